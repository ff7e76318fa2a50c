"""Train a segmentor with MMEngine's Runner: mmseg's ``tools/train.py`` plus what it lacks.

Usage::

    python tools/train.py CONFIG [--work-dir DIR] [--resume] [--amp]
        [--cfg-options key=value ...] [--dense-attn {fast,mmseg}]
        [--launcher {none,pytorch,slurm,mpi}] [--verbose]

CONFIG is a file or ``mmseg::<dir>/<name>.py``. Besides mmseg's tool: any config gets the
crash-safe, strict, weights-only checkpoint hook; a schedule mmengine would fail on late
(``train_cfg.max_iters=abc``, a scheduler ending before it begins) is refused before the
work dir is made; ``--launcher pytorch`` runs on gloo
without CUDA; ``--amp`` is bf16 on CPU; dense attention runs on PyTorch's fused path
(``--dense-attn mmseg`` keeps mmseg's); the console leaves out the config dump (the log
file in the work dir keeps everything; ``--verbose`` shows it). Multi-GPU / multi-node:
``tools/dist_train.sh CONFIG GPUS [ARGS]``.
"""
import os.path as osp
import sys

# Make `mita_seg` importable from a checkout without installing it or setting PYTHONPATH.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

# the arguments are parsed (and refused) before the mm stack is imported, in main()
from mita_seg.cli import (KeyValueAction, add_dense_attn_arg, config_file, output_dir,  # noqa: E402
                          quiet_stack, run_tool)
from mita_seg.cli.core import ToolParser  # noqa: E402


def parse_args(argv=None):
    parser = ToolParser(description='Train a segmentor')
    parser.add_argument('config', type=config_file,
                        help="train config file, or 'mmseg::<dir>/<config>.py'")
    parser.add_argument('--work-dir', type=output_dir('--work-dir'),
                        help='the dir to save logs and models')
    parser.add_argument('--resume', action='store_true',
                        help='resume from the latest checkpoint in the work_dir automatically')
    parser.add_argument('--amp', action='store_true',
                        help='automatic mixed precision (fp16 on CUDA, bf16 on CPU)')
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction,
                        help='override settings of the config, key=value (a list: key="[a,b]")')
    add_dense_attn_arg(parser)
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--verbose', action='store_true',
                        help='print the config dump and environment as mmseg does')
    # torchrun passes --local-rank (and sets LOCAL_RANK)
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    quiet_stack()
    from mita_seg.apis import (build_runner, check_schedule, config_name, load_config,
                               prepare_config)
    cfg = check_schedule(load_config(args.config, args.cfg_options, args.work_dir))
    prepare_config(cfg, args.launcher, resume=args.resume, amp=args.amp,
                   local_rank=args.local_rank)
    runner = build_runner(cfg, args.verbose)
    runner.train()
    ckpt = runner.message_hub.get_info('last_ckpt')
    print(f'trained {config_name(args.config)} to iteration {runner.iter}; last checkpoint: '
          f'{ckpt}; log: {runner.log_dir}')
    return runner


if __name__ == '__main__':
    run_tool(main)
