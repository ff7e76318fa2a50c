"""Gradients of the fused CPU MiTA path (C++ forward and backward, the backward from what
the forward saved) against the dense reference, with and without a relative position bias;
about 5 s on 2 cores."""
import pytest
import torch

from mita_seg.ops import Inputs, RelPosBias, mita_attention, mita_attention_reference
from mita_seg.ops.bias import table_size
from mita_seg.ops.fused_cpu import _C

pytestmark = pytest.mark.skipif(_C is None, reason='the C++ extension mita_seg._C is not built')

# (B, H, h, w, prefix, suffix, d, pool, topk, router_topk): the awkward cases of test_ops.py.
CASES = {
    'vit-7x11-cls': (2, 3, 7, 11, 1, 0, 16, 3, 10, 1),
    'vit-7x11-cls-r2': (2, 3, 7, 11, 1, 0, 16, 3, 10, 2),
    '32x43-cls': (1, 2, 32, 43, 1, 0, 8, 7, 49, 1),
    '32x43-suffix150': (1, 2, 32, 43, 0, 150, 8, (5, 7), 49, 1),
    '32x43-cls-suffix-r2': (2, 2, 32, 43, 1, 11, 8, 7, 49, 2),
    '5x5-odd-d': (3, 1, 5, 5, 2, 3, 5, (2, 3), 4, 3),
    '1x9-pool1': (1, 2, 1, 9, 1, 0, 4, (1, 2), 3, 1),
}


def _inputs(B, H, N, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(B, H, N, d, generator=g, dtype=dtype) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], grad


def _pair(p):
    return (p, p) if isinstance(p, int) else p


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_fused_gradients_match_dense_reference(case, shared):
    B, H, h, w, p, s, d, pool, topk, r = case
    (q, k, v), grad = _inputs(B, H, p + h * w + s, d)
    kw = dict(hw_shape=(h, w), topk=topk, router_topk=r, num_prefix_tokens=p,
              with_shared_expert=shared)
    out = mita_attention(q, k, v, pool_size=pool, backend='fused_cpu', **kw)
    fused = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(
        mita_attention_reference(Inputs(q, k, v, pool_size=_pair(pool), **kw)), (q, k, v), grad)
    for name, a, b in zip('qkv', fused, ref):
        assert a.abs().sum() > 0, f'd{name} is zero'
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f'd{name}: {m}')


def test_fused_op_gradcheck_float64():
    """End to end: the C++ read-out backward and the ATen routing backward (landmarks, S,
    G, V_R), in float64."""
    (q, k, v), _ = _inputs(1, 2, 1 + 12 + 2, 3, torch.float64, seed=5)
    for kw in (dict(router_topk=2), dict(router_topk=1),
               dict(router_topk=1, with_shared_expert=False)):
        assert torch.autograd.gradcheck(
            lambda a, b, c, kw=kw: mita_attention(a, b, c, (3, 4), 2, 4, backend='fused_cpu',
                                                  **kw), (q, k, v), fast_mode=True)


def test_fused_gradients_low_precision():
    """bfloat16 inputs: routing and read-out run in float32, gradients come back in
    bfloat16 (reference: float32 on the same, rounded, values)."""
    (q, k, v), grad = _inputs(2, 2, 1 + 8 * 8, 16, seed=6)
    q, k, v = (t.detach().bfloat16() for t in (q, k, v))
    kw = dict(hw_shape=(8, 8), pool_size=(4, 4), topk=12, router_topk=2)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(mita_attention_reference(Inputs(*leaves, **kw)), leaves, grad)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = mita_attention(*leaves, backend='fused_cpu', **kw)
    for a, b in zip(torch.autograd.grad(out, leaves, grad.bfloat16()), ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)


def _table(H, h, w, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, table_size((h, w)), generator=g).requires_grad_()


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
def test_fused_gradients_with_bias_router_top2(shared):
    """Relative position bias under router top-2 (each query reads two experts, the table's
    routed entries twice) and a batch of 2 (bias gradients summed over it)."""
    B, H, h, w, d = 2, 3, 7, 11, 16
    (q, k, v), grad = _inputs(B, H, 1 + h * w, d, seed=8)
    table = _table(H, h, w)
    kw = dict(hw_shape=(h, w), pool_size=(3, 3), topk=10, router_topk=2,
              with_shared_expert=shared)
    leaves = (q, k, v, table)
    out = mita_attention(q, k, v, backend='fused_cpu', rel_pos_bias=RelPosBias(table, (h, w)),
                         **kw)
    ref = mita_attention_reference(Inputs(q, k, v, bias=RelPosBias(table, (h, w)), **kw))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(['q', 'k', 'v', 'table'], torch.autograd.grad(out, leaves, grad),
                          torch.autograd.grad(ref, leaves, grad)):
        assert b.abs().sum() > 0, f'd{name} is zero'
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f'd{name}: {m}')


def test_fused_gradients_low_precision_with_bias():
    """bfloat16 inputs and a float32 bias table: routing and read-out in float32, q/k/v
    gradients in bfloat16, the table's in float32 (reference: float32 on the same, rounded,
    values and the same table)."""
    B, H, h, w, d = 2, 2, 8, 8, 16
    (q, k, v), grad = _inputs(B, H, 1 + h * w, d, seed=6)
    q, k, v = (t.detach().bfloat16() for t in (q, k, v))
    table = _table(H, h, w)
    kw = dict(hw_shape=(h, w), pool_size=(4, 4), topk=12, router_topk=2)
    leaves = [t.float().requires_grad_() for t in (q, k, v)] + [table]
    ref = mita_attention_reference(Inputs(*leaves[:3], bias=RelPosBias(table, (h, w)), **kw))
    ref_grads = torch.autograd.grad(ref, leaves, grad)
    leaves = [t.requires_grad_() for t in (q, k, v)] + [table]
    out = mita_attention(*leaves[:3], backend='fused_cpu', rel_pos_bias=RelPosBias(table, (h, w)),
                         **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out, leaves, grad.bfloat16())
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32]
    for name, a, b in zip(['q', 'k', 'v', 'table'], grads, ref_grads):
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f'd{name}: {m}')
