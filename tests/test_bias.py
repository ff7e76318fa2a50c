"""BEiT's relative position bias in the MiTA operator: the bias maths (index, box-filter
means) against mmseg and dense pooling, every backend against the dense reference (outputs
and gradients, the bias table's included), and route-only ``k >= N`` against softmax
attention with the dense bias."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from mmseg.models.backbones.beit import BEiTAttention

from mita_seg.ops import BACKENDS, Inputs, RelPosBias, mita_attention, select_backend
from mita_seg.ops.bias import (bias_index, check_bias, dense_bias, landmark_bias,
                               pooled_dense_bias, table_size)

# (B, H, h, w, d, pool, topk): square, non-square, pools that do not divide the grid (the
# adaptive pool's regions overlap), a 1-row grid, the paper's 32x32 / 7x7 / 49.
CASES = {
    '5x7-pool2x3': (2, 3, 5, 7, 8, (2, 3), 6),
    '8x8-pool3': (1, 2, 8, 8, 16, (3, 3), 10),
    '4x6-pool4x3': (2, 1, 4, 6, 5, (4, 3), 5),
    '1x9-pool1x2': (1, 2, 1, 9, 4, (1, 2), 3),
    '32x32-pool7': (1, 2, 32, 32, 8, (7, 7), 49),
}
# Backends that take a bias on CPU.
BIAS_BACKENDS = ['fused_cpu', 'blocked', 'varlen']


def _inputs(case, dtype=torch.float32, seed=0):
    B, H, h, w, d, pool, topk = case
    g = torch.Generator().manual_seed(seed)
    N = 1 + h * w
    q, k, v, grad = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64).to(dtype)
                     for _ in range(4))
    # BEiT's tables are trained from zeros to values around +-1: large enough to move the
    # routing, as here.
    table = torch.randn(H, table_size((h, w)), generator=g, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, table)], grad


def _run(case, backend, tensors, shared=True, topk=None):
    B, H, h, w, d, pool, k_ = case
    q, k, v, table = tensors
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # topk > N is clamped with a warning
        return mita_attention(q, k, v, (h, w), pool, topk or k_, with_shared_expert=shared,
                              backend=backend, rel_pos_bias=RelPosBias(table, (h, w)))


def test_index_is_mmseg_relative_position_index():
    for window in [(5, 7), (1, 9), (14, 14)]:
        attn = BEiTAttention(embed_dims=16, num_heads=2, window_size=window)
        N = 1 + window[0] * window[1]
        t = torch.arange(N)
        got = bias_index(window, t.view(-1, 1), t.view(1, -1))
        assert torch.equal(got, attn.relative_position_index), window
        assert attn.relative_position_bias_table.shape[0] == table_size(window)


@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_box_filter_means_equal_dense_pooling(case):
    B, H, h, w, d, pool, topk = case
    (_, _, _, table), _ = _inputs(case, torch.float64)
    bias = RelPosBias(table, (h, w))
    Bq, Bk = landmark_bias(bias, pool)
    Bq_ref, Bk_ref = pooled_dense_bias(dense_bias(bias), (h, w), pool)
    M = pool[0] * pool[1]
    assert Bq.shape == (H, M, 1 + h * w) and Bk.shape == (H, 1 + h * w, M)
    torch.testing.assert_close(Bq, Bq_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(Bk, Bk_ref, atol=1e-12, rtol=0)
    # float32 tables: the integral image runs in float64, so no cancellation error.
    Bq32, Bk32 = landmark_bias(RelPosBias(table.float(), (h, w)), pool)
    assert Bq32.dtype == torch.float32
    torch.testing.assert_close(Bq32, Bq_ref.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(Bk32, Bk_ref.float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize('backend', BIAS_BACKENDS)
@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_backends_match_reference_with_bias(case, shared, backend):
    tensors, grad = _inputs(case)
    out = _run(case, backend, tensors, shared)
    ref = _run(case, 'reference', tensors, shared)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out, tensors, grad.float())
    grads_ref = torch.autograd.grad(ref, tensors, grad.float())
    for name, a, b in zip(['q', 'k', 'v', 'table'], grads, grads_ref):
        assert b.abs().sum() > 0, f'd{name} of the reference is zero: the case tests nothing'
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f'd{name}: {m}')


@pytest.mark.parametrize('backend', BIAS_BACKENDS)
def test_bias_changes_the_output_and_the_routing(backend):
    case = CASES['8x8-pool3']
    tensors, _ = _inputs(case)
    B, H, h, w, d, pool, topk = case
    q, k, v, table = tensors
    with_bias = _run(case, backend, tensors)
    without = mita_attention(q, k, v, (h, w), pool, topk, backend=backend)
    assert (with_bias - without).abs().max() > 1e-2
    # A zero table is no bias at all.
    zero = [q, k, v, torch.zeros_like(table)]
    torch.testing.assert_close(_run(case, backend, zero), without, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize('backend', BIAS_BACKENDS + ['reference'])
def test_route_only_full_topk_is_attention_with_the_dense_bias(backend):
    case = CASES['5x7-pool2x3']
    tensors, _ = _inputs(case)
    q, k, v, table = tensors
    B, H, h, w, d, pool, topk = case
    out = _run(case, backend, tensors, shared=False, topk=10**6)
    mask = dense_bias(RelPosBias(table, (h, w)))                        # [H, N, N]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('backend', BIAS_BACKENDS)
def test_gradcheck_float64_with_bias(backend):
    case = (1, 2, 3, 4, 3, (2, 2), 4)
    tensors, _ = _inputs(case, torch.float64)
    B, H, h, w, d, pool, topk = case

    def f(q, k, v, table):
        return mita_attention(q, k, v, (h, w), pool, topk, backend=backend,
                              rel_pos_bias=RelPosBias(table, (h, w)))

    # fast_mode: the Jacobian checked along random directions (the full one costs 30 s
    # through varlen's padded kernel); a wrong gradient of any input still fails it.
    assert torch.autograd.gradcheck(f, tuple(tensors), atol=1e-6, fast_mode=True)


def test_bias_that_does_not_fit_the_grid_is_refused():
    H, (h, w) = 2, (4, 5)
    q = torch.randn(1, H, 1 + h * w, 8)
    ok = RelPosBias(torch.zeros(H, table_size((h, w))), (h, w))
    mita_attention(q, q, q, (h, w), 2, 4, rel_pos_bias=ok)
    trained_elsewhere = RelPosBias(torch.zeros(H, table_size((6, 6))), (6, 6))
    with pytest.raises(ValueError, match=r'built for a 6x6 patch grid.*4x5.*slide'):
        mita_attention(q, q, q, (h, w), 2, 4, rel_pos_bias=trained_elsewhere)
    wrong_table = RelPosBias(torch.zeros(H, table_size((6, 6))), (h, w))
    with pytest.raises(ValueError, match='resize_rel_pos_embed'):
        mita_attention(q, q, q, (h, w), 2, 4, rel_pos_bias=wrong_table)
    with pytest.raises(ValueError, match=r'\[H, T\] = \[2, '):
        mita_attention(q, q, q, (h, w), 2, 4,
                       rel_pos_bias=RelPosBias(ok.table.t(), (h, w)))
    with pytest.raises(ValueError, match='num_prefix_tokens=1'):
        check_bias(ok, H, h * w, (h, w), 0)


def test_dispatch_with_bias_picks_the_fused_kernel_on_cpu():
    case = CASES['5x7-pool2x3']
    (q, k, v, table), _ = _inputs(case)
    B, H, h, w, d, pool, topk = case
    inp = Inputs(q, k, v, (h, w), pool, topk, bias=RelPosBias(table, (h, w)))
    name = select_backend(inp)
    assert name == 'fused_cpu'  # the first of the CPU order: it takes the bias
    for backend in BIAS_BACKENDS:
        assert BACKENDS[backend].unsupported(inp) == []
