"""MiTAAttention: mmcv MultiheadAttention's drop-in replacement."""
import pytest
import torch
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmseg.registry import MODELS

import mita_seg.models  # noqa: F401  (registers MiTAAttention)
from mita_seg.models import MiTAAttention
from mita_seg.ops import Inputs, mita_attention, mita_attention_reference


def _mmcv_attn(C=32, H=4, seed=0):
    torch.manual_seed(seed)
    m = MultiheadAttention(C, H, batch_first=True, bias=True).eval()
    for p in m.parameters():  # non-trivial biases too
        torch.nn.init.normal_(p, std=0.2)
    return m


def test_builds_from_registry_with_mmcv_arguments():
    m = MODELS.build(dict(type='MiTAAttention', embed_dims=64, num_heads=4, pool_size=(3, 5),
                          topk=16, router_topk=2, attn_drop=0., proj_drop=0.1,
                          dropout_layer=dict(type='DropPath', drop_prob=0.1), qkv_bias=False,
                          batch_first=True))
    assert isinstance(m, MiTAAttention) and m.attn.in_proj_bias is None
    assert (m.pool_size, m.topk, m.router_topk) == ((3, 5), 16, 2)


def test_state_dict_round_trips_strictly_with_mmcv():
    ref = _mmcv_attn()
    mita = MiTAAttention(32, 4, pool_size=3, topk=8)
    assert set(mita.state_dict()) == set(ref.state_dict()) == {
        'attn.in_proj_weight', 'attn.in_proj_bias', 'attn.out_proj.weight', 'attn.out_proj.bias'}
    mita.load_state_dict(ref.state_dict(), strict=True)
    MultiheadAttention(32, 4, batch_first=True).load_state_dict(mita.state_dict(), strict=True)


@pytest.mark.parametrize('prefix,suffix', [(1, 0), (0, 5), (1, 3)])
def test_route_only_full_topk_equals_mmcv(prefix, suffix):
    ref = _mmcv_attn()
    mita = MiTAAttention(32, 4, pool_size=(2, 3), topk=10_000, with_shared_expert=False,
                         num_prefix_tokens=prefix).eval()
    mita.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, prefix + 5 * 7 + suffix, 32)
    with torch.no_grad():
        out = mita(x, hw_shape=(5, 7))          # k = N: every key (logged once)
    torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('prefix,suffix,global_tokens', [(1, 0, (1, 0)), (0, 5, (0, 5)),
                                                         (1, 3, (1, 2))])
def test_route_only_full_topk_with_global_tokens_equals_mmcv(prefix, suffix, global_tokens):
    """Global tokens passed to forward: route-only MiTA whose experts hold every other key
    is still softmax attention."""
    ref = _mmcv_attn()
    mita = MiTAAttention(32, 4, pool_size=(2, 3), topk=10_000, with_shared_expert=False,
                         num_prefix_tokens=prefix).eval()
    mita.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, prefix + 5 * 7 + suffix, 32)
    with torch.no_grad():
        out = mita(x, hw_shape=(5, 7), global_tokens=global_tokens)
    torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)


def test_global_tokens_reach_the_operator():
    """forward(global_tokens=...) is mita_attention(global_tokens=...) on the projected
    heads, with the shared expert and router top-2 (not the output without them)."""
    ref = _mmcv_attn(seed=2)
    mita = MiTAAttention(32, 4, pool_size=3, topk=6, router_topk=2, num_prefix_tokens=1).eval()
    mita.load_state_dict(ref.state_dict())
    x = torch.randn(2, 1 + 6 * 8 + 4, 32)
    with torch.no_grad():
        out = mita(x, hw_shape=(6, 8), global_tokens=(1, 4))
        qkv = torch.nn.functional.linear(x, ref.attn.in_proj_weight, ref.attn.in_proj_bias)
        q, k, v = qkv.reshape(2, -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
        o = mita_attention(q, k, v, (6, 8), 3, 6, 2, 1, global_tokens=(1, 4))
        expected = x + ref.attn.out_proj(o.transpose(1, 2).reshape(2, -1, 32))
        routed = mita(x, hw_shape=(6, 8))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, routed, atol=1e-3)


def test_matches_reference_on_projected_heads():
    ref = _mmcv_attn(seed=1)
    mita = MiTAAttention(32, 4, pool_size=3, topk=6, router_topk=2, num_prefix_tokens=1).eval()
    mita.load_state_dict(ref.state_dict())
    x = torch.randn(2, 1 + 6 * 8, 32)
    with torch.no_grad():
        out = mita(x, hw_shape=(6, 8))
        qkv = torch.nn.functional.linear(x, ref.attn.in_proj_weight, ref.attn.in_proj_bias)
        q, k, v = qkv.reshape(2, -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
        o = mita_attention_reference(Inputs(q, k, v, (6, 8), (3, 3), 6, 2, 1))
        expected = x + ref.attn.out_proj(o.transpose(1, 2).reshape(2, -1, 32))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_batch_first_false_and_identity():
    m = MiTAAttention(16, 2, pool_size=2, topk=4, batch_first=False).eval()
    x = torch.randn(1 + 16, 3, 16)              # [N, B, C]
    ident = torch.zeros_like(x)
    with torch.no_grad():
        out = m(x, identity=ident)
        out_bf = MiTAAttention(16, 2, pool_size=2, topk=4).eval()
        out_bf.load_state_dict(m.state_dict())
        torch.testing.assert_close(out.transpose(0, 1),
                                   out_bf(x.transpose(0, 1)) - x.transpose(0, 1),
                                   atol=1e-5, rtol=1e-5)


def test_square_grid_is_inferred_and_otherwise_required():
    m = MiTAAttention(16, 2, pool_size=2, topk=4).eval()
    assert m(torch.randn(1, 1 + 25, 16)).shape == (1, 26, 16)   # 5x5 after the cls token
    # 1 + 24 tokens: not a square grid, and no hw_shape given
    with pytest.raises(ValueError, match='hw_shape'):
        m(torch.randn(1, 1 + 24, 16))
    assert m(torch.randn(1, 1 + 24, 16), hw_shape=(4, 6)).shape == (1, 25, 16)


def test_variants_dwc_and_router_topk_train():
    m = MiTAAttention(16, 2, pool_size=2, topk=5, router_topk=2, with_dwc=True, shared_scale=0.3)
    assert {'dwc.weight', 'dwc.bias'} <= set(m.state_dict())
    x = torch.randn(2, 1 + 4 * 6 + 2, 16, requires_grad=True)
    m(x, hw_shape=(4, 6)).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_rejects_what_it_does_not_implement():
    m = MiTAAttention(16, 2, pool_size=2, topk=4)
    x = torch.randn(1, 17, 16)
    # cross-attention is not MiTA
    with pytest.raises(NotImplementedError, match='self-attention'):
        m(x, key=torch.randn(1, 5, 16))
    # masks are not supported
    with pytest.raises(NotImplementedError, match='mask'):
        m(x, attn_mask=torch.zeros(17, 17, dtype=torch.bool))
    # heads must divide the width
    with pytest.raises(ValueError, match='divisible'):
        MiTAAttention(18, 4)
