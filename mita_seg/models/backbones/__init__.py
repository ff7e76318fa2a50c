from .mita_vit import MiTAVisionTransformer

__all__ = ['MiTAVisionTransformer']
