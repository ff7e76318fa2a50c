"""The swap study's figures (:mod:`projects.swap_study.study` draws them), read from the
study's results (the JSON it writes): mIoU against cost for every model (:func:`plot_study`),
the MiTA-trained models against the test-time setting (:func:`plot_native`), the attention
kinds at equal cost (:func:`plot_kinds`)."""
from typing import List, Optional, Sequence

from mita_seg.analysis.equal_cost import TOLERANCE
from mita_seg.setting import MITA, OTHER_KINDS

__all__ = ['plot_study', 'plot_native', 'plot_kinds']

# the equal-cost figure's curves, in order: MiTA, the other kinds, ToMe; their colours and
# legend labels (a kind without one gets its name, in brown)
ATTENTION_KINDS = (MITA, ) + OTHER_KINDS + ('tome', )
KIND_COLOURS = dict(mita='tab:red', agent='tab:blue', block='tab:green', topk='tab:orange',
                    window='tab:gray', tome='tab:purple')
KIND_NAMES = dict(mita='MiTA (shared + routed experts)', agent='compression (agent)',
                  block='block routing (MoBA)', topk='per-query top-k', window='local window',
                  tome='ToMe (token merging)')


def _error_bars(ax, rows: Sequence[dict], key: Optional[str] = None, xs=None) -> None:
    """Each row's spread over the seeds (± its sample standard deviation) on mIoU, and on
    ``key`` (the x axis) if given; ``xs``: the x positions instead of ``r[key]``."""
    for i, r in enumerate(rows):
        std = r.get('std', {})
        if r.get('seeds', 1) > 1 and 'mIoU' in std:
            ax.errorbar([xs[i] if xs is not None else r[key]], [r['mIoU']], yerr=[std['mIoU']],
                        xerr=[std.get(key, 0.0)] if key else None, fmt='none', ecolor='0.35',
                        elinewidth=0.8, capsize=2, zorder=3)


GFLOPS_AXIS = 'model GFLOPs per image (1 MAC = 1 FLOP)'
# The panels of a model's column: (row key, x axis label, zoomed on the swaps).
STUDY_PANELS = (('model_GFLOPs', GFLOPS_AXIS, False),
                ('model_GFLOPs', GFLOPS_AXIS + ', zoomed', True),
                ('img_per_s', 'images/s measured (test mode, CPU)', False))


def _plot_swaps(ax, rows: Sequence[dict], key: str, lines: bool) -> List[dict]:
    """The unswapped model (star), the control (triangle), the sweep (a line per M when
    ``lines``, k annotated), ToMe (with the head too; r annotated), MiTA with the mask head
    and MiTA + ToMe on one panel; returns the sweep's rows."""
    for r in rows:
        if r['kind'] == 'baseline':
            ax.scatter([r[key]], [r['mIoU']], marker='*', s=220, c='k', zorder=4,
                       label='unswapped')
        elif r['kind'] == 'control':
            ax.scatter([r[key]], [r['mIoU']], marker='^', s=70, c='grey', zorder=4,
                       label=r['setting'])
    swaps = [r for r in rows if r['kind'] == 'swap']
    for M in sorted({r['M'] for r in swaps}):
        # FLOPs grow with k: a line per M; measured speed is noisy: markers only
        sel = sorted((r for r in swaps if r['M'] == M), key=lambda r: r['topk'])
        ax.plot([r[key] for r in sel], [r['mIoU'] for r in sel],
                'o-' if lines else 'o', ms=4, label=f'MiTA M={M}, no retraining')
        for r in sel:
            ax.annotate(f"k={r['topk']}", (r[key], r['mIoU']), fontsize=7,
                        textcoords='offset points', xytext=(3, 3))
    for kind, colour, what in (('tome', 'tab:purple', ''),
                               ('tome-head', 'olive', ', with the head')):
        tome = sorted((r for r in rows if r['kind'] == kind), key=lambda r: r['merge_ratio'])
        if tome:
            ax.plot([r[key] for r in tome], [r['mIoU'] for r in tome],
                    's--' if lines else 's', c=colour, ms=5,
                    label=f'ToMe{what}, no retraining')
        for r in tome:
            ax.annotate(f"r={r['merge_ratio']:g}", (r[key], r['mIoU']), fontsize=7,
                        textcoords='offset points', xytext=(3, -9), c=colour)
    for kind, marker, colour in (('swap-head', 'v', 'tab:cyan'),
                                 ('swap-head-routed', '1', 'tab:pink')):
        for r in (r for r in rows if r['kind'] == kind):
            ax.scatter([r[key]], [r['mIoU']], marker=marker, s=80, c=colour, zorder=5,
                       label=r['setting'])
    for r in (r for r in rows if r['kind'] == 'swap+tome'):
        ax.scatter([r[key]], [r['mIoU']], marker='X', s=70, c='tab:brown', zorder=5,
                   label=r['setting'])
    return swaps


