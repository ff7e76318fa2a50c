"""Global tokens: tokens outside the grid that MiTA does not route.

As in BigBird and Longformer, a few tokens that need the whole image (Segmenter's class
embeddings; ViT's cls where chosen) are global: as a query, a global token attends to every
key exactly (dense ``T x N`` attention); as a key, it is in every other query's softmax
exactly (``T`` more logits ``q . k_g / sqrt(d)`` with values ``v_g``, next to the shared and
routed ones). It is no candidate of an expert's top-k (so it is counted once) and routes no
query. The other tokens run MiTA among themselves: :func:`with_global_tokens` calls the
backend on them, with the global keys and values as :attr:`Inputs.global_kv
<mita_seg.ops.dispatch.Inputs>`, which every backend adds to each query's softmax (the
reference and the blocked backend as one more block of logits, the varlen backend as more
keys of every group, the fused CPU backend by merging its log-sum-exp with theirs,
:func:`merge_lse`).

Equivalent PyTorch code (one batch item and head; ``g`` the global positions, ``o`` the
others, ``mita_logits(n)`` / ``mita_values(n)`` MiTA's shared and routed logits and values of
query ``n`` over the tokens ``o``)::

    for n in o:
        logits = cat([mita_logits(n), q[n] @ k[g].T / sqrt(d)])
        out[n] = softmax(logits, -1) @ cat([mita_values(n), v[g]])
    out[g] = softmax(q[g] @ k.T / sqrt(d), -1) @ v
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .routing import routing_dtype

__all__ = ['with_global_tokens', 'attend_with_lse', 'merge_lse', 'split_tokens']


def split_tokens(x: Tensor, global_tokens: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
    """``x`` (``[B, H, N, ...]``) as ``(others, globals)``: the global tokens are the first
    ``global_tokens[0]`` and the last ``global_tokens[1]``, in token order."""
    gp, gs = global_tokens
    N = x.shape[2]
    return x[:, :, gp:N - gs], torch.cat([x[:, :, :gp], x[:, :, N - gs:]], 2)


def attend_with_lse(q: Tensor, k: Tensor, v: Tensor,
                    bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention with scale ``1 / sqrt(d)`` in the routing dtype (float32 or
    wider) and its log-sum-exp: ``(out [..., L, d], lse [..., L])``, differentiable in both.
    ``bias`` (broadcast to the ``[..., L, n]`` logits) is added to them. Explicit (``T x N``
    or ``N x T`` logits: small), so that FLOP counters see it."""
    dt = routing_dtype(q.dtype)
    logits = (q.to(dt) * q.shape[-1] ** -0.5) @ k.to(dt).transpose(-1, -2)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    lse = torch.logsumexp(logits, -1)
    return torch.exp(logits - lse.unsqueeze(-1)) @ v.to(dt), lse


def merge_lse(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """The softmax attention over the union of two sets of logits, from each one's output
    and log-sum-exp (FlashAttention's merge): ``(e^lse_a out_a + e^lse_b out_b) /
    (e^lse_a + e^lse_b)``, in the dtype of ``lse_a``."""
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a.to(lse.dtype) +
            torch.exp(lse_b - lse).unsqueeze(-1) * out_b.to(lse.dtype))


def with_global_tokens(inp, fn) -> Tensor:
    """MiTA of ``inp`` (a :class:`~mita_seg.ops.dispatch.Inputs` with ``global_tokens``)
    with the backend ``fn``: ``fn`` on the other tokens (their prefix count reduced by the
    global prefix tokens) with the global keys and values as ``global_kv``, and the global
    queries' dense attention over every key.

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``.
    """
    gp, gs = inp.global_tokens
    if not gp and not gs:
        return fn(inp)
    (q_o, q_g), (k_o, k_g), (v_o, v_g) = (split_tokens(t, (gp, gs))
                                          for t in (inp.q, inp.k, inp.v))
    out_o = fn(inp._replace(q=q_o, k=k_o, v=v_o, num_prefix_tokens=inp.num_prefix_tokens - gp,
                            global_tokens=(0, 0), global_kv=(k_g, v_g)))
    out_g = attend_with_lse(q_g, inp.k, inp.v)[0].to(inp.dtype)      # [B, H, T, d]
    return torch.cat([out_g[:, :, :gp], out_o, out_g[:, :, gp:]], 2)
