"""How the patch grid reaches MiTA attention modules.

mmseg's ``TransformerEncoderLayer`` calls ``self.attn(x, identity=x)`` without the grid
shape. Instead of copying the backbones' ``forward``, the owner of the tokens writes the grid
of the current forward into a :class:`GridContext` shared with its attention modules: a
ViT through a hook on its ``patch_embed`` (a callable object, not a closure, so
``copy.deepcopy`` of a model rebinds it to the copy), a Segmenter head in its ``forward``
(:class:`mita_seg.models.MiTASegmenterMaskTransformerHead`).
"""
import math
from typing import Optional, Tuple


class GridContext:
    """Grid shape and number of prefix tokens of the current forward of one token owner.

    Args:
        num_prefix_tokens (int): tokens before the grid (1 for a ViT cls token).
        hw_shape (tuple[int, int], optional): the patch grid; set by hooks.
    """

    def __init__(self, num_prefix_tokens: int = 0, hw_shape: Optional[Tuple[int, int]] = None):
        self.num_prefix_tokens = num_prefix_tokens
        self.hw_shape = hw_shape

    def __repr__(self):
        return f'GridContext(hw_shape={self.hw_shape}, num_prefix_tokens={self.num_prefix_tokens})'


class PatchEmbedGridHook:
    """Forward hook for mmcv/mmseg ``PatchEmbed``, which returns ``(tokens, hw_shape)``."""

    def __init__(self, context: GridContext):
        self.context = context

    def __call__(self, module, args, output):
        self.context.hw_shape = tuple(int(s) for s in output[1])


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
