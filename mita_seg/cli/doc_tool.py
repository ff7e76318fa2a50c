"""The ``main()`` of a tool that rewrites one generator's doc blocks from committed data
(:class:`mita_seg.utils.doc_blocks.DocBlocks`): ``tools/study_docs.py``,
``tools/bench_docs.py``."""
import sys
from typing import Callable, List, Optional

from .core import ToolParser, print_error

__all__ = ['doc_tool']


def doc_tool(description: str, generator: Callable[[], object], name: str, source: str,
             command: str, root: str) -> Callable[[Optional[List[str]]], None]:
    """A tool's ``main(argv=None)``: rewrite the generated blocks and print the docs written;
    with ``--check`` write nothing, and end in one ``error:`` line (exit status 1) naming the
    docs out of date.

    Args:
        description (str): the tool's ``--help``.
        generator (Callable[[], DocBlocks]): the generator, imported when the tool runs
            (after its arguments are parsed).
        name (str): what the blocks are, for the messages (``the study docs``).
        source (str): what they are generated from (``the committed JSON``).
        command (str): how to regenerate them (``make study-docs``).
        root (str): the repository's root.
    """
    def main(argv: Optional[List[str]] = None) -> None:
        p = ToolParser(description=description)
        p.add_argument('--check', action='store_true', help='write nothing; exit 1 naming '
                       'the docs that differ from what the generator writes')
        args = p.parse_args(argv)
        blocks = generator()
        if args.check:
            stale = blocks.stale(root)
            if stale:
                print_error(f"{', '.join(stale)}: not what {source} gives; run {command}")
                sys.exit(1)
            print(f'{name} up to date')
            return
        written = blocks.write(root)
        print(f"wrote {', '.join(written)}" if written else f'{name} up to date')

    return main
