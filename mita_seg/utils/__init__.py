"""Utilities of mita_seg: safe checkpoint loading, the checkpoint key report, distributed
set-up for the tools (these depend on torch and mmengine), and the tools' argument parsing
(:mod:`mita_seg.utils.cli`, no torch, no mm stack).

Names load on first use, so ``import mita_seg.utils.cli`` stays light.
"""
import importlib

_SOURCES = {
    'checkpoint': ('CheckpointMismatchError', 'UnreadableCheckpointError',
                   'UnsafeCheckpointError', 'check_checkpoint_keys', 'check_state_dict',
                   'load_checkpoint', 'load_local_checkpoint', 'mmengine_safe_globals',
                   'register_safe_globals'),
    'dist': ('setup_cpu_distributed', ),
    'modules': ('is_attention_module', ),
}
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f'{__name__}.{_WHERE[name]}'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(list(globals()) + __all__)
