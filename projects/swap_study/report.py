"""The swap study's report (:mod:`projects.swap_study.study` writes it): the markdown tables
of ``swap_study.md`` and the figures, read from the study's results (the JSON it writes)."""
from typing import List, Optional, Sequence

from mita_seg.apis.sweep import FLOP_NOTE
from mita_seg.evaluation import ACCURACY_KEYS
from .kinds import kinds_markdown

# what the paper reports for the swap without retraining (Wen et al., arXiv 2602.01219)
PAPER_CLAIMS = ('about 1 mIoU point lost, up to 42% fewer FLOPs, swapping the attention of '
                'pretrained segmenters without retraining (ADE20K, N of about 1025 to 1601, '
                'M = k = 49)')


def _fmt(v, digits=2) -> str:
    if v is None:
        return ''
    if isinstance(v, float):
        return f'{v:.{digits}f}'
    return str(v)


COLUMNS = ['setting', 'M', 'k', 'mIoU', 'delta', 'delta by seed', 'model GFLOPs',
           'FLOPs saved', 'attn GMACs', 'img/s', 'speed-up']


def _pm(r: dict, key: str, sign: str = '') -> str:
    """``r[key]`` as ``mean ± std`` where the row is over seeds (``std``), else the value."""
    text = f'{r[key]:{sign}.2f}'
    std = r.get('std', {}).get(key)
    return text if std is None or r.get('seeds', 1) < 2 else f'{text} ± {std:.2f}'


def _table(rows: Sequence[dict]) -> List[str]:
    """Rows (:func:`_row`, or over seeds: :func:`~projects.swap_study.study.aggregate_rows`)
    as a markdown table of :data:`COLUMNS`."""
    out = ['| ' + ' | '.join(COLUMNS) + ' |',
           '|' + '|'.join(['---'] + ['---:'] * (len(COLUMNS) - 1)) + '|']
    for r in rows:
        by_seed = r.get('per_seed', {}).get('delta_mIoU', {})
        out.append('| ' + ' | '.join([
            r['setting'], _fmt(r['M']), _fmt(r['topk']), _pm(r, 'mIoU'),
            _pm(r, 'delta_mIoU', '+'), ' / '.join(f'{v:+.2f}' for v in by_seed.values()),
            _fmt(r.get('model_GFLOPs'), 4),
            _fmt(r.get('model_reduction_%'), 1) + ('%' if r.get('model_GFLOPs') else ''),
            _fmt(r.get('attn_GMACs'), 4), _fmt(r.get('img_per_s'), 2),
            (_fmt(r.get('speedup'), 2) + 'x') if r.get('speedup') else ''
        ]) + ' |')
    return out


def _evidence(rows: Sequence[dict]) -> List[str]:
    """Pixel accuracy by the evidence a label needs (the long-range scenes'
    ``EvidenceAccuracyMetric``: ``acc_context``, ...) for every row that has it."""
    rows = [r for r in rows if all(k in r for k in ACCURACY_KEYS)]
    if not rows:
        return []
    out = ['', 'Pixel accuracy (%) by the evidence a label needs (context: texture and the '
           'distant cue; object: own texture; retrieval: the distant partner; detail: poles):',
           '', '| row | ' + ' | '.join(k[len('acc_'):] for k in ACCURACY_KEYS) + ' |',
           '|---|' + '---:|' * len(ACCURACY_KEYS)]
    for r in rows:
        out.append(f"| {r['setting']} | " + ' | '.join(_pm(r, k) for k in ACCURACY_KEYS)
                   + ' |')
    return out


def best_uniform(rows: Sequence[dict], gflops: float) -> Optional[dict]:
    """The uniform MiTA row (no retraining) of highest mIoU at ``gflops`` or fewer."""
    within = [r for r in rows if r['kind'] == 'swap' and r['model_GFLOPs'] <= gflops + 1e-9]
    return max(within, key=lambda r: r['mIoU']) if within else None


