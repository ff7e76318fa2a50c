"""Every config in configs/ inherits from mmseg, builds, and runs a forward pass (BEiT-B at
640x640 and MAE-B at 512x512 are ``slow``: tests/test_beit_swap.py runs them smaller)."""
import copy
import glob
import os.path as osp

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmseg.registry import MODELS

from mita_seg.models import MiTASettingsMixin

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', '*.py')))
TINY = [c for c in CONFIGS if 'tiny-ade20k' in c]
REAL = [c for c in CONFIGS if c not in TINY]
# BEiT / MAE backbones run only at the grid of their bias tables: the config's img_size
BEIT_FAMILY = [c for c in CONFIGS if 'beit' in osp.basename(c) or 'mae' in osp.basename(c)]
HEAVY = [c for c in BEIT_FAMILY if c in REAL]   # ViT-B at 640x640 / 512x512 with UperNet


def cfg_id(path):
    return osp.splitext(osp.basename(path))[0]


def build(cfg):
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    return model.eval()


def num_mita(module):
    return sum(isinstance(m, MiTASettingsMixin) for m in module.modules())


def unswapped_and_swapped(model, x, swapped, **mita_cfg):
    """``model(x)`` in tensor mode before and after ``swap_attention(model, **mita_cfg)``,
    which must find no MiTA module before and swap ``swapped`` attention modules."""
    from mita_seg import swap_attention
    assert num_mita(model) == 0
    with torch.no_grad():
        base = model(x, mode='tensor')
        assert swap_attention(model, verbose=False, **mita_cfg) == swapped
        out = model(x, mode='tensor')
    assert torch.isfinite(out).all()
    return base, out


def test_configs_exist():
    names = [cfg_id(c) for c in CONFIGS]
    assert 'mita_upernet_ade20k' in names
    for size in 'tsb':
        assert f'mita_segmenter_vit-{size}_mask_8xb1-160k_ade20k-512x512' in names
    assert any('deit-s16' in n and 'upernet' in n for n in names)
    assert TINY


@pytest.mark.parametrize('path', CONFIGS, ids=cfg_id)
def test_config_inherits_from_mmseg(path):
    text = open(path).read()
    assert "_base_ = ['mmseg::" in text, 'configs inherit from mmseg base files'
    cfg = Config.fromfile(path)
    assert cfg.custom_imports['imports'] == ['mita_seg.models', 'mita_seg.engine']
    # crash-safe saves and strict weights-only loads with mmseg's own tools too
    assert cfg.default_hooks.checkpoint.type == 'SafeCheckpointHook'
    assert cfg.model.backbone.type == (
        'MiTAVisionTransformer' if path not in BEIT_FAMILY else
        'MiTAMAE' if 'mae' in osp.basename(path) else 'MiTABEiT')
    if path in REAL:  # published defaults and the real dataset, unchanged
        assert cfg.model.backbone.mita_cfg == dict(pool_size=7, topk=49)
        assert cfg.train_dataloader.dataset.data_root == 'data/ade/ADEChallengeData2016'
        assert cfg.model.decode_head.num_classes == 150
    if 'segmenter' in path:  # the paper's swap: the encoder only, mmseg's mask head
        assert cfg.model.decode_head.type == 'SegmenterMaskTransformerHead'
        assert 'mita_cfg' not in cfg.model.decode_head


@pytest.mark.parametrize(
    'path', [pytest.param(c, marks=pytest.mark.slow) if c in HEAVY else c for c in CONFIGS],
    ids=cfg_id)
