"""FLOP counting with attention (mita_seg.analysis, tools/get_flops.py).

Budget: about 1.5 min on 2 cores, most of it in ``test_tool_real_configs`` (mmseg's
Segmenter ViT-T, ViT-B UperNet, SETR ViT-L at 512 and Swin-T UperNet, built from the real
configs with random weights).
"""
import copy
import json
import os.path as osp

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmseg.models.backbones.vit import TransformerEncoderLayer
from mmseg.structures import SegDataSample
from torch.utils.flop_counter import FlopCounterMode

from mita_seg.analysis.flop_count import count_flops
from mita_seg.analysis.flop_handles import CONVENTION
from mita_seg.analysis.segmentor_cost import (SegmentorFlops, decode_head_called_as_module,
                                              inference_crops, slide_crops)
from mita_seg.apis import load_config
from mita_seg.models import MiTAAttention
from mita_seg.ops import Inputs, attention_flops, mita_flops, select_backend

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SEGMENTER_T = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
VIT_B_UPERNET = 'mmseg::vit/vit_vit-b16_mln_upernet_8xb2-80k_ade20k-512x512.py'
SETR = 'mmseg::setr/setr_vit-l_pup_8xb2-160k_ade20k-512x512.py'
SWIN_T = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'

B, N, C, HEADS = 2, 50, 64, 4


def cpu_backend():
    """The backend a CPU run of the MiTA layers below picks."""
    q = torch.empty(1, 1, 1, 1)
    return select_backend(Inputs(q, q, q, (1, 1), (1, 1), 1))


