"""The swap sweep's results (:class:`~mita_seg.apis.sweep.SweepRow`, ``tools/swap_sweep.py``)
as tables and a plot: a markdown table and a CSV beside it, and mIoU against cost."""
import csv
import io
import os.path as osp

from mita_seg.utils.atomic_files import atomic_write_text
from .plotting import save_figure, wrap_title

__all__ = ['write_tables', 'plot_sweep']


def write_tables(rows, out_md, note):
    """Write ``rows`` (:class:`~mita_seg.apis.sweep.SweepRow`) as markdown and CSV beside
    it, without the columns no row has a value in, each file whole
    (:func:`~mita_seg.utils.atomic_files.atomic_write_text`: a failed or killed write leaves
    the file that was there); returns both paths."""
    stem = osp.splitext(out_md)[0]
    out_csv = stem + '.csv'
    out_md = stem + '.md'
    rows = [r.as_dict() for r in rows]
    keys = [k for k in rows[0] if any(r[k] is not None for r in rows)]
    rows = [{k: '' if r[k] is None else r[k] for k in keys} for r in rows]
    table = io.StringIO(newline='')
    writer = csv.DictWriter(table, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)

    def fmt(key, v):
        if not isinstance(v, float):
            return str(v)
        return f'{v:.4g}' if key.endswith(('GMACs', 'GFLOPs')) else f'{v:.2f}'

    lines = ['| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
    lines += ['| ' + ' | '.join(fmt(k, r[k]) for k in keys) + ' |' for r in rows]
    atomic_write_text(table.getvalue(), out_csv)
    atomic_write_text('\n'.join(lines) + f'\n\n{note}\n', out_md)
    return out_md, out_csv


def _variant(row) -> tuple:
    """What a MiTA row's setting sets besides its pool and k, in its label's words
    (``('route-only',)``, ``('router_topk=2',)``; ``()`` for the shared expert and one
    expert per query)."""
    return tuple(w for w in row.point.setting.label.split(' ')
                 if not w.startswith(('M=', 'k=')))


def plot_sweep(rows, out_png, title):
    """mIoU against whole-model GFLOPs and against attention GMACs of ``rows``
    (:class:`~mita_seg.apis.sweep.SweepRow`); one line per number of landmarks (and
    variant: route-only, ``router_topk``...) and one for ToMe's ratios, the plans as
    diamonds, the baseline as a star; written whole to ``out_png``."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    base = rows[0]
    for ax, key, xlabel in ((axes[0], 'model_GFLOPs', 'model GFLOPs per image'),
                            (axes[1], 'attn_GMACs', 'attention GMACs per image')):
        x = lambda r: getattr(r, key)  # noqa: E731
        ax.scatter([x(base)], [base.mIoU], marker='*', s=200, c='k', label=base.label,
                   zorder=3)
        tome = sorted((r for r in rows if r.method == 'tome'), key=x)
        if tome:
            ax.plot([x(r) for r in tome], [r.mIoU for r in tome], 'D--', c='C7',
                    label='ToMe (token merging)')
            for r in tome:
                ax.annotate(f'r={r.merge_ratio:g}', (x(r), r.mIoU), fontsize=7,
                            textcoords='offset points', xytext=(3, -9))
        for r in (r for r in rows if r.method in ('plan', 'swap+tome')):
            ax.scatter([x(r)], [r.mIoU], marker='D', s=60, zorder=3, label=r.label)
        swaps = [r for r in rows if r.method == 'swap' and r.point.setting.is_mita]
        # a line per M and variant: route-only or another router_topk is another attention
        for m, variant in sorted({(r.M, _variant(r)) for r in swaps}):
            sel = sorted((r for r in swaps if (r.M, _variant(r)) == (m, variant)), key=x)
            ax.plot([x(r) for r in sel], [r.mIoU for r in sel], 'o-',
                    label=' '.join((f'MiTA M={m}', ) + variant))
            for r in sel:
                ax.annotate(f'k={r.topk}', (x(r), r.mIoU), fontsize=7,
                            textcoords='offset points', xytext=(3, 3))
        others = [r for r in rows if r.method == 'swap' and not r.point.setting.is_mita]
        for kind in sorted({r.point.setting.kind for r in others}):  # the other kinds
            sel = sorted((r for r in others if r.point.setting.kind == kind), key=x)
            ax.plot([x(r) for r in sel], [r.mIoU for r in sel], 's--', label=kind)
            for r in sel:
                ax.annotate(r.label, (x(r), r.mIoU), fontsize=7, textcoords='offset points',
                            xytext=(3, -9))
        ax.set_xlabel(f'{xlabel} (1 MAC = 1 FLOP)')
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('mIoU (%)')
    axes[1].legend(fontsize=8)
    fig.suptitle(wrap_title(title, fig.get_figwidth()), fontsize=9)
    fig.tight_layout()
    save_figure(fig, out_png)
    plt.close(fig)
    return out_png
