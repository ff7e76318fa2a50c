"""Training-free attention kinds (:mod:`mita_seg.ops` agent, block, top-k and window
attention): softmax attention where they must be dense; a per-query loop written out here
(float64, forward and gradients) where they are not, border queries, ragged blocks, prefix
and suffix (global) tokens and non-square grids included; float32 and bfloat16; chunking;
bad arguments; each FLOP formula against FlopCounterMode and an explicit count. A few
seconds on 2 cores."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mita_seg.ops import (agent_attention, agent_flops_per_head, block_attention,
                          block_flops_per_head, topk_attention, topk_flops_per_head,
                          window_attention, window_flops_per_head)

# name: (B, H, h, w, prefix, suffix, d)
LAYOUTS = {
    'cls-5x7-suffix3': (2, 2, 5, 7, 1, 3, 8),
    'plain-4x6': (1, 2, 4, 6, 0, 0, 8),
    'prefix2-6x5-d5': (2, 1, 6, 5, 2, 0, 5),
    'suffix2-3x4': (1, 3, 3, 4, 0, 2, 6),
}
SPARSE_LAYOUTS = ['cls-5x7-suffix3', 'prefix2-6x5-d5']


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def qkv(layout, seed=0):
    """Seeded float64 q, k, v whose values are float32 numbers (so float32 runs see the
    same inputs), and an output gradient."""
    B, H, h, w, p, s, d = layout
    g = torch.Generator().manual_seed(seed)
    q, k, v, gout = (torch.randn(B, H, p + h * w + s, d, generator=g).double()
                     for _ in range(4))
    return q, k, v, gout


def run(fn, q, k, v, gout, dtype):
    """``fn`` on ``q, k, v`` cast to ``dtype``: ``(out, (dq, dk, dv))``."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return out, torch.autograd.grad(out, (q, k, v), gout.to(dtype))


def dense(q, k, v):
    """Softmax attention, written out."""
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v


# ----------------------------------------------------------------------------------------
# The per-query loop reference: every query's logits and values, one query at a time.
# ----------------------------------------------------------------------------------------
def loop_reference(q, k, v, hw, p, grid_part):
    """Grid query ``n`` (index in the grid) over ``grid_part(b, head, n) -> (logits,
    values)`` plus the global (non-grid) keys; the global queries over every key."""
    B, H, N, d = q.shape
    n_o = hw[0] * hw[1]
    glob = [i for i in range(N) if not p <= i < p + n_o]
    rows = []
    for b in range(B):
        for hd in range(H):
            for i in range(N):
                if i in glob:
                    logits, values = q[b, hd, i] @ k[b, hd].T / d ** 0.5, v[b, hd]
                else:
                    gl, gv = grid_part(b, hd, i - p)
                    logits = torch.cat([gl, q[b, hd, i] @ k[b, hd, glob].T / d ** 0.5])
                    values = torch.cat([gv, v[b, hd, glob]])
                rows.append(torch.softmax(logits, -1) @ values)
    return torch.stack(rows).view(B, H, N, d)


def keys_part(q, k, v, p, keys_of):
    """Grid query ``n`` attends to the grid keys ``keys_of(b, head, n)``."""
    d = q.shape[-1]

    def part(b, hd, n):
        J = [p + j for j in keys_of(b, hd, n)]
        return q[b, hd, p + n] @ k[b, hd, J].T / d ** 0.5, v[b, hd, J]
    return part


def topk_keys(q, k, hw, p, topk):
    n_o = hw[0] * hw[1]

    def keys_of(b, hd, n):
        scores = q[b, hd, p + n].detach() @ k[b, hd, p:p + n_o].detach().T
        return scores.argsort(descending=True)[:topk].tolist()
    return keys_of


