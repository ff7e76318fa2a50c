"""Segmenter's mask transformer head with MiTA attention."""
from typing import Optional, Sequence

from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.registry import MODELS

from ..attention import use_mita_layers
from ..grid import GridFromInputsMixin, register_grid_class


@MODELS.register_module()
class MiTASegmenterMaskTransformerHead(GridFromInputsMixin, SegmenterMaskTransformerHead):
    """Segmenter mask head whose layers use :class:`MiTAAttention`.

    Its tokens are the ``h x w`` feature grid followed by ``num_classes`` class
    embeddings, which MiTA treats as suffix tokens (queries, keys and values, not pooled).
    Checkpoint keys are those of ``SegmenterMaskTransformerHead``.

    Args:
        mita_cfg (dict, optional): :class:`MiTAAttention` settings. Default: None.
        mita_layer_cfgs (Sequence[dict | None], optional): per layer, settings over
            ``mita_cfg``, or None for standard attention (a swap plan). Default: None (all
            layers on ``mita_cfg``).
        **kwargs: arguments of ``SegmenterMaskTransformerHead``.
    """

    def __init__(self, mita_cfg: Optional[dict] = None,
                 mita_layer_cfgs: Optional[Sequence[Optional[dict]]] = None, **kwargs):
        super().__init__(**kwargs)
        use_mita_layers(self, mita_cfg, None, mita_layer_cfgs)


# a swapped SegmenterMaskTransformerHead becomes this registered class
register_grid_class(SegmenterMaskTransformerHead, MiTASegmenterMaskTransformerHead)
