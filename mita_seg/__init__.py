"""MiTA (Mixture-of-Top-k Attention) for MMSegmentation.

``import mita_seg`` stays light (the operator needs only torch); mmseg components are
registered by importing :mod:`mita_seg.models` (what configs' ``custom_imports`` do) or on
first use of :func:`swap_attention` or :func:`merge_tokens` (token merging, ToMe).
"""
__version__ = '0.1.0'


def __getattr__(name):
    if name in ('swap_attention', 'merge_tokens', 'MiTAAttention', 'MiTAVisionTransformer',
                'MiTASegmenterMaskTransformerHead'):
        from . import models
        return getattr(models, name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
