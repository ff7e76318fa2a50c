"""Training-free token merging (ToMe) in mmseg's ViTs, applied in place like
:func:`~mita_seg.models.swap.swap_attention`.

In each patched ``TransformerEncoderLayer`` the grid tokens are merged (bipartite soft
matching, :mod:`mita_seg.ops.token_merge`) before the attention and, again, before the MLP,
and unmerged after each, as in ToMe for Stable Diffusion and Expedit's ToMe port to
Segmenter; the attention is proportional (``log`` of each key's size added to its logits).
Every block, the neck and the head see the full grid; cls tokens and Segmenter's class
embeddings are never merged.

Only the classes of ``layer.attn`` and ``layer.ffn`` change (:class:`ToMeAttention`,
:class:`ToMeFFN`, subclasses of mmcv's ``MultiheadAttention`` and ``FFN`` whose ``forward``
calls the parent's on the merged tokens), each getting a parameter-free
:class:`TokenMerger`: parameters, buffers and state-dict keys are unchanged, and with no
token to merge (``ratio=0``) the parent's ``forward`` runs as it is.

With MiTA (:func:`~mita_seg.swap_attention`, before or after): MiTA needs the full patch
grid, so in a layer whose attention is MiTA only the MLP's tokens are merged.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmcv.cnn.bricks.transformer import FFN, MultiheadAttention
from mmengine.logging import print_log
from mmseg.models.decode_heads import SegmenterMaskTransformerHead

from mita_seg.ops.token_merge import (MergePlan, bipartite_soft_matching, check_ratio, merge,
                                      merged_count, merged_sizes,
                                      proportional_attention_bias, unmerge)
from .attention import (MiTAAttention, MiTASetting, MiTASettingsMixin, layer_indices,
                        register_mita_conversion)
from .grid import PATCH_EMBED_OWNERS
from .swap import SWAP_RULES

__all__ = ['TokenMerger', 'ToMeAttention', 'ToMeFFN', 'NothingToMergeError', 'merge_tokens']


class NothingToMergeError(ValueError):
    """A model has no ViT encoder layer whose tokens can be merged (the message lists
    what it has)."""


class TokenMerger(nn.Module):
    """Bipartite soft matching and merge of the grid tokens of its input; no parameters.

    Args:
        ratio (float): fraction of the grid tokens merged away, in ``[0, 0.5]``.
        num_prefix_tokens (int): tokens before the grid (a cls token). Default: 0.
        num_suffix_tokens (int): tokens after the grid (Segmenter's class embeddings).
            Default: 0.
    """
    merges_tokens = True  # what the FLOP breakdown looks for (mita_seg.utils.modules)

    def __init__(self, ratio: float, num_prefix_tokens: int = 0, num_suffix_tokens: int = 0):
        super().__init__()
        self.ratio = check_ratio(ratio)
        self.num_prefix_tokens = num_prefix_tokens
        self.num_suffix_tokens = num_suffix_tokens

    def num_merged(self, num_tokens: int) -> int:
        """Tokens a forward over ``num_tokens`` tokens leaves (``N - r``)."""
        n = num_tokens - self.num_prefix_tokens - self.num_suffix_tokens
        return num_tokens - merged_count(max(n, 0), self.ratio)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[MergePlan]]:
        """Merge the grid tokens of ``x`` (``[B, N, C]``, the metric of the matching).

        Returns:
            tuple: the merged tokens ``[B, N - r, C]`` and the plan, or ``(x, None)`` when
            nothing is merged (``r = 0``).
        """
        n = x.shape[1] - self.num_prefix_tokens - self.num_suffix_tokens
        r = merged_count(max(n, 0), self.ratio)
        if r == 0:
            return x, None
        plan = bipartite_soft_matching(x, r, self.num_prefix_tokens, self.num_suffix_tokens)
        return merge(x, plan), plan

    def extra_repr(self) -> str:
        return (f'ratio={self.ratio}, num_prefix_tokens={self.num_prefix_tokens}, '
                f'num_suffix_tokens={self.num_suffix_tokens}')


class ToMeAttention(MultiheadAttention):
    """mmcv's ``MultiheadAttention`` over merged tokens, with proportional attention.

    A module of this class is an mmcv ``MultiheadAttention`` whose class was swapped by
    :func:`merge_tokens` (same parameters) and which holds a :class:`TokenMerger`
    (``token_merger``). Self-attention of batch-first tokens without masks or positional
    terms is merged; any other call runs mmcv's ``forward`` unchanged.
    """

    def forward(self, query, key=None, value=None, identity=None, query_pos=None,
                key_pos=None, attn_mask=None, key_padding_mask=None, **kwargs):
        plan = None
        if (key is None and value is None and query_pos is None and key_pos is None
                and attn_mask is None and key_padding_mask is None and self.batch_first):
            merged, plan = self.token_merger(query)
        if plan is None:
            return super().forward(query, key, value, identity, query_pos, key_pos,
                                   attn_mask, key_padding_mask, **kwargs)
        bias = proportional_attention_bias(merged_sizes(plan, merged.dtype), self.num_heads)
        out = super().forward(merged, identity=merged.new_zeros(()), attn_mask=bias, **kwargs)
        return (query if identity is None else identity) + unmerge(out, plan)


class ToMeFFN(FFN):
    """mmcv's ``FFN`` over merged tokens (class swapped by :func:`merge_tokens`, same
    parameters; holds a :class:`TokenMerger`, ``token_merger``)."""

    def forward(self, x, identity=None):
        merged, plan = self.token_merger(x)
        if plan is None:
            return super().forward(x, identity)
        if not self.add_identity:  # BEiT's layers add the residual themselves
            return unmerge(super().forward(merged), plan)
        out = super().forward(merged, merged.new_zeros(()))
        return (x if identity is None else identity) + unmerge(out, plan)


def _to_mita(attn: ToMeAttention, setting: MiTASetting, with_dwc: bool = False) -> nn.Module:
    """A ToMe attention put on MiTA (:func:`~mita_seg.swap_attention` after
    :func:`merge_tokens`): MiTA over the full grid; the layer's MLP stays merged."""
    return MiTAAttention.from_mmcv(attn, setting, with_dwc)


