"""The swap study's report (:mod:`projects.swap_study.study` writes it): the markdown tables
of ``swap_study.md``, read from the study's results (the JSON it writes); the figures are
:mod:`projects.swap_study.figures`'."""
from typing import Dict, List, Optional, Sequence

from mita_seg.analysis.equal_cost import TOLERANCE
from mita_seg.apis.sweep import FLOP_NOTE
from mita_seg.evaluation import ACCURACY_KEYS
from mita_seg.setting import MITA
from .stats import paired, pm

__all__ = ['PAPER_CLAIMS', 'COLUMNS', 'markdown', 'rows_table', 'kinds_markdown',
           'evidence_table', 'equal_flops_table', 'native_tables', 'best_uniform']

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


def rows_table(rows: Sequence[dict]) -> List[str]:
    """Rows (:func:`~projects.swap_study.rows.study_row`, or over seeds:
    :func:`~projects.swap_study.rows.aggregate_rows`)
    as a markdown table of :data:`COLUMNS`."""
    out = ['| ' + ' | '.join(COLUMNS) + ' |',
           '|' + '|'.join(['---'] + ['---:'] * (len(COLUMNS) - 1)) + '|']
    for r in rows:
        by_seed = r.get('per_seed', {}).get('delta_mIoU', {})
        out.append('| ' + ' | '.join([
            r['setting'], _fmt(r['M']), _fmt(r['topk']), pm(r, 'mIoU'),
            pm(r, 'delta_mIoU', '+'), ' / '.join(f'{v:+.2f}' for v in by_seed.values()),
            _fmt(r.get('model_GFLOPs'), 4),
            _fmt(r.get('model_reduction_%'), 1) + ('%' if r.get('model_GFLOPs') else ''),
            _fmt(r.get('attn_GMACs'), 4), _fmt(r.get('img_per_s'), 2),
            (_fmt(r.get('speedup'), 2) + 'x') if r.get('speedup') else ''
        ]) + ' |')
    return out


def evidence_table(rows: Sequence[dict]) -> List[str]:
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
        out.append(f"| {r['setting']} | " + ' | '.join(pm(r, k) for k in ACCURACY_KEYS)
                   + ' |')
    return out


def best_uniform(rows: Sequence[dict], gflops: float) -> Optional[dict]:
    """The uniform MiTA row (no retraining) of highest mIoU at ``gflops`` or fewer."""
    within = [r for r in rows if r['kind'] == 'swap' and r['model_GFLOPs'] <= gflops + 1e-9]
    return max(within, key=lambda r: r['mIoU']) if within else None


def equal_flops_table(rows: Sequence[dict]) -> List[str]:
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
            cells = ' | '.join(p['layers'].get(n, '') for n in layers)
            out.append(f"| {r['setting']} | {cells} | {p['predicted_error']:.3g} | "
                       f"{p['calibration_seconds']:.0f} |")
    return out


def native_tables(res: dict) -> List[str]:
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
        out += rows_table(n['rows']) + ['']
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
        cells = ' | '.join(_fmt(d['mIoU']) if d else '' for d in dense)
        out.append('| softmax attention (every key) | ' + _fmt(base['model_GFLOPs'], 4) +
                   f" | {base['mIoU']:.2f} | {cells} |")
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


def _budgets(rows: Sequence[dict]) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for r in rows:
        if r['kind'] == 'equal-cost':
            out.setdefault(r['budget'], []).append(r)
    return out


def kinds_markdown(rows: Sequence[dict]) -> List[str]:
    """The equal-cost table of one model (its rows over seeds), and per budget which kind
    loses least and MiTA's difference from each other kind within the budget, paired by
    seed (the seeds' own spread cancels)."""
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
                       f"{r['model_GFLOPs']:.4f} | {pm(r, 'delta_mIoU', '+')} | "
                       + ' / '.join(f'{v:+.2f}' for v in by_seed.values())
                       + f" | {r['img_per_s']:.2f} |")
        fair = sorted((r for r in brows if r['within']), key=lambda r: -r['mIoU'])
        mita = next((r for r in brows if r['attention'] == MITA), None)
        if len(fair) > 1 and mita is not None:
            versus = [f"{r['attention']} {paired(mita, r)}" for r in brows
                      if r is not mita and r['within']]
            verdicts.append(f"at the cost of MiTA {budget}: {fair[0]['attention']} loses "
                            f"least ({fair[0]['delta_mIoU']:+.2f}); MiTA minus each kind "
                            f"within the budget, paired by seed: {'; '.join(versus)}")
    return out + [''] + [f'- {v}' for v in verdicts]


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
        out += rows_table([r for r in res['rows'] if r['kind'] != 'equal-cost'])
        out += evidence_table(res['rows'])
        out += equal_flops_table(res['rows'])
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
        out += native_tables(res)
        for note in res.get('notes', []):
            out += ['', f'Note: {note}']
        for e in res['errors']:
            out += ['', f'**Failed**: {e}']
        out.append('')
    out.append(f"Figures: {', '.join(study['figures'])}")
    return '\n'.join(out) + '\n'
