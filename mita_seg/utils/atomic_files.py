"""Crash-safe file writes: a file is either its old contents or its new ones, never half.

The new bytes go to a temporary file in the same directory, are flushed and ``fsync``-ed,
then ``os.replace`` moves them over the target (atomic on POSIX and Windows within one file
system), and the directory is ``fsync``-ed so the rename itself survives a power cut. The
file gets the mode of the file it replaces, or that of a new file (``0666 & ~umask``), as
``open`` would give it (``mkstemp`` makes its temporary file ``0600``, whatever the umask).

Light (the standard library; :func:`atomic_write_image` imports OpenCV when called): the
dataset generators write through it without loading torch or the mm stack.
:mod:`mita_seg.engine.atomic_io` adds mmengine's file backend on top.
"""
import contextlib
import os
import os.path as osp
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

__all__ = ['atomic_path', 'atomic_write_bytes', 'atomic_write_text', 'atomic_write_image',
           'new_file_mode']


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


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc``)."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('Umask:'):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, but brief)
    os.umask(mask)
    return mask


def new_file_mode(filepath: Union[str, Path]) -> int:
    """The permission bits ``filepath`` should have once written: those of the file there
    now, or ``0666 & ~umask`` for a new one (what ``open(filepath, 'w')`` gives)."""
    try:
        return os.stat(filepath).st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(filepath: Union[str, Path], suffix: str = '.tmp') -> Iterator[str]:
    """A temporary path beside ``filepath`` to write to; when the block ends without an
    exception it takes :func:`new_file_mode`, is ``fsync``-ed (whoever wrote it) and replaces
    ``filepath`` in one rename (the directory ``fsync``-ed); otherwise it is removed and
    ``filepath`` is untouched. Parent directories are created. A writer that opens the path
    itself (``torch.onnx.export``) uses this; bytes in memory go through
    :func:`atomic_write_bytes`.

    Args:
        filepath (str | Path): the target.
        suffix (str): the temporary file's suffix. Default: ``'.tmp'``.
    """
    filepath = osp.abspath(os.fspath(filepath))
    dirname = osp.dirname(filepath)
    os.makedirs(dirname, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dirname, prefix=f'.{osp.basename(filepath)}.', suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, new_file_mode(filepath))
        # the bytes on disk before the rename makes them the file (the writer may not have
        # synced them: a power cut would leave filepath empty or torn)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, filepath)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(dirname)


def atomic_write_bytes(data: bytes, filepath: Union[str, Path]) -> None:
    """Write ``data`` to ``filepath`` atomically (parent directories are created), with the
    mode :func:`new_file_mode` says.

    Args:
        data (bytes): the new contents.
        filepath (str | Path): the target; an existing file is replaced only once the new
            contents are fully on disk.

    Raises:
        OSError: writing failed; ``filepath`` is untouched and no temporary file is left.
    """
    with atomic_path(filepath) as tmp:
        with open(tmp, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(text: str, filepath: Union[str, Path], encoding: str = 'utf-8') -> None:
    """:func:`atomic_write_bytes` for text."""
    atomic_write_bytes(text.encode(encoding), filepath)


def atomic_write_image(image, filepath: Union[str, Path], params: Sequence[int] = (),
                       ext: Optional[str] = None) -> None:
    """Encode ``image`` (an array as ``cv2.imwrite`` takes it: BGR, or one channel) as
    ``ext`` (``'.png'``; default: ``filepath``'s suffix), with ``cv2.imencode``'s ``params``,
    and write it with :func:`atomic_write_bytes`.

    Unlike ``cv2.imwrite``, which returns False on a failed write (a full disk) and may leave
    a truncated file, this raises and leaves ``filepath`` as it was.

    Raises:
        ValueError: OpenCV cannot encode ``image`` in that format.
        OSError: writing failed (see :func:`atomic_write_bytes`).
    """
    import cv2
    ext = ext or osp.splitext(os.fspath(filepath))[1]
    ok, buf = cv2.imencode(ext, image, list(params))
    if not ok:
        raise ValueError(f'could not encode {filepath} as {ext}')
    atomic_write_bytes(buf.tobytes(), filepath)
