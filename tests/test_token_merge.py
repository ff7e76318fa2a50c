"""Token merging (ToMe): the ops (mita_seg.ops.token_merge), merge_tokens on mmseg's ViTs,
its FLOP count, and the tools (``--merge-ratio``, ``--merge-ratios``).

Budget: about 25 s on 2 cores for the fast tests; the tools' end-to-end runs are ``slow``.
"""
import copy
import csv
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn.bricks.transformer import FFN, MultiheadAttention
from mmseg.models.backbones import VisionTransformer
from mmseg.models.backbones.vit import TransformerEncoderLayer
from torch.utils.flop_counter import FlopCounterMode

from mita_seg.analysis.flop_count import count_flops
from mita_seg.analysis.segmentor_cost import SegmentorFlops, decode_head_called_as_module
from mita_seg.apis import load_config
from mita_seg.models import (MiTAAttention, NothingToMergeError, ToMeAttention, ToMeFFN,
                             TokenMerger, merge_tokens, swap_attention)
from mita_seg.ops import attention_flops
from mita_seg.ops.token_merge import (bipartite_soft_matching, merge, merge_flops,
                                      merged_count, merged_sizes,
                                      proportional_attention_bias, unmerge)

BEIT_TINY = 'configs/baselines/beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py'

# (batch, prefix, grid tokens, suffix, channels): odd grids, a cls token, class tokens
LAYOUTS = [(1, 1, 64, 0, 16), (2, 1, 35, 0, 8), (2, 0, 24, 5, 12), (3, 1, 3, 2, 4)]
LAYOUT_IDS = ['vit-8x8', 'vit-5x7-batch2', 'head-class-tokens', 'tiny-grid']


def reference_merge(x, plan):
    """Per batch item: ``index_reduce`` mean of the grid tokens into their slots."""
    p, n = plan.num_prefix_tokens, plan.slot.shape[1]
    out = []
    for b in range(x.shape[0]):
        grid = torch.zeros(plan.num_merged, x.shape[-1]).index_reduce_(
            0, plan.slot[b], x[b, p:p + n], 'mean', include_self=False)
        out.append(torch.cat([x[b, :p], grid, x[b, p + n:]]))
    return torch.stack(out)


# ----------------------------------------------------------------------------------------
# The ops.
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize('ratio', [0.0, 0.1, 0.3, 0.5])
@pytest.mark.parametrize('B, p, n, s, C', LAYOUTS, ids=LAYOUT_IDS)
def test_merge_unmerge(B, p, n, s, C, ratio):
    torch.manual_seed(0)
    x = torch.randn(B, p + n + s, C)
    r = merged_count(n, ratio)
    plan = bipartite_soft_matching(x, r, p, s)
    merged = merge(x, plan)
    assert merged.shape == (B, p + n - r + s, C)
    torch.testing.assert_close(merged, reference_merge(x, plan), rtol=1e-6, atol=1e-6)
    size = merged_sizes(plan)
    assert torch.equal(size.sum(1), torch.full((B, ), float(p + n + s)))
    back = unmerge(merged, plan)
    # untouched tokens (prefix, suffix, grid tokens merged with no other) come back exactly
    alone = torch.cat([torch.ones(B, p, dtype=torch.bool),
                       size[:, p:p + n - r].gather(1, plan.slot) == 1,
                       torch.ones(B, s, dtype=torch.bool)], dim=1)
    assert torch.equal(back[alone], x[alone])
    assert int((~alone).sum()) == (0 if r == 0 else int((size > 1).sum() + B * r))
    if r == 0:
        assert torch.equal(back, x)
    # every token gets its merged token
    assert torch.equal(back[:, p:p + n], merged[:, p:p + n - r].gather(
        1, plan.slot[..., None].expand(B, n, C)))


