"""The swap sweep's results (:class:`~mita_seg.apis.sweep.SweepRow`, ``tools/swap_sweep.py``)
as tables and a plot: a markdown table and a CSV beside it, and mIoU against cost."""
import csv
import os.path as osp

from .plotting import wrap_title

__all__ = ['write_tables', 'plot_sweep']


def write_tables(rows, out_md, note):
    """Write ``rows`` (:class:`~mita_seg.apis.sweep.SweepRow`) as markdown and CSV beside
    it, without the columns no row has a value in; returns both paths."""
    stem = osp.splitext(out_md)[0]
    out_csv = stem + '.csv'
    out_md = stem + '.md'
    rows = [r.as_dict() for r in rows]
    keys = [k for k in rows[0] if any(r[k] is not None for r in rows)]
    rows = [{k: '' if r[k] is None else r[k] for k in keys} for r in rows]
    with open(out_csv, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(key, v):
        if not isinstance(v, float):
            return str(v)
        return f'{v:.4g}' if key.endswith(('GMACs', 'GFLOPs')) else f'{v:.2f}'

    lines = ['| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
    lines += ['| ' + ' | '.join(fmt(k, r[k]) for k in keys) + ' |' for r in rows]
    with open(out_md, 'w') as f:
        f.write('\n'.join(lines) + f'\n\n{note}\n')
    return out_md, out_csv


def plot_sweep(rows, out_png, title):
    """mIoU against whole-model GFLOPs and against attention GMACs of ``rows``
    (:class:`~mita_seg.apis.sweep.SweepRow`); one line per number of landmarks and one for
    ToMe's ratios, the plans as diamonds, the baseline as a star."""
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
        for m in sorted({r.M for r in swaps}):
            sel = sorted((r for r in swaps if r.M == m), key=x)
            ax.plot([x(r) for r in sel], [r.mIoU for r in sel], 'o-', label=f'MiTA M={m}')
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
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
