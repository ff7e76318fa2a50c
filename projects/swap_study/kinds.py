"""The paper's taxonomy at equal cost, a stage of the study (issue 42): for each budget (the
attention MACs of the encoder swapped to a MiTA setting: the paper's M = k = 49 and lower
ones), each attention kind at the setting whose MACs come nearest that budget
(:func:`mita_seg.analysis.equal_cost.setting_at_cost`: compression ``agent``, block routing
``block``, per-query ``topk``, a local ``window``, and MiTA at the budget itself), and ToMe
at the ratio whose whole-model GFLOPs come nearest the budget's, all evaluated without
retraining; rows of kind ``equal-cost`` with ``attention`` (the kind), ``budget`` and
``cost_ratio`` (the row's cost over the budget's: attention MACs, for ToMe model GFLOPs),
``within`` (10%). A kind that cannot reach a budget (``topk`` scores every key) gets its
cheapest setting, marked. This module chooses the points, makes the rows, the markdown and
the figure."""
import copy
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from mita_seg.analysis.attention_macs import attention_gmacs
from mita_seg.analysis.equal_cost import TOLERANCE, cost_of, setting_at_cost, within
from mita_seg.apis import merge_model, swap_model
from mita_seg.apis.sweep import SweepPoint, SweepRow, model_gflops
from mita_seg.models import MiTASettingsMixin
from mita_seg.setting import MiTASetting

__all__ = ['ATTENTION_KINDS', 'split_kinds', 'match_budgets', 'kind_points', 'kind_rows',
           'kinds_markdown', 'plot_kinds']

ATTENTION_KINDS = ('mita', 'agent', 'block', 'topk', 'window', 'tome')
KIND_NAMES = dict(mita='MiTA (shared + routed experts)', agent='compression (agent)',
                  block='block routing (MoBA)', topk='per-query top-k', window='local window',
                  tome='ToMe (token merging)')


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


def split_kinds(swapped: nn.Module, kinds: Sequence[str]) -> Tuple[Tuple[str, ...],
                                                                   Dict[str, str]]:
    """``kinds`` (but ``mita``) as those that every attention of ``swapped`` (a model swapped
    to MiTA) can run, and the others, each with the modules that cannot (BEiT/MAE attention
    runs MiTA only: the other kinds do not take its relative position bias)."""
    modules = [m for m in swapped.modules() if isinstance(m, MiTASettingsMixin)]
    runnable, skipped = [], {}
    for kind in (k for k in kinds if k != 'mita'):
        refusing = sorted({type(m).__name__ for m in modules if kind not in m.supported_kinds})
        if refusing:
            skipped[kind] = f"not run by {', '.join(refusing)}"
        else:
            runnable.append(kind)
    return tuple(runnable), skipped


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
        for kind in ('mita', ) + runnable:
            setting, macs = (budget, target) if kind == 'mita' else setting_at_cost(
                kind, target, calls)
            entry['kinds'].append(dict(attention=kind, setting=setting.text,
                                       cost_ratio=macs / target, within=within(macs, target)))
        if merge_cfg is not None:
            r, g = tome_ratio_at(model, batch, gflops, merge_cfg)
            entry['kinds'].append(dict(attention='tome', merge_ratio=r, cost_ratio=g / gflops,
                                       within=within(g, gflops)))
        out.append(entry)
    return out


def _point(k: dict) -> SweepPoint:
    if k['attention'] == 'tome':
        return SweepPoint('tome', merge_ratio=k['merge_ratio'])
    return SweepPoint('swap', MiTASetting.parse(k['setting']))


def kind_points(matched: Sequence[dict]) -> List[SweepPoint]:
    """The sweep of the matched settings: the baseline, then each distinct point once, ToMe
    first (:func:`~mita_seg.apis.swap_sweep` merges the model as it is: before any swap)."""
    points = [SweepPoint('baseline')]
    for tome in (True, False):
        for entry in matched:
            for k in entry['kinds']:
                if (k['attention'] == 'tome') == tome and _point(k) not in points:
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
            what = (f"ToMe r={k['merge_ratio']:.3g}" if k['attention'] == 'tome' else
                    ('MiTA ' if k['attention'] == 'mita' else '')
                    + MiTASetting.parse(k['setting']).label)
            row = make_row(r, f"{what} at the cost of MiTA {entry['label']}")
            row.update(kind='equal-cost', attention=k['attention'], budget=entry['budget'],
                       cost_ratio=k['cost_ratio'], within=k['within'])
            out.append(row)
    return out


def _budgets(rows: Sequence[dict]) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for r in rows:
        if r['kind'] == 'equal-cost':
            out.setdefault(r['budget'], []).append(r)
    return out


