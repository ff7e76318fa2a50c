"""MiTA modules run on any image mmseg's ViT runs on (at least one patch): the landmark grid
is at most the patch grid (``min(P, h) x min(P, w)``), ``k`` at most ``N``, ``router_topk`` at
most ``M``, logged once; down to a 1x1 grid through the backbone, the head and
``tools/test.py``. Also: MiTA settings are checked when a module is built, not at its first
forward."""
import copy

import pytest
import torch
from mmseg.models.backbones import VisionTransformer
from mmseg.models.decode_heads import SegmenterMaskTransformerHead

from mita_seg.models import attention
from mita_seg.models import (MITA_DEFAULTS, MiTAAttention, MiTASegmenterMaskTransformerHead,
                             MiTAVisionTransformer)

VIT = dict(img_size=(64, 64), patch_size=16, embed_dims=32, num_layers=2, num_heads=2,
           out_indices=(0, 1))
# route-only MiTA with k >= N is softmax attention: the outputs of mmseg's modules
EXACT = dict(pool_size=7, topk=49, with_shared_expert=False)


def test_published_defaults_are_defined_once():
    assert MITA_DEFAULTS == dict(pool_size=7, topk=49, router_topk=1, with_shared_expert=True,
                                 shared_scale=None)
    attn = MiTAAttention(32, 2)
    assert {k: getattr(attn, k) for k in MITA_DEFAULTS} == MITA_DEFAULTS


def test_settings_are_checked_when_built():
    # pool_size: an int >= 1 or a pair of them
    with pytest.raises(ValueError, match=r'pool_size=0: pool_size must be an int >= 1'):
        MiTAAttention(32, 2, pool_size=0)
    with pytest.raises(ValueError, match=r"pool_size='7': pool_size must be an int >= 1"):
        MiTAAttention(32, 2, pool_size='7')
    # topk and router_topk: ints >= 1
    with pytest.raises(ValueError, match=r'topk=-3: topk must be an int >= 1'):
        MiTAAttention(32, 2, topk=-3)
    with pytest.raises(ValueError, match=r'router_topk=0: router_topk must be an int >= 1'):
        MiTAAttention(32, 2, router_topk=0)
    # shared_scale: > 0 or None
    with pytest.raises(ValueError,
                       match=r'shared_scale=0: shared_scale must be a finite number > 0'):
        MiTAAttention(32, 2, shared_scale=0)
    # through a config, the backbone's mita_cfg too
    with pytest.raises(ValueError, match=r"unknown MiTA setting 'top_k'; allowed: pool_size"):
        MiTAVisionTransformer(**VIT, mita_cfg=dict(top_k=3))
    # reconfiguring checks the same way
    with pytest.raises(ValueError, match=r'topk=0'):
        MiTAAttention(32, 2).configure(topk=0)


def vit_pair(**mita_cfg):
    """mmseg's ViT and a MiTA ViT with the same weights."""
    torch.manual_seed(0)
    vit = VisionTransformer(**VIT)
    mita = MiTAVisionTransformer(**VIT, mita_cfg=mita_cfg)
    mita.load_state_dict(vit.state_dict(), strict=True)
    vit.eval(), mita.eval()             # (mmseg's ViT.train() returns None)
    return vit, mita


@pytest.mark.parametrize('image', [(16, 16), (32, 32), (48, 80), (20, 9)],
                         ids=['1x1', '2x2', '3x5', '2x1-padded'])
