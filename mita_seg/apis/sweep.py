"""Evaluate one standard-attention checkpoint unswapped, with token merging (ToMe) at
several ratios, on MiTA with several settings and with swap plans (per-layer settings)
(``tools/swap_sweep.py``): mIoU and cost of each point (:class:`SweepPoint`), one typed row
each (:class:`SweepRow`)."""
import itertools
import os.path as osp
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.nn as nn
from mmengine.model import is_model_wrapper
from mmengine.runner import Runner

from mita_seg.analysis.attention_macs import attention_gmacs
from mita_seg.models import SWAP_RULES, MiTASettingsMixin, SwapPlan
from mita_seg.ops.token_merge import check_ratio
from mita_seg.setting import MiTASetting, MiTASettingError, check_settings
from .model import swap_model
from .token_merge import merge_label, merge_model

FLOP_NOTE = ('attn_GMACs: analytic multiply-adds per image of the global attention layers '
             '(2 N^2 C standard, mita_seg.ops.mita_flops for MiTA; BEiT/MAE: plus the '
             'relative position bias adds, one add = one FLOP; ToMe: 2 N\'^2 C over the N\' '
             'merged tokens), counted on the calls the model makes; model_GFLOPs: whole '
             'model per image (mita_seg.analysis, jit trace with attention handles, times '
             'the test-mode crops); 1 MAC = 1 FLOP')


def run_key(setting: MiTASetting, ran: set) -> tuple:
    """What tells two sweep points apart as they run: for MiTA, the pools, ``k``,
    ``router_topk`` and ``N`` its calls ran with (:attr:`AttentionMacCounter.ran`: a pool
    larger than the grid, or ``k`` above ``N``, runs as a smaller one) and what no grid
    changes (the shared expert, its scale); another kind, its setting."""
    if not setting.is_mita:
        return (setting, )
    return frozenset(ran), setting.with_shared_expert, setting.shared_scale


def model_gflops(model: nn.Module, batch: dict) -> float:
    """Whole-model GFLOPs (MACs) of the first image of ``batch`` under the model's test
    mode: one traced ``mode='tensor'`` forward per crop, in eval mode (a model left in
    training mode after a training is put back in it: its BatchNorm statistics untouched),
    times the crops."""
    from mita_seg.analysis.flop_count import count_flops
    from mita_seg.analysis.segmentor_cost import inference_crops
    x = model.data_preprocessor(batch, False)['inputs'][:1]
    _, crops, (hc, wc) = inference_crops(getattr(model, 'test_cfg', None),
                                         tuple(x.shape[-2:]))
    training = model.training
    model.eval()
    try:
        return crops * count_flops(model, (x[..., :hc, :wc].contiguous(), )).total / 1e9
    finally:
        model.train(training)


SWEEP_METHODS = ('baseline', 'tome', 'swap', 'swap+tome', 'plan')


@dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep: how the model is evaluated.

    Args:
        method (str): ``baseline`` (as configured), ``tome`` (token merging at
            ``merge_ratio``), ``swap`` (MiTA at ``setting``), ``swap+tome`` (both) or
            ``plan`` (the swap plan ``plan``).
        setting (MiTASetting, optional): the MiTA setting of ``swap`` and ``swap+tome``.
        merge_ratio (float, optional): the ToMe ratio of ``tome`` and ``swap+tome``.
        plan (SwapPlan, optional): the plan of ``plan``.

    Raises:
        ValueError: an unknown method, or a field the method needs missing (or one it has no
            use for given), a ``setting`` that is not one (``MiTASettingError``: a
            :class:`MiTASetting`, its text ``'7:49'`` or a dict of settings), or a
            ``merge_ratio`` outside ``[0, 0.5]`` (TypeError: not a number).
    """
    method: str
    setting: Optional[MiTASetting] = None
    merge_ratio: Optional[float] = None
    plan: Optional[SwapPlan] = field(default=None, compare=False)

    def __post_init__(self):
        # any spelling of a setting, and the ratio, checked here: not after the baseline ran
        object.__setattr__(self, 'setting', MiTASetting.of(self.setting))
        if self.merge_ratio is not None:
            object.__setattr__(self, 'merge_ratio', check_ratio(self.merge_ratio))
        if self.method not in SWEEP_METHODS:
            raise ValueError(f'sweep point method {self.method!r}: one of '
                             f'{", ".join(SWEEP_METHODS)}')
        given = dict(setting=self.setting is not None, merge_ratio=self.merge_ratio is not None,
                     plan=self.plan is not None)
        needs = dict(setting=self.method in ('swap', 'swap+tome'),
                     merge_ratio=self.method in ('tome', 'swap+tome'), plan=self.method == 'plan')
        if given != needs:
            raise ValueError(f'a {self.method!r} sweep point takes '
                             + (', '.join(k for k, v in needs.items() if v) or 'nothing')
                             + f'; got {", ".join(k for k, v in given.items() if v) or "none"}')


def sweep_points(pool_sizes: Sequence[int] = (),
                 topks: Sequence[int] = (),
                 mita_cfg: Optional[dict] = None,
                 merge_ratios: Sequence[float] = (),
                 merged_swaps: Sequence[Tuple[MiTASetting, float]] = (),
                 plans: Sequence[SwapPlan] = (),
                 settings: Sequence[MiTASetting] = ()) -> List[SweepPoint]:
    """The points of a sweep, in the order :func:`swap_sweep` evaluates them: the baseline,
    ToMe at every ratio, MiTA at every ``(pool size, top-k)`` (with the further MiTA
    settings ``mita_cfg``: ``router_topk``...), each of ``settings`` (any kind:
    ``agent:7``, ``block:8:4``...), MiTA with ToMe, the plans.

    Raises:
        MiTASettingError: a bad setting, or ``mita_cfg`` with another key than a MiTA
            setting (not ``pool_size``/``topk``, which the sweep sets).
    """
    extra = dict(mita_cfg or {})
    for key in ('pool_size', 'topk'):
        if key in extra:
            raise MiTASettingError(f'mita_cfg sets {key}, which the sweep sets (pool_sizes, '
                                   'topks)')
    points = [SweepPoint('baseline')]
    points += [SweepPoint('tome', merge_ratio=r) for r in merge_ratios]
    points += [SweepPoint('swap', MiTASetting.from_cfg(dict(extra, pool_size=p, topk=k)))
               for p, k in itertools.product(pool_sizes, topks)]
    points += [SweepPoint('swap', s) for s in settings]
    points += [SweepPoint('swap+tome', s, r) for s, r in merged_swaps]
    points += [SweepPoint('plan', plan=p) for p in plans]
    return points


@dataclass
class SweepRow:
    """What one :class:`SweepPoint` gave.

    Attributes:
        point (SweepPoint): what was asked.
        label (str): what ran, for tables and plots (``MiTA M=16x16 k=49 (asked
            M=20x20)``, ``ToMe r=0.40``, ``plan p.json``).
        ran (str, optional): the MiTA setting as it ran (``M=16x16 k=49 (asked M=20x20)``)
            for ``swap`` and ``swap+tome``; else None.
        M (int, optional): the landmarks that ran (the largest grid's) for ``swap`` and
            ``swap+tome``; else None.
        mIoU, mAcc, aAcc (float): the test metrics.
        attn_GMACs (float): analytic attention multiply-adds per image (:data:`FLOP_NOTE`).
        model_GFLOPs (float): whole-model GFLOPs per image.
        attn_reduction, model_reduction (float): % below the baseline row.
        delta_mIoU (float): mIoU minus the baseline's.
        extra (dict): the test loop's other metrics (a config's further evaluators:
            ``acc_retrieval``, ...) and ``measure``'s columns.
    """
    point: SweepPoint
    label: str
    ran: Optional[str]
    M: Optional[int]
    mIoU: float
    mAcc: float
    aAcc: float
    attn_GMACs: float
    model_GFLOPs: float
    attn_reduction: float = 0.0
    model_reduction: float = 0.0
    delta_mIoU: float = 0.0
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def method(self) -> str:
        """How the point was evaluated (:attr:`SweepPoint.method`)."""
        return self.point.method

    @property
    def topk(self) -> Optional[int]:
        """The ``k`` asked, for ``swap`` and ``swap+tome`` of a kind that has one (MiTA,
        top-k); else None."""
        setting = self.point.setting
        return setting.topk if setting is not None and 'topk' in setting.record.keys else None

    @property
    def merge_ratio(self) -> Optional[float]:
        return self.point.merge_ratio

    def as_dict(self) -> Dict[str, Any]:
        """The row for CSV and JSON: ``setting`` (the label), ``kind`` (the
        :attr:`method`: the files' column keeps its name), ``M``, ``topk``, ``merge_ratio``,
        the metrics and costs, the reductions (``attn_reduction_%``,
        ``model_reduction_%``), ``delta_mIoU`` and ``measure``'s columns."""
        return dict(setting=self.label, kind=self.method, M=self.M, topk=self.topk,
                    merge_ratio=self.merge_ratio, mIoU=self.mIoU, mAcc=self.mAcc,
                    aAcc=self.aAcc, attn_GMACs=self.attn_GMACs, model_GFLOPs=self.model_GFLOPs,
                    **{'attn_reduction_%': self.attn_reduction,
                       'model_reduction_%': self.model_reduction},
                    delta_mIoU=self.delta_mIoU, **self.extra)


def _check_order(points: Sequence[SweepPoint]) -> None:
    """Raise ``ValueError`` unless the baseline comes first and every ``tome`` point before
    the first point that swaps (a swap is not undone: a later merge would merge the
    swapped model)."""
    if not points or points[0].method != 'baseline':
        raise ValueError('swap_sweep: the first point must be the baseline (the reductions '
                         'and deltas are against it); use sweep_points()')
    swapped = [i for i, p in enumerate(points) if p.method in ('swap', 'swap+tome', 'plan')]
    late = [p for p in points[swapped[0]:] if p.method == 'tome'] if swapped else []
    if late:
        raise ValueError(f'swap_sweep: ToMe point r={late[0].merge_ratio} comes after a swap, '
                         'which is not undone: put every tome point before the swaps '
                         '(sweep_points() does)')


def swap_sweep(runner: Runner,
               points: Sequence[SweepPoint],
               swap_cfg: Optional[dict] = None,
               flops_images: int = 1,
               progress: Optional[Callable[[str], None]] = None,
               measure: Optional[Callable[[nn.Module, dict], Dict]] = None,
               merge_cfg: Optional[dict] = None) -> List[SweepRow]:
    """Evaluate ``runner``'s model (checkpoint in ``load_from``) at every point of
    ``points`` (:func:`sweep_points`), in turn, on the same model: as configured, with
    token merging (ToMe, :func:`mita_seg.merge_tokens`), swapped to MiTA, both, or on a swap
    plan; the model is unmerged again before a point that does not merge.

    Args:
        runner (Runner): a built runner with a test loop and ``load_from``.
        points (Sequence[SweepPoint]): what to evaluate, the baseline first.
        swap_cfg (dict, optional): the layer choice of every swap (``layers``,
            ``include_head`` of :func:`~mita_seg.swap_attention`). Default: None.
        flops_images (int): test images the attention MACs are averaged over. Default: 1.
        progress (Callable, optional): called with a line per step.
        measure (Callable, optional): ``measure(model, batch)`` -> further columns of each
            row, measured on the model as evaluated (e.g. images/s) with the first test
            batch (:attr:`SweepRow.extra`). Default: None.
        merge_cfg (dict, optional): further :func:`mita_seg.merge_tokens` arguments of
            every merged point (``include_head``, ``layers``). Default: None.

    Returns:
        list[SweepRow]: one row per point that ran, the baseline first; its ``label`` and
        ``M`` say what ran (:meth:`~mita_seg.setting.MiTASetting.ran_label`: a pool larger
        than the grid runs on the grid). A ``swap`` point that runs exactly as an earlier one
        (two pools clamped to the same grid, two ``k`` of at least ``N``) is not evaluated
        again, and has no row (``progress`` says so).

    Raises:
        ValueError: the first point is not the baseline, or a ``tome`` point follows a
            point that swaps (a swap is not undone: it would merge the swapped model);
            ``MiTASettingError``: ``swap_cfg`` or ``merge_cfg`` with another key than
            ``layers`` and ``include_head``, or a bad value (before anything runs).
    """
    _check_order(points)
    progress = progress or (lambda line: None)
    merge_cfg, swap_cfg = dict(merge_cfg or {}), dict(swap_cfg or {})
    check_settings(swap_cfg, SWAP_RULES)      # a point's setting is the whole setting
    check_settings(merge_cfg, SWAP_RULES)     # merge_tokens' layers and include_head
    batches = list(itertools.islice(iter(runner.test_dataloader), flops_images))
    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    rows: List[SweepRow] = []
    seen: Dict[frozenset, str] = {}      # what ran -> the label of its row
    merged = False
    first = {}                         # method -> index of its first point (verbose once)
    t0 = time.time()
    for i, point in enumerate(points):
        verbose = first.setdefault(point.method, i) == i and point.method in ('tome', 'swap')
        if merged and point.method != 'tome':
            merge_model(model, 0.0, verbose=False, **merge_cfg)  # exactly unmerged again
            merged = False
        ran: set = set()
        attn = ran_label = M = None   # attn after runner.test(), which sets eval(), if None
        if point.method == 'baseline':
            configured = any(isinstance(m, MiTASettingsMixin) for m in model.modules())
            label = 'baseline (MiTA as configured)' if configured else 'baseline'
        elif point.method == 'tome':
            merge_model(model, point.merge_ratio, verbose=verbose, **merge_cfg)
            merged, label = True, merge_label(point.merge_ratio)
        elif point.method == 'plan':
            swap_model(model, dict(plan=point.plan), verbose=False)
            label = f'plan {osp.basename(point.plan.source) or i}'
        else:   # swap, swap+tome: what runs, counted first
            setting = point.setting
            swap_model(model, dict(swap_cfg, setting=setting), verbose=verbose)
            if point.method == 'swap+tome':
                merge_model(model, point.merge_ratio, verbose=False, **merge_cfg)
                merged = True
            attn = attention_gmacs(model, batches, ran)
            if setting.is_mita:
                ran_label = setting.ran_label({p for p, *_ in ran},
                                              [k < setting.topk for _, k, _, _ in ran])
                M = max((h * w for (h, w), *_ in ran), default=setting.num_experts)
                label = f'MiTA {ran_label}'
            else:  # another kind of the taxonomy: as asked
                ran_label = label = setting.label
            if point.method == 'swap+tome':
                label += f' + {merge_label(point.merge_ratio)}'
            else:
                key = run_key(setting, ran)
                same = seen.get(key)
                if same is not None:
                    progress(f'[{i + 1}/{len(points)}] MiTA {point.setting.label} runs '
                             f'exactly as {same!r} on these inputs: not evaluated again, no row')
                    continue
                seen[key] = label
        progress(f'[{i + 1}/{len(points)}] {label}: evaluating '
                 f'({time.time() - t0:.0f}s elapsed)')
        metrics = runner.test()
        if attn is None:
            attn = attention_gmacs(model, batches)
        row = SweepRow(point, label, ran_label, M, mIoU=float(metrics['mIoU']),
                       mAcc=float(metrics['mAcc']), aAcc=float(metrics['aAcc']),
                       attn_GMACs=attn, model_GFLOPs=model_gflops(model, batches[0]),
                       extra={k: float(v) for k, v in metrics.items()
                              if k not in ('mIoU', 'mAcc', 'aAcc')})
        base = rows[0] if rows else row
        row.attn_reduction = 100.0 * (1 - row.attn_GMACs / base.attn_GMACs)
        row.model_reduction = 100.0 * (1 - row.model_GFLOPs / base.model_GFLOPs)
        row.delta_mIoU = row.mIoU - base.mIoU
        if measure is not None:
            row.extra.update(measure(model, batches[0]))
        rows.append(row)
        progress(f'[{i + 1}/{len(points)}] {label}: mIoU {row.mIoU:.2f}, attention '
                 f'{row.attn_GMACs:.3f} GMACs/img, model {row.model_GFLOPs:.3f} GFLOPs/img')
    return rows
