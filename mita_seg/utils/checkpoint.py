"""Load mmengine checkpoints with torch's weights-only unpickler.

torch >= 2.6 loads files with ``weights_only=True``, which refuses any Python global not on
an allow-list. Checkpoints saved by mmengine's ``Runner`` hold a few such globals besides
tensors: numpy arrays, scalars and dtypes (message-hub history, metrics) and mmengine's
``HistoryBuffer``. :func:`register_safe_globals` adds exactly those to torch's allow-list,
and replaces mmengine's loader of local files by :func:`load_local_checkpoint`, which loads
with ``weights_only=True`` explicitly and fails with :class:`UnsafeCheckpointError` (naming
the globals at fault), or :class:`UnreadableCheckpointError` for a file that is no
checkpoint at all. It also replaces mmengine's loader of URLs (``http(s)://``, and the
``torchvision://``, ``open-mmlab://`` and ``mmcls://`` names that resolve to URLs), which
downloads through ``torch.hub.load_state_dict_from_url`` and so unpickles with
``weights_only=False``: :func:`load_url_checkpoint` downloads to the same cache and loads the
file with :func:`load_local_checkpoint`. ``--resume``, ``load_from``, every tool and
``Pretrained`` init (mmseg's configs name their pretrained backbones by URL) go through them;
no file is unpickled with ``weights_only=False``.

:func:`check_state_dict` is the one report of a checkpoint that does not fit a model
(missing, unexpected and mis-shaped keys), used by :func:`load_checkpoint`, the
checkpoint hook and the MiTA backbone's ``Pretrained`` check.
"""
import importlib
import os
import os.path as osp
import pickle
import re
import zipfile
from urllib.parse import urlparse
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.nn as nn
from mmengine.runner.checkpoint import CheckpointLoader

