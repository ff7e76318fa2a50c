"""LabelledIoUMetric: mmseg's IoUMetric with its means over the labelled classes only."""
import numpy as np
import pytest
import torch
from mmseg.evaluation import IoUMetric
from mmseg.registry import METRICS

import mita_seg.evaluation  # noqa: F401  (registers the metric)

CLASSES = ('a', 'b', 'c', 'd', 'e')


def _metric(cls, **kwargs):
    metric = cls(iou_metrics=['mIoU', 'mDice'], **kwargs)
    metric.dataset_meta = dict(classes=CLASSES)
    return metric


def _evaluate(metric, pairs):
    metric.process({}, [dict(pred_sem_seg=dict(data=torch.as_tensor(p)[None]),
                             gt_sem_seg=dict(data=torch.as_tensor(g)[None])) for p, g in pairs])
    return metric.compute_metrics(metric.results)


def _pairs():
    # labels hold classes 0, 1, 2 (and 255, ignored); the predictions also paint class 3
    g1 = np.array([[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 255, 255], [2, 2, 2, 2]])
    p1 = np.array([[0, 0, 1, 3], [0, 0, 1, 1], [2, 2, 3, 3], [2, 0, 2, 2]])
    g2 = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [2, 2, 2, 2]])
    p2 = np.array([[1, 1, 1, 1], [0, 3, 0, 0], [0, 0, 0, 0], [2, 2, 2, 1]])
    return [(p1, g1), (p2, g2)]


def _by_hand(pairs, classes):
    """IoU and Dice per class, counted pixel by pixel (255 ignored)."""
    iou, dice = [], []
    for c in classes:
        inter = union = pred = lab = 0
        for p, g in pairs:
            keep = g != 255
            inter += ((p == c) & (g == c) & keep).sum()
            union += (((p == c) | (g == c)) & keep).sum()
            pred += ((p == c) & keep).sum()
            lab += ((g == c) & keep).sum()
        iou.append(inter / union)
        dice.append(2 * inter / (pred + lab))
    return 100 * np.mean(iou), 100 * np.mean(dice)


def test_means_skip_classes_the_labels_never_hold():
    pairs = _pairs()
    ours = _evaluate(_metric(METRICS.get('LabelledIoUMetric')), pairs)
    mmseg = _evaluate(_metric(IoUMetric), pairs)
    labelled_iou, labelled_dice = _by_hand(pairs, (0, 1, 2))
    all_iou, _ = _by_hand(pairs, (0, 1, 2, 3))   # mmseg: class 3 enters at IoU 0
    assert ours['mIoU'] == pytest.approx(labelled_iou, abs=0.01)
    assert ours['mDice'] == pytest.approx(labelled_dice, abs=0.01)
    assert mmseg['mIoU'] == pytest.approx(all_iou, abs=0.01)
    assert ours['mIoU'] > mmseg['mIoU'] + 10
    assert ours['aAcc'] == mmseg['aAcc']


def test_equal_to_mmseg_when_nothing_unlabelled_is_predicted():
    pairs = [(np.where(p == 3, g, p), g) for p, g in _pairs()]   # stray class 3 removed
    pairs = [(np.where(p == 255, 0, p), g) for p, g in pairs]
    ours = _evaluate(_metric(METRICS.get('LabelledIoUMetric')), pairs)
    mmseg = _evaluate(_metric(IoUMetric), pairs)
    assert ours == mmseg


def test_nan_to_num_keeps_unlabelled_classes_out_of_the_means():
    pairs = _pairs()
    ours = _evaluate(_metric(METRICS.get('LabelledIoUMetric'), nan_to_num=0), pairs)
    assert ours['mIoU'] == pytest.approx(_by_hand(pairs, (0, 1, 2))[0], abs=0.01)


# --- EvidenceAccuracyMetric: accuracy by the evidence a long-range label needs

def _scenes(tmp_path, num=3, seed=0):
    from mita_seg.datasets import longrange_scenes as gen
    out = str(tmp_path / 'scenes')
    gen.make_split(out, 'validation', num, 128, seed)
    gen.write_scenes_file(out, layout=gen.DEFAULT_LAYOUT, seed=seed, size=128,
                          kinds=list(gen.KINDS), cues=2, train=0, val=num)
    return out, gen