def test_config_forward_512(path):
    # 512x512, or a BEiT/MAE backbone's img_size
    cfg = Config.fromfile(path)
    model = build(cfg)
    layers = len(model.backbone.layers)
    assert num_mita(model) == layers    # the encoder only (Segmenter's head too: dense)
    # UperNet predicts at 1/4 of the input, Segmenter's mask head at the 1/16 patch grid
    stride = 16 if 'segmenter' in path else 4
    size = cfg.model.backbone.img_size[0] if path in BEIT_FAMILY else 512
    with torch.no_grad():
        out = model(torch.randn(1, 3, size, size), mode='tensor')
    assert out.shape == (1, 150, size // stride, size // stride)
    assert torch.isfinite(out).all()


def test_non_square_whole_inference():
    # whole-image inference at 512x683: a 32x43 grid in the backbone
    cfg = Config.fromfile(
        osp.join(ROOT, 'configs', 'mita_segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'))
    cfg.model.test_cfg = dict(mode='whole')
    model = build(cfg)
    img = torch.randn(1, 3, 512, 683)
    meta = dict(img_shape=(512, 683), ori_shape=(512, 683), pad_shape=(512, 683),
                padding_size=[0, 0, 0, 0])
    with torch.no_grad():
        seg_logits = model.inference(img, [meta])
    assert model.backbone._mita_grid.hw_shape == (32, 43)
    assert seg_logits.shape == (1, 150, 512, 683)


def test_baseline_configs_are_standard_attention_and_swappable():
    # configs/baselines/: standard-attention models for the swap tools (docs/swap.md)
    path = osp.join(ROOT, 'configs', 'baselines',
                    'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')
    model = build(Config.fromfile(path))
    # the encoder's 4 layers by default; the mask head's 2 as well on request
    head = copy.deepcopy(model)
    base, out = unswapped_and_swapped(model, torch.randn(1, 3, 128, 160), 4, pool_size=4,
                                      topk=16)
    unswapped_and_swapped(head, torch.randn(1, 3, 128, 160), 4 + 2, pool_size=4, topk=16,
                          include_head=True)
    assert base.shape == out.shape == (1, 150, 16, 20)

    # the tiny Segmenter at 256x256 (tools/swap_study.py): a 32x32 grid, N = 1025 in the
    # backbone (and 1024 + 150 in the mask head, with include_head=True)
    path = osp.join(ROOT, 'configs', 'baselines',
                    'segmenter_vit-tiny_mask_1xb4_tiny-ade20k-256x256.py')
    cfg = Config.fromfile(path)
    assert cfg.train_dataloader.dataset.data_root == 'data/ade/tiny_ade20k_256'
    assert cfg.test_dataloader.dataset.pipeline[1].scale == (1024, 256)
    model = build(cfg)
    base, out = unswapped_and_swapped(model, torch.randn(1, 3, 256, 256), 4, pool_size=7,
                                      topk=49)
    assert model.backbone._mita_grid.hw_shape == (32, 32)
    assert base.shape == out.shape == (1, 150, 32, 32)

    # the tiny BEiT UperNet: 256x256 crops, a 32x32 grid of patch 8 plus cls (N = 1025)
    path = osp.join(ROOT, 'configs', 'baselines', 'beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py')
    cfg = Config.fromfile(path)
    # the 256x256 data, not the demo's 128x128 (read upsampled without a word)
    assert cfg.train_dataloader.dataset.data_root == 'data/ade/tiny_ade20k_256'
    assert cfg.test_dataloader.dataset.data_root == 'data/ade/tiny_ade20k_256'
    model = build(cfg)
    base, out = unswapped_and_swapped(model, torch.randn(1, 3, 256, 256), 4)
    assert model.backbone._mita_grid.hw_shape == (32, 32)
    assert base.shape == out.shape == (1, 150, 64, 64)

    # the tiny BEiT on the long-range scenes: the long-range Segmenter's linear mask head (no
    # attention outside the encoder), its cls token kept (N = 1025); route-only MiTA with
    # every key (through BEiT's relative position bias) is its softmax attention
    path = osp.join(ROOT, 'configs', 'longrange',
                    'beit-tiny_linear_1xb4_longrange-ade20k-256x256.py')
    cfg = Config.fromfile(path)
    assert cfg.train_dataloader.dataset.data_root == 'data/ade/longrange_ade20k'
    # the Segmenter's schedule, longer (it learns retrieval later): decay over the last 300
    assert cfg.train_cfg.max_iters == 2400 and cfg.train_cfg.val_interval == 400
    assert [(p.begin, p.end) for p in cfg.param_scheduler] == [(0, 50), (2100, 2400)]
    model = build(cfg)
    assert type(model.backbone).__name__ == 'BEiT' and len(model.decode_head.layers) == 0
    base, out = unswapped_and_swapped(model, torch.randn(1, 3, 256, 256), 4, pool_size=1,
                                      topk=1025, with_shared_expert=False)
    assert model.backbone._mita_grid.hw_shape == (32, 32)
    assert base.shape == (1, 150, 32, 32)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)


