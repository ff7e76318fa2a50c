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

Over grid tokens both means are box sums of the 2-D table (an integral image: four reads
each), so :func:`landmark_bias` costs ``O(T + M N)`` per head, not ``O(N^2)``.
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


def landmark_bias(bias: RelPosBias, pool_size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
    """The landmarks' mean biases, by box sums over the 2-D table (integral image).

    Args:
        bias (RelPosBias): the bias (checked with :func:`check_bias`).
        pool_size (tuple[int, int]): ``(Ph, Pw)``, ``M = Ph * Pw``.

    Returns:
        tuple[Tensor, Tensor]: ``Bq`` ``[H, M, N]``, the mean bias of landmark ``m``'s
        region of queries towards key ``j``, and ``Bk`` ``[H, N, M]``, the mean bias of
        query ``n`` towards landmark ``m``'s region of keys; float32 (or wider),
        differentiable in the table.
    """
    Wh, Ww = bias.window
    (Ph, Pw), dev = pool_size, bias.table.device
    H, T = bias.table.shape
    out_dtype = torch.promote_types(bias.table.dtype, torch.float32)
    # Integral image in float64: box sums are differences of large partial sums.
    t2 = bias.table[:, :T - 3].double().view(H, 2 * Wh - 1, 2 * Ww - 1)
    ii = F.pad(t2.cumsum(1).cumsum(2), (1, 0, 1, 0))                       # [H, 2Wh, 2Ww]

    def box(a0, a1, b0, b1):  # sums over [a0, a1) x [b0, b1), broadcast
        return ii[:, a1, b1] - ii[:, a0, b1] - ii[:, a1, b0] + ii[:, a0, b0]

    r0, r1 = _regions(Wh, Ph, dev)                                          # [Ph]
    c0, c1 = _regions(Ww, Pw, dev)                                          # [Pw]
    y, x = torch.arange(Wh, device=dev), torch.arange(Ww, device=dev)
    area = ((r1 - r0).view(Ph, 1) * (c1 - c0).view(1, Pw)).reshape(1, -1).double()  # [1, M]
    # Bq: queries in region m (rows yi in [r0, r1)), key at (y, x): dy = yi - y.
    a0 = (r0.view(Ph, 1) - y.view(1, Wh) + Wh - 1).view(Ph, 1, Wh, 1)
    a1 = (r1.view(Ph, 1) - y.view(1, Wh) + Wh - 1).view(Ph, 1, Wh, 1)
    b0 = (c0.view(Pw, 1) - x.view(1, Ww) + Ww - 1).view(1, Pw, 1, Ww)
    b1 = (c1.view(Pw, 1) - x.view(1, Ww) + Ww - 1).view(1, Pw, 1, Ww)
    bq = box(a0, a1, b0, b1).reshape(H, Ph * Pw, Wh * Ww) / area.view(1, -1, 1)
    # Bk: query at (y, x), keys in region m (yj in [r0, r1)): dy = y - yj.
    a0 = (y.view(Wh, 1) - r1.view(1, Ph) + Wh).view(Wh, 1, Ph, 1)
    a1 = (y.view(Wh, 1) - r0.view(1, Ph) + Wh).view(Wh, 1, Ph, 1)
    b0 = (x.view(Ww, 1) - c1.view(1, Pw) + Ww).view(1, Ww, 1, Pw)
    b1 = (x.view(Ww, 1) - c0.view(1, Pw) + Ww).view(1, Ww, 1, Pw)
    bk = box(a0, a1, b0, b1).reshape(H, Wh * Ww, Ph * Pw) / area.view(1, 1, -1)
    table = bias.table.to(out_dtype)
    M = Ph * Pw
    # cls: grid queries towards the cls key use token-to-cls (T - 2); the cls query towards
    # grid keys uses cls-to-token (T - 3).
    Bq = torch.cat([table[:, T - 2].view(H, 1, 1).expand(H, M, 1), bq.to(out_dtype)], 2)
    Bk = torch.cat([table[:, T - 3].view(H, 1, 1).expand(H, 1, M), bk.to(out_dtype)], 1)
    return Bq, Bk
