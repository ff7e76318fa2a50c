"""The swap workflows end to end on the tiny ADE20K data: ``tools/test.py --swap-attn mita``,
``tools/swap_sweep.py``, ``tools/export_swapped.py``, ``tools/analyze_token_selection.py``
(run as users run them), and the token-selection analysis they rest on.

The checkpoint is the standard-attention tiny Segmenter of ``conftest.segmenter_ckpt``
(ViT 4 x 64, patch 8; 2-layer mask head), evaluated on 4 images.
"""
import csv
import json
import os.path as osp
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.hub import get_config
from mmseg.models.backbones import VisionTransformer
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from mita_seg import swap_attention
from mita_seg.analysis.token_selection import (TokenSelectionRecorder, plot_selection_overlay,
                                               selection_from_qk)
from mita_seg.apis import export_swapped, init_model, mita_config
from mita_seg.models import NothingToSwapError
from mita_seg.ops import mita_attention

register_all_modules()
ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
SWIN = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
MITA = dict(pool_size=4, topk=32)        # 16 experts of 32 keys over a 16x16 grid
# route-only MiTA with every key is softmax attention: the unswapped model's outputs
EXACT = ['pool_size=2', 'topk=100000', 'with_shared_expert=False']


@pytest.mark.slow
def test_test_py_swap_attn_mita(segmenter_ckpt, tools, tmp_path):
    config, ckpt = segmenter_ckpt
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'base',
                   '--out', tmp_path / 'base_pred')
    base = tools.miou(out)
    assert 'on MiTA' not in out and 'per class results' not in out  # short console
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'exact',
                   '--out', tmp_path / 'exact_pred', '--mita-cfg', *EXACT)
    assert 'swap_attention: 4 attention modules on MiTA' in out    # the encoder's 4
    assert tools.miou(out) == base
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'mita',
                   '--out', tmp_path / 'mita_pred', '--swap-attn', 'mita', '--mita-cfg',
                   'pool_size=4', 'topk=32')
    assert "4 attention modules on MiTA ({'pool_size': 4, 'topk': 32, 'router_topk': 1" in out
    assert re_summary(out, 4)
    # the predictions, pixel by pixel (an mIoU can hide a swap that changed nothing): the
    # exact setting's are the unswapped model's, MiTA's with 32 of 256 keys are not
    base_pred, exact_pred, mita_pred = (predictions(tmp_path / f'{run}_pred')
                                        for run in ('base', 'exact', 'mita'))
    assert len(base_pred) == 4 and exact_pred.keys() == base_pred.keys() == mita_pred.keys()
    assert all((exact_pred[name] == base_pred[name]).all() for name in base_pred)
    changed = sum(int((mita_pred[name] != base_pred[name]).sum()) for name in base_pred)
    assert changed > 0, 'the MiTA swap left every predicted pixel as it was'
    # the mask head (2 layers) too, on request
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'head',
                   '--mita-cfg', 'pool_size=4', 'topk=32', 'include_head=True')
    assert re_summary(out, 6)


def predictions(out_dir) -> dict:
    """``{file name: class map}`` of the PNGs ``tools/test.py --out`` wrote."""
    import glob

    import numpy as np
    from PIL import Image
    return {osp.basename(f): np.asarray(Image.open(f))
            for f in sorted(glob.glob(osp.join(out_dir, '**', '*.png'), recursive=True))}


def re_summary(out, swapped):
    """The tool's last line before the log path: images, swap, metrics."""
    import re
    return re.search(rf'on 4 images, {swapped} attention modules on MiTA: aAcc: [\d.]+  '
                     r'mIoU: [\d.]+  mAcc: [\d.]+', out)


