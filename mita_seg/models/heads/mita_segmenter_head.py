"""Segmenter's mask transformer head with MiTA attention."""
from typing import List, Optional

import torch
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.registry import MODELS

from ..swap import swap_attention


class GridFromInputsMixin:
    """Sets the grid of a decode head's MiTA layers from its input, then runs the head.

    mmseg's segmentors call ``decode_head.forward(x)`` directly (``predict``, ``loss``,
    ``mode='tensor'``), which skips module hooks, so the grid is set in ``forward``.
    """

    def forward(self, inputs: List[torch.Tensor]) -> torch.Tensor:
        self._mita_grid.hw_shape = tuple(
            int(s) for s in self._transform_inputs(inputs).shape[-2:])
        return super().forward(inputs)


@MODELS.register_module()
class MiTASegmenterMaskTransformerHead(GridFromInputsMixin, SegmenterMaskTransformerHead):
    """Segmenter mask head whose layers use :class:`MiTAAttention`.

    Its tokens are the ``h x w`` feature grid followed by ``num_classes`` class
    embeddings, which MiTA treats as suffix tokens (queries, keys and values, not pooled).
    Checkpoint keys are those of ``SegmenterMaskTransformerHead``.

    Args:
        mita_cfg (dict, optional): :class:`MiTAAttention` settings. Default: None.
        **kwargs: arguments of ``SegmenterMaskTransformerHead``.
    """

    def __init__(self, mita_cfg: Optional[dict] = None, **kwargs):
        super().__init__(**kwargs)
        swap_attention(self, verbose=False, **(mita_cfg or {}))


def with_grid_forward(cls: type) -> type:
    """``cls`` (a ``SegmenterMaskTransformerHead`` class) with :class:`GridFromInputsMixin`;
    a user's subclass keeps its own methods."""
    if issubclass(cls, GridFromInputsMixin):
        return cls
    if cls is SegmenterMaskTransformerHead:
        return MiTASegmenterMaskTransformerHead
    return type(f'MiTA{cls.__name__}', (GridFromInputsMixin, cls), {})
