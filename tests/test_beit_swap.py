"""MiTA with BEiT's relative position bias: ``swap_attention`` on mmseg's own BEiT-B and MAE-B
UperNet configs, the MiTA BEiT/MAE backbones and configs, the grid-mismatch error, and the
FLOPs with the bias cost.

The model-zoo cases build mmseg's configs with seeded random weights, saved as model-zoo
checkpoints (``meta`` + ``state_dict``). The fast ones keep the architecture (ViT-B, 12
layers, 12 heads, q/v bias, layer scale, UperNet) at a 128x160 crop (an 8x10 patch grid,
non-square, N = 81) with a narrower UperNet (the head has no attention); the ``slow`` ones
run the configs' own crops (BEiT 640x640, N = 1601; MAE 512x512, N = 1025; about 2 min) and
``tools/get_flops.py``. About 1.5 min on 2 cores without the slow ones.
"""
import copy
import json
import os.path as osp
import re
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.hub import get_config
from mmengine.runner import load_checkpoint
from mmseg.models.backbones import BEiT, MAE
from mmseg.models.backbones.beit import BEiTAttention
from mmseg.models.backbones.mae import MAEAttention
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from mita_seg import swap_attention
from mita_seg.analysis.segmentor_cost import SegmentorFlops
from mita_seg.analysis.token_selection import TokenSelectionRecorder
from mita_seg.apis import MiTASegInferencer, load_config
from mita_seg.apis.export import mita_config
from mita_seg.setting import MiTASetting, MiTASettingError
from mita_seg.analysis.attention_macs import AttentionMacCounter
from mita_seg.analysis.flop_count import count_flops
from mita_seg.models import (GridMismatchError, MiTABEiT, MiTABEiTAttention, MiTAMAE,
                             MiTAMAEAttention, guard_grids)
from mita_seg.ops import (Inputs, RelPosBias, attention_flops, bias_flops_per_head,
                          mita_flops, select_backend)
from mita_seg.ops.bias import table_size
from mita_seg.utils import CheckpointMismatchError, check_checkpoint_keys

register_all_modules()

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
ZOO = {
    'beit-b': 'mmseg::beit/beit-base_upernet_8xb2-160k_ade20k-640x640.py',
    'mae-b': 'mmseg::mae/mae-base_upernet_8xb2-amp-160k_ade20k-512x512.py',
}
MITA_CONFIGS = {
    'beit-b': osp.join(ROOT, 'configs', 'mita_beit-base_upernet_8xb2-160k_ade20k-640x640.py'),
    'mae-b': osp.join(ROOT, 'configs', 'mita_mae-base_upernet_8xb2-amp-160k_ade20k-512x512.py'),
}
TINY_BEIT = osp.join(ROOT, 'configs', 'baselines', 'beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py')
MITA_TINY_BEIT = osp.join(ROOT, 'configs', 'mita_beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py')
MITA_CLASS = {'beit-b': MiTABEiTAttention, 'mae-b': MiTAMAEAttention}
CROP = (128, 160)                                  # an 8x10 grid of 16x16 patches, N = 81
# Route-only MiTA with every key in every expert: exactly BEiT's attention, bias included.
EXACT = dict(pool_size=2, topk=10**6, with_shared_expert=False)


def model_cfg(name, crop=CROP, stride=(96, 96)):
    """mmseg's model config ``name`` at crop ``crop`` (slide inference, as configured), no
    pretrained download, a narrower UperNet; None keeps the config's crop."""
    cfg = Config.fromfile(name) if osp.isfile(name) else get_config(name)
    model = copy.deepcopy(cfg.model)
    model.pretrained = None                # no download: seeded random weights instead
    model.backbone.init_cfg = None
    model.backbone.pop('pretrained', None)
    model.decode_head.channels = 128       # the UperNet has no attention: 4x faster
    model.auxiliary_head.channels = 64
    if crop is not None:
        model.backbone.img_size = crop
        model.test_cfg = dict(mode='slide', crop_size=crop, stride=stride)
    return model


