"""Stage 2c of the study, the paper's taxonomy at equal cost (issue 42): for each budget (the
attention MACs of the encoder swapped to a MiTA setting: the paper's M = k = 49 and lower
ones), each attention kind at the setting whose MACs come nearest that budget
(:func:`mita_seg.analysis.equal_cost.setting_at_cost`: compression ``agent``, block routing
``block``, per-query ``topk``, a local ``window``, and MiTA at the budget itself), and ToMe
at the ratio whose whole-model GFLOPs come nearest the budget's, all evaluated without
retraining; rows of type ``equal-cost`` with ``attention`` (the kind), ``budget`` and
``cost_ratio`` (the row's cost over the budget's: attention MACs, for ToMe model GFLOPs),
``within`` (10%). A kind that cannot reach a budget (``topk`` scores every key) gets its
cheapest setting, marked. The budgets are ``kind_budgets`` and, with them, the paper's
compression (:attr:`ModelStudy.paper`'s first: MiTA at 42% fewer model FLOPs), whose rows
carry ``paper_reduction_%``. This module chooses the points and makes the rows; their table is
:func:`projects.swap_study.report.kinds_markdown`'s, their figure
:func:`projects.swap_study.figures.plot_kinds`'."""
import copy
import os.path as osp
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn
from mmengine.runner import Runner

from mita_seg.analysis.attention_macs import attention_gmacs
from mita_seg.analysis.equal_cost import cost_of, setting_at_cost, within
from mita_seg.apis import merge_model, swap_model
from mita_seg.apis.sweep import SweepPoint, SweepRow, model_gflops
from mita_seg.setting import MITA, MiTASetting
from .model_study import PAPER_MARK, ModelStudy
from .rows import from_sweep
from .sweep import ENCODER_ONLY, merge_error, split_kinds

__all__ = ['TOME', 'split_kinds', 'budgets_of', 'match_budgets', 'kind_points', 'kind_rows',
           'run']

# ToMe's entry beside the attention kinds (its ``attention`` in the rows)
TOME = 'tome'


def tome_ratio_at(model: nn.Module, batch: dict, gflops: float, merge_cfg: dict,
                  steps: int = 8) -> Tuple[float, float]:
    """The ToMe ratio in ``[0, 0.5]`` whose model GFLOPs on ``batch`` come nearest
    ``gflops`` (bisection: GFLOPs fall as the ratio grows; 0.5 when even it costs more),
    and those GFLOPs."""
    def cost(r):
        merged = copy.deepcopy(model)
        merge_model(merged, r, verbose=False, **merge_cfg)
        return model_gflops(merged, batch)

    tried = {0.5: cost(0.5)}
    lo, hi = 0.0, 0.5
    if tried[0.5] < gflops:
        for _ in range(steps):
            mid = round((lo + hi) / 2, 4)
            tried[mid] = cost(mid)
            lo, hi = (mid, hi) if tried[mid] > gflops else (lo, mid)
    r = min(tried, key=lambda k: abs(tried[k] - gflops))
    return r, tried[r]


def match_budgets(model: nn.Module, batch: dict, budgets: Sequence[MiTASetting],
                  kinds: Sequence[str], merge_cfg: Optional[dict]) -> List[dict]:
    """For each budget: the encoder of ``model`` swapped to it, its attention calls priced
    (its MACs) and its model GFLOPs; each of ``kinds`` at the setting nearest those MACs;
    ToMe (unless ``merge_cfg`` is None) at the ratio nearest those GFLOPs. A kind that the
    model's attention cannot run (:func:`split_kinds`) is left out, named in ``skipped``.

    Returns:
        list[dict]: per budget ``budget`` (spelling), ``label``, ``attn_MACs``,
        ``model_GFLOPs``, ``skipped`` (kind: why) and ``kinds``: ``attention``, ``setting``
        (spelling; for ToMe ``merge_ratio``), ``cost_ratio``, ``within``.
    """
    out = []
    for budget in budgets:
        swapped = copy.deepcopy(model)
        swap_model(swapped, budget.cfg(), verbose=False)
        calls: list = []
        attention_gmacs(swapped, [batch], calls=calls)
        target, gflops = cost_of(budget, calls), model_gflops(swapped, batch)
        runnable, skipped = split_kinds(swapped, kinds)
        del swapped
        entry = dict(budget=budget.text, label=budget.label, attn_MACs=target,
                     model_GFLOPs=gflops, skipped=skipped, kinds=[])
        for kind in (MITA, ) + runnable:
            setting, macs = (budget, target) if kind == MITA else setting_at_cost(
                kind, target, calls)
            entry['kinds'].append(dict(attention=kind, setting=setting.text,
                                       cost_ratio=macs / target, within=within(macs, target)))
        if merge_cfg is not None:
            r, g = tome_ratio_at(model, batch, gflops, merge_cfg)
            entry['kinds'].append(dict(attention=TOME, merge_ratio=r, cost_ratio=g / gflops,
                                       within=within(g, gflops)))
        out.append(entry)
    return out