def _equal_flops(rows: Sequence[dict]) -> List[str]:
    """ToMe, MiTA + ToMe and the calibrated plans, each beside the best uniform MiTA setting
    of the sweep at equal or lower FLOPs."""
    others = [r for r in rows if r['kind'] in ('tome', 'tome-head', 'swap+tome', 'plan')]
    if not others:
        return []
    out = ['', 'At equal or lower FLOPs: each ToMe, MiTA + ToMe and calibrated-plan row beside '
           'the best uniform MiTA setting of the sweep (no retraining) that costs no more:', '',
           '| row | GFLOPs | delta | best uniform MiTA at <= its GFLOPs | its GFLOPs | its delta '
           '| row minus uniform |', '|---|---:|---:|---|---:|---:|---:|']
    for r in others:
        u = best_uniform(rows, r['model_GFLOPs'])
        out.append(f"| {r['setting']} | {r['model_GFLOPs']:.4f} | {r['delta_mIoU']:+.2f} | " + (
            f"{u['setting']} | {u['model_GFLOPs']:.4f} | {u['delta_mIoU']:+.2f} | "
            f"{r['mIoU'] - u['mIoU']:+.2f} |" if u else 'none as cheap | | | |'))
    out += ['', '(means over the seeds)'] if any(r.get('seeds', 1) > 1 for r in rows) else []
    plans = [r for r in rows if r['kind'] == 'plan']
    if plans:
        layers = list(plans[0]['plan']['layers'])
        out += ['', "The plans' choice per layer (calibration error: the sum over layers of the "
                'mean per-pixel KL of the logits with that layer alone swapped, on the '
                'calibration images):', '',
                '| plan | ' + ' | '.join(n.replace('.attn', '') for n in layers) +
                ' | predicted error | calibration s |',
                '|---|' + '---|' * len(layers) + '---:|---:|']
        for r in plans:
            p = r['plan']
            out.append(f"| {r['setting']} | " + ' | '.join(p['layers'].get(n, '')
                                                          for n in layers)
                       + f" | {p['predicted_error']:.3g} | {p['calibration_seconds']:.0f} |")
    return out


def _native(res: dict) -> List[str]:
    """The MiTA-trained models: their rows, a cross table against the standard-attention
    model's swap, and token selection by depth."""
    natives = [n for n in res.get('native', []) if n.get('rows')]
    if not natives:
        return []
    out = ['', f"### {res['name']}: trained with MiTA from scratch, experts changed at test "
           'time', '']
    for n in natives:
        t = n['train']
        out += [f"Trained {t['iters']} iterations with MiTA {n['label']} from random weights "
                f"in {t['seconds']:.0f} s"
                + (' (an earlier run; checkpoint reused)' if t['reused'] else '') +
                '; evaluated at each setting with no retraining ("delta" against the '
                'standard-attention model unswapped):', '']
        out += _table(n['rows']) + ['']
    swaps = {(r['M'], r['topk']): r for r in res['rows'] if r['kind'] == 'swap'}
    keys = [(r['M'], r['topk']) for r in natives[0]['rows'] if r['kind'] == 'native']
    keys = sorted(set(keys), key=lambda mk: (mk[0], mk[1]))
    head = ['test-time setting', 'model GFLOPs', 'standard attention, swapped'] + [
        f"trained {n['label']}" for n in natives]
    out += ['mIoU by test-time setting (the trained setting in bold):', '',
            '| ' + ' | '.join(head) + ' |', '|---|' + '---:|' * (len(head) - 1)]
    for M, k in keys:
        p = int(round(M ** 0.5))
        cells = [f'M={p}x{p} k={k}', _fmt(swaps.get((M, k), {}).get('model_GFLOPs'), 4),
                 _fmt(swaps.get((M, k), {}).get('mIoU'))]
        for n in natives:
            r = next((r for r in n['rows'] if (r['M'], r['topk']) == (M, k)), None)
            v = _fmt(r['mIoU']) if r else ''
            cells.append(f'**{v}**' if r and r.get('trained_setting') else v)
        out.append('| ' + ' | '.join(cells) + ' |')
    dense = [next((r for r in n['rows'] if r['kind'] == 'native-dense'), None) for n in natives]
    if any(dense):
        base = next(r for r in res['rows'] if r['kind'] == 'baseline')
        out.append('| softmax attention (every key) | ' + _fmt(base['model_GFLOPs'], 4) +
                   f" | {base['mIoU']:.2f} | " + ' | '.join(_fmt(d['mIoU']) if d else ''
                                                         for d in dense) + ' |')
    sels = [(f"standard attention, swapped to {res['selection']['label']}",
             res['selection'])] if res.get('selection') else []
    sels += [(f"trained {n['label']}", n['selection'])
             for n in natives if n.get('selection')]
    if sels:
        layers = list(sels[0][1]['layers'])
        out += ['', 'Tokens no routed expert selects, by depth (mean over '
                f"{len(sels[0][1]['images'])} validation image(s)):", '',
                '| layer | ' + ' | '.join(w for w, _ in sels) + ' |',
                '|---|' + '---:|' * len(sels)]
        for layer in layers:
            out.append(f'| {layer} | ' + ' | '.join(
                f"{100 * sel['layers'][layer]['never_selected']:.1f}%"
                if layer in sel['layers'] else '' for _, sel in sels) + ' |')
    return out


