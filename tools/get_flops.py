"""FLOPs of an mmseg segmentor, attention included, and what swapping to MiTA (or merging
tokens, ToMe) saves.

Usage::

    python tools/get_flops.py CONFIG [--shape H [W]] [--image-shape H [W]]
        [--swap-attn mita] [--mita-cfg pool_size=7 topk=49 ... | --mita-plan PLAN.json]
        [--merge-ratio R]
        [--device {cpu,meta}]
        [--json OUT.json] [--sweep 512 1024 2048] [--plot OUT.png] [--cfg-options k=v ...]

Like mmseg's ``tools/analysis_tools/get_flops.py`` (one crop, ``mode='tensor'``, auxiliary
head removed, random weights, eval), but it works with mmengine 0.10.x and counts every
attention: mmcv/torch ``MultiheadAttention`` in any path, SDPA, ``baddbmm`` and MiTA
(:mod:`mita_seg.analysis`). One multiply-accumulate = one FLOP. CONFIG is a file or
``mmseg::<dir>/<name>.py``. ``--sweep`` counts square inputs of each size on the ``meta``
device (shapes only: the same trace and counts, no compute, no memory). A model with
nothing to swap is an error (exit status 1) listing its attention modules.
``--merge-ratio R`` counts the model with token merging (:func:`mita_seg.merge_tokens`,
alone or after the MiTA swap): the shorter sequences, and the matching and merging
themselves (their own row, "token merging").
"""
import argparse
import json
import os.path as osp
import sys
import time


# Make `mita_seg` importable from a checkout without installing it or setting PYTHONPATH.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.apis import add_merge_args, add_mita_args, swap_settings  # noqa: E402
from mita_seg.utils.cli import (KeyValueAction, config_file, ensure_parent,  # noqa: E402
                                int_range, output_file, quiet_stack, run_tool, wrap_title)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='FLOPs of a segmentor (attention included) and of its MiTA swap')
    parser.add_argument('config', type=config_file,
                        help="config file, or 'mmseg::<dir>/<config>.py'")
    # FLOPs do not depend on weights: a checkpoint given as mmseg's tools take one is refused
    parser.add_argument('checkpoint', nargs='?', help=argparse.SUPPRESS)
    parser.add_argument('--shape', type=int_range(1), nargs='+', default=None,
                        help='input shape H [W] of the counted forward (one crop); default: '
                        "the config's crop_size, else 512")
    parser.add_argument('--image-shape', type=int_range(1), nargs='+', default=None,
                        help='image shape H [W] for the whole-image cost under the '
                        "config's test_cfg (slide: crops x per-crop cost); default: --shape")
    add_mita_args(parser)
    add_merge_args(parser)
    parser.add_argument('--device', choices=['cpu', 'meta'], default='cpu',
                        help="'cpu' runs the forward (as mmseg's tool); 'meta' traces "
                        'shapes only (same counts, for large inputs)')
    parser.add_argument('--json', type=output_file('--json', ('.json', )),
                        help='write the figures (GFLOPs) to this JSON file (its folder is '
                        'made if missing)')
    parser.add_argument('--sweep', type=int_range(1), nargs='+', default=None,
                        help='also count square inputs of these sizes (meta device)')
    parser.add_argument('--plot', type=output_file('--plot', ('.png', '.pdf', '.svg')),
                        help='PNG of GFLOPs against input size (needs --sweep)')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    if args.checkpoint is not None:
        parser.error(f'{args.checkpoint!r}: get_flops.py takes no checkpoint (FLOPs depend on '
                     'the config alone, as counted on random weights): give only the config')
    args.mita = swap_settings(parser, args)
    if args.plot and not args.sweep:
        parser.error('--plot needs --sweep SIZES')
    for name in ('shape', 'image_shape'):
        value = getattr(args, name)
        if value is not None:
            if len(value) not in (1, 2):
                parser.error(f'--{name.replace("_", "-")} takes one or two positive ints '
                             f'(H [W]), got {len(value)}')
            setattr(args, name, tuple(value) * (3 - len(value)))
    return args


def sweep(counter: 'SegmentorFlops', sizes):  # noqa: F821
    """Count square inputs of each size; progress goes to stderr.

    Returns:
        list[dict]: per size: ``size``, ``baseline``, ``mita`` (total GFLOPs, mita None when
        not swapped), ``baseline_attention``, ``mita_attention`` (GFLOPs).
    """
    rows, t0 = [], time.time()
    for i, s in enumerate(sizes):
        print(f'[sweep {i + 1}/{len(sizes)}] {s}x{s}: tracing on {counter.device} '
              f'({time.time() - t0:.0f}s elapsed)', file=sys.stderr, flush=True)
        base, mita = counter.count((s, s))
        rows.append(dict(size=s, baseline=base.total / 1e9,
                         mita=None if mita is None else mita.total / 1e9,
                         baseline_attention=base.attention / 1e9,
                         mita_attention=None if mita is None else mita.attention / 1e9))
    return rows


