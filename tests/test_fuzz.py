"""Property-based tests: random shapes and settings never crash, NaN or change shape.

Every drawn case either matches the dense reference (outputs and gradients) or raises a
``ValueError`` whose message names the offending argument. Examples are seeded
(``derandomize``) and few, so the suite stays fast and reproducible on 2 cores.
"""
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mita_seg.ops import Inputs, mita_attention, mita_attention_reference

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@st.composite
def op_cases(draw):
    """One call of the operator; about one case in four breaks one rule on purpose."""
    h, w = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    prefix, suffix = draw(st.integers(0, 2)), draw(st.integers(0, 3))
    N = prefix + h * w + suffix

    def maybe_bad(good, bad):  # one draw in ten breaks the rule
        return draw(bad if draw(st.integers(0, 9)) == 0 else good)

    pool = (maybe_bad(st.integers(1, h), st.sampled_from([0, h + 1])),
            maybe_bad(st.integers(1, w), st.sampled_from([0, w + 1])))
    return dict(
        B=draw(st.integers(1, 2)),
        H=draw(st.integers(1, 3)),
        d=draw(st.sampled_from([1, 2, 3, 5, 8, 16])),  # odd head dims included
        h=h, w=w, prefix=prefix, suffix=suffix,
        # the grid passed to the op: the true one, or one with more tokens than N
        hw=maybe_bad(st.just((h, w)), st.just((h + suffix + 1, w))),
        pool=pool,
        topk=maybe_bad(st.integers(1, N + 2), st.just(0)),  # > N is clamped
        router_topk=maybe_bad(st.integers(1, min(3, max(1, pool[0] * pool[1]))),
                              st.sampled_from([0, pool[0] * pool[1] + 1])),
        shared=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        seed=draw(st.integers(0, 2**16)),
    )


def _invalid(c):
    """Why the case must raise (None if it is valid): the op's documented rules."""
    N = c['prefix'] + c['h'] * c['w'] + c['suffix']
    (gh, gw), (ph, pw) = c['hw'], c['pool']
    if c['prefix'] + gh * gw > N:
        return 'hw_shape'
    if not (1 <= ph <= gh and 1 <= pw <= gw):
        return 'pool_size'
    if c['topk'] < 1:
        return 'topk'
    if not 1 <= c['router_topk'] <= ph * pw:
        return 'router_topk'
    return None


@FUZZ
@given(op_cases())
def test_operator_fuzz(c):
    N = c['prefix'] + c['h'] * c['w'] + c['suffix']
    g = torch.Generator().manual_seed(c['seed'])
    q, k, v = (torch.randn(c['B'], c['H'], N, c['d'], generator=g, dtype=c['dtype'])
               .requires_grad_() for _ in range(3))
    kw = dict(hw_shape=c['hw'], pool_size=c['pool'], topk=c['topk'],
              router_topk=c['router_topk'], num_prefix_tokens=c['prefix'],
              with_shared_expert=c['shared'])
    why = _invalid(c)
    if why is not None:
        # invalid combination: a ValueError naming the argument, nothing else
        with pytest.raises(ValueError, match=rf'^{why}\b'):   # 'topk', not router_topk's
            mita_attention(q, k, v, **kw)
        return
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # topk > N is clamped with a warning
        out = mita_attention(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    ref = mita_attention_reference(Inputs(q, k, v, **{**kw, 'topk': min(c['topk'], N)}))
    tol = 1e-5 if c['dtype'] == torch.float32 else 1e-10
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)

    dout = torch.randn(out.shape, generator=g, dtype=c['dtype'])
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads_ref = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip('qkv', grads, grads_ref):
        assert a.shape == q.shape and torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol, msg=f'grad of {name}')


@pytest.fixture(scope='module')
def vit_factory():
    pytest.importorskip('mmseg')
    from mita_seg.models import MiTAVisionTransformer

    def build(pool, topk, router_topk, shared):
        torch.manual_seed(0)
        model = MiTAVisionTransformer(
            img_size=(64, 64), patch_size=8, embed_dims=32, num_layers=2, num_heads=2,
            mlp_ratio=2, out_indices=(1, ), final_norm=True, with_cls_token=True,
            mita_cfg=dict(pool_size=pool, topk=topk, router_topk=router_topk,
                          with_shared_expert=shared))
        model.eval()  # (mmseg's VisionTransformer.train() returns None, not the model)
        return model

    return build


@settings(FUZZ, max_examples=25)
@given(
    H=st.integers(8, 72), W=st.integers(8, 72), B=st.integers(1, 2),
    pool=st.tuples(st.integers(1, 4), st.integers(1, 4)), topk=st.integers(1, 60),
    router_topk=st.integers(1, 2), shared=st.booleans())
def test_backbone_fuzz(vit_factory, H, W, B, pool, topk, router_topk, shared):
    model = vit_factory(pool, topk, router_topk, shared)
    x = torch.randn(B, 3, H, W, generator=torch.Generator().manual_seed(H * 100 + W))
    h, w = -(-H // 8), -(-W // 8)  # mmseg's PatchEmbed pads to a whole number of patches
    # any grid runs: the module uses min(P, h) x min(P, w) landmarks, k <= N, r <= M
    with torch.no_grad():
        (out, ) = model(x)
    assert out.shape == (B, 32, h, w)
    assert torch.isfinite(out).all()
