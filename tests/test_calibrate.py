"""The calibrated swap: the knapsack against brute force, the calibration of the tiny
Segmenter (``conftest.segmenter_ckpt``: 6 attention layers, 8 training images of 128x128),
its plans' FLOPs as ``tools/get_flops.py`` counts them, determinism, a MiTA config (calibrated
against its dense model), bad input, and ``tools/calibrate_swap.py`` end to end.
"""
import itertools
import json
import os
import os.path as osp
import re

import numpy as np
import pytest
import torch
from mmengine.config import Config

from mita_seg.analysis.segmentor_cost import SegmentorFlops
from mita_seg.apis import CalibrationError, SwapCalibrator, export_swapped, init_model
from mita_seg.apis.calibrate import choose
from mita_seg.models import MiTAAttention, SwapPlan, current_plan

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY_MITA = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')

# a few candidates keep it short: dense, two with the shared expert, one route-only, and
# route-only with every key (softmax attention: no error)
CANDIDATES = ['dense', '4:16', '2:8', '4:32:route', '2:100000:route']


def brute_force(costs, flops, capacity):
    best, arg = np.inf, None
    for choice in itertools.product(*[range(costs.shape[1])] * costs.shape[0]):
        f = sum(flops[i, c] - flops[i].min() for i, c in enumerate(choice))
        e = sum(costs[i, c] for i, c in enumerate(choice))
        if f <= capacity and e < best:
            best, arg = e, choice
    return best, arg


@pytest.mark.parametrize('seed', range(6))
def test_knapsack_is_optimal(seed):
    rng = np.random.default_rng(seed)
    costs = rng.random((4, 4))
    flops = rng.integers(0, 50, (4, 4))
    capacity = int(rng.integers(0, 120))
    best, _ = brute_force(costs, flops, capacity)
    choice = choose(costs, flops, capacity)                      # unit 1: exact
    assert sum(costs[i, c] for i, c in enumerate(choice)) == pytest.approx(best)
    # with few bins the weights are rounded up: still within the capacity, never better
    coarse = choose(costs, flops, capacity, bins=7)
    assert sum(flops[i, c] - flops[i].min() for i, c in enumerate(coarse)) <= capacity
    assert sum(costs[i, c] for i, c in enumerate(coarse)) >= best - 1e-12


@pytest.fixture(scope='module')
def calibrated(segmenter_ckpt):
    config, ckpt = segmenter_ckpt
    cal = SwapCalibrator(config, ckpt, images=4, candidates=CANDIDATES, seed=0)
    cal.errors()
    return cal


def test_calibration_measures(calibrated, tiny_data):
    cal = calibrated
    assert cal.layers[0] == 'backbone.layers.0.attn' and len(cal.layers) == 6
    errors, flops = cal.errors(), cal.flops()
    assert errors.shape == flops.shape == (6, 5)
    assert (errors[:, 0] == 0).all()                  # dense
    assert (errors[:, 1:4] > 1e-6).all()              # MiTA changes the logits
    assert errors[:, 4].max() < 1e-6                   # route-only with every key: softmax
    assert (flops[:, 1:4] < flops[:, [0]]).all()       # cheaper than dense at N = 257
    # the images come from the training split, through the test pipeline
    assert len(cal.image_paths) == 4
    assert all(osp.join('images', 'training') in p for p in cal.image_paths)


def test_plans_fit_their_budget_as_get_flops_counts(calibrated, segmenter_ckpt):
    cal = calibrated
    config, _ = segmenter_ckpt
    dense = cal.dense_flops
    counter = SegmentorFlops(Config.fromfile(config), None)
    assert counter.count((128, 128))[0].total == dense
    for reduction in (0.1, 0.25):
        plan = cal.plan(reduction=reduction)
        budget = int(dense * (1 - reduction))
        counted = SegmentorFlops(Config.fromfile(config), dict(plan=plan)).count((128, 128))[1]
        assert counted.total == round(plan.info['flops']['plan_gflops'] * 1e9)
        assert counted.total <= budget
        assert plan.info['budget']['gflops'] == budget / 1e9
    # no reduction: every layer dense; the cheapest budget: every layer on its cheapest
    assert all(s is None for s in cal.plan(reduction=0).layers.values())
    cheapest = cal.plan(budget_gflops=cal.cheapest_flops() / 1e9)
    assert cheapest.info['flops']['plan_gflops'] * 1e9 == pytest.approx(cal.cheapest_flops())
    # the uniform setting's FLOPs as a budget: the plan's predicted error is at most its own
    uniform = cal.uniform_gflops('4:16')
    plan = cal.plan(budget_gflops=uniform)
    assert plan.info['flops']['plan_gflops'] <= uniform
    assert plan.info['calibration']['predicted_error'] <= cal.errors()[:, 1].sum() + 1e-12


