"""Swap the global attention of mmseg segmenters to MiTA, in place."""
from typing import List, Optional, Sequence, Tuple

import torch.nn as nn
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmengine.logging import print_log
from mmseg.models.backbones import VisionTransformer
from mmseg.models.decode_heads import SegmenterMaskTransformerHead

from .attention import MiTAAttention
from .grid import GridContext, PatchEmbedGridHook

# Attention modules this tool knows it cannot swap, by class name, and why.
_UNSWAPPABLE = {
    'WindowMSA': 'windowed attention (Swin): no global attention to replace',
    'ShiftWindowMSA': 'windowed attention (Swin): no global attention to replace',
    'EfficientMultiheadAttention': 'spatial-reduction attention (SegFormer/PVT)',
    'GlobalSubsampledAttention': 'spatial-reduction attention (Twins)',
    'LocallyGroupedSelfAttention': 'windowed attention (Twins)',
    'BEiTAttention': 'attention with a dense relative-position bias (BEiT/MAE)',
}


def _grid_context(owner: nn.Module) -> GridContext:
    """The grid context of a token owner, hooked up on first use.

    A ViT's grid is the output of its ``patch_embed`` (a forward hook). A Segmenter head is
    called as ``decode_head.forward(x)`` by mmseg's segmentors, which skips module hooks:
    its class becomes :class:`MiTASegmenterMaskTransformerHead` (same state and keys), whose
    ``forward`` sets the grid from its input.
    """
    ctx = getattr(owner, '_mita_grid', None)
    if ctx is None:
        if isinstance(owner, VisionTransformer):
            ctx = GridContext(num_prefix_tokens=1 if owner.with_cls_token else 0)
            owner.patch_embed.register_forward_hook(PatchEmbedGridHook(ctx))
        else:
            from .heads import with_grid_forward
            ctx = GridContext(num_prefix_tokens=0)
            owner.__class__ = with_grid_forward(type(owner))
        owner._mita_grid = ctx
    return ctx


def _is_attention(module: nn.Module) -> bool:
    name = type(module).__name__
    return (isinstance(module, (nn.MultiheadAttention, MultiheadAttention))
            or name.endswith('Attention') or name.endswith('MSA'))


def swap_attention(model: nn.Module,
                   pool_size=7,
                   topk: int = 49,
                   router_topk: int = 1,
                   with_shared_expert: bool = True,
                   layers: Optional[Sequence[int]] = None,
                   include_head: bool = True,
                   verbose: bool = True,
                   **mita_cfg) -> int:
    """Replace the global attention of mmseg's ViT family by :class:`MiTAAttention`.

    Covers every ``VisionTransformer`` backbone (ViT, DeiT, Segmenter, SETR, DPT) and, with
    ``include_head``, Segmenter's mask head. The swapped modules keep the very same
    parameter objects, so state-dict keys and weights are unchanged; modules already on
    MiTA are reconfigured (M and k can change at test time). The grid shape reaches every
    swapped module through hooks on the token owners, for whole and slide inference alike.

    Args:
        model (nn.Module): a segmentor, backbone or head; changed in place.
        pool_size, topk, router_topk, with_shared_expert: MiTA settings
            (:class:`MiTAAttention`). Defaults: 7, 49, 1, True.
        layers (Sequence[int], optional): backbone encoder layers to swap (negative
            indices count from the end); None for all. Default: None.
        include_head (bool): swap Segmenter's mask head too. Default: True.
        verbose (bool): log what was swapped and what was left alone. Default: True.
        **mita_cfg: further :class:`MiTAAttention` arguments (``shared_scale``).

    Returns:
        int: the number of attention modules now on MiTA.

    Raises:
        ValueError: nothing in ``model`` can be swapped (the message lists the attention
            modules found), or ``layers`` names a layer that does not exist.
    """
    cfg = dict(pool_size=pool_size, topk=topk, router_topk=router_topk,
               with_shared_expert=with_shared_expert, **mita_cfg)
    swapped: List[str] = []
    left_by_choice = {}  # global attention not swapped because of layers= / include_head
    for owner_name, owner in model.named_modules():
        prefix = f'{owner_name}.' if owner_name else ''
        if isinstance(owner, VisionTransformer):
            n = len(owner.layers)
            ids = range(n) if layers is None else list(layers)
            bad = [i for i in ids if not -n <= i < n]
            if bad:
                raise ValueError(f'layers {bad} out of range: {owner_name or "the backbone"} '
                                 f'has {n} encoder layers')
            ids = sorted({i % n for i in ids})
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
        for i in ids:
            layer = owner.layers[i]
            if isinstance(layer.attn, MiTAAttention):
                layer.attn.__dict__.update(
                    {k: v for k, v in cfg.items() if k != 'with_dwc'})
            elif type(layer.attn) is MultiheadAttention:
                layer.attn = MiTAAttention.from_mmcv(layer.attn, **cfg)
            else:
                continue
            layer.attn.grid = _grid_context(owner)
            swapped.append(f'{prefix}layers.{i}.attn')

    skipped: List[Tuple[str, str]] = []
    for name, m in model.named_modules():
        if not _is_attention(m) or isinstance(m, MiTAAttention):
            continue
        if any(name == s or name.startswith(s + '.') for s in swapped):
            continue  # the nn.MultiheadAttention holding a swapped module's weights
        if any(name.startswith(s + '.') for s, _ in skipped):
            continue
        reason = left_by_choice.get(name) or _UNSWAPPABLE.get(
            type(m).__name__, 'not a global self-attention of a supported model (ViT family, '
            'Segmenter head)')
        skipped.append((name, f'{type(m).__name__}: {reason}'))

    if not swapped:
        found = '\n'.join(f'  {n} ({why})' for n, why in skipped) or '  none'
        raise ValueError(f'swap_attention found no global attention to swap to MiTA in '
                         f'{type(model).__name__}. Attention modules found:\n{found}')
    if verbose:
        print_log(f'swap_attention: {len(swapped)} attention modules on MiTA ({cfg})',
                  logger='current')
        for name, why in skipped:
            print_log(f'swap_attention: left {name} alone: {why}', logger='current')
    return len(swapped)
