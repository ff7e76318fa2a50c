"""A stand-in for a released checkpoint, made offline: the model of a config with seeded
random weights, saved in the model zoo's format (``{'meta': ..., 'state_dict': ...}``), so
that what takes a checkpoint (the README's swap example, :func:`~mita_seg.apis.init_model`,
every tool) runs without the internet. It loads strictly into the same config and swaps as
the released one does; its segmentation is noise (nothing is trained).
"""
import copy
import io
import os.path as osp
from typing import Optional

import torch
from mmengine.config import Config

from mita_seg.utils.cfg_options import blame_cfg_options, merge_cfg_options
from mita_seg.utils.errors import InputError
from .config import config_name, load_config
from .model import dataset_meta

__all__ = ['STANDIN_NOTE', 'make_standin_checkpoint', 'is_standin']

# What the checkpoint's meta says it is.
STANDIN_NOTE = ('seeded random weights, not trained: a stand-in for a released checkpoint '
                '(tools/make_standin_checkpoint.py), to run the commands offline')


def is_standin(path: str) -> bool:
    """Whether ``path`` is a checkpoint :func:`make_standin_checkpoint` wrote (its meta says
    so); False for any other file, readable or not."""
    from mita_seg.utils.checkpoint import load_local_checkpoint
    try:
        meta = load_local_checkpoint(path, map_location='cpu').get('meta') or {}
    except Exception:  # noqa: BLE001  (not a checkpoint at all: not a stand-in either)
        return False
    return isinstance(meta, dict) and isinstance(meta.get('stand_in'), dict)


def make_standin_checkpoint(config, out: str, seed: int = 0,
                            cfg_options: Optional[dict] = None, force: bool = False) -> dict:
    """Write the model of ``config`` with seeded random weights to ``out``, in the model
    zoo's format: ``meta`` (the dataset's class names and palette, ``stand_in``: what it
    is, the config and the seed) and ``state_dict``. The same config, seed and mmseg give
    the same file, byte for byte. Written atomically (a file is never half there).

    Args:
        config (str | Config): a config file, ``'mmseg::<dir>/<name>.py'`` or a ``Config``.
        out (str): the ``.pth`` to write (its folders are made).
        seed (int): the random seed of the weights. Default: 0.
        cfg_options (dict, optional): ``--cfg-options`` merged into the config (into a
            copy of a ``Config``).
        force (bool): replace a file at ``out`` that is not a stand-in (an empty one, as a
            failed download leaves, and an earlier stand-in are replaced anyway).
            Default: False.

    Returns:
        dict: ``path``, ``config`` (its name), ``parameters`` (the number), ``bytes``.

    Raises:
        InputError: ``out`` holds another file (a real checkpoint, say) and not ``force``;
        CfgOptionsError: the model cannot be built with a ``cfg_options`` value.
    """
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    from mita_seg.utils.atomic_files import atomic_write_bytes
    import mita_seg.models  # noqa: F401  (registers MiTA types for MiTA configs)
    size = osp.getsize(out) if osp.isfile(out) else 0
    if size and not force and not is_standin(out):
        size = f'{size / 2**20:.1f} MB' if size >= 2**20 else f'{size} bytes'
        raise InputError(f'{out} exists ({size}) and is not a stand-in made by this command '
                         '(a downloaded checkpoint?): give another --out, or --force to '
                         'replace it')
    if isinstance(config, Config):   # its --cfg-options too, the caller's config untouched
        cfg = merge_cfg_options(copy.deepcopy(config), cfg_options)
    else:
        cfg = load_config(config, cfg_options)
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.pretrained = None              # no download: the weights are the seed's
    model_cfg.pop('train_cfg', None)
    if isinstance(model_cfg.get('backbone'), dict):
        model_cfg.backbone.init_cfg = None
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    torch.manual_seed(seed)
    with blame_cfg_options(cfg, 'the model', ('model', )):
        model = MODELS.build(model_cfg)
    source = config if isinstance(config, str) else (cfg.filename or 'config')
    meta = dict(stand_in=dict(note=STANDIN_NOTE, config=source, seed=seed))
    classes = dataset_meta(cfg, None)
    if classes:
        meta['dataset_meta'] = dict(
            classes=list(classes.get('classes') or ()),
            palette=[list(map(int, c)) for c in classes.get('palette') or ()])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    buffer = io.BytesIO()      # not saved to a temporary name: the archive would carry it
    torch.save({'meta': meta, 'state_dict': state}, buffer)
    atomic_write_bytes(buffer.getvalue(), out)
    return dict(path=out, config=config_name(source),
                parameters=sum(p.numel() for p in model.parameters()), bytes=osp.getsize(out))
