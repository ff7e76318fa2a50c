"""Window (neighbourhood) attention: each grid query attends to the grid window around it.

The window of grid token ``(i, j)`` is ``wh x ww`` grid tokens starting at row
``clamp(i - wh // 2, 0, h - wh)`` and column ``clamp(j - ww // 2, 0, w - ww)``: centred on
the query (for an even side, the query is at offset ``side // 2``) and shifted inward at the
borders so that it stays whole inside the grid (NATTEN's neighbourhood attention). A window
larger than the grid is clamped to it, so ``window_size >= max(h, w)`` is softmax attention.
The tokens outside the grid are global, as in :mod:`.global_tokens`: exact extra keys in
every grid query's softmax, and dense queries. Keys are gathered through a precomputed
neighbour table, ``chunk_size`` queries at a time. BEiT's relative position bias adds each
pair's own entry to its logit (``window_size >= max(h, w)`` is then BEiT's attention).

Equivalent PyTorch code (one batch item and head; ``o`` the grid positions ``p:p + h*w``,
``g`` the others)::

    for i, j in product(range(h), range(w)):
        r, c = min(max(i - wh // 2, 0), h - wh), min(max(j - ww // 2, 0), w - ww)
        J = [a * w + b for a in range(r, r + wh) for b in range(c, c + ww)]
        n = i * w + j
        logits = cat([q[o][n] @ k[o][J].T, q[o][n] @ k[g].T]) / sqrt(d)
        out[o][n] = softmax(logits, -1) @ cat([v[o][J], v[g]])
    out[g] = softmax(q[g] @ k.T / sqrt(d), -1) @ v
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .bias import RelPosBias
from .routing import IntPair, pair
from .selected_keys import attend_grid, attend_selected, check_count, check_grid_args, grid_bias

__all__ = ['window_attention', 'neighbour_table', 'attend_setting']


def neighbour_table(hw_shape: Tuple[int, int], window: Tuple[int, int], device=None) -> Tensor:
    """Grid positions of each grid token's window, ``[h*w, wh*ww]`` (row-major in the
    window); ``wh <= h``, ``ww <= w``."""
    (h, w), (wh, ww) = hw_shape, window
    rows = (torch.arange(h, device=device) - wh // 2).clamp(0, h - wh).view(h, 1) + \
        torch.arange(wh, device=device)                               # [h, wh]
    cols = (torch.arange(w, device=device) - ww // 2).clamp(0, w - ww).view(w, 1) + \
        torch.arange(ww, device=device)                               # [w, ww]
    table = rows.view(h, 1, wh, 1) * w + cols.view(1, w, 1, ww)       # [h, w, wh, ww]
    return table.reshape(h * w, wh * ww)


def window_attention(q: Tensor,
                     k: Tensor,
                     v: Tensor,
                     hw_shape: IntPair,
                     window_size: IntPair,
                     num_prefix_tokens: int = 0,
                     chunk_size: int = 256,
                     rel_pos_bias: Optional[RelPosBias] = None) -> Tensor:
    """Neighbourhood attention over the grid, the other tokens global.

    Args:
        q, k, v (Tensor): ``[B, H, N, d]``, one floating point dtype (bfloat16 / float16
            computed in float32).
        hw_shape (int | tuple[int, int]): the patch grid ``(h, w)``, tokens
            ``p:p + h*w``.
        window_size (int | tuple[int, int]): window ``(wh, ww)`` in tokens; clamped to the
            grid.
        num_prefix_tokens (int): tokens before the grid (ViT's cls). Default: 0.
        chunk_size (int): queries gathered at a time. Default: 256.
        rel_pos_bias (RelPosBias, optional): BEiT's relative position bias (tokens: cls,
            then the grid), each logit's own entry. Default: None.

    Returns:
        Tensor: ``[B, H, N, d]``, the dtype of ``q``.
    """
    h, w = check_grid_args(q, k, v, hw_shape, num_prefix_tokens)
    wh, ww = pair(window_size, 'window_size')
    if wh < 1 or ww < 1:
        raise ValueError(f'window_size must be >= 1, got {window_size}: pass the window '
                         'side in tokens, e.g. 7')
    check_count(chunk_size, 'chunk_size', 'pass the queries gathered at a time, e.g. 256')
    wh, ww = min(wh, h), min(ww, w)
    bias_of = grid_bias(rel_pos_bias, q.shape[1], num_prefix_tokens, h * w)

    def grid_fn(q_o, k_o, v_o):
        if (wh, ww) == (h, w):
            return attend_selected(q_o, k_o, v_o, lambda start, stop: None, chunk_size,
                                   bias_of)
        table = neighbour_table((h, w), (wh, ww), q.device)           # [h*w, wh*ww]
        return attend_selected(q_o, k_o, v_o, lambda start, stop: (table[start:stop], None),
                               chunk_size, bias_of)

    return attend_grid(q, k, v, (h, w), num_prefix_tokens, grid_fn, rel_pos_bias)


def attend_setting(setting, q: Tensor, k: Tensor, v: Tensor, hw_shape: IntPair,
                   num_prefix_tokens: int, global_tokens: IntPair = (0, 0),
                   rel_pos_bias=None) -> Tensor:
    """``window`` attention of a setting (its ``window``), every token off the grid global,
    with the relative position bias if given (:func:`mita_seg.ops.attend`)."""
    return window_attention(q, k, v, hw_shape, setting.window, num_prefix_tokens,
                            rel_pos_bias=rel_pos_bias)
