"""The bound of an attention swap: the same model with the swapped layers' attention
mixing removed (measurement only, not attention).

A swapped layer still pays its q, k, v and output projections; no attention between them can
cost less than none. :func:`remove_attention_mixing` turns each :class:`MiTAAttention` of a
swapped model into a :class:`NoMixingAttention`, which keeps the projections and outputs
``out = v``: the speed of that model is the most any attention in those layers can reach
(``tools/benchmark.py --level model``'s ``bound`` column; ``--level onnx`` builds the same
bound in the exported graph).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from mita_seg.models.attention import MiTAAttention

__all__ = ['NoMixingAttention', 'remove_attention_mixing']


class NoMixingAttention(MiTAAttention):
    """A :class:`MiTAAttention` whose attention is ``out = v``: the packed q, k, v
    projection (all three, as attention pays for them) and the output projection of
    mmcv's ``MultiheadAttention``, with no mixing of tokens between them. For measuring
    only; :func:`remove_attention_mixing` makes one from a swapped layer."""

    def forward(self, query: torch.Tensor, key=None, value=None, identity=None,
                query_pos=None, **kwargs) -> torch.Tensor:
        """``identity + dropout(out_proj(v))`` with ``v`` the value projection of
        ``query`` (``+ query_pos``); the layout (batch first or not) does not matter, as
        no token sees another."""
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        C = query.shape[-1]
        qkv = F.linear(query, self.attn.in_proj_weight, self.attn.in_proj_bias)  # [.., 3C]
        v = qkv[..., 2 * C:]                                  # a strided view: no copy
        if v.dtype in (torch.bfloat16, torch.float16):
            # (autocast) the output projection reads a strided input on a slow path: a copy
            # of v is cheaper (Zen 3, one ViT-B layer at N = 4097: 1567 ms strided, 1156 ms
            # copied, docs/benchmark.md); float32 GEMMs read it in place
            v = v.contiguous()
        x = self.attn.out_proj(v)
        return identity + self.dropout_layer(self.proj_drop(x))


def remove_attention_mixing(model: nn.Module) -> int:
    """Turn every :class:`MiTAAttention` of ``model`` into a :class:`NoMixingAttention`
    (in place, same parameters): the model with the swapped layers' attention mixing
    removed and their projections kept.

    Returns:
        int: the number of layers changed.

    Raises:
        ValueError: ``model`` has no :class:`MiTAAttention` (swap it first, e.g.
            :func:`mita_seg.swap_attention`; BEiT/MAE attention is not covered).
    """
    done = 0
    for m in model.modules():
        if type(m) is MiTAAttention:
            m.__class__ = NoMixingAttention
            done += 1
    if not done:
        raise ValueError(f'{type(model).__name__} has no MiTAAttention layer to remove the '
                         'attention mixing of: swap its attention first '
                         '(mita_seg.swap_attention); BEiT/MAE attention is not covered')
    return done
