"""Segmenter's mask transformer head with MiTA attention."""
from typing import List, Optional

import torch
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.registry import MODELS

from ..swap import swap_attention


@MODELS.register_module()
class MiTASegmenterMaskTransformerHead(SegmenterMaskTransformerHead):
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

    def forward(self, inputs: List[torch.Tensor]) -> torch.Tensor:
        """mmseg's forward, after giving the layers the grid of this input.

        mmseg's segmentors call ``decode_head.forward(x)`` directly (``predict``, ``loss``,
        ``mode='tensor'``), which skips forward pre-hooks, so the grid is set here.
        """
        self._mita_grid.hw_shape = tuple(self._transform_inputs(inputs).shape[-2:])
        return super().forward(inputs)
