"""The swap study's rows: their types (:data:`ROW_TYPES`, the JSON's ``kind`` field), the
numbers averaged over seeds (:data:`NUMBERS`), a row made from a stage's metrics
(:func:`study_row`, :func:`from_sweep`) and the rows and results of several seeds as one
(:func:`aggregate_rows`, :func:`aggregate`)."""
from statistics import mean
from typing import Dict, List, Optional, Sequence, Tuple

from mita_seg.apis.sweep import SweepRow
from mita_seg.evaluation import ACCURACY_KEYS
from .settings import PAPER
from .stats import mean_std

__all__ = ['ROW_TYPES', 'NUMBERS', 'study_row', 'from_sweep', 'aggregate_rows', 'aggregate']

# the types of row (a row's ``kind`` in the JSON) in the order of the tables (the paper's row,
# MiTA M = k = 49 in the encoder only, goes first: :func:`aggregate_rows`)
ROW_TYPES = ('baseline', 'swap', 'swap-head', 'swap-head-routed', 'tome', 'tome-head',
             'swap+tome', 'check', 'equal-cost', 'plan', 'finetune', 'control')
# the numbers of a row that are averaged over the seeds (with the long-range scenes' pixel
# accuracy by evidence, their configs' EvidenceAccuracyMetric)
NUMBERS = ('mIoU', 'mAcc', 'aAcc', 'attn_GMACs', 'model_GFLOPs', 'img_per_s', 'delta_mIoU',
           'model_reduction_%', 'speedup') + ACCURACY_KEYS


def study_row(setting: str, row_type: str, M, topk, values: dict, base: Optional[dict],
              merge_ratio: Optional[float] = None) -> dict:
    """A table row (``kind``: its ``row_type``) with the reductions against ``base`` (the
    unswapped row)."""
    row = dict(setting=setting, kind=row_type, M=M, topk=topk)
    if merge_ratio is not None:
        row['merge_ratio'] = merge_ratio
    row.update({k: values.get(k) for k in ('mIoU', 'mAcc', 'aAcc', 'attn_GMACs',
                                           'model_GFLOPs', 'img_per_s')})
    row.update({k: values[k] for k in ACCURACY_KEYS if k in values})
    base = base or row
    row['delta_mIoU'] = row['mIoU'] - base['mIoU']
    if row['model_GFLOPs'] is not None:
        row['model_reduction_%'] = 100.0 * (1 - row['model_GFLOPs'] / base['model_GFLOPs'])
    if row['img_per_s'] is not None:
        row['speedup'] = row['img_per_s'] / base['img_per_s']
    return row


def from_sweep(r: SweepRow, base: Optional[dict], setting: Optional[str] = None,
               row_type: Optional[str] = None) -> dict:
    """:func:`study_row` of a :func:`~mita_seg.apis.swap_sweep` row (its label and point
    kind unless given)."""
    if setting is None:
        setting = 'unswapped (softmax attention)' if r.method == 'baseline' else r.label
    return study_row(setting, row_type or r.method, r.M, r.topk, r.as_dict(), base,
                     merge_ratio=r.merge_ratio)


def aggregate_rows(runs: Sequence[Tuple[int, Sequence[dict]]]) -> List[dict]:
    """Rows of several seeds, ``(seed, rows)``, matched by ``(kind, setting)``: each the first
    seed's row with every number of :data:`NUMBERS` the mean over the seeds that have it,
    ``std`` (sample standard deviation, n - 1), ``per_seed`` (``{number: {seed: value}}``)
    and ``seeds`` (how many); in the order of :data:`ROW_TYPES`, the paper's row (MiTA
    M = k = 49, encoder only) first."""
    groups: Dict[tuple, List[Tuple[int, dict]]] = {}
    for seed, rows in runs:
        for r in rows:
            groups.setdefault((r['kind'], r['setting']), []).append((seed, r))
    out = []
    for group in groups.values():
        row = dict(group[0][1], seeds=len(group), std={}, per_seed={})
        for k in NUMBERS:
            values = {str(seed): r[k] for seed, r in group if r.get(k) is not None}
            if values:
                row[k], row['std'][k] = mean_std(list(values.values()))
                row['per_seed'][k] = values
        out.append(row)
    paper = ('swap', PAPER.num_experts, PAPER.topk)
    return sorted(out, key=lambda r: -1 if (r['kind'], r['M'], r['topk']) == paper
                  else ROW_TYPES.index(r['kind']) if r['kind'] in ROW_TYPES
                  else len(ROW_TYPES))


def aggregate(runs: Sequence[dict]) -> dict:
    """One model's runs (:func:`~projects.swap_study.study.study_model`, one per seed) as one
    result: its rows, and those of each MiTA-trained setting, over the seeds
    (:func:`aggregate_rows`); the training seconds averaged; the first seed's token
    selection; every run kept in ``runs``; the runs' errors and notes, each with its seed."""
    first = runs[0]
    res = dict(name=first['name'], config=first['config'], seeds=[r['seed'] for r in runs],
               runs=list(runs), rows=aggregate_rows([(r['seed'], r['rows']) for r in runs]),
               load=[v for r in runs for v in r['load']],
               seconds=sum(r.get('seconds', 0) for r in runs),
               errors=[f"seed {r['seed']}: {e}" for r in runs for e in r['errors']],
               notes=sorted({n for r in runs for n in r['notes']}), native=[])
    for key in ('input', 'test_images', 'patch_size', 'selection'):
        if key in first:
            res[key] = first[key]
    trained = [r['train'] for r in runs if 'train' in r]
    if trained:
        res['train'] = dict(trained[0], seconds=mean(t['seconds'] for t in trained),
                            reused=any(t['reused'] for t in trained))
    for native in first['native']:
        same = [(r['seed'], n) for r in runs for n in r['native']
                if n['setting'] == native['setting']]
        train = [n['train'] for _, n in same if 'train' in n]
        res['native'].append(dict(
            native, rows=aggregate_rows([(seed, n['rows']) for seed, n in same]),
            **(dict(train=dict(train[0], seconds=mean(t['seconds'] for t in train),
                               reused=any(t['reused'] for t in train))) if train else {})))
    return res