def _samples(out, gen, num, predict):
    """Data samples as mmseg's test loop gives them (labels reduced by one, 0 -> 255)."""
    import cv2
    samples = []
    for i in range(num):
        img_path = f'{out}/images/validation/ADE_val_{i + 1:08d}.jpg'
        label = cv2.imread(img_path.replace('images', 'annotations').replace('.jpg', '.png'),
                           cv2.IMREAD_UNCHANGED).astype(np.int64)
        gt = np.where(label == 0, 255, label - 1)
        scene = gen.sample_scene(gen.scene_rng(0, 'validation', i), 128)
        samples.append(dict(img_path=img_path,
                            gt_sem_seg=dict(data=torch.as_tensor(gt)[None]),
                            pred_sem_seg=dict(data=torch.as_tensor(predict(gt, scene))[None])))
    return samples


def _evidence_metric(samples):
    metric = METRICS.build(dict(type='EvidenceAccuracyMetric'))
    metric.process({}, samples)
    return metric.compute_metrics(metric.results)


def test_evidence_accuracy_by_kind(tmp_path):
    out, gen = _scenes(tmp_path)
    perfect = _evidence_metric(_samples(out, gen, 3, lambda gt, scene: gt))
    assert perfect == dict(acc_context=100.0, acc_object=100.0, acc_retrieval=100.0,
                           acc_detail=100.0)

    def no_retrieval(gt, scene):   # every plain object called 'wall' (label 1 -> 0)
        pred = gt.copy()
        pred[gen.evidence_map(scene) == 3] = 0
        return pred
    res = _evidence_metric(_samples(out, gen, 3, no_retrieval))
    assert res['acc_retrieval'] == 0.0
    assert res['acc_context'] == res['acc_object'] == res['acc_detail'] == 100.0

    # each kind wrong on its own: its accuracy alone falls to 0, under its own name
    # (object and detail are 100 in every case above: a metric that swapped them passed)
    for k, name in gen.EVIDENCE.items():
        def wrong_on(gt, scene, k=k):
            pred, m = gt.copy(), gen.evidence_map(scene) == k
            pred[m] = np.where(gt[m] == 149, 148, 149)   # another class than the label's
            return pred
        res = _evidence_metric(_samples(out, gen, 3, wrong_on))
        assert res == {key: 0.0 if key == f'acc_{name}' else 100.0 for key in perfect}, name

    def half_background(gt, scene):   # the left half of the background wrong
        pred = gt.copy()
        pred[:, :64][gen.evidence_map(scene)[:, :64] == 1] = 149
        return pred
    res = _evidence_metric(_samples(out, gen, 3, half_background))
    assert 30 < res['acc_context'] < 70 and res['acc_retrieval'] == 100.0


def test_evidence_map_matches_the_labels():
    from mita_seg.datasets import longrange_scenes as gen
    for i in range(4):
        scene = gen.sample_scene(gen.scene_rng(5, 'validation', i), 256)
        label = gen.render_scene(scene)[1]
        evidence = gen.evidence_map(scene)
        assert np.array_equal(evidence == 0, label == 0)
        assert np.all(label[evidence == 4] == gen.POLE)
        objects = np.isin(label, list(gen.OBJECT_CLASSES.values()))
        assert np.array_equal(objects, np.isin(evidence, (2, 3)))
        assert (evidence == 3).any() and (evidence == 1).mean() > 0.5


def test_evidence_metric_refuses_scenes_it_cannot_redraw(tmp_path):
    import os
    out, gen = _scenes(tmp_path, num=2)
    samples = _samples(out, gen, 2, lambda gt, scene: gt)
    gen.write_scenes_file(out, layout=gen.DEFAULT_LAYOUT, seed=1, size=128,
                          kinds=list(gen.KINDS), cues=2)
    from mita_seg.utils.errors import InputError   # a user error: the tools print one line
    with pytest.raises(InputError, match='not the scene'):
        _evidence_metric(samples)
    os.remove(f'{out}/scenes.json')
    with pytest.raises(InputError, match='no scenes.json'):
        _evidence_metric(samples)
