"""How the patch grid reaches MiTA attention modules.

mmseg's ``TransformerEncoderLayer`` calls ``self.attn(x, identity=x)`` without the grid
shape. Instead of copying the backbones' ``forward``, the owner of the tokens writes the grid
of the current forward into a :class:`GridContext` shared with its attention modules
(:func:`grid_context` hooks an owner up):

- a ViT, BEiT or MAE through a hook on its ``patch_embed`` (:class:`PatchEmbedGridHook`,
  a callable object, not a closure, so ``copy.deepcopy`` of a model rebinds it to the copy);
- a Segmenter mask head in its ``forward`` (:class:`GridFromInputsMixin`): mmseg's
  segmentors call ``decode_head.forward(x)`` directly, which skips module hooks.

This module depends on mmseg's classes only; the MiTA modules depend on it.
"""
import math
from typing import Dict, Optional, Tuple

import torch.nn as nn
from mmseg.models.backbones import MAE, BEiT, VisionTransformer

# Backbones whose grid is the output of their ``patch_embed`` (BEiT covers MAE); BEiT always
# has a cls token before the grid.
PATCH_EMBED_OWNERS = (VisionTransformer, BEiT)


class GridMismatchError(ValueError):
    """The patch grid of an input is not the one grid a BEiT/MAE backbone accepts (that of
    its relative-position bias table and, for MAE, its position embedding); the message
    says how to evaluate such a model."""


def grid_mismatch_message(what: str, window: Tuple[int, int],
                          hw_shape: Tuple[int, int]) -> str:
    """What :class:`GridMismatchError` says: ``what`` was built for ``window``, the input
    has ``hw_shape``, and how to evaluate at the training crop or another size."""
    return (f'{what} was built for a {window[0]}x{window[1]} patch grid (the backbone\'s '
            f'img_size / patch_size, i.e. the training crop), but this input has a '
            f'{hw_shape[0]}x{hw_shape[1]} grid. BEiT/MAE attention only fits the grid of its '
            'relative position bias table (mmseg\'s fails on another one too). Evaluate at '
            "the training crop size: test_cfg=dict(mode='slide', crop_size=<img_size>, "
            'stride=...) on images at least that large. To run whole images of another '
            'square size S, build the model for it with its tables interpolated from the '
            'checkpoint: mita_seg.apis.init_model(config, checkpoint, img_size=(S, S)) '
            '(tools/export_onnx.py --shape S S does), or build it with img_size = S and the '
            "weights through init_cfg=dict(type='Pretrained', ...), where "
            'resize_rel_pos_embed interpolates (MiTABEiT/MiTAMAE with any SciPy; mmseg\'s '
            'own BEiT/MAE need SciPy < 1.14).')


class GridContext:
    """Grid shape, prefix tokens and global tokens of the current forward of one token owner.

    Args:
        num_prefix_tokens (int): tokens before the grid (1 for a ViT cls token).
        hw_shape (tuple[int, int], optional): the patch grid; set by hooks.
        window (tuple[int, int], optional): the only grid the owner accepts (a BEiT/MAE
            backbone with a bias table or position embedding of that grid); another one
            is a :class:`GridMismatchError` as soon as the patch embedding gives it.
            Default: None (any grid).
        global_prefix (bool): the prefix tokens (a ViT's cls) are global tokens
            (:mod:`mita_seg.ops.global_tokens`: they attend to every key and every query
            attends to them, exactly); False routes them as the paper does. Default: False.
        global_suffix (bool): the tokens after the grid (a Segmenter head's class
            embeddings) are global tokens. Default: False (True for heads, see
            :func:`grid_context`).
    """

    def __init__(self, num_prefix_tokens: int = 0, hw_shape: Optional[Tuple[int, int]] = None,
                 window: Optional[Tuple[int, int]] = None, global_prefix: bool = False,
                 global_suffix: bool = False):
        self.num_prefix_tokens = num_prefix_tokens
        self.hw_shape = hw_shape
        self.window = window
        self.global_prefix = global_prefix
        self.global_suffix = global_suffix

    def global_tokens(self, num_tokens: int, hw_shape: Tuple[int, int]) -> Tuple[int, int]:
        """The ``(prefix, suffix)`` global tokens (``mita_attention``'s ``global_tokens``)
        of a forward over ``num_tokens`` tokens on a ``hw_shape`` grid."""
        p = self.num_prefix_tokens
        return (p if self.global_prefix else 0,  # (int(): a shape is a tensor in jit traces)
                int(num_tokens) - p - hw_shape[0] * hw_shape[1] if self.global_suffix else 0)

    def __repr__(self):
        return (f'GridContext(hw_shape={self.hw_shape}, num_prefix_tokens='
                f'{self.num_prefix_tokens}, window={self.window}, global_prefix='
                f'{self.global_prefix}, global_suffix={self.global_suffix})')


