"""The FLOP comparison of ``tools/get_flops.py`` in words and figures: the side-by-side
table of a :class:`~mita_seg.analysis.segmentor_cost.FlopComparison`, the MiTA settings of
a swapped model, and the counts of square inputs of several sizes (a sweep) as a table and a
plot."""
import time
from typing import Callable, List, Optional

from .flop_handles import CONVENTION, REL_POS_BIAS
from .plotting import save_figure, wrap_title

__all__ = ['count_sweep', 'format_sweep', 'plot_sweep', 'format_comparison',
           'mita_settings']


def count_sweep(counter: 'SegmentorFlops', sizes,  # noqa: F821
                progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Count square inputs of each size; ``progress`` (a callable taking a line) hears
    of each size before it is traced.

    Returns:
        list[dict]: per size: ``size``, ``baseline``, ``mita`` (total GFLOPs, mita None when
        not swapped), ``baseline_attention``, ``mita_attention`` (GFLOPs).
    """
    rows, t0 = [], time.time()
    for i, s in enumerate(sizes):
        if progress is not None:
            progress(f'[sweep {i + 1}/{len(sizes)}] {s}x{s}: tracing on {counter.device} '
                     f'({time.time() - t0:.0f}s elapsed)')
        base, mita = counter.count((s, s))
        rows.append(dict(size=s, baseline=base.total / 1e9,
                         mita=None if mita is None else mita.total / 1e9,
                         baseline_attention=base.attention / 1e9,
                         mita_attention=None if mita is None else mita.attention / 1e9))
    return rows


def format_sweep(rows, label: str = 'MiTA') -> str:
    """The rows of :func:`count_sweep` as a table (GFLOPs against input size)."""
    has_mita = rows[0]['mita'] is not None
    head = f'{"size":>10s}{"baseline":>12s}{"(attn)":>10s}'
    if has_mita:
        head += f'{label:>12s}{"(attn)":>10s}{"reduction":>11s}'
    lines = ['GFLOPs against input size (one forward, ' + CONVENTION.split(' (')[0] + ')', head]
    for r in rows:
        line = (f'{r["size"]:>4d}x{r["size"]:<5d}{r["baseline"]:12.1f}'
                f'{r["baseline_attention"]:10.1f}')
        if has_mita:
            red = 100 * (1 - r['mita'] / r['baseline'])
            line += f'{r["mita"]:12.1f}{r["mita_attention"]:10.1f}{red:10.1f}%'
        lines.append(line)
    return '\n'.join(lines)


def plot_sweep(rows, out: str, title: str, label: str = 'MiTA'):
    """GFLOPs against input size of the rows of :func:`count_sweep` (total and attention,
    baseline and the second model, named ``label`` as :attr:`FlopComparison.label` names
    it: ``MiTA``, ``window``, ``ToMe r=0.3``...; the total's reduction along the bottom),
    written whole to ``out``."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    sizes = [r['size'] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(sizes, [r['baseline'] for r in rows], 'o-', color='C0', label='baseline total')
    ax.plot(sizes, [r['baseline_attention'] for r in rows], 'o--', color='C0',
            label='baseline attention')
    if rows[0]['mita'] is not None:
        ax.plot(sizes, [r['mita'] for r in rows], 's-', color='C3', label=f'{label} total')
        ax.plot(sizes, [r['mita_attention'] for r in rows], 's--', color='C3',
                label=f'{label} attention')
        low = min(min(r['mita_attention'], r['baseline_attention']) for r in rows)
        ax.set_ylim(bottom=low / 4)  # room for the labels below the curves
        ax.set_xlim(sizes[0] / 1.35, sizes[-1] * 1.35)
        for r in rows:  # the reduction of the total, along the bottom of the plot
            ax.text(r['size'], 0.03, f"total -{100 * (1 - r['mita'] / r['baseline']):.0f}%",
                    transform=ax.get_xaxis_transform(), ha='center', fontsize=8, color='C3')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xticks(sizes, [f'{s}' for s in sizes])
    ax.set_xlabel('input size (pixels, square)')
    ax.set_ylabel('GFLOPs (1 MAC = 1 FLOP)')
    ax.set_title(wrap_title(title, fig.get_figwidth()), fontsize=9)   # whole, on 2+ lines
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


def format_comparison(c: 'FlopComparison', settings: str) -> str:  # noqa: F821
    """The side-by-side table of a :class:`FlopComparison`."""
    g = 1e9
    rows = [('total', 'total'), ('backbone', 'backbone'),
            ('  attention (QK^T, AV, SDPA, MiTA)', 'backbone_attention'),
            ('  rest (projections, MLP, embed)', 'backbone_rest')]
    if c.mita is not None and c.mita.token_merge:
        rows.append(('    of it ToMe (matching, merge)', 'token_merge'))
    if c.baseline.neck or (c.mita and c.mita.neck):
        rows.append(('neck', 'neck'))
    rows.append(('decode head', 'head'))
    if c.baseline.head_attention or (c.mita and c.mita.head_attention):
        rows.append(('  attention', 'head_attention'))
    H, W = c.shape
    lines = [f'FLOPs of {c.name}: input {H}x{W} (one crop, mode=\'tensor\', '
             'auxiliary head removed)',
             f'Convention: {CONVENTION}. GFLOPs = 1e9 MACs.']
    if c.baseline.by_operator.get(REL_POS_BIAS):
        lines.append('Relative position bias (BEiT/MAE), in attention: one add = one FLOP; '
                     'N^2 per head for the dense bias, mita_seg.ops.bias_flops_per_head in '
                     'MiTA.')
    if c.mita is not None and c.num_swapped:
        lines.append(f'{c.label.split("+")[0]}: {c.num_swapped} attention modules swapped, '
                     f'{settings}')
    if c.merge_ratio is not None:
        lines.append(f'ToMe: tokens merged at ratio {c.merge_ratio:g} in {c.num_merged} '
                     'encoder layers (before each attention and MLP, unmerged after; in a '
                     'layer on MiTA, before the MLP only); the matching (MACs) and the merge '
                     '(one add = one FLOP) counted in their own row')
    if c.note:
        lines.append(c.note)
    label = 'as config' if c.note.startswith('note: the config already') else 'baseline'
    head = f'{"":36s}{label:>12s}'
    if c.mita is not None:
        head += f'{c.label:>12s}{"reduction":>11s}'
    lines += ['', head]
    for label, key in rows:
        line = f'{label + " (GFLOPs)" if key == "total" else label:36s}'
        line += f'{getattr(c.baseline, key) / g:12.2f}'
        if c.mita is not None:
            line += f'{getattr(c.mita, key) / g:12.2f}'
            line += f'{c.reduction(key):10.1f}%' if key != 'token_merge' else ''
        lines.append(line)
    line = f'{"params (M)":36s}{c.baseline.params / 1e6:12.2f}'
    if c.mita is not None:
        line += f'{c.mita.params / 1e6:12.2f}'
    lines.append(line)
    if c.image is not None:
        im = c.image
        ih, iw = im['shape']
        ch, cw = im['crop_shape']
        how = 'whole'
        if im['mode'] == 'slide':
            how = f"slide: {im['crops']} crop{'s' * (im['crops'] > 1)} of {ch}x{cw}"
        lines.append(f'whole image {ih}x{iw} under test_cfg ({how}):')
        line = f'{"  total (GFLOPs)":36s}{im["baseline"] / g:12.2f}'
        if c.mita is not None and im.get('mita') is not None:
            red = 100.0 * (1 - im['mita'] / im['baseline'])
            line += f'{im["mita"] / g:12.2f}{red:10.1f}%'
        lines.append(line)
    return '\n'.join(lines)


def mita_settings(counter: 'SegmentorFlops') -> str:  # noqa: F821
    """The MiTA settings of the swapped model, as ``key=value`` pairs (a plan: its file and
    how many layers are dense; '' where only tokens are merged)."""
    from mita_seg.models import MiTASettingsMixin
    if counter.mita is None:
        return ''
    plan = (counter.mita_cfg or {}).get('plan')
    if plan is not None:
        return f'{plan.what} ({plan.summary()})'
    attn = next((m for m in counter.mita.modules() if isinstance(m, MiTASettingsMixin)), None)
    if attn is None:
        return ''
    return ', '.join(f'{k}={v}' for k, v in attn.setting.cfg().items())
