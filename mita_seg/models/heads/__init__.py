from .mita_segmenter_head import MiTASegmenterMaskTransformerHead

__all__ = ['MiTASegmenterMaskTransformerHead']
