"""Stage 2b of the study: Segmenter's mask head swapped too, at ``head_settings``, its class
tokens global and, to show why, routed like patches; ToMe with the head merged too. Each is a
sweep of a model of its own (a later encoder-only swap would keep a swapped head)."""
import copy
import os.path as osp
from typing import List, Optional, Sequence

import torch.nn as nn

from mita_seg.apis import swap_model
from mita_seg.apis.sweep import SweepPoint, sweep_points
from mita_seg.models.grid import grid_context
from .model_study import ModelStudy
from .rows import from_sweep
from .sweep import WITH_HEAD

__all__ = ['run']


def run(study: ModelStudy) -> None:
    """The rows with Segmenter's mask head swapped (merged) too."""
    s = study.s
    head_ratios = s.merge_ratios if s.merge_head and any(
        r['kind'] == 'tome' for r in study.result['rows']) else ()
    if s.head_settings or head_ratios:
        head = study.stage(f'the mask head too: MiTA at {len(s.head_settings)} setting(s) '
                           '(class tokens global, then routed), '
                           f'{len(head_ratios)} ToMe ratio(s)',
                           lambda: _head_rows(study, head_ratios))
        study.result['rows'] += head or []


def _head_rows(study: ModelStudy, head_ratios: Sequence[float]) -> List[dict]:
    """The head's rows: its class tokens global, then routed (each a sweep of its own
    model); none, and a note, when the decode head has no attention."""
    out = []
    for row_type, routed in (('swap-head', False), ('swap-head-routed', True)):
        swept = study.sweep_with(
            study.ckpt, osp.join(study.work_dir, 'head'),
            lambda runner, model: _head_points(study, model, routed, head_ratios),
            f'{row_type} ', swap_cfg=WITH_HEAD, merge_cfg=WITH_HEAD)
        if swept is None:
            study.result['notes'].append('no head rows: the decode head has no attention')
            return out
        rows, _ = swept
        study.check_base(rows[0], row_type)
        how = 'class tokens routed' if routed else 'class tokens global'
        for r in rows[1:]:
            if r.method == 'tome':
                out.append(from_sweep(r, study.base, f'{r.label}, with the head', 'tome-head'))
            else:
                out.append(from_sweep(r, study.base, f'{r.label}, with the head ({how})',
                                      row_type))
    return out


def _head_points(study: ModelStudy, model: nn.Module, routed: bool,
                 head_ratios: Sequence[float]) -> Optional[List[SweepPoint]]:
    """The points with the head, its class tokens global or routed; None if the decode
    head has no attention to swap."""
    if swap_model(copy.deepcopy(model), dict(WITH_HEAD), verbose=False) == \
            swap_model(copy.deepcopy(model), {}, verbose=False):
        return None
    grid_context(model.decode_head).global_suffix = not routed
    points = sweep_points(merge_ratios=() if routed else head_ratios)
    return points + [SweepPoint('swap', h) for h in study.s.head_settings]
