"""mmseg's dense global attention on PyTorch's fused path (:func:`set_dense_attn`).

mmseg's ViT family (ViT, DeiT, SETR, DPT, Segmenter's encoder) and Segmenter's mask head run
attention through mmcv's ``MultiheadAttention``, which calls ``torch.nn.MultiheadAttention``
with its default ``need_weights=True``: torch then computes the attention explicitly
(``bmm``, ``softmax``, ``bmm``), materialising the ``[B*H, N, N]`` weights, and averages
them over the heads for a return value mmcv discards (``[0]``). With ``need_weights=False``
the same function calls ``F.scaled_dot_product_attention`` (a fused kernel that never forms
the weights): the same projections, the same attention to float rounding, the same
parameters.

:func:`set_dense_attn` swaps the class of the ``nn.MultiheadAttention`` inside each mmcv
``MultiheadAttention`` (ToMe style, so module names, parameters and state dicts stay as they
are) to :class:`FastMultiheadAttention` (``'fast'``) or back (``'mmseg'``). The inner module
of a layer swapped to MiTA is the very module :func:`~mita_seg.models.use_dense` puts back,
so a layer made dense again runs the path the model was set to.

BEiT/MAE attention is mmseg's own (``BEiTAttention``): it forms the ``N x N`` logits to add
its relative position bias and has no weights-returning path to drop; it is left alone.

This module depends on mmcv's and torch's classes only.
"""
from typing import Optional

import torch
import torch.nn as nn
from mmcv.cnn.bricks.transformer import MultiheadAttention

# 'fast': PyTorch's fused SDPA path; 'mmseg': mmseg's own (the N x N weights materialised)
DENSE_ATTN_MODES = ('fast', 'mmseg')


class FastMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` that never computes attention weights.

    ``forward`` is ``nn.MultiheadAttention.forward`` with ``need_weights=False`` whatever
    the caller asks, so torch takes ``F.scaled_dot_product_attention`` instead of forming
    the weights; it returns ``(output, None)``. Only :func:`set_dense_attn` makes one, by
    swapping the class of the module inside an mmcv ``MultiheadAttention`` (which keeps
    only the output). Same parameters and state dict keys as ``nn.MultiheadAttention``.
    """

    def forward(self,
                query: torch.Tensor,
                key: torch.Tensor,
                value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None,
                need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None,
                average_attn_weights: bool = True,
                is_causal: bool = False):
        return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                               need_weights=False, attn_mask=attn_mask,
                               average_attn_weights=average_attn_weights, is_causal=is_causal)


# mode -> the class of the nn.MultiheadAttention inside an mmcv MultiheadAttention
_CLASSES = {'fast': FastMultiheadAttention, 'mmseg': nn.MultiheadAttention}


def check_dense_attn(mode) -> str:
    """``mode`` if it is one of :data:`DENSE_ATTN_MODES`.

    Raises:
        ValueError: any other value, naming it and the choices.
    """
    if not isinstance(mode, str) or mode not in DENSE_ATTN_MODES:
        raise ValueError(
            f"dense_attn={mode!r}: give 'fast' (PyTorch's fused scaled_dot_product_attention"
            ", mmseg's results to float rounding) or 'mmseg' (mmseg's own path, which "
            'materialises the N x N attention weights)')
    return mode


def _inner_attentions(model: nn.Module):
    """The ``nn.MultiheadAttention`` (or :class:`FastMultiheadAttention`) inside each mmcv
    ``MultiheadAttention`` of ``model`` (also its subclasses: ToMe's, and MiTA's, which
    holds the module of the layer it replaced)."""
    for m in model.modules():
        if isinstance(m, MultiheadAttention) and type(m.attn) in _CLASSES.values():
            yield m.attn


def set_dense_attn(model: nn.Module, mode: str = 'fast') -> int:
    """Put the dense global attention of ``model`` (mmcv ``MultiheadAttention``: mmseg's
    ViT family and Segmenter's mask head) on PyTorch's fused path (``'fast'``) or on
    mmseg's own (``'mmseg'``), in place. Parameters, names and state dict keys are
    unchanged; ``'fast'`` gives mmseg's results to float32 rounding. Layers on MiTA keep
    running MiTA; their standard module follows too, for :func:`use_dense`.

    Args:
        model (nn.Module): any model (a segmentor, a backbone, a head).
        mode (str): ``'fast'`` or ``'mmseg'``. Default: 'fast'.

    Returns:
        int: the number of mmcv ``MultiheadAttention`` modules now on ``mode``.

    Raises:
        ValueError: ``mode`` is not one of :data:`DENSE_ATTN_MODES`.
    """
    cls = _CLASSES[check_dense_attn(mode)]
    done = 0
    for attn in _inner_attentions(model):
        attn.__class__ = cls
        done += 1
    return done


def dense_attn_of(model: nn.Module) -> Optional[str]:
    """The dense attention path of ``model``'s mmcv ``MultiheadAttention`` modules:
    ``'fast'``, ``'mmseg'``, ``'mixed'``, or None where it has none (e.g. for a label that
    says what ran)."""
    modes = {('fast' if type(a) is FastMultiheadAttention else 'mmseg')
             for a in _inner_attentions(model)}
    return None if not modes else modes.pop() if len(modes) == 1 else 'mixed'


__all__ = ['DENSE_ATTN_MODES', 'FastMultiheadAttention', 'check_dense_attn',
           'set_dense_attn', 'dense_attn_of']
