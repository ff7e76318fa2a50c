"""Stage 3 of the study: per-layer swap plans calibrated on training images
(:class:`~mita_seg.apis.calibrate.SwapCalibrator`) at several FLOP budgets (the FLOPs of
uniform settings, the paper's compression and ToMe's largest reduction) and with fewer
calibration images, each then evaluated on the validation images. At each budget two plans:
one among the MiTA candidates, and one across kinds, whose candidates add each other kind
of the taxonomy at its setting nearest each budget
(:func:`~mita_seg.analysis.equal_cost.settings_near`), so that layers may get different
kinds; one calibrator measures both (:meth:`SwapCalibrator.plan`'s ``among``)."""
import os
import os.path as osp
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mita_seg.analysis.equal_cost import settings_near
from mita_seg.apis import load_config
from mita_seg.apis.calibrate import CalibrationError, SwapCalibrator
from mita_seg.apis.sweep import sweep_points
from mita_seg.models import SwapPlan
from mita_seg.setting import MiTASetting, label as label_of
from .model_study import ACROSS_MARK, PAPER_MARK, ModelStudy
from .rows import from_sweep
from .settings import StudySettings, tag_of

__all__ = ['plan_budgets', 'across_kinds', 'calibrate_plans', 'run']


def plan_budgets(s: StudySettings, paper: Sequence[MiTASetting] = ()) -> Tuple[str, ...]:
    """The plans' budgets: ``s.plan_budgets``, then the paper's compression (the first of
    ``paper``, spelled) unless among them; none without ``s.plan_budgets``."""
    extra = [p.text for p in paper[:1]] if s.plan_budgets else []
    return tuple(s.plan_budgets) + tuple(b for b in extra if b not in s.plan_budgets)


def across_kinds(budgets: Sequence[str], kinds: Sequence[str],
                 calls: Sequence) -> List[MiTASetting]:
    """The further candidates of the plans across kinds: each of ``kinds`` at its setting
    nearest each budget that is a setting (its attention MACs over ``calls``:
    :func:`~mita_seg.analysis.equal_cost.settings_near`), each once; none without kinds or
    calls."""
    settings = [MiTASetting.parse_or_dense(b) for b in budgets if b != 'tome']
    settings = [b for b in settings if b is not None]
    if not (kinds and calls and settings):
        return []
    return settings_near(settings, kinds, calls)


def calibrate_plans(config: str, opts: dict, checkpoint: str, work_dir: str,
                    s: StudySettings, rows: Sequence[dict], progress: Callable[[str], None],
                    notes: List[str], paper: Sequence[MiTASetting] = (),
                    kinds: Sequence[MiTASetting] = ()) -> List[Tuple[SwapPlan, dict]]:
    """Per-layer swap plans of ``checkpoint`` calibrated on training images: one per budget
    (:func:`plan_budgets`) with ``s.calibration_images`` images, and one at the first budget
    for each count of ``s.calibration_counts``, among the MiTA candidates; with ``kinds``,
    also one across kinds per budget (the same images); each saved as
    ``WORK_DIR/plans/<tag>[_kinds]_<count>img.json``.

    Args:
        rows (Sequence[dict]): the study's rows so far (budget ``'tome'``: the reduction of
            the ToMe row of the largest ratio).
        notes (list[str]): gets a line for each budget skipped (no ToMe row, or ToMe
            cheaper than the cheapest plan).
        paper (Sequence[MiTASetting]): the settings at the paper's compression (the first a
            budget; a MiTA candidate too).
        kinds (Sequence[MiTASetting]): the other kinds' candidates of the plans across
            kinds (:func:`across_kinds`); none for no such plans.

    Returns:
        list[tuple[SwapPlan, dict]]: each plan and what the table says of it: ``label``,
        ``budget``, ``images``, ``file``, ``summary``, ``layers`` (each layer's setting),
        ``predicted_error``, ``calibration_seconds``, ``across_kinds``, and
        ``paper_reduction_%`` at the paper's budget.
    """
    budgets = plan_budgets(s, paper)
    mita = list(s.candidates()) + [p.text for p in paper[:1]]
    tome = [r for r in rows if r['kind'] == 'tome']
    out = []
    counts = [s.calibration_images] + [n for n in s.calibration_counts
                                       if n != s.calibration_images]
    for count in counts:
        main = count == s.calibration_images
        extra = [k.text for k in kinds] if main else []
        cal = SwapCalibrator(load_config(config, opts), checkpoint, count, mita + extra,
                             progress=progress)
        # MiTA's candidates first (as without kinds), then every candidate: across kinds
        choices = [(mita if extra else None, False)] + ([(None, True)] if extra else [])
        for budget in budgets if main else budgets[:1]:
            for among, across in choices:
                got = _plan(cal, budget, tome, notes, among, across)
                if got is None:
                    continue
                plan, what, tag = got
                os.makedirs(osp.join(work_dir, 'plans'), exist_ok=True)
                name = f"{tag}{'_kinds' if across else ''}_{count}img.json"
                info = dict(label=f"calibrated plan{' across kinds' if across else ''}, {what}, "
                            f'{count} images', budget=budget, images=count,
                            file=plan.save(osp.join(work_dir, 'plans', name)),
                            summary=plan.summary(),
                            layers={n: label_of(v) for n, v in plan.layers.items()},
                            predicted_error=plan.info['calibration']['predicted_error'],
                            calibration_seconds=plan.info['calibration']['seconds'],
                            **{ACROSS_MARK: across})
                if budget in {p.text for p in paper[:1]}:
                    info[PAPER_MARK] = 100 * s.paper_reduction
                progress(f"{info['label']}: {info['summary']}; "
                         + ', '.join(f'{n}: {v}' for n, v in info['layers'].items()))
                out.append((plan, info))
    return out


