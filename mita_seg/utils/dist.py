"""Distributed set-up for the tools on machines without CUDA (gloo on CPU)."""
import datetime
import os

import torch
import torch.distributed as torch_dist
from mmengine.config import Config
from mmengine.logging import print_log


def setup_cpu_distributed(cfg: Config, launcher: str) -> Config:
    """Let ``launcher='pytorch'`` runs (``torchrun``) work on CPU.

    mmengine's pytorch launcher calls ``torch.cuda.set_device`` and wraps the model in DDP
    with ``device_ids=[LOCAL_RANK]``, both of which fail without CUDA. On such machines
    this initialises the process group with gloo itself (the Runner then skips its own
    ``init_dist``) and wraps the model with ``device_ids=None``. With CUDA, or without a
    launcher, nothing changes.

    Args:
        cfg (Config): the run's config; its ``model_wrapper_cfg`` gets ``device_ids=None``.
        launcher (str): the ``--launcher`` of the tool.

    Returns:
        Config: ``cfg``, changed in place.
    """
    if launcher != 'pytorch' or torch.cuda.is_available():
        return cfg
    dist_cfg = dict(cfg.get('env_cfg', {}).get('dist_cfg', {}))
    backend = dist_cfg.pop('backend', 'gloo')
    if backend != 'gloo':
        print_log(f'no CUDA: using the gloo backend instead of {backend}', logger='current')
    if 'timeout' in dist_cfg:
        dist_cfg['timeout'] = datetime.timedelta(seconds=dist_cfg['timeout'])
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(
            backend='gloo', rank=int(os.environ['RANK']),
            world_size=int(os.environ['WORLD_SIZE']), **dist_cfg)
    wrapper = cfg.get('model_wrapper_cfg') or dict(
        type='MMDistributedDataParallel', broadcast_buffers=False,
        find_unused_parameters=cfg.get('find_unused_parameters', False))
    wrapper['device_ids'] = None
    cfg.model_wrapper_cfg = wrapper
    return cfg
