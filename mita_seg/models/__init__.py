"""mmseg components of mita_seg; importing this module registers them, and makes
mmengine load local checkpoints weights-only with mmengine's few safe globals allowed
(:func:`mita_seg.utils.checkpoint.register_safe_globals`).

The settings (rules, spelling, label) are :mod:`mita_seg.setting`, re-exported here.

Imports within: ``grid`` <- ``attention`` <- ``beit_attention`` <- ``backbones``, ``heads``
<- ``plan`` <- ``swap`` <- ``token_merge``
(the high-level swap depends on the modules, never the reverse); ``fast_attention`` (mmcv's
dense attention on PyTorch's fused path) stands apart, ``segmentors`` builds on it.
"""
from mita_seg.setting import (MITA_DEFAULTS, MITA_KEYS, SETTING_DEFAULTS, SETTING_KEYS,
                              MiTASetting, MiTASettingError,
                              check_settings)
from mita_seg.utils.checkpoint import register_safe_globals
from .attention import (MiTAAttention, MiTASettingsMixin, swapped_attention_modules,
                        use_dense, use_mita)
from .backbones import MiTABEiT, MiTAMAE, MiTAVisionTransformer
from .beit_attention import MiTABEiTAttention, MiTAMAEAttention
from .fast_attention import (DENSE_ATTN_MODES, FastMultiheadAttention, check_dense_attn,
                             dense_attn_of, set_dense_attn)
from .grid import GridContext, GridMismatchError, guard_grids
from .heads import MiTASegmenterMaskTransformerHead
from .plan import PLAN_FORMAT, PlanError, SwapPlan
from .segmentors import SlimEncoderDecoder
from .swap import (SWAP_RULES, NothingToSwapError, attention_layers, check_plan_fits,
                   current_plan, swap_attention)
from .token_merge import NothingToMergeError, ToMeAttention, ToMeFFN, TokenMerger, merge_tokens

register_safe_globals()

__all__ = [
    'MiTAAttention', 'MiTABEiTAttention', 'MiTAMAEAttention', 'MiTASettingsMixin',
    'MiTAVisionTransformer', 'MiTABEiT', 'MiTAMAE', 'MiTASegmenterMaskTransformerHead',
    'SlimEncoderDecoder',
    'GridMismatchError', 'guard_grids',
    'GridContext', 'swap_attention', 'swapped_attention_modules', 'use_mita', 'check_settings',
    'MITA_DEFAULTS',
    'MITA_KEYS', 'SETTING_KEYS', 'SETTING_DEFAULTS', 'SWAP_RULES', 'NothingToSwapError',
    'merge_tokens', 'NothingToMergeError',
    'TokenMerger', 'ToMeAttention', 'ToMeFFN', 'SwapPlan', 'PlanError', 'PLAN_FORMAT',
    'attention_layers', 'check_plan_fits', 'current_plan', 'use_dense', 'MiTASettingError',
    'MiTASetting',
    'DENSE_ATTN_MODES', 'FastMultiheadAttention', 'check_dense_attn', 'dense_attn_of',
    'set_dense_attn'
]