def _plan(cal: SwapCalibrator, budget: str, tome: Sequence[dict], notes: List[str],
          among: Optional[Sequence[str]],
          across: bool) -> Optional[Tuple[SwapPlan, str, str]]:
    """The plan of ``cal`` at ``budget`` among ``among`` (None: every candidate), what its
    label says of the budget and its file tag; None (a note) when there is none."""
    if budget != 'tome':
        setting = MiTASetting.parse_or_dense(budget)
        return (cal.plan(budget_uniform=budget, among=among),
                f"the FLOPs of {'MiTA ' + setting.label if setting else 'dense'}",
                tag_of(setting) if setting else 'dense')
    if not tome:
        if not across:
            notes.append("no plan at budget 'tome': this model has no ToMe rows")
        return None
    top = max(tome, key=lambda r: r['merge_ratio'])
    what = f"the FLOPs of ToMe r={top['merge_ratio']:.2f}"
    try:
        return cal.plan(reduction=top['model_reduction_%'] / 100, among=among), what, 'tome'
    except CalibrationError as e:    # ToMe cheaper than any plan: a finding
        notes.append(f"no plan{' across kinds' if across else ''} at {what}: {e}")
        return None


def run(study: ModelStudy) -> None:
    """Calibrate the plans (:func:`calibrate_plans`; across kinds when
    ``plans_across_kinds`` and the model runs other kinds, else a note), then evaluate
    them."""
    s = study.s
    budgets = plan_budgets(s, study.paper)
    kinds: List[MiTASetting] = []
    if s.plans_across_kinds:
        kinds = across_kinds(budgets, study.runnable, study.calls)
        if not kinds:   # the kinds left out, by why (as the taxonomy's note)
            by_why: Dict[str, List[str]] = {}
            for kind, why in study.skipped.items():
                by_why.setdefault(why, []).append(kind)
            study.result['notes'].append('no plans across kinds: ' + ('; '.join(
                f"{', '.join(k)} ({why})" for why, k in by_why.items()) if by_why else
                'no other kind, or no budget that is a setting'))
    plans = study.stage(f'calibrated plans at {len(budgets)} budget(s) on '
                        f'{s.calibration_images} training images'
                        + (f', also across kinds ({len(kinds)} further candidates)'
                           if kinds else '')
                        + f', and at the first with {list(s.calibration_counts)} images',
                        lambda: calibrate_plans(study.config, study.opts, study.ckpt,
                                                study.work_dir, s, study.result['rows'],
                                                study.say(''), study.result['notes'],
                                                study.paper, kinds))
    if not plans:
        return
    evaluated = study.stage(
        f'{len(plans)} calibrated plan(s) on the validation images',
        lambda: study.sweep_with(study.ckpt, osp.join(study.work_dir, 'plans'),
                                 sweep_points(plans=[p for p, _ in plans]), 'plans '))
    if evaluated is not None:
        rows, _ = evaluated
        study.check_base(rows[0], 'plans', ' before the plans')
        for r, (plan, info) in zip(rows[1:], plans):
            extra = {k: info[k] for k in (ACROSS_MARK, PAPER_MARK) if k in info}
            study.add_row(from_sweep(r, study.base, info['label']), plan=info, **extra)