__all__ = [
    'UnsafeCheckpointError', 'UnreadableCheckpointError', 'CheckpointMismatchError',
    'mmengine_safe_globals', 'register_safe_globals', 'load_local_checkpoint',
    'load_url_checkpoint', 'check_state_dict', 'check_checkpoint_keys', 'load_checkpoint'
]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds Python objects outside the weights-only allow-list."""


class UnreadableCheckpointError(ValueError):
    """A file is not a readable checkpoint (random bytes, text, a truncated file)."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's ``state_dict`` does not fit the model (the message lists the keys)."""


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
        FileNotFoundError: ``filename`` does not exist (IsADirectoryError: it is a folder).
        UnsafeCheckpointError: the file holds objects outside the allow-list.
        UnreadableCheckpointError: the file is not a checkpoint torch can read.
    """
    filename = osp.expanduser(filename)
    if osp.isdir(filename):
        raise IsADirectoryError(f'checkpoint {filename} is a directory: give a checkpoint '
                                'file (.pth)')
    if not osp.isfile(filename):
        raise FileNotFoundError(f'checkpoint {filename} does not exist')
    try:
        return torch.load(filename, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001  (classified below, always re-raised)
        unsafe = _unsafe_globals(filename, e)
        if unsafe is None:
            size = osp.getsize(filename)
            with open(filename, 'rb') as f:
                head = f.read(2)
            what = ('an empty file' if size == 0 else 'a damaged or truncated zip archive'
                    if head == b'PK' else 'neither a torch zip archive nor a pickle')
            raise UnreadableCheckpointError(
                f'{filename} is not a readable checkpoint ({what}, {size} bytes). Give a .pth '
                'file saved by torch.save (an mmseg/mmengine checkpoint); a download may be '
                'incomplete.') from e
        raise UnsafeCheckpointError(
            f'refusing to load checkpoint {filename}: it holds Python objects outside the '
            f'weights-only allow-list: {", ".join(unsafe)}. Checkpoints of mmengine runs only '
            'need tensors, numpy values and HistoryBuffer (mita_seg.utils.checkpoint). If you '
            'trust this file and know what these objects are, allow them with '
            'torch.serialization.add_safe_globals([...]) before loading. '
            f'torch said: {e}') from e


def _unsafe_globals(filename: str, error: Exception) -> Optional[List[str]]:
    """The globals outside the allow-list that made a weights-only load fail, or None if
    the file is not a readable checkpoint."""
    if zipfile.is_zipfile(filename):  # torch's format since 1.6
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(filename)
        except Exception:  # noqa: BLE001  a damaged archive
            return None
        allowed = {g[1] if isinstance(g, tuple) else f'{g.__module__}.{g.__qualname__}'
                   for g in torch.serialization.get_safe_globals()}
        # all globals allowed, yet the load failed: a refused call (e.g. getattr)
        return [g for g in found if g not in allowed] or ['(see the error below)']
    # legacy (pre-1.6) pickles: torch names the global it refused
    found = re.findall(r'Unsupported global: GLOBAL ([\w.]+)', str(error))
    return found or None


def check_state_dict(expected: Dict[str, Any],
                     state_dict: Dict[str, Any],
                     source: str = '',
                     target: str = 'the model',
                     skip: Optional[Callable[[str, str], bool]] = None,
                     same_shape: Optional[Callable[[str, tuple, tuple], bool]] = None,
                     hint: Optional[str] = None) -> List[str]:
    """Check that ``state_dict`` fits ``expected`` exactly, as ``strict=True`` would.

    Args:
        expected (dict): the model's state dict (keys and tensors).
        state_dict (dict): the checkpoint's.
        source (str): where the checkpoint comes from, for the message. Default: ''.
        target (str): what it is loaded into, for the message. Default: 'the model'.
        skip (Callable, optional): ``skip(kind, key)`` with ``kind`` ``'missing'`` or
            ``'unexpected'``: True for keys that may legitimately differ. Default: None.
        same_shape (Callable, optional): ``same_shape(key, model_shape, ckpt_shape)``;
            default: equal shapes.
        hint (str, optional): the last line of the message, what to do. Default: use the
            right config or convert the checkpoint.

    Returns:
        list[str]: the keys skipped by ``skip``.

    Raises:
        CheckpointMismatchError: keys are missing, unexpected, or of another shape; the
            message counts them and names them in groups (:func:`group_keys`: keys that
            differ only in layer indices or in their last name), on lines of at most
            about 100 characters.
    """
    skip = skip or (lambda kind, key: False)
    same_shape = same_shape or (lambda key, want, got: want == got)
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    skipped = [k for k in missing if skip('missing', k)]
    skipped += [k for k in unexpected if skip('unexpected', k)]
    missing = [k for k in missing if k not in skipped]
    unexpected = [k for k in unexpected if k not in skipped]
    shapes: Dict[tuple, List[str]] = {}     # (checkpoint's, model's) -> keys
    for k in sorted(expected.keys() & state_dict.keys()):
        want, got = (tuple(getattr(d[k], 'shape', ())) for d in (expected, state_dict))
        if not same_shape(k, want, got):
            shapes.setdefault((got, want), []).append(k)
    if missing or unexpected or shapes:
        lines = [f'checkpoint {source} does not fit {target}:']
        mismatched = [f'{g}: checkpoint {got} vs model {want}'
                      for (got, want), keys in shapes.items() for g in group_keys(keys)]
        for title, count, groups in (
                ('missing keys', len(missing), group_keys(missing)),
                ('unexpected keys', len(unexpected), group_keys(unexpected)),
                ('shape mismatch', sum(map(len, shapes.values())), mismatched)):
            if groups:
                lines += _wrap(f'{title} ({count}): ', groups)
        if any('relative_position_bias_table' in k and got[-1:] == want[-1:]  # other grid
               for (got, want), keys in shapes.items() for k in keys):
            lines.append(
                '  BEiT/MAE: the relative position bias table was built for another patch '
                'grid (the backbone\'s img_size / patch_size). Set img_size to the crop the '
                "checkpoint was trained at and evaluate with test_cfg mode='slide' at that "
                'crop. Backbone weights (a pretrained BEiT/MAE) can instead be loaded through '
                "the backbone's init_cfg=dict(type='Pretrained', checkpoint=...), where "
                "mmseg's BEiT.resize_rel_pos_embed interpolates the table (square grids).")
        lines.append(hint or '  Use the config this checkpoint was trained with, or convert '
                     'the checkpoint.')
        raise CheckpointMismatchError('\n'.join(lines))
    return skipped


# ------------------------------------------------------------------------ key reports
_MAX_GROUPS = 12      # groups named per kind; the count says how many keys there are


def group_keys(keys: List[str]) -> List[str]:
    """``keys`` in groups, each an exact pattern: indices that vary as ``{0..11}`` (a
    run) or ``{0,2,5}``, last names that vary as ``{weight,bias}``; e.g. the 24 keys
    ``backbone.layers.{0..11}.attn.attn.{in_proj_bias,in_proj_weight}``. Every key is in
    exactly one group and every expansion of a group is a key (:func:`expand_group`)."""
    by_shape: Dict[tuple, List[List[str]]] = {}
    for key in keys:
        parts = key.split('.')
        shape = tuple('#' if p.isdigit() else p for p in parts)
        by_shape.setdefault(shape, []).append(parts)
    groups = []
    for shape, members in by_shape.items():
        groups += _index_groups(shape, members)
    # the same indices, the last name differing: one group
    merged: Dict[str, List[str]] = {}
    out = []
    for g in groups:
        parts = _parts(g)
        if len(parts) > 1 and not parts[-1].startswith('{'):
            merged.setdefault('.'.join(parts[:-1]), []).append(parts[-1])
        else:
            out.append(g)
    out += [f'{head}.{lasts[0]}' if len(lasts) == 1 else f'{head}.{{{",".join(sorted(lasts))}}}'
            for head, lasts in merged.items()]
    return sorted(out, key=lambda g: _sort_key(expand_group(g)[0]))


def _index_groups(shape: tuple, members: List[List[str]]) -> List[str]:
    """Keys of one shape (``'#'`` where an index is) as index patterns: one pattern if the
    keys are every combination of the indices seen at each place, else split on the
    first place that varies."""
    places = [i for i, p in enumerate(shape) if p == '#']
    values = [sorted({int(m[i]) for m in members}) for i in places]
    combos = 1
    for v in values:
        combos *= len(v)
    if combos == len(members):
        parts = list(shape)
        for i, v in zip(places, values):
            parts[i] = _indices(v)
        return ['.'.join(parts)]
    first = next(i for i, v in zip(places, values) if len(v) > 1)
    rest: Dict[str, List[int]] = {}   # pattern of the other places -> values at ``first``
    mark = f'\0{first}\0'                # stands for them in the patterns
    for value in sorted({int(m[first]) for m in members}):
        sub = [m for m in members if int(m[first]) == value]
        fixed = tuple(mark if i == first else p for i, p in enumerate(shape))
        for pattern in _index_groups(fixed, sub):
            rest.setdefault(pattern, []).append(value)
    return [pattern.replace(mark, _indices(v)) for pattern, v in rest.items()]


def _indices(values: List[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    if values == list(range(values[0], values[-1] + 1)):
        return f'{{{values[0]}..{values[-1]}}}'
    return '{' + ','.join(map(str, values)) + '}'


def expand_group(group: str) -> List[str]:
    """The keys a :func:`group_keys` pattern stands for."""
    keys = ['']
    for part in _parts(group):
        if part.startswith('{') and part.endswith('}'):
            inner = part[1:-1]
            if '..' in inner:
                low, high = inner.split('..')
                options = [str(i) for i in range(int(low), int(high) + 1)]
            else:
                options = inner.split(',')
        else:
            options = [part]
        keys = [f'{k}.{o}' if k else o for k in keys for o in options]
    return keys


def _parts(group: str) -> List[str]:
    """``group`` split at the dots outside braces."""
    return re.split(r'\.(?![^{]*\})', group)


def _sort_key(key: str) -> tuple:
    return tuple((0, int(p), '') if p.isdigit() else (1, 0, p) for p in key.split('.'))


def _wrap(first: str, groups: List[str], width: int = 100) -> List[str]:
    """``first`` then the groups, comma-separated, on indented lines of at most ``width``
    characters (a longer group stands alone on its line); past :data:`_MAX_GROUPS`
    groups, how many more."""
    shown = groups[:_MAX_GROUPS]
    items = [g + ',' for g in shown[:-1]] + shown[-1:]
    if len(groups) > len(shown):
        items[-1] += ','
        items.append(f'... and {len(groups) - len(shown)} more groups')
    lines, line = [], '  ' + first
    for item in items:
        if line.strip() and len(line) + 1 + len(item) > width and not line.endswith(': '):
            lines.append(line)
            line = '    ' + item
        else:
            line += ('' if line.endswith(': ') else ' ') + item
    return lines + [line]


def _model_and_state(model: nn.Module, checkpoint: Any, source: str):
    """The module mmengine loads into (a wrapper's or TTA model's ``module``) and the
    checkpoint's state dict as mmengine loads it (``state_dict`` entry, ``module.``
    prefix removed)."""
    from mmengine.model import BaseTTAModel, is_model_wrapper
    if is_model_wrapper(model) or isinstance(model, BaseTTAModel):
        model = model.module
    state = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise CheckpointMismatchError(
            f'checkpoint {source} holds no state_dict (a dict of tensors): it is not a '
            'model checkpoint')
    return model, {re.sub(r'^module\.', '', k): v for k, v in state.items()}


def check_checkpoint_keys(model: nn.Module, checkpoint: Any, source: str = '',
                          hint: Optional[str] = None) -> None:
    """Check that a loaded checkpoint fits ``model`` exactly (:func:`check_state_dict`).

    Args:
        model (nn.Module): the model (a wrapper's or a test-time-augmentation model's
            ``module`` is used, as mmengine loads into it).
        checkpoint (dict): the loaded checkpoint.
        source (str): where the checkpoint comes from, for the message. Default: ''.
        hint (str, optional): what to do, the last line of the message.

    Raises:
        CheckpointMismatchError: see :func:`check_state_dict`.
    """
    model, state = _model_and_state(model, checkpoint, source)
    check_state_dict(model.state_dict(), state, source, type(model).__name__, hint=hint)


def load_checkpoint(model: nn.Module, filename: str, map_location: str = 'cpu',
                    adapt: Optional[Callable[[dict], dict]] = None) -> dict:
    """Load a checkpoint into ``model`` strictly and weights-only.

    Args:
        model (nn.Module): the model; its weights are replaced by the checkpoint's.
        filename (str): a local checkpoint (mmengine's format or a bare state dict).
        map_location (str): where tensors are loaded. Default: 'cpu'.
        adapt (Callable, optional): applied to the state dict before the strict check, to
            fit weights to a model built for another input size (e.g. BEiT's position
            tables interpolated); the result must fit the model exactly. Default: None.

    Returns:
        dict: the checkpoint (``meta`` and the like); ``{'state_dict': ...}`` for a bare
        state dict.

    Raises:
        FileNotFoundError, UnreadableCheckpointError, UnsafeCheckpointError: see
            :func:`load_local_checkpoint`.
        CheckpointMismatchError: the weights do not fit ``model`` (nothing is loaded).
    """
    checkpoint = load_local_checkpoint(filename, map_location=map_location)
    model, state = _model_and_state(model, checkpoint, filename)
    if adapt is not None:
        state = adapt(state)
    check_state_dict(model.state_dict(), state, filename, type(model).__name__)
    model.load_state_dict(state, strict=True)
    return checkpoint if 'state_dict' in checkpoint else dict(state_dict=checkpoint)


_REGISTERED = False


def register_safe_globals() -> None:
    """Allow mmengine's checkpoint globals in torch's weights-only loads and make
    mmengine load local files through :func:`load_local_checkpoint` and URLs through
    :func:`load_url_checkpoint` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from mmengine.runner import checkpoint as mmengine_checkpoint
    torch.serialization.add_safe_globals(mmengine_safe_globals())
    # '' is the prefix of local paths in mmengine's CheckpointLoader
    CheckpointLoader.register_scheme(prefixes='', loader=load_from_local_weights_only, force=True)
    CheckpointLoader.register_scheme(prefixes=('http://', 'https://'),
                                     loader=load_from_http_weights_only, force=True)
    # mmengine's torchvision://, open-mmlab:// and mmcls:// loaders call load_from_http by
    # its module-level name, not through the schemes
    mmengine_checkpoint.load_from_http = load_from_http_weights_only
    _REGISTERED = True


def load_from_local_weights_only(filename: str, map_location=None, logger=None) -> Any:
    """mmengine ``CheckpointLoader`` scheme for local paths (named ``load_from_...`` as
    mmengine's loaders: its log names the scheme by what follows, "local_weights_only")."""
    return load_local_checkpoint(filename, map_location=map_location)


def load_url_checkpoint(url: str, map_location: Optional[Union[str, Callable]] = None,
                        model_dir: Optional[str] = None, progress: bool = False) -> Any:
    """Download a checkpoint once and load it with :func:`load_local_checkpoint`.

    The file is cached where mmengine's loader (``torch.hub.load_state_dict_from_url``)
    caches it, ``<torch.hub.get_dir()>/checkpoints/<the URL's file name>``, so a checkpoint
    downloaded before is not downloaded again; ``torch.hub.download_url_to_file`` writes it
    whole (a temporary file, then renamed).

    Args:
        url (str): the checkpoint's ``http://`` or ``https://`` URL.
        map_location (str | Callable, optional): as in :func:`torch.load`. Default: None.
        model_dir (str, optional): the cache folder. Default: torch.hub's.
        progress (bool): show a progress bar while downloading. Default: False.

    Raises:
        UnsafeCheckpointError, UnreadableCheckpointError: see :func:`load_local_checkpoint`
            (the message names the cached file, to delete for a fresh download).
    """
    model_dir = model_dir or osp.join(torch.hub.get_dir(), 'checkpoints')
    cached = osp.join(model_dir, osp.basename(urlparse(url).path))
    if not osp.isfile(cached):
        os.makedirs(model_dir, exist_ok=True)
        torch.hub.download_url_to_file(url, cached, None, progress=progress)
    return load_local_checkpoint(cached, map_location=map_location)


def load_from_http_weights_only(filename: str, map_location=None, model_dir=None,
                                progress: Optional[bool] = None) -> Any:
    """mmengine's ``load_from_http`` (the ``http(s)://`` scheme, and what its model-zoo
    schemes call), weights-only: rank 0 downloads first, the other ranks after a barrier
    (from the cache then), as mmengine's does."""
    from mmengine.dist import get_dist_info
    rank, world_size = get_dist_info()
    if progress is None:   # as mmengine: a progress bar on a terminal
        progress = os.isatty(0)
    if rank == 0:
        checkpoint = load_url_checkpoint(filename, map_location, model_dir, progress)
    if world_size > 1:
        torch.distributed.barrier()
        if rank > 0:
            checkpoint = load_url_checkpoint(filename, map_location, model_dir, progress)
    return checkpoint
