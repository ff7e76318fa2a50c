"""Load mmengine checkpoints with torch's weights-only unpickler.

torch >= 2.6 loads files with ``weights_only=True``, which refuses any Python global not on
an allow-list. Checkpoints saved by mmengine's ``Runner`` hold a few such globals besides
tensors: numpy arrays, scalars and dtypes (message-hub history, metrics) and mmengine's
``HistoryBuffer``. :func:`register_safe_globals` adds exactly those to torch's allow-list,
and replaces mmengine's loader of local files by :func:`load_local_checkpoint`, which loads
with ``weights_only=True`` explicitly and fails with :class:`UnsafeCheckpointError` (naming
the globals at fault) for anything else. ``--resume``, ``load_from``, ``tools/test.py``
and ``Pretrained`` init all go through it; no file is unpickled with ``weights_only=False``.
"""
import importlib
import pickle
from typing import Any, Callable, List, Optional, Union

import torch
from mmengine.runner.checkpoint import CheckpointLoader

__all__ = [
    'UnsafeCheckpointError', 'mmengine_safe_globals', 'register_safe_globals',
    'load_local_checkpoint'
]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds Python objects outside the weights-only allow-list."""


# HistoryBuffer pickles its statistics methods (HistoryBuffer.min, ...) as
# getattr(HistoryBuffer, 'min'): the only getattr calls mmengine checkpoints need.
_HISTORY_BUFFER_METHODS = ('min', 'max', 'current', 'mean')


def _history_buffer_getattr(obj: Any, name: str) -> Any:
    """``getattr`` limited to the statistics methods of mmengine's ``HistoryBuffer``.

    Registered as ``builtins.getattr`` for weights-only loads: a general ``getattr`` would
    let a pickle reach any attribute (e.g. a method that writes files) of allowed objects.
    """
    from mmengine.logging import HistoryBuffer
    if obj is HistoryBuffer and name in _HISTORY_BUFFER_METHODS:
        return getattr(obj, name)
    raise pickle.UnpicklingError(
        f'refusing getattr({obj!r}, {name!r}) in a weights-only load: mita_seg only allows '
        f'HistoryBuffer.{{{",".join(_HISTORY_BUFFER_METHODS)}}}')


def mmengine_safe_globals() -> List[Any]:
    """The globals that checkpoints saved by mmengine's ``Runner`` hold besides tensors.

    Found by saving real checkpoints (``tools/train.py``) and listing their globals with
    ``torch.serialization.get_unsafe_globals_in_checkpoint``.

    Returns:
        list: entries for ``torch.serialization.add_safe_globals``.
    """
    import numpy as np
    from mmengine.logging import HistoryBuffer

    # numpy 2 renamed numpy.core to numpy._core
    multiarray = importlib.import_module(
        'numpy._core.multiarray' if int(np.__version__.split('.')[0]) >= 2 else
        'numpy.core.multiarray')
    globs = [
        HistoryBuffer,  # message hub: training log history ...
        (_history_buffer_getattr, 'builtins.getattr'),  # ... and its statistics methods
        np.ndarray, np.dtype, multiarray._reconstruct,  # numpy arrays in the history
        multiarray.scalar,  # numpy scalars (e.g. metrics, eta)
    ]
    # dtype classes (numpy >= 1.25 pickles the class of each dtype instance)
    for name in ('bool', 'int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32',
                 'uint64', 'float16', 'float32', 'float64'):
        globs.append(type(np.dtype(name)))
    return globs


def load_local_checkpoint(filename: str,
                          map_location: Optional[Union[str, Callable]] = None) -> Any:
    """Load a local checkpoint with ``torch.load(weights_only=True)``.

    Args:
        filename (str): path of the checkpoint.
        map_location (str | Callable, optional): as in :func:`torch.load`. Default: None.

    Returns:
        The unpickled checkpoint (a dict for mmengine checkpoints).

    Raises:
        FileNotFoundError: ``filename`` does not exist.
        UnsafeCheckpointError: the file holds objects outside the allow-list.
    """
    import os.path as osp
    filename = osp.expanduser(filename)
    if not osp.isfile(filename):
        raise FileNotFoundError(f'checkpoint {filename} does not exist')
    try:
        return torch.load(filename, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(filename)
        except Exception:  # not a zip checkpoint: fall back to torch's message
            unsafe = []
        allowed = {g[1] if isinstance(g, tuple) else f'{g.__module__}.{g.__qualname__}'
                   for g in torch.serialization.get_safe_globals()}
        unsafe = [g for g in unsafe if g not in allowed] or ['(see the error below)']
        raise UnsafeCheckpointError(
            f'refusing to load checkpoint {filename}: it holds Python objects outside the '
            f'weights-only allow-list: {", ".join(unsafe)}. Checkpoints of mmengine runs only '
            'need tensors, numpy values and HistoryBuffer (mita_seg.utils.checkpoint). If you '
            'trust this file and know what these objects are, allow them with '
            'torch.serialization.add_safe_globals([...]) before loading. '
            f'torch said: {e}') from e


_REGISTERED = False


def register_safe_globals() -> None:
    """Allow mmengine's checkpoint globals in torch's weights-only loads and make
    mmengine load local files through :func:`load_local_checkpoint` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    torch.serialization.add_safe_globals(mmengine_safe_globals())
    # '' is the prefix of local paths in mmengine's CheckpointLoader
    CheckpointLoader.register_scheme(prefixes='', loader=_mmengine_local_loader, force=True)
    _REGISTERED = True


def _mmengine_local_loader(filename: str, map_location=None, logger=None) -> Any:
    """mmengine ``CheckpointLoader`` scheme for local paths."""
    return load_local_checkpoint(filename, map_location=map_location)
