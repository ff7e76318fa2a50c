"""What counts as an attention module, for the swap report and the FLOP breakdown."""
import torch.nn as nn


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` is an attention module: ``nn.MultiheadAttention`` and, by class
    name, mmcv's ``MultiheadAttention``, MiTA, timm/mmseg attentions (``*Attention``) and
    Swin's windowed ones (``*MSA``)."""
    name = type(module).__name__
    return (isinstance(module, nn.MultiheadAttention) or name.endswith('Attention')
            or name.endswith('MSA'))
