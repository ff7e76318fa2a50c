"""Swap plans (one MiTA setting or dense per attention layer): the file format and its checks,
``swap_attention(plan=...)`` against the unswapped model and against ``--mita-cfg``,
``--mita-plan`` at argument parsing, and the plan carried by ``export_swapped``.

The model is the standard-attention tiny Segmenter of ``conftest.segmenter_ckpt`` (ViT 4 x 64,
patch 8; 2-layer mask head): 6 attention layers.
"""
import argparse
import copy
import json
import os.path as osp
import re

import pytest
import torch
from mmengine.config import Config

from mita_seg import swap_attention
from mita_seg.apis import export_swapped, init_model
from mita_seg.cli import add_mita_args, swap_settings
from mita_seg.models import (MITA_DEFAULTS, MiTAAttention, MiTASetting, PlanError, SwapPlan,
                             attention_layers, current_plan)
from mita_seg.models.plan import PLAN_FORMAT

LAYERS = [f'backbone.layers.{i}.attn' for i in range(4)] + [
    f'decode_head.layers.{i}.attn' for i in range(2)]
MITA = dict(pool_size=4, topk=32)
ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY_MITA = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')


def plan_dict(settings):
    return dict(format=PLAN_FORMAT,
                layers=[dict(name=n, setting=s) for n, s in zip(LAYERS, settings)])


MIXED = ['dense', dict(pool_size=4, topk=16), dict(pool_size=2, topk=8,
         with_shared_expert=False), 'dense', dict(pool_size=4, topk=32), 'dense']


def logits(model, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 128, 96)
    metas = [dict(ori_shape=(128, 96), img_shape=(128, 96), pad_shape=(128, 96))] * 2
    with torch.no_grad():
        return model.inference(x, metas)


@pytest.fixture(scope='module')
def dense_logits(segmenter_ckpt):
    config, ckpt = segmenter_ckpt
    return logits(init_model(config, ckpt))


# -- the format ----------------------------------------------------------------------------
@pytest.mark.parametrize('data, message', [
    ([1, 2], 'not a swap plan'),                                      # not an object
    (dict(format='other/1', layers=[]), "format 'other/1' is not"),   # another format
    (dict(format=PLAN_FORMAT, layers=[]), 'non-empty list'),
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.blocks.0', setting='dense')]),
     "unknown layer 'backbone.blocks.0'"),                            # not <owner>.layers.i.attn
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.layers.0.attn', setting='dense')] * 2),
     'backbone.layers.0.attn is given twice'),
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.layers.0.attn',
                                           setting=dict(topk=0))]),
     'layer backbone.layers.0.attn: topk=0: topk must be an int >= 1'),
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.layers.0.attn',
                                           setting=dict(top_k=3))]),
     "layer backbone.layers.0.attn: unknown MiTA setting 'top_k'"),
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.layers.0.attn', setting='mita')]),
     'setting must be "dense" or an object'),
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.layers.0.attn')]),
     'must be an object with "name" and "setting"'),
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.layers.0.attn', setting='dense',
                                           embed_dims=0)]),
     'layer backbone.layers.0.attn: embed_dims must be an int >= 1'),
    (dict(format=PLAN_FORMAT, layers=[dict(name='backbone.layers.0.attn', setting='dense',
                                           num_heads='3')]),
     "num_heads must be an int >= 1 (the layer's num_heads in the model the plan was made "
     "for), got '3'; remove it"),
], ids=['not-object', 'format', 'empty', 'unknown-layer', 'twice', 'bad-value', 'bad-key',
        'bad-setting', 'no-setting', 'bad-width', 'bad-heads'])
def test_bad_plan_files_name_the_problem(data, message, tmp_path):
    path = tmp_path / 'plan.json'
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match='plan .*plan.json') as e:
        SwapPlan.load(str(path))
    assert message in str(e.value)


