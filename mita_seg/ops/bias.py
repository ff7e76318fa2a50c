"""Relative position bias (BEiT's) in MiTA, without ever forming the ``N x N`` bias.

BEiT adds a learnt per-head bias ``B[n, j] = table[index(n, j)]`` to every attention logit,
where ``index`` depends on the relative position of the two grid tokens, with three extra
entries for the cls token (mmseg's ``BEiTAttention``: ``relative_position_bias_table``
``[T, H]`` and ``relative_position_index`` ``[N, N]``). MiTA uses the bias in three places:

- routed logits: the exact bias of each gathered key, ``B[n, I_e[t]]`` (:func:`gather_bias`);
- landmark scores: a landmark is the mean of the queries of its pooling region, so its
  score is the mean of their logits: ``S[m, j] = R_m . k_j / sqrt(d) + Bq[m, j]`` with
  ``Bq[m, j] = mean_{i in region m} B[i, j]`` (drives the top-k and ``V_R``);
- shared logits: ``G[n, m] * shared_scale + Bk[n, m]`` with
  ``Bk[n, m] = mean_{j in region m} B[n, j]`` (also the router's argmax).

Over grid tokens both means are box means of the 2-D table, separable into a mean over
table rows and one over table columns: :func:`landmark_bias` computes them as two products
with small band matrices per head (``O(M N (Wh + Ww))`` multiply-adds, ``O(M N)`` memory;
never ``N x N``). On CPU these GEMMs are far faster than gathering box corners from an
integral image (measured at N = 1025, H = 12, 7x7 landmarks, 1 thread: 5 ms instead of
38 ms forward, 15 ms instead of 100 ms with the backward).
"""
from typing import NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ['RelPosBias', 'check_bias', 'bias_index', 'gather_bias', 'dense_bias',
           'landmark_bias', 'pooled_dense_bias', 'table_size']


class RelPosBias(NamedTuple):
    """BEiT's relative position bias, as the MiTA operator takes it.

    Tokens are ``[cls, grid]``: token 0 is cls, tokens ``1 .. Wh*Ww`` the grid, row-major.

    Attributes:
        table (Tensor): ``[H, T]``, ``T = (2Wh - 1)(2Ww - 1) + 3`` (mmseg's
            ``relative_position_bias_table.t()``): entry ``(dy + Wh - 1) * (2Ww - 1) + dx +
            Ww - 1`` for a query ``(dy, dx)`` below/right of its key, then cls-to-token,
            token-to-cls, cls-to-cls.
        window (tuple[int, int]): ``(Wh, Ww)``, the grid the table was built for.
    """
    table: Tensor
    window: Tuple[int, int]


def table_size(window: Tuple[int, int]) -> int:
    """Entries of BEiT's table for a ``window`` grid: ``(2Wh - 1)(2Ww - 1) + 3``."""
    return (2 * window[0] - 1) * (2 * window[1] - 1) + 3


def check_bias(bias: RelPosBias, num_heads: int, num_tokens: int, hw_shape: Tuple[int, int],
               num_prefix_tokens: int) -> None:
    """Check that ``bias`` fits the tokens of a MiTA call.

    Raises:
        ValueError: the table does not fit its window, the heads, or the tokens' grid (e.g.
            a BEiT trained at one crop size evaluated at another); the message says what
            to change.
    """
    Wh, Ww = bias.window
    T = table_size((Wh, Ww))
    if bias.table.dim() != 2 or bias.table.shape[0] != num_heads:
        raise ValueError(f'the relative position bias table must be [H, T] = [{num_heads}, '
                         f'{T}] (heads first), got {tuple(bias.table.shape)}')
    if bias.table.shape[1] != T:
        raise ValueError(
            f'the relative position bias table has {bias.table.shape[1]} entries per head, '
            f'but a {Wh}x{Ww} window needs (2*{Wh}-1)*(2*{Ww}-1)+3 = {T}: the table was '
            'built for another grid; interpolate it to this window as mmseg\'s '
            'BEiT.resize_rel_pos_embed does')
    if tuple(hw_shape) != (Wh, Ww):
        raise ValueError(
            f'the relative position bias was built for a {Wh}x{Ww} patch grid but the input '
            f'has a {hw_shape[0]}x{hw_shape[1]} grid: BEiT\'s bias only fits its training '
            'grid; evaluate at the training crop size (test_cfg mode=\'slide\' with '
            'crop_size = the training crop), or interpolate the table to the new grid as '
            'mmseg\'s BEiT.resize_rel_pos_embed does')
    if num_prefix_tokens != 1 or num_tokens != 1 + Wh * Ww:
        raise ValueError(
            f'the relative position bias needs tokens [cls, {Wh}x{Ww} grid]: '
            f'num_prefix_tokens=1 and N = {1 + Wh * Ww}, got num_prefix_tokens='
            f'{num_prefix_tokens} and N = {num_tokens}')


