"""Agent attention: MiTA's shared expert alone (compression only, no routed experts).

The landmarks ``R`` are MiTA's (:func:`~.routing.landmarks`: the grid part of ``q``
average-pooled to ``pool_size``); they gather the grid's values (``V_R``) and each grid
query reads them through ``M = Ph * Pw`` logits scaled by ``shared_scale`` (MiTA's shared
logits, ``1 / d`` by default). The tokens outside the grid are global, as in
:mod:`.global_tokens`: exact extra keys in every grid query's softmax, and dense queries.
Cost linear in ``N``: ``4 M h*w d`` MACs per batch item and head on the grid.

Equivalent PyTorch code (one batch item and head; ``o`` the grid positions ``p:p + h*w``,
``g`` the others)::

    R = adaptive_avg_pool2d(q[o].T.reshape(d, h, w), pool_size).flatten(1).T   # [M, d]
    V_R = softmax(R @ k[o].T / sqrt(d), -1) @ v[o]                             # [M, d]
    for n in o:
        logits = cat([q[n] @ R.T * shared_scale, q[n] @ k[g].T / sqrt(d)])
        out[n] = softmax(logits, -1) @ cat([V_R, v[g]])
    out[g] = softmax(q[g] @ k.T / sqrt(d), -1) @ v
"""
import math
from typing import Optional

import torch
from torch import Tensor

from .routing import IntPair, landmarks, pair
from .selected_keys import attend_grid, check_grid_args, no_bias

__all__ = ['agent_attention', 'attend_setting']


def agent_attention(q: Tensor,
                    k: Tensor,
                    v: Tensor,
                    hw_shape: IntPair,
                    pool_size: IntPair,
                    num_prefix_tokens: int = 0,
                    shared_scale: Optional[float] = None) -> Tensor:
    """Agent attention (MiTA's shared expert alone) over the grid, the other tokens global.

    Args:
        q, k, v (Tensor): ``[B, H, N, d]``, one floating point dtype (bfloat16 / float16
            computed in float32).
        hw_shape (int | tuple[int, int]): the patch grid ``(h, w)``, tokens
            ``p:p + h*w``.
        pool_size (int | tuple[int, int]): landmark grid ``(Ph, Pw)``, ``M = Ph * Pw``
            landmarks; at most the patch grid.
        num_prefix_tokens (int): tokens before the grid (ViT's cls). Default: 0.
        shared_scale (float, optional): scale of the logits ``q . R``; None means MiTA's
            ``1 / d``. Default: None.

    Returns:
        Tensor: ``[B, H, N, d]``, the dtype of ``q``.
    """
    h, w = check_grid_args(q, k, v, hw_shape, num_prefix_tokens)
    ph, pw = pair(pool_size, 'pool_size')
    if ph < 1 or pw < 1 or ph > h or pw > w:
        raise ValueError(
            f'pool_size {(ph, pw)} must be >= 1 and no larger than the grid {(h, w)}: '
            f'use a pool_size of at most {(h, w)}')
    d = q.shape[-1]
    if shared_scale is not None and not 0 < shared_scale < math.inf:
        raise ValueError(f'shared_scale must be finite and > 0 (it scales the logits q . R), got '
                         f'{shared_scale}; None means 1/d')
    scale = 1.0 / d if shared_scale is None else float(shared_scale)

    def grid_fn(q_o, k_o, v_o):
        R = landmarks(q_o, (h, w), (ph, pw), 0)                              # [B, H, M, d]
        v_r = torch.softmax((R * d ** -0.5) @ k_o.transpose(-1, -2), -1) @ v_o   # [B, H, M, d]
        logits = q_o @ (R * scale).transpose(-1, -2)                        # [B, H, n, M]
        lse = torch.logsumexp(logits, -1)
        return torch.exp(logits - lse.unsqueeze(-1)) @ v_r, lse

    return attend_grid(q, k, v, (h, w), num_prefix_tokens, grid_fn)


def attend_setting(setting, q: Tensor, k: Tensor, v: Tensor, hw_shape: IntPair,
                   num_prefix_tokens: int, global_tokens: IntPair = (0, 0),
                   rel_pos_bias=None) -> Tensor:
    """``agent`` attention of a setting (:class:`~mita_seg.setting.MiTASetting`: its
    ``pool_size``, at most the grid, and ``shared_scale``), every token off the grid global
    (:func:`mita_seg.ops.attend`)."""
    no_bias('agent', rel_pos_bias)
    (h, w), (ph, pw) = pair(hw_shape, 'hw_shape'), pair(setting.pool_size, 'pool_size')
    return agent_attention(q, k, v, (h, w), (min(ph, h), min(pw, w)), num_prefix_tokens,
                           setting.shared_scale)
