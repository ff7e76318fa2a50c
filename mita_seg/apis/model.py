"""Segmentors for the tools: built from a config, checkpoint loaded strictly and
weights-only, optionally swapped to MiTA."""
import copy
import logging
import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
from mmengine.config import Config
from mmengine.model import BaseTTAModel, is_model_wrapper, revert_sync_batchnorm

from mita_seg.models import check_dense_attn, guard_grids, swap_attention
from mita_seg.models.backbones.mita_beit import interpolate_rel_pos_grid
from mita_seg.setting import MiTASetting
from mita_seg.utils.cfg_options import blame_cfg_options, merge_cfg_options
from mita_seg.utils.checkpoint import load_checkpoint
from mita_seg.utils.errors import InputError
from .config import load_config, use_dense_attn, use_slim_inference
from .mita_cfg import as_mita_cfg


def swap_model(model: nn.Module, mita_cfg: Union[dict, str, MiTASetting],
               verbose: bool = True) -> int:
    """:func:`mita_seg.swap_attention` on ``model`` (unwrapped from DDP or a TTA model),
    settings of ``--mita-cfg`` (MiTA settings, ``layers``, ``include_head``), or a whole
    setting (a :class:`~mita_seg.setting.MiTASetting` or its text, ``'7:49'``) for every
    layer.

    Returns:
        int: the number of attention modules on MiTA.

    Raises:
        NothingToSwapError: nothing to swap (the message lists the attention found).
    """
    if is_model_wrapper(model) or isinstance(model, BaseTTAModel):   # DDP, --tta
        model = model.module
    return swap_attention(model, verbose=verbose, **as_mita_cfg(mita_cfg))


def dataset_meta(cfg: Config, checkpoint: Optional[dict],
                 num_classes: Optional[int] = None) -> Optional[dict]:
    """Class names and palette: the checkpoint's ``meta`` (mmseg 1.x ``dataset_meta``,
    0.x ``CLASSES``/``PALETTE``), else those of the config's test dataset as mmseg builds
    it (:func:`config_dataset_meta`: its class's ``METAINFO`` with the config's
    ``metainfo`` over it), else, given the model's ``num_classes``, mmseg ``init_model``'s
    rule (the first of mmseg's datasets with that many classes; where none has, the names
    ``'0'``, ``'1'``... with mmseg's seeded random palette). A palette that is missing or
    does not match the classes is mmseg's seeded random one; None where nothing is known.
    """
    meta = (checkpoint or {}).get('meta') or {}
    if isinstance(meta.get('dataset_meta'), dict) and meta['dataset_meta'].get('classes'):
        found = meta['dataset_meta']
    elif meta.get('CLASSES'):
        found = dict(classes=meta['CLASSES'], palette=meta.get('PALETTE'))
    else:
        found = config_dataset_meta(cfg) or _dataset_meta_of_size(num_classes)
    if not found:
        return None
    classes, palette = found['classes'], found.get('palette')
    if not palette or len(palette) != len(classes):
        palette = _random_palette(len(classes))
    return dict(found, classes=classes, palette=palette)


def config_dataset_meta(cfg: Config) -> Optional[dict]:
    """The class names and palette of ``cfg``'s test dataset as mmseg builds it: the
    dataset class's ``METAINFO`` with the config's ``metainfo`` over it (a
    ``BaseSegDataset`` of a custom dataset gives its classes there) and mmseg's palette
    rule (the palette's subset of the classes kept, a seeded random one where it has none);
    None where the config has no test dataset, or one without classes."""
    from mmseg.datasets import BaseSegDataset
    from mmseg.registry import DATASETS
    loader = cfg.get('test_dataloader', None)          # None in a model-only config
    dataset = loader.get('dataset') if isinstance(loader, dict) else None
    while (isinstance(dataset, dict) and 'metainfo' not in dataset
           and isinstance(dataset.get('dataset'), dict)):   # RepeatDataset and the like
        dataset = dataset['dataset']
    kind = dataset.get('type') if isinstance(dataset, dict) else None
    cls = kind if isinstance(kind, type) else DATASETS.get(kind) if kind else None
    if not isinstance(cls, type):
        return None
    if not issubclass(cls, BaseSegDataset):
        return dict(getattr(cls, 'METAINFO', {})) or None
    meta = cls._load_metainfo(copy.deepcopy(dataset.get('metainfo')))
    if not meta.get('classes'):
        return None
    probe = cls.__new__(cls)        # mmseg's palette rule, without building the dataset
    probe._metainfo, probe.label_map = meta, cls.get_label_map(meta['classes'])
    try:
        palette = probe._update_palette()
    except ValueError:              # a palette that does not match: dataset_meta's own
        palette = None
    return dict(classes=meta['classes'], palette=palette)