def test_plan_round_trips(tmp_path):
    data = plan_dict(MIXED)
    data['layers'][1]['error'] = 0.25                                  # extra keys are kept
    data['budget'] = dict(gflops=1.5)
    plan = SwapPlan.from_dict(data)
    assert plan.layers['backbone.layers.0.attn'] is None
    assert plan.layers['backbone.layers.1.attn'] == MiTASetting(pool_size=4, topk=16)
    # a plan holds whole settings: the file written back names every key of its kind
    full = copy.deepcopy(data)
    for entry in full['layers']:
        if entry['setting'] != 'dense':
            entry['setting'] = {**MITA_DEFAULTS, **entry['setting']}
    assert plan.to_dict() == full
    data = full
    assert SwapPlan.load(plan.save(str(tmp_path / 'p.json'))).to_dict() == data
    with pytest.raises(PlanError, match='not found'):
        SwapPlan.load(str(tmp_path / 'missing.json'))
    (tmp_path / 'bad.json').write_text('{"format": ')
    with pytest.raises(PlanError, match='not a JSON file'):
        SwapPlan.load(str(tmp_path / 'bad.json'))


# -- swap_attention(plan=...) ---------------------------------------------------------------
def test_attention_layers_are_the_plan_names(segmenter_ckpt):
    model = init_model(*segmenter_ckpt)
    assert [n for n, _, _ in attention_layers(model)] == LAYERS


def test_all_dense_plan_is_the_unswapped_model(segmenter_ckpt, dense_logits):
    model = init_model(*segmenter_ckpt)
    keys = list(model.state_dict())
    assert swap_attention(model, plan=SwapPlan.uniform(LAYERS, None)) == 0
    assert not any(isinstance(m, MiTAAttention) for m in model.modules())
    torch.testing.assert_close(logits(model), dense_logits, rtol=0, atol=0)
    # after a swap, the all-dense plan puts back the very modules and parameters
    swap_attention(model, **MITA)
    assert not torch.equal(logits(model), dense_logits)
    swap_attention(model, plan=SwapPlan.uniform(LAYERS, None))
    assert not any(isinstance(m, MiTAAttention) for m in model.modules())
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(logits(model), dense_logits, rtol=0, atol=0)


def test_uniform_plan_is_mita_cfg(segmenter_ckpt):
    config, ckpt = segmenter_ckpt
    # LAYERS: the encoder's and the mask head's
    by_cfg = init_model(config, ckpt, mita_cfg=dict(MITA, include_head=True))
    plan = SwapPlan.uniform(LAYERS, MiTASetting(**MITA))
    by_plan = init_model(config, ckpt, mita_cfg=dict(plan=plan))
    assert repr(by_plan) == repr(by_cfg)
    torch.testing.assert_close(logits(by_plan), logits(by_cfg), rtol=0, atol=0)


def test_mixed_plan_sets_each_layer(segmenter_ckpt, log_records):
    model = init_model(*segmenter_ckpt)
    plan = SwapPlan.from_dict(plan_dict(MIXED), source='mixed.json')
    with log_records() as records:
        assert swap_attention(model, plan=plan) == 3
    assert ('swap_attention: plan mixed.json: 3 attention modules on MiTA (1 x M=4x4 k=16, '
            '1 x M=2x2 k=8 route-only, 1 x M=4x4 k=32), 3 dense') in records.messages
    for name, setting in zip(LAYERS, MIXED):
        attn = model.get_submodule(name)
        if setting == 'dense':
            assert not isinstance(attn, MiTAAttention)
        else:
            assert {k: getattr(attn, k) for k in setting} == setting
            assert attn.router_topk == 1                    # defaults for the rest
    # the backbone as --mita-cfg layers=[i] with each layer's setting makes it
    ref = init_model(*segmenter_ckpt)
    for i, setting in enumerate(MIXED[:4]):
        if setting != 'dense':
            swap_attention(ref, layers=[i], include_head=False, verbose=False, **setting)
    torch.manual_seed(0)
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        torch.testing.assert_close(model.backbone(x), ref.backbone(x), rtol=0, atol=0)


