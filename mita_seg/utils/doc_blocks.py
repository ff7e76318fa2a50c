"""Tables in the docs generated from committed data: a doc holds each generated block between
two marker comments::

    <!-- PREFIX:NAME:begin -->
    ... (written by a generator: edit its code or data, not the text) ...
    <!-- PREFIX:NAME:end -->

and everything outside them is prose, written by hand. A :class:`DocBlocks` is one generator:
its marker prefix (``study-docs``, ``bench-docs``: generators do not see each other's blocks),
the line that opens each block, the blocks it knows and which docs must hold which.
:meth:`DocBlocks.stale` says which docs differ from what :meth:`DocBlocks.write` would write
(the tests that keep the docs in step)."""
import os.path as osp
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from .errors import InputError

__all__ = ['DocBlocks', 'render']

Blocks = Dict[str, Callable[[], List[str]]]


def _marker(prefix: str) -> 're.Pattern':
    return re.compile(rf'(<!-- {re.escape(prefix)}:([a-z0-9-]+):begin -->\n)(.*?)'
                      rf'(<!-- {re.escape(prefix)}:\2:end -->)', re.S)


def render(text: str, path: str, known: Blocks, required: Sequence[str], prefix: str,
           opening: str) -> str:
    """``text`` with every block marked ``prefix`` rewritten: the ``opening`` line, then
    the lines of ``known[name]()``.

    Args:
        text (str): the doc as it is.
        path (str): its path, for the errors.
        known (dict[str, Callable[[], list[str]]]): the blocks, by name.
        required (Sequence[str]): the blocks the doc must hold.
        prefix (str): the markers' prefix (``study-docs``); others' markers are left as
            they are.
        opening (str): the first line of every block.

    Returns:
        str: the doc as generated.

    Raises:
        InputError: a marker names no block, a block is marked twice, or a required block
            has no markers.
    """
    seen: List[str] = []

    def fill(m: 're.Match') -> str:
        name = m.group(2)
        if name not in known:
            raise InputError(f'{path}: marker {prefix}:{name} names no block; give one of '
                             f"{', '.join(sorted(known))}")
        if name in seen:
            raise InputError(f'{path}: block {name} is marked twice; keep one')
        seen.append(name)
        body = re.sub(r'\n{3,}', '\n\n', '\n'.join([opening, ''] + known[name]()))
        return m.group(1) + body.strip('\n') + '\n' + m.group(4)

    out = _marker(prefix).sub(fill, text)
    missing = [n for n in required if n not in seen]
    if missing:
        raise InputError(f"{path}: no markers for block(s) {', '.join(missing)}: put "
                         f'<!-- {prefix}:NAME:begin --> and <!-- {prefix}:NAME:end --> '
                         'where each table goes')
    return out


@dataclass(frozen=True)
class DocBlocks:
    """One generator of doc blocks.

    Args:
        prefix (str): its markers' prefix.
        opening (str): the line that opens each block (which command writes it, from what).
        docs (dict[str, tuple[str, ...]]): the docs (paths from the repository's root) and
            the blocks each must hold.
        blocks (Callable[[str], Blocks]): the root to every block it knows, by name (read
            when called: a broken data file is an error then, not at import).
    """
    prefix: str
    opening: str
    docs: Dict[str, Tuple[str, ...]]
    blocks: Callable[[str], Blocks]

    def generate(self, root: str) -> Dict[str, Tuple[str, str]]:
        """Every doc under ``root``: ``{path: (as it is, as generated)}``."""
        known = self.blocks(root)
        out = {}
        for path, required in self.docs.items():
            with open(osp.join(root, path), encoding='utf-8') as f:
                text = f.read()
            out[path] = (text, render(text, path, known, required, self.prefix,
                                      self.opening))
        return out

    def stale(self, root: str) -> List[str]:
        """The docs (paths relative to ``root``) that differ from what :meth:`write`
        writes."""
        return [path for path, (old, new) in self.generate(root).items() if old != new]

    def write(self, root: str) -> List[str]:
        """Rewrite the generated blocks of every doc; each changed doc is written whole
        (atomically); returns the paths written."""
        from mita_seg.engine import atomic_write_text   # mmengine: only when writing
        written = []
        for path, (old, new) in self.generate(root).items():
            if old != new:
                atomic_write_text(new, osp.join(root, path))
                written.append(path)
        return written