def test_every_config_imports_what_it_registers_in_a_fresh_interpreter():
    """Each config's ``custom_imports`` alone registers its model and evaluator types, read
    as mmseg's own ``tools/train.py`` reads it (``Config.fromfile``, which imports them; a
    config that overrides ``custom_imports`` of its base must keep what the base imports:
    within one process an earlier import hides the gap)."""
    import subprocess
    import sys
    paths = sorted(glob.glob(osp.join(ROOT, 'configs', '**', '*.py'), recursive=True))
    # one forked child per config, from an interpreter that has imported the stack but
    # nothing of mita_seg: a type registered for one config cannot hide another's gap
    script = '''
import multiprocessing, sys
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmseg.registry import METRICS, MODELS
import mmseg.datasets, mmseg.evaluation, mmseg.models  # noqa: the stack, imported once

def gaps(path):
    assert not any(m.startswith('mita_seg') for m in sys.modules), 'mita_seg imported early'
    cfg = Config.fromfile(path)
    init_default_scope('mmseg')
    kinds = [('model', MODELS, cfg.model), ('model.backbone', MODELS, cfg.model.backbone)]
    for key in ('val_evaluator', 'test_evaluator'):
        evals = cfg.get(key) or []
        kinds += [(key, METRICS, e) for e in (evals if isinstance(evals, list) else [evals])]
    return [f"{path}: {key} {part['type']}" for key, registry, part in kinds
            if isinstance(part['type'], str) and registry.get(part['type']) is None]

if __name__ == '__main__':
    with multiprocessing.get_context('fork').Pool(2, maxtasksperchild=1) as pool:
        print('\\n'.join(g for found in pool.map(gaps, sys.argv[1:], chunksize=1)
                          for g in found))
'''
    out = subprocess.run([sys.executable, '-c', script, *paths], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == '', out.stdout
    assert len(paths) >= 10, paths


def test_test_out_reaches_every_metric_that_writes_predictions(tmp_path):
    """tools/test.py --out on a config whose evaluator is a list (the long-range configs': an
    IoU metric and the evidence accuracy) sets the IoU metric's output_dir; an evaluator with
    no metric that writes predictions is refused, naming the metrics."""
    from mita_seg.apis import keep_predictions, load_config
    from mita_seg.utils.errors import InputError
    cfg = load_config(osp.join(ROOT, 'configs', 'longrange',
                               'segmenter_vit-tiny_linear_1xb4_longrange-ade20k-256x256.py'))
    assert isinstance(cfg.test_evaluator, list) and len(cfg.test_evaluator) == 2
    assert keep_predictions(cfg, str(tmp_path)) == 1
    kept = [m for m in cfg.test_evaluator if m.get('output_dir')]
    assert [m['type'] for m in kept] == ['LabelledIoUMetric']
    assert kept[0]['output_dir'] == str(tmp_path) and kept[0]['keep_results'] is True

    cfg = load_config(CONFIGS[0])   # a single IoUMetric, as in mmseg's configs
    assert keep_predictions(cfg, str(tmp_path)) == 1
    assert cfg.test_evaluator['output_dir'] == str(tmp_path)

    cfg.test_evaluator = [dict(type='EvidenceAccuracyMetric')]
    with pytest.raises(InputError, match='EvidenceAccuracyMetric.*writes predictions'):
        keep_predictions(cfg, str(tmp_path))


def test_mae_amp_config_trains_in_mixed_precision():
    """mmseg's MAE -amp- config turns AMP on with mmcv 0.x's `fp16 = dict(...)`, which
    mmengine no longer reads: prepare_config gives it the mixed precision of --amp (bf16
    autocast without CUDA), where mmseg's own tool would train in float32."""
    from mita_seg.apis import load_config, prepare_config
    cfg = load_config(osp.join(ROOT, 'configs',
                               'mita_mae-base_upernet_8xb2-amp-160k_ade20k-512x512.py'))
    assert cfg.optim_wrapper.type == 'OptimWrapper' and cfg.fp16 is not None
    prepare_config(cfg)
    expected = 'AmpOptimWrapper' if torch.cuda.is_available() else 'BF16AmpOptimWrapper'
    assert cfg.optim_wrapper.type == expected
    # a config without it keeps float32
    cfg = load_config(osp.join(ROOT, 'configs', 'mita_upernet_ade20k.py'))
    prepare_config(cfg)
    assert cfg.optim_wrapper.type == 'OptimWrapper'
