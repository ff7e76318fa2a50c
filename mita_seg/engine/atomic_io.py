"""Crash-safe file writes for mmengine: :class:`AtomicLocalBackend`, mmengine's local file
backend whose writes are atomic, over the writers of :mod:`mita_seg.utils.atomic_files`
(re-exported here): a file is either its old contents or its new ones, never half, with the
mode ``open`` would give it (the user's umask) or that of the file it replaces.
"""
from pathlib import Path
from typing import Union

from mmengine.fileio import LocalBackend, register_backend

from mita_seg.utils.atomic_files import (atomic_path, atomic_write_bytes, atomic_write_text,
                                         new_file_mode)

__all__ = ['atomic_path', 'atomic_write_bytes', 'atomic_write_text', 'AtomicLocalBackend',
           'ATOMIC_BACKEND', 'new_file_mode']

# Name under which :class:`AtomicLocalBackend` is registered in mmengine's file backends.
ATOMIC_BACKEND = 'mita_atomic_local'


@register_backend(ATOMIC_BACKEND)
class AtomicLocalBackend(LocalBackend):
    """mmengine's ``LocalBackend`` whose ``put``/``put_text`` write atomically.

    ``Runner.save_checkpoint`` serialises the whole checkpoint to memory and hands the bytes
    to the file backend's ``put``: with this backend a checkpoint file is never observed
    half-written, whether saving raises or the process is killed.
    """

    def put(self, obj: bytes, filepath: Union[str, Path]) -> None:
        """Write bytes to ``filepath`` atomically."""
        atomic_write_bytes(obj, filepath)

    def put_text(self, obj: str, filepath: Union[str, Path], encoding: str = 'utf-8') -> None:
        """Write text to ``filepath`` atomically."""
        atomic_write_text(obj, filepath, encoding)
