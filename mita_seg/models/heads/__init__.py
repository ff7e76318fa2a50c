from .mita_segmenter_head import MiTASegmenterMaskTransformerHead, with_grid_forward

__all__ = ['MiTASegmenterMaskTransformerHead', 'with_grid_forward']