def test_calibration_is_deterministic(calibrated, segmenter_ckpt):
    config, ckpt = segmenter_ckpt
    # again, running every layer instead of replaying the dense ones before the swapped one:
    # the same errors, bit for bit
    again = SwapCalibrator(config, ckpt, images=4, candidates=CANDIDATES[:2], seed=0,
                           replay=False)
    np.testing.assert_array_equal(again.errors(), calibrated.errors()[:, :2])
    np.testing.assert_array_equal(again.flops(), calibrated.flops()[:, :2])
    assert again.image_paths == calibrated.image_paths
    twice = SwapCalibrator(config, ckpt, images=4, candidates=CANDIDATES[:2], seed=0)
    a, b = again.plan(reduction=0.05).to_dict(), twice.plan(reduction=0.05).to_dict()
    for d in (a, b):
        d['calibration'].pop('seconds')
    assert a == b and any(layer['setting'] != 'dense' for layer in a['layers'])
    other = SwapCalibrator(config, ckpt, images=4, candidates=['dense', '2:8'], seed=1)
    other._batches()
    assert other.image_paths != calibrated.image_paths


def test_a_plan_among_some_candidates_is_theirs_alone(calibrated, segmenter_ckpt):
    """One calibrator measures every candidate once; a plan among some of them (the
    MiTA-only plan of a calibrator that also measured other kinds) is the plan of a
    calibrator of those alone: same choice, same FLOPs, same predicted error."""
    config, ckpt = segmenter_ckpt
    alone = SwapCalibrator(config, ckpt, images=4, candidates=CANDIDATES[:2], seed=0)
    for budget in (dict(reduction=0.05), dict(budget_uniform='4:16')):
        a, b = calibrated.plan(**budget, among=CANDIDATES[1:2]), alone.plan(**budget)
        assert a.layers == b.layers and any(s is not None for s in a.layers.values())
        assert a.info['flops'] == b.info['flops']
        assert a.info['calibration']['predicted_error'] == pytest.approx(
            b.info['calibration']['predicted_error'], abs=0)
        assert a.info['calibration']['candidates'] == ['dense', '4:16']
    # among every candidate: the plan as without among
    assert calibrated.plan(reduction=0.1, among=CANDIDATES).layers == \
        calibrated.plan(reduction=0.1).layers
    # a candidate that was not measured cannot be chosen
    with pytest.raises(CalibrationError, match="'7:49' is not one of the candidates .*: a "
                       'plan chooses among the measured candidates'):
        calibrated.plan(reduction=0.1, among=['7:49'])
    # a budget that every candidate meets but not those it may choose (2:8 is cheaper)
    with pytest.raises(CalibrationError, match=r'below the cheapest plan of the candidates it '
                       r'may choose \(dense 4:16: .* GFLOPs\)'):
        calibrated.plan(budget_gflops=calibrated.cheapest_flops() / 1e9, among=['4:16'])


def test_a_mita_config_is_calibrated_against_its_dense_model(calibrated, segmenter_ckpt,
                                                             tmp_path):
    """A MiTA config (the tiny Segmenter exported on MiTA, encoder and head: the same
    weights) is calibrated against its dense model: the very errors, FLOPs and plans of the
    standard-attention config, and it says so."""
    config, ckpt = segmenter_ckpt
    mita_config, mita_ckpt = export_swapped(config, ckpt, str(tmp_path), dict(
        pool_size=2, topk=8, include_head=True))
    assert all(isinstance(init_model(mita_config, mita_ckpt).get_submodule(n), MiTAAttention)
               for n in calibrated.layers)
    lines = []
    cal = SwapCalibrator(mita_config, mita_ckpt, images=4, candidates=CANDIDATES[:2], seed=0,
                         progress=lines.append)
    # the model measured is the dense one
    assert all(s is None for s in current_plan(cal.model).layers.values())
    assert cal.config_attention == 'M=2x2 k=8: backbone.layers.0-3.attn, ' \
        'decode_head.layers.0-1.attn'
    assert lines[0] == (f'config {mita_config} runs 6 layers: 6 on MiTA, 0 dense (M=2x2 k=8: '
                        'backbone.layers.0-3.attn, decode_head.layers.0-1.attn): calibrating '
                        'against its dense model, the same weights with every attention '
                        'layer on standard attention (MiTA has no parameters)')
    np.testing.assert_array_equal(cal.errors(), calibrated.errors()[:, :2])
    np.testing.assert_array_equal(cal.flops(), calibrated.flops()[:, :2])
    plan = cal.plan(reduction=0.05)
    assert plan.layers == calibrated.plan(reduction=0.05, among=CANDIDATES[:2]).layers
    assert plan.info['model']['config_attention'] == cal.config_attention
    # the standard-attention config's plan says nothing of it
    assert 'config_attention' not in calibrated.plan(reduction=0.05).info['model']
    assert calibrated.config_attention is None