def _plot_plans(ax, rows: Sequence[dict], key: str, lines: bool) -> None:
    """The calibrated plans on one panel: those of the main image count (plus signs,
    joined when ``lines``), the others apart with their image counts."""
    plans = [r for r in rows if r['kind'] == 'plan']
    if not plans:
        return
    main = max(p['plan']['images'] for p in plans)
    line = sorted((r for r in plans if r['plan']['images'] == main), key=lambda r: r[key])
    ax.plot([r[key] for r in line], [r['mIoU'] for r in line],
            'P-' if lines else 'P', c='tab:green', ms=8, zorder=5,
            label=f'calibrated per-layer plans ({main} images)')
    other = [r for r in plans if r['plan']['images'] != main]
    if other:
        ax.scatter([r[key] for r in other], [r['mIoU'] for r in other], marker='P',
                   s=50, c='yellowgreen', zorder=5, label='plans, fewer calibration images')
        for r in other:
            ax.annotate(f"{r['plan']['images']} img", (r[key], r['mIoU']),
                        fontsize=7, textcoords='offset points', xytext=(3, 3))


def _plot_finetuned(ax, rows: Sequence[dict], swaps: Sequence[dict], key: str,
                    lines: bool) -> None:
    """The fine-tuned swaps (diamonds), with an arrow from the same setting without
    retraining when ``lines``."""
    for r in (r for r in rows if r['kind'] == 'finetune'):
        ax.scatter([r[key]], [r['mIoU']], marker='D', s=60, c='tab:red', zorder=5,
                   label=r['setting'])
        src = [w for w in swaps if w['M'] == r['M'] and w['topk'] == r['topk']]
        if src and lines:
            ax.annotate('', (r[key], r['mIoU']), (src[0][key], src[0]['mIoU']),
                        arrowprops=dict(arrowstyle='->', color='tab:red', lw=1))


def _study_panel(ax, name: str, rows: Sequence[dict], key: str, label: str, zoom: bool,
                 first: bool) -> None:
    """One panel of :func:`plot_study`: every kind of row against ``key``, the spread over
    the seeds, the axes; the ``first`` of a column has the model's name and the legend."""
    lines = key == 'model_GFLOPs'   # joined on the FLOP panels (speed is noisy)
    swaps = _plot_swaps(ax, rows, key, lines)
    _plot_plans(ax, rows, key, lines)
    _plot_finetuned(ax, rows, swaps, key, lines)
    _error_bars(ax, rows, key)
    if zoom and rows:
        top = max(r['mIoU'] for r in rows)
        base = next((r['mIoU'] for r in rows if r['kind'] == 'baseline'), top)
        ax.set_ylim(base - 6, top + 0.8)
    ax.set_xlabel(label)
    ax.set_ylabel('mIoU (%)')
    ax.grid(alpha=0.3)
    if first:
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7, loc='best', framealpha=0.7)


