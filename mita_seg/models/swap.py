"""Swap the global attention of mmseg segmenters to MiTA, in place."""
from typing import List, Optional, Sequence, Tuple

import torch.nn as nn
from mmengine.logging import print_log
from mmseg.models.decode_heads import SegmenterMaskTransformerHead

from mita_seg.utils.modules import is_attention_module
from .attention import (MITA_KEYS, SETTING_RULES, MiTASettingsMixin, can_use_mita,
                        check_settings, layer_indices, use_mita)
from .beit_attention import MiTABEiTAttention  # noqa: F401  (registers the BEiT/MAE swap)
from .grid import PATCH_EMBED_OWNERS

# Attention modules this tool knows it cannot swap, by class name, and why.
_UNSWAPPABLE = {
    'WindowMSA': 'windowed attention (Swin): no global attention to replace',
    'ShiftWindowMSA': 'windowed attention (Swin): no global attention to replace',
    'EfficientMultiheadAttention': 'spatial-reduction attention (SegFormer/PVT)',
    'GlobalSubsampledAttention': 'spatial-reduction attention (Twins)',
    'LocallyGroupedSelfAttention': 'windowed attention (Twins)',
}


class NothingToSwapError(ValueError):
    """A model has no global attention MiTA can replace (the message lists what it has)."""


# The settings of swap_attention besides the MiTA ones: name -> (what it must be, check).
SWAP_RULES = {
    'layers': ('None or a list of backbone layer indices, e.g. [0,1] or [-1]',
               lambda x: x is None or (isinstance(x, (list, tuple)) and all(
                   isinstance(i, int) and not isinstance(i, bool) for i in x))),
    'include_head': ('True or False', lambda x: isinstance(x, bool)),
}


def swap_attention(model: nn.Module,
                   layers: Optional[Sequence[int]] = None,
                   include_head: bool = True,
                   verbose: bool = True,
                   **mita_cfg) -> int:
    """Replace the global attention of mmseg's ViT family by MiTA.

    Covers every ``VisionTransformer`` backbone (ViT, DeiT, Segmenter, SETR, DPT), whose
    attention becomes :class:`MiTAAttention`, BEiT and MAE backbones (their attention with
    a relative position bias becomes :class:`MiTABEiTAttention` /
    :class:`MiTAMAEAttention`, the bias going into MiTA) and, with ``include_head``,
    Segmenter's mask head. The swapped modules keep the very same
    parameter objects, so state-dict keys and weights are unchanged
    (:func:`~mita_seg.models.attention.use_mita`). Settings not given are the MiTA
    defaults (``pool_size=7, topk=49``) for modules swapped now, and keep their values in
    modules already on MiTA (so ``topk=16`` changes only k at test time). The grid shape
    reaches every swapped module through hooks on the token owners, for whole and slide
    inference alike.

    Args:
        model (nn.Module): a segmentor, backbone or head; changed in place.
        layers (Sequence[int], optional): backbone encoder layers to swap (negative
            indices count from the end); None for all. Default: None.
        include_head (bool): swap Segmenter's mask head too. Default: True.
        verbose (bool): log what was swapped and what was left alone. Default: True.
        **mita_cfg: MiTA settings (``pool_size``, ``topk``, ``router_topk``,
            ``with_shared_expert``, ``shared_scale``).

    Returns:
        int: the number of attention modules now on MiTA.

    Raises:
        NothingToSwapError: nothing in ``model`` can be swapped (a ``ValueError`` whose
            message lists the attention modules found).
        ValueError: ``layers`` names a layer that does not exist, or a setting is unknown
            or has a bad value.
    """
    check_settings(mita_cfg, {k: SETTING_RULES[k] for k in MITA_KEYS})
    swapped: List[str] = []
    left_by_choice = {}  # global attention not swapped because of layers= / include_head
    for owner_name, owner in model.named_modules():
        prefix = f'{owner_name}.' if owner_name else ''
        if isinstance(owner, PATCH_EMBED_OWNERS):
            n = len(owner.layers)
            ids = layer_indices(n, layers)
            left_by_choice.update({f'{prefix}layers.{i}.attn': f'not in layers={list(layers)}'
                                   for i in range(n) if i not in ids})
        elif isinstance(owner, SegmenterMaskTransformerHead):
            ids = range(len(owner.layers))
            if not include_head:
                left_by_choice.update({f'{prefix}layers.{i}.attn': 'in a decode head '
                                       '(include_head=False)' for i in ids})
                continue
        else:
            continue
        ids = [i for i in ids if can_use_mita(owner.layers[i].attn)]
        use_mita(owner, ids, **mita_cfg)
        swapped += [f'{prefix}layers.{i}.attn' for i in ids]

    skipped: List[Tuple[str, str]] = []
    for name, m in model.named_modules():
        if not is_attention_module(m) or isinstance(m, MiTASettingsMixin):
            continue
        if any(name == s or name.startswith(s + '.') for s in swapped):
            continue  # the nn.MultiheadAttention holding a swapped module's weights
        if any(name.startswith(s + '.') for s, _ in skipped):
            continue
        reason = left_by_choice.get(name) or _UNSWAPPABLE.get(
            type(m).__name__, 'not a global self-attention of a supported model (ViT family, '
            'BEiT/MAE, Segmenter head)')
        skipped.append((name, f'{type(m).__name__}: {reason}'))

    if not swapped:
        found = '\n'.join(f'  {n} ({why})' for n, why in skipped) or '  none'
        raise NothingToSwapError(
            f'swap_attention found no global attention to swap to MiTA in '
            f'{type(model).__name__}. Attention modules found:\n{found}')
    if verbose:
        settings = {k: getattr(model.get_submodule(swapped[0]), k) for k in MITA_KEYS}
        print_log(f'swap_attention: {len(swapped)} attention modules on MiTA ({settings})',
                  logger='current')
        for name, why in skipped:
            print_log(f'swap_attention: left {name} alone: {why}', logger='current')
    return len(swapped)
