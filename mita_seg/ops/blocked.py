"""Blocked MiTA in plain PyTorch: runs anywhere (the fallback for what the other backends
cannot run, e.g. router top-r on CUDA).

Each routed query is one *item* (``r`` items per query under router top-r). Items are
sorted by expert and laid out in tiles of ``T`` slots, every tile holding items of a single
expert; each expert's run of tiles is padded to a multiple of ``T``. The number of tiles is
bounded statically by ``ceil((N r + M (T - 1)) / T)``, so no shape depends on the data (no
host synchronisation; runs under ``torch.compile``). A tile then needs the ``k`` keys of one
expert only: the routed part is one batched matmul of ``[T, d] x [d, k]`` blocks instead of
a per-query gather. The shared expert is a dense ``[N, M]`` attention. The partial softmaxes
(shared part and each routed choice) are merged with their running maxima, as in
FlashAttention.
"""
import math

from typing import List

import torch

from .bias import gather_bias, landmark_bias
from .flops import mita_flops_per_head
from .global_tokens import attend_with_lse, merge_lse
from .routing import mita_routing, routing_dtype


def default_block_size(num_items: int, num_experts: int) -> int:
    """Tile size ``T``: a power of two near a quarter of the mean items per expert, in
    ``[4, 64]``: small enough that padding (at most ``M (T - 1)`` slots) stays a small
    fraction of ``N r``, large enough that each tile's matmul is worth a call."""
    mean = num_items / (4 * num_experts)
    return int(min(64, max(4, 2 ** math.floor(math.log2(max(mean, 1.0))))))