def _dataset_meta_of_size(num_classes: Optional[int]) -> Optional[dict]:
    """mmseg ``init_model``'s class names for a checkpoint without them: the first of its
    datasets with ``num_classes`` classes; where none has (mmseg then takes Cityscapes'
    19 whatever the count), the names ``'0'``, ``'1'``..."""
    if not isinstance(num_classes, int) or num_classes < 1:
        return None
    from mmengine.logging import print_log
    from mmseg.utils import dataset_aliases, get_classes, get_palette
    for name in dataset_aliases:
        if len(get_classes(name)) == num_classes:
            print_log(f'class names: neither the checkpoint nor the config has them; those of '
                      f'{name}, which has {num_classes} classes too', logger='current',
                      level=logging.WARNING)
            return dict(classes=tuple(get_classes(name)), palette=get_palette(name))
    print_log(f'class names: neither the checkpoint nor the config has them, and no dataset '
              f'of mmseg has {num_classes} classes: they are named by their index',
              logger='current', level=logging.WARNING)
    return dict(classes=tuple(str(i) for i in range(num_classes)), palette=None)


def _random_palette(num_classes: int) -> list:
    """mmseg's palette for classes without one (``BaseSegDataset``'s: seed 42)."""
    return np.random.RandomState(42).randint(0, 255, size=(num_classes, 3)).tolist()


