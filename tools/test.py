"""Test (and evaluate) a segmentor with MMEngine's Runner (mmseg's tools/test.py, plus MiTA).

Usage::

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out DIR] [--show-dir DIR]
        [--tta] [--cfg-options key=value ...] [--launcher {none,pytorch,slurm,mpi}]
        [--swap-attn {none,mita}] [--mita-cfg pool_size=7 topk=49 ...]

``--swap-attn mita`` puts the attention of a standard mmseg ViT/DeiT/Segmenter model on MiTA
(:func:`mita_seg.swap_attention`) before evaluation, or reconfigures a MiTA model with
``--mita-cfg`` (M and k can change at test time). Swapping keeps parameter names, so the
checkpoint loads the same before or after it.

Multi-GPU / multi-node: ``tools/dist_test.sh CONFIG CHECKPOINT GPUS [ARGS]``.
"""
import argparse
import inspect
import os
import os.path as osp
import sys

# Make `mita_seg` importable from a checkout without installing it or setting PYTHONPATH.
sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.logging import print_log  # noqa: E402
from mmengine.model import is_model_wrapper  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

import mita_seg.models  # noqa: E402,F401  (registers MiTA modules)
from mita_seg.engine import use_safe_checkpoint  # noqa: E402
from mita_seg.models import MiTAAttention, swap_attention  # noqa: E402
from mita_seg.utils import setup_cpu_distributed  # noqa: E402

# Arguments of swap_attention / MiTAAttention that --mita-cfg may not set: structure, not
# MiTA settings (with_dwc would add untrained parameters).
_NOT_MITA_CFG = {
    'self', 'model', 'verbose', 'kwargs', 'mita_cfg', 'embed_dims', 'num_heads', 'attn_drop',
    'proj_drop', 'dropout_layer', 'qkv_bias', 'batch_first', 'init_cfg', 'with_dwc',
    'num_prefix_tokens'
}


def mita_cfg_keys() -> set:
    """The keys ``--mita-cfg`` accepts (MiTA settings, ``layers``, ``include_head``)."""
    keys = set(inspect.signature(swap_attention).parameters)
    keys |= set(inspect.signature(MiTAAttention.__init__).parameters)
    return keys - _NOT_MITA_CFG


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='MMSeg test (and eval) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument(
        '--work-dir',
        help='if specified, the evaluation metric results will be dumped '
        'into the directory as json')
    parser.add_argument(
        '--out', type=str,
        help='the directory to save output prediction for offline evaluation')
    parser.add_argument('--show', action='store_true', help='show prediction results')
    parser.add_argument(
        '--show-dir',
        help='directory where painted images will be saved (under work_dir/timestamp)')
    parser.add_argument('--wait-time', type=float, default=2, help='the interval of show (s)')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override some settings in the used config, the key-value pair '
        'in xxx=yyy format will be merged into config file')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    parser.add_argument('--tta', action='store_true', help='Test time augmentation')
    parser.add_argument(
        '--swap-attn',
        choices=['none', 'mita'],
        default='none',
        help='"mita": put the global attention of the model on MiTA (or reconfigure MiTA '
        'modules) before evaluation; "none": evaluate the model as configured')
    parser.add_argument(
        '--mita-cfg',
        nargs='+',
        action=DictAction,
        help='MiTA settings for --swap-attn mita, e.g. pool_size=7 topk=49 router_topk=1 '
        'with_shared_expert=True layers="[0,1]" include_head=False')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    if args.mita_cfg and args.swap_attn != 'mita':
        parser.error('--mita-cfg needs --swap-attn mita')
    unknown = sorted(set(args.mita_cfg or {}) - mita_cfg_keys())
    if unknown:
        parser.error(f'--mita-cfg: unknown keys {unknown}; '
                     f'choose from {sorted(mita_cfg_keys())}')
    return args


def trigger_visualization_hook(cfg, args):
    default_hooks = cfg.default_hooks
    if 'visualization' not in default_hooks:
        raise RuntimeError('VisualizationHook must be included in default_hooks, e.g. '
                           'visualization=dict(type="SegVisualizationHook")')
    visualization_hook = default_hooks['visualization']
    visualization_hook['draw'] = True
    if args.show:
        visualization_hook['show'] = True
        visualization_hook['wait_time'] = args.wait_time
    if args.show_dir:
        cfg.visualizer['save_dir'] = args.show_dir
    return cfg


def swap_runner_model(runner: Runner, mita_cfg: dict) -> int:
    """Put the attention of ``runner.model`` (unwrapped from DDP) on MiTA, in place.

    Settings missing from ``mita_cfg`` keep the values of a model already on MiTA (so
    ``topk=16`` changes only k), else they are :func:`mita_seg.swap_attention`'s defaults.

    Args:
        runner (Runner): a built runner; the checkpoint may be loaded before or after.
        mita_cfg (dict): arguments of :func:`mita_seg.swap_attention`.

    Returns:
        int: the number of attention modules on MiTA.
    """
    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    current = next((m for m in model.modules() if isinstance(m, MiTAAttention)), None)
    if current is not None:
        keep = set(inspect.signature(swap_attention).parameters) - {'model', 'layers',
                                                                    'include_head', 'verbose'}
        keep |= {'shared_scale'}
        mita_cfg = {**{k: getattr(current, k) for k in keep if hasattr(current, k)},
                    **mita_cfg}
    return swap_attention(model, **mita_cfg)


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

    cfg.load_from = args.checkpoint

    if args.show or args.show_dir:
        cfg = trigger_visualization_hook(cfg, args)

    if args.tta:
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model

    if args.out is not None:
        cfg.test_evaluator['output_dir'] = args.out
        cfg.test_evaluator['keep_results'] = True

    # strict checkpoint loading (a checkpoint that does not fit is an error)
    use_safe_checkpoint(cfg)
    setup_cpu_distributed(cfg, args.launcher)
    runner = Runner.from_cfg(cfg)
    if args.swap_attn == 'mita':
        # the runner loads the checkpoint in test(); parameter names are unchanged by the swap
        swap_runner_model(runner, dict(args.mita_cfg or {}))
    metrics = runner.test()
    if 'mIoU' in metrics:
        print_log(f'mIoU: {metrics["mIoU"]:.2f}', logger='current')
    return metrics


if __name__ == '__main__':
    main()