# ----------------------------------------------------------------------------------------
# Standard attention: 2 N^2 C whichever path torch takes.
# ----------------------------------------------------------------------------------------
class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` called as user code does, in one of its paths."""

    def __init__(self, need_weights=True, mask=False):
        super().__init__()
        self.attn = nn.MultiheadAttention(C, HEADS, batch_first=True)
        self.need_weights, self.mask = need_weights, mask

    def forward(self, x):
        mask = torch.zeros(x.shape[1], x.shape[1]) if self.mask else None
        return self.attn(x, x, x, need_weights=self.need_weights, attn_mask=mask)[0]


class SDPAAttention(nn.Module):
    """timm-style attention on ``F.scaled_dot_product_attention``, optionally with grouped
    key/value heads (GQA)."""

    def __init__(self, kv_heads=HEADS):
        super().__init__()
        self.d, self.kv_heads = C // HEADS, kv_heads
        self.q = nn.Linear(C, C)
        self.kv = nn.Linear(C, 2 * kv_heads * self.d)
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != HEADS)
        return self.proj(out.transpose(1, 2).reshape(b, n, C))


def torch_encoder_layer():
    return nn.TransformerEncoderLayer(C, HEADS, 4 * C, dropout=0., batch_first=True)


def vit_layer():
    """mmseg's ViT layer, with mmcv's MultiheadAttention as mmseg builds it."""
    return TransformerEncoderLayer(embed_dims=C, num_heads=HEADS, feedforward_channels=4 * C)


@pytest.mark.parametrize('make, train, op', [
    (vit_layer, False, 'bmm'),
    (vit_layer, True, 'bmm'),
    (lambda: MultiheadAttention(C, HEADS, batch_first=True), False, 'bmm'),
    (lambda: TorchMHA(), False, 'native_mha_attention'),       # fused fast path
    (lambda: TorchMHA(), True, 'bmm'),
    (lambda: TorchMHA(need_weights=False), True, 'scaled_dot_product_attention'),
    (lambda: TorchMHA(mask=True), True, 'baddbmm'),
    (lambda: SDPAAttention(), False, 'scaled_dot_product_attention'),
    (lambda: torch_encoder_layer(), False, 'native_mha_attention'),
], ids=['mmseg-vit-layer-eval', 'mmseg-vit-layer-train', 'mmcv-mha', 'torch-mha-fastpath',
        'torch-mha-bmm', 'torch-mha-sdpa', 'torch-mha-baddbmm', 'sdpa', 'torch-encoder-layer'])
def test_standard_attention_is_2_n2_c(make, train, op):
    torch.manual_seed(0)
    model = make()
    model.train(train)
    x = torch.randn(B, N, C)
    with torch.set_grad_enabled(train):
        flops = count_flops(model, (x, ))
    assert flops.by_operator.get(op, 0) > 0, f'{op} not traced: {flops.by_operator}'
    assert flops.attention == attention_flops(B, HEADS, N, C // HEADS) == 2 * B * N**2 * C


def test_torch_mha_paths_count_the_same():
    """The fused fast path counts its projections too: every path of the same module gives
    the same total, 4 N C^2 (projections) + 2 N^2 C (attention) per batch item."""
    torch.manual_seed(0)
    model, x = TorchMHA(), torch.randn(B, N, C)
    totals = []
    for train, need_weights in ((False, True), (True, True), (True, False)):
        model.train(train)
        model.need_weights = need_weights
        with torch.set_grad_enabled(train):
            totals.append(count_flops(model, (x, )).total)
    assert totals == [B * (4 * N * C * C + 2 * N * N * C)] * 3

    # nn.TransformerEncoderLayer: fused attention in eval, unfused in training
    model = torch_encoder_layer()
    with torch.no_grad():
        fused = count_flops(model.eval(), (x, ))
    with torch.enable_grad():
        unfused = count_flops(model.train(), (x, ))
    assert 'native_mha_proj' in fused.by_operator
    assert 'scaled_dot_product_attention' in unfused.by_operator
    assert fused.total == unfused.total and fused.attention == unfused.attention


def test_sdpa_grouped_query_attention():
    torch.manual_seed(0)
    flops = count_flops(SDPAAttention(kv_heads=2).eval(), (torch.randn(B, N, C), ))
    # every query head attends over all N keys of its group
    assert flops.attention == attention_flops(B, HEADS, N, C // HEADS)


# ----------------------------------------------------------------------------------------
# MiTA: the analytic count of the implementation.
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize('grid, pool, topk, router_topk, shared, batch', [
    ((7, 7), 7, 49, 1, True, 1),
    ((6, 10), (3, 4), 20, 1, True, 2),      # non-square grid, not a multiple of the pool
    ((6, 10), 3, 16, 2, False, 2),          # router top-2, route-only
], ids=['7x7-M49-k49', '6x10-M12-k20', '6x10-M9-k16-r2-route-only'])
def test_mita_count_is_mita_flops(grid, pool, topk, router_topk, shared, batch,
                                  monkeypatch):
    torch.manual_seed(0)
    h, w = grid
    n = 1 + h * w
    attn = MiTAAttention(C, HEADS, pool_size=pool, topk=topk, router_topk=router_topk,
                         with_shared_expert=shared).eval()

    class Layer(nn.Module):

        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x, hw_shape=grid)

    x = torch.randn(batch, n, C)
    ph, pw = (pool, pool) if isinstance(pool, int) else pool
    args = (batch, HEADS, n, C // HEADS, ph * pw, topk, router_topk, shared)
    flops = count_flops(Layer(), (x, ))
    expected = mita_flops(*args, backend=cpu_backend())
    assert flops.by_operator['mita_attention'] == flops.attention == expected
    # the projections are the same as standard attention's: 4 N C^2
    assert flops.total - flops.attention == batch * 4 * n * C * C

    # the blocked backend also computes the padding slots of its tiles
    monkeypatch.setenv('MITA_BACKEND', 'blocked')
    blocked = count_flops(Layer(), (x, ))
    assert blocked.attention == mita_flops(*args, backend='blocked')
    assert blocked.attention > mita_flops(*args)     # = (4M + 2k) N C without padding


def test_mita_count_with_global_tokens():
    """A traced MiTA op with global tokens: MiTA over the other tokens plus the global
    tokens' dense parts (mita_flops' num_global_tokens), as the backend a CPU run picks."""
    attn = MiTAAttention(C, HEADS, pool_size=3, topk=12, num_prefix_tokens=1).eval()

    class Layer(nn.Module):

        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x, hw_shape=(6, 7), global_tokens=(1, 5))

    n = 1 + 6 * 7 + 5
    flops = count_flops(Layer(), (torch.randn(2, n, C), ))
    expected = mita_flops(2, HEADS, n, C // HEADS, 9, 12, backend=cpu_backend(),
                          num_global_tokens=6)
    assert flops.attention == expected > mita_flops(2, HEADS, n - 6, C // HEADS, 9, 12,
                                                    backend=cpu_backend())


def test_mita_flops_of_a_k_beyond_the_keys_is_what_runs():
    """mita_attention runs a k beyond the N - T keys it routes over as k = N - T: the
    analytic count says the same, as the traced call does."""
    assert mita_flops(1, 1, 17, 4, 4, 49) == mita_flops(1, 1, 17, 4, 4, 17) == 3400
    assert (mita_flops(2, 3, 20, 8, 4, 99, num_global_tokens=3)
            == mita_flops(2, 3, 20, 8, 4, 17, num_global_tokens=3))


class GridLayer(nn.Module):
    """A swapped attention module called on a given grid, and an adaptive pooling outside
    it (a PSP head's): its count must stay mmengine's."""

    def __init__(self, attn, grid):
        super().__init__()
        self.attn, self.grid = attn, grid
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x):
        y = self.attn(x, hw_shape=self.grid)
        return y, self.pool(y.unsqueeze(0))


# 5 x 7 grid + cls: non-square, not a multiple of the blocks, pools or windows asked.
@pytest.mark.parametrize('spec', ['3:10', '2x4:99:route', 'agent:3', 'agent:9', 'block:2:3',
                                  'block:3:2', 'block:4:99', 'topk:6', 'window:4', 'window:9'])
def test_every_kind_counts_as_it_prices(spec):
    """On a ragged grid, for every kind: the traced count (``tools/get_flops.py``) is the
    formula the MAC counter and the equal-cost pricing use (``attention_macs``: block
    attention's padded gathers as executed, pools and windows clamped to the grid), and
    the swap leaves the rest as it was: the projections, ``4 N C^2``, and the pooling
    outside the attention (the agent kind's landmark pooling is not counted, as MiTA's)."""
    from mita_seg.analysis.attention_macs import AttentionMacCounter
    from mita_seg.setting import MiTASetting
    torch.manual_seed(0)
    grid, n = (5, 7), 1 + 5 * 7
    attn = MiTAAttention(C, HEADS, setting=spec).eval()
    layer, x = GridLayer(attn, grid), torch.randn(B, n, C)
    flops = count_flops(layer, (x, ))
    with AttentionMacCounter(layer) as counter, torch.no_grad():
        layer(x)
    setting = MiTASetting.parse(spec)
    glob = 0 if setting.is_mita else 1          # the other kinds take cls as global
    priced = B * HEADS * setting.attention_macs(grid, n, C // HEADS, glob)
    assert flops.attention == counter.macs == priced
    assert flops.total - flops.attention == B * 4 * n * C * C + B * n * C  # + outside pool
    assert flops.by_operator['adaptive_avg_pool2d'] == B * n * C


def test_block_flops_on_a_ragged_grid():
    """5 x 5 grid, 2 x 2 blocks (nb = 9, the last row and column of blocks smaller), 2 per
    query: ``n nb d + 2 n b bh bw d``, every chosen block gathered padded to 4 slots."""
    from mita_seg.ops import block_flops_per_head
    n, d = 25, 8
    assert block_flops_per_head((5, 5), d, 2, 2) == (n * 9 + 2 * n * 2 * 4) * d
    # cls global: + 2 n T d + 2 T (n + T) d
    assert block_flops_per_head((5, 5), d, 2, 2, 1) == (n * 9 + 2 * n * 2 * 4) * d + (
        2 * n + 2 * (n + 1)) * d
    # every block (and a block over the grid): softmax attention
    assert block_flops_per_head((5, 5), d, 2, 9) == block_flops_per_head((5, 5), d, 8, 1) \
        == 2 * n * n * d


# ----------------------------------------------------------------------------------------
# Small segmentors from mmseg's Segmenter config.
# ----------------------------------------------------------------------------------------
MITA_TINY = dict(pool_size=3, topk=12, include_head=True)  # the head too: its class tokens


@pytest.fixture(scope='module')
def tiny(tiny_cfg):
    return SegmentorFlops(tiny_cfg, MITA_TINY, name='tiny-segmenter')


def test_segmentor_breakdown(tiny):
    shape = (64, 96)                                     # 8 x 12 grid, non-square
    base, mita = tiny.count(shape)
    n, d = 1 + 8 * 12, 16
    backend = cpu_backend()
    assert base.backbone_attention == 2 * attention_flops(1, 4, n, d)
    assert base.head_attention == attention_flops(1, 4, 8 * 12 + 10, d)   # + class tokens
    assert mita.backbone_attention == 2 * mita_flops(1, 4, n, d, 9, 12, backend=backend)
    assert mita.head_attention == mita_flops(1, 4, 8 * 12 + 10, d, 9, 12, backend=backend,
                                             num_global_tokens=10)  # global class tokens
    for f in (base, mita):
        assert f.total == f.backbone + f.head           # no neck
        assert f.attention == f.backbone_attention + f.head_attention
        assert f.backbone_rest == base.backbone_rest    # projections, MLPs unchanged
    assert mita.total < base.total and mita.params == base.params


def test_meta_device_counts_like_cpu(tiny_cfg, tiny):
    meta = SegmentorFlops(tiny_cfg, MITA_TINY, device='meta')
    for shape in ((64, 64), (48, 80)):
        for on_cpu, on_meta in zip(tiny.count(shape), meta.count(shape)):
            assert on_cpu.by_operator == on_meta.by_operator
            assert (on_cpu.total, on_cpu.backbone, on_cpu.head,
                    on_cpu.attention) == (on_meta.total, on_meta.backbone, on_meta.head,
                                          on_meta.attention)
    assert next(meta.baseline.parameters()).is_meta


# FlopCounterMode (2 FLOPs per MAC) misses CPU SDPA, the fused MHA kernel and our op.
def _sdpa_cpu(q, k, v, *args, out_shape=None, **kwargs):
    return 2 * q[0] * q[1] * q[2] * k[2] * (q[3] + v[3])


def _native_mha(q, k, v, *args, out_shape=None, **kwargs):
    b, L, E = q
    S = k[1]
    return 2 * (b * (2 * L + 2 * S) * E * E + 2 * b * L * S * E)


def _mita(q, k, v, h, w, ph, pw, topk, router_topk, num_prefix_tokens, with_shared_expert,
          shared_scale, block_size, backend, bias_table=None, window_h=0, window_w=0,
          global_prefix=0, global_suffix=0, out_shape=None, **kwargs):
    return 2 * mita_flops(*q, ph * pw, topk, router_topk, with_shared_expert, block_size,
                          num_global_tokens=global_prefix + global_suffix)


# Keyed by packet: FlopCounterMode looks formulas up by ``func._overloadpacket``.
CUSTOM = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    torch.ops.aten._native_multi_head_attention: _native_mha,
    torch.ops.mita_seg.mita_attention: _mita,
}


def flop_counter_mode(model, x):
    """FlopCounterMode's total, and the ops it counted."""
    counter = FlopCounterMode(display=False, custom_mapping=CUSTOM)
    with torch.no_grad(), counter:
        model(x)
    return counter.get_total_flops(), {str(k) for k in counter.get_flop_counts()['Global']}


SDPA_CPU = 'aten._scaled_dot_product_flash_attention_for_cpu'


@pytest.mark.parametrize('make, train, op', [
    (vit_layer, False, 'aten.bmm'),
    (lambda: TorchMHA(), False, 'aten._native_multi_head_attention'),
    (lambda: TorchMHA(need_weights=False), True, SDPA_CPU),   # train mode: not the fast path
    (SDPAAttention, False, SDPA_CPU),
], ids=['mmseg-vit-layer', 'torch-mha-fastpath', 'torch-mha-sdpa', 'sdpa'])
def test_flop_counter_mode_agrees_on_layers(make, train, op):
    torch.manual_seed(0)
    model = make()
    model.train(train)
    x = torch.randn(B, N, C)
    ours = count_flops(model, (x, ))
    theirs, ops = flop_counter_mode(model, x)
    assert op in ops
    assert ours.macs == pytest.approx(theirs / 2, rel=0.01)


def test_flop_counter_mode_agrees_on_segmentors(tiny):
    x = tiny.inputs((64, 96))
    for model in (tiny.baseline, tiny.mita):
        with decode_head_called_as_module(model):
            ours = count_flops(model, (x, ))
            theirs, ops = flop_counter_mode(model, x)
        assert ours.macs == pytest.approx(theirs / 2, rel=0.01)
        assert ('mita_seg.mita_attention' in ops) == (model is tiny.mita)


# ----------------------------------------------------------------------------------------
# Whole-image cost under test_cfg.
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize('image', [(64, 64), (100, 150), (40, 130)],
                         ids=['one-crop', '2x3-crops', 'smaller-than-crop'])
def test_slide_crops_match_mmseg_slide_inference(tiny_cfg, image):
    cfg = copy.deepcopy(tiny_cfg)
    counter = SegmentorFlops(cfg)
    model = counter.baseline
    shapes = []
    model.backbone.register_forward_pre_hook(lambda m, args: shapes.append(args[0].shape))
    H, W = image
    meta = dict(ori_shape=image, img_shape=image, pad_shape=image)
    data = dict(inputs=[torch.zeros(3, H, W, dtype=torch.uint8)],
                data_samples=[SegDataSample(metainfo=meta)])
    with torch.no_grad():
        model.test_step(data)
    n, crop = slide_crops(image, (64, 64), (48, 48))
    assert n == len(shapes) and all(tuple(s[-2:]) == crop for s in shapes)
    assert inference_crops(model.test_cfg, image) == ('slide', n, crop)

    comparison = counter.compare((64, 64), image)
    assert comparison.image['baseline'] == n * counter.count(crop)[0].total


def test_bad_arguments(tiny):
    # shapes are one or two positive ints
    with pytest.raises(ValueError, match='shape'):
        tiny.compare((64, 0))
    # slide needs positive sizes
    with pytest.raises(ValueError, match='positive'):
        slide_crops((64, 64), (0, 64), (48, 48))
    # test_cfg.mode is whole or slide
    with pytest.raises(ValueError, match='whole'):
        inference_crops(dict(mode='tiles'), (64, 64))
    # devices: cpu or meta
    with pytest.raises(ValueError, match='meta'):
        SegmentorFlops(None, device='cuda')
    # nothing to swap: an error listing the attention modules, not a baseline-only count
    with pytest.raises(ValueError, match='no global attention to swap.*\n.*WindowMSA'):
        SegmentorFlops(load_config(SWIN_T), {}, device='meta')


# ----------------------------------------------------------------------------------------
# The tool on mmseg's real configs.
# ----------------------------------------------------------------------------------------
def get_flops(tools, tmp_path, *args):
    """Run tools/get_flops.py with --json; returns (figures, printed text)."""
    out = tmp_path / 'flops.json'
    _, text = tools('tools/get_flops.py', *args, '--json', out)
    return json.loads(out.read_text()), text


@pytest.mark.slow
def test_tool_real_configs(tmp_path, tools):
    d = 192 // 3
    # Segmenter ViT-T on CPU, as mmseg's tool runs; a slide image of 2 crops.
    result, text = get_flops(tools, tmp_path, SEGMENTER_T, '--mita-cfg', 'pool_size=7',
                             'topk=49', '--image-shape', 512, 683)
    assert set(result) == {'convention', 'shape', 'baseline', 'mita', 'reduction_percent',
                           'image'}
    assert set(result['baseline']) == set(result['mita']) == {
        'total', 'backbone', 'backbone_attention', 'head', 'params'}
    assert result['shape'] == [512, 512] and CONVENTION in result['convention']
    assert result['baseline']['backbone_attention'] == pytest.approx(
        12 * attention_flops(1, 3, 1025, d) / 1e9)
    assert result['mita']['backbone_attention'] == pytest.approx(
        12 * mita_flops(1, 3, 1025, d, 49, 49, backend=cpu_backend()) / 1e9)
    # the paper's swap: the encoder's attention only, the decode head as it was
    base, mita = result['baseline'], result['mita']
    assert mita['head'] == pytest.approx(base['head'])
    assert mita['total'] == pytest.approx(
        base['total'] - base['backbone_attention'] + mita['backbone_attention'])
    assert 30 < result['reduction_percent']['total'] < 35   # 32.7% (40.0% with the head)
    image = result['image']
    assert (image['mode'], image['crops'], image['crop_shape']) == ('slide', 2, [512, 512])
    assert image['baseline'] == pytest.approx(2 * result['baseline']['total'])
    assert 'slide: 2 crops of 512x512' in text and 'decode head' in text
    # the paper's swap: the encoder's 12 layers (the mask head on request)
    assert ('MiTA: 12 attention modules swapped, pool_size=7, topk=49, router_topk=1, '
            'with_shared_expert=True, shared_scale=None') in text

    # ViT-B UperNet and SETR ViT-L: traced on meta (same counts, see above).
    for config, layers, heads, width in ((VIT_B_UPERNET, 12, 12, 768), (SETR, 24, 16, 1024)):
        result, text = get_flops(tools, tmp_path, config, '--swap-attn', 'mita', '--device',
                                 'meta')
        base, mita = result['baseline'], result['mita']
        assert base['backbone_attention'] == pytest.approx(
            layers * attention_flops(1, heads, 1025, width // heads) / 1e9)
        assert mita['backbone'] - mita['backbone_attention'] == pytest.approx(
            base['backbone'] - base['backbone_attention'])
        assert 0 < result['reduction_percent']['total'] < result['reduction_percent'][
            'backbone'] < 100
        assert f'MiTA: {layers} attention modules swapped, pool_size=7, topk=49' in text

    # Swin without a swap: windowed attention counted (q k^T and attn v of the windows)
    result, text = get_flops(tools, tmp_path, SWIN_T, '--device', 'meta', '--shape', 256)
    assert result['mita'] is None and result['reduction_percent'] is None
    assert result['baseline']['backbone_attention'] > 0


@pytest.mark.slow
def test_tool_sweep_and_plot(tmp_path, tiny_cfg, tools):
    config = tmp_path / 'tiny.py'
    tiny_cfg.dump(str(config))
    png = tmp_path / 'sweep.png'
    # the mask head on MiTA too: all the attention grows like N
    result, text = get_flops(tools, tmp_path, config, '--shape', 64, '--mita-cfg',
                             'pool_size=3', 'topk=12', 'include_head=True', '--sweep', 64, 128,
                             256, '--plot', png)
    rows = result['sweep']
    assert [r['size'] for r in rows] == [64, 128, 256]
    assert png.stat().st_size > 10000
    # attention grows like N^2 for the baseline, like N for MiTA (N = (s/8)^2 + 1)
    base = [r['baseline_attention'] for r in rows]
    mita = [r['mita_attention'] for r in rows]
    assert base[2] / base[1] > 12 and mita[2] / mita[1] < 5
    reductions = [1 - r['mita'] / r['baseline'] for r in rows]
    assert reductions == sorted(reductions)
    assert 'GFLOPs against input size' in text
    assert f'{256:>4d}x{256:<5d}{rows[2]["baseline"]:12.1f}' in text