class PatchEmbedGridHook:
    """Forward hook for mmcv/mmseg ``PatchEmbed``, which returns ``(tokens, hw_shape)``.

    Raises:
        GridMismatchError: the grid is not the context's ``window``.
    """

    def __init__(self, context: GridContext):
        self.context = context

    def __call__(self, module, args, output):
        hw_shape = tuple(int(s) for s in output[1])
        window = self.context.window
        if window is not None and hw_shape != tuple(window):
            raise GridMismatchError(grid_mismatch_message(
                'this BEiT/MAE backbone (its relative position bias tables)', window, hw_shape))
        self.context.hw_shape = hw_shape


class GridFromInputsMixin:
    """Sets the grid of a decode head's MiTA layers from its input, then runs the head.

    mmseg's segmentors call ``decode_head.forward(x)`` directly (``predict``, ``loss``,
    ``mode='tensor'``), which skips module hooks, so the grid is set in ``forward``.
    """

    def forward(self, inputs):
        # (grid_context: a head built on MiTA whose layers are all dense has none yet)
        grid_context(self).hw_shape = tuple(
            int(s) for s in self._transform_inputs(inputs).shape[-2:])
        return super().forward(inputs)


# head class -> its subclass with GridFromInputsMixin (registered classes are added by
# their modules, e.g. SegmenterMaskTransformerHead -> MiTASegmenterMaskTransformerHead)
_GRID_CLASSES: Dict[type, type] = {}


def register_grid_class(cls: type, grid_cls: type) -> None:
    """Make :func:`with_grid_forward` turn ``cls`` into ``grid_cls`` (a registered
    subclass of ``cls`` with :class:`GridFromInputsMixin`)."""
    _GRID_CLASSES[cls] = grid_cls


def with_grid_forward(cls: type) -> type:
    """``cls`` (a decode head class) with :class:`GridFromInputsMixin`; a user's subclass
    keeps its own methods."""
    if issubclass(cls, GridFromInputsMixin):
        return cls
    if cls not in _GRID_CLASSES:
        _GRID_CLASSES[cls] = type(f'MiTA{cls.__name__}', (GridFromInputsMixin, cls), {})
    return _GRID_CLASSES[cls]


def grid_context(owner: nn.Module) -> GridContext:
    """The grid context of a token owner (a ViT, BEiT or MAE backbone or a decode head),
    hooked up on first use.

    A backbone's grid is the output of its ``patch_embed`` (a forward hook); a head's class
    gets :class:`GridFromInputsMixin` (same state and keys), whose ``forward`` sets the grid.
    A BEiT/MAE backbone accepts only the grid of its bias tables (``window``), unless it has
    neither tables nor a position embedding. A head's tokens after the grid (Segmenter's
    class embeddings, which each need evidence from the whole image) are global tokens; a
    backbone's cls is routed (the paper's MiTA): set ``global_prefix`` / ``global_suffix``
    of the returned context to choose otherwise.
    """
    ctx = getattr(owner, '_mita_grid', None)
    if ctx is None:
        if isinstance(owner, PATCH_EMBED_OWNERS):
            ctx = GridContext(num_prefix_tokens=int(getattr(owner, 'with_cls_token', True)))
            if isinstance(owner, BEiT) and (isinstance(owner, MAE) or any(
                    layer.attn.relative_position_bias_table is not None
                    for layer in owner.layers)):
                ctx.window = tuple(int(s) for s in owner.patch_shape)
            owner.patch_embed.register_forward_hook(PatchEmbedGridHook(ctx))
        else:
            ctx = GridContext(num_prefix_tokens=0, global_suffix=True)
            owner.__class__ = with_grid_forward(type(owner))
        owner._mita_grid = ctx
    return ctx


def guard_grids(model: nn.Module) -> int:
    """Hook up the grid context of every BEiT/MAE backbone in ``model`` (on MiTA or not),
    so that an input whose patch grid their bias tables (or MAE's position embedding) do
    not fit is a :class:`GridMismatchError` saying how to evaluate, not mmseg's
    broadcasting error deep in the attention.

    Returns:
        int: the number of BEiT/MAE backbones with a fixed grid.
    """
    return sum(grid_context(m).window is not None for m in model.modules()
               if isinstance(m, BEiT))


def resolve_grid(num_tokens: int, num_prefix_tokens: int,
                 hw_shape: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """The grid of ``num_tokens`` tokens: ``hw_shape`` if given, else a square of the
    non-prefix tokens if they form one.

    Raises:
        ValueError: no ``hw_shape`` and the tokens do not form a square grid.
    """
    if hw_shape is not None:
        return int(hw_shape[0]), int(hw_shape[1])
    n = num_tokens - num_prefix_tokens
    side = math.isqrt(max(n, 0))
    if n <= 0 or side * side != n:
        raise ValueError(
            f'MiTA needs the patch grid: got {num_tokens} tokens with '
            f'{num_prefix_tokens} prefix tokens, which is not a square grid. Pass '
            'hw_shape=(h, w) to forward, or build the model with a MiTA backbone or '
            'mita_seg.swap_attention, which pass the grid to every layer')
    return side, side


__all__ = [
    'PATCH_EMBED_OWNERS', 'GridMismatchError', 'grid_mismatch_message', 'GridContext',
    'PatchEmbedGridHook', 'GridFromInputsMixin', 'register_grid_class', 'with_grid_forward',
    'grid_context', 'guard_grids', 'resolve_grid'
]
