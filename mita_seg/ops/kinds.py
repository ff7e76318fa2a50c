"""Attention of a setting, whatever its kind: :func:`attend` runs the operator that the
setting's kind names (its record's ``operator``, :data:`mita_seg.setting.KINDS`), with the
setting whole, as a swapped module runs it."""
import importlib
from typing import Callable, Dict, Optional

from torch import Tensor

from .bias import RelPosBias
from .routing import IntPair

__all__ = ['attend', 'operator_of']

# 'module:function' -> the function (imported once)
_OPERATORS: Dict[str, Callable[..., Tensor]] = {}


def operator_of(setting) -> Callable[..., Tensor]:
    """The operator function of ``setting``'s kind (its record's ``operator``), imported
    the first time. A module that runs a setting resolves it when the setting is set
    (``MiTASettingsMixin.configure``), so that a ``torch.compile``'d forward finds it
    without an import (which dynamo does not trace)."""
    name = setting.record.operator
    fn = _OPERATORS.get(name)
    if fn is None:
        module, attr = name.split(':')
        fn = _OPERATORS[name] = getattr(importlib.import_module(module), attr)
    return fn


def attend(setting, q: Tensor, k: Tensor, v: Tensor, hw_shape: IntPair,
           num_prefix_tokens: int, global_tokens: IntPair = (0, 0),
           rel_pos_bias: Optional[RelPosBias] = None) -> Tensor:
    """The attention of ``setting`` (a :class:`~mita_seg.setting.MiTASetting`) over
    ``q, k, v`` (``[B, H, N, d]``; the ``h x w`` grid after ``num_prefix_tokens`` tokens).

    MiTA takes ``global_tokens`` (``(prefix, suffix)``, :func:`mita_seg.ops.mita_attention`);
    every other kind treats every token off the grid as global. MiTA, top-k and window
    attention take a relative position bias (``Kind.bias_adds``), agent and block refuse
    one. A pool larger than the grid runs on the grid; a top-k, a block
    count or a window beyond the grid reads the whole grid.

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``.
    """
    return operator_of(setting)(setting, q, k, v, hw_shape, num_prefix_tokens, global_tokens,
                                rel_pos_bias)
