"""Stage 2 of the study: the trained model without retraining, in the encoder (the paper's
swap): unswapped, token merging (ToMe, :func:`~mita_seg.merge_tokens`) at every merge ratio,
MiTA at every (pool size, top-k) of the sweep, MiTA with ToMe together
(:func:`~mita_seg.apis.swap_sweep`: the test loop of ``tools/test.py``); then the two checks:
route-only MiTA with every key in every expert (:data:`EXACT`: exactly softmax attention, its
mIoU must equal the unswapped one) and the destructive controls (:data:`CONTROLS`: every token
reads one key, ``1:1:route``; each token its own, ``window:1``; no token mixing). The sweep
also holds the paper's compression (:func:`paper_settings`: MiTA at the pool side whose model
FLOPs come nearest ``paper_reduction`` below the unswapped model's, for each k of
``paper_topks``), its rows marked ``paper_reduction_%``."""
import copy
import gc
import os.path as osp
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn
from mmengine.runner import Runner

from mita_seg.analysis.attention_macs import attention_gmacs
from mita_seg.analysis.equal_cost import setting_at_reduction
from mita_seg.apis import merge_model, swap_model
from mita_seg.apis.sweep import SweepPoint, model_gflops, sweep_points
from mita_seg.models import MiTASettingsMixin, NothingToMergeError
from mita_seg.setting import MITA, MiTASetting
from .model_study import CONTROL_MARK, PAPER_MARK, ModelStudy
from .rows import from_sweep, study_row
from .runner import test_runner
from .settings import PAPER

__all__ = ['EXACT', 'ONE_KEY', 'WINDOW_ONE', 'CONTROLS', 'ENCODER_ONLY', 'WITH_HEAD',
           'merge_error', 'every_key_miou', 'split_kinds', 'paper_settings', 'run', 'restore']

# route-only MiTA with every key in every expert: exactly softmax attention (k is clamped to N)
EXACT = dict(with_shared_expert=False, topk=10**6)
# the destructive control: one landmark, one key, no shared expert: every token reads the
# same single key, no token mixing (a swap that loses as little as this one says nothing)
ONE_KEY = MiTASetting.parse('1:1:route')
# the other destructive control: a 1x1 window, each token reads its own key (and the tokens
# off the grid, global for every kind but MiTA), no token mixing
WINDOW_ONE = MiTASetting.parse('window:1')
# the controls and their rows' labels (the row's ``control`` is the spelling)
CONTROLS = {
    ONE_KEY: f'every token reads one key ({ONE_KEY.text}: no token mixing, the destructive '
             'control)',
    WINDOW_ONE: f'each token reads its own key ({WINDOW_ONE.text}: no token mixing, the '
                'destructive control)',
}
# the layers of ToMe in the study's sweep (the encoder only, as MiTA's swap), and of the rows
# with the mask head too
ENCODER_ONLY = dict(include_head=False)
WITH_HEAD = dict(include_head=True)


def merge_error(model: nn.Module) -> Optional[NothingToMergeError]:
    """Why ToMe cannot merge ``model``'s encoder (tried on a copy); None if it can."""
    try:
        merge_model(copy.deepcopy(model), 0.5, verbose=False, **ENCODER_ONLY)
    except NothingToMergeError as e:
        return e
    return None


def every_key_miou(runner: Runner, model: nn.Module, pool: int) -> float:
    """The test mIoU of ``model`` on route-only MiTA with every key in every expert: exactly
    softmax attention."""
    swap_model(model, dict(EXACT, pool_size=pool), verbose=False)
    return float(runner.test()['mIoU'])


def split_kinds(swapped: nn.Module, kinds: Sequence[str]) -> Tuple[Tuple[str, ...],
                                                                   Dict[str, str]]:
    """``kinds`` (but MiTA's) as those that every attention of ``swapped`` (a model swapped
    to MiTA) can run, and the others, each with the modules that cannot (BEiT/MAE attention
    runs MiTA, top-k and window: agent and block attention do not take its relative position
    bias)."""
    modules = [m for m in swapped.modules() if isinstance(m, MiTASettingsMixin)]
    runnable, skipped = [], {}
    for kind in (k for k in kinds if k != MITA):
        refusing = sorted({type(m).__name__ for m in modules if kind not in m.supported_kinds})
        if refusing:
            skipped[kind] = f"not run by {', '.join(refusing)}"
        else:
            runnable.append(kind)
    return tuple(runnable), skipped


