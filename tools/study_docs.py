"""`make study-docs`: the swap study's tables in docs/swap_study.md and README.md, generated
from the JSON committed under docs/swap_study/ (no training; seconds).

Usage::

    python tools/study_docs.py           # rewrite the generated blocks; print the docs written
    python tools/study_docs.py --check   # write nothing; exit 1 naming the docs out of date

The blocks, their sources and the verdict rules are :mod:`projects.swap_study.docs` and
:mod:`projects.swap_study.verdicts`; the prose around the blocks is written by hand.
"""
import os.path as osp
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

from mita_seg.cli import run_tool  # noqa: E402
from mita_seg.cli.core import ToolParser, print_error  # noqa: E402


def build_parser() -> ToolParser:
    p = ToolParser(description='the swap study\'s tables in docs/swap_study.md and README.md, '
                   'from the JSON committed under docs/swap_study/')
    p.add_argument('--check', action='store_true', help='write nothing; exit 1 naming the '
                   'docs that differ from what the generator writes')
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from projects.swap_study.docs import stale_docs, write_docs
    if args.check:
        stale = stale_docs(ROOT)
        if stale:
            print_error(f"{', '.join(stale)}: not what the committed JSON gives; run "
                        'make study-docs')
            sys.exit(1)
        print('the study docs are up to date')
        return
    written = write_docs(ROOT)
    print(f"wrote {', '.join(written)}" if written else 'the study docs are up to date')


if __name__ == '__main__':
    run_tool(main)
