"""MiTA through variable-length attention: one softmax per expert group, no merge.

Queries routed to the same expert ``e`` (of one batch item and head) form a *group*; all of
them attend to the same ``M + k`` keys and values::

    keys   = [R * shared_scale * sqrt(d) ; K[I_e]]      values = [V_R ; V[I_e]]

with the usual scale ``1 / sqrt(d)``: ``q . (R_m * shared_scale * sqrt(d)) / sqrt(d) =
q . R_m * shared_scale`` is the shared logit, so one softmax over the group's keys is exactly
MiTA's joint softmax (shared + routed); route-only keeps the ``k`` keys alone. Global keys
and values (:mod:`.global_tokens`) are appended to every group's: ``M + k + T`` keys. Every
group has the same number of keys and a data-dependent number of queries: that is
variable-length attention, the kernel class of FlashAttention's ``varlen`` API that the
paper's code uses.

One packing (:func:`pack`) feeds three kernels:

- CUDA, fp16/bf16, sm80+: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen);
- CUDA otherwise (fp32, older GPUs): nested-jagged ``F.scaled_dot_product_attention``, which
  dispatches to the flash / memory-efficient varlen kernels;
- CPU: batched SDPA over the groups with the queries padded to the largest group (faster
  here than nested-jagged SDPA, which runs the math kernel group by group on CPU).

Routing (top-k of ``S = R K^T``, argmax of ``q R^T``) runs in float32 under ``no_grad``; the
landmarks ``R``, ``V_R = SDPA(R, K, V)`` and the kernels are ordinary autograd, so gradients
reach q (through R and the logits), k and v with no recomputation of the forward. Router
top-r (r > 1) reads r experts per query, which is not one softmax per group: the dispatcher
falls back to another backend.

A relative position bias (:mod:`.bias`) becomes an additive mask: ``[Bk[n] ; B[n, I_e]]``
on each query's row of its group's keys, and ``Bq`` on ``V_R``'s SDPA. Only the CPU kernel
takes a mask; on CUDA the dispatcher falls back to another backend.
"""
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .bias import gather_bias, landmark_bias
from .flops import mita_flops_per_head
from .routing import landmarks, mita_routing

try:  # FlashAttention-2 varlen through PyTorch (torch >= 2.9)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: nested-jagged SDPA on CUDA
    varlen_attn = None

__all__ = ['mita_attention_varlen', 'pack', 'VarlenPack', 'unsupported', 'flops', 'kernel']


class VarlenPack(NamedTuple):
    """The packed layout of one MiTA call (``G`` non-empty groups, ``Tq = B H N`` queries).

    Attributes:
        q (Tensor): ``[Tq, d]`` queries sorted by group (stable: token order within a group).
        k (Tensor): ``[G * L, d]`` each group's ``L`` keys, group after group.
        v (Tensor): ``[G * L, d]`` the values, same layout.
        cu_seq_q (Tensor): ``[G + 1]`` int32, offsets of the groups in ``q``.
        cu_seq_k (Tensor): ``[G + 1]`` int32, offsets in ``k`` / ``v`` (multiples of ``L``).
        max_q (int): queries in the largest group.
        kv_len (int): ``L = M + k`` (``k`` route-only; ``+ T`` global keys), keys of every
            group.
        order (Tensor): ``[Tq]`` the row of ``q.reshape(B H N, d)`` in each packed slot.
        inverse (Tensor): ``[Tq]`` the packed slot of each row (``order``'s inverse).
        bias (Tensor | None): ``[Tq, L]`` the additive bias of each query's logits (a
            relative position bias), or None.
    """
    q: Tensor
    k: Tensor
    v: Tensor
    cu_seq_q: Tensor
    cu_seq_k: Tensor
    max_q: int
    kv_len: int
    order: Tensor
    inverse: Tensor
    bias: Optional[Tensor] = None


def unsupported(inp) -> List[str]:
    """Why the varlen backend cannot run ``inp`` (a :class:`mita_seg.ops.dispatch.Inputs`)."""
    why = []
    if inp.router_topk != 1:
        why.append(f'router_topk={inp.router_topk}: a query reading several experts is not '
                   'one softmax per expert group (router_topk=1 only)')
    if inp.device.type == 'cuda' and (inp.head_dim % 8 or inp.head_dim > 256):
        why.append(f'head_dim={inp.head_dim}: the CUDA varlen kernels need a multiple of 8, '
                   'at most 256')
    if inp.bias is not None and inp.device.type != 'cpu':
        why.append('relative position bias: the CUDA varlen kernels take no additive bias')
    if inp.device.type not in ('cpu', 'cuda'):
        why.append(f'it runs on CPU and CUDA tensors, got {inp.device.type}')
    return why