def test_matching_merges_the_most_similar_pairs():
    torch.manual_seed(0)
    x = torch.randn(1, 1 + 12, 8)
    x[0, 1 + 2] = 3 * x[0, 1 + 5]   # A token 2 ~ B token 5 (cosine 1)
    x[0, 1 + 8] = x[0, 1 + 1]       # A token 8 = B token 1
    plan = bipartite_soft_matching(x, 2, num_prefix_tokens=1)
    slot = plan.slot[0]
    assert slot[2] == slot[5] and slot[8] == slot[1]
    assert len(set(slot.tolist())) == 10
    # the cls token is never matched, even when it is a copy of a grid token
    x[0, 0] = x[0, 1 + 3]
    assert bipartite_soft_matching(x, 2, num_prefix_tokens=1).slot.shape == (1, 12)


def test_proportional_attention_is_attention_over_the_tokens_merged():
    """Keys and values of ``s`` identical tokens merged into one with ``log s`` added to its
    logits: the same attention as over the ``s`` tokens."""
    torch.manual_seed(0)
    H, S, d = 2, 6, 8
    q, k, v = torch.randn(3, 1, H, 5, d).unbind(0)
    k, v = torch.randn(1, H, S, d), torch.randn(1, H, S, d)
    size = torch.tensor([[1., 3., 1., 2., 1., 4.]])
    repeat = size[0].long()
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 2),
                                           v.repeat_interleave(repeat, 2))
    bias = proportional_attention_bias(size, H, 5).reshape(1, H, 5, S)
    merged = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(merged, dense, rtol=1e-5, atol=1e-5)


def test_proportional_attention_with_sizes_one_is_softmax_attention():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 17, 32)
    bias = proportional_attention_bias(torch.ones(2, 17), 4)
    assert bias.shape == (8, 17, 17) and not bias.any()
    with torch.no_grad():
        plain, _ = mha(x, x, x)
        proportional, _ = mha(x, x, x, attn_mask=bias)
    torch.testing.assert_close(proportional, plain, rtol=0, atol=1e-6)


def test_bad_ratios():
    # a ratio is the fraction of grid tokens merged away: not below 0
    with pytest.raises(ValueError, match=r'merge ratio -0.1 is outside \[0, 0.5\]'):
        merged_count(10, -0.1)
    # bipartite matching merges each token of one half at most once: at most 0.5
    with pytest.raises(ValueError, match='at most half'):
        merged_count(10, 0.6)
    # a number, not a string or a bool
    with pytest.raises(TypeError, match='must be a number'):
        merged_count(10, '0.3')
    with pytest.raises(TypeError, match='must be a number'):
        TokenMerger(True)
    # r beyond set A
    with pytest.raises(ValueError, match='cannot merge r=6 of 10'):
        bipartite_soft_matching(torch.randn(1, 10, 4), 6)


# ----------------------------------------------------------------------------------------
# merge_tokens on mmseg's models.
# ----------------------------------------------------------------------------------------
def small_vit(**kwargs):
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=(32, 48), patch_size=8, embed_dims=32, num_layers=3,
                            num_heads=4, out_indices=(1, 2), **kwargs)
    vit.eval()   # mmseg's ViT.train() returns None
    return vit


@pytest.fixture(scope='module')
def segmentor(tiny_cfg):
    from mita_seg.analysis.segmentor_cost import build_segmentor
    return build_segmentor(tiny_cfg)


def forward(model, x):
    with torch.no_grad(), decode_head_called_as_module(model):
        return model(x, mode='tensor')


def test_ratio_zero_is_the_unswapped_model(segmentor):
    x = torch.randn(2, 3, 64, 96)
    before = forward(segmentor, x)
    model = copy.deepcopy(segmentor)
    params = dict(model.named_parameters())
    assert merge_tokens(model, ratio=0.0, include_head=True) == 3   # 2 backbone + 1 head
    assert dict(model.named_parameters()) == params                 # the same objects
    assert list(model.state_dict()) == list(segmentor.state_dict())
    assert isinstance(model.backbone.layers[0].attn, ToMeAttention)
    assert torch.equal(forward(model, x), before)
    # merged, then back to 0: exactly the unswapped model again
    merge_tokens(model, ratio=0.4, include_head=True)
    merged = forward(model, x)
    assert merged.shape == before.shape and not torch.allclose(merged, before)
    merge_tokens(model, ratio=0.0)
    merge_tokens(model, ratio=0.0, include_head=True)
    assert torch.equal(forward(model, x), before)


