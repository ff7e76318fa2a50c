"""`make study-docs`: the swap study's tables in docs/swap_study.md, docs/longrange_data.md and
README.md, generated from the JSON committed under docs/swap_study/ (no training; seconds).

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
from mita_seg.cli.doc_tool import doc_tool  # noqa: E402


def _generator():
    from projects.swap_study.docs import STUDY_DOCS
    return STUDY_DOCS


main = doc_tool('the swap study\'s tables in docs/swap_study.md, docs/longrange_data.md and '
                'README.md, from the JSON committed under docs/swap_study/', _generator,
                'the study docs are', 'the committed JSON', 'make study-docs', ROOT)

if __name__ == '__main__':
    run_tool(main)