def flops(num_tokens: int, head_dim: int, num_experts: int, topk: int, router_topk: int = 1,
          with_shared_expert: bool = True, block_size=None) -> int:
    """MACs per batch item and head: MiTA's (:func:`mita_flops_per_head`) plus the
    landmark scores computed twice (routing, then inside ``V_R``'s SDPA) and the router
    logits computed twice (routing, then as the shared logits inside the kernel). The CPU
    kernel also computes the padding queries of each group (not counted: data-dependent)."""
    extra = 2 * num_tokens * num_experts * head_dim if with_shared_expert else 0
    return mita_flops_per_head(num_tokens, head_dim, num_experts, topk, router_topk,
                               with_shared_expert) + extra


def pack(q: Tensor, k: Tensor, v: Tensor, R: Tensor, v_r, expert_keys: Tensor,
         choice: Tensor, shared_key_scale: float, bias=None, bias_k=None,
         global_kv=None) -> VarlenPack:
    """Lay out the groups of one MiTA call for a varlen kernel (differentiable in q, k, v,
    R and ``v_r``; the indices carry no gradient).

    Args:
        q, k, v (Tensor): ``[B, H, N, d]``.
        R (Tensor): the landmarks ``[B, H, M, d]``, in the dtype of q.
        v_r (Tensor | None): the shared expert's values ``[B, H, M, d]``; None route-only.
        expert_keys (Tensor): ``[B, H, M, k]`` int64, the keys of each expert.
        choice (Tensor): ``[B, H, N, 1]`` int64, the expert of each query.
        shared_key_scale (float): factor on ``R`` as keys (``shared_scale * sqrt(d)``).
        bias (RelPosBias, optional): a relative position bias, for the routed logits.
        bias_k (Tensor, optional): ``Bk`` ``[H, N, M]``, its means for the shared logits.
        global_kv (tuple[Tensor, Tensor], optional): global keys and values
            ``[B, H, T, d]``, appended to every group's (not with ``bias``).
    """
    B, H, N, d = q.shape
    M, topk = expert_keys.shape[-2:]
    BH = B * H
    dev = q.device
    base = torch.arange(BH, device=dev)
    group = (base.unsqueeze(1) * M + choice.reshape(BH, N)).reshape(-1)     # [BH N]
    counts = torch.bincount(group, minlength=BH * M)                         # [BH M]
    order = torch.argsort(group, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=dev)
    live = counts.nonzero().squeeze(1)                                       # [G] (host sync)
    cu_seq_q = F.pad(counts[live].cumsum(0), (1, 0)).to(torch.int32)
    max_q = int(counts.max())
    bh, e = live // M, live % M                                              # [G]
    # Each group's keys: the landmarks (shared) then its expert's k keys.
    rows = (expert_keys.reshape(BH, M, topk)[bh, e] + (bh * N).unsqueeze(1)).reshape(-1)
    keys = k.reshape(BH * N, d).index_select(0, rows).view(-1, topk, d)      # [G, k, d]
    vals = v.reshape(BH * N, d).index_select(0, rows).view(-1, topk, d)
    if v_r is not None:
        keys = torch.cat([(R.reshape(BH, M, d) * shared_key_scale)[bh], keys], 1)
        vals = torch.cat([v_r.reshape(BH, M, d)[bh], vals], 1)
    if global_kv is not None:
        T = global_kv[0].shape[2]
        keys = torch.cat([keys, global_kv[0].reshape(BH, T, d)[bh]], 1)
        vals = torch.cat([vals, global_kv[1].reshape(BH, T, d)[bh]], 1)
    L = keys.shape[1]
    cu_seq_k = torch.arange(live.numel() + 1, device=dev, dtype=torch.int32) * L
    mask = None
    if bias is not None:  # each packed query's row: [Bk[n] ; B[n, I_e]]
        row_bh, n = order // N, (order % N).unsqueeze(1)
        head = (row_bh % H).unsqueeze(1)
        e = group[order] % M
        mask = gather_bias(bias, head, n, expert_keys.reshape(BH, M, topk)[row_bh, e])
        if v_r is not None:
            mask = torch.cat([bias_k[head.squeeze(1), n.squeeze(1)], mask], 1)  # [Tq, L]
        mask = mask.to(q.dtype)
    return VarlenPack(q.reshape(BH * N, d)[order], keys.reshape(-1, d), vals.reshape(-1, d),
                      cu_seq_q, cu_seq_k, max_q, L, order, inverse, mask)


def kernel(p: VarlenPack) -> str:
    """Which kernel :func:`attend` runs on ``p``: ``'varlen_attn'``, ``'nested'`` or
    ``'padded'``."""
    if p.q.is_cuda:
        fa2 = (varlen_attn is not None and p.q.dtype in (torch.float16, torch.bfloat16)
               and torch.cuda.get_device_capability(p.q.device) >= (8, 0))
        return 'varlen_attn' if fa2 else 'nested'
    return 'padded'