def reference_layer(layer, x, r, p):
    """A ToMe layer written out with the ops: merge the normed tokens, proportional softmax
    attention (SDPA with a float mask), unmerge, residual; the same for the MLP."""
    def merged_op(y, op):
        plan = bipartite_soft_matching(y, r, p)
        m = merge(y, plan)
        return unmerge(op(m, merged_sizes(plan)), plan)

    def attention(m, size):
        mha = layer.attn.attn
        B, L, C = m.shape
        H = mha.num_heads
        q, k, v = F.linear(m, mha.in_proj_weight, mha.in_proj_bias).reshape(
            B, L, 3, H, C // H).permute(2, 0, 3, 1, 4)
        mask = size.log()[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return mha.out_proj(out.transpose(1, 2).reshape(B, L, C))

    x = x + merged_op(layer.norm1(x), attention)
    return x + merged_op(layer.norm2(x), lambda m, size: layer.ffn(m, identity=0 * m))


@pytest.mark.parametrize('ratio', [0.2, 0.5])
def test_layer_against_reference(ratio):
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(32, 4, 64).eval()
    x = torch.randn(2, 1 + 5 * 7, 32)
    with torch.no_grad():
        ref = reference_layer(layer, x, merged_count(35, ratio), 1)
        vit = small_vit()
        vit.layers = nn.ModuleList([layer])   # the layer as one of a ViT's
        merge_tokens(vit, ratio, verbose=False)
        assert isinstance(layer.attn, ToMeAttention) and isinstance(layer.ffn, ToMeFFN)
        out = layer(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cls_and_class_tokens_never_merged(segmentor):
    model = copy.deepcopy(segmentor)
    merge_tokens(model, 0.5, include_head=True, verbose=False)
    assert model.backbone.layers[0].attn.token_merger.num_prefix_tokens == 1
    head = model.decode_head.layers[0].ffn.token_merger
    assert (head.num_prefix_tokens, head.num_suffix_tokens) == (0, 10)
    x = torch.randn(1, 3, 64, 96)
    assert forward(model, x).shape == forward(segmentor, x).shape
    vit = small_vit(with_cls_token=False)
    merge_tokens(vit, 0.3, verbose=False)
    assert vit.layers[0].attn.token_merger.num_prefix_tokens == 0
    assert [o.shape for o in vit(torch.randn(1, 3, 40, 56))] == [(1, 32, 5, 7)] * 2


def test_layers_and_batch(segmentor):
    vit = small_vit()
    assert merge_tokens(vit, 0.3, layers=[-1], verbose=False) == 1
    assert type(vit.layers[0].attn) is MultiheadAttention
    assert type(vit.layers[0].ffn) is FFN
    # batch items merge independently: a batch of 2 is each item on its own
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        both = vit(x)
        one = [vit(x[i:i + 1]) for i in range(2)]
    for i in range(2):
        for a, b in zip(both, one[i]):
            torch.testing.assert_close(a[i:i + 1], b, rtol=1e-5, atol=1e-5)


def test_with_mita(segmentor):
    x = torch.randn(1, 3, 64, 96)
    keys = list(segmentor.state_dict())
    # MiTA first: its layers get their MLP merged only (MiTA needs the full grid)
    model = copy.deepcopy(segmentor)
    swap_attention(model, pool_size=3, topk=12, verbose=False)
    assert merge_tokens(model, 0.3, verbose=False) == 2
    assert isinstance(model.backbone.layers[0].attn, MiTAAttention)
    assert isinstance(model.backbone.layers[0].ffn, ToMeFFN)
    out = forward(model, x)
    # ToMe first, then MiTA: the same model
    other = copy.deepcopy(segmentor)
    merge_tokens(other, 0.3, verbose=False)
    assert swap_attention(other, pool_size=3, topk=12, verbose=False) == 2   # the encoder's
    assert type(other.backbone.layers[0].attn) is MiTAAttention
    assert list(other.state_dict()) == list(model.state_dict()) == keys
    assert torch.equal(forward(other, x), out)


def test_errors(segmentor):
    vit = small_vit()
    # nothing to merge: one message listing what was found
    with pytest.raises(NothingToMergeError, match='no encoder layer to merge tokens in'):
        merge_tokens(nn.Sequential(nn.Conv2d(3, 8, 3)))
    # BEiT/MAE: the relative position bias is tied to the grid
    from mita_seg.analysis.segmentor_cost import build_segmentor
    beit = build_segmentor(load_config(BEIT_TINY))
    with pytest.raises(NothingToMergeError, match='BEiT/MAE: a relative position bias'):
        merge_tokens(beit)
    # ratios outside [0, 0.5]
    with pytest.raises(ValueError, match='outside'):
        merge_tokens(vit, 0.51)
    with pytest.raises(ValueError, match='outside'):
        merge_tokens(vit, -0.2)
    # layers must exist
    with pytest.raises(ValueError, match=r'layers \[5\] out of range'):
        merge_tokens(vit, 0.3, layers=[5])
    with pytest.raises(ValueError, match='layers must be'):
        merge_tokens(vit, 0.3, layers=1)
    # nothing was patched by the failed calls
    assert type(vit.layers[0].attn) is MultiheadAttention


# ----------------------------------------------------------------------------------------
# FLOPs.
# ----------------------------------------------------------------------------------------
def test_flops_of_a_merged_segmentor(tiny_cfg):
    counter = SegmentorFlops(tiny_cfg, None, merge_ratio=0.3, name='tiny')
    assert counter.num_merged == 2
    base, tome = counter.count((64, 96))                 # 8 x 12 grid + cls
    n, C, H = 96, 64, 4
    r = merged_count(n, 0.3)
    d = C // H
    # attention over the merged tokens; matching and merge, twice per layer, on their own
    assert tome.backbone_attention == 2 * attention_flops(1, H, 1 + n - r, d)
    assert tome.token_merge == 2 * 2 * merge_flops(1, n, C, r)
    assert tome.head == base.head and tome.params == base.params
    assert tome.total < base.total
    # the MLPs and projections run on n - r tokens; the matching adds its n^2 C / 4
    saved_rest = base.backbone_rest - (tome.backbone_rest - tome.token_merge)
    assert saved_rest > 0
    # against FlopCounterMode (2 FLOPs per MAC; it does not count the merge's adds)
    x = counter.inputs((64, 96))
    with decode_head_called_as_module(counter.mita):
        ours = count_flops(counter.mita, (x, ))
        flop_mode = FlopCounterMode(display=False)
        with torch.no_grad(), flop_mode:
            counter.mita(x)
    adds = ours.by_operator['token_merge_adds']
    assert adds == 2 * 2 * r * (C + 1)
    assert 2 * ours.macs == pytest.approx(flop_mode.get_total_flops(), rel=0.01)
    # meta device: the same counts
    meta = SegmentorFlops(tiny_cfg, None, device='meta', merge_ratio=0.3)
    assert meta.count((64, 96))[1].by_operator == tome.by_operator
    json_ = counter.compare((64, 96)).to_json()
    assert json_['merge_ratio'] == 0.3 and json_['label'] == 'ToMe r=0.3'
    assert json_['mita']['token_merge'] == pytest.approx(tome.token_merge / 1e9)


def test_merge_flops_formula():
    assert merge_flops(2, 35, 8, 0) == 0
    assert merge_flops(2, 35, 8, 10) == 2 * (18 * 17 * 8 + 10 * 9)
    # the matching of one merge is about a quarter of one attention's N^2 C
    assert merge_flops(1, 1024, 192, 307) / attention_flops(1, 3, 1024, 64) == \
        pytest.approx(1 / 8, rel=0.01)


# ----------------------------------------------------------------------------------------
# The tools, end to end (the tiny Segmenter of conftest).
# ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tools_end_to_end(segmenter_ckpt, tools, tmp_path):
    config, ckpt = segmenter_ckpt
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'base')
    base = tools.miou(out)
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'zero',
                   '--merge-ratio', 0)
    assert 'tokens merged (ToMe r=0) in 4 layers' in out and tools.miou(out) == base
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'tome',
                   '--merge-ratio', 0.3, '--mita-cfg', 'pool_size=4', 'topk=32')
    assert '4 attention modules on MiTA, tokens merged (ToMe r=0.3) in 4 layers' in out

    _, out = tools('tools/swap_sweep.py', config, ckpt, '--pool-sizes', 4, '--topks', 16,
                   '--merge-ratios', 0, 0.25, 0.5, '--work-dir', tmp_path / 'sweep',
                   '--out', tmp_path / 'sweep.md', '--plot', tmp_path / 'sweep.png')
    with open(tmp_path / 'sweep.csv') as f:
        rows = list(csv.DictReader(f))
    assert [r['setting'] for r in rows] == ['baseline', 'ToMe r=0.00', 'ToMe r=0.25',
                                            'ToMe r=0.50', 'MiTA M=4x4 k=16']
    assert float(rows[1]['mIoU']) == float(rows[0]['mIoU'])
    gflops = [float(r['model_GFLOPs']) for r in rows[:4]]
    assert gflops[1] == gflops[0] and gflops[3] < gflops[2] < gflops[0]
    attn = [float(r['attn_GMACs']) for r in rows]
    assert attn[3] < attn[2] < attn[0] and rows[4]['merge_ratio'] == ''

    result_path = tmp_path / 'flops.json'
    _, out = tools('tools/get_flops.py', config, '--shape', 128, '--merge-ratio', 0.3,
                   '--json', result_path)
    result = json.loads(result_path.read_text())
    assert 'ToMe r=0.3' in out and 'of it ToMe (matching, merge)' in out
    assert 0 < result['mita']['token_merge'] and result['reduction_percent']['total'] > 0

    # bad input: one line each
    code, out = tools('tools/test.py', config, ckpt, '--merge-ratio', 0.7, check=False)
    assert code == 2 and 'merge ratio 0.7 is outside [0, 0.5]' in out
    code, out = tools('tools/get_flops.py', BEIT_TINY, '--merge-ratio', 0.3, check=False)
    last = out.strip().splitlines()[-1]
    assert code == 1 and last.startswith('error: merge_tokens found no encoder layer')
    assert 'backbone.layers.0 and 3 more: its attention is BEiTAttention' in last
    assert 'Traceback' not in out


@pytest.mark.slow
def test_benchmark_model_level(tools):
    # ToMe beside the four models of --level model: its img/s column and its speed-up over
    # the fast dense model, timed in the same rounds (a small whole image)
    _, out = tools('tools/benchmark.py', '--level', 'model', '--models', 'segmenter-vit-t',
                   '--images', '64x80', '--merge-ratio', 0.3, '--rounds', 1, '--no-memory',
                   '--min-run-time', 0.01, timeout=600)
    header = next(ln for ln in out.splitlines() if ln.strip().startswith('model '))
    assert header.split('|')[1].split()[-1] == 'ToMe' and 'ToMe/dense' in header, header
    line = next(ln for ln in out.splitlines() if ln.strip().startswith('segmenter-vit-t'))
    assert math.isfinite(float(line.split('|')[1].split()[-1]))      # ToMe's img/s
