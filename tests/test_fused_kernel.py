"""The C++ kernel of the fused CPU backend on its own: its routing against
:func:`mita_seg.ops.mita_routing` (with and without a relative position bias), the checks of
its entry points (bad shapes, dtypes, indices and bias operands give a clear error, never a
crash), its custom ops' fake implementations, infinities and NaNs without -ffast-math,
results independent of the thread count, and the bf16/fp16 read-out GEMMs (oneDNN's brgemm,
MITA_CPU_BF16_GEMM): the float32 path's routing, bit for bit. The tests that hold bf16/fp16
inputs to the float32 kernel's bits force the float32 GEMMs. A few seconds on 2 cores."""
import os.path as osp
import re

import pytest
import torch

from mita_seg.ops import (Inputs, RelPosBias, mita_attention, mita_attention_reference,
                          mita_routing)
from mita_seg.ops.bias import landmark_bias, table_size
from mita_seg.ops.fused_cpu import _C, FusedState, profile

pytestmark = pytest.mark.skipif(_C is None, reason='the C++ extension mita_seg._C is not built')

# (B, H, h, w, prefix, suffix, d, pool, topk, router_topk)
CASES = {
    'vit-7x11-cls': (2, 3, 7, 11, 1, 0, 16, (3, 3), 10, 1),
    '32x43-cls-suffix-r2': (1, 2, 32, 43, 1, 11, 8, (7, 7), 49, 2),
    '5x5-odd-d-r3': (3, 1, 5, 5, 2, 3, 5, (2, 3), 4, 3),
    '1x9-pool1x2': (1, 2, 1, 9, 1, 0, 4, (1, 2), 3, 1),
    'segmenter-1025': (1, 2, 32, 32, 1, 0, 64, (7, 7), 49, 1),
}


def _qkv(B, H, N, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g).to(dtype) for _ in range(3)]


@pytest.fixture
def float32_gemms(monkeypatch):
    """bf16/fp16 inputs through the float32 GEMMs (what the float32 kernel computes)."""
    monkeypatch.setenv('MITA_CPU_BF16_GEMM', '0')