def attend(p: VarlenPack, kernel_name: str = None) -> Tensor:
    """Softmax attention (scale ``1 / sqrt(d)``, every kernel's default) of each group's
    queries over its keys: ``[Tq, d]`` in packed order. ``kernel_name`` forces one of
    :func:`kernel`'s answers (the CPU tests run ``'nested'`` too)."""
    name = kernel_name or kernel(p)
    if p.bias is not None and name != 'padded':
        raise ValueError(f'the {name!r} kernel takes no additive bias; use the padded kernel')
    if name == 'varlen_attn':
        out = varlen_attn(p.q.unsqueeze(1), p.k.unsqueeze(1), p.v.unsqueeze(1), p.cu_seq_q,
                          p.cu_seq_k, p.max_q, p.kv_len)                    # [Tq, 1, d]
        return out.squeeze(1)
    if name == 'nested':
        offsets = p.cu_seq_q.long()
        q = torch.nested.nested_tensor_from_jagged(p.q.unsqueeze(1), offsets)  # [G, j, 1, d]
        k, v = (torch.nested.nested_tensor_from_jagged(t.unsqueeze(1), p.cu_seq_k.long())
                for t in (p.k, p.v))                                       # [G, L, 1, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        return out.transpose(1, 2).values().squeeze(1)                     # [Tq, d]
    if name == 'padded':
        return _padded_sdpa(p)
    raise ValueError(f'unknown varlen kernel {name!r}')


def _padded_sdpa(p: VarlenPack, num_buckets: int = 4) -> Tensor:
    """The CPU kernel: batched SDPA over the groups, each group's queries padded to the
    largest group of its bucket (groups sorted by size and cut into ``num_buckets`` runs of
    equal count, so padding stays near the real queries where group sizes vary). Padding
    queries attend too and are dropped; every group has ``L`` keys, so no mask is needed
    (except a relative position bias, padded like the queries)."""
    Tq, d = p.q.shape
    G, L, dev = p.cu_seq_q.numel() - 1, p.kv_len, p.q.device
    sizes = (p.cu_seq_q[1:] - p.cu_seq_q[:-1]).long()                       # [G]
    grp = torch.repeat_interleave(torch.arange(G, device=dev), sizes, output_size=Tq)
    pos = torch.arange(Tq, device=dev) - p.cu_seq_q.long()[grp]             # [Tq]
    by_size = sizes.argsort()
    rank = torch.empty_like(by_size)
    rank[by_size] = torch.arange(G, device=dev)                               # [G]
    k, v = p.k.view(G, L, d), p.v.view(G, L, d)
    outs, rows = [], []
    for groups in by_size.tensor_split(min(num_buckets, G)):                # [Gb] each
        first = groups.numel() and int(rank[groups[0]])
        r = ((rank[grp] >= first) & (rank[grp] < first + groups.numel())).nonzero().squeeze(1)
        slot = (rank[grp[r]] - first, pos[r])
        shape = (groups.numel(), int(sizes[groups[-1]]))
        q = p.q.new_zeros(*shape, d).index_put(slot, p.q[r])
        mask = None if p.bias is None else p.bias.new_zeros(*shape, L).index_put(slot, p.bias[r])
        outs.append(F.scaled_dot_product_attention(q, k[groups], v[groups], mask)[slot])
        rows.append(r)
    return torch.cat(outs)[torch.cat(rows).argsort()]


def mita_attention_varlen(inp, kernel_name=None):
    """Varlen MiTA of ``inp`` (a :class:`mita_seg.ops.dispatch.Inputs`: the arguments of
    :func:`mita_seg.ops.mita_attention`, validated, ``router_topk == 1``; ``block_size`` is
    unused; ``bias`` the ``rel_pos_bias``). ``kernel_name`` forces a kernel (:func:`attend`).

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``; differentiable with respect to q, k, v.
    """
    q, k, v, bias, pool_size = inp.q, inp.k, inp.v, inp.bias, inp.pool_size
    B, H, N, d = q.shape
    shared_scale = 1.0 / d if inp.shared_scale is None else inp.shared_scale
    lm_bias = None if bias is None else landmark_bias(bias, pool_size)   # [H, M, N], [H, N, M]
    with torch.no_grad():
        rt = mita_routing(q, k, inp.hw_shape, pool_size, inp.topk, 1, inp.num_prefix_tokens,
                          shared_scale, lm_bias)
    R = v_r = None
    if inp.with_shared_expert:
        R = landmarks(q, inp.hw_shape, pool_size, inp.num_prefix_tokens).to(q.dtype)
        v_r = F.scaled_dot_product_attention(
            R, k, v, None if bias is None else lm_bias[0].to(q.dtype))       # [B, H, M, d]
    p = pack(q, k, v, R, v_r, rt.expert_keys, rt.choice, shared_scale * d ** 0.5, bias,
             None if bias is None else lm_bias[1], inp.global_kv)
    out = attend(p, kernel_name)                                              # [Tq, d]
    return out[p.inverse].view(B, H, N, d)