@pytest.mark.slow
def test_swap_sweep(segmenter_ckpt, tools, tmp_path):
    config, ckpt = segmenter_ckpt
    # --swap-attn read as every tool reads it: one more row, --mita-cfg's keys over it
    _, out = tools('tools/swap_sweep.py', config, ckpt, '--pool-sizes', 2, 4, '--topks', 8,
                   100000, '--mita-cfg', 'with_shared_expert=False', 'include_head=True',
                   '--swap-attn', '3:8', '--work-dir',
                   tmp_path / 'work', '--out', tmp_path / 'sweep.md', '--plot',
                   tmp_path / 'sweep.png')
    with open(tmp_path / 'sweep.csv') as f:
        rows = list(csv.DictReader(f))
    # k at least N: every key, and the label says so (and that the experts are route-only)
    assert [r['setting'] for r in rows] == [
        'baseline', 'MiTA M=2x2 k=8 route-only', 'MiTA M=2x2 k=100000 (every key) route-only',
        'MiTA M=4x4 k=8 route-only', 'MiTA M=4x4 k=100000 (every key) route-only',
        'MiTA M=3x3 k=8 route-only']
    assert [r['kind'] for r in rows] == ['baseline'] + ['swap'] * 5
    rows = [{k: (float(v) if k not in ('setting', 'kind', 'M', 'topk') else v)
             for k, v in r.items()} for r in rows]
    base = rows[0]
    for r in rows[1:]:
        if r['topk'] == '100000':   # route-only with every key: softmax attention, same mIoU
            assert r['mIoU'] == pytest.approx(base['mIoU'], abs=1e-6)
        else:
            # 8 of 256 keys: not the unswapped model (a sweep that swapped nothing would be)
            assert r['mIoU'] != base['mIoU'], r
            assert r['attn_GMACs'] < base['attn_GMACs'] / 2
            assert r['attn_reduction_%'] > 50
            # the whole-model trace saves what the analytic attention count saves
            assert base['model_GFLOPs'] - r['model_GFLOPs'] == pytest.approx(
                base['attn_GMACs'] - r['attn_GMACs'], rel=0.01)
    # no ToMe: no merge_ratio column
    assert (tmp_path / 'sweep.md').read_text().startswith('| setting | kind | M | topk | mIoU')
    assert (tmp_path / 'sweep.png').stat().st_size > 10000
    assert f'MiTA M=2x2 k=100000 (every key) route-only{base["mIoU"]:8.2f}   +0.00' in out


@pytest.mark.slow
def test_export_swapped_pair_loads_strictly_and_matches_swap(segmenter_ckpt, tools, tmp_path):
    config, ckpt = segmenter_ckpt
    _, out = tools('tools/export_swapped.py', config, ckpt, '--out-dir', tmp_path,
                   '--mita-cfg', 'pool_size=4', 'topk=32')
    out_cfg = str(tmp_path / (osp.splitext(osp.basename(config))[0] + '_mita.py'))
    out_ckpt = str(tmp_path / (osp.splitext(osp.basename(ckpt))[0] + '_mita.pth'))
    assert f'wrote {out_cfg}\nwrote {out_ckpt}' in out

    cfg = Config.fromfile(out_cfg)
    assert cfg.model.backbone.type == 'MiTAVisionTransformer'
    assert cfg.model.backbone.mita_cfg == MITA
    # the paper's swap: the encoder; the config says so in its first lines
    assert cfg.model.decode_head.type == 'SegmenterMaskTransformerHead'
    head = open(out_cfg).read().splitlines()[:2]
    assert head[0].startswith(f'# MiTA version of {config} (tools/export_swapped.py): MiTA in '
                              "all the backbone's attention layers (MiTAVisionTransformer; "
                              'pool_size=4, topk=32)'), head
    assert head[1].startswith('# Segmenter mask head on standard attention'), head
    assert {'mita_seg.models', 'mita_seg.engine'} <= set(cfg.custom_imports.imports)
    assert cfg.default_hooks.checkpoint.type == 'SafeCheckpointHook'
    assert cfg.load_from == out_ckpt
    exported = init_model(out_cfg, out_ckpt)                 # strict
    swapped = init_model(config, ckpt, mita_cfg=MITA)
    assert list(exported.state_dict()) == list(swapped.state_dict())
    x = torch.randn(2, 3, 128, 96)
    metas = [dict(ori_shape=(128, 96), img_shape=(128, 96), pad_shape=(128, 96))] * 2
    with torch.no_grad():
        torch.testing.assert_close(exported.inference(x, metas), swapped.inference(x, metas),
                                   rtol=0, atol=0)

    # tools/test.py evaluates the pair as it is, like --swap-attn on the original
    _, out1 = tools('tools/test.py', out_cfg, out_ckpt, '--work-dir', tmp_path / 'a')
    _, out2 = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'b',
                    '--mita-cfg', 'pool_size=4', 'topk=32')
    assert tools.miou(out1) == tools.miou(out2)


