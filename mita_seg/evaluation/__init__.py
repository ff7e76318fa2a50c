"""mmseg evaluation components of mita_seg; importing this module registers them
(configs: ``custom_imports = dict(imports=['mita_seg.evaluation'])``)."""
from .evidence_metric import ACCURACY_KEYS, EvidenceAccuracyMetric
from .iou_metric import LabelledIoUMetric

__all__ = ['ACCURACY_KEYS', 'EvidenceAccuracyMetric', 'LabelledIoUMetric']
