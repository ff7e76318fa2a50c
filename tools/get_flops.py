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
from mita_seg.cli import (KeyValueAction, add_merge_args, add_mita_args, config_file,  # noqa: E402
                          ensure_parent, int_range, output_file, quiet_stack, run_tool,
                          swap_settings)
from mita_seg.cli.core import ToolParser  # noqa: E402


def parse_args(argv=None):
    parser = ToolParser(
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


def main(argv=None) -> dict:
    """Run the tool; returns the figures written with ``--json`` (``sweep`` rows too)."""
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.analysis.flop_report import (count_sweep, format_comparison, format_sweep,
                                               mita_settings, plot_sweep)
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
        result['sweep'] = count_sweep(
            counter, args.sweep, progress=lambda line: print(line, file=sys.stderr, flush=True))
        print()
        print(format_sweep(result['sweep'], comparison.label))
        if args.plot:
            what = 'baseline' if counter.mita is None else (
                f'baseline vs {comparison.label} ({mita_settings(counter) or "ToMe"})')
            plot_sweep(result['sweep'], ensure_parent(args.plot), f'{name}\n{what}',
                       comparison.label)
            print(f'wrote {args.plot}')
    if args.json:   # whole: a run killed while writing leaves the file that was there
        from mita_seg.utils.atomic_files import atomic_write_text
        atomic_write_text(json.dumps(result, indent=2) + '\n', ensure_parent(args.json))
        print(f'wrote {args.json}')
    return result


if __name__ == '__main__':
    run_tool(main)