def init_model(config: Union[str, Config],
               checkpoint: Optional[str] = None,
               device: str = 'cpu',
               cfg_options: Optional[dict] = None,
               mita_cfg: Union[dict, str, MiTASetting, None] = None,
               dense_attn: Optional[str] = None,
               img_size: Optional[Sequence[int]] = None) -> nn.Module:
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
        mita_cfg (dict | str | MiTASetting, optional): swap to MiTA with these settings
            (:func:`swap_model`: a dict as ``--mita-cfg``, or a whole setting such as
            ``'7:49'``); None for no swap. Default: None.
        dense_attn (str, optional): the path of the dense global attention (the ViT
            family's, Segmenter's mask head's, and a swap plan's dense layers):
            ``'fast'`` (``F.scaled_dot_product_attention``, the ``N x N`` weights never
            formed) or ``'mmseg'`` (mmseg's own, as released;
            :func:`~mita_seg.models.set_dense_attn`). None: the config's ``dense_attn``,
            else ``'fast'``. Default: None.
        img_size (Sequence[int], optional): ``(H, W)`` of the whole images the model will
            see. A backbone whose position tables fit one grid only (BEiT, MAE) is built
            for it and its tables are interpolated from the checkpoint, as mmseg does for
            pretrained weights (``BEiT.resize_rel_pos_embed``, ``MAE.resize_abs_pos_embed``);
            other backbones (the ViT family resizes its own) are left as they are. None:
            the config's size. Default: None.

    Returns:
        nn.Module: the segmentor in eval mode, with ``cfg`` and ``dataset_meta``.

    Raises:
        ValueError: the config does not exist, or ``dense_attn`` is neither ``'fast'`` nor
            ``'mmseg'``; NothingToSwapError: ``mita_cfg`` given and
            nothing to swap; FileNotFoundError, UnreadableCheckpointError,
            UnsafeCheckpointError, CheckpointMismatchError: the checkpoint cannot be
            loaded, or does not fit the model exactly (nothing runs with random weights);
            InputError (a ValueError): a BEiT/MAE asked for a non-square size or one whose
            position index buffers would not fit in memory; CfgOptionsError (an InputError):
            the model cannot be built with a value of ``cfg_options`` (or of those
            :func:`~mita_seg.apis.load_config` merged).
    """
    from mmseg.apis import init_model as mmseg_init_model
    cfg = config if isinstance(config, Config) else load_config(config)
    merge_cfg_options(cfg, cfg_options)
    if dense_attn is not None:
        cfg.dense_attn = check_dense_attn(dense_attn)
    use_slim_inference(cfg)

    adapt, fixed = None, fixed_grid_size(cfg)
    if img_size is not None and fixed is not None and tuple(img_size) != fixed:
        check_fixed_grid_size(cfg, tuple(img_size))
        cfg.model.backbone.img_size = tuple(int(s) for s in img_size)
        adapt = lambda state: resize_position_tables(model, state)  # noqa: E731
    with blame_cfg_options(cfg, 'the model', ('model', )):   # a bad --cfg-options value
        model = revert_sync_batchnorm(mmseg_init_model(cfg, None, device='cpu'))
    use_dense_attn(model, cfg)
    guard_grids(model)           # a BEiT/MAE at another grid: an error that says what to do
    if adapt is not None:
        from mmengine.logging import print_log
        print_log(f'{type(model.backbone).__name__} built for {img_size[0]}x{img_size[1]} '
                  f'images (config: {fixed[0]}x{fixed[1]}): its position tables '
                  'interpolated from the checkpoint as mmseg does for pretrained weights',
                  logger='current')
    if mita_cfg is not None:
        swap_model(model, mita_cfg)
    ckpt = load_checkpoint(model, checkpoint, adapt=adapt) if checkpoint is not None else None
    model.dataset_meta = dataset_meta(
        model.cfg, ckpt, getattr(getattr(model, 'decode_head', None), 'num_classes', None))
    return model.to(device).eval()


def _backbone_args(cfg: Config) -> Optional[dict]:
    """The arguments a BEiT/MAE backbone of ``cfg`` is built with (the config's over the
    class's defaults); None for other backbones (the ViT family interpolates its own
    position embedding)."""
    import inspect

    from mmseg.models.backbones import BEiT
    from mmseg.registry import MODELS
    backbone = cfg.get('model', {}).get('backbone')
    kind = backbone.get('type') if isinstance(backbone, dict) else None
    cls = kind if isinstance(kind, type) else MODELS.get(kind) if kind else None
    if not (isinstance(cls, type) and issubclass(cls, BEiT)):
        return None
    defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return dict(defaults, **backbone, name=cls.__name__)


def fixed_grid_size(cfg: Config) -> Optional[Tuple[int, int]]:
    """The image size ``(H, W)`` the config's BEiT/MAE backbone (position tables of one
    grid) is built for; None for other backbones (the ViT family interpolates its own)."""
    args = _backbone_args(cfg)
    if args is None:
        return None
    size = args['img_size']
    return (size, size) if isinstance(size, int) else tuple(size)


def check_fixed_grid_size(cfg: Config, img_size: Tuple[int, int]) -> None:
    """Refuse a size the config's BEiT/MAE cannot be built for: not square (mmseg
    interpolates square tables only), or an ``[N+1, N+1]`` position index per layer (int64,
    a buffer of mmseg's ``BEiTAttention``) over half the machine's memory."""
    args = _backbone_args(cfg)
    name, patch, layers = args['name'], args['patch_size'], args['num_layers']
    h, w = img_size
    if h != w:
        raise InputError(f'{name} at {h}x{w}: its position tables are interpolated to '
                         'square grids only (mmseg\'s resize_rel_pos_embed); give a square '
                         'size')
    n = (h // patch) * (w // patch) + 1
    need = layers * n * n * 8
    total = physical_memory()
    if total and need > total / 2:
        raise InputError(
            f'{name} at {h}x{w} ({n} tokens): mmseg\'s BEiTAttention keeps an [N, N] int64 '
            f'position index per layer, {need / 2**30:.1f} GiB for its {layers} '
            f'layers, over half of this machine\'s {total / 2**30:.0f} GiB; give a smaller '
            'size')


def resize_position_tables(model: nn.Module, state: dict) -> dict:
    """``state`` with the BEiT/MAE backbone's relative position bias tables
    (:func:`resize_rel_pos_table`) and MAE's absolute position embedding (mmseg's
    ``MAE.resize_abs_pos_embed``) interpolated to ``model``'s grid, and the position index
    buffers (a function of the grid) taken from ``model``."""
    backbone, prefix = model.backbone, 'backbone.'
    own = model.state_dict()
    tables = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and (
        k.endswith('relative_position_bias_table') or k == prefix + 'pos_embed')}
    for k, table in tables.items():
        if k.endswith('relative_position_bias_table'):
            tables[k] = resize_rel_pos_table(table, own[prefix + k].shape[0])
    if hasattr(backbone, 'resize_abs_pos_embed'):
        tables = backbone.resize_abs_pos_embed(tables)
    state = dict(state, **{prefix + k: v for k, v in tables.items()})
    for k in state:
        if k.endswith('relative_position_index') and k in own:
            state[k] = own[k]
    return state


def resize_rel_pos_table(table: torch.Tensor, num_pos: int) -> torch.Tensor:
    """A BEiT relative position bias table ``[(2S-1)^2 + 3, H]`` resized to ``num_pos``
    rows as mmseg's ``BEiT.resize_rel_pos_embed`` does
    (:func:`~mita_seg.models.backbones.mita_beit.interpolate_rel_pos_grid`). The 3 rows of
    the class token's distances are kept."""
    extra = 3
    src = int(round((table.shape[0] - extra) ** 0.5))
    dst = int(round((num_pos - extra) ** 0.5))
    if src == dst:
        return table
    grid = interpolate_rel_pos_grid(table[:-extra], src, dst)
    return torch.cat([grid, table[-extra:]], dim=0)


def physical_memory() -> Optional[int]:
    """Bytes of physical memory, None where unknown."""
    try:
        return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError, AttributeError):
        return None