def _point(k: dict) -> SweepPoint:
    if k['attention'] == TOME:
        return SweepPoint('tome', merge_ratio=k['merge_ratio'])
    return SweepPoint('swap', MiTASetting.parse(k['setting']))


def kind_points(matched: Sequence[dict]) -> List[SweepPoint]:
    """The sweep of the matched settings: the baseline, then each distinct point once, ToMe
    first (:func:`~mita_seg.apis.swap_sweep` merges the model as it is: before any swap)."""
    points = [SweepPoint('baseline')]
    for tome in (True, False):
        for entry in matched:
            for k in entry['kinds']:
                if (k['attention'] == TOME) == tome and _point(k) not in points:
                    points.append(_point(k))
    return points


def kind_rows(matched: Sequence[dict], rows: Sequence[SweepRow], make_row) -> List[dict]:
    """The ``equal-cost`` rows, per budget and kind, from the sweep of :func:`kind_points`
    (``make_row(sweep_row, setting)`` makes a study row)."""
    by_point = {r.point: r for r in rows}
    out = []
    for entry in matched:
        for k in entry['kinds']:
            r = by_point.get(_point(k))
            if r is None:   # runs exactly as an earlier point: the sweep made no row
                continue
            what = (f"ToMe r={k['merge_ratio']:.3g}" if k['attention'] == TOME else
                    ('MiTA ' if k['attention'] == MITA else '')
                    + MiTASetting.parse(k['setting']).label)
            row = make_row(r, f"{what} at the cost of MiTA {entry['label']}")
            row.update(kind='equal-cost', attention=k['attention'], budget=entry['budget'],
                       cost_ratio=k['cost_ratio'], within=k['within'])
            out.append(row)
    return out


def budgets_of(study: ModelStudy) -> Tuple[MiTASetting, ...]:
    """The taxonomy's budgets: ``kind_budgets``, then the paper's compression (the first
    setting of :attr:`ModelStudy.paper`) unless among them; none without ``kind_budgets``."""
    budgets = tuple(study.s.kind_budgets)
    extra = study.paper[:1] if budgets else []
    return budgets + tuple(b for b in extra if b not in budgets)


def run(study: ModelStudy) -> None:
    """Each attention kind at the MACs of each budget, ToMe at its GFLOPs, evaluated without
    retraining: the ``equal-cost`` rows and ``result['equal_cost']`` (the matched
    settings)."""
    s = study.s
    budgets = budgets_of(study)
    matched: List[dict] = []

    def points(runner: Runner, model: nn.Module) -> List[SweepPoint]:
        batch = next(iter(runner.test_dataloader))
        merge = ENCODER_ONLY if merge_error(model) is None else None
        matched.extend(match_budgets(model, batch, budgets, s.kinds, merge))
        skipped = {k: why for entry in matched for k, why in entry['skipped'].items()}
        by_why: Dict[str, List[str]] = {}   # the kinds left out, by why
        for kind, why in skipped.items():
            by_why.setdefault(why, []).append(kind)
        if by_why:
            note = 'no equal-cost rows for ' + '; '.join(
                f"{', '.join(kinds)} ({why})" for why, kinds in by_why.items())
            study.result['notes'].append(note)
            study.progress(f'{study.name}: {note}')
        return kind_points(matched)

    swept = study.stage(f"{', '.join((MITA, ) + s.kinds)} and ToMe at the cost of MiTA "
                        f"{', '.join(b.text for b in budgets)}, no retraining",
                        lambda: study.sweep_with(study.ckpt, osp.join(study.work_dir, 'kinds'),
                                                 points, 'kinds ', merge_cfg=ENCODER_ONLY))
    if swept is not None:
        rows, _ = swept
        study.check_base(rows[0], 'kinds', ' before the kinds')
        study.result['equal_cost'] = matched
        paper = {b.text for b in study.paper[:1]}
        for row in kind_rows(matched, rows, lambda r, label: from_sweep(r, study.base, label)):
            if row['budget'] in paper:
                row[PAPER_MARK] = 100 * s.paper_reduction
            study.result['rows'].append(row)
