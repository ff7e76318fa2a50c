"""Utilities of mita_seg: safe checkpoint loading and distributed set-up for the tools."""
from .checkpoint import (UnsafeCheckpointError, load_local_checkpoint, mmengine_safe_globals,
                         register_safe_globals)
from .dist import setup_cpu_distributed

__all__ = [
    'UnsafeCheckpointError', 'load_local_checkpoint', 'mmengine_safe_globals',
    'register_safe_globals', 'setup_cpu_distributed'
]
