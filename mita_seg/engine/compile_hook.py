"""``PlainParamGroupsHook``: the optimizer's parameter groups as plain dicts, so that
MMEngine's ``compile=True`` trains.

With ``cfg.compile`` set, mmengine 0.10.7's Runner compiles ``model.train_step`` whole, the
optimizer step included. Its ``DefaultOptimWrapperConstructor`` puts the param groups of
``paramwise_cfg`` into the optimizer's ``ConfigDict`` config, which turns them into
``ConfigDict``s, and torch keeps them as they are in ``optimizer.param_groups``. Dynamo
(torch 2.13) fails on a ``dict`` subclass there, any subclass: ``InternalTorchDynamoError:
'UserDefinedDictVariable' object has no attribute 'items'`` at ``for group in
self.param_groups`` in ``AdamW.step``. The hook gives each group to torch as a plain ``dict``
of the same items before the first iteration; optimizer state and parameter schedulers
(which read the groups through the optimizer) are unaffected.
"""
from mmengine.hooks import Hook
from mmengine.optim import OptimWrapperDict
from mmseg.registry import HOOKS

from mita_seg.utils.cfg_options import add_custom_imports

__all__ = ['PlainParamGroupsHook', 'use_plain_param_groups']


@HOOKS.register_module()
class PlainParamGroupsHook(Hook):
    """Before training (after a resume, before the first, compiled, ``train_step``), replace
    every optimizer param group that is a ``dict`` subclass by a plain ``dict``."""

    priority = 'VERY_HIGH'

    def before_train(self, runner) -> None:
        wrapper = runner.optim_wrapper
        wrappers = wrapper.values() if isinstance(wrapper, OptimWrapperDict) else [wrapper]
        for optim_wrapper in wrappers:
            groups = optim_wrapper.optimizer.param_groups
            groups[:] = [g if type(g) is dict else dict(g) for g in groups]


def use_plain_param_groups(cfg) -> None:
    """Add :class:`PlainParamGroupsHook` to a config that compiles (``compile`` neither
    unset nor False: mmengine compiles on ``True`` and on a dict, ``dict()`` included),
    in place (what ``tools/train.py`` does); ``mita_seg.engine`` is added to
    ``custom_imports`` so that the config the runner dumps in ``work_dir`` works on its own.

    Args:
        cfg (mmengine.Config): the training config.
    """
    if cfg.get('compile') in (None, False):
        return
    hooks = list(cfg.get('custom_hooks') or [])
    if not any(h.get('type') in ('PlainParamGroupsHook', PlainParamGroupsHook) for h in hooks):
        cfg.custom_hooks = hooks + [dict(type='PlainParamGroupsHook')]
    add_custom_imports(cfg, 'mita_seg.engine')