def bias_index(window: Tuple[int, int], qi: Tensor, kj: Tensor) -> Tensor:
    """Table entry of query token ``qi`` and key token ``kj`` (int tensors, broadcast):
    mmseg's ``relative_position_index[qi, kj]``, computed instead of read."""
    Wh, Ww = window
    T = table_size(window)
    gi, gj = qi - 1, kj - 1
    dy = torch.div(gi, Ww, rounding_mode='floor') - torch.div(gj, Ww, rounding_mode='floor')
    dx = gi.remainder(Ww) - gj.remainder(Ww)
    idx = (dy + Wh - 1) * (2 * Ww - 1) + dx + Ww - 1
    q_cls, k_cls = qi == 0, kj == 0
    idx = torch.where(q_cls, T - 3, idx)
    idx = torch.where(k_cls, T - 2, idx)
    return torch.where(q_cls & k_cls, T - 1, idx)


def gather_bias(bias: RelPosBias, head: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
    """``B[head, qi, kj]`` for int tensors ``head``, ``qi``, ``kj`` (broadcast together):
    float32 (or the table's wider dtype), differentiable in the table."""
    table = bias.table.to(torch.promote_types(bias.table.dtype, torch.float32))
    T = table.shape[1]
    return table.reshape(-1)[head * T + bias_index(bias.window, qi, kj)]


def dense_bias(bias: RelPosBias) -> Tensor:
    """The whole bias ``[H, N, N]`` (the dense reference only: ``O(N^2)``)."""
    Wh, Ww = bias.window
    H = bias.table.shape[0]
    t = torch.arange(1 + Wh * Ww, device=bias.table.device)
    heads = torch.arange(H, device=t.device).view(H, 1, 1)
    return gather_bias(bias, heads, t.view(1, -1, 1), t.view(1, 1, -1))


def pooled_dense_bias(B: Tensor, hw_shape: Tuple[int, int], pool_size: Tuple[int, int],
                      num_prefix_tokens: int = 1) -> Tuple[Tensor, Tensor]:
    """``(Bq, Bk)`` of :func:`landmark_bias` by pooling a dense bias ``B`` ([H, N, N]) the
    way the landmarks pool the queries: the obviously correct ``O(N^2)`` version."""
    H, N, _ = B.shape
    h, w = hw_shape
    p = num_prefix_tokens
    rows = B[:, p:p + h * w, :].reshape(H, h, w, N).permute(0, 3, 1, 2)     # [H, N, h, w]
    Bq = F.adaptive_avg_pool2d(rows, pool_size).flatten(2).transpose(1, 2)  # [H, M, N]
    cols = B[:, :, p:p + h * w].reshape(H, N, h, w)
    Bk = F.adaptive_avg_pool2d(cols, pool_size).flatten(2)                  # [H, N, M]
    return Bq, Bk


def _regions(length: int, pools: int, device) -> Tuple[Tensor, Tensor]:
    """Start and end (exclusive) of ``adaptive_avg_pool``'s ``pools`` regions over
    ``length`` cells."""
    i = torch.arange(pools, device=device)
    return (i * length) // pools, ((i + 1) * length + pools - 1) // pools


def _band(lo: Tensor, hi: Tensor, n: int, dtype) -> Tensor:
    """``[R, n]``: row ``r`` is ``1 / (hi[r] - lo[r])`` on ``[lo[r], hi[r])``, 0 elsewhere
    (``lo``, ``hi``: ``[R]``): multiplying by it averages over those ranges."""
    a = torch.arange(n, device=lo.device)
    inside = (a >= lo.view(-1, 1)) & (a < hi.view(-1, 1))
    return inside.to(dtype) / (hi - lo).to(dtype).view(-1, 1)


def landmark_bias(bias: RelPosBias, pool_size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
    """The landmarks' mean biases, as separable box means over the 2-D table.

    Args:
        bias (RelPosBias): the bias (checked with :func:`check_bias`).
        pool_size (tuple[int, int]): ``(Ph, Pw)``, ``M = Ph * Pw``.

    Returns:
        tuple[Tensor, Tensor]: ``Bq`` ``[H, M, N]``, the mean bias of landmark ``m``'s
        region of queries towards key ``j``, and ``Bk`` ``[H, N, M]``, the mean bias of
        query ``n`` towards landmark ``m``'s region of keys; float32 (or wider, computed in
        that dtype), differentiable in the table.
    """
    Wh, Ww = bias.window
    (Ph, Pw), dev = pool_size, bias.table.device
    H, T = bias.table.shape
    M = Ph * Pw
    dt = torch.promote_types(bias.table.dtype, torch.float32)
    table = bias.table.to(dt)
    # The grid part: t2[a, b] is the bias of a query (dy, dx) = (a - Wh + 1, b - Ww + 1) from
    # its key (below/right of it for positive offsets).
    t2 = table[:, :T - 3].view(H, 2 * Wh - 1, 2 * Ww - 1)
    r0, r1 = _regions(Wh, Ph, dev)                                          # [Ph]
    c0, c1 = _regions(Ww, Pw, dev)                                          # [Pw]
    y, x = torch.arange(Wh, device=dev), torch.arange(Ww, device=dev)
    # Bq: queries of region m = (i, j) (rows [r0_i, r1_i), columns [c0_j, c1_j)), key at
    # (y, x): the mean of t2 over rows [r0_i - y, r1_i - y) + Wh - 1 and columns
    # [c0_j - x, c1_j - x) + Ww - 1, i.e. rows_q t2 cols_q^T with the band matrices
    # rows_q [(i, y), 2Wh - 1] and cols_q [(j, x), 2Ww - 1].
    rows_q = _band((r0.view(Ph, 1) - y + Wh - 1).flatten(),
                   (r1.view(Ph, 1) - y + Wh - 1).flatten(), 2 * Wh - 1, dt)
    cols_q = _band((c0.view(Pw, 1) - x + Ww - 1).flatten(),
                   (c1.view(Pw, 1) - x + Ww - 1).flatten(), 2 * Ww - 1, dt)
    bq = (rows_q @ t2 @ cols_q.t()).view(H, Ph, Wh, Pw, Ww)
    bq = bq.permute(0, 1, 3, 2, 4).reshape(H, M, Wh * Ww)                   # [H, (i, j), (y, x)]
    # Bk: query at (y, x), keys of region m: rows [y - r1_i, y - r0_i) + Wh, columns
    # [x - c1_j, x - c0_j) + Ww; band matrices rows_k [(y, i), .], cols_k [(x, j), .].
    rows_k = _band((y.view(Wh, 1) - r1 + Wh).flatten(), (y.view(Wh, 1) - r0 + Wh).flatten(),
                   2 * Wh - 1, dt)
    cols_k = _band((x.view(Ww, 1) - c1 + Ww).flatten(), (x.view(Ww, 1) - c0 + Ww).flatten(),
                   2 * Ww - 1, dt)
    bk = (rows_k @ t2 @ cols_k.t()).view(H, Wh, Ph, Ww, Pw)
    bk = bk.permute(0, 1, 3, 2, 4).reshape(H, Wh * Ww, M)                   # [H, (y, x), (i, j)]
    # cls: grid queries towards the cls key use token-to-cls (T - 2); the cls query towards
    # grid keys uses cls-to-token (T - 3).
    Bq = torch.cat([table[:, T - 2].view(H, 1, 1).expand(H, M, 1), bq], 2)
    Bk = torch.cat([table[:, T - 3].view(H, 1, 1).expand(H, 1, M), bk], 1)
    return Bq, Bk
