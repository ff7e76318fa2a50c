"""The MiTA operator against its dense reference and against softmax attention."""
import pytest
import torch
import torch.nn.functional as F

from mita_seg.ops import (BACKENDS, Inputs, mita_attention, mita_attention_reference, mita_routing,
                          select_backend)

# (B, H, h, w, prefix, suffix, d, pool, topk, router_topk): awkward sizes on purpose.
CASES = {
    'vit-7x11-cls': (2, 3, 7, 11, 1, 0, 16, 3, 10, 1),
    'vit-7x11-cls-r2': (2, 3, 7, 11, 1, 0, 16, 3, 10, 2),
    '32x43-cls': (1, 2, 32, 43, 1, 0, 8, 7, 49, 1),
    '32x43-suffix150': (1, 2, 32, 43, 0, 150, 8, (5, 7), 49, 1),
    '32x43-cls-suffix-r2': (2, 2, 32, 43, 1, 11, 8, 7, 49, 2),
    '5x5-odd-d': (3, 1, 5, 5, 2, 3, 5, (2, 3), 4, 3),
    '1x9-pool1': (1, 2, 1, 9, 1, 0, 4, (1, 2), 3, 1),
}


def _qkv(B, H, N, d, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g, dtype=dtype).requires_grad_(requires_grad)
            for _ in range(3)]


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'route-only'])
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize('impl', ['op', 'blocked', 'fused_cpu'])
def test_matches_dense_reference(case, shared, impl):
    B, H, h, w, p, s, d, pool, topk, r = case
    q, k, v = _qkv(B, H, p + h * w + s, d)
    kw = dict(hw_shape=(h, w), pool_size=pool, topk=topk, router_topk=r, num_prefix_tokens=p,
              with_shared_expert=shared)
    ref = mita_attention_reference(Inputs(q, k, v, **{**kw, 'pool_size': (pool, pool) if
                                                      isinstance(pool, int) else pool}))
    if impl == 'op':
        out = mita_attention(q, k, v, **kw)
    else:  # every backend, forced through the public op
        out = mita_attention(q, k, v, backend=impl, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('impl', ['op', 'blocked', 'varlen', 'fused_cpu'])
def test_shared_scale_reaches_the_backend(impl):
    """A shared_scale other than 1/d (every case above runs the default): each backend
    scales the shared logits by it, as the reference does (a backend that kept 1/d passed
    the suite)."""
    q, k, v = _qkv(2, 2, 1 + 7 * 11, 8, seed=9)
    kw = dict(hw_shape=(7, 11), pool_size=(3, 3), topk=10)
    backend = {} if impl == 'op' else dict(backend=impl)
    default = mita_attention(q, k, v, **kw, **backend)
    for scale in (0.05, 2.0):
        ref = mita_attention_reference(Inputs(q, k, v, **kw, shared_scale=scale))
        assert not torch.allclose(ref, default, atol=1e-3), 'the scale changes nothing'
        out = mita_attention(q, k, v, **kw, shared_scale=scale, **backend)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('block_size', [1, 3, 16, 64])
def test_any_block_size_is_the_same_operator(block_size):
    q, k, v = _qkv(2, 2, 1 + 9 * 13, 8, seed=1)
    kw = dict(hw_shape=(9, 13), pool_size=4, topk=20, router_topk=2)
    ref = mita_attention_reference(Inputs(q, k, v, **{**kw, 'pool_size': (4, 4)}))
    torch.testing.assert_close(mita_attention(q, k, v, block_size=block_size, **kw), ref,
                               atol=1e-5, rtol=1e-5)


def test_the_fused_cpu_backend_is_built_and_chosen_on_cpu():
    q = torch.zeros(1, 1, 5, 4)
    inp = Inputs(q, q, q, (2, 2), (1, 1), 3)
    assert BACKENDS['fused_cpu'].unsupported(inp) == []
    assert select_backend(inp) == 'fused_cpu'
    # router top-2 too: the fused kernel reads several experts per query
    assert select_backend(inp._replace(pool_size=(2, 2), router_topk=2)) == 'fused_cpu'


def test_dispatch_reasons_name_every_backend():
    q = torch.zeros(1, 1, 5, 4)
    inp = Inputs(q, q, q, (2, 2), (2, 2), 3, router_topk=2)
    # a forced backend that cannot run says why, naming the argument
    with pytest.raises(ValueError, match=r"'varlen' cannot run[\s\S]*router_topk=2"):
        select_backend(inp, 'varlen')
    # the environment variable forces a backend as backend= does
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('MITA_BACKEND', 'reference')
        assert select_backend(inp) == 'reference'
    # when no backend of the device's order can run, each gives its reasons on its own line
    from mita_seg.ops import dispatch
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(dispatch.AUTO_ORDER, 'cpu', ('varlen', ))
        with pytest.raises(ValueError, match=r'no MiTA backend can run these inputs:\n  varlen: '
                           r'router_topk=2'):
            select_backend(inp)


def test_backend_switch():
    q, k, v = _qkv(1, 2, 1 + 36, 8)
    kw = dict(hw_shape=(6, 6), pool_size=2, topk=5)
    a = mita_attention(q, k, v, backend='blocked', **kw)
    b = mita_attention(q, k, v, backend='reference', **kw)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # an unknown backend names the choices
    with pytest.raises(ValueError, match='blocked'):
        mita_attention(q, k, v, backend='cuda-magic', **kw)


@pytest.mark.parametrize('prefix,suffix', [(0, 0), (1, 0), (1, 7)])
def test_route_only_full_topk_equals_sdpa(prefix, suffix):
    h, w = 6, 9
    q, k, v = _qkv(2, 3, prefix + h * w + suffix, 16, seed=2)
    N = q.shape[2]
    out = mita_attention(q, k, v, hw_shape=(h, w), pool_size=3, topk=N, router_topk=2,
                         num_prefix_tokens=prefix, with_shared_expert=False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5,
                               rtol=1e-5)


def test_topk_above_n_is_clamped_with_a_warning():
    q, k, v = _qkv(1, 1, 1 + 16, 4)
    with pytest.warns(UserWarning, match='larger than the number of tokens'):
        out = mita_attention(q, k, v, hw_shape=(4, 4), pool_size=2, topk=1000,
                             with_shared_expert=False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5,
                               rtol=1e-5)


def test_routing_selects_the_topk_keys_of_the_aligned_grid():
    """Landmarks pool the grid after the cls token (not the author's shifted q[:, :-1]),
    and each expert holds exactly the k best-scoring keys (brute force)."""
    B, H, h, w, d = 1, 2, 4, 6, 8
    q, k, _ = _qkv(B, H, 1 + h * w, d, seed=3)
    rt = mita_routing(q, k, (h, w), (2, 3), topk=5, router_topk=2, num_prefix_tokens=1)
    grid = q[:, :, 1:].reshape(B, H, h, w, d)
    # landmark (i, j) averages the 2x2 block of the grid at rows 2i.., cols 2j..
    R = grid.reshape(B, H, 2, 2, 3, 2, d).mean(dim=(3, 5)).reshape(B, H, 6, d)
    torch.testing.assert_close(rt.landmarks, R)
    S = R @ k.transpose(-1, -2)
    torch.testing.assert_close(rt.scores, S / d ** 0.5)
    best = S.sort(dim=-1, descending=True).indices[..., :5].sort(-1).values
    assert torch.equal(rt.expert_keys.sort(-1).values, best)
    G = q @ R.transpose(-1, -2)
    torch.testing.assert_close(rt.router, G / d)   # shared_scale defaults to 1/d
    scaled = mita_routing(q, k, (h, w), (2, 3), 5, 2, 1, shared_scale=0.3)
    torch.testing.assert_close(scaled.router, G * 0.3)
    assert torch.equal(rt.choice.sort(-1).values, G.topk(2, -1).indices.sort(-1).values)


def test_gradcheck_float64():
    q, k, v = (t.double().requires_grad_() for t in _qkv(1, 2, 1 + 12, 3, seed=4))
    kw = dict(hw_shape=(3, 4), pool_size=2, topk=4, router_topk=2)
    assert torch.autograd.gradcheck(lambda a, b, c: mita_attention(a, b, c, **kw), (q, k, v))
    kw['with_shared_expert'] = False
    assert torch.autograd.gradcheck(lambda a, b, c: mita_attention(a, b, c, **kw), (q, k, v))


def test_backward_matches_reference_gradients():
    q, k, v = _qkv(2, 2, 1 + 7 * 11 + 3, 8, seed=5, requires_grad=True)
    kw = dict(hw_shape=(7, 11), pool_size=3, topk=9, router_topk=2)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    grads = torch.autograd.grad(mita_attention(q, k, v, **kw), (q, k, v), g)
    ref = torch.autograd.grad(
        mita_attention_reference(Inputs(q, k, v, **{**kw, 'pool_size': (3, 3)})), (q, k, v), g)
    for a, b in zip(grads, ref):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_low_precision_forward_backward(dtype):
    q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(2, 2, 1 + 8 * 8, 16, seed=7))
    kw = dict(hw_shape=(8, 8), pool_size=4, topk=12)
    out = mita_attention(q, k, v, **kw)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = mita_attention_reference(Inputs(*(t.detach().float() for t in (q, k, v)),
                                   **{**kw, 'pool_size': (4, 4)}))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_runs_under_torch_compile():
    q, k, v = _qkv(1, 2, 1 + 36, 8)
    fn = torch.compile(lambda a, b, c: mita_attention(a, b, c, hw_shape=(6, 6), pool_size=2,
                                                      topk=6), fullgraph=True, backend='eager')
    torch.testing.assert_close(fn(q, k, v), mita_attention(q, k, v, hw_shape=(6, 6),
                                                           pool_size=2, topk=6))


