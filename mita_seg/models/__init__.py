"""mmseg components of mita_seg; importing this module registers them, and makes
mmengine load local checkpoints weights-only with mmengine's few safe globals allowed
(:func:`mita_seg.utils.checkpoint.register_safe_globals`).

Imports within: ``grid`` <- ``attention`` <- ``beit_attention`` <- ``backbones``, ``heads``
<- ``swap``
(the high-level swap depends on the modules, never the reverse); ``segmentors`` stands apart.
"""
from mita_seg.utils.checkpoint import register_safe_globals
from .attention import (MITA_DEFAULTS, MITA_KEYS, MiTAAttention, MiTASettingsMixin,
                        check_settings, use_mita)
from .backbones import MiTABEiT, MiTAMAE, MiTAVisionTransformer
from .beit_attention import MiTABEiTAttention, MiTAMAEAttention
from .grid import GridContext, GridMismatchError, guard_grids
from .heads import MiTASegmenterMaskTransformerHead
from .segmentors import SlimEncoderDecoder
from .swap import SWAP_RULES, NothingToSwapError, swap_attention

register_safe_globals()

__all__ = [
    'MiTAAttention', 'MiTABEiTAttention', 'MiTAMAEAttention', 'MiTASettingsMixin',
    'MiTAVisionTransformer', 'MiTABEiT', 'MiTAMAE', 'MiTASegmenterMaskTransformerHead',
    'SlimEncoderDecoder',
    'GridMismatchError', 'guard_grids',
    'GridContext', 'swap_attention', 'use_mita', 'check_settings', 'MITA_DEFAULTS',
    'MITA_KEYS', 'SWAP_RULES', 'NothingToSwapError'
]
