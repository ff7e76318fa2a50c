"""Mixed-precision training where mmengine's ``AmpOptimWrapper`` refuses to run.

mmengine 0.10.7's ``AmpOptimWrapper`` asserts that a CUDA/NPU/MLU/MUSA device is present,
so ``--amp`` fails on CPU although ``mmengine.runner.amp.autocast`` supports CPU bfloat16.
bfloat16 has float32's exponent range, so it needs no loss scaling: the wrapper below is
mmengine's plain ``OptimWrapper`` with a bfloat16 autocast context.
"""
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn as nn
from mmengine.optim import OptimWrapper
from mmseg.registry import OPTIM_WRAPPERS

__all__ = ['BF16AmpOptimWrapper', 'use_amp']


@OPTIM_WRAPPERS.register_module()
class BF16AmpOptimWrapper(OptimWrapper):
    """Automatic mixed precision in bfloat16, on any device (CPU included).

    Args:
        loss_scale (str | float | dict, optional): accepted for config compatibility with
            ``AmpOptimWrapper`` and ignored: bfloat16 does not underflow where float32
            does not. Default: None.
        dtype (str | torch.dtype): must be bfloat16; there for config compatibility
            with ``AmpOptimWrapper``. Default: 'bfloat16'.
        **kwargs: arguments of mmengine's ``OptimWrapper``.
    """

    def __init__(self, loss_scale=None, dtype: Optional[str] = 'bfloat16', **kwargs):
        if dtype not in ('bfloat16', torch.bfloat16):
            raise ValueError(f'BF16AmpOptimWrapper runs bfloat16 only, got dtype={dtype!r}; '
                             'use mmengine\'s AmpOptimWrapper for float16 on CUDA')
        super().__init__(**kwargs)

    @contextmanager
    def optim_context(self, model: nn.Module):
        """The parent's context (gradient accumulation) inside a bfloat16 autocast."""
        from mmengine.runner.amp import autocast
        with super().optim_context(model), autocast(dtype=torch.bfloat16):
            yield


def use_amp(cfg) -> None:
    """Turn on mixed precision in a config, in place (what ``tools/train.py --amp`` does).

    With CUDA: mmengine's ``AmpOptimWrapper`` (float16, dynamic loss scaling), as mmseg's
    own tool. Without: :class:`BF16AmpOptimWrapper` (bfloat16 autocast). A config that
    already uses an AMP wrapper is left as it is.

    Args:
        cfg (mmengine.Config): the training config.

    Raises:
        ValueError: the config's ``optim_wrapper.type`` is neither ``OptimWrapper`` nor an
            AMP wrapper, so there is nothing to switch.
    """
    kind = cfg.optim_wrapper.get('type', 'OptimWrapper')
    if kind in ('AmpOptimWrapper', 'BF16AmpOptimWrapper'):
        return
    if kind != 'OptimWrapper':
        raise ValueError('--amp needs optim_wrapper.type="OptimWrapper" in the config, '
                         f'got {kind!r}')
    if torch.cuda.is_available():
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.loss_scale = 'dynamic'
    else:
        cfg.optim_wrapper.type = 'BF16AmpOptimWrapper'
    custom_imports = cfg.setdefault('custom_imports', dict(imports=[]))
    imports = list(custom_imports.get('imports', []))
    if 'mita_seg.engine' not in imports:
        custom_imports['imports'] = imports + ['mita_seg.engine']