def save_zoo(model, path):
    meta = dict(mmseg_version='1.2.2', dataset_meta=dict(classes=[f'c{i}' for i in range(150)]))
    torch.save({'meta': meta, 'state_dict': model.state_dict()}, path)


def build(cfg, path=None, test_cfg=None):
    cfg = copy.deepcopy(cfg)
    if test_cfg is not None:
        cfg.test_cfg = test_cfg
    model = MODELS.build(cfg)
    if path is not None:
        load_checkpoint(model, path, map_location='cpu', strict=True, logger='silent')
    model.eval()                           # BEiT.train() returns None: no chaining
    return model


def logits(model, shape, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(1, 3, *shape)
    metas = [dict(ori_shape=shape, img_shape=shape, pad_shape=shape, padding_size=[0, 0, 0, 0])]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')   # topk > N is clamped with a warning
        return model.inference(x, metas)


def attention_types(model):
    return [type(layer.attn) for layer in model.backbone.layers]


@pytest.fixture(scope='module', params=list(ZOO))
def zoo(request, tmp_path_factory):
    """(name, model config, path of a model-zoo style checkpoint with random weights)."""
    cfg = model_cfg(ZOO[request.param])
    torch.manual_seed(0)
    model = MODELS.build(cfg)
    model.init_weights()
    for layer in model.backbone.layers:   # MAE's table starts at zero: give it a bias
        torch.nn.init.normal_(layer.attn.relative_position_bias_table, std=0.5)
    path = tmp_path_factory.mktemp(request.param) / 'model.pth'
    save_zoo(model, path)
    return request.param, cfg, str(path)


# ----------------------------------------------------------------------------------------
# The swap on mmseg's BEiT-B and MAE-B UperNet.
# ----------------------------------------------------------------------------------------
def test_zoo_checkpoint_swap_keeps_keys_and_reloads(zoo):
    name, cfg, path = zoo
    model = build(cfg, path)
    ref = logits(model, CROP)
    keys = list(model.state_dict())
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    modules = [layer.attn for layer in model.backbone.layers]
    assert attention_types(model) == [MAEAttention if name == 'mae-b' else BEiTAttention] * 12

    assert swap_attention(model, verbose=False) == 12

    assert attention_types(model) == [MITA_CLASS[name]] * 12
    assert [layer.attn for layer in model.backbone.layers] == modules   # the same modules
    assert list(model.state_dict()) == keys
    for key in ('qkv.weight', 'relative_position_bias_table', 'relative_position_index',
                'proj.weight', 'proj.bias') + (('q_bias', 'v_bias') if name == 'beit-b' else
                                               ('qkv.bias', )):
        assert f'backbone.layers.0.attn.{key}' in keys
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    load_checkpoint(model, path, map_location='cpu', strict=True, logger='silent')
    out = logits(model, CROP)
    assert out.shape == ref.shape == (1, 150, *CROP)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, ref, atol=1e-3)   # k = 49 < N = 81, shared expert: MiTA


@pytest.mark.parametrize('image', [CROP, (128, 224)], ids=['whole', 'slide'])
def test_route_only_full_topk_equals_beit(zoo, image):
    # whole: one crop-sized forward; slide: 2 crops of 128x160 over a 128x224 image
    _, cfg, path = zoo
    test_cfg = dict(mode='whole') if image == CROP else None
    model = build(cfg, path, test_cfg)
    ref = logits(model, image)
    swap_attention(model, verbose=False, **EXACT)
    torch.testing.assert_close(logits(model, image), ref, rtol=1e-4, atol=1e-4)