def paper_settings(model: nn.Module, batch: dict, reduction: Optional[float],
                   topks: Sequence[int]) -> Tuple[List[Tuple[MiTASetting, float]], list]:
    """For each k of ``topks``, the MiTA setting ``P:k`` whose model FLOPs on ``batch``
    (:func:`~mita_seg.apis.sweep.model_gflops`, the sweep's column) come nearest
    ``reduction`` below ``model``'s unswapped, P up to the patch grid's side
    (:func:`~mita_seg.analysis.equal_cost.setting_at_reduction`: a few counts per k), with
    its reduction (a fraction; none for ``reduction`` None); and the attention calls of the
    model swapped to the paper's M = k = 49
    (:class:`~mita_seg.analysis.attention_macs.AttentionMacCounter`), which price any
    setting on it (:mod:`mita_seg.analysis.equal_cost`)."""
    probe, calls = copy.deepcopy(model), []
    swap_model(probe, PAPER.cfg(), verbose=False)
    attention_gmacs(probe, [batch], calls=calls)
    if reduction is None:
        return [], calls
    side = max(min(grid) for grid, *_ in calls)
    dense = model_gflops(model, batch)

    def flops(setting: MiTASetting) -> float:
        swap_model(probe, setting.cfg(), verbose=False)
        return model_gflops(probe, batch)

    found, start = [], None
    for k in topks:
        pools = [MiTASetting(pool_size=p, topk=k) for p in range(1, side + 1)]
        setting, r, start = setting_at_reduction(pools, reduction, dense, flops, start)
        found.append((setting, r))
    return found, calls


def run(study: ModelStudy) -> bool:
    """The encoder's sweep (the baseline row first, :attr:`ModelStudy.base`) and the
    every-key check: True if it ran."""
    s = study.s
    swept = study.stage(
        f'unswapped, {len(s.merge_ratios)} ToMe ratios, '
        f'{len(s.pool_sizes) * len(s.topks)} MiTA settings'
        + (f' (and {len(s.paper_topks)} at {100 * s.paper_reduction:.0f}% fewer FLOPs)'
           if s.paper_reduction else '') + ' and '
        f'{len(s.merged_swaps)} MiTA + ToMe in the encoder, no retraining',
        lambda: study.sweep_with(study.ckpt, osp.join(study.work_dir, 'sweep'),
                                 partial(_points, study), 'sweep ',
                                 after=partial(_checks, study), merge_cfg=ENCODER_ONLY))
    if swept is None:
        return False
    rows, checks = swept
    for r in rows:
        row = from_sweep(r, study.base)
        if r.point.method == 'swap' and r.point.setting in study.paper:
            row[PAPER_MARK] = 100 * s.paper_reduction
        study.result['rows'].append(row)
        study.base = study.base or study.result['rows'][0]
    if checks is not None:
        exact, controls = checks
        study.add_row(study_row('route-only MiTA, every key (check: = unswapped)', 'check',
                                None, 'N', dict(mIoU=exact), study.base))
        for setting, metrics in controls.items():
            M, k = (setting.num_experts, setting.topk) if setting.is_mita else (None, None)
            study.add_row(study_row(CONTROLS[setting], 'check', M, k, metrics, study.base),
                          **{CONTROL_MARK: setting.text})
    return True


def _paper(study: ModelStudy, model: nn.Module, batch: dict) -> None:
    """The settings at the paper's compression into :attr:`ModelStudy.paper` and the result
    (a note names them), with :func:`_state`."""
    s = study.s
    found = _state(study, model, batch)
    study.result['paper_compression'] = dict(
        target_percent=100 * s.paper_reduction,
        settings=[dict(setting=x.text, model_reduction_percent=100 * r) for x, r in found])
    if found:
        note = (f'the paper\'s compression, {100 * s.paper_reduction:.0f}% fewer model FLOPs: '
                + ', '.join(f'MiTA {x.text} ({100 * r:.1f}%)' for x, r in found)
                + f'; {found[0][0].text} also a budget of the taxonomy and the plans')
        study.result['notes'].append(note)
        study.progress(f'{study.name}: {note}')