def test_a_mita_config_with_dwc_is_refused(tmp_path):
    """The DWC branch is trained parameters dense attention does not have: there is no
    dense model to calibrate against."""
    dwc = {'model.backbone.mita_cfg.with_dwc': True}
    ckpt = str(tmp_path / 'dwc.pth')
    torch.save({'meta': {}, 'state_dict': init_model(TINY_MITA, cfg_options=dwc).state_dict()},
               ckpt)
    with pytest.raises(CalibrationError, match=f'config {re.escape(TINY_MITA)} builds 4 '
                       r'attention layers on MiTA with the DWC branch \(backbone.layers.0.attn'
                       r'...\): trained parameters dense attention does not have, so the '
                       'config has no dense model to calibrate against; calibrate the '
                       'standard-attention config'):
        SwapCalibrator(TINY_MITA, ckpt, images=1, candidates=['dense', '2:8'], cfg_options=dwc)


def test_plans_record_their_model(calibrated):
    """Each layer's shape in the model the plan is for (SwapPlan.check_fits reads them)."""
    plan = SwapPlan.from_dict(calibrated.plan(reduction=0.1).to_dict())
    assert plan.shapes() == {n: dict(embed_dims=64, num_heads=2) for n in calibrated.layers}


def test_flops_counted_without_a_crop_size_say_where_the_shape_is_from(segmenter_ckpt):
    """A config with no crop size is counted at get_flops.py's 512x512, and says so."""
    config, ckpt = segmenter_ckpt
    cfg = Config.fromfile(config)
    cfg.crop_size = None                     # and model.test_cfg has none (mode='whole')
    lines = []
    cal = SwapCalibrator(cfg, ckpt, images=1, candidates=['dense', '2:8'], progress=lines.append)
    cal.flops()
    assert cal.shape == (512, 512)
    note = "512x512 (the config sets no crop size: tools/get_flops.py's default)"
    assert f'counted at {note}: dense ' in lines[-1], lines
    plan = cal.plan(reduction=0)
    assert plan.info['budget']['counted'].startswith(f'one {note.replace(" (", " crop (")}, ')


def test_bad_budgets(calibrated):
    cal = calibrated
    dense, cheapest = cal.dense_flops / 1e9, cal.cheapest_flops() / 1e9
    # above the dense model's cost
    with pytest.raises(CalibrationError, match=r"budget .* GFLOPs is above the dense model's "
                       r'cost \(.* GFLOPs at 128x128\)'):
        cal.plan(budget_gflops=dense * 1.01)
    # below the cheapest plan of the candidates
    with pytest.raises(CalibrationError, match=r'reduction 0.99 is below the cheapest plan '
                       r'of the candidates \(.* GFLOPs at 128x128, .*% below dense\): give at '
                       'least that, or add cheaper --candidates'):
        cal.plan(reduction=0.99)
    with pytest.raises(CalibrationError, match='below the cheapest'):
        cal.plan(budget_gflops=cheapest * 0.99)
    with pytest.raises(ValueError, match='give one of reduction, budget_gflops and '
                       'budget_uniform'):
        cal.plan()
    # the FLOPs of a uniform setting that is not a candidate
    with pytest.raises(CalibrationError, match="'7:49' is not one of the candidates"):
        cal.plan(budget_uniform='7:49')


def test_empty_training_split(segmenter_ckpt, tmp_path):
    config, ckpt = segmenter_ckpt
    os.makedirs(tmp_path / 'empty')
    cal = SwapCalibrator(config, ckpt, images=2, candidates=['dense', '2:8'], cfg_options={
        'train_dataloader.dataset.data_prefix.img_path': str(tmp_path / 'empty')})
    with pytest.raises(CalibrationError, match='the training split of the config .* has no '
                       'images: calibration draws its images from the training split'):
        cal.errors()


