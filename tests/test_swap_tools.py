"""The swap tools end to end on the tiny ADE20K data: tools/test.py --swap-attn mita,
tools/swap_sweep.py, tools/export_swapped.py, tools/analyze_token_selection.py, and the
token-selection analysis they rest on.

A tiny Segmenter (ViT with 64-dim tokens, 4 layers, patch 8; 2-layer mask head) with
standard attention is trained for 4 iterations by mmengine's Runner on 8 synthetic images and
saved as a model-zoo checkpoint (``meta`` + ``state_dict``); evaluation uses 4 images.
About 90 s on 2 cores.
"""
import csv
import importlib.util
import json
import os.path as osp
import subprocess
import sys
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.hub import get_config
from mmengine.runner import Runner, load_checkpoint
from mmseg.models.backbones import VisionTransformer
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from mita_seg import swap_attention
from mita_seg.analysis.token_selection import (TokenSelectionRecorder, plot_selection_overlay,
                                               selection_from_qk)
from mita_seg.ops import mita_attention

register_all_modules()
ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
SWIN = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
MITA = dict(pool_size=4, topk=32)        # 16 experts of 32 keys over a 16x16 grid


def tool(name):
    """tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f'mita_tools_{name}',
                                                  osp.join(ROOT, 'tools', f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args):
    """Run a repository script; its output, or the failure with its output."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(config path, checkpoint trained with standard attention, data root)."""
    tmp = tmp_path_factory.mktemp('swap_tools')
    data = str(tmp / 'tiny_ade20k')
    run('tools/dataset/make_tiny_ade20k.py', '--out', data, '--train', '8', '--val', '4')

    cfg = Config.fromfile(TINY)
    cfg.model.backbone.type = 'VisionTransformer'           # standard attention
    cfg.model.backbone.pop('mita_cfg')
    cfg.model.backbone.out_indices = 3
    cfg.model.neck = None
    cfg.model.auxiliary_head = None
    cfg.model.decode_head = dict(
        type='SegmenterMaskTransformerHead', in_channels=64, channels=64, num_classes=150,
        num_layers=2, num_heads=2, embed_dims=64, dropout_ratio=0.0,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0))
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = data
        cfg[loader].num_workers = 0
        cfg[loader].persistent_workers = False
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=4, val_interval=100)
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', by_epoch=False, interval=100)
    cfg.default_hooks.logger.interval = 1
    config = str(tmp / 'segmenter_vit-tiny_tiny-ade20k-128x128.py')
    cfg.dump(config)
    cfg.work_dir = str(tmp / 'train')
    runner = Runner.from_cfg(cfg)
    model = runner.train()
    ckpt = str(tmp / 'segmenter_vit-tiny_iter4.pth')
    torch.save({'meta': dict(dataset_meta=runner.train_dataloader.dataset.metainfo),
                'state_dict': model.state_dict()}, ckpt)
    return config, ckpt, data


def build(config, checkpoint):
    cfg = Config.fromfile(config)
    model = MODELS.build(cfg.model)
    load_checkpoint(model, checkpoint, map_location='cpu', strict=True, logger='silent')
    return model.eval()


def test_test_py_swap_attn_mita_reports_miou(tiny, tmp_path):
    config, ckpt, _ = tiny
    out = run('tools/test.py', config, ckpt, '--swap-attn', 'mita', '--work-dir', str(tmp_path),
              '--mita-cfg', 'pool_size=4', 'topk=32')
    assert 'swap_attention: 6 attention modules on MiTA' in out    # 4 backbone + 2 head
    miou = float(out.split('mIoU: ')[-1].split()[0])
    assert 0 <= miou <= 100


