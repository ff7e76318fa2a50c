"""Utilities of mita_seg: safe checkpoint loading, the checkpoint key report, distributed
set-up for the tools. Depends on torch and mmengine only."""
from .checkpoint import (CheckpointMismatchError, UnreadableCheckpointError,
                         UnsafeCheckpointError, check_checkpoint_keys, check_state_dict,
                         load_checkpoint, load_local_checkpoint, mmengine_safe_globals,
                         register_safe_globals)
from .dist import setup_cpu_distributed
from .modules import is_attention_module

__all__ = [
    'CheckpointMismatchError', 'UnreadableCheckpointError', 'UnsafeCheckpointError',
    'check_checkpoint_keys', 'check_state_dict', 'load_checkpoint', 'load_local_checkpoint',
    'mmengine_safe_globals', 'register_safe_globals', 'setup_cpu_distributed',
    'is_attention_module'
]
