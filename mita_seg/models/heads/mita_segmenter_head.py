"""Segmenter's mask transformer head with MiTA attention."""
from typing import Optional

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
