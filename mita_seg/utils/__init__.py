"""Utilities of mita_seg: safe checkpoint loading, the checkpoint key report, distributed
set-up (these depend on torch and mmengine); crash-safe file writes (:mod:`.atomic_files`,
light); ``--cfg-options`` remembered on a config and blamed when a part of it cannot be
built (:mod:`.cfg_options`); the error a user fixes
(:class:`InputError`, :mod:`.errors`) and the stack's noise (:mod:`.stack_noise`), light.

Names load on first use, so ``import mita_seg.utils.errors`` stays light (no torch, no mm
stack): the tools' command line (the ``cli`` package) imports it before parsing.
"""
import importlib

_SOURCES = {
    'checkpoint': ('CheckpointMismatchError', 'UnreadableCheckpointError',
                   'UnsafeCheckpointError', 'check_checkpoint_keys', 'check_state_dict',
                   'load_checkpoint', 'load_local_checkpoint', 'load_url_checkpoint',
                   'mmengine_safe_globals', 'register_safe_globals'),
    'cfg_options': ('CfgOptionsError', 'blame_cfg_options', 'cfg_options_of',
                    'merge_cfg_options'),
    'dist': ('setup_cpu_distributed', ),
    'errors': ('InputError', ),
    'modules': ('is_attention_module', ),
    'stack_noise': ('is_stack_noise', 'quiet_stack'),
}
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f'{__name__}.{_WHERE[name]}'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(list(globals()) + __all__)