def test_swap_sweep(tiny, tmp_path):
    config, ckpt, _ = tiny
    rows = tool('swap_sweep').main([
        config, ckpt, '--pool-sizes', '2', '4', '--topks', '8', '100000',
        '--mita-cfg', 'with_shared_expert=False', '--work-dir', str(tmp_path / 'work'),
        '--out', str(tmp_path / 'sweep.md'), '--plot', str(tmp_path / 'sweep.png')])
    assert [r['setting'] for r in rows] == [
        'baseline', 'MiTA M=2x2 k=8', 'MiTA M=2x2 k=100000', 'MiTA M=4x4 k=8',
        'MiTA M=4x4 k=100000']
    base = rows[0]
    for r in rows[1:]:
        if r['topk'] == 100000:   # route-only with every key: softmax attention, same mIoU
            assert r['mIoU'] == pytest.approx(base['mIoU'], abs=1e-6)
        else:
            assert r['attn_GMACs'] < base['attn_GMACs'] / 2
            assert r['model_GFLOPs'] < base['model_GFLOPs']
            assert r['attn_reduction_%'] > 50
            # the whole-model trace (mita_seg.analysis.flops) saves what the analytic
            # attention count saves: nothing else changes
            assert base['model_GFLOPs'] - r['model_GFLOPs'] == pytest.approx(
                base['attn_GMACs'] - r['attn_GMACs'], rel=0.01)
    with open(tmp_path / 'sweep.csv') as f:
        table = list(csv.DictReader(f))
    assert [float(r['mIoU']) for r in table] == pytest.approx([r['mIoU'] for r in rows])
    assert (tmp_path / 'sweep.md').read_text().startswith('| setting | M | topk | mIoU')
    assert (tmp_path / 'sweep.png').stat().st_size > 10000


def test_swap_sweep_rejects_settings_it_owns():
    # pool_size/topk come from --pool-sizes/--topks, not --mita-cfg
    with pytest.raises(ValueError, match='--pool-sizes'):
        tool('swap_sweep').parse_args(['c.py', 'x.pth', '--mita-cfg', 'topk=3'])


def test_export_swapped_pair_loads_strictly_and_matches_swap(tiny, tmp_path):
    config, ckpt, _ = tiny
    export = tool('export_swapped')
    out_cfg, out_ckpt = export.export(config, ckpt, str(tmp_path), dict(MITA))

    cfg = Config.fromfile(out_cfg)
    assert cfg.model.backbone.type == 'MiTAVisionTransformer'
    assert cfg.model.backbone.mita_cfg == MITA
    assert cfg.model.decode_head.type == 'MiTASegmenterMaskTransformerHead'
    assert 'mita_seg.models' in cfg.custom_imports.imports
    assert cfg.load_from == out_ckpt
    exported = build(out_cfg, out_ckpt)              # strict
    swapped = build(config, ckpt)
    assert list(exported.state_dict()) == list(swapped.state_dict())
    assert swap_attention(swapped, verbose=False, **MITA) == 6
    x = torch.randn(2, 3, 128, 96)
    metas = [dict(ori_shape=(128, 96), img_shape=(128, 96), pad_shape=(128, 96))] * 2
    with torch.no_grad():
        torch.testing.assert_close(exported.inference(x, metas), swapped.inference(x, metas),
                                   rtol=0, atol=0)

    # tools/test.py evaluates the pair as it is, like --swap-attn on the original
    test = tool('test')
    m1 = test.main([out_cfg, out_ckpt, '--work-dir', str(tmp_path / 'a')])
    m2 = test.main([config, ckpt, '--swap-attn', 'mita', '--work-dir', str(tmp_path / 'b'),
                    '--mita-cfg', 'pool_size=4', 'topk=32'])
    assert m1['mIoU'] == m2['mIoU']


def test_export_swapped_errors(tiny, tmp_path):
    config, ckpt, _ = tiny
    export = tool('export_swapped')
    # with_dwc adds parameters the checkpoint lacks
    with pytest.raises(ValueError, match='with_dwc adds parameters'):
        export.export(config, ckpt, str(tmp_path), dict(with_dwc=True))
    # only ViT-family backbones can be exported
    with pytest.raises(ValueError, match="VisionTransformer backbone.*'SwinTransformer'"):
        export.mita_config(get_config(SWIN), {})


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


def test_analyze_token_selection_cli(tiny, tmp_path):
    config, ckpt, data = tiny
    imgs = [osp.join(data, 'images', 'validation', f'ADE_val_{i:08d}.jpg') for i in (1, 2)]
    summary = tool('analyze_token_selection').main(
        [config, ckpt, *imgs, '--out-dir', str(tmp_path), '--mita-cfg', 'pool_size=4',
         'topk=16'])
    layers = [f'backbone.layers.{i}.attn' for i in range(4)] + [
        f'decode_head.layers.{i}.attn' for i in range(2)]
    for img in imgs:
        assert list(summary[img]) == layers
        assert all(0 <= s['never_selected'] <= s['never_used'] <= 1
                   for s in summary[img].values())
        png = tmp_path / (osp.splitext(osp.basename(img))[0] + '_selected.png')
        assert png.stat().st_size > 10000
    saved = json.loads((tmp_path / 'token_selection.json').read_text())
    assert saved == summary
