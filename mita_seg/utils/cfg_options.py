"""``--cfg-options`` remembered on the config they were merged into, so that a part of the
config that cannot be built with them is one error naming the option, not a traceback from
deep inside the stack.

:func:`merge_cfg_options` merges the options (as ``Config.merge_from_dict``) and remembers
each with the value it replaced (kept on the ``Config`` object, outside its contents: a
dumped config does not show it; copies and deep copies keep it). Code that builds a part of
a config (the model, a dataloader, an optimizer) does so inside
:func:`blame_cfg_options`: a ``TypeError``, ``ValueError``, ``KeyError``, ``IndexError``,
``AssertionError`` or ``RuntimeError`` raised by the stack while building that part,
from a config whose options changed that part, becomes a :class:`CfgOptionsError` naming
the option, the value the config had, and the stack's own message (its first line). What
the user did not change is not blamed on them: an error with no option in the part being
built, or an error class of ``mita_seg`` (deliberate, already saying what to do), passes
through unchanged.

The option is found by what the error says: a keyword argument the class does not take
(``embed_dim`` for ``embed_dims``: a misspelt key, and the key it was probably meant to be),
a key or value named in the message (``batch_size=-1``), a number replaced by a word
(``embed_dims=abc``), a key the config did not have; else every option of that part.
"""
import contextlib
import difflib
import re
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from .errors import InputError

__all__ = ['CfgOptionsError', 'merge_cfg_options', 'cfg_options_of', 'blame_cfg_options',
           'cfg_options_error', 'add_custom_imports']

# Where the merged options are kept on a Config object (not in its contents).
_ATTR = '_mita_cfg_options'
# The error classes building from a bad value raises (torch, mmengine, mmcv, mmseg).
BLAMED = (TypeError, ValueError, KeyError, IndexError, AssertionError, RuntimeError)


class _Missing:
    """No value: the key was not in the config (one object, kept by copies)."""

    def __repr__(self) -> str:
        return '<not in the config>'

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return 'MISSING'


MISSING = _Missing()


class CfgOptionsError(InputError):
    """A part of a config cannot be built with a ``--cfg-options`` value; the message names
    the option, the value the config had, and what the stack said."""


def _lookup(cfg, key: str) -> Any:
    """The value at the dotted ``key`` of ``cfg`` (``a.0.b`` indexes a list), or
    :data:`MISSING`."""
    node = cfg
    for part in key.split('.'):
        if isinstance(node, (list, tuple)) and part.lstrip('-').isdigit():
            index = int(part)
            if not -len(node) <= index < len(node):
                return MISSING
            node = node[index]
        elif hasattr(node, 'keys') and part in node:
            node = node[part]
        else:
            return MISSING
    return node


def merge_cfg_options(cfg, options: Optional[dict]):
    """Merge ``options`` (``--cfg-options``, dotted keys) into ``cfg`` in place, as
    ``Config.merge_from_dict`` does, remembering each with the value it replaced
    (:func:`cfg_options_of`).

    Returns:
        Config: ``cfg``.
    """
    if not options:
        return cfg
    recorded = dict(cfg_options_of(cfg))
    before = {key: _lookup(cfg, key) for key in options}
    cfg.merge_from_dict(options)
    for key, value in options.items():
        first = recorded[key][1] if key in recorded else before[key]
        recorded[key] = (value, first)
    object.__setattr__(cfg, _ATTR, recorded)   # Config's own __setattr__ writes its contents
    return cfg


def cfg_options_of(cfg) -> Dict[str, Tuple[Any, Any]]:
    """``key -> (value given, value the config had, or MISSING)`` of the options merged into
    ``cfg`` by :func:`merge_cfg_options`; empty if none."""
    return dict(getattr(cfg, _ATTR, None) or {}) if cfg is not None else {}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _said(e: BaseException) -> str:
    """The first line of what ``e`` says (a KeyError's message without its quotes)."""
    text = e.args[0] if isinstance(e, KeyError) and e.args else e
    line = (str(text).strip().splitlines() or [''])[0].rstrip(':')
    return line if len(line) <= 200 else line[:197] + '...'


