"""Segmentors for the tools: built from a config, checkpoint loaded strictly and
weights-only, optionally swapped to MiTA."""
from typing import Optional, Union

import torch.nn as nn
from mmengine.config import Config
from mmengine.model import is_model_wrapper, revert_sync_batchnorm

from mita_seg.models import check_dense_attn, guard_grids, swap_attention
from mita_seg.utils.checkpoint import load_checkpoint
from .config import load_config, use_dense_attn, use_slim_inference


def swap_model(model: nn.Module, mita_cfg: dict, verbose: bool = True) -> int:
    """:func:`mita_seg.swap_attention` on ``model`` (unwrapped from DDP), settings of
    ``--mita-cfg`` (MiTA settings, ``layers``, ``include_head``).

    Returns:
        int: the number of attention modules on MiTA.

    Raises:
        NothingToSwapError: nothing to swap (the message lists the attention found).
    """
    if is_model_wrapper(model):
        model = model.module
    return swap_attention(model, verbose=verbose, **mita_cfg)


def dataset_meta(cfg: Config, checkpoint: Optional[dict]) -> Optional[dict]:
    """Class names and palette: the checkpoint's ``meta`` (mmseg 1.x ``dataset_meta``,
    0.x ``CLASSES``/``PALETTE``), else those of the config's test dataset class."""
    meta = (checkpoint or {}).get('meta') or {}
    if isinstance(meta.get('dataset_meta'), dict):
        return meta['dataset_meta']
    if 'CLASSES' in meta:
        return dict(classes=meta['CLASSES'], palette=meta.get('PALETTE'))
    from mmseg.registry import DATASETS
    dataset = cfg.get('test_dataloader', {}).get('dataset', {})
    cls = DATASETS.get(dataset.get('type', '')) if isinstance(dataset, dict) else None
    return dict(getattr(cls, 'METAINFO', {})) or None


def init_model(config: Union[str, Config],
               checkpoint: Optional[str] = None,
               device: str = 'cpu',
               cfg_options: Optional[dict] = None,
               mita_cfg: Optional[dict] = None,
               dense_attn: Optional[str] = None) -> nn.Module:
    """mmseg's ``init_model``, with the checkpoint loaded strictly and weights-only, an
    ``EncoderDecoder`` on :class:`~mita_seg.models.SlimEncoderDecoder` (mmseg's results,
    lighter slide inference; ``slim_inference=False`` in ``cfg_options`` keeps mmseg's),
    dense attention on PyTorch's fused path (mmseg's results to float32 rounding;
    ``dense_attn='mmseg'`` keeps mmseg's path) and an optional swap to MiTA.

    Args:
        config (str | Config): a config file, ``'mmseg::...'``, or a ``Config``.
        checkpoint (str, optional): a local checkpoint; None keeps the initial weights.
        device (str): where the model runs. Default: 'cpu'.
        cfg_options (dict, optional): ``--cfg-options`` merged into the config.
        mita_cfg (dict, optional): swap to MiTA with these settings
            (:func:`swap_model`); None for no swap. Default: None.
        dense_attn (str, optional): the path of the dense global attention (the ViT
            family's, Segmenter's mask head's, and a swap plan's dense layers):
            ``'fast'`` (``F.scaled_dot_product_attention``, the ``N x N`` weights never
            formed) or ``'mmseg'`` (mmseg's own, as released;
            :func:`~mita_seg.models.set_dense_attn`). None: the config's ``dense_attn``,
            else ``'fast'``. Default: None.

    Returns:
        nn.Module: the segmentor in eval mode, with ``cfg`` and ``dataset_meta``.

    Raises:
        ValueError: the config does not exist, or ``dense_attn`` is neither ``'fast'`` nor
            ``'mmseg'``; NothingToSwapError: ``mita_cfg`` given and
            nothing to swap; FileNotFoundError, UnreadableCheckpointError,
            UnsafeCheckpointError, CheckpointMismatchError: the checkpoint cannot be
            loaded, or does not fit the model exactly (nothing runs with random weights).
    """
    from mmseg.apis import init_model as mmseg_init_model
    cfg = config if isinstance(config, Config) else load_config(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if dense_attn is not None:
        cfg.dense_attn = check_dense_attn(dense_attn)
    use_slim_inference(cfg)
    model = revert_sync_batchnorm(mmseg_init_model(cfg, None, device='cpu'))
    use_dense_attn(model, cfg)
    guard_grids(model)           # a BEiT/MAE at another grid: an error that says what to do
    if mita_cfg is not None:
        swap_model(model, mita_cfg)
    ckpt = load_checkpoint(model, checkpoint) if checkpoint is not None else None
    model.dataset_meta = dataset_meta(model.cfg, ckpt)
    return model.to(device).eval()
