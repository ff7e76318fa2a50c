"""Test (and evaluate) a segmentor with MMEngine's Runner: mmseg's ``tools/test.py`` plus
``--swap-attn`` and ``--merge-ratio``.

Usage::

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out DIR] [--show-dir DIR]
        [--tta] [--cfg-options key=value ...] [--launcher {none,pytorch,slurm,mpi}]
        [--swap-attn mita] [--mita-cfg pool_size=7 topk=49 ... | --mita-plan PLAN.json]
        [--merge-ratio R]
        [--verbose]

CONFIG is a file or ``mmseg::<dir>/<name>.py``. ``--swap-attn mita`` (implied by
``--mita-cfg``) puts the attention of a standard mmseg ViT/DeiT/Segmenter model on MiTA
(:func:`mita_seg.swap_attention`) before evaluation, or reconfigures a MiTA model (M and k
can change at test time); ``--mita-plan`` gives each attention layer its own setting (a
swap plan, e.g. from ``tools/calibrate_swap.py``). ``--merge-ratio R`` merges that fraction
of the grid tokens before each attention and MLP of the ViT's layers and unmerges them after
each (token merging, ToMe, training-free: :func:`mita_seg.merge_tokens`), alone or with MiTA.
The checkpoint must fit the model exactly and is loaded
weights-only. The console leaves out the config dump and mmseg's per-class table (the log
file keeps them; ``--verbose`` shows them). Multi-GPU / multi-node:
``tools/dist_test.sh CONFIG CHECKPOINT GPUS [ARGS]``.
"""
import os
import os.path as osp
import sys

# Make `mita_seg` importable from a checkout without installing it or setting PYTHONPATH.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (InputError, KeyValueAction, add_merge_args, add_mita_args,  # noqa: E402
                          checkpoint_file, config_file, float_range, int_range, output_dir,
                          quiet_stack, run_tool, swap_settings)
from mita_seg.cli.core import ToolParser  # noqa: E402


def parse_args(argv=None):
    parser = ToolParser(description='MMSeg test (and eval) a model')
    parser.add_argument('config', type=config_file,
                        help="test config file, or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('checkpoint', type=checkpoint_file, help='checkpoint file')
    parser.add_argument('--work-dir', type=output_dir('--work-dir'),
                        help='the dir for logs and the metrics json')
    parser.add_argument('--out', type=output_dir('--out'),
                        help='the dir to save predictions (PNG) for offline evaluation')
    parser.add_argument('--show', action='store_true', help='show prediction results')
    parser.add_argument('--show-dir', type=output_dir('--show-dir'),
                        help='directory where painted images will be saved')
    parser.add_argument('--show-interval', type=int_range(1), default=1,
                        help='paint every n-th image with --show/--show-dir (default: every '
                        'image; mmseg configs say 50)')
    parser.add_argument('--wait-time', type=float_range(0), default=2,
                        help='the interval of show (s)')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override settings of the config, key=value')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--tta', action='store_true', help='test time augmentation')
    add_mita_args(parser)
    add_merge_args(parser)
    parser.add_argument('--verbose', action='store_true',
                        help="print the config dump and mmseg's per-class table")
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    args.mita = swap_settings(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.apis import (build_runner, config_name, keep_predictions, load_config,
                               merge_model, prepare_config, swap_model)
    from mita_seg.models import current_plan
    cfg = load_config(args.config, args.cfg_options, args.work_dir)
    if args.show or args.show_dir:
        hook = cfg.default_hooks.get('visualization')
        if hook is None:
            raise InputError(f'--show/--show-dir: config {args.config} has no '
                             'default_hooks.visualization; add one, e.g. '
                             'dict(type="SegVisualizationHook")')
        hook.update(draw=True, interval=args.show_interval, show=args.show,
                    wait_time=args.wait_time)
        if args.show_dir:
            cfg.visualizer['save_dir'] = args.show_dir
    if args.tta:
        if not cfg.get('tta_model') or not cfg.get('tta_pipeline'):
            raise InputError(f'--tta: config {args.config} has no tta_model/tta_pipeline '
                             "(mmseg's configs have them); add them or leave out --tta")
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
    if args.out is not None:
        keep_predictions(cfg, args.out)
    prepare_config(cfg, args.launcher, checkpoint=args.checkpoint, local_rank=args.local_rank)
    runner = build_runner(cfg, args.verbose)
    swapped = ''
    if args.mita is not None:
        # the runner loads the checkpoint in test(); the swap keeps parameter names
        n = swap_model(runner.model, args.mita)
        swapped = f', {n} attention modules on {current_plan(runner.model).swapped_as()}'
    if args.merge_ratio is not None:
        swapped += (f', tokens merged (ToMe r={args.merge_ratio:g}) in '
                    f'{merge_model(runner.model, args.merge_ratio)} layers')
    metrics = runner.test()
    images = len(runner.test_dataloader.dataset)
    print(f'{config_name(args.config)} on {images} images{swapped}: ' + '  '.join(
        f'{k}: {v:.2f}' for k, v in metrics.items() if isinstance(v, float)))
    plan = current_plan(runner.model, ran=True)
    if plan.layers:   # what the modules ran with (fitted to the grid), read from them
        print(f'attention as evaluated: {plan.describe()}')
    if args.out:
        print(f'predictions: {args.out}')
    if args.show_dir:
        painted = sum(f.endswith(('.png', '.jpg')) for _, _, files in os.walk(args.show_dir)
                      for f in files)
        print(f'painted {painted} images (every {args.show_interval}) under {args.show_dir}')
    print(f'log: {runner.log_dir}')
    return metrics


if __name__ == '__main__':
    run_tool(main)
