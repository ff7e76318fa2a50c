"""Dense reference of MiTA: the same maths as a masked full attention, O(N^2).

Slow and obviously correct; every fast path is tested against it.
"""
from typing import List

import torch

from .bias import dense_bias, pooled_dense_bias
from .routing import mita_routing


def unsupported(inp) -> List[str]:
    """The reference runs any inputs (in O(N^2) time and memory)."""
    return []


def flops(num_tokens: int, head_dim: int, num_experts: int, topk: int, router_topk: int = 1,
          with_shared_expert: bool = True, block_size=None) -> int:
    """MACs per batch item and head of the dense reference: ``S``, ``G``, the dense logits
    and one dense read-out per router choice, plus the shared expert's ``V_R`` and output."""
    N, M = num_tokens, num_experts
    per_head = 2 * M * N + N * N * (1 + router_topk)
    if with_shared_expert:
        per_head += 2 * M * N
    return head_dim * per_head


def mita_attention_reference(inp):
    """MiTA as one softmax over a concatenation of dense, masked logit blocks.

    For every query ``n`` the logits are ``[G[n] * shared_scale | L_1 | ... | L_r]`` with
    values ``[V_R | V | ... | V]``, where ``L_c[j] = q_n . k_j / sqrt(d)`` if key ``j`` is in
    the expert of the query's ``c``-th choice, and ``-inf`` otherwise. ``inp`` (a
    :class:`mita_seg.ops.dispatch.Inputs`) holds the arguments of
    :func:`mita_seg.ops.mita_attention` (taken as already validated; ``block_size`` is
    unused); global keys and values (``inp.global_kv``) are one more block of logits
    ``q_n . k_g / sqrt(d)`` with values ``v_g``. With a relative position ``bias``, the
    dense bias ``B``
    ``[H, N, N]`` is added to the dense logits, and its means over the landmarks' regions
    (pooled exactly as the queries are) to the scores and the shared logits.

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``.
    """
    q, k, v, bias, router_topk = inp.q, inp.k, inp.v, inp.bias, inp.router_topk
    B, H, N, d = q.shape
    dense_b = lm_bias = None
    if bias is not None:
        dense_b = dense_bias(bias)                                    # [H, N, N]
        lm_bias = pooled_dense_bias(dense_b, inp.hw_shape, inp.pool_size,
                                    inp.num_prefix_tokens)
    rt = mita_routing(q, k, inp.hw_shape, inp.pool_size, inp.topk, router_topk,
                      inp.num_prefix_tokens, inp.shared_scale, lm_bias)
    dt = rt.landmarks.dtype
    qf, kf, vf = q.to(dt), k.to(dt), v.to(dt)
    M = rt.landmarks.shape[2]
    scale = d ** -0.5

    # member[b, h, m, j]: key j belongs to expert m.
    member = torch.zeros(B, H, M, N, dtype=torch.bool, device=q.device)
    member.scatter_(-1, rt.expert_keys, True)
    dense = qf @ kf.transpose(-1, -2) * scale                        # [B, H, N, N]
    if dense_b is not None:
        dense = dense + dense_b.to(dt)
    logits, values = [], []
    for c in range(router_topk):
        e = rt.choice[..., c]                                         # [B, H, N]
        mask = member.gather(2, e.unsqueeze(-1).expand(B, H, N, N))   # [B, H, N, N]
        logits.append(dense.masked_fill(~mask, float('-inf')))
        values.append(vf)
    if inp.with_shared_expert:
        v_r = torch.softmax(rt.scores, dim=-1) @ vf                   # [B, H, M, d]
        logits.append(rt.router)
        values.append(v_r)
    if inp.global_kv is not None:
        k_g, v_g = (t.to(dt) for t in inp.global_kv)                  # [B, H, T, d]
        logits.append(qf @ k_g.transpose(-1, -2) * scale)
        values.append(v_g)
    attn = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    return (attn @ torch.cat(values, dim=2)).to(q.dtype)
