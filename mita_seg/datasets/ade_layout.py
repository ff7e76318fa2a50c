"""The files of a generated dataset in ADE20K's layout, and the check that a folder holds
no others: ``OUT/images/{training,validation}/ADE_{train,val}_00000001.jpg`` and the
annotations beside them as ``.png`` (what mmseg's ``ADE20KDataset`` reads: every ``.jpg``
under the image folder, recursively). Light: the standard library only, so the generators
(``tools/dataset/make_tiny_ade20k.py``, ``make_longrange_ade20k.py``) use it without
loading torch or the mm stack.
"""
import os
import os.path as osp
from typing import Dict, List

from mita_seg.utils.errors import InputError

__all__ = ['SPLITS', 'scene_name', 'check_split_folders']

# split folder -> the tag of its file names (ADEChallengeData2016's)
SPLITS = {'training': 'train', 'validation': 'val'}
# what mmseg's ADE20KDataset reads in each folder
_SUFFIX = {'images': '.jpg', 'annotations': '.png'}


def scene_name(split: str, index: int) -> str:
    """The file name (without suffix) of scene ``index`` (from 0) of ``split``:
    ``ADE_train_00000001`` for the first training scene."""
    return f'ADE_{SPLITS[split]}_{index + 1:08d}'


def _read_files(folder: str, suffix: str) -> List[str]:
    """The ``suffix`` files under ``folder`` (recursively, as mmseg lists them), relative."""
    found = []
    for root, _, files in os.walk(folder):
        found += [osp.relpath(osp.join(root, f), folder) for f in files if f.endswith(suffix)]
    return sorted(found)


def check_split_folders(out: str, counts: Dict[str, int]) -> None:
    """Refuse an output folder whose split folders hold images or annotations a run writing
    ``counts`` scenes per split would not write (a larger dataset written there before, or
    other data): mmseg would read them with the new ones as one dataset. The files a run
    writes (re-running a command, finishing an interrupted run) are fine.

    Args:
        out (str): the dataset's folder (``--out``).
        counts (dict): scenes per split, e.g. ``{'training': 200, 'validation': 40}``.

    Raises:
        InputError: naming the folder, how many files are extra and the first of them.
    """
    for split, num in counts.items():
        written = {scene_name(split, i) for i in range(num)}
        for kind, suffix in _SUFFIX.items():
            folder = osp.join(out, kind, split)
            extra = [f for f in _read_files(folder, suffix)
                     if osp.splitext(f)[0] not in written]
            if extra:
                raise InputError(
                    f'{folder} holds {len(extra)} {suffix} file(s) this run would not write '
                    f'({", ".join(extra[:3])}{", ..." if len(extra) > 3 else ""}): mmseg '
                    'would read them as part of the dataset. Give --out a new or empty folder, '
                    'or remove that one first')