def test_current_plan_reads_the_modules(segmenter_ckpt):
    """What the attention runs with, read back from the modules (tools/test.py prints it):
    the plan a model was set with, and its one-line description."""
    model = init_model(*segmenter_ckpt)
    assert current_plan(model).layers == {n: None for n in LAYERS}
    assert current_plan(model).describe() == ('dense: backbone.layers.0-3.attn, '
                                              'decode_head.layers.0-1.attn')
    plan = SwapPlan.from_dict(plan_dict(MIXED))
    swap_attention(model, plan=plan, verbose=False)
    now = current_plan(model)
    for name, setting in zip(LAYERS, MIXED):
        if setting == 'dense':
            assert now.layers[name] is None
        else:   # every MiTA setting, those the plan leaves out at their defaults
            assert now.layers[name] == MiTASetting(**setting)
    assert now.describe() == plan.describe()
    text = now.describe()
    assert text.count('dense: ') == 1 and 'route-only' in text and 'router_topk' not in text


def test_plan_for_another_model(segmenter_ckpt):
    model = init_model(*segmenter_ckpt)
    # a plan of another layer count: a plan for another model
    plan = SwapPlan.from_dict(plan_dict(MIXED[:5]), source='other.json')
    with pytest.raises(PlanError, match='plan other.json is for a model with 5 attention '
                       r'layers; SlimEncoderDecoder has 6 \(backbone.layers.0-3.attn, '
                       r'decode_head.layers.0-1.attn\)'):
        swap_attention(model, plan=plan)
    # same count, a layer the model does not have
    data = plan_dict(MIXED)
    data['layers'][5]['name'] = 'decode_head.layers.7.attn'
    with pytest.raises(PlanError, match='names layer decode_head.layers.7.attn, which '
                       'SlimEncoderDecoder does not have'):
        swap_attention(model, plan=SwapPlan.from_dict(data))
    # a plan and settings at once
    with pytest.raises(ValueError, match='give a plan or settings'):
        swap_attention(model, plan=SwapPlan.from_dict(plan_dict(MIXED)), topk=3)


def shaped(data, embed_dims=64, num_heads=2, **model):
    """The plan file ``data`` with each layer's shape, and ``model`` as its ``model``."""
    data = copy.deepcopy(data)
    for entry in data['layers']:
        entry.update(embed_dims=embed_dims, num_heads=num_heads)
    if model:
        data['model'] = model
    return data


