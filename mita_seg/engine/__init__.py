"""Training-loop reliability for mmengine runners. Importing this module registers
:class:`SafeCheckpointHook` and :class:`PlainParamGroupsHook` (mmseg ``HOOKS``),
:class:`BF16AmpOptimWrapper` (mmseg ``OPTIM_WRAPPERS``) and the atomic local file backend
(``mita_atomic_local``)."""
from .amp import BF16AmpOptimWrapper, use_amp
from .atomic_io import ATOMIC_BACKEND, AtomicLocalBackend, atomic_write_bytes, atomic_write_text
from .checkpoint_hook import SafeCheckpointHook, use_safe_checkpoint
from .compile_hook import PlainParamGroupsHook, use_plain_param_groups

__all__ = [
    'SafeCheckpointHook', 'use_safe_checkpoint', 'AtomicLocalBackend', 'ATOMIC_BACKEND',
    'atomic_write_bytes', 'atomic_write_text', 'BF16AmpOptimWrapper', 'use_amp',
    'PlainParamGroupsHook', 'use_plain_param_groups'
]
