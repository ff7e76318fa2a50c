"""The core of the tools' command line: the argument types, ``key=value`` options, and the
one ``error:`` line of a user error (:func:`run_tool`). Imports no torch and no mm stack,
so a tool parses its arguments, and refuses a bad one, before it imports what it runs.

- Arguments wrong on their own are refused while parsing, with one ``error: <message>``
  line and exit status 2, before anything is imported, built or loaded: the argument types
  below (:func:`input_file`, :func:`config_file`, :func:`checkpoint_file`,
  :func:`image_file`, :func:`output_file`, :func:`output_dir`, :func:`int_range`,
  :func:`float_range`, :func:`device_name`) and :class:`KeyValueAction` (``--cfg-options``;
  ``--mita-cfg`` builds on it), through the tool's :class:`ToolParser` (argparse's parser
  without the usage block). Each message names the argument, the value, and what to give
  instead.
- Errors a user fixes by changing the command line, the config or the checkpoint but that
  show only once a file is read or a model built (:func:`user_errors`: a config that does
  not parse, a file that is no image or no checkpoint, a checkpoint that does not fit, a
  ``--cfg-options`` value the model cannot be built with, a layer that does not exist...)
  end the tool through :func:`run_tool` with the same ``error: <message>`` line and exit
  status 1. Library code raises them without importing this module
  (:class:`~mita_seg.utils.errors.InputError` and the error classes of its modules).

Output paths are checked while parsing too (:func:`output_file`, :func:`output_dir`): a
folder where a file should be, a file where a folder should be, a place that cannot be
written (``/proc``, a read-only mount, no permission). Files are written after their
folders are made (:func:`ensure_parent`), and only once everything they hold has been
computed.
"""
import argparse
import math
import os
import os.path as osp
import re
import shlex
import sys
import tempfile
from typing import Callable, Optional, Sequence, Tuple

from mita_seg.utils.errors import InputError
from mita_seg.utils.stack_noise import is_stack_noise, quiet_stack

__all__ = [
    'InputError', 'user_errors', 'run_tool', 'ToolParser', 'print_error', 'input_file',
    'config_file', 'checkpoint_file', 'image_file', 'output_file', 'output_dir', 'int_range',
    'float_range', 'device_name', 'KeyValueAction', 'DeferredHelp', 'quiet_stack',
    'is_stack_noise', 'ensure_parent', 'python_command'
]

# What a user fixes by changing the command line, the config or the checkpoint, by module.
# Named rather than imported, so that this module loads no stack: an exception of a module
# that is not imported yet cannot have been raised.
_USER_ERRORS = {
    'builtins': ('FileNotFoundError', 'IsADirectoryError', 'NotADirectoryError',
                 'PermissionError'),
    'mita_seg.utils.errors': ('InputError', ),   # CfgOptionsError too
    'mita_seg.utils.checkpoint': ('UnreadableCheckpointError', 'UnsafeCheckpointError',
                                  'CheckpointMismatchError'),
    'mita_seg.models': ('NothingToSwapError', 'GridMismatchError', 'MiTASettingError',
                        'NothingToMergeError', 'PlanError'),
    'mita_seg.ops.onnx': ('OnnxExportError', ),
    'mita_seg.setting': ('MiTASettingError', ),
}


def user_errors() -> Tuple[type, ...]:
    """The exception classes :func:`run_tool` reports in one line: missing or unreadable
    files, :class:`InputError` (a bad ``--cfg-options`` value too), unreadable, unsafe or
    non-fitting checkpoints, nothing to swap or merge, a layer that does not exist, a
    BEiT/MAE run at a grid its bias tables do not fit, a bad MiTA setting or swap plan, an
    ONNX export that fails its check; of the modules imported so far."""
    found = []
    for module, names in _USER_ERRORS.items():
        module = sys.modules.get(module)
        found += [getattr(module, n) for n in names if hasattr(module, n)]
    return tuple(found)


def print_error(message: str) -> None:
    """Print the one shape of every tool error: ``error: <message>`` on stderr."""
    print(f'error: {message}', file=sys.stderr, flush=True)


