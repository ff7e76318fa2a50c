"""Sweep MiTA settings on one checkpoint trained with standard attention.

Evaluates the checkpoint unswapped (baseline), with token merging at each ``--merge-ratios``
(ToMe, ``mita_seg.merge_tokens``, training-free: its peer) and after
``mita_seg.swap_attention`` with every (pool size, top-k) pair, on the config's test set
with mmengine's Runner (the same pipeline, whole/slide mode and metric as ``tools/test.py``;
:func:`mita_seg.apis.swap_sweep`), and writes a CSV and a markdown table (mIoU and cost per
setting) and a plot of mIoU against cost.

Cost: the attention multiply-adds (one MAC = one FLOP, mmengine's convention) of every
global attention layer, counted per image on the first test image(s) as the model runs
them (all crops in slide mode), and the whole-model count (a jit trace with attention
handles, times the crops of the test mode). ``--swap-attn SETTING`` (any kind, ``--mita-cfg``'s
keys over it, as every tool reads it) and ``--settings`` add rows after the grid,
``--mita-plan`` a row for a swap plan (per-layer settings, ``tools/calibrate_swap.py``)
after them.

Each row says what ran: a pool larger than the patch grid runs on the grid and its row is
labelled with the landmarks used (``MiTA M=16x16 k=49 (asked M=20x20)``), ``k >= N`` is
``(every key)``, and a setting that runs exactly as an earlier row is not evaluated again
(the progress line says so). ``--help`` shows the defaults.

Usage::

    python tools/swap_sweep.py CONFIG CHECKPOINT --pool-sizes 5 7 --topks 25 49 \\
        [--mita-cfg router_topk=1 with_shared_expert=True layers=[0,1] include_head=True] \\
        [--swap-attn 4:16] [--settings agent:7 window:7] \\
        [--merge-ratios 0.2 0.4] [--mita-plan PLAN.json] \\
        [--work-dir DIR] [--out DIR/table.md] [--plot DIR/sweep.png] [--cfg-options k=v ...]
"""
import argparse
import copy
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (KeyValueAction, add_merge_args, add_mita_args,  # noqa: E402
                          checkpoint_file, config_file, ensure_parent, int_range, output_dir,
                          output_file, quiet_stack, run_tool, setting_arg)
from mita_seg.cli.core import ToolParser  # noqa: E402
from mita_seg.cli.swap_args import sweep_swaps  # noqa: E402


def parse_args(argv=None):
    parser = ToolParser(description='Sweep MiTA (pool size, top-k) settings '
                        'on a checkpoint trained with standard attention',
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('config', type=config_file,
                        help="test config file, or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('checkpoint', type=checkpoint_file,
                        help='checkpoint file (standard attention)')
    parser.add_argument('--pool-sizes', type=int_range(1), nargs='+', default=[5, 7],
                        help='landmark grid sides P (M = P*P experts; a P larger than the '
                        'patch grid runs on the grid, and its row says so)')
    parser.add_argument('--topks', type=int_range(1), nargs='+', default=[25, 49],
                        help='keys per routed expert')
    add_mita_args(parser, swap_flag=False, exclude=('pool_size', 'topk'))
    add_merge_args(parser, sweep=True)
    parser.add_argument('--settings', type=setting_arg, nargs='+', default=[],
                        metavar='SETTING',
                        help='more settings to sweep, of any kind: 7:49, agent:7 (compression '
                        'only), block:8:4 (block routing), topk:49 (per-query top-k), window:7 '
                        '(a local window)')
    parser.add_argument('--flops-images', type=int_range(1), default=1,
                        help='test images to count attention MACs on (per-image mean)')
    parser.add_argument('--work-dir', type=output_dir('--work-dir'),
                        help='directory for logs and outputs (default: '
                        'work_dirs/swap_sweep/<config>)')
    parser.add_argument('--out', type=output_file('--out', ('.md', '.csv')),
                        help='table path; both .md and .csv are written '
                        '(default: WORK_DIR/swap_sweep.md)')
    parser.add_argument('--plot', type=output_file('--plot', ('.png', '.pdf', '.svg')),
                        help='plot path (default: WORK_DIR/swap_sweep.png)')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override config settings, key=value')
    parser.add_argument('--verbose', action='store_true',
                        help="print the config dump and mmseg's per-class tables")
    args = parser.parse_args(argv)
    quiet_stack()
    # --swap-attn, --mita-cfg and --mita-plan read as every tool reads them; a whole setting
    # (--mita-cfg's keys over it) is one more row, a plan one more row after the grid
    args.swaps = sweep_swaps(parser, args, args.pool_sizes, args.settings)
    return args


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.apis import (build_runner, config_name, load_config, merge_model,
                               prepare_config, swap_model, swap_sweep)
    from mita_seg.analysis.sweep_report import plot_sweep, write_tables
    from mita_seg.apis.sweep import FLOP_NOTE, sweep_points
    cfg = load_config(args.config, args.cfg_options, args.work_dir or osp.join(
        'work_dirs', 'swap_sweep', config_name(args.config)))
    prepare_config(cfg, checkpoint=args.checkpoint)
    out_md = args.out or osp.join(cfg.work_dir, 'swap_sweep.md')
    out_png = args.plot or osp.join(cfg.work_dir, 'swap_sweep.png')
    runner = build_runner(cfg, args.verbose)
    # nothing to swap is an error before the baseline is evaluated
    swaps = args.swaps
    swap_model(copy.deepcopy(runner.model), dict(swaps.swap_cfg), verbose=False)
    if args.merge_ratios:  # and nothing to merge too
        merge_model(copy.deepcopy(runner.model), args.merge_ratios[0], verbose=False)
    for plan in swaps.plans:  # a plan for another model is an error before the baseline too
        swap_model(copy.deepcopy(runner.model), dict(plan=plan), verbose=False)
    points = sweep_points(args.pool_sizes, args.topks, swaps.grid_cfg,
                          merge_ratios=args.merge_ratios, plans=swaps.plans,
                          settings=swaps.settings)
    rows = swap_sweep(runner, points, swaps.swap_cfg, args.flops_images,
                      progress=lambda line: print(f'[swap_sweep] {line}', flush=True))

    batch = next(iter(runner.test_dataloader))
    shape = tuple(batch['inputs'][0].shape[-2:])
    mode = cfg.model.get('test_cfg', {}).get('mode', 'whole')
    note = (f'{FLOP_NOTE}; counted on {args.flops_images} test batch(es), first input '
            f'{shape[0]}x{shape[1]}, test mode {mode!r}. Checkpoint: {args.checkpoint}.')
    md, csv_path = write_tables(rows, ensure_parent(out_md), note)
    png = plot_sweep(rows, ensure_parent(out_png),
                     f'{osp.basename(args.config)} ({mode} inference)')
    print(f'\n{"setting":<28}{"mIoU":>8}{"delta":>8}{"model GFLOPs":>14}{"attn GMACs":>12}')
    for r in rows:
        print(f'{r.label:<28}{r.mIoU:8.2f}{r.delta_mIoU:+8.2f}'
              f'{r.model_GFLOPs:14.4g}{r.attn_GMACs:12.4g}')
    print(f'wrote {md}, {csv_path}, {png}')
    return rows


if __name__ == '__main__':
    run_tool(main)