def test_a_plan_checks_the_shapes_of_its_model(segmenter_ckpt, tmp_path, log_records):
    """A plan records its model's layer shapes (embed_dims, num_heads): another model with
    the same layer names (ViT-T's plan on ViT-B) is refused, naming both; a plan that
    records none (written before, or by hand) is still applied, checked by its names, and
    says so once."""
    config, ckpt = segmenter_ckpt
    model = init_model(config, ckpt)
    # the shapes of this model (64 wide, 2 heads): applied, as without them
    plan = SwapPlan.from_dict(shaped(plan_dict(MIXED)), source='ours.json')
    assert plan.shapes()['backbone.layers.0.attn'] == dict(embed_dims=64, num_heads=2)
    assert plan.to_dict()['layers'][0]['embed_dims'] == 64           # kept when written
    with log_records() as records:
        assert swap_attention(model, plan=plan) == 3
    assert not any('records no shapes' in m for m in records.messages)
    # another width, or the same width and other heads: a plan for another model
    vitt = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
    for data, differs in [(shaped(plan_dict(MIXED), 192, 3, config=vitt),
                           'embed_dims 192 and num_heads 3; in SlimEncoderDecoder '
                           r'\(segmenter_vit-tiny_tiny-ade20k-128x128.py\) it has embed_dims '
                           '64 and num_heads 2'),
                          (shaped(plan_dict(MIXED), 64, 4), 'embed_dims 64 and num_heads 4; '
                           'in SlimEncoderDecoder .* it has embed_dims 64 and num_heads 2')]:
        made_for = re.escape(vitt) if 'model' in data else 'another model'
        with pytest.raises(PlanError, match=f'plan other.json was made for {made_for}, whose '
                           f'backbone.layers.0.attn has {differs}: a plan for another model. '
                           'Calibrate one for this model with tools/calibrate_swap.py'):
            swap_attention(model, plan=SwapPlan.from_dict(data, source='other.json'))
    # the model is left as it was
    assert current_plan(model).layers == plan.layers
    # a plan that records no shapes: checked by its names, and, from a file, said once
    old = str(tmp_path / 'old.json')
    with open(old, 'w') as f:
        json.dump(dict(plan_dict(MIXED), model=dict(config=vitt)), f)
    old_plan = SwapPlan.load(old)
    with log_records() as records:
        swap_attention(model, plan=old_plan, verbose=False)
        swap_attention(model, plan=old_plan, verbose=False)
        swap_attention(model, plan=SwapPlan.from_dict(plan_dict(MIXED)), verbose=False)
    noted = [m for m in records.messages if 'records no shapes' in m]
    assert noted == [f'plan {old} (made for {vitt}) records no shapes of its layers (written '
                     'before plans recorded them, or by hand): checked against '
                     'SlimEncoderDecoder by its layer names only. Calibrate it again '
                     '(tools/calibrate_swap.py) to have it checked'], records.messages


@pytest.mark.slow   # the tool on mmseg's ViT-B (meta device), ~15 s; the check itself: above
def test_get_flops_refuses_a_plan_for_another_model(tools, tmp_path):
    """The reviewer's case: a plan for Segmenter ViT-T counted on Segmenter ViT-B (the same
    14 layer names) is one error line naming both, exit 1; on ViT-T it is counted."""
    vitt = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
    names = [f'backbone.layers.{i}.attn' for i in range(12)] + [
        f'decode_head.layers.{i}.attn' for i in range(2)]
    data = dict(format=PLAN_FORMAT, model=dict(config=vitt),
                layers=[dict(name=n, setting=dict(pool_size=7, topk=49), embed_dims=192,
                             num_heads=3) for n in names])
    path = tmp_path / 'plan_vitt.json'
    path.write_text(json.dumps(data))
    code, log = tools('tools/get_flops.py', vitt.replace('vit-t', 'vit-b'), '--mita-plan', path,
                      '--device', 'meta', check=False)
    assert code == 1 and 'Traceback' not in log, log
    errors = [line for line in log.splitlines() if line.startswith('error:')]
    assert errors == [f'error: plan {path} was made for {vitt}, whose backbone.layers.0.attn '
                      'has embed_dims 192 and num_heads 3; in EncoderDecoder it has embed_dims '
                      '768 and num_heads 12: a plan for another model. Calibrate one for this '
                      'model with tools/calibrate_swap.py'], log
    tools('tools/get_flops.py', vitt, '--mita-plan', path, '--device', 'meta')


def test_dense_in_a_mita_config():
    from mita_seg.analysis.segmentor_cost import build_segmentor
    from mita_seg.models import use_dense
    # a MiTA backbone builds mmseg's layers, then swaps them: dense puts them back
    model = build_segmentor(Config.fromfile(TINY_MITA))        # MiTAVisionTransformer
    names = [n for n, _, _ in attention_layers(model)]
    assert swap_attention(model, plan=SwapPlan.uniform(names, None)) == 0
    assert not any(isinstance(m, MiTAAttention) for m in model.modules())
    # a MiTAAttention built as such has no standard attention to go back to
    owner = torch.nn.Module()
    owner.layers = torch.nn.ModuleList([torch.nn.Module()])
    owner.layers[0].attn = MiTAAttention(64, 2)
    with pytest.raises(ValueError, match='layer 0 of Module was built on MiTA, not swapped'):
        use_dense(owner, [0])