def test_export_refuses_what_it_cannot_swap(segmenter_ckpt, tmp_path):
    config, ckpt = segmenter_ckpt
    # only ViT-family backbones can be exported
    with pytest.raises(NothingToSwapError, match="VisionTransformer backbone.*'SwinTransformer'"):
        mita_config(get_config(SWIN), {})
    # the MiTA model is built and loaded before anything is written: a MiTA model with
    # more parameters (the DWC branch) than the checkpoint has is refused by name
    cfg = mita_config(Config.fromfile(config), MITA)
    cfg.model.backbone.mita_cfg.with_dwc = True
    with pytest.raises(ValueError, match=r'missing keys \(8\): '
                       r'backbone\.layers\.\{0\.\.3\}\.attn\.dwc\.\{bias,weight\}'):
        init_model(cfg, ckpt)
    out_cfg, _ = export_swapped(config, ckpt, str(tmp_path),
                                dict(layers=[-1], include_head=False))
    cfg = Config.fromfile(out_cfg)
    assert cfg.model.backbone.mita_layers == [-1]
    assert cfg.model.decode_head.type == 'SegmenterMaskTransformerHead'


# --------------------------------------------------------------------------------------
# token selection
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize('router_topk', [1, 2])
def test_selection_matches_what_route_only_mita_reads(router_topk):
    """A value is read by route-only MiTA iff its key is in a used expert's set: v's
    gradient is non-zero exactly on ``used``."""
    torch.manual_seed(0)
    B, H, h, w, p, d = 2, 3, 5, 7, 1, 8
    N = p + h * w + 3                                     # cls + grid + 3 suffix tokens
    q, k, v = (torch.randn(B, H, N, d, dtype=torch.float64) for _ in range(3))
    v.requires_grad_()
    cfg = dict(hw_shape=(h, w), pool_size=(2, 3), topk=4, router_topk=router_topk,
               num_prefix_tokens=p)
    out = mita_attention(q, k, v, with_shared_expert=False, **cfg)
    out.backward(torch.randn_like(out))
    selected, used = selection_from_qk(q, k, **cfg)
    assert torch.equal(used, v.grad.abs().sum(-1) > 0)
    assert (selected >= used).all() and not used.all()
    assert (selected.sum(-1) <= 6 * 4).all()             # at most M * k distinct keys


def tiny_vit_segmenter(**mita):
    torch.manual_seed(0)
    cfg = Config.fromfile(TINY).model
    model = MODELS.build(cfg).eval()
    swap_attention(model, verbose=False, **mita)
    return model


@pytest.mark.parametrize('mita,never', [
    (dict(pool_size=4, topk=10**6), 0.0),                 # every key in every expert
    (dict(pool_size=1, topk=1), 1 - 1 / 257),             # one expert, one key per head
], ids=['all', 'one'])
def test_recorder_fractions(mita, never):
    model = tiny_vit_segmenter(**mita)
    x = torch.randn(2, 3, 128, 128)
    with TokenSelectionRecorder(model) as rec, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model.backbone(x)
    assert [r.name for r in rec.records] == [f'backbone.layers.{i}.attn' for i in range(4)]
    for r in rec.records:
        assert r.hw_shape == (16, 16) and r.selected.shape == (2, 2, 257)
        assert r.frac_never_selected == pytest.approx(never)
        assert r.grid_map().shape == (2, 2, 16, 16)
    assert rec.never_selected() == pytest.approx({r.name: never for r in rec.records})
    model.backbone(x)                                     # hooks removed on exit
    assert len(rec.records) == 4