def _forward(q, k, v, h, w, p, pool, topk, r, shared=True, save=True):
    B, H, N, d = q.shape
    flat = (t.reshape(B * H, N, d) for t in (q, k, v))
    return FusedState(*_C.mita_forward(*flat, h, w, *pool, p, topk, r, shared, 1.0 / d, save))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16],
                         ids=['fp32', 'bf16', 'fp16'])
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_kernel_routing_is_the_reference_routing(case, dtype, float32_gemms):
    """Same landmarks, scores, shared logits and the very same keys and experts as
    mita_routing; for bf16/fp16 inputs, routing in float32 on the rounded values."""
    B, H, h, w, p, s, d, pool, topk, r = case
    N = p + h * w + s
    q, k, v = _qkv(B, H, N, d, dtype=dtype)
    out, lse, keys, choice, offsets, order, R, probs, ls, vr, out32 = _forward(
        q, k, v, h, w, p, pool, topk, r)
    assert out.dtype == dtype and lse.dtype == R.dtype == torch.float32
    if dtype == torch.float32:
        assert out32.numel() == 0  # out itself (custom ops return no aliases)
        out32 = out
    torch.testing.assert_close(out, out32.to(dtype), atol=0, rtol=0)
    rt = mita_routing(q, k, (h, w), pool, topk, r, p)
    BH, M = B * H, pool[0] * pool[1]
    torch.testing.assert_close(R, rt.landmarks.reshape(BH, M, d), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ls, rt.router.reshape(BH, N, M), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, torch.softmax(rt.scores, -1).reshape(BH, M, N),
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(vr, (torch.softmax(rt.scores, -1) @ v.float()).reshape(BH, M, d),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(keys.sort(-1).values, rt.expert_keys.reshape(BH, M, topk).sort(-1).values)
    assert torch.equal(choice.sort(-1).values, rt.choice.reshape(BH, N, r).sort(-1).values)
    # the grouping: expert m's items are order[offsets[m]:offsets[m + 1]], increasing
    items = choice.reshape(BH, N * r)
    for bh in range(BH):
        for m in range(M):
            grp = order[bh, offsets[bh, m]:offsets[bh, m + 1]]
            assert torch.equal(grp, (items[bh] == m).nonzero().flatten())
    ref = mita_attention_reference(Inputs(q.float(), k.float(), v.float(), (h, w), pool, topk,
                                          r, p))
    torch.testing.assert_close(out32.reshape(B, H, N, d), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('case', ['vit-7x11-cls', '32x43-cls-suffix-r2', 'segmenter-1025'])
def test_kernel_saves_probabilities_only_when_asked(case):
    """Without a backward to feed, no M x N tensor is kept (the experts work in a local
    buffer), to the same output and routing."""
    B, H, h, w, p, s, d, pool, topk, r = CASES[case]
    q, k, v = _qkv(B, H, p + h * w + s, d)
    kept = _forward(q, k, v, h, w, p, pool, topk, r)
    res = _forward(q, k, v, h, w, p, pool, topk, r, save=False)
    assert res.probs.numel() == 0
    for name in ('keys', 'choice', 'offsets', 'order'):  # the routing
        assert torch.equal(getattr(res, name), getattr(kept, name))
    torch.testing.assert_close(res.out, kept.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(res.lse, kept.lse, atol=1e-6, rtol=1e-6)
    res = _forward(q, k, v, h, w, p, pool, topk, r, shared=False)
    assert res.probs.numel() == 0 and res.shared_values.numel() == 0  # route-only: no V_R


def _backward_args(case='vit-7x11-cls'):
    """The arguments of _C.mita_backward, by name (the state's fields among them), from a
    real forward."""
    B, H, h, w, p, s, d, pool, topk, r = CASES[case]
    q, k, v = _qkv(B, H, p + h * w + s, d)
    state = _forward(q, k, v, h, w, p, pool, topk, r)
    flat = [t.reshape(state.out.shape) for t in (q, k, v)]
    return dict(q=flat[0], k=flat[1], v=flat[2], h=h, w=w, ph=pool[0], pw=pool[1], prefix=p,
                shared=True, shared_scale=1.0 / d, **state._asdict(),
                dout=torch.ones_like(state.out))


def _bwd(a):
    """_C.mita_backward on the arguments of :func:`_backward_args` (the state's fields
    gathered into its state)."""
    state = [a[name] for name in FusedState._fields]
    rest = {key: value for key, value in a.items() if key not in FusedState._fields}
    return _C.mita_backward(**rest, state=state)


def test_kernel_backward_rejects_bad_indices():
    """Every index the backward reads from a tensor is range-checked first."""
    a = _backward_args()
    N, M = a['q'].shape[1], a['keys'].shape[1]
    assert all(torch.isfinite(t).all() for t in _bwd(a))  # the good ones pass
    # a key outside [0, N) would read past the end of k and v
    keys = a['keys'].clone()
    keys[1, 2, 3] = N
    with pytest.raises(RuntimeError, match=rf'keys holds {N} .* outside \[0, {N}\)'):
        _bwd({**a, 'keys': keys})
    keys[1, 2, 3] = -1
    with pytest.raises(RuntimeError, match=r'keys holds -1'):
        _bwd({**a, 'keys': keys})
    # an expert id outside [0, M)
    choice = a['choice'].clone()
    choice[0, 5, 0] = M
    with pytest.raises(RuntimeError, match=rf'choice holds {M} .* outside \[0, {M}\)'):
        _bwd({**a, 'choice': choice})
    # an item id outside [0, N r) in the grouping
    order = a['order'].clone()
    order[0, 0] = 10 ** 9
    with pytest.raises(RuntimeError, match='order holds 1000000000'):
        _bwd({**a, 'order': order})
    # offsets that do not partition the items
    offsets = a['offsets'].clone()
    offsets[0, -1] += 1
    with pytest.raises(RuntimeError, match='offsets.* must run from 0 to N r'):
        _bwd({**a, 'offsets': offsets})
    offsets = a['offsets'].clone()
    offsets[0, 1], offsets[0, 2] = 7, 3
    with pytest.raises(RuntimeError, match='non-decreasing'):
        _bwd({**a, 'offsets': offsets})
    # wrong shapes and dtypes name the tensor
    with pytest.raises(RuntimeError, match='order must have shape'):
        _bwd({**a, 'order': a['order'][:, :-1]})
    with pytest.raises(RuntimeError, match='keys must be int64'):
        _bwd({**a, 'keys': a['keys'].int()})
    with pytest.raises(RuntimeError, match='lse must have shape'):
        _bwd({**a, 'lse': a['lse'][:, :-1]})
    with pytest.raises(RuntimeError, match='probs must have shape'):
        _bwd({**a, 'probs': a['probs'][:, :, 1:]})
    # a geometry that does not match the saved routing
    with pytest.raises(RuntimeError, match='keys must have shape'):
        _bwd({**a, 'ph': a['ph'] - 1})
    with pytest.raises(RuntimeError, match='does not fit N'):
        _bwd({**a, 'prefix': 5})


def test_kernel_forward_rejects_bad_arguments():
    q, k, v = (t.reshape(2, 37, 8) for t in _qkv(1, 2, 37, 8))
    # floating point only, all three of one dtype
    with pytest.raises(RuntimeError, match='float32, float64, bfloat16 or float16'):
        _C.mita_forward(q.long(), k.long(), v.long(), 6, 6, 2, 2, 1, 4, 1, True, 0.1, False)
    with pytest.raises(RuntimeError, match='the same dtype'):
        _C.mita_forward(q, k.bfloat16(), v, 6, 6, 2, 2, 1, 4, 1, True, 0.1, False)
    with pytest.raises(RuntimeError, match=r'q, k, v must be \[BH, N, d\]'):
        _C.mita_forward(q, k[:, 1:], v, 6, 6, 2, 2, 1, 4, 1, True, 0.1, False)
    with pytest.raises(RuntimeError, match='does not fit N'):
        _C.mita_forward(q, k, v, 6, 7, 2, 2, 1, 4, 1, True, 0.1, False)
    with pytest.raises(RuntimeError, match='topk must be in'):
        _C.mita_forward(q, k, v, 6, 6, 2, 2, 1, 38, 1, True, 0.1, False)
    with pytest.raises(RuntimeError, match='router_topk must be in'):
        _C.mita_forward(q, k, v, 6, 6, 2, 2, 1, 4, 5, True, 0.1, False)
    with pytest.raises(RuntimeError, match='pool'):
        _C.mita_forward(q, k, v, 6, 6, 7, 2, 1, 4, 1, True, 0.1, False)


def test_kernel_refuses_a_bias_table_of_other_heads():
    """[B, H, N, d] inputs need a table row per head: one with fewer rows (dividing BH, which
    [BH, N, d] inputs may take, row bh % H) would give heads another head's bias."""
    B, H, h, w, d, pool = 1, 4, 3, 3, 8, (2, 2)
    q, k, v = _qkv(B, H, 1 + h * w, d)
    bias = _bias(2, h, w)
    Bq, Bk = landmark_bias(bias, pool)
    with pytest.raises(RuntimeError, match=r'a row per head, \[H = 4'):
        _C.mita_forward(q, k, v, h, w, *pool, 1, 3, 1, True, 1.0 / d, False, Bq, Bk,
                        bias.table, h, w)


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
def test_large_logits_and_nans_as_the_reference(shared):
    """IEEE maths (no -ffast-math): logits of 1e4 underflow to exact zeros, not NaN; a NaN
    in v reaches exactly the outputs that read it."""
    q, k, v = _qkv(1, 2, 1 + 64, 16, seed=3)
    kw = dict(hw_shape=(8, 8), pool_size=(2, 2), topk=9, with_shared_expert=shared)
    big = q * 300  # routed logits up to ~1e4
    out = mita_attention(big, k, v, backend='fused_cpu', **kw)
    ref = mita_attention_reference(Inputs(big, k, v, **kw))
    assert torch.isfinite(out).all()
    # float32 logits of ~1e4 carry rounding errors of ~1e-3 (in either order of the products)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    rt = mita_routing(q, k, (8, 8), (2, 2), 9, 1, 1)
    j = int(rt.expert_keys[0, 1, 0, 0])  # a key of expert 0 in head 1
    v = v.clone()
    v[0, 1, j, 3] = float('nan')
    out = mita_attention(q, k, v, backend='fused_cpu', **kw)
    nan = torch.zeros_like(out, dtype=torch.bool)
    if shared:  # every V_R row averages all values: channel 3 is NaN for the whole head
        nan[0, 1, :, 3] = True
    else:  # only the queries whose expert holds key j (the dense reference, which
        # multiplies masked zeros by NaN, has NaN in all of channel 3 of that head)
        holds = (rt.expert_keys[0, 1] == j).any(-1)                 # [M]
        nan[0, 1, :, 3] = holds[rt.choice[0, 1, :, 0]]
        assert 0 < nan.sum() < out.shape[2]
    assert torch.equal(torch.isnan(out), nan)
    ref = mita_attention_reference(Inputs(q, k, v, **kw))
    torch.testing.assert_close(out[0, 0], ref[0, 0], atol=1e-5, rtol=1e-5)  # the other head


def _per_setting(settings, apply, restore):
    """Output and gradients of q, k, v of one router top-2 case under each setting
    (``apply(setting)`` before each, ``restore()`` after all)."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 3, 1 + 20 * 21 + 5, 16, seed=4))
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    res = []
    try:
        for s in settings:
            apply(s)
            out = mita_attention(q, k, v, (20, 21), (4, 5), 30, router_topk=2,
                                 backend='fused_cpu')
            res.append([out] + list(torch.autograd.grad(out, (q, k, v), g)))
    finally:
        restore()
    return res


def test_same_bits_on_any_number_of_threads():
    """No task writes memory another reads or writes: the result does not depend on how the
    tasks fall on threads (which the threads take as they go: it differs from call to
    call)."""
    threads = torch.get_num_threads()
    res = _per_setting((1, 2, 3, 2), torch.set_num_threads,
                       lambda: torch.set_num_threads(threads))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            assert torch.equal(a, b)


def test_kernel_phases_run_on_every_thread():
    """The phases' at::parallel_for is inline OpenMP: an extension built without -fopenmp
    runs them all on one thread, correct and half as fast on two cores."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert _C.parallel_threads() == n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_kernel_conversions_are_tensor_to(dtype):
    """bf16/fp16 inputs are widened and outputs narrowed by the kernel's own vector code:
    bit for bit Tensor.to, ties (to even), infinities, subnormals and overflow included, at
    every length around the 8-wide vectors; NaN stays NaN (its payload bits may differ)."""
    info = torch.finfo(dtype)
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 100
    ulp = torch.tensor([1.0, 3.0, 2.0 ** -10, info.tiny]).to(torch.float32)
    special = torch.tensor([0.0, -0.0, float('inf'), float('-inf'), float('nan'), info.max,
                            -info.max, 3.5e38, -3.5e38, 1e-40, info.tiny / 3, 65520.0])
    # exact ties between two values of dtype: v + ulp(v) / 2
    ties = ulp + (ulp * info.eps / 2)
    x = torch.cat([special, ties, -ties, x])
    for n in (1, 7, 8, 9, 15, 17, x.numel()):
        for src, to, bits in ((x[:n], dtype, torch.int16),
                              (x[:n].to(dtype), torch.float32, torch.int32)):
            ours, ref = _C._convert(src, to), src.to(to)
            assert torch.equal(ours.isnan(), ref.isnan()), n
            assert torch.equal(ours.nan_to_num(0).view(bits), ref.nan_to_num(0).view(bits)), n


def test_profile_counts_every_phase():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1 + 64, 16))
    bias = _bias(2, 8, 8)
    bias.table.requires_grad_()
    profile(True)
    try:
        # the bias means run only with a bias, the merge phase only with r > 1
        for b, r in ((None, 2), (bias, 1)):
            out = mita_attention(q, k, v, (8, 8), 2, 9, router_topk=r, backend='fused_cpu',
                                 rel_pos_bias=b)
            out.sum().backward()
    finally:
        phases = profile(False)
    assert set(phases) >= {'fwd.experts', 'fwd.routed', 'fwd.merge', 'bwd.routed',
                           'bwd.scores', 'fwd.bias_means', 'bwd.bias_means'}
    assert all(t > 0 for t in phases.values()), phases


def test_torch_mm_fallback_gives_the_same_results():
    """Where PyTorch links no Fortran BLAS, the kernels' GEMMs go through torch::mm: the same
    outputs and gradients (to rounding)."""
    res = _per_setting((False, True), _C._set_torch_mm_only,
                       lambda: _C._set_torch_mm_only(False))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---- BEiT's relative position bias (tokens [cls, grid]): the kernel's routing with the
# landmark means, the routed logits' table entries, and its checks.
BIAS_CASES = {  # (B, H, h, w, d, pool, topk, router_topk)
    'vit-7x11': (2, 3, 7, 11, 16, (3, 3), 10, 1),
    'vit-7x11-r2': (2, 3, 7, 11, 16, (3, 3), 10, 2),
    '1x9-pool1x2': (1, 2, 1, 9, 4, (1, 2), 3, 1),
    'segmenter-1025': (1, 2, 32, 32, 64, (7, 7), 49, 1),
}


def _bias(H, h, w, seed=1):
    g = torch.Generator().manual_seed(seed)
    return RelPosBias(torch.randn(H, table_size((h, w)), generator=g), (h, w))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16],
                         ids=['fp32', 'bf16', 'fp16'])