# -- --mita-plan ----------------------------------------------------------------------------
def parse(argv, **kwargs):
    p = argparse.ArgumentParser()
    add_mita_args(p, **kwargs)
    return swap_settings(p, p.parse_args(argv))


def test_mita_plan_argument(tmp_path, capsys):
    path = str(tmp_path / 'plan.json')
    SwapPlan.from_dict(plan_dict(MIXED)).save(path)
    got = parse(['--mita-plan', path])
    assert list(got) == ['plan'] and got['plan'].source == path
    assert got['plan'].layers['backbone.layers.1.attn'] == MiTASetting(pool_size=4, topk=16)
    assert parse(['--mita-plan', path], swap_flag=False)['plan'].layers == got['plan'].layers
    # a bad file, or a plan with --mita-cfg or --swap-attn none: usage errors (exit 2)
    (tmp_path / 'bad.json').write_text(json.dumps(plan_dict(['dense', dict(topk=0)])))
    for argv, message in [
            (['--mita-plan', str(tmp_path / 'bad.json')],
             'argument --mita-plan: plan .*bad.json: layer backbone.layers.1.attn: topk=0'),
            (['--mita-plan', str(tmp_path / 'none.json')], 'plan .*none.json not found'),
            (['--mita-plan', path, '--mita-cfg', 'topk=3'], 'give --mita-plan or --mita-cfg'),
            (['--mita-plan', path, '--swap-attn', 'none'], '--mita-plan needs --swap-attn')]:
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2
        assert re.search(message, capsys.readouterr().err), argv


# -- export_swapped -------------------------------------------------------------------------
def test_export_carries_the_plan(segmenter_ckpt, tmp_path):
    config, ckpt = segmenter_ckpt
    plan = SwapPlan.from_dict(plan_dict(MIXED), source='mixed.json')
    out_cfg, out_ckpt = export_swapped(config, ckpt, str(tmp_path), dict(plan=plan))
    cfg = Config.fromfile(out_cfg)
    assert cfg.model.backbone.type == 'MiTAVisionTransformer'
    full = [s if s == 'dense' else {**MITA_DEFAULTS, **s} for s in MIXED]   # whole settings
    assert cfg.model.backbone.mita_layer_cfgs == [None, full[1], full[2], None]
    assert cfg.model.decode_head.mita_layer_cfgs == [full[4], None]
    meta = torch.load(out_ckpt, weights_only=True)['meta']
    assert meta['mita_plan'] == plan.to_dict()
    exported = init_model(out_cfg, out_ckpt)                                  # strict
    swapped = init_model(config, ckpt, mita_cfg=dict(plan=plan))
    assert repr(exported).count('MiTAAttention') == 3
    assert list(exported.state_dict()) == list(swapped.state_dict())
    torch.testing.assert_close(logits(exported), logits(swapped), rtol=0, atol=0)
    # the same plan on the exported model changes nothing
    swap_attention(exported, plan=plan)
    torch.testing.assert_close(logits(exported), logits(swapped), rtol=0, atol=0)
    # a plan for another model is refused before anything is written
    other = SwapPlan.from_dict(plan_dict(MIXED[:4]), source='other.json')
    with pytest.raises(PlanError, match='is for a model with 4 attention layers'):
        export_swapped(config, ckpt, str(tmp_path / 'other'), dict(plan=other))
    # and one with this model's layer names, made for another width
    other = SwapPlan.from_dict(shaped(plan_dict(MIXED), 192, 3), source='other.json')
    with pytest.raises(PlanError, match='embed_dims 192 and num_heads 3; in .* it has '
                       'embed_dims 64 and num_heads 2: a plan for another model'):
        export_swapped(config, ckpt, str(tmp_path / 'other'), dict(plan=other))
    assert not osp.exists(tmp_path / 'other')


