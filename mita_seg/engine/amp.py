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

from mita_seg.utils.cfg_options import add_custom_imports
from mita_seg.utils.errors import InputError

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
    own tool; a config that already uses an AMP wrapper is left as it is. Without:
    :class:`BF16AmpOptimWrapper` (bfloat16 autocast), also in place of the
    ``AmpOptimWrapper`` of an AMP config (mmseg's ``-amp-`` configs), which mmengine
    refuses to build without a GPU (its loss scale is dropped: bfloat16 needs none).

    Args:
        cfg (mmengine.Config): the training config.

    Raises:
        InputError: the config's ``optim_wrapper.type`` is neither ``OptimWrapper`` nor an
            AMP wrapper, so there is nothing to switch.
    """
    kind = cfg.optim_wrapper.get('type', 'OptimWrapper')
    cuda = torch.cuda.is_available()
    if kind == 'BF16AmpOptimWrapper' or (kind == 'AmpOptimWrapper' and cuda):
        return
    if kind not in ('OptimWrapper', 'AmpOptimWrapper'):
        raise InputError(f'mixed precision (--amp, or the config\'s fp16): optim_wrapper.type is '
                         f'{kind!r}, and only an OptimWrapper can be switched to an AMP one: '
                         'leave out --amp, or give --cfg-options optim_wrapper.type=OptimWrapper')
    if cuda:
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.loss_scale = 'dynamic'
    else:
        cfg.optim_wrapper.type = 'BF16AmpOptimWrapper'
        for key in ('loss_scale', 'dtype'):   # AmpOptimWrapper's: float16 scaling
            cfg.optim_wrapper.pop(key, None)
    add_custom_imports(cfg, 'mita_seg.engine')