def _suspects(options: Dict[str, Tuple[Any, Any]], text: str) -> Tuple[list, bool]:
    """The options the error ``text`` points at, and whether it points at them (False:
    every option of the part, none named)."""
    last = {key: key.rsplit('.', 1)[-1] for key in options}
    kwarg = re.search(r"unexpected keyword argument '(\w+)'", text)
    if kwarg:
        named = [k for k in options if last[k] == kwarg.group(1)]
        if named:
            return named, True
    named = [k for k, (value, before) in options.items()
             if re.search(rf'(?<!\w){re.escape(last[k])}(?!\w)', text)
             or (isinstance(value, str) and len(value) > 1 and value in text)
             or (_is_number(before) and isinstance(value, str))]
    if named:
        return named, True
    new = [k for k, (_, before) in options.items() if before is MISSING]
    return (new, True) if new else (list(options), False)


def _had(cfg, key: str, value: Any, before: Any) -> str:
    """What the config had at ``key``: its value (and, for a word where it has a number,
    what to give), or that it has no such key (and the key of the same parent it probably
    meant)."""
    if before is not MISSING:
        give = ''
        if _is_number(before) and isinstance(value, str):
            give = ': give an int' if isinstance(before, int) else ': give a number'
        return f'the config has {key}={before!r}{give}'
    parent, _, name = key.rpartition('.')
    siblings = _lookup(cfg, parent) if parent else cfg
    keys = [k for k in siblings.keys() if k != name] if hasattr(siblings, 'keys') else []
    near = difflib.get_close_matches(name, keys, n=1)
    return f'the config has no {key}' + (f': did you mean {parent}.{near[0]}?' if near else '')


def cfg_options_error(cfg, e: BaseException, what: str,
                      sections: Sequence[str]) -> Optional[CfgOptionsError]:
    """The :class:`CfgOptionsError` that says which ``--cfg-options`` of ``cfg`` building
    ``what`` (the config's ``sections``, top-level keys) failed on with ``e``; None where no
    option of those sections was given, or ``e`` is not one a bad value raises (a
    ``mita_seg`` error says what to do already)."""
    if not isinstance(e, BLAMED) or type(e).__module__.split('.')[0] == 'mita_seg':
        return None
    options = {k: v for k, v in cfg_options_of(cfg).items() if k.split('.')[0] in sections}
    if not options:
        return None
    text = _said(e)
    keys, named = _suspects(options, text)
    given = ', '.join(f'{k}={options[k][0]!r}' for k in keys)
    which = 'it' if len(keys) == 1 else ('them' if named else 'one of them')
    said = f'{type(e).__name__}: {text}' if text else type(e).__name__
    msg = f'--cfg-options {given}: {what} cannot be built with {which} ({said})'
    if len(keys) == 1:
        msg += f'; {_had(cfg, keys[0], *options[keys[0]])}'
    return CfgOptionsError(msg)


def add_custom_imports(cfg, *modules: str):
    """Add ``modules`` to ``cfg``'s ``custom_imports`` (created if missing; its other keys,
    ``allow_failed_imports``, kept), in place, so that a config dumped by the Runner builds
    what it names (``SafeCheckpointHook``...) on its own.

    (Not ``cfg.setdefault('custom_imports', ...)['imports'] = ...``: on an mmengine
    ``Config`` without the key, ``setdefault`` stores a converted copy and returns the
    original, so the change is lost.)

    Returns:
        Config: ``cfg``.
    """
    custom = dict(cfg.get('custom_imports') or {})
    imports = custom.get('imports') or []
    imports = [imports] if isinstance(imports, str) else list(imports)   # mmengine takes both
    missing = [m for m in modules if m not in imports]
    if missing:   # a failed import an error, unless the config says otherwise
        cfg.custom_imports = dict({'allow_failed_imports': False, **custom},
                                  imports=imports + missing)
    return cfg


@contextlib.contextmanager
def blame_cfg_options(cfg, what: str, sections: Sequence[str]) -> Iterator[None]:
    """Build ``what`` (the config's ``sections``) inside: an error a bad ``--cfg-options``
    value raises there is a :class:`CfgOptionsError` naming the option
    (:func:`cfg_options_error`; the stack's error chained to it), any other error passes
    through unchanged.

    Args:
        cfg (Config): the config, options merged by :func:`merge_cfg_options`.
        what (str): what is built, for the message (``'the model'``).
        sections (Sequence[str]): the config's top-level keys it is built from.
    """
    try:
        yield
    except BLAMED as e:
        error = cfg_options_error(cfg, e, what, sections)
        if error is None:
            raise
        raise error from e