def run_tool(main: Callable[[], object]) -> None:
    """Run a tool's ``main()``; a user error (:func:`user_errors`) prints
    ``error: <message>`` and exits with status 1."""
    try:
        main()
    except Exception as e:      # re-raised unless it is a user error
        if not isinstance(e, user_errors()):
            raise
        msg = str(e)
        if isinstance(e, OSError) and e.filename is not None and e.strerror:
            msg = f'{e.filename}: {e.strerror}'     # not "[Errno 21] Is a directory: 'x'"
        print_error(msg)
        sys.exit(1)


# argparse's "argument NAME: " before a message that starts with NAME itself
_NAMED_TWICE = re.compile(r'^argument (\S+): (?=\1[ :])')


class ToolParser(argparse.ArgumentParser):
    """argparse's parser whose errors have the one shape of every tool error: a usage
    error (an argument wrong on its own, a missing or unknown one, a bad combination) prints
    ``error: <message>`` on stderr, no usage block, and exits with status 2 (``--help``
    shows the usage); argparse's ``argument --out: --out 'x' ...`` names the argument once.
    Every tool builds its parser from this class."""

    def error(self, message: str):
        print_error(_NAMED_TWICE.sub('', message))
        self.exit(2)


# --------------------------------------------------------------------------- paths in
def _is_url(path: str) -> bool:
    return '://' in path


def _check_input(path: str, kind: str, suffixes: Sequence[str]) -> str:
    """``path`` if it is a readable, non-empty file (of one of ``suffixes``), else an
    ``ArgumentTypeError`` naming it, what is wrong and what ``kind`` of file to give."""
    give = f'give {"an" if kind[0] in "aeiou" else "a"} {kind} file' + (
        f' ({"/".join(suffixes)})' if suffixes else '')
    if not osp.exists(path):
        why = 'does not exist'
        parent = osp.dirname(osp.abspath(path))
        if not osp.isdir(parent):
            why += f' (no folder {osp.dirname(path) or parent})'
        raise argparse.ArgumentTypeError(f'{kind} {path!r} {why}: {give}')
    if osp.isdir(path):
        raise argparse.ArgumentTypeError(f'{kind} {path!r} is a directory: {give}')
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f'{kind} {path!r} is not readable (permissions)')
    if osp.getsize(path) == 0:
        raise argparse.ArgumentTypeError(f'{kind} {path!r} is empty: {give}')
    if suffixes and not path.lower().endswith(tuple(suffixes)):
        raise argparse.ArgumentTypeError(f'{kind} {path!r} is not a {kind} file: {give}')
    return path