register_mita_conversion(ToMeAttention, _to_mita)


def _patch(module: nn.Module, cls: type, ratio: float, prefix: int, suffix: int) -> None:
    if isinstance(module, cls):
        module.token_merger.ratio = ratio
        return
    module.__class__ = cls
    module.token_merger = TokenMerger(ratio, prefix, suffix)


def _merge_layer(layer: nn.Module, ratio: float, prefix: int, suffix: int) -> Tuple[str, str]:
    """Patch one encoder layer; returns ``(what is merged, why not the rest)``."""
    attn, ffn = getattr(layer, 'attn', None), getattr(layer, 'ffn', None)
    if type(ffn) not in (FFN, ToMeFFN):
        return '', f'its MLP is {type(ffn).__name__}, not mmcv\'s FFN'
    if type(attn) in (MultiheadAttention, ToMeAttention) and attn.batch_first:
        _patch(attn, ToMeAttention, ratio, prefix, suffix)
        _patch(ffn, ToMeFFN, ratio, prefix, suffix)
        return 'attention and MLP', ''
    if isinstance(attn, MiTASettingsMixin):
        _patch(ffn, ToMeFFN, ratio, prefix, suffix)
        return 'MLP', (f'its attention is {type(attn).__name__}, which needs the full patch '
                       'grid: only the MLP\'s tokens are merged')
    return '', (f'its attention is {type(attn).__name__} (BEiT/MAE: a relative position bias '
                'tied to the patch grid), not mmcv\'s MultiheadAttention or MiTA')