def plot_study(models: Sequence[dict], out_png: str) -> str:
    """mIoU against model GFLOPs (top; below it the same zoomed on the 6 points under the
    unswapped model) and against measured images/s (bottom), one column per model: the
    unswapped model (star), the sweep (one colour per M, k annotated; joined
    in increasing k on the GFLOPs panel), ToMe (squares, r annotated), MiTA + ToMe (X), the
    calibrated plans (plus signs; those of the main image count joined), the fine-tuned
    swaps (diamonds; on the GFLOPs panel an arrow from the same setting without retraining),
    the control (triangle), MiTA with the mask head (down triangles: class tokens global;
    tri-downs: routed) and ToMe with the head (squares, olive); over seeds, each point is
    the mean with ± one sample standard deviation as error bars."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    n = max(1, len(models))
    fig, axes = plt.subplots(3, n, figsize=(5.4 * n, 12.0), squeeze=False)
    for col, res in enumerate(models):
        rows = [r for r in res['rows'] if r.get('model_GFLOPs') is not None]
        for row_i, (key, label, zoom) in enumerate(STUDY_PANELS):
            _study_panel(axes[row_i][col], res['name'], rows, key, label, zoom, row_i == 0)
    fig.suptitle('MiTA swap on toy segmenters (generated data, CPU) beside ToMe and '
                 'calibrated plans: mIoU against cost', fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def plot_native(res: dict, out_png: str) -> str:
    """Model ``res``'s MiTA-trained runs: mIoU against the test-time setting (left; one line
    per training setting, its own setting ringed, the standard-attention model's swap beside
    them, softmax attention at the right end) and the share of tokens no routed expert
    selects by layer (right)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    natives = [n for n in res['native'] if n.get('rows')]
    swaps = [r for r in res['rows'] if r['kind'] == 'swap']
    keys = sorted({(r['M'], r['topk']) for n in natives for r in n['rows']
                   if r['kind'] == 'native'} | {(r['M'], r['topk']) for r in swaps})
    labels = [f'M={int(round(M ** 0.5))}²\nk={k}' for M, k in keys] + ['softmax']
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.6),
                                  gridspec_kw=dict(width_ratios=[1.7, 1]))
    base = next(r for r in res['rows'] if r['kind'] == 'baseline')
    series = [('standard attention, swapped', 'k', swaps, base)]
    series += [(f"trained with MiTA {n['label']}", c,
                [r for r in n['rows'] if r['kind'] == 'native'],
                next((r for r in n['rows'] if r['kind'] == 'native-dense'), None))
               for n, c in zip(natives, ('tab:blue', 'tab:orange', 'tab:green', 'tab:red'))]
    for label, colour, rows, dense in series:
        by = {(r['M'], r['topk']): r for r in rows}
        xs = [i for i, mk in enumerate(keys) if mk in by]
        ax.plot(xs, [by[keys[i]]['mIoU'] for i in xs], 'o-', c=colour, ms=4, label=label)
        _error_bars(ax, [by[keys[i]] for i in xs], xs=xs)
        if dense is not None:
            ax.plot([len(keys)], [dense['mIoU']], 'o', c=colour, ms=6)
        for i in xs:
            if by[keys[i]].get('trained_setting'):
                ax.plot([i], [by[keys[i]]['mIoU']], 'o', ms=14, mfc='none', mec=colour, mew=2)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_xlabel('test-time setting (no retraining); ringed: the setting a model was '
                  'trained with')
    ax.set_ylabel('mIoU (%)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc='best', framealpha=0.7)
    sels = [('standard attention, swapped', 'k', res.get('selection'))] + [
        (f"trained {n['label']}", c, n.get('selection'))
        for n, c in zip(natives, ('tab:blue', 'tab:orange', 'tab:green', 'tab:red'))]
    for label, colour, sel in sels:
        if not sel:
            continue
        names = list(sel['layers'])
        ax2.plot(range(len(names)), [100 * sel['layers'][n]['never_selected'] for n in names],
                 'o-', c=colour, ms=4,
                 label=f"{label} (at {sel['label']})")
        ax2.set_xticks(range(len(names)))
        ax2.set_xticklabels([n.replace('decode_head', 'head').replace('backbone.', '')
                             .replace('.attn', '').replace('layers.', 'L') for n in names],
                            fontsize=7)
    ax2.set_xlabel('attention layer (backbone, then mask head)')
    ax2.set_ylabel('tokens no routed expert selects (%)')
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7, loc='best', framealpha=0.7)
    fig.suptitle(f"{res['name']}: trained with small or paper-size experts, evaluated at other "
                 'settings without retraining; token selection by depth', fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


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
            c = KIND_COLOURS.get(kind, 'tab:brown')
            xs, ys = [r['model_GFLOPs'] for r in sel], [r['delta_mIoU'] for r in sel]
            ax.plot(xs, ys, '-', c=c, lw=1.2, label=KIND_NAMES.get(kind, kind))
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
