"""`make bench-docs`: the README's speed table and docs/benchmark.md's current figures,
generated from the committed records of `tools/benchmark.py ... --json` runs (no timing;
seconds).

Usage::

    python tools/bench_docs.py           # rewrite the generated blocks; print the docs written
    python tools/bench_docs.py --check   # write nothing; exit 1 naming the docs out of date

The records and the tables are :mod:`mita_seg.benchmark.docs`'; the prose around them is
written by hand.
"""
import os.path as osp
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

from mita_seg.cli import run_tool  # noqa: E402
from mita_seg.cli.doc_tool import doc_tool  # noqa: E402


def _generator():
    from mita_seg.benchmark.docs import BENCH_DOCS
    return BENCH_DOCS


main = doc_tool("the README's speed table and docs/benchmark.md's current figures, from the "
                'benchmark records committed under docs/benchmark/', _generator,
                'the speed tables are', 'the committed records',
                'make bench-docs', ROOT)

if __name__ == '__main__':
    run_tool(main)
