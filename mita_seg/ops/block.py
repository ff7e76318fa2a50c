"""Block attention (MoBA-style): each grid query attends to a few blocks of the grid.

The ``h x w`` grid is cut into ``bh x bw`` blocks of tokens, row-major (the last row and
column of blocks are smaller where ``h`` or ``w`` is not a multiple; a block larger than the
grid is the grid). A block's summary is the mean of its keys. Each grid query attends to
``num_blocks`` blocks (at most all of them): its own block always, and the others with the
highest ``q . mean_key``; one softmax over the union of their keys. With every block it is
softmax attention (then no scores are computed). The tokens outside the grid are global, as
in :mod:`.global_tokens`: exact extra keys in every grid query's softmax, and dense queries.
Scores and the attended keys are taken ``chunk_size`` queries at a time.

Equivalent PyTorch code (one batch item and head; ``o`` the grid positions ``p:p + h*w``,
``g`` the others; ``blocks[b]`` the grid positions of block ``b``, ``own[n]`` the block of
grid token ``n``)::

    mean_k = stack([k[o][blocks[b]].mean(0) for b in range(len(blocks))])   # [nb, d]
    for n in range(h * w):
        s = q[o][n] @ mean_k.T
        s[own[n]] = inf
        J = cat([blocks[b] for b in s.topk(num_blocks).indices])            # its keys
        logits = cat([q[o][n] @ k[o][J].T, q[o][n] @ k[g].T]) / sqrt(d)
        out[o][n] = softmax(logits, -1) @ cat([v[o][J], v[g]])
    out[g] = softmax(q[g] @ k.T / sqrt(d), -1) @ v
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .routing import IntPair, pair
from .selected_keys import (attend_grid, attend_selected, check_count, check_grid_args,
                            no_bias)

__all__ = ['block_attention', 'block_tables', 'attend_setting']


def block_tables(hw_shape: Tuple[int, int], block_size: Tuple[int, int],
                 device=None) -> Tuple[Tensor, Tensor, Tensor]:
    """The block layout of an ``h x w`` grid cut in ``bh x bw`` blocks (``bh <= h``,
    ``bw <= w``), ``nb = ceil(h / bh) * ceil(w / bw)`` blocks, row-major.

    Returns:
        tuple: ``(keys [nb, bh*bw], valid [nb, bh*bw], own [h*w])``: each block's grid
        positions (0 where ``valid`` is False: the slots past the grid of the last row and
        column of blocks), and each grid token's block.
    """
    (h, w), (bh, bw) = hw_shape, block_size
    nbh, nbw = -(-h // bh), -(-w // bw)
    rows = torch.arange(nbh * bh, device=device).view(nbh, 1, bh, 1)   # [nbh, 1, bh, 1]
    cols = torch.arange(nbw * bw, device=device).view(1, nbw, 1, bw)   # [1, nbw, 1, bw]
    valid = (rows < h) & (cols < w)                                   # [nbh, nbw, bh, bw]
    keys = torch.where(valid, rows * w + cols, 0)
    own = (torch.arange(h, device=device) // bh).view(h, 1) * nbw + (
        torch.arange(w, device=device) // bw).view(1, w)
    return keys.reshape(nbh * nbw, bh * bw), valid.reshape(nbh * nbw, bh * bw), own.flatten()


def block_means(k: Tensor, hw_shape: Tuple[int, int], block_size: Tuple[int, int]) -> Tensor:
    """Mean key of each block: ``k`` ``[B, H, h*w, d]`` to ``[B, H, nb, d]`` (sums, no
    MACs)."""
    B, H, _, d = k.shape
    (h, w), (bh, bw) = hw_shape, block_size
    nbh, nbw = -(-h // bh), -(-w // bw)
    grid = F.pad(k.reshape(B, H, h, w, d), (0, 0, 0, nbw * bw - w, 0, nbh * bh - h))
    sums = grid.view(B, H, nbh, bh, nbw, bw, d).sum((3, 5))          # [B, H, nbh, nbw, d]
    rows = (h - torch.arange(nbh, device=k.device) * bh).clamp(max=bh)
    cols = (w - torch.arange(nbw, device=k.device) * bw).clamp(max=bw)
    counts = (rows.view(nbh, 1) * cols.view(1, nbw)).unsqueeze(-1)   # [nbh, nbw, 1]
    return (sums / counts).reshape(B, H, nbh * nbw, d)


def block_attention(q: Tensor,
                    k: Tensor,
                    v: Tensor,
                    hw_shape: IntPair,
                    block_size: IntPair,
                    num_blocks: int,
                    num_prefix_tokens: int = 0,
                    chunk_size: int = 256) -> Tensor:
    """MoBA-style block attention over the grid, the other tokens global.

    Args:
        q, k, v (Tensor): ``[B, H, N, d]``, one floating point dtype (bfloat16 / float16
            computed in float32).
        hw_shape (int | tuple[int, int]): the patch grid ``(h, w)``, tokens
            ``p:p + h*w``.
        block_size (int | tuple[int, int]): block ``(bh, bw)`` in tokens; larger than the
            grid is one block.
        num_blocks (int): blocks each grid query attends to, its own included; clamped to
            the number of blocks (all of them is softmax attention).
        num_prefix_tokens (int): tokens before the grid (ViT's cls). Default: 0.
        chunk_size (int): queries scored and gathered at a time. Default: 256.

    Returns:
        Tensor: ``[B, H, N, d]``, the dtype of ``q``.
    """
    h, w = check_grid_args(q, k, v, hw_shape, num_prefix_tokens)
    bh, bw = pair(block_size, 'block_size')
    if bh < 1 or bw < 1:
        raise ValueError(f'block_size must be >= 1, got {block_size}: pass the block '
                         'side in tokens, e.g. 8')
    check_count(num_blocks, 'num_blocks', 'pass the number of blocks each query attends '
                'to, its own included')
    check_count(chunk_size, 'chunk_size', 'pass the queries scored at a time, e.g. 256')
    bh, bw = min(bh, h), min(bw, w)
    nb = -(-h // bh) * -(-w // bw)
    nsel = min(num_blocks, nb)

    def grid_fn(q_o, k_o, v_o):
        if nsel == nb:
            return attend_selected(q_o, k_o, v_o, lambda start, stop: None, chunk_size)
        keys, valid, own = block_tables((h, w), (bh, bw), q.device)
        with torch.no_grad():
            mean_k = block_means(k_o, (h, w), (bh, bw))                # [B, H, nb, d]

        def select(start, stop):
            with torch.no_grad():
                scores = q_o[:, :, start:stop] @ mean_k.transpose(-1, -2)   # [B, H, c, nb]
                mine = own[start:stop].view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
                scores.scatter_(-1, mine, float('inf'))
                chosen = scores.topk(nsel, dim=-1, sorted=False).indices    # [B, H, c, nsel]
            return keys[chosen].flatten(-2), valid[chosen].flatten(-2)   # [B, H, c, nsel*bh*bw]

        return attend_selected(q_o, k_o, v_o, select, chunk_size)

    return attend_grid(q, k, v, (h, w), num_prefix_tokens, grid_fn)


def attend_setting(setting, q: Tensor, k: Tensor, v: Tensor, hw_shape: IntPair,
                   num_prefix_tokens: int, global_tokens: IntPair = (0, 0),
                   rel_pos_bias=None) -> Tensor:
    """``block`` attention of a setting (its ``block_size``, ``num_blocks``), every token off
    the grid global (:func:`mita_seg.ops.attend`)."""
    no_bias('block', rel_pos_bias)
    return block_attention(q, k, v, hw_shape, setting.block_size, setting.num_blocks,
                           num_prefix_tokens)
