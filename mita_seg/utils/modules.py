"""What counts as an attention module (for the swap report and the FLOP breakdown) and
as a token merger (for the FLOP breakdown)."""
import torch.nn as nn


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` is an attention module: ``nn.MultiheadAttention`` and, by class
    name, mmcv's ``MultiheadAttention``, MiTA, timm/mmseg attentions (``*Attention``) and
    Swin's windowed ones (``*MSA``)."""
    name = type(module).__name__
    return (isinstance(module, nn.MultiheadAttention) or name.endswith('Attention')
            or name.endswith('MSA'))


def is_token_merger(module: nn.Module) -> bool:
    """Whether ``module`` matches and merges tokens (ToMe's
    :class:`~mita_seg.models.token_merge.TokenMerger`): its cost is reported on its own,
    not as attention, by the FLOP breakdown."""
    return bool(getattr(type(module), 'merges_tokens', False))
