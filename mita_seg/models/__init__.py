"""mmseg components of mita_seg; importing this module registers them."""
from .attention import MiTAAttention
from .backbones import MiTAVisionTransformer
from .grid import GridContext
from .heads import MiTASegmenterMaskTransformerHead
from .swap import swap_attention

__all__ = [
    'MiTAAttention', 'MiTAVisionTransformer', 'MiTASegmenterMaskTransformerHead',
    'GridContext', 'swap_attention'
]
