"""MiTA in default-domain ONNX operators: the translation of ``mita_seg::mita_attention`` for
``torch.onnx.export(..., dynamo=True, custom_translation_table=...)``.

The exported file needs no custom operator library: every node is a standard ONNX operator
(opset 18: MatMul, TopK, ArgMax, GatherND, ScatterElements, CumSum, Softmax, ...), so ONNX
Runtime, OpenVINO and TensorRT read it as it is. It computes what
:func:`mita_seg.ops.mita_attention_reference` computes: the same landmarks (adaptive average
pooling as constant averaging matrices, rows then columns), scores, top-k experts and router
choices (ONNX ``TopK`` / ``ArgMax`` on the same float32 logits: the same keys and experts,
barring exact ties), the shared expert, route-only, router top-r, cls / suffix tokens,
BEiT's relative position bias, and global tokens (:mod:`mita_seg.ops.global_tokens`: sliced
off, their keys' logits merged into the other queries' softmax on its maximum, their
queries' dense ``MatMul-Softmax-MatMul`` over all ``N`` keys, concatenated in token order).

The routed part is laid out as the blocked backend lays it out (:mod:`mita_seg.ops.blocked`):
each (query, choice) item goes to a slot of a tile of ``T`` slots that holds one expert's items
only, each expert's run padded to a multiple of ``T``; the number of tiles is bounded
statically (:func:`~mita_seg.ops.blocked.num_tiles`), so every shape is fixed at export. A tile
needs the ``k`` keys of one expert: the routed logits are a batched ``[T, d] x [d, k]`` MatMul,
not a per-query gather of ``N k d`` keys (the other formulation, ``formulation='gather'``, kept
for measurement: it is slower in ONNX Runtime, see docs/deploy.md). The shared and routed
partial softmaxes are merged with their maxima, as in FlashAttention; a query's shared (and
global) maximum is known before the tiles, so each slot exponentiates its logits against the
larger of it and its own maximum, and with one choice (``r = 1``) the slot's partial sums come
back on the query's common maximum: the ``d``-wide outputs are gathered back as they are, never
rescaled or packed with their (max, sum) pairs (8-10% of the layer at N = 4097 on an Ice Lake
Xeon, none at 1025). The top-k of the scores is one unsorted ``TopK`` over ``[B H M, N]`` rows.
Measured and left out (slower in ONNX Runtime 1.32.0): a fixed capacity per expert (one
``[B H M, cap, d]`` MatMul with cap the largest expert's count: routing is uneven, so 3x the
slots at N = 1025), keys and values gathered side by side, and a per-expert ``[M, k, d]`` copy
gathered again per tile; and (ONNX Runtime 1.32.0, AVX2 Zen 3) the router's ArgMax and max as
one ``TopK(k=1)`` (slower than ArgMax + ReduceMax), items ranked within their experts by a
cumulative sum over one-hot rows instead of a sort (the sort is cheap; the one-hot ops are
not), and each expert's ``K^T`` gathered once and then per tile as whole ``[d, k]`` slices, so
that the tile logits need no transposed operand (10% slower). The layout's item numbers and
its ones and zeros are built in the graph (a ``Range``, ``ConstantOfShape``), not folded into
the file by the exporter: a layer's constants, but for the pooling's two averaging matrices,
do not grow with the grid (the folded ``[B H, N r]`` and ``[B H, L]`` int64 tensors were
236 KB of the tiny BEiT's file, about 18 MB of BEiT-B's at 1024); ONNX Runtime computes them
once, when it loads the file.

With a relative position bias the graph never forms the ``[H, N, N]`` bias: the landmarks'
mean biases are box sums of the 2-D table (an integral image in float64, as
:func:`mita_seg.ops.bias.landmark_bias` computes them), and each routed logit's bias is read
from the table at the index mmseg's ``relative_position_index`` would hold. Nothing of the
grid's size is a constant of the file: the box sums' indices are built in the graph (separable
reads, a ``Range`` per axis), and what is computed from the table is kept from the exporter's
constant folding (:func:`.graph.unfolded`), so that a layer adds its table and constants of
the landmarks' size; ONNX Runtime computes the landmarks' biases once, when it loads the file.

The package is in three parts, each importing only those before it. :mod:`.common` holds
what both others need, with torch alone (the settings, the error, the landmarks' averaging
matrices, the tile size, why a call cannot be translated); this module adds the routing-aware
tie check, the check's stand-in for MiTA's node (:func:`stand_in_attention`,
:func:`stand_in_table`) and :func:`mita_translation_table`, and re-exports :mod:`.common`'s
names;
:mod:`.graph` builds the graph, importing ``onnxscript`` at its top, and is imported only when a
table is built (:func:`mita_translation_table`), so ``import mita_seg.ops.onnx`` works without
onnxscript.
"""
from typing import Callable, Dict, Optional, Tuple