def test_mita_config_loads_zoo_checkpoint(zoo):
    # configs/mita_{beit,mae}-base_...: backbone type switched; the zoo checkpoint loads
    # strictly and runs as the swapped mmseg model with the same settings
    name, cfg, path = zoo
    mita = build(model_cfg(MITA_CONFIGS[name]), path)
    assert type(mita.backbone) is (MiTAMAE if name == 'mae-b' else MiTABEiT)
    assert attention_types(mita) == [MITA_CLASS[name]] * 12
    assert mita.backbone.layers[0].attn.pool_size == 7 and mita.backbone.layers[0].attn.topk == 49
    swapped = build(cfg, path)
    swap_attention(swapped, verbose=False, pool_size=7, topk=49)
    torch.testing.assert_close(logits(mita, CROP), logits(swapped, CROP), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize('name, mode', [('beit-b', 'whole'), ('mae-b', 'slide')])
def test_route_only_full_topk_equals_beit_at_the_configs_crop(name, mode, tmp_path):
    # the configs' own crops: BEiT-B 640x640 (N = 1601) whole, MAE-B 512x512 (N = 1025)
    # slide over a 512x576 image (2 crops); about 2 min on 2 busy cores
    cfg = model_cfg(ZOO[name], crop=None)
    crop = tuple(cfg.test_cfg.crop_size)
    torch.manual_seed(0)
    model = MODELS.build(cfg)
    model.init_weights()
    for layer in model.backbone.layers:
        torch.nn.init.normal_(layer.attn.relative_position_bias_table, std=0.5)
    path = str(tmp_path / 'model.pth')
    save_zoo(model, path)
    test_cfg, image = (dict(mode='whole'), crop) if mode == 'whole' else (
        None, (crop[0], crop[1] + 64))
    model = build(cfg, path, test_cfg)
    ref = logits(model, image)
    assert swap_attention(model, verbose=False, **EXACT) == 12
    torch.testing.assert_close(logits(model, image), ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------
# The backbones on the input shapes of mmseg's own BEiT / MAE unit tests.
# ----------------------------------------------------------------------------------------
# tests/test_models/test_backbones/test_{beit,mae}.py of mmsegmentation: image size ->
# feature grid of patch 16 (two layers instead of twelve: the shapes are what is tested)
MMSEG_SHAPES = [((224, 224), (14, 14)), ((256, 256), (16, 16)), ((32, 32), (2, 2)),
                ((112, 224), (7, 14)), ((234, 345), (14, 21)),
                ((16, 16), (1, 1))]                      # and one patch (ours)


@pytest.mark.parametrize('mita_cls, mmseg_cls', [(MiTABEiT, BEiT), (MiTAMAE, MAE)],
                         ids=['beit', 'mae'])
@pytest.mark.parametrize('image, grid', MMSEG_SHAPES, ids=lambda s: f'{s[0]}x{s[1]}')
def test_mmseg_unit_test_shapes(mita_cls, mmseg_cls, image, grid):
    torch.manual_seed(0)
    mita = mita_cls(img_size=image, num_layers=2, out_indices=[0, 1])
    mita.init_weights()
    mita.train()
    feats = mita(torch.randn(1, 3, *image))
    assert [f.shape for f in feats] == [(1, 768, *grid)] * 2
    assert all(torch.isfinite(f).all() for f in feats)
    # route-only MiTA with every key is the mmseg backbone, on these grids too
    torch.manual_seed(0)
    ref = mmseg_cls(img_size=image, num_layers=2, out_indices=[0, 1])
    ref.load_state_dict(mita.state_dict())
    for layer in ref.layers:
        torch.nn.init.normal_(layer.attn.relative_position_bias_table, std=0.5)
    ref.eval()
    mita = mita_cls(img_size=image, num_layers=2, out_indices=[0, 1], mita_cfg=EXACT)
    mita.load_state_dict(ref.state_dict(), strict=True)
    mita.eval()
    x = torch.randn(2, 3, *image)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for a, b in zip(mita(x), ref(x)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('kwargs', [dict(qv_bias=False), dict(init_values=0),
                                    dict(final_norm=True), dict(patch_norm=True)],
                         ids=['no-qv-bias', 'init-values-0', 'final-norm', 'patch-norm'])
def test_mmseg_unit_test_options(kwargs):
    # the BEiT options mmseg's test_beit.py runs, at 224x224
    model = MiTABEiT(num_layers=2, mita_cfg=dict(pool_size=4, topk=32), **kwargs)
    model.init_weights()
    feat = model(torch.randn(1, 3, 224, 224))
    assert feat[-1].shape == (1, 768, 14, 14) and torch.isfinite(feat[-1]).all()


def test_window_and_topk_take_the_bias_agent_and_block_are_refused():
    """BEiT's attention on the kinds its bias enters (each pair's own entry): a window
    covering the grid and a top-k of every key are BEiT's attention; ``window:1`` (the
    study's control: each token reads itself and cls) runs; agent and block are refused."""
    torch.manual_seed(0)
    ref = BEiT(img_size=(64, 64), embed_dims=64, num_layers=2, num_heads=4)
    ref.init_weights()
    for layer in ref.layers:   # a bias that matters (mmseg initialises the tables to 0)
        torch.nn.init.normal_(layer.attn.relative_position_bias_table, std=1.0)
    ref.eval()
    x = torch.randn(2, 3, 64, 64)                                       # the 4x4 window
    with torch.no_grad():
        expected = ref(x)[0]
        for spec in ('window:4', 'topk:16', 'window:1', 'topk:3'):
            mita = copy.deepcopy(ref)
            assert swap_attention(mita, spec, verbose=False) == 2
            out = mita(x)[0]
            if spec in ('window:4', 'topk:16'):
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            else:
                assert not torch.allclose(out, expected, rtol=1e-3, atol=1e-3), spec
        for spec in ('agent:2', 'block:2:2'):
            with pytest.raises(MiTASettingError, match='does not take its relative position '
                               'bias'):
                swap_attention(copy.deepcopy(ref), spec, verbose=False)


def test_without_relative_position_bias():
    # a BEiT whose tables are None runs without bias (as mmseg's), on any grid
    torch.manual_seed(0)
    ref = BEiT(img_size=(64, 64), embed_dims=64, num_layers=2, num_heads=4)
    ref.init_weights()
    for layer in ref.layers:
        layer.attn.relative_position_bias_table = None
    mita = copy.deepcopy(ref)
    assert swap_attention(mita, verbose=False, **EXACT) == 2
    for model in (ref, mita):
        model.eval()
    x = torch.randn(2, 3, 64, 96)                    # a 4x6 grid, not the 4x4 window
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torch.testing.assert_close(mita(x)[0], ref(x)[0], rtol=1e-4, atol=1e-4)
    swap_attention(mita, verbose=False, pool_size=2, topk=8, with_shared_expert=True)
    with torch.no_grad():
        out = mita(x)[0]
    assert out.shape == (2, 64, 4, 6) and torch.isfinite(out).all()


def test_gradients_reach_every_parameter():
    # fine-tuning a swapped BEiT: the bias table learns through MiTA too
    torch.manual_seed(0)
    model = MiTABEiT(img_size=(64, 80), embed_dims=64, num_layers=2, num_heads=4,
                     mita_cfg=dict(pool_size=2, topk=8))
    model.init_weights()
    for layer in model.layers:
        torch.nn.init.normal_(layer.attn.relative_position_bias_table, std=0.5)
    model.train()
    sum(f.square().mean() for f in model(torch.randn(2, 3, 64, 80))).backward()
    no_grad = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert no_grad == []


# ----------------------------------------------------------------------------------------
# Settings, layers, reconfiguration.
# ----------------------------------------------------------------------------------------
def small_beit(**kwargs):
    torch.manual_seed(0)
    model = BEiT(img_size=(64, 80), embed_dims=64, num_layers=4, num_heads=4, **kwargs)
    model.init_weights()
    model.eval()
    return model


def test_layers_selection_and_reconfiguring(log_records):
    model = small_beit()
    x = torch.randn(1, 3, 64, 80)
    with torch.no_grad():
        ref = model(x)[0]
    with log_records() as records:
        assert swap_attention(model, layers=[0, -1], pool_size=2, topk=8) == 2
    assert [type(layer.attn) for layer in model.layers] == [
        MiTABEiTAttention, BEiTAttention, BEiTAttention, MiTABEiTAttention]
    log = '\n'.join(records.messages)
    assert 'left layers.1.attn alone: BEiTAttention: not in layers=[0, -1]' in log
    # again with other settings: the swapped ones change k only, the rest are swapped
    assert swap_attention(model, verbose=False, topk=20) == 4
    attns = [layer.attn for layer in model.layers]
    assert [(a.pool_size, a.topk) for a in attns] == [(2, 20), (7, 20), (7, 20), (2, 20)]
    assert swap_attention(model, verbose=False, **EXACT) == 4
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torch.testing.assert_close(model(x)[0], ref, rtol=1e-4, atol=1e-4)
    # a deep copy (EMA, export) carries the grid plumbing over to the copy
    twin = copy.deepcopy(model)
    del model
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torch.testing.assert_close(twin(x)[0], ref, rtol=1e-4, atol=1e-4)


def test_token_selection_and_attention_macs():
    model = small_beit()                              # 4 layers, 4 heads, a 4x5 grid
    H, N, d = 4, 21, 16
    x = torch.randn(2, 3, 64, 80)
    with AttentionMacCounter(model) as counter, torch.no_grad():
        model(x)
    assert counter.macs == 4 * attention_flops(2, H, N, d, with_bias=True)
    # a strong bias towards the cls key (table entry T-2: grid query -> cls key) puts cls
    # in every expert; with k = 1, no other key: the routing sees the bias
    for layer in model.layers:
        layer.attn.relative_position_bias_table.data[-2] = 100.
    swap_attention(model, verbose=False, pool_size=2, topk=1)
    with AttentionMacCounter(model) as counter, TokenSelectionRecorder(model) as rec, \
            torch.no_grad():
        model(x)
    assert counter.macs == 4 * mita_flops(2, H, N, d, 4, 1, with_bias=True)
    assert [r.name for r in rec.records] == [f'layers.{i}.attn' for i in range(4)]
    for r in rec.records:
        assert r.hw_shape == (4, 5) and r.num_prefix_tokens == 1
        assert r.selected[:, :, 0].all() and not r.selected[:, :, 1:].any()
    # top-k and window: their own MACs and their own bias adds (cls global: T = 1), written
    # out; not MiTA's
    n, T = 20, 1
    for spec, macs, adds in (
            ('window:1', 2 * n * 1 * d, n * 1),
            ('window:3', 2 * n * 9 * d, n * 9),
            ('topk:3', n * n * d + 2 * n * 3 * d, n * n + n * 3),
            ('topk:20', 2 * n * n * d, n * n)):
        glob = 2 * T * (n + T) * d + 2 * n * T * d    # the cls query's row, the cls key
        swap_attention(model, spec, verbose=False)
        with AttentionMacCounter(model) as counter, torch.no_grad():
            model(x)
        per_head = macs + glob + adds + n * T + T * (n + T)
        assert counter.macs == 4 * 2 * H * per_head, spec


def test_export_config_switches_the_backbone():
    # tools/export_swapped.py's config: BEiT -> MiTABEiT with the settings, same keys
    cfg = mita_config(load_config(TINY_BEIT), dict(pool_size=5, topk=25))
    assert cfg.model.backbone.type == 'MiTABEiT'
    assert cfg.model.backbone.mita_cfg == dict(pool_size=5, topk=25)
    base, mita = (MODELS.build(c.model) for c in (load_config(TINY_BEIT), cfg))
    assert list(mita.state_dict()) == list(base.state_dict())
    assert [(a.pool_size, a.topk) for a in (layer.attn for layer in mita.backbone.layers)] == [
        (5, 25)] * 4
    mae = load_config(ZOO['mae-b'])
    assert mita_config(mae, {}).model.backbone.type == 'MiTAMAE'


def test_bad_settings():
    # MiTA settings are checked where the backbone is built, naming the bad value
    with pytest.raises(ValueError, match='pool_size=0: pool_size must be an int >= 1'):
        MiTABEiT(img_size=(32, 32), num_layers=1, mita_cfg=dict(pool_size=0))
    # an unknown setting lists the allowed ones
    with pytest.raises(ValueError, match="unknown MiTA setting 'topK'.*allowed: pool_size"):
        MiTAMAE(img_size=(32, 32), num_layers=1, mita_cfg=dict(topK=4))
    # BEiT/MAE checkpoints have no DWC weights
    with pytest.raises(ValueError, match='with_dwc=True is not available for BEiT/MAE'):
        MiTABEiT(img_size=(32, 32), num_layers=1, mita_cfg=dict(with_dwc=True))
    # mita_layers must exist
    with pytest.raises(ValueError, match=r'mita_layers \[4\] out of range'):
        MiTABEiT(img_size=(32, 32), num_layers=2, mita_layers=[4])
    # MiTABEiTAttention built directly: the same checks
    with pytest.raises(ValueError, match='topk=0: topk must be an int >= 1'):
        MiTABEiTAttention(64, 4, (4, 4), topk=0)


# ----------------------------------------------------------------------------------------
# Bad input: a model evaluated at a grid its bias table was not built for.
# ----------------------------------------------------------------------------------------
def test_grid_mismatch_is_a_clear_error(zoo):
    name, cfg, path = zoo
    image = (128, 192)                          # an 8x12 grid; the tables are for 8x10
    model = build(cfg, path, dict(mode='whole'))
    # mmseg's own BEiT fails with a broadcasting error (MAE in its pos_embed already) ...
    with pytest.raises(RuntimeError, match='size of tensor'):
        logits(model, image)
    # ... which our tools turn into the error below (guard_grids), swapped or not
    assert guard_grids(model) == 1
    with pytest.raises(GridMismatchError):
        logits(model, image)
    swap_attention(model, verbose=False)
    with pytest.raises(GridMismatchError) as err:
        logits(model, image)
    message = str(err.value)
    assert 'built for a 8x10 patch grid' in message and 'this input has a 8x12 grid' in message
    assert "test_cfg=dict(mode='slide', crop_size=<img_size>" in message
    assert 'resize_rel_pos_embed' in message
    assert isinstance(err.value, ValueError)
    # the module alone checks its tokens too
    with pytest.raises(GridMismatchError, match='21 tokens are not a cls token followed by '
                       'the 4x4 patch grid'):
        MiTABEiTAttention(64, 4, (4, 4))(torch.randn(1, 21, 64))


def test_inferencer_grid_mismatch_is_a_clear_error(zoo):
    # MiTASegInferencer guards the grid as init_model does
    name, cfg, path = zoo
    config = load_config(ZOO[name])
    config.model = copy.deepcopy(cfg)
    config.model.test_cfg = dict(mode='whole')
    model = MiTASegInferencer(config, weights=path, mita_cfg='7:49', device='cpu').model
    with pytest.raises(GridMismatchError, match='built for a 8x10 patch grid'):
        logits(model, (128, 192))


def test_checkpoint_of_another_grid_says_what_to_do(zoo, tmp_path):
    # a checkpoint trained at 128x160 loaded into the model of another crop
    name, cfg, path = zoo
    model = MODELS.build(model_cfg(MITA_CONFIGS[name], crop=(128, 128)))
    with pytest.raises(CheckpointMismatchError) as err:
        check_checkpoint_keys(model, torch.load(path, weights_only=True), path)
    message = str(err.value)
    # the keys in one group: backbone.layers.{0..N}.attn.relative_position_bias_table
    assert re.search(r'backbone\.layers\.\{0\.\.\d+\}\.attn\.relative_position_bias_table: '
                     r'checkpoint \(\d+, \d+\) vs model \(\d+, \d+\)', message), message
    assert 'relative position bias table was built for another patch grid' in message
    assert "mode='slide'" in message and 'resize_rel_pos_embed' in message


def cpu_backend(N, d, window=(32, 32), pool=(7, 7), topk=49):
    """The backend a CPU run of a MiTA BEiT layer picks (with the bias)."""
    q = torch.empty(1, 1, 1, d).expand(1, 1, N, d)
    bias = RelPosBias(torch.empty(1, table_size(window)), window)
    return select_backend(Inputs(q, q, q, window, pool, topk, bias=bias))


# ----------------------------------------------------------------------------------------
# FLOPs: the bias counted on both sides, one add = one FLOP.
# ----------------------------------------------------------------------------------------
def test_flops_count_the_bias_on_both_sides():
    # the tiny BEiT at 256x256: N = 1 + 32 x 32 = 1025, 4 layers, 2 heads of 32 channels
    cfg = load_config(TINY_BEIT)
    counter = SegmentorFlops(cfg, dict(pool_size=7, topk=49), device='meta')
    base, mita = counter.count((256, 256))
    L, H, N, d = 4, 2, 1025, 32
    bias_adds = L * H * N**2                     # BEiT adds the dense bias: N^2 per head
    assert base.by_operator['rel_pos_bias'] == bias_adds
    assert base.backbone_attention == L * attention_flops(1, H, N, d) + bias_adds
    assert base.macs == base.total - bias_adds - sum(
        base.by_operator.get(k, 0) for k in ('batch_norm', 'layer_norm', 'upsample_bilinear2d',
                                             'adaptive_avg_pool2d'))
    backend = cpu_backend(N, d)                   # counted for the backend a CPU run picks
    with_bias = mita_flops(1, H, N, d, 49, 49, backend=backend, with_bias=True)
    assert with_bias == mita_flops(1, H, N, d, 49, 49, backend=backend) + H * bias_flops_per_head(
        N, 49, 49)
    assert 'rel_pos_bias' not in mita.by_operator
    assert mita.backbone_attention == L * with_bias
    assert mita.backbone_rest == base.backbone_rest
    # the MiTA config counts as the swap
    configured, _ = SegmentorFlops(load_config(MITA_TINY_BEIT), device='meta').count((256, 256))
    assert configured.backbone_attention == mita.backbone_attention


@pytest.mark.parametrize('setting', ['topk:5', 'window:3', 'topk:100', '2:4'])
def test_the_kinds_bias_adds_counted_in_the_trace(setting):
    """Top-k and window add the bias by plain adds in the trace (MiTA inside its op): the
    trace counts them as the analytic count does, and nothing else (index arithmetic,
    merged outputs); topk:100 is dense attention, and counts as the dense BEiT layer."""
    torch.manual_seed(0)
    base = BEiTAttention(16, 2, (6, 6)).eval()
    torch.nn.init.normal_(base.relative_position_bias_table)
    x = torch.randn(1, 37, 16)
    with torch.no_grad():
        dense = count_flops(base, (x, ))
        layer = MiTABEiTAttention.from_beit(copy.deepcopy(base), MiTASetting.parse(setting))
        traced = count_flops(layer, (x, ))
        with AttentionMacCounter(layer) as analytic:
            layer(x)
    assert traced.attention == analytic.macs
    if setting == 'topk:100':
        assert traced.attention == dense.attention
        assert traced.by_operator['rel_pos_bias'] == dense.by_operator['rel_pos_bias']


@pytest.mark.slow
def test_get_flops_tool_on_the_beit_config(tools, tmp_path):
    out = tmp_path / 'flops.json'
    _, text = tools('tools/get_flops.py', ZOO['beit-b'], '--swap-attn', 'mita', '--device',
                    'meta', '--json', out)
    result = json.loads(out.read_text())
    L, H, N, d = 12, 12, 1601, 64
    assert result['baseline']['backbone_attention'] == pytest.approx(
        L * (attention_flops(1, H, N, d) + H * N**2) / 1e9)
    assert result['mita']['backbone_attention'] == pytest.approx(
        L * mita_flops(1, H, N, d, 49, 49, backend=cpu_backend(N, d, (40, 40)),
                       with_bias=True) / 1e9)
    assert 'MiTA: 12 attention modules swapped, pool_size=7, topk=49' in text
    assert 'Relative position bias (BEiT/MAE), in attention: one add = one FLOP' in text
    assert result['reduction_percent']['backbone'] > 0


# ----------------------------------------------------------------------------------------
# init_model(img_size=...): BEiT/MAE built for another whole-image size, tables interpolated
# ----------------------------------------------------------------------------------------
def test_resize_rel_pos_table_keeps_what_it_should():
    from mita_seg.apis.model import resize_rel_pos_table
    src, dst, heads = 8, 12, 3                      # grids 8x8 -> 12x12
    rows = lambda s: (2 * s - 1) ** 2 + 3           # noqa: E731
    table = torch.randn(rows(src), heads, generator=torch.Generator().manual_seed(0))
    out = resize_rel_pos_table(table, rows(dst))
    assert out.shape == (rows(dst), heads) and out.dtype == table.dtype
    assert torch.equal(out[-3:], table[-3:])        # the class token's three distances
    # the geometric sequence keeps distances 0 and +-1 on source points: exact there
    grid_in = table[:-3].view(2 * src - 1, 2 * src - 1, heads)
    grid_out = out[:-3].view(2 * dst - 1, 2 * dst - 1, heads)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            torch.testing.assert_close(grid_out[dst - 1 + dy, dst - 1 + dx],
                                       grid_in[src - 1 + dy, src - 1 + dx])
    flat = torch.full_like(table, 0.25)             # a constant stays constant
    torch.testing.assert_close(resize_rel_pos_table(flat, rows(dst)),
                               torch.full((rows(dst), heads), 0.25))
    assert resize_rel_pos_table(table, rows(src)) is table


@pytest.mark.parametrize('name', list(ZOO))
def test_init_model_builds_beit_for_another_size(name, tmp_path):
    from mita_seg.apis import init_model
    cfg = get_config(ZOO[name])
    cfg.model = model_cfg(ZOO[name], crop=(128, 128))          # an 8x8 grid
    cfg.model.test_cfg = dict(mode='whole')
    torch.manual_seed(0)
    zoo_model = MODELS.build(cfg.model)
    zoo_model.init_weights()
    for layer in zoo_model.backbone.layers:
        torch.nn.init.normal_(layer.attn.relative_position_bias_table, std=0.5)
    path = str(tmp_path / 'model.pth')
    save_zoo(zoo_model, path)
    saved = zoo_model.state_dict()
    model = init_model(cfg, path, img_size=(192, 192))          # a 12x12 grid
    assert tuple(model.backbone.img_size) == (192, 192)
    state = model.state_dict()
    for i in range(len(model.backbone.layers)):
        key = f'backbone.layers.{i}.attn.relative_position_bias_table'
        assert state[key].shape[0] == 23 * 23 + 3 and saved[key].shape[0] == 15 * 15 + 3
        assert torch.equal(state[key][-3:], saved[key][-3:])
        centre = lambda t, s: t[:-3].view(2 * s - 1, 2 * s - 1, -1)[s - 1, s - 1]  # noqa
        torch.testing.assert_close(centre(state[key], 12), centre(saved[key], 8))
    if name == 'mae-b':                             # the absolute embedding too, cls row kept
        assert state['backbone.pos_embed'].shape[1] == 1 + 144
        torch.testing.assert_close(state['backbone.pos_embed'][:, 0],
                                   saved['backbone.pos_embed'][:, 0])
    # every other weight is the checkpoint's; the model runs whole at the new size
    for key, value in saved.items():
        if 'relative_position' not in key and key != 'backbone.pos_embed':
            assert torch.equal(state[key], value), key
    out = logits(model, (192, 192))
    assert out.shape == (1, 150, 192, 192) and torch.isfinite(out).all()
    # the config's own size: nothing rebuilt or interpolated
    same = init_model(cfg, path, img_size=(128, 128))
    assert all(torch.equal(v, saved[k]) for k, v in same.state_dict().items())
    with pytest.raises(ValueError, match='square grids only'):
        init_model(cfg, path, img_size=(192, 256))
    with pytest.raises(ValueError, match=r'int64 position index per layer, \d+\.\d GiB'):
        init_model(cfg, path, img_size=(8192, 8192))