def test_backbone_runs_on_small_grids(image, log_records):
    attention._ADAPTED.clear()          # what earlier tests of this process had logged
    vit, mita = vit_pair(**EXACT)
    x = torch.randn(2, 3, *image)
    with torch.no_grad(), log_records() as log:
        outs, refs = mita(x), vit(x)
        mita(x)                                            # logged once, not per call
    h, w = mita._mita_grid.hw_shape
    assert (h, w) == tuple(-(-s // 16) for s in image)     # mmseg pads to whole patches
    for out, ref in zip(outs, refs):
        assert out.shape == (2, 32, h, w)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    said = [m for m in log.messages if 'runs with fewer' in m]
    assert len(said) == 1, log.messages
    # each setting reduced, and why; router_topk=1 fits every grid and is not mentioned
    assert (f'on a {h}x{w} grid (N={1 + h * w} tokens) runs with fewer: pool_size (7, 7) -> '
            f'{(min(7, h), min(7, w))}: the grid is {h}x{w}; topk 49 -> {1 + h * w}: there '
            f'are N={1 + h * w} tokens (logged once)') in said[0]
    assert 'router_topk' not in said[0]


def test_default_settings_on_a_1x1_grid():
    # the published M = 7x7, k = 49 with the shared expert on a 16x16 image (one patch)
    _, mita = vit_pair()
    out = mita(torch.randn(1, 3, 16, 16))
    assert out[-1].shape == (1, 32, 1, 1) and torch.isfinite(out[-1]).all()
    out[-1].sum().backward()                               # and it trains
    assert all(p.grad is not None for p in mita.parameters() if p.requires_grad)


def test_router_topk_is_at_most_the_experts(log_records):
    attention._ADAPTED.clear()
    attn = MiTAAttention(32, 2, pool_size=3, topk=4, router_topk=4)
    with log_records() as log:
        ran = attn.setting_on(1 + 2 * 1, (2, 1))
        assert (ran.pool, ran.topk, ran.router_topk) == ((2, 1), 3, 2)
        assert attn.setting_on(1 + 5 * 5, (5, 5)) is attn.setting     # nothing to adapt
    assert log.messages == [
        'MiTAAttention on a 2x1 grid (N=3 tokens) runs with fewer: pool_size (3, 3) -> (2, 1): '
        'the grid is 2x1; topk 4 -> 3: there are N=3 tokens; router_topk 4 -> 2: there are '
        'M=2 landmarks (logged once)']


@pytest.mark.parametrize('grid', [(1, 1), (2, 3)])
def test_segmenter_head_on_small_grids(grid):
    kw = dict(in_channels=32, channels=32, num_classes=5, num_layers=2, num_heads=2,
              embed_dims=32, dropout_ratio=0.0)
    torch.manual_seed(0)
    ref = SegmenterMaskTransformerHead(**kw).eval()
    head = MiTASegmenterMaskTransformerHead(**kw, mita_cfg=EXACT).eval()
    head.load_state_dict(ref.state_dict(), strict=True)
    x = [torch.randn(2, 32, *grid)]
    with torch.no_grad():
        out = head(x)
        torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)
    assert out.shape == (2, 5, *grid) and head._mita_grid.hw_shape == grid
    default = copy.deepcopy(head)
    for layer in default.layers:
        layer.attn.configure(**MITA_DEFAULTS)
    assert torch.isfinite(default(x)).all()


@pytest.mark.slow
def test_test_py_on_a_1x1_grid(segmenter_ckpt, tools, tmp_path):
    """The tiny Segmenter (patch 8) evaluated on 8x8 images: one patch, a 1x1 grid."""
    config, ckpt = segmenter_ckpt
    opts = ['--cfg-options', 'test_dataloader.dataset.pipeline.1.scale=(8,8)',
            'test_dataloader.dataset.pipeline.1.keep_ratio=False']
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'a', *opts)
    base = tools.miou(out)
    # route-only with k >= N (the head has 1 + 150 class tokens): softmax attention
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'b', '--mita-cfg',
                   'with_shared_expert=False', 'topk=1000', *opts)
    assert ('on a 1x1 grid (N=2 tokens) runs with fewer: pool_size (7, 7) -> (1, 1): the '
            'grid is 1x1; topk 1000 -> 2: there are N=2 tokens') in out
    assert tools.miou(out) == base
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'c', '--swap-attn',
                   'mita', *opts)
    assert 'on 4 images, 4 attention modules on MiTA: aAcc: ' in out