def test_recorder_leaves_the_heads_global_class_tokens_out():
    """A swapped Segmenter head's 150 class tokens are global (every query reads them; the
    experts route over the 256 patch tokens): the recorder routes as the layer runs, over
    the patches only, so one expert of one key leaves all but one patch unselected."""
    torch.manual_seed(0)
    model = MODELS.build(Config.fromfile(osp.join(
        ROOT, 'configs', 'baselines', 'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py'
    )).model).eval()
    swap_attention(model, pool_size=1, topk=1, include_head=True, verbose=False)
    with TokenSelectionRecorder(model) as rec, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model(torch.randn(1, 3, 128, 128), mode='tensor')
    head = [r for r in rec.records if r.name.startswith('decode_head')]
    assert [r.name for r in head] == ['decode_head.layers.0.attn', 'decode_head.layers.1.attn']
    for r in head:
        assert r.selected.shape[-1] == 256 and r.num_prefix_tokens == 0
        assert r.frac_never_selected == pytest.approx(1 - 1 / 256)
        assert r.grid_map().shape[-2:] == (16, 16)


def test_recorder_needs_mita():
    model = VisionTransformer(img_size=64, embed_dims=32, num_layers=1, num_heads=2)
    # no MiTA modules: say how to get them
    with pytest.raises(ValueError, match='swap_attention'):
        TokenSelectionRecorder(model)


def test_plot_selection_overlay(tmp_path):
    model = tiny_vit_segmenter(pool_size=3, topk=16)
    with TokenSelectionRecorder(model) as rec, torch.no_grad():
        model.backbone(torch.randn(1, 3, 128, 96))
    image = torch.randint(0, 255, (128, 96, 3), dtype=torch.uint8).numpy()
    png = plot_selection_overlay(image, rec.records, str(tmp_path / 'sel.png'), cell_size=(8, 8))
    assert osp.getsize(png) > 10000
    with pytest.raises(ValueError, match="'selected' or 'used'"):
        plot_selection_overlay(image, rec.records, str(tmp_path / 'x.png'), which='all')


@pytest.mark.slow
def test_analyze_token_selection_cli(segmenter_ckpt, tiny_data, tools, tmp_path):
    config, ckpt = segmenter_ckpt
    imgs = [osp.join(tiny_data, 'images', 'validation', f'ADE_val_{i:08d}.jpg') for i in (1, 2)]
    _, out = tools('tools/analyze_token_selection.py', config, ckpt, *imgs, '--out-dir',
                   tmp_path, '--mita-cfg', 'pool_size=4', 'topk=16')
    summary = json.loads((tmp_path / 'token_selection.json').read_text())
    layers = [f'backbone.layers.{i}.attn' for i in range(4)]   # the encoder, as the paper
    for img in imgs:
        assert list(summary[img]) == layers
        for s in summary[img].values():
            assert (s['hw_shape'], s['num_experts'], s['topk']) == ([16, 16], 16, 16)
            # a used key is a selected key; 16 experts of 16 keys cannot cover 257 tokens
            assert 0 < s['never_selected'] <= s['never_used'] < 1
        png = tmp_path / (osp.splitext(osp.basename(img))[0] + '_selected.png')
        assert png.stat().st_size > 10000
        first = summary[img]['backbone.layers.0.attn']['never_selected']
        assert f'{100 * first:.1f}%' in out.split(img)[1].split('\n')[2]   # layer 0's row