def format_sweep(rows, label: str = 'MiTA') -> str:
    has_mita = rows[0]['mita'] is not None
    head = f'{"size":>10s}{"baseline":>12s}{"(attn)":>10s}'
    if has_mita:
        head += f'{label:>12s}{"(attn)":>10s}{"reduction":>11s}'
    from mita_seg.analysis.flop_handles import CONVENTION
    lines = ['GFLOPs against input size (one forward, ' + CONVENTION.split(' (')[0] + ')', head]
    for r in rows:
        line = (f'{r["size"]:>4d}x{r["size"]:<5d}{r["baseline"]:12.1f}'
                f'{r["baseline_attention"]:10.1f}')
        if has_mita:
            red = 100 * (1 - r['mita'] / r['baseline'])
            line += f'{r["mita"]:12.1f}{r["mita_attention"]:10.1f}{red:10.1f}%'
        lines.append(line)
    return '\n'.join(lines)


def plot_sweep(rows, out: str, title: str):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    sizes = [r['size'] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(sizes, [r['baseline'] for r in rows], 'o-', color='C0', label='baseline total')
    ax.plot(sizes, [r['baseline_attention'] for r in rows], 'o--', color='C0',
            label='baseline attention')
    if rows[0]['mita'] is not None:
        ax.plot(sizes, [r['mita'] for r in rows], 's-', color='C3', label='MiTA total')
        ax.plot(sizes, [r['mita_attention'] for r in rows], 's--', color='C3',
                label='MiTA attention')
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
    fig.savefig(out, dpi=120)
    plt.close(fig)


def format_comparison(c: 'FlopComparison', settings: str) -> str:  # noqa: F821
    """The side-by-side table of a :class:`FlopComparison`."""
    from mita_seg.analysis.flop_handles import CONVENTION, REL_POS_BIAS
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
        lines.append(f'MiTA: {c.num_swapped} attention modules swapped, {settings}')
    if c.merge_ratio is not None:
        lines.append(f'ToMe: tokens merged at ratio {c.merge_ratio:g} in {c.num_merged} '
                     'encoder layers (before each attention and MLP, unmerged after); the '
                     'matching (MACs) and the merge (one add = one FLOP) counted in their '
                     'own row')
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
    from mita_seg.models import MITA_KEYS, MiTASettingsMixin
    if counter.mita is None:
        return ''
    plan = (counter.mita_cfg or {}).get('plan')
    if plan is not None:
        return f'{plan.what} ({plan.summary()})'
    attn = next((m for m in counter.mita.modules() if isinstance(m, MiTASettingsMixin)), None)
    if attn is None:
        return ''
    return ', '.join(f'{k}={getattr(attn, k)}' for k in MITA_KEYS)


def main(argv=None) -> dict:
    """Run the tool; returns the figures written with ``--json`` (``sweep`` rows too)."""
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.analysis.segmentor_cost import SegmentorFlops, default_shape
    from mita_seg.apis import config_name, load_config
    cfg = load_config(args.config, args.cfg_options)
    shape = args.shape or default_shape(cfg)
    name = config_name(args.config)
    t0 = time.time()
    print(f'building {name} and tracing {shape[0]}x{shape[1]} on {args.device} ...',
          file=sys.stderr, flush=True)
    counter = SegmentorFlops(cfg, args.mita, device=args.device, name=name,
                             merge_ratio=args.merge_ratio)
    comparison = counter.compare(shape, args.image_shape)
    print(format_comparison(comparison, mita_settings(counter)))
    print(f'({time.time() - t0:.1f}s)', file=sys.stderr)
    result = comparison.to_json()
    if args.sweep:
        if args.device != 'meta':
            counter = SegmentorFlops(cfg, args.mita, device='meta', name=name,
                                     merge_ratio=args.merge_ratio)
        result['sweep'] = sweep(counter, args.sweep)
        print()
        print(format_sweep(result['sweep'], comparison.label))
        if args.plot:
            what = 'baseline' if counter.mita is None else (
                f'baseline vs {comparison.label} ({mita_settings(counter) or "ToMe"})')
            plot_sweep(result['sweep'], ensure_parent(args.plot), f'{name}\n{what}')
            print(f'wrote {args.plot}')
    if args.json:
        with open(ensure_parent(args.json), 'w') as f:
            json.dump(result, f, indent=2)
        print(f'wrote {args.json}')
    return result

if __name__ == '__main__':
    run_tool(main)
