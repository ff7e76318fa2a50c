"""swap_attention on mmseg's own configs (Segmenter ViT-T, DeiT-S UperNet, Swin), built with
seeded random weights and saved as model-zoo checkpoints (``meta`` + ``state_dict``).

Inputs are 128x160 (an 8x10 patch grid, non-square) to stay fast; about 40 s on 2 cores.
BEiT and MAE (relative position bias): tests/test_beit_swap.py.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmengine.hub import get_config
from mmengine.runner import load_checkpoint
from mmseg.models.backbones import BEiT, VisionTransformer
from mmseg.models.backbones.mit import EfficientMultiheadAttention
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from mita_seg import swap_attention
from mita_seg.models import MiTAAttention, MiTABEiTAttention

register_all_modules()

CONFIGS = {
    'segmenter_vit-t': 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py',
    'deit-s_upernet': 'mmseg::vit/vit_deit-s16_upernet_8xb2-160k_ade20k-512x512.py',
}
SWIN = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
IMG = (128, 160)
WHOLE = dict(mode='whole')
SLIDE = dict(mode='slide', crop_size=(128, 128), stride=(96, 96))   # 2 crops of 8x8
# Route-only MiTA with every key in every expert: exactly softmax attention.
EXACT = dict(pool_size=2, topk=10**6, with_shared_expert=False)


def model_cfg(name):
    cfg = get_config(name).model
    cfg.pretrained = None           # no download: seeded random weights instead
    cfg.backbone.init_cfg = None
    cfg.backbone.pop('pretrained', None)
    if cfg.decode_head.type == 'UPerHead':   # narrower UperNet (no attention in it): 4x faster
        cfg.decode_head.channels = 128
        cfg.auxiliary_head.channels = 64
    return cfg


@pytest.fixture(scope='module', params=list(CONFIGS))
def zoo(request, tmp_path_factory):
    """(name, model config, path of a model-zoo style checkpoint with random weights)."""
    cfg = model_cfg(CONFIGS[request.param])
    torch.manual_seed(0)
    model = MODELS.build(cfg)
    model.init_weights()
    path = tmp_path_factory.mktemp(request.param) / 'model.pth'
    meta = dict(mmseg_version='1.2.2', dataset_meta=dict(classes=[f'c{i}' for i in range(150)]))
    torch.save({'meta': meta, 'state_dict': model.state_dict()}, path)
    return request.param, cfg, str(path)


def load(cfg, path, test_cfg=WHOLE):
    cfg = copy.deepcopy(cfg)
    cfg.test_cfg = test_cfg
    model = MODELS.build(cfg)
    load_checkpoint(model, path, map_location='cpu', strict=True, logger='silent')
    return model.eval()


def logits(model, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(1, 3, *IMG)
    metas = [dict(ori_shape=IMG, img_shape=IMG, pad_shape=IMG, padding_size=[0, 0, 0, 0])]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')      # topk > N is clamped with a warning
        return model.inference(x, metas)


def num_attention(model):
    return sum(type(m) is MultiheadAttention for m in model.modules())


def test_zoo_checkpoint_swap_keeps_keys_and_reloads(zoo):
    name, cfg, path = zoo
    model = load(cfg, path)
    ref = logits(model)
    keys = list(model.state_dict())
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    head = 2 if name.startswith('segmenter') else 0
    expected = num_attention(model) - head   # the encoder's 12 (the paper's swap)

    n = swap_attention(model, verbose=False)

    assert n == expected == 12
    assert num_attention(model) == head      # Segmenter's mask head: on request only
    assert list(model.state_dict()) == keys
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    load_checkpoint(model, path, map_location='cpu', strict=True, logger='silent')
    out = logits(model)
    assert out.shape == ref.shape == (1, 150, *IMG)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, ref, atol=1e-4)   # k=49 < N=81: MiTA differs


@pytest.mark.parametrize('test_cfg', [WHOLE, SLIDE], ids=['whole', 'slide'])
def test_route_only_full_topk_equals_softmax_attention(zoo, test_cfg):
    _, cfg, path = zoo
    model = load(cfg, path, test_cfg)
    ref = logits(model)
    swap_attention(model, verbose=False, **EXACT)
    assert all(isinstance(m.attn, MiTAAttention) for m in model.backbone.layers)
    torch.testing.assert_close(logits(model), ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope='module')
def segmenter():
    cfg = model_cfg(CONFIGS['segmenter_vit-t'])
    torch.manual_seed(0)
    return cfg, MODELS.build(cfg).eval()


def test_layers_selection(segmenter, log_records):
    cfg, base = segmenter
    model = copy.deepcopy(base)
    assert swap_attention(model, layers=[0, -1], verbose=False,
                          include_head=True) == 4   # 2 + 2 head layers
    kinds = [type(layer.attn) for layer in model.backbone.layers]
    assert kinds == [MiTAAttention] + [MultiheadAttention] * 10 + [MiTAAttention]
    assert all(isinstance(layer.attn, MiTAAttention) for layer in model.decode_head.layers)

    model = copy.deepcopy(base)
    with log_records() as records:   # the encoder only by default: the head is logged
        assert swap_attention(model, layers=[3]) == 1
    assert all(type(layer.attn) is MultiheadAttention for layer in model.decode_head.layers)
    log = '\n'.join(records.messages)
    assert 'left backbone.layers.0.attn alone: MultiheadAttention: not in layers=[3]' in log
    assert 'left decode_head.layers.1.attn alone: MultiheadAttention: in a decode head' in log

    # a head already on MiTA is reconfigured only when the head is asked for
    model = copy.deepcopy(base)
    swap_attention(model, topk=16, include_head=True, verbose=False)
    with log_records() as records:   # all 14 are on MiTA; no false "left alone" lines
        assert swap_attention(model, topk=8) == 14
    log = '\n'.join(records.messages)
    assert 'swap_attention: 12 attention modules on MiTA' in log
    assert '2 more on MiTA as they were' in log and 'alone' not in log
    assert [layer.attn.topk for layer in model.decode_head.layers] == [16, 16]
    assert swap_attention(model, topk=8, include_head=True, verbose=False) == 14
    assert [layer.attn.topk for layer in model.decode_head.layers] == [8, 8]

    # layers must exist in the backbone
    with pytest.raises(ValueError, match='out of range'):
        swap_attention(copy.deepcopy(base), layers=[12], verbose=False)


def test_swapping_twice_reconfigures(segmenter):
    _, base = segmenter
    model = copy.deepcopy(base)
    ref = logits(model)
    both = dict(include_head=True, verbose=False)
    assert swap_attention(model, pool_size=7, topk=49, **both) == 14
    modules = [m for m in model.modules() if isinstance(m, MiTAAttention)]
    assert not torch.allclose(logits(model), ref, atol=1e-4)

    assert swap_attention(model, **EXACT, **both) == 14
    assert [m for m in model.modules() if isinstance(m, MiTAAttention)] == modules
    assert all(m.pool_size == 2 and m.topk == 10**6 and not m.with_shared_expert
               for m in modules)
    torch.testing.assert_close(logits(model), ref, rtol=1e-4, atol=1e-4)

    # a deep copy (EMA, export) carries the grid plumbing over to the copy
    twin = copy.deepcopy(model)
    del model
    torch.testing.assert_close(logits(twin), ref, rtol=1e-4, atol=1e-4)


def test_swin_raises_naming_what_it_found():
    cfg = model_cfg(SWIN)
    model = MODELS.build(cfg)
    # windowed attention only: an error, not a silent no-op
    with pytest.raises(ValueError, match=r'no global attention.*\n.*WindowMSA') as err:
        swap_attention(model)
    assert 'backbone.stages.0.blocks.0.attn' in str(err.value)
    assert 'windowed attention (Swin)' in str(err.value)


def test_mixed_model_reports_unswappable_by_name(log_records):
    model = nn.ModuleDict(dict(
        vit=VisionTransformer(img_size=(32, 32), embed_dims=32, num_layers=2, num_heads=2),
        beit=BEiT(img_size=(32, 32), embed_dims=32, num_layers=1, num_heads=2),
        segformer=EfficientMultiheadAttention(32, 2, sr_ratio=2)))
    with log_records() as records:
        assert swap_attention(model, pool_size=2, topk=4) == 3
    assert isinstance(model['vit'].layers[1].attn, MiTAAttention)
    assert isinstance(model['beit'].layers[0].attn, MiTABEiTAttention)   # tests/test_beit_swap
    log = '\n'.join(records.messages)
    assert 'left segformer alone: EfficientMultiheadAttention: spatial-reduction' in log
    out = model['vit'](torch.randn(2, 3, 32, 48))
    assert out[0].shape == (2, 32, 2, 3) and torch.isfinite(out[0]).all()