@pytest.mark.parametrize('case', list(BIAS_CASES.values()), ids=list(BIAS_CASES))
def test_kernel_routing_with_bias_is_the_reference_routing(case, dtype, float32_gemms):
    """With a bias: scores + Bq and shared logits + Bk as mita_routing's (the very same keys
    and experts; for bf16/fp16 inputs, routing in float32 on the rounded values), and the
    output of the dense reference with the dense bias."""
    B, H, h, w, d, pool, topk, r = case
    N, M, BH = 1 + h * w, pool[0] * pool[1], B * H
    q, k, v = _qkv(B, H, N, d, dtype=dtype)
    bias = _bias(H, h, w)
    Bq, Bk = landmark_bias(bias, pool)
    flat = (t.reshape(BH, N, d) for t in (q, k, v))
    out, lse, keys, choice, offsets, order, R, probs, ls, vr, out32 = _C.mita_forward(
        *flat, h, w, *pool, 1, topk, r, True, 1.0 / d, True, Bq, Bk, bias.table, h, w)
    out32 = out if dtype == torch.float32 else out32
    rt = mita_routing(q, k, (h, w), pool, topk, r, 1, landmark_bias=(Bq, Bk))
    torch.testing.assert_close(ls, rt.router.reshape(BH, N, M), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, torch.softmax(rt.scores, -1).reshape(BH, M, N),
                               atol=1e-6, rtol=1e-5)
    assert torch.equal(keys.sort(-1).values, rt.expert_keys.reshape(BH, M, topk).sort(-1).values)
    assert torch.equal(choice.sort(-1).values, rt.choice.reshape(BH, N, r).sort(-1).values)
    without = _forward(q, k, v, h, w, 1, pool, topk, r)
    assert not torch.equal(keys, without.keys), 'the bias does not move the routing'
    ref = mita_attention_reference(Inputs(q.float(), k.float(), v.float(), (h, w), pool, topk,
                                          r, 1, bias=bias))
    torch.testing.assert_close(out32.reshape(B, H, N, d), ref, atol=1e-5, rtol=1e-5)
    # inference (no probabilities saved): the experts' local buffer takes the bias too
    flat = (t.reshape(BH, N, d) for t in (q, k, v))
    res = FusedState(*_C.mita_forward(*flat, h, w, *pool, 1, topk, r, True, 1.0 / d, False,
                                      Bq, Bk, bias.table, h, w))
    assert res.probs.numel() == 0 and torch.equal(res.keys, keys)
    # (in float32: the scores in tiles sum in another order, an fp16 output may round apart)
    res32 = res.out if dtype == torch.float32 else res.out_float
    torch.testing.assert_close(res32, out32, atol=1e-6, rtol=1e-5)