def _state(study: ModelStudy, model: nn.Module, batch: dict) -> list:
    """What the later stages read of the sweep: the settings at the paper's compression
    (:attr:`ModelStudy.paper`), the attention calls (:attr:`ModelStudy.calls`), the
    taxonomy's kinds this model runs (:attr:`ModelStudy.runnable`, the others
    :attr:`ModelStudy.skipped`). Returns the paper's settings with their reductions."""
    s = study.s
    found, study.calls = paper_settings(model, batch, s.paper_reduction or None,
                                        s.paper_topks)
    swapped = copy.deepcopy(model)
    swap_model(swapped, PAPER.cfg(), verbose=False)
    study.runnable, study.skipped = split_kinds(swapped, s.kinds)
    study.paper = [setting for setting, _ in found]
    return found


def restore(study: ModelStudy) -> None:
    """The sweep of a resumed run (its rows already in the result): the unswapped row
    (:attr:`ModelStudy.base`), and :func:`_state` again from the model on one test batch."""
    study.base = study.result['rows'][0]
    runner, model = test_runner(study.config, study.opts, study.ckpt,
                                osp.join(study.work_dir, 'sweep'), study.s)
    _state(study, model, next(iter(runner.test_dataloader)))
    del runner, model
    gc.collect()


def _points(study: ModelStudy, runner: Runner, model: nn.Module) -> List[SweepPoint]:
    """The sweep's points; no ToMe points when the model has nothing to merge (a note)."""
    s = study.s
    swap_model(copy.deepcopy(model), {}, verbose=False)  # nothing to swap: error now
    _paper(study, model, next(iter(runner.test_dataloader)))
    ratios, merged = s.merge_ratios, s.merged_swaps
    if ratios or merged:
        error = merge_error(model)
        if error is not None:
            study.result['notes'].append(f'no ToMe rows: {error}')
            study.progress(f'{study.name}: no ToMe rows: {error}')
            ratios, merged = (), ()
    grid = sweep_points(s.pool_sizes, s.topks)
    return sweep_points(s.pool_sizes, s.topks, merge_ratios=ratios, merged_swaps=merged,
                        settings=[p for p in study.paper if SweepPoint('swap', p) not in grid])


def _checks(study: ModelStudy, runner: Runner, model: nn.Module,
            points: List[SweepPoint]) -> Optional[Tuple[float, Dict[MiTASetting, dict]]]:
    """The test input's shape, images and patch size into the result; the every-key
    mIoU and the metrics of each destructive control (:data:`CONTROLS`) the model's
    attention runs (a note names the others); None without the checks."""
    batch = next(iter(runner.test_dataloader))
    study.result['input'] = list(batch['inputs'][0].shape[-2:])
    study.result['test_images'] = len(runner.test_dataloader.dataset)
    study.result['patch_size'] = runner.cfg.model.backbone.get('patch_size')
    if not study.s.exact_check:
        return None
    study.progress(f'{study.name}: route-only MiTA with every key (exactly softmax attention)')
    if any(p.merge_ratio is not None for p in points):   # ToMe ran: unmerge
        merge_model(model, 0.0, verbose=False, **ENCODER_ONLY)
    exact = every_key_miou(runner, model, min(study.s.pool_sizes))
    swap_model(model, ONE_KEY.cfg(), verbose=False)   # MiTA: any kind's settings go on it
    controls = {}
    for setting in CONTROLS:
        _, skipped = split_kinds(model, (setting.kind, ))
        if skipped:
            note = f'no {setting.text} control row ({skipped[setting.kind]})'
            study.result['notes'].append(note)
            study.progress(f'{study.name}: {note}')
            continue
        study.progress(f'{study.name}: {CONTROLS[setting]}')
        swap_model(model, setting.cfg(), verbose=False)
        controls[setting] = dict(runner.test())
    return exact, controls