def _paired(a: dict, b: dict) -> str:
    """Row ``a``'s mIoU minus row ``b``'s, seed by seed: mean ± sample std, and on how many
    seeds ``a`` is ahead."""
    from .study import _mean_std   # (study imports this module)
    sa, sb = (r.get('per_seed', {}).get('mIoU', {}) for r in (a, b))
    diffs = [sa[k] - sb[k] for k in sa if k in sb] or [a['mIoU'] - b['mIoU']]
    mean, std = _mean_std(diffs)
    return (f'{mean:+.2f} ± {std:.2f} (ahead on {sum(d > 0 for d in diffs)} of '
            f'{len(diffs)} seeds)')


def kinds_markdown(rows: Sequence[dict]) -> List[str]:
    """The equal-cost table of one model (its rows over seeds), and per budget which kind
    loses least and MiTA's difference from each other kind within the budget, paired by
    seed (the seeds' own spread cancels)."""
    from .report import _pm   # (report imports this module)
    budgets = _budgets(rows)
    if not budgets:
        return []
    out = ['', f'Attention kinds at equal cost, no retraining (each kind at the setting whose '
           f'encoder attention MACs come nearest the budget; ToMe at the nearest model '
           f'GFLOPs; "cost" is that over the budget, * where it is off by more than '
           f'{TOLERANCE:.0%}):', '',
           '| budget | kind | setting | cost | model GFLOPs | mIoU change | by seed | img/s |',
           '|---|---|---|---:|---:|---:|---|---:|']
    verdicts = []
    for budget, brows in budgets.items():
        for r in brows:
            by_seed = r.get('per_seed', {}).get('delta_mIoU', {})
            out.append(f"| {budget} | {r['attention']} | {r['setting'].split(' at the cost')[0]}"
                       f" | {r['cost_ratio']:.2f}{'' if r['within'] else ' *'} | "
                       f"{r['model_GFLOPs']:.4f} | {_pm(r, 'delta_mIoU', '+')} | "
                       + ' / '.join(f'{v:+.2f}' for v in by_seed.values())
                       + f" | {r['img_per_s']:.2f} |")
        fair = sorted((r for r in brows if r['within']), key=lambda r: -r['mIoU'])
        mita = next((r for r in brows if r['attention'] == 'mita'), None)
        if len(fair) > 1 and mita is not None:
            versus = [f"{r['attention']} {_paired(mita, r)}" for r in brows
                      if r is not mita and r['within']]
            verdicts.append(f"at the cost of MiTA {budget}: {fair[0]['attention']} loses "
                            f"least ({fair[0]['delta_mIoU']:+.2f}); MiTA minus each kind "
                            f"within the budget, paired by seed: {'; '.join(versus)}")
    return out + [''] + [f'- {v}' for v in verdicts]


def plot_kinds(models: Sequence[dict], out_png: str, title: str = '') -> str:
    """mIoU change against model GFLOPs, one curve per attention kind over the budgets (each
    point the mean over the seeds of the change against the same seed's unswapped model,
    ± its sample standard deviation: the seeds' own spread cancels; hollow where the kind is
    off its budget by more than the tolerance), the unswapped model a star at 0; a panel
    per model."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    n = max(1, len(models))
    fig, axes = plt.subplots(1, n, figsize=(6.4 * n, 5.0), squeeze=False)
    colours = dict(zip(ATTENTION_KINDS, ('tab:red', 'tab:blue', 'tab:green', 'tab:orange',
                                         'tab:gray', 'tab:purple')))
    for ax, res in zip(axes[0], models):
        base = next(r for r in res['rows'] if r['kind'] == 'baseline')
        ax.scatter([base['model_GFLOPs']], [0.0], marker='*', s=200, c='k', zorder=4,
                   label=f"unswapped ({base['mIoU']:.2f} mIoU)")
        rows = [r for r in res['rows'] if r['kind'] == 'equal-cost']
        for kind in ATTENTION_KINDS:
            sel = sorted((r for r in rows if r['attention'] == kind),
                         key=lambda r: r['model_GFLOPs'])
            if not sel:
                continue
            c = colours[kind]
            xs, ys = [r['model_GFLOPs'] for r in sel], [r['delta_mIoU'] for r in sel]
            ax.plot(xs, ys, '-', c=c, lw=1.2, label=KIND_NAMES[kind])
            for r, x, y in zip(sel, xs, ys):
                ax.plot([x], [y], 'o', c=c, mfc=c if r['within'] else 'white', ms=6)
                std = r.get('std', {}).get('delta_mIoU')
                if std and r.get('seeds', 1) > 1:
                    ax.errorbar([x], [y], yerr=[std], fmt='none', ecolor=c, capsize=2)
        ax.set_xlabel('model GFLOPs per image (1 MAC = 1 FLOP)')
        ax.set_ylabel('mIoU change against the unswapped model (points)')
        ax.set_title(f"{res['name']}, {len(res.get('seeds', [1]))} seed(s)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc='best', framealpha=0.7)
    fig.suptitle(title or 'Attention kinds swapped in without retraining at the attention '
                 'MACs of MiTA settings\n(mean ± std over seeds; hollow: off the budget by '
                 f'more than {TOLERANCE:.0%})', fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
