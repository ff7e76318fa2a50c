"""The training-free kinds of attention by setting: :func:`attend_kind` runs the operator a
setting's ``kind`` names (:mod:`mita_seg.setting`: ``agent``, ``block``, ``topk``,
``window``) with its settings, as a swapped module runs it."""
from torch import Tensor

from .agent import agent_attention
from .block import block_attention
from .routing import IntPair, pair
from .topk import topk_attention
from .window import window_attention

__all__ = ['attend_kind']


def attend_kind(setting, q: Tensor, k: Tensor, v: Tensor, hw_shape: IntPair,
                num_prefix_tokens: int) -> Tensor:
    """The attention of ``setting`` (a :class:`~mita_seg.setting.MiTASetting`, or anything
    with its attributes, whose ``kind`` is not ``'mita'``) over ``q, k, v`` (``[B, H, N,
    d]``; the ``h x w`` grid after ``num_prefix_tokens`` tokens, every token off the grid
    global). A pool larger than the grid runs on the grid (as MiTA's does); a top-k, a
    block count or a window beyond the grid reads the whole grid.

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``.
    """
    h, w = pair(hw_shape, 'hw_shape')
    if setting.kind == 'agent':
        ph, pw = pair(setting.pool_size, 'pool_size')
        return agent_attention(q, k, v, (h, w), (min(ph, h), min(pw, w)), num_prefix_tokens,
                               setting.shared_scale)
    if setting.kind == 'block':
        return block_attention(q, k, v, (h, w), setting.block_size, setting.num_blocks,
                               num_prefix_tokens)
    if setting.kind == 'topk':
        return topk_attention(q, k, v, (h, w), setting.topk, num_prefix_tokens)
    if setting.kind == 'window':
        return window_attention(q, k, v, (h, w), setting.window, num_prefix_tokens)
    raise ValueError(f'attend_kind runs agent, block, topk or window attention, not '
                     f'{setting.kind!r} (MiTA: mita_attention)')
