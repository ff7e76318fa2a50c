"""Pixel accuracy on the long-range scenes by the evidence a label needs."""
import os.path as osp
from typing import Dict, Sequence

import numpy as np
from mmengine.evaluator import BaseMetric
from mmseg.registry import METRICS

from mita_seg.datasets.longrange_scenes import EVIDENCE, evidence_map, scene_of_file
from mita_seg.utils.errors import InputError


# the metrics' names, one per kind of evidence (``acc_context``, ...), in EVIDENCE's order
ACCURACY_KEYS = tuple(f'acc_{name}' for name in EVIDENCE.values())


@METRICS.register_module()
class EvidenceAccuracyMetric(BaseMetric):
    """Pixel accuracy on the scenes of ``tools/dataset/make_longrange_ade20k.py``, split by
    what decides each pixel's label (:data:`~mita_seg.datasets.longrange_scenes.EVIDENCE`):
    ``acc_context`` (background: its texture *and* the distant cue), ``acc_object`` (textured
    objects: their own texture), ``acc_retrieval`` (plain objects: the texture of the distant
    object of their hue), ``acc_detail`` (poles), in percent.

    mIoU mixes these; this says which evidence a model (or a swap) uses: a model that never
    learned retrieval gets plain objects right one time in three, whatever its mIoU. Each
    image's scene is drawn again from its folder's ``scenes.json`` and its index in the file
    name (``ADE_val_00000001.jpg`` is image 0); the labels are checked against it (the cue,
    the one unlabelled region, must be where the scene has it).

    Args:
        collect_device (str): as :class:`mmengine.evaluator.BaseMetric`. Default: 'cpu'.
        prefix (str, optional): as :class:`mmengine.evaluator.BaseMetric`. Default: None.
    """

    def process(self, data_batch: dict, data_samples: Sequence[dict]) -> None:
        """Count right and labelled pixels per kind of evidence, one row per image."""
        for sample in data_samples:
            pred = sample['pred_sem_seg']['data'].squeeze().cpu().numpy()
            gt = sample['gt_sem_seg']['data'].squeeze().cpu().numpy()
            evidence = evidence_map(_scene_of(sample['img_path']))
            if evidence.shape != gt.shape or pred.shape != gt.shape:
                raise InputError(
                    f"{sample['img_path']}: prediction {pred.shape}, labels {gt.shape}, "
                    f'scene {evidence.shape}: evaluate at the scenes\' own size (a test '
                    'pipeline without Resize)')
            unlabelled = gt == 255   # reduce_zero_label: 0 (the cue) -> 255
            if np.mean(unlabelled != (evidence == 0)) > 0.01:
                raise InputError(
                    f"{sample['img_path']}: its labels are not the scene its folder's "
                    'scenes.json describes (the cue is elsewhere): write the scenes again')
            right = pred == gt
            self.results.append(np.array(
                [[np.sum(right & (evidence == k)), np.sum(evidence == k)] for k in EVIDENCE],
                dtype=np.int64))

    def compute_metrics(self, results: list) -> Dict[str, float]:
        """``acc_<kind>`` for each kind of evidence: right pixels over its pixels, percent
        (nan where the images hold none)."""
        total = np.sum(results, axis=0)
        return {key: round(float(100 * r / n), 2) if n else float('nan')
                for key, (r, n) in zip(ACCURACY_KEYS, total)}


def _scene_of(img_path: str):
    """The scene of an image file ``OUT/images/<split>/ADE_<tag>_<n>.jpg``."""
    split_dir = osp.dirname(img_path)
    out = osp.dirname(osp.dirname(split_dir))
    stem = osp.splitext(osp.basename(img_path))[0]
    try:
        index = int(stem.rsplit('_', 1)[1]) - 1
    except (IndexError, ValueError):
        raise InputError(f'{img_path}: not a long-range scene (ADE_<split>_<n>.jpg)') from None
    return scene_of_file(out, osp.basename(split_dir), index)
