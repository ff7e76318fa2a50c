"""Global tokens (:mod:`mita_seg.ops.global_tokens`): every backend against a dense oracle
that builds each query's logit set explicitly (forward and gradients), prefix and suffix
global tokens, batch > 1, non-square grids not a multiple of the pool, router top-2,
route-only; route-only MiTA with every key is softmax attention; the FLOP formula against
FlopCounterMode. A few seconds on 2 cores."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mita_seg.ops import BACKENDS, mita_attention, mita_flops, mita_routing
from mita_seg.ops.flops import global_flops_per_head
from mita_seg.ops.fused_cpu import _C

BACKEND_NAMES = [b for b in BACKENDS if b != 'fused_cpu' or _C is not None]

# (B, H, h, w, prefix, suffix, global (prefix, suffix), d, pool, topk, router_topk, shared)
CASES = {
    'segmenter-head-suffix': (2, 2, 5, 7, 0, 6, (0, 6), 8, (2, 3), 6, 1, True),
    'vit-global-cls': (1, 3, 6, 6, 1, 0, (1, 0), 8, (3, 3), 5, 1, True),
    'both-some-local': (2, 1, 4, 9, 2, 3, (1, 2), 5, (2, 4), 7, 1, True),
    'route-only-r2': (1, 2, 5, 5, 1, 4, (1, 4), 8, (2, 2), 6, 2, False),
    'r2-shared': (2, 2, 3, 8, 0, 5, (0, 3), 8, (2, 3), 4, 2, True),
}


def oracle(q, k, v, hw, pool, topk, r, p, shared, global_tokens):
    """Each query's logits and values, written out one query at a time: global queries
    over every key; the others over the shared expert's landmarks, the keys of their routed
    experts (MiTA on the other tokens) and the global keys."""
    B, H, N, d = q.shape
    gp, gs = global_tokens
    glob = list(range(gp)) + list(range(N - gs, N))
    other = [n for n in range(N) if n not in glob]
    qo, ko, vo = (t[:, :, other] for t in (q, k, v))
    rt = mita_routing(qo, ko, hw, pool, topk, r, p - gp)
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            v_r = torch.softmax(rt.scores[b, h], -1) @ vo[b, h]
            for n in range(N):
                if n in glob:
                    logits, values = q[b, h, n] @ k[b, h].T / d ** 0.5, v[b, h]
                else:
                    i = other.index(n)
                    logits, values = [], []
                    if shared:
                        logits.append(rt.router[b, h, i])
                        values.append(v_r)
                    for e in rt.choice[b, h, i]:
                        keys = [other[j] for j in rt.expert_keys[b, h, e]]
                        logits.append(q[b, h, n] @ k[b, h, keys].T / d ** 0.5)
                        values.append(v[b, h, keys])
                    logits.append(q[b, h, n] @ k[b, h, glob].T / d ** 0.5)
                    values.append(v[b, h, glob])
                    logits, values = torch.cat(logits), torch.cat(values)
                out[b, h, n] = torch.softmax(logits, -1) @ values
    return out


def _qkv(B, H, N, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g, dtype=dtype).requires_grad_()
            for _ in range(3)]


@pytest.mark.parametrize('backend', BACKEND_NAMES)
@pytest.mark.parametrize('case', list(CASES.values()), ids=list(CASES))
def test_every_backend_matches_the_dense_oracle(case, backend):
    B, H, h, w, p, s, gt, d, pool, topk, r, shared = case
    if backend == 'varlen' and r > 1:
        pytest.skip('varlen runs router top-1 only')
    N = p + h * w + s
    q, k, v = _qkv(B, H, N, d)
    grad = torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    kw = dict(hw_shape=(h, w), pool_size=pool, topk=topk, router_topk=r, num_prefix_tokens=p,
              with_shared_expert=shared)
    ref = oracle(q, k, v, (h, w), pool, topk, r, p, shared, gt)
    out = mita_attention(q, k, v, **kw, global_tokens=gt, backend=backend)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, a, b in zip('qkv', torch.autograd.grad(out, (q, k, v), grad),
                          torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)
    with torch.no_grad():  # the custom op's path
        torch.testing.assert_close(mita_attention(q, k, v, **kw, global_tokens=gt,
                                                  backend=backend), ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize('backend', BACKEND_NAMES)
@pytest.mark.parametrize('gt', [(1, 0), (0, 5), (1, 5)], ids=['cls', 'suffix', 'both'])
def test_route_only_every_key_is_softmax_attention(gt, backend):
    """Route-only MiTA whose expert holds every key that is not global: each query's softmax
    is over all N keys, global or not, so the operator is softmax attention exactly."""
    h, w, p, s = 4, 5, 1, 5
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(2, 2, p + h * w + s, 8))
    out = mita_attention(q, k, v, (h, w), 2, q.shape[2] - sum(gt), num_prefix_tokens=p,
                         with_shared_expert=False, global_tokens=gt, backend=backend)
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g))
    for a, b in grads:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_flop_formula_counts_the_global_parts():
    """mita_flops(num_global_tokens=T): the backend's count over the N - T other tokens,
    plus 2 (N - T) T d (their queries on the global keys) and 2 T N d (the global queries
    on every key); as FlopCounterMode counts the reference backend (2 FLOPs per MAC)."""
    B, H, h, w, p, s, gt, d, pool, topk, r, shared = CASES['both-some-local']
    N, T, M = p + h * w + s, sum(gt), pool[0] * pool[1]
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(B, H, N, d))
    with FlopCounterMode(display=False) as counter:
        mita_attention(q, k, v, (h, w), pool, topk, r, p, shared, global_tokens=gt,
                       backend='reference')
    args = (B, H, N, d, M, topk, r, shared)
    assert counter.get_total_flops() == 2 * mita_flops(*args, backend='reference',
                                                       num_global_tokens=T)
    local = mita_flops(B, H, N - T, d, M, topk, r, shared)
    assert mita_flops(*args, num_global_tokens=T) - local == B * H * global_flops_per_head(
        N, T, d) == B * H * (2 * (N - T) * T * d + 2 * T * N * d)


def test_bad_global_tokens():
    q = torch.randn(1, 2, 1 + 16 + 3, 4)
    # global tokens are prefix / suffix tokens: at most (p, N - p - h*w)
    with pytest.raises(ValueError, match=r'global_tokens \(2, 0\) .* at most \(1, 3\)'):
        mita_attention(q, q, q, (4, 4), 2, 4, global_tokens=(2, 0))
    with pytest.raises(ValueError, match=r'at most \(1, 3\)'):
        mita_attention(q, q, q, (4, 4), 2, 4, global_tokens=(0, 4))
    # a pair of ints
    with pytest.raises(TypeError, match='global_tokens must be an int or a pair'):
        mita_attention(q, q, q, (4, 4), 2, 4, global_tokens=(0, 1.5))
    # topk counts the keys that are not global
    with pytest.warns(UserWarning, match='less 3 global = 17; using topk=17'):
        mita_attention(q, q, q, (4, 4), 2, 19, global_tokens=(0, 3))


@pytest.mark.parametrize('backend', BACKEND_NAMES)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_low_precision_with_global_tokens(dtype, backend):
    """bf16/fp16 inputs with global tokens: within the inputs' rounding of the float32
    operator on the same (rounded) values, forward and gradients."""
    B, H, h, w, p, s, gt, d, pool, topk, r, shared = CASES['segmenter-head-suffix']
    N = p + h * w + s
    low = [t.detach().to(dtype).requires_grad_() for t in _qkv(B, H, N, d, seed=3)]
    wide = [t.detach().float().requires_grad_() for t in low]
    kw = dict(hw_shape=(h, w), pool_size=pool, topk=topk, num_prefix_tokens=p,
              global_tokens=gt, backend=backend)
    out, ref = mita_attention(*low, **kw), mita_attention(*wide, **kw)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    for a, b in zip(torch.autograd.grad(out, low, g.to(dtype)),
                    torch.autograd.grad(ref, wide, g)):
        torch.testing.assert_close(a.float(), b, atol=4 * tol, rtol=4 * tol)


def test_attention_mac_counter_counts_global_tokens(tiny_cfg):
    # the sweep's attn GMACs: a swapped head's class tokens are global, their exact
    # attention both ways counted (mita_flops' num_global_tokens), as in the FLOP count
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    from mita_seg import swap_attention
    from mita_seg.analysis.attention_macs import AttentionMacCounter
    from mita_seg.ops import mita_flops
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(tiny_cfg.model).eval()
    swap_attention(model, include_head=True, pool_size=2, topk=8, verbose=False)
    with AttentionMacCounter(model) as counter, torch.no_grad():
        model._forward(torch.randn(1, 3, 64, 64))
    # 2 encoder layers over cls + 8x8 patches; 1 head layer over 64 patches + 10 classes
    assert counter.macs == (2 * mita_flops(1, 4, 65, 16, 4, 8)
                            + mita_flops(1, 4, 74, 16, 4, 8, num_global_tokens=10))