def num_tiles(num_items: int, num_experts: int, block_size: int) -> int:
    """Static upper bound on the tiles the blocked layout needs."""
    return -(-(num_items + num_experts * (block_size - 1)) // block_size)


def unsupported(inp) -> List[str]:
    """The blocked backend runs any inputs."""
    return []


def flops(num_tokens: int, head_dim: int, num_experts: int, topk: int, router_topk: int = 1,
          with_shared_expert: bool = True, block_size=None) -> int:
    """MACs per batch item and head: MiTA's, with the routed part over every slot of the
    tiled layout, padding included: ``L = T * ceil((N r + M (T - 1)) / T)`` slots instead of
    ``N r`` (``T = block_size``, :func:`default_block_size` if None)."""
    NR = num_tokens * router_topk
    T = block_size or default_block_size(NR, num_experts)
    padding = num_tiles(NR, num_experts, T) * T - NR
    return (mita_flops_per_head(num_tokens, head_dim, num_experts, topk, router_topk,
                                with_shared_expert) + 2 * padding * topk * head_dim)


def _tile_layout(choice: torch.Tensor, num_experts: int, block_size: int):
    """Place the items of ``choice`` ([BH, NR] expert ids) into expert-pure tiles.

    Returns:
        item_slot (Tensor): ``[BH, NR]`` slot of each item in the tiled layout.
        slot_item (Tensor): ``[BH, L]`` item held by each slot (0 for padding slots).
        tile_expert (Tensor): ``[BH, nT]`` expert of each tile (0 for empty tiles).
    """
    BH, NR = choice.shape
    T, M = block_size, num_experts
    nT = num_tiles(NR, M, T)
    dev = choice.device
    counts = torch.zeros(BH, M, dtype=torch.long, device=dev)
    counts.scatter_add_(1, choice, torch.ones_like(choice))          # items per expert
    padded = (counts + T - 1) // T * T
    start_padded = padded.cumsum(1) - padded                          # [BH, M]
    start = counts.cumsum(1) - counts
    order = torch.argsort(choice, dim=1, stable=True)                 # items by expert
    sorted_e = choice.gather(1, order)
    rank = torch.arange(NR, device=dev) - start.gather(1, sorted_e)   # rank within expert
    slot_sorted = start_padded.gather(1, sorted_e) + rank
    item_slot = torch.empty_like(choice).scatter_(1, order, slot_sorted)
    slot_item = torch.zeros(BH, nT * T, dtype=torch.long, device=dev)
    slot_item.scatter_(1, slot_sorted, order)
    tile_expert = torch.zeros(BH, nT, dtype=torch.long, device=dev)
    tile_expert.scatter_(1, slot_sorted // T, sorted_e)               # same value per tile
    return item_slot, slot_item, tile_expert


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a 2-D ``x`` and any-shaped ``index`` (index_select is the fastest
    row gather on CPU)."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, x.shape[-1])


def mita_attention_blocked(inp):
    """Blocked MiTA of ``inp`` (a :class:`mita_seg.ops.dispatch.Inputs`: the arguments of
    :func:`mita_seg.ops.mita_attention`, validated; ``bias`` the ``rel_pos_bias``, tiles of
    ``block_size`` items, :func:`default_block_size` if None).

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``; differentiable with respect to q, k, v.
    """
    q, k, v, bias, topk = inp.q, inp.k, inp.v, inp.bias, inp.topk
    B, H, N, d = q.shape
    BH, r = B * H, inp.router_topk
    scale = d ** -0.5
    rt = mita_routing(q, k, inp.hw_shape, inp.pool_size, topk, r, inp.num_prefix_tokens,
                      inp.shared_scale,
                      None if bias is None else landmark_bias(bias, inp.pool_size))
    M = rt.landmarks.shape[2]
    acc = routing_dtype(q.dtype)
    # The gathers and P @ V run in the input dtype on GPU; the logits are formed in float32
    # everywhere, as the other backends form them (logits rounded to bf16 before the softmax
    # gave ~30x their error). CPU low-precision matmuls are slow and less accurate, so there
    # everything runs in float32.
    mm = q.dtype if q.is_cuda else acc

    # Routed experts, tiled: [BH, nT, T] items against [BH, nT, k] keys.
    T = inp.block_size or default_block_size(N * r, M)
    item_slot, slot_item, tile_expert = _tile_layout(rt.choice.reshape(BH, N * r), M, T)
    nT = tile_expert.shape[1]
    L = nT * T
    # Row gathers on flattened [BH * N, d] tensors (contiguous rows, much faster than
    # torch.gather with an index expanded over d).
    base = torch.arange(BH, device=q.device).unsqueeze(1)               # [BH, 1]
    q_rows = (q.to(mm) * scale).reshape(BH * N, d)
    k_rows, v_rows = (t.to(mm).reshape(BH * N, d) for t in (k, v))
    q_tiles = _rows(q_rows, slot_item // r + base * N).view(BH, nT, T, d)
    tile_keys = rt.expert_keys.reshape(BH, M, topk).gather(
        1, tile_expert.unsqueeze(-1).expand(BH, nT, topk))            # [BH, nT, k]
    key_rows = tile_keys.view(BH, nT * topk) + base * N
    k_tiles = _rows(k_rows, key_rows).view(BH, nT, topk, d)
    v_tiles = _rows(v_rows, key_rows).view(BH, nT, topk, d)
    logits = q_tiles.to(acc) @ k_tiles.to(acc).transpose(-1, -2)     # [BH, nT, T, k]
    if bias is not None:  # B[n, key] of every (slot, key) pair
        heads = (base % H).view(BH, 1, 1, 1)
        logits = logits + gather_bias(bias, heads, (slot_item // r).view(BH, nT, T, 1),
                                      tile_keys.unsqueeze(2)).to(acc)
    m_r = logits.amax(-1, keepdim=True)
    p_r = torch.exp(logits - m_r)
    o_r = (p_r.to(mm) @ v_tiles).to(acc)                              # [BH, nT, T, d]
    # Back to items: [BH, N, r, ...].
    o_r = _rows(o_r.view(BH * L, d), item_slot + base * L).view(BH, N, r, d)
    m_r = m_r.view(BH, L).gather(1, item_slot).view(BH, N, r)
    s_r = p_r.sum(-1).view(BH, L).gather(1, item_slot).view(BH, N, r)

    m = m_r.amax(-1)                                                  # [BH, N]
    if inp.with_shared_expert:
        v_r = torch.softmax(rt.scores, dim=-1) @ v.to(acc)            # [B, H, M, d]
        logits_s = rt.router.reshape(BH, N, M)
        m_s = logits_s.amax(-1)
        m = torch.maximum(m, m_s)
        p_s = torch.exp(logits_s - m.unsqueeze(-1))
        num = p_s @ v_r.reshape(BH, M, d)                             # [BH, N, d]
        den = p_s.sum(-1)
    else:
        num, den = 0, 0
    a_r = torch.exp(m_r - m.unsqueeze(-1))                            # [BH, N, r]
    num = num + (o_r * a_r.unsqueeze(-1)).sum(2)
    den = den + (s_r * a_r).sum(-1)
    out = (num / den.unsqueeze(-1)).view(B, H, N, d)
    if inp.global_kv is not None:  # the global keys' softmax, merged by log-sum-exp
        lse = (m + den.log()).view(B, H, N)
        out = merge_lse(out, lse, *attend_with_lse(q, *inp.global_kv))
    return out.to(q.dtype)
