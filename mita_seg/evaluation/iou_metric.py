"""mmseg's IoU metric averaged over the classes that the labels hold."""
from typing import Dict

import numpy as np
import torch
from mmseg.evaluation import IoUMetric
from mmseg.registry import METRICS


@METRICS.register_module()
class LabelledIoUMetric(IoUMetric):
    """mmseg's :class:`IoUMetric`, its means (mIoU, mAcc, mDice, ...) taken over the classes
    that occur in the evaluated labels only.

    mmseg averages over every class with a labelled *or predicted* pixel. On a dataset that
    uses a few of ADE20K's 150 classes (the generated scenes of ``tools/dataset/``), a class
    the model predicts somewhere but the labels never hold enters that mean at IoU 0: a model
    that paints a few stray pixels 'sky' in 10-class data loses a whole eleventh of its mIoU
    (measured: a swap on the long-range scenes lost 25 points of mmseg's mIoU, 5 of them over
    the labelled classes). Here such a class is left out of the means (``nan`` in the
    per-class table); its pixels still count against the labelled classes they cover, as
    missed pixels. On data whose labels hold every class (ADE20K's validation set) the two
    metrics are equal. aAcc is unchanged.

    Args:
        Those of :class:`mmseg.evaluation.IoUMetric` (``iou_metrics``, ``nan_to_num``,
        ``beta``, ``ignore_index``, ...).
    """

    def total_area_to_metrics(self, total_area_intersect: torch.Tensor,
                              total_area_union: torch.Tensor,
                              total_area_pred_label: torch.Tensor,
                              total_area_label: torch.Tensor, metrics=('mIoU', ),
                              nan_to_num=None, beta: int = 1) -> Dict[str, np.ndarray]:
        """The per-class metrics of :meth:`IoUMetric.total_area_to_metrics` (aAcc aside),
        ``nan`` for each class without a labelled pixel, so that the means skip it."""
        out = IoUMetric.total_area_to_metrics(total_area_intersect, total_area_union,
                                              total_area_pred_label, total_area_label,
                                              metrics, nan_to_num, beta)
        unlabelled = (total_area_label == 0).cpu().numpy()
        for name, value in out.items():
            if name != 'aAcc':
                # in mmseg's dtype (float32): its means are taken in it, and a float64 mean
                # rounds to another last digit now and then (41.97 for mmseg's 41.96)
                value = np.array(value, copy=True)
                value[unlabelled] = np.nan
                out[name] = value
        return out