def test_budget_uniform_dense_is_refused_by_name(segmenter_ckpt, tools, tmp_path):
    # (its value None counted as absent: "one of the arguments ... is required")
    config, ckpt = segmenter_ckpt
    code, log = tools('tools/calibrate_swap.py', config, ckpt, '--budget-uniform', 'dense',
                      '--out', tmp_path / 'x.json', check=False)
    assert code == 2 and log.strip().splitlines()[-1] == (
        "error: --budget-uniform dense: every layer dense costs the dense model's FLOPs, and "
        'the plan for that budget is dense everywhere: give --reduction 0 for it, or a setting '
        'such as 7:49 or agent:7'), log


def test_calibrate_swap_help_names_every_kind(tools):
    # the candidates are settings of any kind, and dense, mixed in one plan: not MiTA's alone
    _, out = tools('tools/calibrate_swap.py', '--help')
    flat = ' '.join(out.split())
    assert 'Per-layer attention settings (dense, MiTA or another kind)' in flat, out
    candidates = flat[flat.index('candidate settings of every layer'):].split('--seed')[0]
    for spelling in ('dense', '7:49', '7:49:route', 'agent:7', 'block:8:4', 'topk:49',
                     'window:7'):
        assert spelling in candidates, candidates
    assert 'MiTA settings' not in flat, out


@pytest.mark.slow
def test_calibrate_swap_tool(segmenter_ckpt, tools, tmp_path):
    config, ckpt = segmenter_ckpt
    out = str(tmp_path / 'plan.json')
    _, log = tools('tools/calibrate_swap.py', config, ckpt, '--reduction', 0.2, '--images', 2,
                   '--candidates', 'dense', '4:16', '2:8:route', '--out', out)
    assert '[calibrate_swap] layer 6/6 decode_head.layers.1.attn: error' in log
    assert re.search(r'layer +setting +error \(KL\) +GFLOPs', log) and 'wrote ' + out in log
    plan = SwapPlan.load(out)
    data = json.load(open(out))
    assert data['budget']['reduction'] == 0.2 and len(data['calibration']['images']) == 2
    assert data['flops']['plan_gflops'] <= data['budget']['gflops']
    assert all('error' in layer for layer in data['layers'])
    # the plan in the tools: get_flops counts what the plan says, test.py evaluates it,
    # the exported pair gives the same mIoU
    _, log = tools('tools/get_flops.py', config, '--mita-plan', out)
    total = float([line.split()[-2] for line in log.splitlines()
                   if line.startswith('total (GFLOPs)')][0])
    assert total == pytest.approx(data['flops']['plan_gflops'], abs=5e-3)
    assert f'plan {out} ({plan.summary()})' in log
    _, log = tools('tools/test.py', config, ckpt, '--mita-plan', out, '--work-dir', tmp_path / 't')
    miou = tools.miou(log)
    _, log = tools('tools/export_swapped.py', config, ckpt, '--mita-plan', out, '--out-dir',
                   tmp_path / 'ex')
    pair = [line.split()[1] for line in log.splitlines() if line.startswith('wrote ')]
    _, log = tools('tools/test.py', *pair, '--work-dir', tmp_path / 'e')
    assert tools.miou(log) == miou
    # bad input: one line each
    code, log = tools('tools/calibrate_swap.py', config, ckpt, '--budget-gflops', 1000,
                      '--images', 1, '--candidates', 'dense', '2:8', '--out',
                      tmp_path / 'x.json', check=False)
    assert code == 1 and "error: budget 1000 GFLOPs is above the dense model's cost" in log
    assert 'Traceback' not in log and not osp.exists(tmp_path / 'x.json')
    code, log = tools('tools/calibrate_swap.py', config, ckpt, '--reduction', 0.2,
                      '--candidates', '7:0', '--out', tmp_path / 'x.json', check=False)
    assert code == 2 and "MiTA setting '7:0': write P:K" in log and 'or dense' in log
    other = SwapPlan.from_dict(dict(plan.to_dict(), layers=plan.to_dict()['layers'][:4]))
    other.save(str(tmp_path / 'other.json'))
    code, log = tools('tools/test.py', config, ckpt, '--mita-plan', tmp_path / 'other.json',
                      '--work-dir', tmp_path / 'o', check=False)
    assert code == 1 and 'is for a model with 4 attention layers; SlimEncoderDecoder has 6' in log
    assert 'Traceback' not in log
