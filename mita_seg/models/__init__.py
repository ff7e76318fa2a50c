"""mmseg components of mita_seg; importing this module registers them, and makes
mmengine load local checkpoints weights-only with mmengine's few safe globals allowed
(:func:`mita_seg.utils.checkpoint.register_safe_globals`)."""
from mita_seg.utils.checkpoint import register_safe_globals
from .attention import MiTAAttention
from .backbones import MiTAVisionTransformer
from .grid import GridContext
from .heads import MiTASegmenterMaskTransformerHead
from .swap import swap_attention

register_safe_globals()

__all__ = [
    'MiTAAttention', 'MiTAVisionTransformer', 'MiTASegmenterMaskTransformerHead',
    'GridContext', 'swap_attention'
]