def input_file(kind: str, suffixes: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse ``type``: an existing, readable, non-empty file, not a directory,
    optionally ending with one of ``suffixes``.

    Args:
        kind (str): what the file is, for the messages (``'checkpoint'``).
        suffixes (Sequence[str]): accepted endings, e.g. ``('.py', '.json')``; empty: any.
    """
    def check(path: str) -> str:
        return _check_input(path, kind, suffixes)
    check.__name__ = kind        # argparse's "invalid <name> value" if anything else raises
    return check


CONFIG_SUFFIXES = ('.py', '.json', '.yaml', '.yml')


def config_file(path: str) -> str:
    """An argparse ``type``: a config file (``.py``/``.json``/``.yaml``/``.yml``) or an
    ``mmseg::<dir>/<name>.py`` config of the installed mmsegmentation (checked when
    loaded, :func:`~mita_seg.apis.load_config`)."""
    if '::' in path:
        return path
    try:
        return _check_input(path, 'config', CONFIG_SUFFIXES)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(
            f"{e}, or 'mmseg::<dir>/<config>.py' (a config of the mmsegmentation "
            'package)') from None


def checkpoint_file(path: str) -> str:
    """An argparse ``type``: a local checkpoint file (any name; its content is checked when
    loaded), or a URL (``https://...``) mmengine downloads."""
    return path if _is_url(path) else _check_input(path, 'checkpoint', ())


IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff', '.webp', '.ppm', '.pgm')


def image_file(path: str) -> str:
    """An argparse ``type``: an image file OpenCV decodes (what mmseg's pipelines read)."""
    _check_input(path, 'image', ())
    import cv2
    if cv2.imread(path, cv2.IMREAD_UNCHANGED) is None:
        raise argparse.ArgumentTypeError(
            f'image {path!r} is not an image OpenCV can read ({osp.getsize(path)} bytes): '
            f'give a {"/".join(IMAGE_SUFFIXES[:5])}... file')
    return path


# -------------------------------------------------------------------------- paths out
def _existing_file_above(path: str) -> Optional[str]:
    """The first existing non-directory among the folders above ``path``, if any."""
    parent = osp.dirname(osp.abspath(path))
    while parent and not osp.exists(parent):
        parent = osp.dirname(parent)
    return parent if parent and not osp.isdir(parent) else None


def _cannot_write(folder: str) -> Optional[str]:
    """Why no file can be written in ``folder`` (made if missing), or None if one can: the
    nearest existing folder at or above it is tried with a file created and removed at
    once (permission bits alone do not tell: root may write anywhere but ``/proc``)."""
    existing = osp.abspath(folder)
    while not osp.exists(existing):
        existing = osp.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        return f'cannot create a file in {existing} (permissions)'
    try:
        fd, probe = tempfile.mkstemp(prefix='.write-check-', dir=existing)
    except OSError as e:
        return f'cannot create a file in {existing} ({e.strerror or e})'
    os.close(fd)
    os.unlink(probe)
    return None


def _refuse_unwritable(kind: str, path: str, folder: str) -> None:
    why = _cannot_write(folder)
    if why:
        raise argparse.ArgumentTypeError(
            f'{kind} {path!r}: {why}: give a path in a folder you can write to')


def output_file(kind: str = 'output', suffixes: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse ``type``: a file to write (its folders are made when it is written,
    :func:`ensure_parent`): not a directory, no file where a folder of it should be, in a
    place that can be written (its folder, or the nearest existing one above it; an
    existing file writable), optionally ending with one of ``suffixes``.

    Args:
        kind (str): what the file is, for the messages (``'--json file'``).
        suffixes (Sequence[str]): accepted endings, e.g. ``('.png',)``; empty: any.
    """
    def check(path: str) -> str:
        if path.endswith(('/', os.sep)) or osp.isdir(path):
            raise argparse.ArgumentTypeError(
                f'{kind} {path!r} is a directory: give a file name, e.g. '
                f'{osp.join(path, "out" + (suffixes[0] if suffixes else ""))}')
        blocker = _existing_file_above(path)
        if blocker:
            raise argparse.ArgumentTypeError(
                f'{kind} {path!r}: {blocker} is a file, not a folder')
        if suffixes and not path.lower().endswith(tuple(suffixes)):
            raise argparse.ArgumentTypeError(
                f'{kind} {path!r} must end with {" or ".join(suffixes)}')
        if osp.exists(path) and not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(
                f'{kind} {path!r} exists and is not writable (permissions)')
        _refuse_unwritable(kind, path, osp.dirname(osp.abspath(path)))
        return path
    check.__name__ = kind
    return check


def output_dir(kind: str = 'output folder', if_missing: bool = False) -> Callable[[str], str]:
    """An argparse ``type``: a folder to write into (made when written): not an existing
    file, no file where a folder above it should be, in a place that can be written.

    Args:
        kind (str): what the folder is, for the messages (``'--work-dir'``).
        if_missing (bool): the folder is read if it exists and written only if it does not
            (a dataset made when missing): an existing one need not be writable.
    """
    def check(path: str) -> str:
        if osp.exists(path) and not osp.isdir(path):
            raise argparse.ArgumentTypeError(
                f'{kind} {path!r} is a file, not a folder: give a folder (made if missing)')
        blocker = _existing_file_above(path)
        if blocker:
            raise argparse.ArgumentTypeError(
                f'{kind} {path!r}: {blocker} is a file, not a folder')
        if not (if_missing and osp.isdir(path)):
            _refuse_unwritable(kind, path, path)
        return path
    check.__name__ = kind
    return check


def ensure_parent(path: str) -> str:
    """Make the folders above the file ``path``; returns ``path``."""
    parent = osp.dirname(osp.abspath(path))
    os.makedirs(parent, exist_ok=True)
    return path


# ---------------------------------------------------------------------------- numbers
def _number_range(cast: type, name: str, low=None, high=None, low_open: bool = False):
    def bounds() -> str:
        parts = []
        if low is not None:
            parts.append(f'{">" if low_open else ">="} {low}')
        if high is not None:
            parts.append(f'<= {high}')
        return ' and '.join(parts)

    def check(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f'{text!r} is not {"an int" if cast is int else "a number"}'
                + (f' ({bounds()})' if bounds() else '')) from None
        if value != value or (low is not None and (value < low or (low_open and value == low))) \
                or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f'{text!r}: must be {bounds()}')
        if cast is float and math.isinf(value):   # 'inf', '1e400': no count or time is that
            raise argparse.ArgumentTypeError(
                f'{text!r}: must be {bounds() + " and " if bounds() else ""}finite')
        return value
    check.__name__ = name
    return check


def int_range(low: Optional[int] = None, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[low, high]`` (a bound None is open);
    ``int_range(1)`` is a positive int."""
    return _number_range(int, 'int', low, high)


def float_range(low: Optional[float] = None, high: Optional[float] = None,
                low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``[low, high]`` (``(low, high]`` with
    ``low_open``; a bound None is open)."""
    return _number_range(float, 'float', low, high, low_open)


def device_name(text: str) -> str:
    """An argparse ``type``: a torch device this machine has (``cpu``, ``cuda``,
    ``cuda:1``)."""
    import torch
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f'{text!r} is not a device: give cpu, cuda or '
                                         'cuda:N') from None
    if device.type == 'cuda':
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count or not count:
            raise argparse.ArgumentTypeError(
                f'{text!r}: torch sees {count} CUDA device(s) (torch {torch.__version__}, '
                f'built for CUDA {torch.version.cuda}); give cpu')
    elif device.type not in ('cpu', 'meta'):
        raise argparse.ArgumentTypeError(f'{text!r}: give cpu, cuda or cuda:N')
    return text


# -------------------------------------------------------------------------- key=value
class KeyValueAction(argparse.Action):
    """mmengine's ``DictAction`` (``key=value`` pairs; values parsed as it does: ints,
    floats, ``True``/``False``/``None``, ``a,b`` and ``[a,b]`` lists; what
    ``--cfg-options`` takes) whose malformed item (no ``=``, no key) is a usage error naming
    it, not a traceback. mmengine is imported only once such an option is given."""

    example = 'train_cfg.max_iters=60'

    def __call__(self, parser, namespace, values, option_string=None):
        for kv in values:
            key, sep, _ = kv.partition('=')
            if not sep or not key:
                parser.error(f'{option_string}: {kv!r} is not KEY=VALUE (e.g. '
                             f'{self.example})')
        from mmengine.config import DictAction
        DictAction(self.option_strings, self.dest, nargs=self.nargs)(
            parser, namespace, values, option_string)


class DeferredHelp(str):
    """An argparse ``help`` text made only when help is printed (``make()``), so that a
    parser whose help quotes the stack's values (the MiTA defaults) is built without
    importing the stack. argparse expands a help text with ``%`` (and
    ``ArgumentDefaultsHelpFormatter`` appends to it first): both defer to ``make()``."""

    def __new__(cls, make: Callable[[], str]):
        self = super().__new__(cls, '(made when help is printed)')
        self.make = make
        return self

    def __add__(self, more: str) -> 'DeferredHelp':
        return DeferredHelp(lambda: self.make() + more)

    def __mod__(self, params) -> str:
        return self.make() % params


# ---------------------------------------------------------------------------- printing
def python_command(script: str, *args: str) -> str:
    """The command line that runs ``script`` (a path) with ``args`` with the interpreter
    running now (so a venv's ``.venv/bin/python`` is printed as such), paths relative to
    the working directory where they are inside it."""
    def rel(path: str) -> str:
        full = osp.abspath(path)
        inside = full.startswith(osp.abspath(os.getcwd()) + os.sep)
        return osp.relpath(full) if inside else path
    return ' '.join(shlex.quote(p) for p in (rel(sys.executable), rel(script), *args))