def test_tiled_scores_as_one_tile():
    """Without a backward the experts work on tiles of about 1024 keys (an online softmax for
    V_R, the top-k fed tile by tile); with one they take whole rows. N = 3137: three tiles.
    Scores that are -inf over the first tile and more, a maximum in the last tile, NaN
    scores (never selected), and queries whose shared logits are all -inf (the routed
    expert alone, as route-only MiTA) give the same routing and outputs either way."""
    H, h, w, d, pool, topk = 2, 56, 56, 16, (7, 7), 49
    N = 1 + h * w
    q, k, v = (t.reshape(H, N, d) for t in _qkv(1, H, N, d, seed=6))
    bias = _bias(H, h, w)
    Bq, Bk = (t.clone() for t in landmark_bias(bias, pool))
    Bq[:, 0, :1500] = float('-inf')                       # nothing in tile 0, part of tile 1
    Bq[:, 3] += torch.linspace(0, 20, N)                  # the maximum moves to the last tile
    Bk[:, 5:10] = float('-inf')                           # no shared expert for queries 5-9

    def run(save, Bq=Bq, shared=True):
        return FusedState(*_C.mita_forward(q, k, v, h, w, *pool, 1, topk, 1, shared, 1.0 / d,
                                           save, Bq, Bk, bias.table, h, w))

    tiled, whole = run(False), run(True)
    for name in ('keys', 'choice', 'offsets', 'order'):
        assert torch.equal(getattr(tiled, name), getattr(whole, name))
    for name in ('out', 'lse', 'shared_values'):
        torch.testing.assert_close(getattr(tiled, name), getattr(whole, name), atol=1e-5,
                                   rtol=1e-5)
    rt = mita_routing(q[None], k[None], (h, w), pool, topk, 1, 1, landmark_bias=(Bq, Bk))
    assert torch.equal(tiled.keys.sort(-1).values, rt.expert_keys[0].sort(-1).values)
    assert (tiled.keys[:, 0] >= 1500).all()
    torch.testing.assert_close(tiled.shared_values, torch.softmax(rt.scores[0], -1) @ v,
                               atol=1e-5,
                               rtol=1e-5)
    alone = run(False, shared=False)  # route-only: the same choices, no shared expert
    assert torch.equal(alone.choice, tiled.choice)
    torch.testing.assert_close(tiled.out[:, 5:10], alone.out[:, 5:10], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(tiled.out[:, 10:20], alone.out[:, 10:20])
    # NaN scores: never among the keys while others are available; V_R is NaN (as softmax)
    nan = Bq.clone()
    nan[:, 2, 1000:1100] = float('nan')
    tiled, whole = run(False, nan), run(True, nan)
    assert torch.equal(tiled.keys, whole.keys)
    assert not ((tiled.keys[:, 2] >= 1000) & (tiled.keys[:, 2] < 1100)).any()
    assert tiled.shared_values[:, 2].isnan().all()
    assert not tiled.shared_values[:, 3].isnan().any()


@pytest.mark.parametrize('save', [False, True], ids=['tiled', 'whole-rows'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_low_precision_inputs_are_read_in_place(dtype, save, float32_gemms):
    """bf16/fp16 q, k, v are read by the phases a tile or a row at a time (no float32 copies):
    bit for bit the float32 kernel on the widened values (widening is exact), routing and
    outputs, in tiles (N = 3137: three) and on whole rows, router top-1 and top-2, with
    strided inputs too."""
    H, h, w, d, pool, topk = 2, 56, 56, 16, (7, 7), 49
    N = 1 + h * w
    q, k, v = (t.reshape(H, N, d).to(dtype) for t in _qkv(1, H, N, d, seed=3))

    def run(q, k, v, r):
        return FusedState(*_C.mita_forward(q, k, v, h, w, *pool, 1, topk, r, True, 1.0 / d,
                                           save))

    for r in (1, 2):  # the routed partial merged in the routed phase (r = 1) or phase 6
        wide = run(q.float(), k.float(), v.float(), r)
        strided = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
        for low in (run(q, k, v, r), run(*strided, r)):
            assert low.out.dtype == dtype and torch.equal(low.out, wide.out.to(dtype))
            assert torch.equal(low.out_float, wide.out)
            for a, b in zip(low[1:-1], wide[1:-1]):  # lse, routing, R, probs, Ls, V_R
                assert torch.equal(a, b)


def _bias_call(case='vit-7x11'):
    """Good arguments of _C.mita_forward with a bias, by name, and its outputs."""
    B, H, h, w, d, pool, topk, r = BIAS_CASES[case]
    N = 1 + h * w
    q, k, v = (t.reshape(B * H, N, d) for t in _qkv(B, H, N, d))
    bias = _bias(H, h, w)
    Bq, Bk = landmark_bias(bias, pool)
    fwd = dict(q=q, k=k, v=v, h=h, w=w, ph=pool[0], pw=pool[1], prefix=1, topk=topk,
               router_topk=r, shared=True, shared_scale=1.0 / d, save_probs=True, bias_q=Bq,
               bias_k=Bk, table=bias.table, window_h=h, window_w=w)
    return fwd, _C.mita_forward(**fwd)


def test_kernel_rejects_bad_bias_inputs():
    """Bias operands that do not fit the call: a clear error naming the tensor, never a read
    outside the table."""
    a, res = _bias_call()
    H, T = a['table'].shape
    M, N = a['bias_q'].shape[1:]

    def fwd(match, **kw):
        with pytest.raises(RuntimeError, match=match):
            _C.mita_forward(**{**a, **kw})
    fwd(rf'bias table must have shape \[{H}, {T}\]', table=torch.zeros(H, T + 1))
    fwd(r'\[H, T\] with H dividing BH = 6', table=torch.zeros(4, T))
    fwd(r'\[H, T\] with H dividing BH', table=torch.zeros(H * T))
    fwd(r'floating point CPU tensor, got Long', table=a['table'].long())
    fwd(rf'bias_q must have shape \[{H}, {M}, {N}\]', bias_q=a['bias_q'][:, :, 1:])
    fwd(rf'bias_k must have shape \[{H}, {N}, {M}\]', bias_k=a['bias_q'])
    fwd(r'needs the table and the landmark means', bias_k=None)
    fwd(r'needs the table', table=None)
    fwd(r'bias tensors given without a window', window_h=0, window_w=0)
    fwd(r'window must be positive', window_h=-1)
    # the table indexes [cls, Wh x Ww grid] tokens: any other layout is refused
    fwd(r'needs tokens \[cls, 11x7 grid\].*grid 7x11', window_h=11, window_w=7)
    fwd(r'needs tokens \[cls, 7x11 grid\].*got prefix 0', prefix=0)
    # the backward: the table and window as the forward took them
    bwd = dict(q=a['q'], k=a['k'], v=a['v'], h=a['h'], w=a['w'], ph=a['ph'], pw=a['pw'],
               prefix=1, shared=True, shared_scale=a['shared_scale'], state=res,
               dout=torch.ones_like(res[0]), table=a['table'], window_h=a['h'],
               window_w=a['w'])
    grads = _C.mita_backward(**bwd)
    assert [tuple(g.shape) for g in grads[3:]] == [(H, M, N), (H, N, M), (H, T)]
    with pytest.raises(RuntimeError, match=rf'bias table must have shape \[{H}, {T}\]'):
        _C.mita_backward(**{**bwd, 'table': a['table'][:, 1:]})
    with pytest.raises(RuntimeError, match='needs tokens'):
        _C.mita_backward(**{**bwd, 'window_h': a['w'], 'window_w': a['h']})
    with pytest.raises(RuntimeError, match='without a window'):
        _C.mita_backward(**{**bwd, 'window_h': 0, 'window_w': 0})


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
@pytest.mark.parametrize('with_bias', [True, False], ids=['bias', 'no-bias'])
def test_fake_implementations_match_the_kernel(with_bias, shared):
    """The fake implementations of the custom ops give the real outputs' shapes and dtypes
    (what torch.compile and other tracers see), bias gradients included."""
    from mita_seg.ops import fused_cpu
    a, _ = _bias_call()
    a = {**a, 'shared': shared}
    if not with_bias:
        a = {**a, 'bias_q': None, 'bias_k': None, 'table': None, 'window_h': 0, 'window_w': 0}
    fwd_args = list(a.values())
    torch.library.opcheck(fused_cpu._fused_fwd, fwd_args, test_utils=('test_schema',
                                                                      'test_faketensor'))
    state = fused_cpu._fused_fwd(*fwd_args)
    bwd_args = [a['q'], a['k'], a['v'], a['h'], a['w'], a['ph'], a['pw'], 1, shared,
                a['shared_scale'], state, torch.ones_like(state[0]), a['table'],
                a['window_h'], a['window_w']]
    torch.library.opcheck(fused_cpu._fused_bwd, bwd_args, test_utils=('test_schema',
                                                                      'test_faketensor'))


def test_same_bits_with_one_and_two_threads_with_bias():
    """With a bias too (the table's gradient is a scatter-add): the result does not depend on
    how the tasks fall on threads."""
    threads = torch.get_num_threads()
    B, H, h, w, d = 2, 3, 20, 21, 16
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, 1 + h * w, d, seed=4))
    table = _bias(H, h, w).table.requires_grad_()
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    res = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = mita_attention(q, k, v, (h, w), (4, 5), 30, router_topk=2,
                                 backend='fused_cpu', rel_pos_bias=RelPosBias(table, (h, w)))
            res.append([out] + list(torch.autograd.grad(out, (q, k, v, table), g)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*res):
        assert torch.equal(a, b)


# (H, Wh, Ww, pool): square, non-square, pools that do not divide the grid (overlapping
# regions), a 1-row grid, the paper's 32x32 / 7x7.
MEANS_CASES = {'5x7-pool2x3': (3, 5, 7, (2, 3)), '8x8-pool3': (2, 8, 8, (3, 3)),
               '4x6-pool4x3': (1, 4, 6, (4, 3)), '1x9-pool1x2': (2, 1, 9, (1, 2)),
               '32x32-pool7': (2, 32, 32, (7, 7))}


@pytest.mark.parametrize('case', list(MEANS_CASES.values()), ids=list(MEANS_CASES))
def test_kernel_landmark_means_are_bias_landmark_bias(case):
    """The C++ landmark means (what fused_cpu feeds its kernel) and their gradient are
    mita_seg.ops.bias.landmark_bias's, in float64 and float32."""
    from mita_seg.ops.fused_cpu import LandmarkBias
    H, Wh, Ww, pool = case
    g = torch.Generator().manual_seed(2)
    table = torch.randn(H, table_size((Wh, Ww)), generator=g, dtype=torch.float64)
    M, N = pool[0] * pool[1], 1 + Wh * Ww
    grads = (torch.randn(H, M, N, generator=g, dtype=torch.float64),
             torch.randn(H, N, M, generator=g, dtype=torch.float64))
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        t = table.to(dtype).requires_grad_()
        ref = landmark_bias(RelPosBias(t, (Wh, Ww)), pool)
        got = LandmarkBias.apply(t, (Wh, Ww), pool)
        for a, b in zip(got, ref):
            assert a.dtype == dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, atol=tol, rtol=0)
        gr = tuple(x.to(dtype) for x in grads)
        d_got, = torch.autograd.grad(got, t, gr)
        d_ref, = torch.autograd.grad(ref, t, gr)
        torch.testing.assert_close(d_got, d_ref, atol=tol * 100, rtol=tol)
    t = table.clone().requires_grad_()
    if N <= 40:  # gradcheck: one column of the Jacobian per table entry
        assert torch.autograd.gradcheck(lambda x: LandmarkBias.apply(x, (Wh, Ww), pool), (t, ))


def test_kernel_landmark_means_reject_bad_inputs():
    from mita_seg.ops import fused_cpu
    table = torch.zeros(2, table_size((5, 7)))
    with pytest.raises(RuntimeError, match=r'table must be \[H, 120\] for a 5x7 window'):
        _C.landmark_bias(table[:, 1:], 5, 7, 2, 3)
    with pytest.raises(RuntimeError, match='float32 or float64 CPU tensor, got Long'):
        _C.landmark_bias(table.long(), 5, 7, 2, 3)
    with pytest.raises(RuntimeError, match='pool 6x3 must be within the grid 5x7'):
        _C.landmark_bias(table, 5, 7, 6, 3)
    with pytest.raises(RuntimeError, match='window must be positive'):
        _C.landmark_bias(table, 0, 7, 1, 1)
    gq, gk = _C.landmark_bias(table, 5, 7, 2, 3)
    assert _C.landmark_bias_backward(gq, gk, 5, 7, 2, 3).shape == table.shape
    with pytest.raises(RuntimeError, match=r'grad_k must have shape \[2, 36, 6\]'):
        _C.landmark_bias_backward(gq, gq, 5, 7, 2, 3)
    with pytest.raises(RuntimeError, match=r'grad_q must have shape \[2, 4, 36\]'):
        _C.landmark_bias_backward(gq, gk, 5, 7, 2, 2)
    torch.library.opcheck(fused_cpu._landmark_bias, (table, 5, 7, 2, 3),
                          test_utils=('test_schema', 'test_faketensor'))
    torch.library.opcheck(fused_cpu._landmark_bias_bwd, (gq, gk, 5, 7, 2, 3),
                          test_utils=('test_schema', 'test_faketensor'))


# ---- bf16/fp16 read-out GEMMs (oneDNN's brgemm; forced with MITA_CPU_BF16_GEMM=1: through
# cpublas's plain bf16/fp16 GEMM where oneDNN's kernel does not run on this CPU).
LOWP_CASES = {  # (B, H, h, w, prefix, suffix, d, pool, topk, router_topk, bias)
    'vit-7x11-cls': (2, 3, 7, 11, 1, 0, 16, (3, 3), 10, 1, False),
    '5x5-odd-d-r3': (3, 1, 5, 5, 2, 3, 5, (2, 3), 5, 3, False),  # odd d and topk: padded
    '1x9-pool1x2': (1, 2, 1, 9, 1, 0, 4, (1, 2), 3, 1, False),
    'segmenter-1025': (1, 2, 32, 32, 1, 0, 64, (7, 7), 49, 1, False),
    '48x48-two-tiles-r2': (1, 1, 48, 48, 1, 0, 32, (7, 7), 49, 2, False),
    'bias-vit-7x11-r2': (2, 3, 7, 11, 1, 0, 16, (3, 3), 9, 2, True),
    'bias-segmenter-1025': (1, 2, 32, 32, 1, 0, 64, (7, 7), 49, 1, True),
}


@pytest.mark.parametrize('save', [False, True], ids=['tiled', 'whole-rows'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('case', list(LOWP_CASES.values()), ids=list(LOWP_CASES))
def test_lowp_gemms_keep_the_float32_routing(case, dtype, save, monkeypatch):
    """With the bf16/fp16 GEMMs forced on: the routing (landmarks, scores' probabilities, shared
    logits, keys, choices, grouping) bit for bit the float32 path's, and the output within
    bf16/fp16 rounding of the float32 reference (test_precision holds it to FlashAttention's
    tolerance); off, the float32 path's bits."""
    B, H, h, w, p, s, d, pool, topk, r, with_bias = case
    N, BH = p + h * w + s, B * H
    q, k, v = (t.reshape(BH, N, d) for t in _qkv(B, H, N, d, seed=5, dtype=dtype))
    extra = ()
    bias = None
    if with_bias:
        bias = _bias(H, h, w)
        extra = (*landmark_bias(bias, pool), bias.table, h, w)

    def run(setting):
        monkeypatch.setenv('MITA_CPU_BF16_GEMM', setting)
        path = _C.lowp_gemm_path(dtype)
        return path, FusedState(*_C.mita_forward(q, k, v, h, w, *pool, p, topk, r, True,
                                                 1.0 / d, save, *extra))

    path32, f32 = run('0')
    path, low = run('1')
    assert path32 == 'float32' and path in ('brgemm-packed', 'brgemm-vnni', 'brgemm-rows',
                                            'cpublas')
    for name in ('keys', 'choice', 'offsets', 'order', 'landmarks', 'probs',
                 'shared_logits'):
        assert torch.equal(getattr(low, name), getattr(f32, name)), name
    assert not torch.equal(low.out_float, f32.out_float), \
        'MITA_CPU_BF16_GEMM=1 ran the float32 GEMMs'
    ref = mita_attention_reference(Inputs(
        *(t.float().reshape(B, H, N, d) for t in (q, k, v)), (h, w), pool, topk, r, p,
        bias=bias)).reshape(BH, N, d)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3  # ~4 ulp of the P, V products' rounding
    torch.testing.assert_close(low.out_float, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(low.shared_values, f32.shared_values, atol=tol, rtol=tol)
    torch.testing.assert_close(low.lse, f32.lse, atol=tol, rtol=tol)
    assert low.out.dtype == dtype and torch.equal(low.out, low.out_float.to(dtype))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('case', list(LOWP_CASES.values()), ids=list(LOWP_CASES))
def test_lowp_gemms_in_the_backward(case, dtype, monkeypatch):
    """The backward's routed GEMMs (q K_e^T, dout V_e^T, dS^T q, P^T dout, dS K_e) on the
    bf16/fp16 path: the gradients of q, k, v (and of the bias table) within bf16/fp16 rounding
    of the float32 reference's, and not the float32 GEMMs' bits (the path ran).
    test_precision holds them to FlashAttention's tolerance as well."""
    B, H, h, w, p, s, d, pool, topk, r, with_bias = case
    N = p + h * w + s
    bias = _bias(H, h, w) if with_bias else None
    q, k, v = _qkv(B, H, N, d, seed=7, dtype=dtype)
    dout = torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(8)).to(dtype)
    kw = dict(pool_size=pool, topk=topk, router_topk=r, num_prefix_tokens=p)

    def leaves(cast):
        """q, k, v (cast) and the bias table as autograd leaves, and the bias of the table."""
        x = [cast(t).requires_grad_() for t in (q, k, v)]
        if bias is None:
            return x, None
        x.append(bias.table.clone().requires_grad_())
        return x, RelPosBias(x[3], bias.window)

    def grads(setting):
        monkeypatch.setenv('MITA_CPU_BF16_GEMM', setting)
        x, b = leaves(torch.clone)
        out = mita_attention(*x[:3], (h, w), **kw, backend='fused_cpu', rel_pos_bias=b)
        return torch.autograd.grad(out, x, dout)

    low, f32 = grads('1'), grads('0')
    x, b = leaves(lambda t: t.float())
    ref = mita_attention_reference(Inputs(*x[:3], (h, w), pool, topk, r, p, bias=b))
    ref = torch.autograd.grad(ref, x, dout.float())
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    for name, a, b, c in zip(['dq', 'dk', 'dv', 'dtable'], low, f32, ref):
        scale = c.abs().max().item()
        err = (a.float() - c).abs().max().item()
        assert err <= tol * scale, f'{name}: error {err:.3g} > {tol} x max |ref| {scale:.3g}'
        assert a.dtype == b.dtype
    assert any(not torch.equal(a, b) for a, b in zip(low, f32)), \
        'MITA_CPU_BF16_GEMM=1 ran the float32 GEMMs in the backward'


def test_lowp_gemm_path_by_cpu_and_setting(monkeypatch):
    """Unset or =0, the bf16/fp16 GEMMs run in float32 on every CPU (the faster choice on
    each one measured, AMX included); =1 on the tiles where the CPU has AMX for the dtype
    (the packed layout, the first probed); float32/float64 inputs never take them.
    (tests/test_cpu_paths.py checks every path against its probe, capped CPU by CPU.)"""
    if not osp.exists('/proc/cpuinfo'):
        pytest.skip('reads the CPU flags from /proc/cpuinfo')
    with open('/proc/cpuinfo') as f:
        amx = re.search(r'\bamx_bf16\b', f.read()) is not None
    for setting in (None, '0'):
        if setting is None:
            monkeypatch.delenv('MITA_CPU_BF16_GEMM', raising=False)
        else:
            monkeypatch.setenv('MITA_CPU_BF16_GEMM', setting)
        assert _C.lowp_gemm_path(torch.bfloat16) == _C.lowp_gemm_path(torch.float16) == \
            'float32'
        assert _C.lowp_gemm_path(torch.float32) == 'float32'
    monkeypatch.setenv('MITA_CPU_BF16_GEMM', '1')
    if amx:
        assert _C.lowp_gemm_path(torch.bfloat16) == 'brgemm-packed'
    assert _C.lowp_gemm_path(torch.float64) == 'float32'


HEADS_DTYPES = {'fp32': (torch.float32, '0'), 'bf16': (torch.bfloat16, '0'),
                'bf16-lowp-gemms': (torch.bfloat16, '1'), 'fp16-lowp-gemms': (torch.float16, '1')}


def _projection(B, N, H, d, dtype, seed=7, grad=False):
    """q, k, v [B, H, N, d] as the module makes them: views of one qkv projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3 * H * d, generator=g).to(dtype).requires_grad_(grad)
    return qkv, qkv.reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
@pytest.mark.parametrize('dtype', list(HEADS_DTYPES), ids=list(HEADS_DTYPES))
@pytest.mark.parametrize('case', list(LOWP_CASES.values()), ids=list(LOWP_CASES))
def test_heads_read_in_the_projection_and_written_as_tokens(case, dtype, shared,
                                                            monkeypatch):
    """``[B, H, N, d]`` views of a qkv projection (``[B, N, 3, H, d]`` permuted, as the
    module makes them) are read in place and out is written ``[B, N, H, d]`` (the module's
    ``[B, N, C]``): the kernel on contiguous ``[BH, N, d]`` copies, the same routing and the
    same outputs (bf16/fp16 bit for bit: read into buffers either way; float32 to rounding,
    as BLAS may round with another leading dimension), with and without the bf16/fp16 GEMMs
    (forced on: their packing reads the rows too), router top-1 and top-2, with a bias."""
    dtype, lowp = HEADS_DTYPES[dtype]
    monkeypatch.setenv('MITA_CPU_BF16_GEMM', lowp)
    B, H, h, w, p, s, d, pool, topk, r, with_bias = case
    N, BH = p + h * w + s, B * H
    _, (q, k, v) = _projection(B, N, H, d, dtype)
    extra = ()
    if with_bias:
        bias = _bias(H, h, w)
        extra = (*landmark_bias(bias, pool), bias.table, h, w)

    def run(q, k, v):
        return FusedState(*_C.mita_forward(q, k, v, h, w, *pool, p, topk, r, shared,
                                           1.0 / d, False, *extra))

    views = run(q, k, v)
    copies = run(*(t.reshape(BH, N, d) for t in (q, k, v)))
    assert not q.is_contiguous() and views.out.shape == (B, N, H, d)
    assert views.out.is_contiguous() and views.out.dtype == dtype
    as_tokens = lambda t: t.view(B, H, N, d).transpose(1, 2)  # noqa: E731
    for name in ('keys', 'choice', 'offsets', 'order'):
        assert torch.equal(getattr(views, name), getattr(copies, name)), name
    same = torch.equal if dtype != torch.float32 else \
        lambda a, b: torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5) is None
    assert same(views.out, as_tokens(copies.out))
    if dtype != torch.float32:
        assert same(views.out_float, as_tokens(copies.out_float))
    for name in ('lse', 'landmarks', 'shared_values'):
        assert same(getattr(views, name), getattr(copies, name)), name


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('global_tokens', [(0, 0), (1, 0)], ids=['no-global', 'global-cls'])
def test_gradients_through_projection_views(dtype, global_tokens):
    """The backward of the fused op fed by views of a qkv projection (its output
    ``[B, N, H, d]``, read back as ``[BH, N, d]``): the gradients of the projection, and the
    output, are those of contiguous copies (with a global cls token: the log-sum-exp merge)."""
    B, H, h, w, d = 2, 3, 7, 11, 16
    N = 1 + h * w
    g = torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    res = []
    for copy in (False, True):
        qkv, qkv_views = _projection(B, N, H, d, dtype, grad=True)
        q, k, v = (t.contiguous() if copy else t for t in qkv_views)
        out = mita_attention(q, k, v, (h, w), (3, 3), 10, num_prefix_tokens=1,
                             backend='fused_cpu', global_tokens=global_tokens)
        res.append((out, *torch.autograd.grad((out.float() * g.float()).sum(), qkv)))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, **tol)


def test_fake_forward_of_projection_views():
    """The forward's fake gives ``[B, N, H, d]`` outputs for ``[B, H, N, d]`` views (what
    torch.compile sees), and the fused backend's result is their transpose: the module's
    ``[B, N, C]`` reshape is a view, where a gradient is needed and where none is (the
    custom op of those calls returns a contiguous ``[B, N, H, d]``, its fake too)."""
    from mita_seg.ops import fused_cpu
    B, H, h, w, d = 2, 3, 7, 11, 16
    N = 1 + h * w
    for dtype in (torch.float32, torch.bfloat16):
        _, qkv = _projection(B, N, H, d, dtype, seed=2)
        assert not qkv[0].is_contiguous()
        args = list(qkv) + [h, w, 3, 3, 1, 10, 1, True, 1.0 / d, False]
        torch.library.opcheck(fused_cpu._fused_fwd, args,
                              test_utils=('test_schema', 'test_faketensor'))
    for grad in (False, True):
        _, (q, k, v) = _projection(B, N, H, d, torch.float32, seed=2, grad=grad)
        out = mita_attention(q, k, v, (h, w), (3, 3), 10, backend='fused_cpu')
        assert out.transpose(1, 2).is_contiguous(), grad
        x = out.transpose(1, 2).reshape(B, N, H * d)   # the module's head merge
        assert x.data_ptr() == out.data_ptr(), grad
    _, qkv = _projection(B, N, H, d, torch.float32, seed=2)
    torch.library.opcheck(torch.ops.mita_seg.mita_attention.default,
                          list(qkv) + [h, w, 3, 3, 10, 1, 1, True, 1.0 / d, 64, 'fused_cpu'],
                          test_utils=('test_schema', 'test_faketensor'))
