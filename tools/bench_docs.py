"""`make bench-docs`: the README's speed table, generated from the committed record of a
`tools/benchmark.py --level model --json` run (no timing; seconds).

Usage::

    python tools/bench_docs.py           # rewrite the generated blocks; print the docs written
    python tools/bench_docs.py --check   # write nothing; exit 1 naming the docs out of date

The record and the table are :mod:`mita_seg.benchmark.docs`'; the prose around it is written
by hand.
"""
import os.path as osp
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

from mita_seg.cli import run_tool  # noqa: E402
from mita_seg.cli.core import ToolParser, print_error  # noqa: E402


def build_parser() -> ToolParser:
    p = ToolParser(description="the README's speed table, from the benchmark record "
                   'committed under docs/benchmark/')
    p.add_argument('--check', action='store_true', help='write nothing; exit 1 naming the '
                   'docs that differ from what the generator writes')
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from mita_seg.benchmark.docs import BENCH_DOCS
    if args.check:
        stale = BENCH_DOCS.stale(ROOT)
        if stale:
            print_error(f"{', '.join(stale)}: not what the committed record gives; run "
                        'make bench-docs')
            sys.exit(1)
        print('the speed table is up to date')
        return
    written = BENCH_DOCS.write(ROOT)
    print(f"wrote {', '.join(written)}" if written else 'the speed table is up to date')


if __name__ == '__main__':
    run_tool(main)