import torch

from ..bias import RelPosBias, landmark_bias
from ..global_tokens import split_tokens
from ..routing import mita_routing
from .common import (FORMULATIONS, TIE_RTOL, OnnxExportError, onnx_block_size,
                     onnx_unsupported, pool_matrix)

__all__ = ['OnnxExportError', 'FORMULATIONS', 'TIE_RTOL', 'pool_matrix',
           'mita_translation_table', 'onnx_unsupported', 'onnx_block_size', 'routing_ties',
           'stand_in_attention', 'stand_in_table']


def routing_ties(q: torch.Tensor, k: torch.Tensor, hw_shape: Tuple[int, int],
                 pool_size: Tuple[int, int], topk: int, router_topk: int = 1,
                 num_prefix_tokens: int = 1, shared_scale: Optional[float] = None,
                 bias: Optional[RelPosBias] = None, rtol: float = TIE_RTOL,
                 global_tokens: Tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The queries whose routing sits at a near-tie: ``[B, H, N]`` bool.

    A query's routing is its router choice (the ``r`` largest of ``G[n]``) and its experts'
    top-k key sets (the ``k`` largest of ``S[m]``). A decision is a near-tie when the margin
    between the last value taken and the first left out is at most ``rtol`` times the
    largest ``|S|`` (``|G|``) of the batch item and head: there two correct float32
    implementations (ONNX Runtime's graph, PyTorch's backends) may decide either way.
    Every other query is routed the same way by any of them, so their outputs must agree
    within float32 rounding.

    Args:
        q, k (Tensor): ``[B, H, N, d]``, as :func:`mita_seg.ops.mita_attention` takes them.
        hw_shape, pool_size (tuple[int, int]), topk, router_topk, num_prefix_tokens (int),
        shared_scale (float, optional), bias (RelPosBias, optional): the call's settings
            (validated, ``topk <= N``).
        rtol (float): the margin, relative to the largest score. Default: :data:`TIE_RTOL`.
        global_tokens (tuple[int, int]): the call's ``(prefix, suffix)`` global tokens:
            they are not routed (never a tie), the others are routed among themselves.
            Default: (0, 0).

    Returns:
        Tensor: ``[B, H, N]`` bool, True where the query's routing is at a near-tie.
    """
    gp, gs = global_tokens
    if gp or gs:
        ties = routing_ties(*(split_tokens(t, (gp, gs))[0] for t in (q, k)), hw_shape,
                            pool_size, topk, router_topk, num_prefix_tokens - gp,
                            shared_scale, bias, rtol)
        return torch.nn.functional.pad(ties, (gp, gs), value=False)
    N = q.shape[2]
    lm_bias = None if bias is None else landmark_bias(bias, pool_size)
    rt = mita_routing(q.float(), k.float(), hw_shape, pool_size, topk, router_topk,
                      num_prefix_tokens, shared_scale, lm_bias)
    S, G = rt.scores, rt.router                                       # [B,H,M,N], [B,H,N,M]

    def close(x, taken, scale):
        """Margin of the ``taken`` largest of each row of ``x`` <= rtol * scale."""
        if taken >= x.shape[-1]:
            return torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
        top = x.topk(taken + 1, dim=-1).values
        return top[..., taken - 1] - top[..., taken] <= rtol * scale

    scale_s = S.abs().amax(dim=(2, 3), keepdim=True)[..., 0]           # [B, H, 1]
    scale_g = G.abs().amax(dim=(2, 3), keepdim=True)[..., 0]
    expert_tie = close(S, min(topk, N), scale_s)                      # [B, H, M]
    router_tie = close(G, router_topk, scale_g)                       # [B, H, N]
    chosen_tie = expert_tie.gather(2, rt.choice.flatten(2)).view(rt.choice.shape)
    return router_tie | chosen_tie.any(-1)


def stand_in_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A deterministic, continuous stand-in for MiTA's output, which the export's check puts
    in place of ``mita_seg::mita_attention`` in PyTorch and in ONNX (its ONNX graph:
    :func:`stand_in_table`) to compare everything around MiTA's node strictly: each value
    gated by its query's agreement with the mean key,
    ``v * sigmoid(q . mean_n(k) / sqrt(d) + mean(bias_table[h]))``. Not attention, but
    every input is read (the projections that make ``q``, ``k``, ``v`` and the bias table
    are all in the graph) and no decision can flip: two correct float32 implementations
    agree within float32 rounding.

    Args:
        q, k, v (Tensor): ``[B, H, N, d]``, as the operator takes them.
        bias_table (Tensor, optional): ``[H, T]``, the operator's relative position bias
            table. Default: None.

    Returns:
        Tensor: ``[B, N, H, d]``, contiguous, as the operator returns it.
    """
    logit = (q * k.mean(2, keepdim=True)).sum(-1, keepdim=True) * q.shape[-1] ** -0.5
    if bias_table is not None:
        logit = logit + bias_table.mean(-1).view(1, -1, 1, 1)
    return (v * torch.sigmoid(logit)).transpose(1, 2).contiguous()


def _graph():
    """:mod:`.graph`, or :class:`OnnxExportError` if onnxscript is missing."""
    try:
        from . import graph
    except ImportError as e:
        raise OnnxExportError(
            f'exporting MiTA to ONNX needs onnxscript ({e}): pip install the versions '
            'pinned in requirements.txt (onnx, onnxruntime, onnxscript)') from None
    return graph


def mita_translation_table(formulation: str = 'tiles', tile_size: Optional[int] = None
                           ) -> Dict[Callable, Callable]:
    """The ``custom_translation_table`` that exports ``mita_seg::mita_attention``.

    Args:
        formulation (str): ``'tiles'`` (expert-pure tiles; the default) or ``'gather'``
            (each query gathers its experts' ``r k`` keys). Default: 'tiles'.
        tile_size (int, optional): tile size ``T``; None picks :func:`onnx_block_size`.
            Default: None.

    Returns:
        dict: ``{torch.ops.mita_seg.mita_attention.default: translation}``; the
        translation, like the op, returns ``[B, N, H, d]`` (a table of one's own must too:
        ``[B, H, N, d]`` would reshape to the right size with the heads mixed up).

    Raises:
        OnnxExportError: ``onnxscript`` is not installed, or an unknown formulation.
    """
    if formulation not in FORMULATIONS:
        raise OnnxExportError(f'unknown formulation {formulation!r}; choose one of '
                              f'{FORMULATIONS}')
    return _graph().translation_table(formulation, tile_size)


def stand_in_table(table: Optional[Dict[Callable, Callable]] = None
                   ) -> Dict[Callable, Callable]:
    """``table`` (None: none) with ``mita_seg::mita_attention`` translated as
    :func:`stand_in_attention` (:func:`.graph.stand_in_translation`): the graph the export's
    check compares with PyTorch's model under the same stand-in, to check everything around
    MiTA's node strictly (every other entry of ``table`` is kept).

    Raises:
        OnnxExportError: ``onnxscript`` is not installed.
    """
    graph = _graph()
    return {**(table or {}),
            torch.ops.mita_seg.mita_attention.default: graph.stand_in_translation}