def merge_tokens(model: nn.Module,
                 ratio: float = 0.3,
                 layers: Optional[Sequence[int]] = None,
                 include_head: bool = False,
                 verbose: bool = True) -> int:
    """Merge tokens (ToMe) in the encoder layers of mmseg's ViTs, in place, training-free.

    In each patched layer, ``floor(ratio * n)`` of the ``n`` grid tokens are merged away
    before the attention and before the MLP (bipartite soft matching on the layer-normed
    tokens), and unmerged after each; the attention adds ``log(size)`` of each merged
    token to its logits. Covers the ``VisionTransformer`` backbones (ViT, DeiT, Segmenter,
    SETR, DPT) and, with ``include_head``, Segmenter's mask head (its class embeddings are
    never merged). A layer on MiTA (:func:`~mita_seg.swap_attention`) gets its MLP merged
    only; BEiT/MAE layers (relative position bias) are left alone. Calling it again
    changes the ratio; ``ratio=0`` runs every layer exactly as before.

    Args:
        model (nn.Module): a segmentor, backbone or head; changed in place.
        ratio (float): fraction of the grid tokens merged away, ``0 <= ratio <= 0.5``
            (bipartite matching merges at most half of them). Default: 0.3.
        layers (Sequence[int], optional): backbone encoder layers to patch (negative
            indices count from the end); None for all. Default: None.
        include_head (bool): merge in Segmenter's mask head too. Default: False (ToMe and
            Expedit merge in the backbone).
        verbose (bool): log what was patched and what was left alone. Default: True.

    Returns:
        int: the number of encoder layers with merged tokens.

    Raises:
        TypeError, ValueError: a bad ``ratio`` or ``layers`` (the message says what they
            must be); NothingToMergeError: no layer of ``model`` can merge tokens.
    """
    check_ratio(ratio)
    what, ok = SWAP_RULES['layers']
    if not ok(layers):
        raise ValueError(f'layers={layers!r}: layers must be {what}')
    if not isinstance(include_head, bool):
        raise TypeError(f'include_head must be True or False, got {include_head!r}')
    patched: List[Tuple[str, str]] = []
    skipped: List[Tuple[str, str]] = []
    for owner_name, owner in model.named_modules():
        prefix = f'{owner_name}.' if owner_name else ''
        if isinstance(owner, PATCH_EMBED_OWNERS):
            ids = layer_indices(len(owner.layers), layers)
            num_prefix, num_suffix = int(getattr(owner, 'with_cls_token', True)), 0
        elif isinstance(owner, SegmenterMaskTransformerHead):
            if not include_head:
                continue
            ids, num_prefix, num_suffix = range(len(owner.layers)), 0, owner.num_classes
        else:
            continue
        for i in ids:
            merged, why = _merge_layer(owner.layers[i], float(ratio), num_prefix, num_suffix)
            name = f'{prefix}layers.{i}'
            if merged:
                patched.append((name, merged))
            if why:
                skipped.append((name, why))
    if not patched:
        reasons: dict = {}   # why -> layers, so the message stays one line
        for name, why in skipped:
            reasons.setdefault(why, []).append(name)
        found = '; '.join(f'{names[0]}' + (f' and {len(names) - 1} more' if len(names) > 1
                                           else '') + f': {why}'
                          for why, names in reasons.items()) or (
            'no VisionTransformer backbone, BEiT/MAE or Segmenter mask head')
        raise NothingToMergeError(
            f'merge_tokens found no encoder layer to merge tokens in, in '
            f'{type(model).__name__}: it merges in the layers of mmseg\'s VisionTransformer '
            '(ViT, DeiT, Segmenter, SETR, DPT) and, with include_head=True, of Segmenter\'s '
            f'mask head. Found: {found}')
    if verbose:
        print_log(f'merge_tokens: ratio={ratio} in {len(patched)} encoder layers',
                  logger='current')
        for name, why in skipped:
            print_log(f'merge_tokens: {name}: {why}', logger='current')
    return len(patched)