def window_keys(hw, window):
    h, w = hw
    wh, ww = min(window[0], h), min(window[1], w)

    def keys_of(b, hd, n):
        i, j = divmod(n, w)
        r, c = min(max(i - wh // 2, 0), h - wh), min(max(j - ww // 2, 0), w - ww)
        return [a * w + e for a in range(r, r + wh) for e in range(c, c + ww)]
    return keys_of


def grid_blocks(hw, block):
    """``{block id: [grid indices]}`` (row-major blocks) and each grid token's block."""
    (h, w), (bh, bw) = hw, block
    per_row = -(-w // bw)
    own = [(i // bh) * per_row + j // bw for i in range(h) for j in range(w)]
    blocks = {}
    for n, x in enumerate(own):
        blocks.setdefault(x, []).append(n)
    return blocks, own


def block_keys(q, k, hw, p, block, num_blocks):
    blocks, own = grid_blocks(hw, block)

    def keys_of(b, hd, n):
        ko = k[b, hd, p:].detach()
        means = torch.stack([ko[blocks[x]].mean(0) for x in sorted(blocks)])
        order = (q[b, hd, p + n].detach() @ means.T).argsort(descending=True).tolist()
        chosen = [own[n]] + [x for x in order if x != own[n]][:num_blocks - 1]
        return sorted(j for x in chosen for j in blocks[x])
    return keys_of


def agent_part(q, k, v, hw, p, pool, shared_scale=None):
    """Landmarks pooled region by region as adaptive average pooling cuts them (rows
    ``floor(a h / Ph)`` to ``ceil((a + 1) h / Ph)``), written out."""
    (h, w), (ph, pw) = hw, pool
    d = q.shape[-1]
    scale = 1 / d if shared_scale is None else shared_scale
    cache = {}

    def part(b, hd, n):
        if (b, hd) not in cache:
            grid = q[b, hd, p:p + h * w].view(h, w, d)
            R = torch.stack([
                grid[a * h // ph:-(-(a + 1) * h // ph), c * w // pw:-(-(c + 1) * w // pw)]
                .mean((0, 1)) for a in range(ph) for c in range(pw)])
            ko, vo = k[b, hd, p:p + h * w], v[b, hd, p:p + h * w]
            cache[b, hd] = R, torch.softmax(R @ ko.T / d ** 0.5, -1) @ vo
        R, v_r = cache[b, hd]
        return q[b, hd, p + n] @ R.T * scale, v_r
    return part


# ----------------------------------------------------------------------------------------
# Cases: name -> (operator (q, k, v, hw, p) -> out, reference part (q, k, v, hw, p))
# ----------------------------------------------------------------------------------------
DENSE = {
    'block-every-block-ragged': lambda q, k, v, hw, p: block_attention(q, k, v, hw, 2, 99, p),
    'block-as-many-as-blocks': lambda q, k, v, hw, p: block_attention(
        q, k, v, hw, 3, -(-hw[0] // 3) * -(-hw[1] // 3), p),
    'block-larger-than-grid': lambda q, k, v, hw, p: block_attention(q, k, v, hw, 9, 1, p),
    'topk-every-grid-key': lambda q, k, v, hw, p: topk_attention(q, k, v, hw, hw[0] * hw[1],
                                                                 p),
    'topk-above': lambda q, k, v, hw, p: topk_attention(q, k, v, hw, 1000, p, chunk_size=7),
    'window-covers-grid': lambda q, k, v, hw, p: window_attention(q, k, v, hw, max(hw), p),
    'window-larger-pair': lambda q, k, v, hw, p: window_attention(q, k, v, hw,
                                                                  (hw[0] + 2, 50), p),
}

SPARSE = {
    'agent-2x3': (lambda q, k, v, hw, p: agent_attention(q, k, v, hw, (2, 3), p),
                  lambda q, k, v, hw, p: agent_part(q, k, v, hw, p, (2, 3))),
    'agent-pool-is-grid-scale': (
        lambda q, k, v, hw, p: agent_attention(q, k, v, hw, hw, p, shared_scale=0.3),
        lambda q, k, v, hw, p: agent_part(q, k, v, hw, p, hw, 0.3)),
    'agent-int-pool': (lambda q, k, v, hw, p: agent_attention(q, k, v, hw, 2, p),
                       lambda q, k, v, hw, p: agent_part(q, k, v, hw, p, (2, 2))),
    'block-2-of-ragged-2x2': (
        lambda q, k, v, hw, p: block_attention(q, k, v, hw, 2, 3, p, chunk_size=5),
        lambda q, k, v, hw, p: keys_part(q, k, v, p, block_keys(q, k, hw, p, (2, 2), 3))),
    'block-3x2-two': (
        lambda q, k, v, hw, p: block_attention(q, k, v, hw, (3, 2), 2, p),
        lambda q, k, v, hw, p: keys_part(q, k, v, p, block_keys(q, k, hw, p, (3, 2), 2))),
    'block-own-only': (
        lambda q, k, v, hw, p: block_attention(q, k, v, hw, 3, 1, p),
        lambda q, k, v, hw, p: keys_part(q, k, v, p, block_keys(q, k, hw, p, (3, 3), 1))),
    'topk-1': (lambda q, k, v, hw, p: topk_attention(q, k, v, hw, 1, p),
               lambda q, k, v, hw, p: keys_part(q, k, v, p, topk_keys(q, k, hw, p, 1))),
    'topk-5-chunks-of-4': (
        lambda q, k, v, hw, p: topk_attention(q, k, v, hw, 5, p, chunk_size=4),
        lambda q, k, v, hw, p: keys_part(q, k, v, p, topk_keys(q, k, hw, p, 5))),
    'window-3': (lambda q, k, v, hw, p: window_attention(q, k, v, hw, 3, p),
                 lambda q, k, v, hw, p: keys_part(q, k, v, p, window_keys(hw, (3, 3)))),
    'window-4-even': (lambda q, k, v, hw, p: window_attention(q, k, v, hw, 4, p, chunk_size=6),
                      lambda q, k, v, hw, p: keys_part(q, k, v, p, window_keys(hw, (4, 4)))),
    'window-2x9-clamped-cols': (
        lambda q, k, v, hw, p: window_attention(q, k, v, hw, (2, 9), p),
        lambda q, k, v, hw, p: keys_part(q, k, v, p, window_keys(hw, (2, 9)))),
    'window-1-self': (lambda q, k, v, hw, p: window_attention(q, k, v, hw, 1, p),
                      lambda q, k, v, hw, p: keys_part(q, k, v, p, window_keys(hw, (1, 1)))),
}


def assert_grads_close(grads, ref_grads, tol):
    for name, g, r in zip('qkv', grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=tol, rtol=tol, msg=f'd{name}')


@pytest.mark.parametrize('layout', list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize('case', list(DENSE), ids=list(DENSE))
def test_dense_cases_are_softmax_attention(case, layout):
    B, H, h, w, p, s, d = LAYOUTS[layout]
    q, k, v, gout = qkv(LAYOUTS[layout])
    fn = lambda q, k, v: DENSE[case](q, k, v, (h, w), p)   # noqa: E731
    ref, ref_grads = run(dense, q, k, v, gout, torch.float64)
    out, grads = run(fn, q, k, v, gout, torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert_grads_close(grads, ref_grads, 1e-12)
    # float32 against PyTorch's SDPA and against the float64 gradients
    sdpa, _ = run(F.scaled_dot_product_attention, q, k, v, gout, torch.float32)
    out, grads = run(fn, q, k, v, gout, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, sdpa, atol=2e-6, rtol=2e-6)
    assert_grads_close(grads, ref_grads, 2e-5)


@pytest.mark.parametrize('layout', SPARSE_LAYOUTS)
@pytest.mark.parametrize('case', list(SPARSE), ids=list(SPARSE))
def test_sparse_cases_match_the_loop_reference(case, layout):
    B, H, h, w, p, s, d = LAYOUTS[layout]
    q, k, v, gout = qkv(LAYOUTS[layout])
    op, part = SPARSE[case]
    ref, ref_grads = run(lambda q, k, v: loop_reference(q, k, v, (h, w), p,
                                                        part(q, k, v, (h, w), p)),
                         q, k, v, gout, torch.float64)
    fn = lambda q, k, v: op(q, k, v, (h, w), p)   # noqa: E731
    out, grads = run(fn, q, k, v, gout, torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert_grads_close(grads, ref_grads, 1e-12)
    out, grads = run(fn, q, k, v, gout, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    assert_grads_close(grads, ref_grads, 2e-5)


# ----------------------------------------------------------------------------------------
# BEiT's relative position bias (tokens: cls, then the grid): window and top-k add each
# pair's own entry to its logit, the global cls key and query included.
# ----------------------------------------------------------------------------------------
BIAS_LAYOUT = (2, 2, 5, 7, 1, 0, 8)


def biased_reference(q, k, v, Bd, keys_of):
    """Grid query ``n`` over the grid keys ``keys_of(b, head, n)`` and cls; cls over every
    key; each logit ``q k / sqrt(d) + Bd[head, query, key]``, written out."""
    B, H, N, d = q.shape
    rows = []
    for b in range(B):
        for hd in range(H):
            for i in range(N):
                J = list(range(N)) if i == 0 else [1 + j for j in keys_of(b, hd, i - 1)] + [0]
                logits = q[b, hd, i] @ k[b, hd, J].T / d ** 0.5 + Bd[hd, i, J]
                rows.append(torch.softmax(logits, -1) @ v[b, hd, J])
    return torch.stack(rows).view(B, H, N, d)


def biased_topk_keys(q, k, Bd, topk):
    d = q.shape[-1]

    def keys_of(b, hd, n):
        logits = q[b, hd, 1 + n].detach() @ k[b, hd, 1:].detach().T / d ** 0.5
        return (logits + Bd[hd, 1 + n, 1:]).argsort(descending=True)[:topk].tolist()
    return keys_of


BIASED = {
    'window-1-self': (
        lambda q, k, v, hw, b: window_attention(q, k, v, hw, 1, 1, rel_pos_bias=b),
        lambda q, k, v, hw, Bd: window_keys(hw, (1, 1))),
    'window-3-chunks-of-4': (
        lambda q, k, v, hw, b: window_attention(q, k, v, hw, 3, 1, chunk_size=4,
                                                rel_pos_bias=b),
        lambda q, k, v, hw, Bd: window_keys(hw, (3, 3))),
    'window-covers-grid': (
        lambda q, k, v, hw, b: window_attention(q, k, v, hw, max(hw), 1, rel_pos_bias=b),
        lambda q, k, v, hw, Bd: lambda b, hd, n: range(hw[0] * hw[1])),
    'topk-5-chunks-of-4': (
        lambda q, k, v, hw, b: topk_attention(q, k, v, hw, 5, 1, chunk_size=4,
                                              rel_pos_bias=b),
        lambda q, k, v, hw, Bd: biased_topk_keys(q, k, Bd, 5)),
    'topk-every-grid-key': (
        lambda q, k, v, hw, b: topk_attention(q, k, v, hw, 99, 1, rel_pos_bias=b),
        lambda q, k, v, hw, Bd: lambda b, hd, n: range(hw[0] * hw[1])),
}


@pytest.mark.parametrize('case', list(BIASED), ids=list(BIASED))
def test_relative_position_bias_on_each_pairs_logit(case):
    """Window and top-k with BEiT's bias against the loop reference with the dense bias:
    each pair's own entry, the cls key and query included; the top-k on biased logits (a
    strong bias moves the keys: the unbiased top-k differs)."""
    from mita_seg.ops.bias import RelPosBias, dense_bias, table_size
    B, H, h, w, p, s, d = BIAS_LAYOUT
    q, k, v, gout = qkv(BIAS_LAYOUT)
    table = torch.randn(H, table_size((h, w)), generator=torch.Generator().manual_seed(1))
    bias = RelPosBias((table * 2).double(), (h, w))
    Bd = dense_bias(bias)                                               # [H, N, N]
    op, keys = BIASED[case]
    # the table's gradient (BEiT's bias is learnt) against the reference's
    grad_of = []
    for fn in (lambda b: biased_reference(q, k, v, dense_bias(b), keys(q, k, v, (h, w), Bd)),
               lambda b: op(q, k, v, (h, w), b)):
        t = bias.table.clone().requires_grad_()
        out = fn(RelPosBias(t, (h, w)))
        grad_of.append(torch.autograd.grad((out * gout).sum(), t)[0])
    torch.testing.assert_close(grad_of[1], grad_of[0], atol=1e-12, rtol=1e-12)
    assert grad_of[0].abs().sum() > 0
    ref, ref_grads = run(
        lambda q, k, v: biased_reference(q, k, v, Bd, keys(q, k, v, (h, w), Bd)),
        q, k, v, gout, torch.float64)
    out, grads = run(lambda q, k, v: op(q, k, v, (h, w), bias), q, k, v, gout, torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert_grads_close(grads, ref_grads, 1e-12)
    unbiased = run(lambda q, k, v: op(q, k, v, (h, w), None), q, k, v, gout, torch.float64)[0]
    assert (unbiased - ref).abs().max() > 1e-3                          # the bias counts
    if case.startswith('topk-5'):   # the biased logits pick other keys than the plain ones
        plain = topk_keys(q, k, (h, w), 1, 5)
        assert any(sorted(plain(0, 0, n)) != sorted(keys(q, k, v, (h, w), Bd)(0, 0, n))
                   for n in range(h * w))


def test_relative_position_bias_that_does_not_fit_is_refused():
    from mita_seg.ops.bias import RelPosBias, table_size
    from mita_seg.ops.kinds import attend
    from mita_seg.setting import MiTASetting
    B, H, h, w, p, s, d = BIAS_LAYOUT
    q, k, v, _ = qkv(BIAS_LAYOUT)
    other = RelPosBias(torch.zeros(H, table_size((h, h))), (h, h))   # another grid's table
    with pytest.raises(ValueError, match='built for a 5x5 patch grid but the input has a 5x7'):
        window_attention(q, k, v, (h, w), 3, 1, rel_pos_bias=other)
    bias = RelPosBias(torch.zeros(H, table_size((h, w))), (h, w))
    with pytest.raises(ValueError, match='agent attention does not take a relative position'):
        attend(MiTASetting.parse('agent:2'), q, k, v, (h, w), 1, rel_pos_bias=bias)


def test_agent_refuses_an_infinite_shared_scale():
    """As mita_attention: shared_scale=inf made every output NaN."""
    q, k, v, _ = qkv(BIAS_LAYOUT)
    B, H, h, w, p, s, d = BIAS_LAYOUT
    for bad in (math.inf, 0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match='shared_scale must be finite and > 0'):
            agent_attention(q, k, v, (h, w), 2, p, shared_scale=bad)


def test_attend_runs_every_kind_as_fitted_to_the_grid():
    """ops.attend runs a pool larger than the grid on the grid, MiTA as the other kinds
    (MiTA's operator alone refuses one)."""
    from mita_seg.ops import mita_attention
    from mita_seg.ops.kinds import attend
    from mita_seg.setting import MiTASetting
    B, H, h, w, p, s, d = BIAS_LAYOUT
    q, k, v, _ = qkv(BIAS_LAYOUT)
    big = MiTASetting.parse('7:49')
    with pytest.raises(ValueError, match='no larger than the grid'):
        mita_attention(q, k, v, (h, w), 7, 12, p)
    fitted = big.fit((h, w), q.shape[2])
    want = mita_attention(q, k, v, (h, w), fitted.pool_size, fitted.topk, p)
    torch.testing.assert_close(attend(big, q, k, v, (h, w), p), want, rtol=0, atol=0)
    for kind in ('agent:7', 'window:9'):
        assert attend(MiTASetting.parse(kind), q, k, v, (h, w), p).shape == q.shape


BF16_CASES = ['agent-2x3', 'block-2-of-ragged-2x2', 'topk-5-chunks-of-4', 'window-3']


@pytest.mark.parametrize('case', BF16_CASES + ['block-every-block-ragged',
                                               'topk-every-grid-key', 'window-covers-grid'])
def test_bfloat16_within_twice_sdpa_error(case):
    """bf16 in, bf16 out (computed in float32): against the operator in float32 on the same
    values, forward and gradients within twice the error of bf16 SDPA against float32 SDPA
    (FlashAttention's rule)."""
    B, H, h, w, p, s, d = LAYOUTS['cls-5x7-suffix3']
    q, k, v, gout = (t.bfloat16().double() for t in qkv(LAYOUTS['cls-5x7-suffix3']))
    op = SPARSE[case][0] if case in SPARSE else DENSE[case]
    fn = lambda q, k, v: op(q, k, v, (h, w), p)   # noqa: E731
    out32, grads32 = run(fn, q, k, v, gout, torch.float32)
    out16, grads16 = run(fn, q, k, v, gout, torch.bfloat16)
    sdpa32, sgrads32 = run(F.scaled_dot_product_attention, q, k, v, gout, torch.float32)
    sdpa16, sgrads16 = run(F.scaled_dot_product_attention, q, k, v, gout, torch.bfloat16)
    assert out16.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads16)
    err = lambda a, b: (a.float() - b).abs().max().item()   # noqa: E731
    assert err(out16, out32) <= 2 * err(sdpa16, sdpa32)
    for name, g16, g32, s16, s32 in zip('qkv', grads16, grads32, sgrads16, sgrads32):
        assert err(g16, g32) <= 2 * err(s16, s32), f'd{name}'


@pytest.mark.parametrize('op', [
    lambda q, k, v, hw, p, c: topk_attention(q, k, v, hw, 6, p, chunk_size=c),
    lambda q, k, v, hw, p, c: block_attention(q, k, v, hw, 2, 4, p, chunk_size=c),
    lambda q, k, v, hw, p, c: window_attention(q, k, v, hw, 3, p, chunk_size=c),
], ids=['topk', 'block', 'window'])
def test_chunk_size_changes_nothing(op):
    B, H, h, w, p, s, d = LAYOUTS['cls-5x7-suffix3']
    q, k, v, _ = qkv(LAYOUTS['cls-5x7-suffix3'])
    whole = op(q, k, v, (h, w), p, 256)
    for c in (1, 6, h * w - 1):
        torch.testing.assert_close(op(q, k, v, (h, w), p, c), whole, atol=1e-14, rtol=1e-14)


def test_bad_arguments():
    q = torch.randn(1, 2, 13, 4)   # p = 1, a 3 x 4 grid
    # q, k, v must share one [B, H, N, d] shape
    with pytest.raises(ValueError, match=r'must all have shape \[B, H, N, d\]'):
        topk_attention(q, q[:, :, :12], q, (3, 4), 2, 1)
    with pytest.raises(ValueError, match='must all have shape'):
        window_attention(q[0], q[0], q[0], (3, 4), 3, 1)
    # floating point, one dtype
    with pytest.raises(TypeError, match='floating point'):
        block_attention(q.long(), q.long(), q.long(), (3, 4), 2, 2, 1)
    with pytest.raises(TypeError, match='one floating point dtype'):
        agent_attention(q, q.double(), q, (3, 4), 2, 1)
    # the grid must fit the tokens, and says how
    with pytest.raises(ValueError, match=r'needs p \+ h\*w = 17 tokens.*N = 13'):
        window_attention(q, q, q, (4, 4), 3, 1)
    with pytest.raises(ValueError, match=r'needs p \+ h\*w = 14'):
        topk_attention(q, q, q, (3, 4), 2, num_prefix_tokens=2)
    with pytest.raises(ValueError, match='hw_shape must be positive'):
        topk_attention(q, q, q, (0, 4), 2, 1)
    with pytest.raises(TypeError, match='hw_shape must be an int or a pair'):
        topk_attention(q, q, q, (3, 4, 1), 2, 1)
    with pytest.raises(ValueError, match='num_prefix_tokens must be >= 0'):
        block_attention(q, q, q, (3, 4), 2, 2, -1)
    # agent: a pool no larger than the grid, a positive scale
    with pytest.raises(ValueError, match=r'no larger than the grid \(3, 4\)'):
        agent_attention(q, q, q, (3, 4), (4, 2), 1)
    with pytest.raises(ValueError, match='pool_size'):
        agent_attention(q, q, q, (3, 4), 0, 1)
    with pytest.raises(ValueError, match='shared_scale must be finite and > 0'):
        agent_attention(q, q, q, (3, 4), 2, 1, shared_scale=0.)
    # block: positive sizes and counts
    with pytest.raises(ValueError, match='block_size must be >= 1'):
        block_attention(q, q, q, (3, 4), 0, 2, 1)
    with pytest.raises(ValueError, match='block_size must be >= 1'):
        block_attention(q, q, q, (3, 4), (2, 0), 2, 1)
    with pytest.raises(ValueError, match='num_blocks must be >= 1'):
        block_attention(q, q, q, (3, 4), 2, 0, 1)
    with pytest.raises(TypeError, match='num_blocks must be an int'):
        block_attention(q, q, q, (3, 4), 2, 1.5, 1)
    # window: positive sides
    with pytest.raises(ValueError, match='window_size must be >= 1'):
        window_attention(q, q, q, (3, 4), 0, 1)
    # top-k: at least one key, an int
    with pytest.raises(ValueError, match='topk must be >= 1'):
        topk_attention(q, q, q, (3, 4), 0, 1)
    with pytest.raises(TypeError, match='topk must be an int'):
        topk_attention(q, q, q, (3, 4), 2., 1)
    # chunks of at least one query
    with pytest.raises(ValueError, match='chunk_size must be >= 1'):
        window_attention(q, q, q, (3, 4), 3, 1, chunk_size=0)


# ----------------------------------------------------------------------------------------
# FLOP formulas (MACs per batch item and head) against FlopCounterMode (2 FLOPs per MAC) on
# the operators, which are plain matmuls and gathers, and against explicit counts.
# ----------------------------------------------------------------------------------------
def counted_macs(fn, layout, seed=0):
    q, k, v, _ = qkv(layout, seed)
    with FlopCounterMode(display=False) as counter:
        fn(q.float(), k.float(), v.float())
    B, H = layout[:2]
    return counter.get_total_flops() // (2 * B * H)


def global_macs(n, T, d):
    """The T global tokens: the n grid queries over them and them over all n + T keys."""
    return 2 * n * T * d + 2 * T * (n + T) * d


FLOP_LAYOUT = (1, 2, 5, 7, 1, 3, 8)   # ragged for blocks of 2 and 3; 4 global tokens


@pytest.mark.parametrize('pool', [(2, 3), 5])
def test_agent_flops(pool):
    _, _, h, w, p, s, d = FLOP_LAYOUT
    n, T, M = h * w, p + s, math.prod(pool) if isinstance(pool, tuple) else pool ** 2
    formula = agent_flops_per_head((h, w), d, pool, T)
    assert formula == 4 * M * n * d + global_macs(n, T, d)
    assert formula == counted_macs(
        lambda q, k, v: agent_attention(q, k, v, (h, w), pool, p), FLOP_LAYOUT)


@pytest.mark.parametrize('topk', [1, 5, 35, 99])
def test_topk_flops(topk):
    _, _, h, w, p, s, d = FLOP_LAYOUT
    n, T = h * w, p + s
    formula = topk_flops_per_head((h, w), d, topk, T)
    grid = 2 * n * n * d if topk >= n else n * n * d + 2 * n * topk * d
    assert formula == grid + global_macs(n, T, d)
    assert formula == counted_macs(
        lambda q, k, v: topk_attention(q, k, v, (h, w), topk, p, chunk_size=8), FLOP_LAYOUT)


@pytest.mark.parametrize('window', [1, 3, 4, (2, 9), 7])
def test_window_flops(window):
    _, _, h, w, p, s, d = FLOP_LAYOUT
    n, T = h * w, p + s
    win = (window, window) if isinstance(window, int) else window
    keys_of = window_keys((h, w), win)
    attended = sum(len(keys_of(0, 0, i)) for i in range(n))
    formula = window_flops_per_head((h, w), d, window, T)
    assert formula == 2 * attended * d + global_macs(n, T, d)
    assert formula == counted_macs(
        lambda q, k, v: window_attention(q, k, v, (h, w), window, p), FLOP_LAYOUT)


@pytest.mark.parametrize('block, num_blocks', [(2, 3), ((3, 2), 2), (3, 1), (2, 12), (2, 99)])
def test_block_flops_ragged_grid(block, num_blocks):
    """On a grid not a multiple of the block: the formula counts what the implementation
    executes, every chosen block gathered padded to ``bh * bw`` slots (as FlopCounterMode
    and get_flops' trace see it); the keys a run attends to are at most each query's own
    block plus the largest other blocks (enumerated here)."""
    _, _, h, w, p, s, d = FLOP_LAYOUT
    n, T = h * w, p + s
    bh, bw = (block, block) if isinstance(block, int) else block
    blocks, own = grid_blocks((h, w), (bh, bw))
    nb, b = len(blocks), min(num_blocks, len(blocks))
    formula = block_flops_per_head((h, w), d, block, num_blocks, T)
    if b == nb:   # softmax attention, no block scores
        assert formula == 2 * n * n * d + global_macs(n, T, d)
        assert formula == counted_macs(
            lambda q, k, v: block_attention(q, k, v, (h, w), block, num_blocks, p),
            FLOP_LAYOUT)
        return
    bound = sum(len(blocks[own[i]]) + sum(sorted(
        (len(m) for x, m in blocks.items() if x != own[i]), reverse=True)[:b - 1])
        for i in range(n))
    assert formula == n * nb * d + 2 * n * b * bh * bw * d + global_macs(n, T, d)
    q, k, _, _ = qkv(FLOP_LAYOUT)
    keys_of = block_keys(q, k, (h, w), p, (bh, bw), num_blocks)
    attended = sum(len(keys_of(bi, hd, i)) for bi in range(FLOP_LAYOUT[0])
                   for hd in range(FLOP_LAYOUT[1]) for i in range(n)) // (
                       FLOP_LAYOUT[0] * FLOP_LAYOUT[1])
    assert attended <= bound <= n * b * bh * bw
    assert counted_macs(
        lambda q, k, v: block_attention(q, k, v, (h, w), block, num_blocks, p),
        FLOP_LAYOUT) == formula


@pytest.mark.parametrize('block, num_blocks', [(2, 3), ((2, 3), 2), (2, 1)])
def test_block_flops_exact_on_a_multiple_grid(block, num_blocks):
    """Every block the same size (a 4 x 6 grid): the formula is exact, and what runs."""
    layout = (1, 2, 4, 6, 2, 1, 8)
    _, _, h, w, p, s, d = layout
    n, T = h * w, p + s
    bh, bw = (block, block) if isinstance(block, int) else block
    nb = (h // bh) * (w // bw)
    formula = block_flops_per_head((h, w), d, block, num_blocks, T)
    assert formula == n * nb * d + 2 * n * num_blocks * bh * bw * d + global_macs(n, T, d)
    assert formula == counted_macs(
        lambda q, k, v: block_attention(q, k, v, (h, w), block, num_blocks, p), layout)
