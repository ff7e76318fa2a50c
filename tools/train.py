"""Train a segmentor with MMEngine's Runner (mmseg's tools/train.py, plus mita_seg).

Usage::

    python tools/train.py CONFIG [--work-dir DIR] [--resume] [--amp]
        [--cfg-options key=value ...] [--launcher {none,pytorch,slurm,mpi}]

Multi-GPU / multi-node: ``tools/dist_train.sh CONFIG GPUS [ARGS]``.
"""
import argparse
import logging
import os
import os.path as osp
import sys

# Make `mita_seg` importable from a checkout without installing it or setting PYTHONPATH.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.logging import print_log  # noqa: E402
from mmengine.runner import Runner  # noqa: E402
from mmseg.registry import RUNNERS  # noqa: E402

import mita_seg.models  # noqa: E402,F401  (registers MiTA modules)
from mita_seg.engine import use_amp, use_safe_checkpoint  # noqa: E402
from mita_seg.utils import setup_cpu_distributed  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a segmentor')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume',
        action='store_true',
        default=False,
        help='resume from the latest checkpoint in the work_dir automatically')
    parser.add_argument(
        '--amp',
        action='store_true',
        default=False,
        help='enable automatic-mixed-precision training')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override some settings in the used config, the key-value pair '
        'in xxx=yyy format will be merged into config file. If the value to '
        'be overwritten is a list, it should be like key="[a,b]" or key=a,b')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    # torchrun passes --local-rank (and sets LOCAL_RANK)
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def main(argv=None):
    args = parse_args(argv)

    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)

    # work_dir: CLI > config > ./work_dirs/<config name>
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])

    if args.amp:
        if cfg.optim_wrapper.get('type') in ('AmpOptimWrapper', 'BF16AmpOptimWrapper'):
            print_log('AMP training is already enabled in your config.', logger='current',
                      level=logging.WARNING)
        # fp16 AmpOptimWrapper on CUDA (as mmseg), bf16 autocast on CPU
        use_amp(cfg)

    cfg.resume = args.resume
    # atomic checkpoint saving, RNG state in checkpoints, strict checkpoint loading
    use_safe_checkpoint(cfg)
    setup_cpu_distributed(cfg, args.launcher)

    if 'runner_type' not in cfg:
        runner = Runner.from_cfg(cfg)
    else:
        runner = RUNNERS.build(cfg)
    runner.train()
    return runner


if __name__ == '__main__':
    main()
