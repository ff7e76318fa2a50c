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
    embeddings, which MiTA treats as global tokens (:mod:`mita_seg.ops.global_tokens`): each
    class embedding attends to every patch and class token exactly, and every query's
    softmax holds every class embedding exactly; MiTA routes the patch tokens among
    themselves. (Routed like patches, a class query read one expert's ``k`` keys, where a
    class mask needs evidence from the whole image.) ``grid_context(head).global_suffix =
    False`` routes them. Checkpoint keys are those of ``SegmenterMaskTransformerHead``.

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
