"""Crash-safe file writes: a file is either its old contents or its new ones, never half.

The new bytes go to a temporary file in the same directory, are flushed and ``fsync``-ed,
then ``os.replace`` moves them over the target (atomic on POSIX and Windows within one file
system), and the directory is ``fsync``-ed so the rename itself survives a power cut.
"""
import os
import os.path as osp
import tempfile
from pathlib import Path
from typing import Union

from mmengine.fileio import LocalBackend, register_backend

__all__ = ['atomic_write_bytes', 'atomic_write_text', 'AtomicLocalBackend', 'ATOMIC_BACKEND']

# Name under which :class:`AtomicLocalBackend` is registered in mmengine's file backends.
ATOMIC_BACKEND = 'mita_atomic_local'


def _fsync_dir(dirname: str) -> None:
    """Persist a rename in ``dirname`` (no-op where directories cannot be opened)."""
    try:
        fd = os.open(dirname, os.O_RDONLY)
    except OSError:  # Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)


def atomic_write_bytes(data: bytes, filepath: Union[str, Path]) -> None:
    """Write ``data`` to ``filepath`` atomically (parent directories are created).

    Args:
        data (bytes): the new contents.
        filepath (str | Path): the target; an existing file is replaced only once the new
            contents are fully on disk.

    Raises:
        OSError: writing failed; ``filepath`` is untouched and no temporary file is left.
    """
    filepath = osp.abspath(os.fspath(filepath))
    dirname = osp.dirname(filepath)
    os.makedirs(dirname, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dirname, prefix=f'.{osp.basename(filepath)}.', suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, filepath)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(dirname)


def atomic_write_text(text: str, filepath: Union[str, Path], encoding: str = 'utf-8') -> None:
    """:func:`atomic_write_bytes` for text."""
    atomic_write_bytes(text.encode(encoding), filepath)


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
