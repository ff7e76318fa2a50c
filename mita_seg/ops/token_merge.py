"""Token merging (ToMe) as pure tensor functions: bipartite soft matching, merge, unmerge,
and the proportional-attention bias.

Bolya et al., "Token Merging: Your ViT but Faster" (ICLR 2023), as applied to dense
prediction by merging before an operation and unmerging after it (Bolya & Hoffman, "Token
Merging for Fast Stable Diffusion", 2023; Expedit's port of ToMe to mmseg's Segmenter). Only
the grid tokens ``x[:, p:N - s]`` take part: ``p`` prefix tokens (a ViT's cls token) and
``s`` suffix tokens (Segmenter's class embeddings) are never merged and keep their places.

Equivalent PyTorch code (one batch item, grid tokens ``g = x[p:N - s]`` of ``[n, C]``,
``r`` tokens merged away)::

    m = g / g.norm(dim=-1, keepdim=True)          # matching metric: cosine similarity
    a, b = m[0::2], m[1::2]                        # bipartite split, alternate tokens
    best, match = (a @ b.T).max(-1)                # each A token's most similar B token
    order = best.argsort(descending=True)          # the r most similar A tokens merge
    # slots of the merged sequence: the n_a - r unmerged A tokens (in `order`), then B
    slot = torch.empty(n, dtype=torch.long)
    slot[0::2][order[r:]] = torch.arange(n_a - r)
    slot[0::2][order[:r]] = n_a - r + match[order[:r]]
    slot[1::2] = n_a - r + torch.arange(n_b)
    merged = torch.zeros(n - r, C).index_reduce_(0, slot, g, 'mean', include_self=False)
    size = torch.bincount(slot, minlength=n - r)   # tokens per merged token
    unmerged = merged[slot]                        # every token gets its merged token
    logits = q @ k.T * scale + size.log()          # proportional attention

:func:`merge` is ``merged`` (with the prefix and suffix tokens around it), :func:`unmerge`
is ``unmerged``, :func:`proportional_attention_bias` is ``size.log()`` shaped as an
additive attention mask. An unmerged token (``size == 1``) comes back bit for bit.

Cost, per merge and batch item (one MAC = one FLOP): the matching ``n_a n_b C`` MACs
(``~ n^2 C / 4``, traced as ``matmul``) and the merge ``r (C + 1)`` adds (``n`` rows and
their counts summed into ``n - r``, traced as ``index_add_``); the norm, max, argsort,
gather and the division by the size are memory traffic or element-wise (not counted, as in
mmengine).
"""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ['MergePlan', 'MAX_MERGE_RATIO', 'check_ratio', 'merged_count',
           'bipartite_soft_matching', 'merge', 'merged_sizes', 'unmerge',
           'proportional_attention_bias', 'merge_flops']

# Bipartite matching merges each token of set A (half the tokens, rounded up) at most once.
MAX_MERGE_RATIO = 0.5


class MergePlan(NamedTuple):
    """Where every grid token goes in a merge.

    Attributes:
        slot (Tensor): ``[B, n]`` int64, the merged token (``0 .. n - r - 1``) of each of
            the ``n`` grid tokens.
        num_merged (int): ``n - r``, the grid tokens after the merge.
        num_prefix_tokens (int): tokens before the grid, kept as they are.
        num_suffix_tokens (int): tokens after the grid, kept as they are.
    """
    slot: Tensor
    num_merged: int
    num_prefix_tokens: int
    num_suffix_tokens: int


