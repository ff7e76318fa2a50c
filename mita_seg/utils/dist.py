"""Distributed set-up for the tools on machines without CUDA (gloo on CPU)."""
import datetime
import os
import subprocess

import torch
import torch.distributed as torch_dist
from mmengine.config import Config
from mmengine.logging import print_log

# What each of MMEngine's launchers reads from the environment: (rank, world size, local
# rank); without the local rank, LOCAL_RANK stays as the tool set it (no device to pick on CPU).
LAUNCHER_RANKS = {
    'pytorch': ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'),
    'mpi': ('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_LOCAL_RANK'),
    'slurm': ('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID'),
}


def _torchrun_env(launcher: str, port=None) -> None:
    """Set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    from a launcher's own variables, as MMEngine's ``init_dist`` does for it (slurm: the
    first host of ``SLURM_NODELIST`` by ``scontrol``, ``port`` or ``MASTER_PORT`` or 29500;
    mpi: ``MASTER_ADDR`` as exported, ``MASTER_PORT`` or 29500)."""
    rank, world, local = LAUNCHER_RANKS[launcher]
    if launcher == 'pytorch':
        return
    os.environ['RANK'] = os.environ[rank]
    os.environ['WORLD_SIZE'] = os.environ[world]
    if local in os.environ:
        os.environ['LOCAL_RANK'] = os.environ[local]
    if port is not None:
        os.environ['MASTER_PORT'] = str(port)
    os.environ.setdefault('MASTER_PORT', '29500')
    if launcher == 'slurm' and 'MASTER_ADDR' not in os.environ:
        nodes = os.environ['SLURM_NODELIST']
        os.environ['MASTER_ADDR'] = subprocess.getoutput(
            f'scontrol show hostname {nodes} | head -n1')


def setup_cpu_distributed(cfg: Config, launcher: str) -> Config:
    """Let ``launcher='pytorch'``, ``'slurm'`` and ``'mpi'`` runs work on CPU.

    MMEngine's launchers call ``torch.cuda.set_device`` and the Runner wraps the model in
    DDP with ``device_ids=[LOCAL_RANK]``, both of which fail without CUDA. On such machines
    this initialises the process group with gloo itself, from the launcher's variables as
    MMEngine reads them (the Runner then skips its own ``init_dist``), and wraps the model
    with ``device_ids=None``. With CUDA, or without a launcher, nothing changes.

    Args:
        cfg (Config): the run's config; its ``model_wrapper_cfg`` gets ``device_ids=None``.
        launcher (str): the ``--launcher`` of the tool.

    Returns:
        Config: ``cfg``, changed in place.
    """
    if launcher not in LAUNCHER_RANKS or torch.cuda.is_available():
        return cfg
    dist_cfg = dict(cfg.get('env_cfg', {}).get('dist_cfg', {}))
    backend = dist_cfg.pop('backend', 'gloo')
    port = dist_cfg.pop('port', None)           # slurm's, for MMEngine's _init_dist_slurm
    dist_cfg.pop('init_backend', None)          # 'torch' is all there is on CPU
    if backend != 'gloo':
        print_log(f'no CUDA: using the gloo backend instead of {backend}', logger='current')
    if 'timeout' in dist_cfg:
        dist_cfg['timeout'] = datetime.timedelta(seconds=dist_cfg['timeout'])
    if not torch_dist.is_initialized():
        _torchrun_env(launcher, port)
        torch_dist.init_process_group(
            backend='gloo', rank=int(os.environ['RANK']),
            world_size=int(os.environ['WORLD_SIZE']), **dist_cfg)
    wrapper = cfg.get('model_wrapper_cfg') or dict(
        type='MMDistributedDataParallel', broadcast_buffers=False,
        find_unused_parameters=cfg.get('find_unused_parameters', False))
    wrapper['device_ids'] = None
    cfg.model_wrapper_cfg = wrapper
    return cfg