def markdown(study: dict) -> str:
    """The study as markdown: the machine, then per model the tables and the selection."""
    m = study['machine']
    s = study['settings']
    out = [f"# MiTA swap study ({study['started']} to {study['finished']})", '',
           f"Machine: {m['cpu']}, "
           f"torch {m['torch']} with {m['threads']} thread(s); mmseg {m['mmseg']}, mmengine "
           f"{m['mmengine']}, mmcv {m['mmcv']}. Load average (1 min) over the run: "
           f"{study['load_range'][0]:.1f} to {study['load_range'][1]:.1f} "
           f"({m['cores']} cores: above {m['cores']} the cores were shared).", '',
           f"Data: {s['data_root']}. Training "
           + ("on each config's own schedule" if s['train_iters'] == 'config' else
              f"{s['train_iters']} iterations")
           + ''.join(f' ({k}: {v})' for k, v in (s.get('model_train_iters') or {}).items()) +
           f"; fine-tune and "
           f"control {s['finetune_iters']} iterations at {s['finetune_lr_mult']}x the "
           f"config's learning rate. img/s: test-mode `test_step` on one test batch, median "
           f"of torch.utils.benchmark.Timer ({s['speed_min_run_time']} s per row).", '',
           f'Cost columns: {FLOP_NOTE}.', '',
           f"Training seeds: {', '.join(str(v) for v in s['seeds'])} (`randomness.seed` of "
           'every training); each model is trained and studied once per seed, and every row '
           'gives the mean ± the sample standard deviation over the seeds (n - 1), the deltas '
           'per seed beside them; every value per seed is in the JSON. MiTA and ToMe rows '
           'without "with the head" swap or merge the encoder only (the paper\'s swap).', '',
           f'The paper reports {PAPER_CLAIMS}. The rows below are what a toy model trained for '
           'minutes on generated data shows, not what ADE20K gives.', '']
    for res in study['models']:
        out.append(f"## {res['name']} (`{res['config']}`)")
        out.append('')
        if 'train' in res:
            t = res['train']
            shape = res.get('input')
            patch = res.get('patch_size')
            grid = (f', patch {patch}: a {shape[0] // patch}x{shape[1] // patch} grid'
                    if shape and patch else '')
            took = f" in {t['seconds']:.0f} s" + (' (an earlier run; checkpoint reused)'
                                                  if t['reused'] else '')
            out.append(f"Trained {t['iters']} iterations with standard attention{took}"
                       f"{' (mean over the seeds)' if len(res.get('seeds', [])) > 1 else ''}; "
                       f"{res.get('test_images', '?')} test images of "
                       f"{shape[0] if shape else '?'}x{shape[1] if shape else '?'}{grid}; "
                       f"this model's study took {res.get('seconds', 0):.0f} s.")
            out.append('')
        out += _table([r for r in res['rows'] if r['kind'] != 'equal-cost'])
        out += _evidence(res['rows'])
        out += _equal_flops(res['rows'])
        out += kinds_markdown(res['rows'])
        sel = res.get('selection')
        if sel:
            out += ['', f"Tokens no routed expert selects (never read by one; seed "
                    f"{res.get('seeds', ['?'])[0]}), swapped to "
                    f"{sel['label']} without retraining, mean over {len(sel['images'])} "
                    'validation image(s):', '',
                    '| layer | grid | tokens | never selected | never used |',
                    '|---|---|---:|---:|---:|']
            for layer, v in sel['layers'].items():
                out.append(f"| {layer} | {v['grid'][0]}x{v['grid'][1]} | {v['tokens']} | "
                           f"{100 * v['never_selected']:.1f}% | {100 * v['never_used']:.1f}% |")
        out += _native(res)
        for note in res.get('notes', []):
            out += ['', f'Note: {note}']
        for e in res['errors']:
            out += ['', f'**Failed**: {e}']
        out.append('')
    out.append(f"Figures: {', '.join(study['figures'])}")
    return '\n'.join(out) + '\n'


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