def test_export_with_a_dense_head_runs_and_reexports_as_evaluated(segmenter_ckpt, tmp_path):
    """A plan that keeps every head layer dense (as calibrated plans do) exports to a model
    that runs; exporting that MiTA config again with single keys gives what
    ``tools/test.py --mita-cfg`` evaluates on it, not the old plan."""
    config, ckpt = segmenter_ckpt
    plan = SwapPlan.from_dict(plan_dict([dict(pool_size=2, topk=8)] + ['dense'] * 5))
    out_cfg, out_ckpt = export_swapped(config, ckpt, str(tmp_path / 'a'), dict(plan=plan))
    exported = init_model(out_cfg, out_ckpt)
    torch.testing.assert_close(logits(exported),
                               logits(init_model(config, ckpt, mita_cfg=dict(plan=plan))),
                               rtol=0, atol=0)
    again_cfg, again_ckpt = export_swapped(out_cfg, out_ckpt, str(tmp_path / 'b'),
                                           dict(topk=4))
    evaluated = init_model(out_cfg, out_ckpt, mita_cfg=dict(topk=4))
    again = init_model(again_cfg, again_ckpt)
    assert current_plan(again).layers == current_plan(evaluated).layers
    assert current_plan(again).layers['backbone.layers.0.attn'].topk == 4
    torch.testing.assert_close(logits(again), logits(evaluated), rtol=0, atol=0)


def test_the_plan_as_it_ran_and_a_tta_model(segmenter_ckpt):
    """``current_plan(model, ran=True)``: what the forwards ran with (a 4 x 4 grid runs
    7:49 as M=4x4, every key); a plan swaps the model inside a TTA wrapper (--tta)."""
    from mmseg.models import SegTTAModel

    from mita_seg.apis.model import swap_model
    config, ckpt = segmenter_ckpt
    model = init_model(config, ckpt, mita_cfg='7:49')
    assert current_plan(model, ran=True).describe() == current_plan(model).describe()
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32), mode='tensor')             # 4 x 4 patches, N = 17
    ran = current_plan(model, ran=True).layers['backbone.layers.0.attn']
    assert (ran.pool, ran.topk) == ((4, 4), 17)
    assert current_plan(model).layers['backbone.layers.0.attn'].pool == (7, 7)
    plan = SwapPlan.from_dict(plan_dict(MIXED))
    tta = SegTTAModel(module=init_model(config, ckpt))
    assert swap_model(tta, dict(plan=plan), verbose=False) == 3
    assert current_plan(tta.module).layers == plan.layers


def test_reexport_of_a_dwc_config_keeps_its_dwc_layers(tmp_path):
    """A MiTA config trained with the DWC branch, exported with ``layers=[0]`` and ``topk``:
    the layers the swap leaves as configured keep their DWC weights (the config carries the
    plan, each layer's ``with_dwc``), and the export is what test.py evaluates."""
    dwc = {'model.backbone.mita_cfg.with_dwc': True}
    model = init_model(TINY_MITA, cfg_options=dwc)
    ckpt = str(tmp_path / 'dwc.pth')
    torch.save({'meta': {}, 'state_dict': model.state_dict()}, ckpt)
    out_cfg, out_ckpt = export_swapped(TINY_MITA, ckpt, str(tmp_path / 'out'),
                                       dict(layers=[0], topk=4), cfg_options=dwc)
    exported = init_model(out_cfg, out_ckpt)
    evaluated = init_model(TINY_MITA, ckpt, cfg_options=dwc, mita_cfg=dict(layers=[0], topk=4))
    assert current_plan(exported).layers == current_plan(evaluated).layers
    assert all(layer.attn.dwc is not None for layer in exported.backbone.layers)
    torch.testing.assert_close(logits(exported), logits(evaluated), rtol=0, atol=0)
