"""Top-k attention: each grid query attends to its own ``topk`` highest-scoring grid keys.

Per query, per batch item and per head (no sharing between queries: the cost MiTA's shared
experts avoid). The tokens outside the grid (``p`` prefix, ``s`` suffix) are global, as in
:mod:`.global_tokens`: as keys they are in every query's softmax exactly (no top-k
candidates), as queries they attend to every key. ``topk`` at least the number of grid keys is
softmax attention. Scores are computed ``chunk_size`` queries at a time (never ``N x N`` at
once). BEiT's relative position bias adds each pair's own entry to its logit, before the
top-k: the keys are those of the highest logits.

Equivalent PyTorch code (one batch item and head; ``o`` the grid positions ``p:p + h*w``,
``g`` the others)::

    for n in o:
        I = (q[n] @ k[o].T).topk(topk).indices                  # of the grid keys
        logits = cat([q[n] @ k[o][I].T, q[n] @ k[g].T]) / sqrt(d)
        out[n] = softmax(logits, -1) @ cat([v[o][I], v[g]])
    out[g] = softmax(q[g] @ k.T / sqrt(d), -1) @ v
"""
from typing import Optional

import torch
from torch import Tensor

from .bias import RelPosBias
from .routing import IntPair
from .selected_keys import attend_grid, attend_selected, check_count, check_grid_args, grid_bias

__all__ = ['topk_attention', 'attend_setting']


def topk_attention(q: Tensor,
                   k: Tensor,
                   v: Tensor,
                   hw_shape: IntPair,
                   topk: int,
                   num_prefix_tokens: int = 0,
                   chunk_size: int = 256,
                   rel_pos_bias: Optional[RelPosBias] = None) -> Tensor:
    """Per-query top-k attention over the grid keys, the other tokens global.

    Args:
        q, k, v (Tensor): ``[B, H, N, d]``, one floating point dtype (bfloat16 / float16
            computed in float32).
        hw_shape (int | tuple[int, int]): the patch grid ``(h, w)``, tokens
            ``p:p + h*w``.
        topk (int): grid keys each grid query attends to; at least ``h*w`` is softmax
            attention (then no scores are computed).
        num_prefix_tokens (int): tokens before the grid (ViT's cls). Default: 0.
        chunk_size (int): queries scored at a time (``chunk_size x h*w`` scores per batch
            item and head). Default: 256.
        rel_pos_bias (RelPosBias, optional): BEiT's relative position bias (tokens: cls,
            then the grid), each logit's own entry, the top-k taken on the biased logits.
            Default: None.

    Returns:
        Tensor: ``[B, H, N, d]``, the dtype of ``q``.
    """
    h, w = check_grid_args(q, k, v, hw_shape, num_prefix_tokens)
    check_count(topk, 'topk', 'pass the number of grid keys each query attends to')
    check_count(chunk_size, 'chunk_size', 'pass the queries scored at a time, e.g. 256')
    n = h * w
    kk = min(topk, n)
    bias_of = grid_bias(rel_pos_bias, q.shape[1], num_prefix_tokens, n)

    def grid_fn(q_o, k_o, v_o):
        def select(start, stop):
            if kk == n:
                return None
            with torch.no_grad():
                scores = q_o[:, :, start:stop] @ k_o.transpose(-1, -2)    # [B, H, c, n]
                if bias_of is not None:   # the logits' order: scaled, then biased
                    scores = scores * q_o.shape[-1] ** -0.5 + bias_of(start, stop, None)
                return scores.topk(kk, dim=-1, sorted=False).indices, None
        return attend_selected(q_o, k_o, v_o, select, chunk_size, bias_of)

    return attend_grid(q, k, v, (h, w), num_prefix_tokens, grid_fn, rel_pos_bias)


def attend_setting(setting, q: Tensor, k: Tensor, v: Tensor, hw_shape: IntPair,
                   num_prefix_tokens: int, global_tokens: IntPair = (0, 0),
                   rel_pos_bias=None) -> Tensor:
    """``topk`` attention of a setting (its ``topk``), every token off the grid global,
    with the relative position bias if given (:func:`mita_seg.ops.attend`)."""
    return topk_attention(q, k, v, hw_shape, setting.topk, num_prefix_tokens,
                          rel_pos_bias=rel_pos_bias)
