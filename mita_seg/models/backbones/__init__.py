from .mita_beit import MiTABEiT, MiTAMAE
from .mita_vit import MiTAVisionTransformer

__all__ = ['MiTAVisionTransformer', 'MiTABEiT', 'MiTAMAE']