def merged_count(num_grid_tokens: int, ratio: float) -> int:
    """``r``: how many of ``num_grid_tokens`` grid tokens a merge at ``ratio`` removes,
    ``int(ratio * n)``, the product in floating point as ToMe's reference computes it
    (``0.29 * 100`` gives 28), at most the ``ceil(n / 2)`` tokens of set A.

    Raises:
        ValueError: ``ratio`` outside ``[0, 0.5]``.
    """
    check_ratio(ratio)
    return min(int(ratio * num_grid_tokens), (num_grid_tokens + 1) // 2)


def check_ratio(ratio) -> float:
    """``ratio`` if it is a number in ``[0, MAX_MERGE_RATIO]``.

    Raises:
        TypeError: not a real number; ValueError: out of range (the message says why).
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f'merge ratio must be a number in [0, {MAX_MERGE_RATIO}], got '
                        f'{ratio!r} ({type(ratio).__name__})')
    if not 0 <= ratio <= MAX_MERGE_RATIO:
        raise ValueError(
            f'merge ratio {ratio} is outside [0, {MAX_MERGE_RATIO}]: it is the fraction of '
            'grid tokens merged away before each attention and MLP, and bipartite soft '
            'matching merges each token of one half at most once, so at most half of them; '
            'use e.g. 0.3')
    return float(ratio)


def bipartite_soft_matching(metric: Tensor, r: int, num_prefix_tokens: int = 0,
                            num_suffix_tokens: int = 0) -> MergePlan:
    """ToMe's bipartite soft matching of the grid tokens of ``metric``.

    The grid tokens are split alternately into A (even positions) and B (odd); each A token
    is matched to its most similar B token (cosine similarity of ``metric``), and the ``r``
    A tokens with the most similar matches are merged into them.

    Args:
        metric (Tensor): ``[B, N, C]`` (the tokens, or their keys).
        r (int): grid tokens to merge away, ``0 <= r <= ceil(n / 2)``.
        num_prefix_tokens (int): tokens before the grid, never merged. Default: 0.
        num_suffix_tokens (int): tokens after the grid, never merged. Default: 0.

    Returns:
        MergePlan: the merged token of every grid token.
    """
    B, N, _ = metric.shape
    n = N - num_prefix_tokens - num_suffix_tokens
    n_a, n_b = (n + 1) // 2, n // 2
    if not 0 <= r <= n_a or (r > 0 and n_b == 0):
        raise ValueError(f'cannot merge r={r} of {n} grid tokens (at most {n_a}, and only '
                         'when there are at least 2)')
    device = metric.device
    if r == 0:
        slot = torch.arange(n, device=device).expand(B, n)
        return MergePlan(slot, n, num_prefix_tokens, num_suffix_tokens)
    with torch.no_grad():
        m = metric[:, num_prefix_tokens:num_prefix_tokens + n]
        m = m / m.norm(dim=-1, keepdim=True)
        scores = m[:, 0::2] @ m[:, 1::2].transpose(-1, -2)           # [B, n_a, n_b]
        best, match = scores.max(dim=-1)                              # [B, n_a]
        order = best.argsort(dim=-1, descending=True)                 # [B, n_a]
        kept = n_a - r
        merged_a, kept_a = order[:, :r], order[:, r:]
        slot_a = torch.empty_like(order)
        slot_a.scatter_(-1, kept_a, torch.arange(kept, device=device).expand(B, kept))
        slot_a.scatter_(-1, merged_a, kept + match.gather(-1, merged_a))
        slot_b = (kept + torch.arange(n_b, device=device)).expand(B, n_b)
        slot = torch.empty(B, n, dtype=torch.long, device=device)
        slot[:, 0::2] = slot_a
        slot[:, 1::2] = slot_b
    return MergePlan(slot, n - r, num_prefix_tokens, num_suffix_tokens)


def _split(x: Tensor, plan: MergePlan, n: int):
    p = plan.num_prefix_tokens
    return x[:, :p], x[:, p:p + n], x[:, p + n:]


def merge(x: Tensor, plan: MergePlan) -> Tensor:
    """The mean of the grid tokens of ``x`` merged into each merged token; prefix and
    suffix tokens around them as they were.

    Args:
        x (Tensor): ``[B, N, C]``.
        plan (MergePlan): from :func:`bipartite_soft_matching` on the same ``N`` tokens.

    Returns:
        Tensor: ``[B, N - r, C]``.
    """
    n = plan.slot.shape[1]
    if plan.num_merged == n:
        return x
    pre, grid, suf = _split(x, plan, n)
    B, _, C = grid.shape
    m = plan.num_merged
    # one index_add over the flattened batch (scatter_reduce's 'mean' is several times
    # slower on CPU), then the division by the size; a token alone is x + 0, / 1: exact
    flat = (plan.slot + torch.arange(B, device=x.device)[:, None] * m).reshape(B * n)
    summed = grid.new_zeros(B * m, C).index_add_(0, flat, grid.reshape(B * n, C))
    size = grid.new_zeros(B * m).index_add_(0, flat, grid.new_ones(B * n))
    merged = (summed / size[:, None]).view(B, m, C)
    return torch.cat([pre, merged, suf], dim=1)


def merged_sizes(plan: MergePlan, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[B, N - r]``: how many tokens each token of the merged sequence stands for (1 for
    the prefix and suffix tokens)."""
    B, n = plan.slot.shape
    size = torch.zeros(B, plan.num_merged, dtype=dtype, device=plan.slot.device)
    size = size.scatter_add(1, plan.slot, torch.ones(B, n, dtype=dtype,
                                                     device=plan.slot.device))
    ones = size.new_ones
    return torch.cat([ones(B, plan.num_prefix_tokens), size, ones(B, plan.num_suffix_tokens)],
                     dim=1)


def unmerge(x: Tensor, plan: MergePlan) -> Tensor:
    """Every grid token gets the value of its merged token (the inverse of :func:`merge`
    for tokens merged with no other).

    Args:
        x (Tensor): ``[B, N - r, C]``.
        plan (MergePlan): the plan :func:`merge` used.

    Returns:
        Tensor: ``[B, N, C]``.
    """
    n = plan.slot.shape[1]
    if plan.num_merged == n:
        return x
    p = plan.num_prefix_tokens
    B, _, C = x.shape
    pre, merged, suf = x[:, :p], x[:, p:p + plan.num_merged], x[:, p + plan.num_merged:]
    grid = merged.gather(1, plan.slot[..., None].expand(B, n, C))
    return torch.cat([pre, grid, suf], dim=1)


def proportional_attention_bias(size: Tensor, num_heads: int,
                                num_queries: Optional[int] = None) -> Tensor:
    """ToMe's proportional attention as an additive attention mask: ``log(size)`` of each
    key, so a merged token of ``s`` tokens weighs as its ``s`` tokens would.

    Args:
        size (Tensor): ``[B, S]`` tokens per key (:func:`merged_sizes`).
        num_heads (int): attention heads ``H``.
        num_queries (int, optional): ``L``; default ``S``.

    Returns:
        Tensor: ``[B * H, L, S]`` (a broadcast view, no copy over ``L``): the float
        ``attn_mask`` of ``nn.MultiheadAttention``.
    """
    B, S = size.shape
    L = S if num_queries is None else num_queries
    return size.log().repeat_interleave(num_heads, dim=0)[:, None, :].expand(B * num_heads,
                                                                             L, S)


def merge_flops(batch: int, num_grid_tokens: int, channels: int, r: int) -> int:
    """MACs of one :func:`bipartite_soft_matching` + :func:`merge` of ``r`` of
    ``num_grid_tokens`` tokens of ``channels`` channels: the matching ``n_a n_b C`` and the
    merge's ``r (C + 1)`` adds (the tokens and their counts; one add = one FLOP), per batch
    item; 0 when ``r == 0`` (nothing runs). Unmerging is a gather (0)."""
    if r == 0:
        return 0
    n_a, n_b = (num_grid_tokens + 1) // 2, num_grid_tokens // 2
    return batch * (n_a * n_b * channels + r * (channels + 1))