def test_bad_arguments():
    q, k, v = _qkv(1, 2, 1 + 20, 8)
    kw = dict(hw_shape=(4, 5), pool_size=2, topk=4)
    # the grid plus prefix must fit in N
    with pytest.raises(ValueError, match='hw_shape'):
        mita_attention(q, k, v, **{**kw, 'hw_shape': (5, 5)})
    with pytest.raises(ValueError, match='hw_shape'):
        mita_attention(q, k, v, **kw, num_prefix_tokens=2)
    # the pool cannot be larger than the grid
    with pytest.raises(ValueError, match='pool_size'):
        mita_attention(q, k, v, **{**kw, 'pool_size': (5, 5)})
    with pytest.raises(ValueError, match='pool_size'):
        mita_attention(q, k, v, **{**kw, 'pool_size': 0})
    # a non-positive shared scale would invert the routing
    with pytest.raises(ValueError, match='shared_scale'):
        mita_attention(q, k, v, **kw, shared_scale=0.0)
    # k must be positive
    with pytest.raises(ValueError, match='topk'):
        mita_attention(q, k, v, **{**kw, 'topk': 0})
    # a query cannot read more experts than there are
    with pytest.raises(ValueError, match='router_topk'):
        mita_attention(q, k, v, **kw, router_topk=5)
    with pytest.raises(ValueError, match='router_topk'):
        mita_attention(q, k, v, **kw, router_topk=0)
    # q, k, v must agree in shape
    with pytest.raises(ValueError, match=r'\[B, H, N, d\]'):
        mita_attention(q, k[:, :, :-1], v, **kw)
    # pool_size must be an int or a pair
    with pytest.raises(TypeError, match='pool_size'):
        mita_attention(q, k, v, **{**kw, 'pool_size': 2.5})
    # integer tensors are not attention inputs
    with pytest.raises(TypeError, match='floating'):
        mita_attention(q.long(), k.long(), v.long(), **kw)


def test_autocast_does_not_change_the_operator():
    q, k, v = _qkv(1, 2, 1 + 8 * 8, 16, seed=8)
    kw = dict(hw_shape=(8, 8), pool_size=4, topk=12)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = mita_attention(q, k, v, **kw)
    torch.testing.assert_close(out, mita_attention(q, k, v, **kw))
