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

The routed part is laid out as the blocked backend lays it out
(:mod:`mita_seg.ops.blocked`): each (query, choice) item goes to a slot of a tile of ``T``
slots that holds one expert's items only, each expert's run padded to a multiple of ``T``;
the number of tiles is bounded statically (:func:`~mita_seg.ops.blocked.num_tiles`), so every
shape is fixed at export. A tile needs the ``k`` keys of one expert: the routed logits are a
batched ``[T, d] x [d, k]`` MatMul, not a per-query gather of ``N k d`` keys (the other
formulation, ``formulation='gather'``, kept for measurement: it is slower in ONNX Runtime, see
docs/deploy.md). The shared and routed partial softmaxes are merged with their maxima, as in
FlashAttention; a query's shared (and global) maximum is known before the tiles, so each slot
exponentiates its logits against the larger of it and its own maximum, and with one choice
(``r = 1``) the slot's partial sums come back on the query's common maximum: the ``d``-wide
outputs are gathered back as they are, never rescaled or packed with their (max, sum) pairs
(8-10% of the layer at N = 4097 on an Ice Lake Xeon, none at 1025). The top-k of the scores is one unsorted ``TopK`` over
``[B H M, N]`` rows. Measured and left out (slower in ONNX Runtime 1.32.0): a fixed
capacity per expert (one ``[B H M, cap, d]`` MatMul with cap the largest expert's count:
routing is uneven, so 3x the slots at N = 1025), keys and values gathered side by side, and a
per-expert ``[M, k, d]`` copy gathered again per tile; and (ONNX Runtime 1.32.0, AVX2 Zen 3)
the router's ArgMax and max as one ``TopK(k=1)`` (slower than ArgMax + ReduceMax), items
ranked within their experts by a cumulative sum over one-hot rows instead of a sort (the sort
is cheap; the one-hot ops are not), and each expert's ``K^T`` gathered once and then per tile
as whole ``[d, k]`` slices, so that the tile logits need no transposed operand (10% slower).

With a relative position bias the graph never forms the ``[H, N, N]`` bias: the landmarks'
mean biases are box sums of the 2-D table (an integral image in float64, as
:func:`mita_seg.ops.bias.landmark_bias` computes them), and each routed logit's bias is read
from the table at the index mmseg's ``relative_position_index`` would hold.

``onnxscript`` is imported only when a table is built (:func:`mita_translation_table`), so
this module imports with torch alone.
"""
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .bias import RelPosBias, landmark_bias, table_size
from .blocked import default_block_size, num_tiles
from .global_tokens import split_tokens
from .routing import mita_routing

__all__ = ['OnnxExportError', 'FORMULATIONS', 'TIE_RTOL', 'pool_matrix',
           'mita_translation_table', 'onnx_unsupported', 'onnx_block_size', 'routing_ties']

FORMULATIONS = ('tiles', 'gather')
# A routing decision is a near-tie when its margin is at most this share of the largest
# |score| (|router logit|) of its batch item and head: float32 rounding of the scores is
# about 1e-7 of them, so two correct implementations may decide such a row either way.
TIE_RTOL = 1e-5


class OnnxExportError(ValueError):
    """A MiTA call (or an environment) the ONNX translation cannot export; the message says
    what to change."""


def pool_matrix(hw_shape: Tuple[int, int], pool_size: Tuple[int, int]) -> np.ndarray:
    """``[Ph*Pw, h*w]`` float32: row ``m`` averages landmark ``m``'s region of the row-major
    grid, the regions of ``adaptive_avg_pool2d`` (``[floor(i h / P), ceil((i + 1) h / P))``)."""
    (h, w), (ph, pw) = hw_shape, pool_size
    P = np.zeros((ph, pw, h, w), np.float32)
    for i in range(ph):
        r0, r1 = (i * h) // ph, -(-((i + 1) * h) // ph)
        for j in range(pw):
            c0, c1 = (j * w) // pw, -(-((j + 1) * w) // pw)
            P[i, j, r0:r1, c0:c1] = 1.0 / ((r1 - r0) * (c1 - c0))
    return P.reshape(ph * pw, h * w)


def onnx_block_size(num_tokens: int, router_topk: int, num_experts: int) -> int:
    """Tile size ``T`` of the ONNX graph: four times the blocked backend's choice
    (:func:`~mita_seg.ops.blocked.default_block_size`), in ``[8, 64]`` (16 at N = 1025, 64 at
    N = 4097 with 49 experts): ONNX Runtime runs a batched MatMul as one small GEMM per tile,
    whose call costs more than padding slots."""
    return int(min(64, max(8, 4 * default_block_size(num_tokens * router_topk, num_experts))))


def onnx_unsupported(dtype: torch.dtype, shape: Tuple[int, ...]) -> List[str]:
    """Why a MiTA call of these inputs cannot be translated (empty when it can)."""
    why = []
    if dtype != torch.float32:
        why.append(f'the ONNX translation runs float32 inputs, got {dtype}: export the '
                   'model in float32')
    if len(shape) != 4 or not all(isinstance(s, int) for s in shape):
        why.append(f'the ONNX translation needs static shapes [B, H, N, d], got {shape}: '
                   'export with a fixed input shape (no dynamic_shapes)')
    return why


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


def _static_shape(value) -> Tuple[int, ...]:
    shape = tuple(getattr(value, 'shape', None) or ())
    dims = tuple(int(s) if isinstance(s, int) or str(s).isdigit() else s for s in shape)
    dtype = getattr(value, 'dtype', None)
    why = onnx_unsupported(torch.float32 if str(dtype).upper().endswith('FLOAT') else dtype,
                           dims)
    if why:
        raise OnnxExportError('; '.join(why))
    return dims


def mita_translation_table(formulation: str = 'tiles', tile_size: Optional[int] = None
                           ) -> Dict[Callable, Callable]:
    """The ``custom_translation_table`` that exports ``mita_seg::mita_attention``.

    Args:
        formulation (str): ``'tiles'`` (expert-pure tiles; the default) or ``'gather'``
            (each query gathers its experts' ``r k`` keys). Default: 'tiles'.
        tile_size (int, optional): tile size ``T``; None picks :func:`onnx_block_size`.
            Default: None.

    Returns:
        dict: ``{torch.ops.mita_seg.mita_attention.default: translation}``.

    Raises:
        OnnxExportError: ``onnxscript`` is not installed, or an unknown formulation.
    """
    if formulation not in FORMULATIONS:
        raise OnnxExportError(f'unknown formulation {formulation!r}; choose one of '
                                   f'{FORMULATIONS}')
    try:
        import onnx_ir as ir
        from onnxscript import FLOAT
        from onnxscript import opset18 as op
    except ImportError as e:
        raise OnnxExportError(
            f'exporting MiTA to ONNX needs onnxscript ({e}): pip install the versions '
            'pinned in requirements.txt (onnx, onnxruntime, onnxscript)') from None
    from . import mita  # noqa: F401  (registers torch.ops.mita_seg.mita_attention)

    def const(arr, dtype=np.int64):
        return op.Constant(value=ir.tensor(np.asarray(arr, dtype=dtype)))

    def gather_rows(data, index, BH, X, rest):
        """``data[b, index[b, i]]`` for ``data`` ``[BH, X, *rest]``, ``index`` ``[BH, I]``:
        one Gather on the flattened ``[BH X, *rest]`` (ONNX Runtime copies whole slices;
        GatherND with batch_dims is much slower). ``X``: an int or a ``[1]`` int64 value."""
        if isinstance(X, int):
            offset = const((np.arange(BH) * X).reshape(BH, 1))
        else:
            offset = op.Mul(const(np.arange(BH).reshape(BH, 1)), X)
        flat = op.Reshape(data, const([-1] + list(rest)))
        return op.Gather(flat, op.Add(index, offset), axis=0)

    def bias_index(qi, kj, Wh, Ww):
        """mmseg's ``relative_position_index[qi, kj]`` (:func:`~.bias.bias_index`)."""
        T = table_size((Wh, Ww))
        one, ww = const(1), const(Ww)
        gi, gj = op.Sub(qi, one), op.Sub(kj, one)
        # gi, gj >= 0 wherever the grid formula is kept (cls rows/columns are replaced).
        dy = op.Sub(op.Div(gi, ww), op.Div(gj, ww))
        dx = op.Sub(op.Mod(gi, ww), op.Mod(gj, ww))
        idx = op.Add(op.Add(op.Mul(op.Add(dy, const(Wh - 1)), const(2 * Ww - 1)), dx),
                     const(Ww - 1))
        q_cls, k_cls = op.Equal(qi, const(0)), op.Equal(kj, const(0))
        idx = op.Where(q_cls, const(T - 3), idx)
        idx = op.Where(k_cls, const(T - 2), idx)
        return op.Where(op.And(q_cls, k_cls), const(T - 1), idx)

    def landmark_bias_graph(table, H, Wh, Ww, Ph, Pw):
        """``(Bq [H, M, N], Bk [H, N, M])`` of :func:`mita_seg.ops.bias.landmark_bias`: box
        sums over the 2-D table (an integral image in float64, four reads each), never the
        ``[H, N, N]`` bias. The corner indices are sums of two small constants, broadcast
        in the graph (no ``M N`` constant in the file)."""
        T = table_size((Wh, Ww))
        t2 = op.Reshape(op.Cast(op.Slice(table, const([0]), const([T - 3]), const([1])),
                                to=11), const([H, 2 * Wh - 1, 2 * Ww - 1]))
        ii = op.CumSum(op.CumSum(t2, const(1)), const(2))
        ii = op.Reshape(op.Pad(ii, const([0, 1, 1, 0, 0, 0])), const([H, -1]))  # [H, 2Wh 2Ww]
        r0, r1 = (np.arange(Ph) * Wh) // Ph, -(-((np.arange(Ph) + 1) * Wh) // Ph)
        c0, c1 = (np.arange(Pw) * Ww) // Pw, -(-((np.arange(Pw) + 1) * Ww) // Pw)
        y, x = np.arange(Wh), np.arange(Ww)
        area = ((r1 - r0)[:, None] * (c1 - c0)[None, :]).reshape(-1).astype(np.float64)
        M = Ph * Pw

        def box(a0, a1, b0, b1, shape):
            # sums over [a0, a1) x [b0, b1) of the table's offsets; a*: rows, b*: columns
            def read(a, b):
                idx = op.Add(const(a * (2 * Ww)), const(b))
                return op.Gather(ii, op.Reshape(idx, const([-1])), axis=1)
            s = op.Add(op.Sub(op.Sub(read(a1, b1), read(a0, b1)), read(a1, b0)),
                       read(a0, b0))
            return op.Reshape(s, const([H] + shape))

        # Bq: queries in region m (rows yi in [r0, r1)), key at (y, x): dy = yi - y.
        bq = box((r0[:, None] - y[None] + Wh - 1).reshape(Ph, 1, Wh, 1),
                 (r1[:, None] - y[None] + Wh - 1).reshape(Ph, 1, Wh, 1),
                 (c0[:, None] - x[None] + Ww - 1).reshape(1, Pw, 1, Ww),
                 (c1[:, None] - x[None] + Ww - 1).reshape(1, Pw, 1, Ww), [M, Wh * Ww])
        bq = op.Cast(op.Div(bq, const(area.reshape(1, M, 1), np.float64)), to=1)
        # Bk: query at (y, x), keys in region m (yj in [r0, r1)): dy = y - yj.
        bk = box((y[:, None] - r1[None] + Wh).reshape(Wh, 1, Ph, 1),
                 (y[:, None] - r0[None] + Wh).reshape(Wh, 1, Ph, 1),
                 (x[:, None] - c1[None] + Ww).reshape(1, Ww, 1, Pw),
                 (x[:, None] - c0[None] + Ww).reshape(1, Ww, 1, Pw), [Wh * Ww, M])
        bk = op.Cast(op.Div(bk, const(area.reshape(1, 1, M), np.float64)), to=1)
        # cls: grid queries towards the cls key use token-to-cls (T - 2); the cls query
        # towards grid keys uses cls-to-token (T - 3).
        to_cls = op.Slice(table, const([T - 2]), const([T - 1]), const([1]))     # [H, 1]
        from_cls = op.Slice(table, const([T - 3]), const([T - 2]), const([1]))
        Bq = op.Concat(op.Expand(op.Unsqueeze(to_cls, const([1])), const([H, M, 1])), bq,
                       axis=2)                                               # [H, M, N]
        Bk = op.Concat(op.Expand(op.Unsqueeze(from_cls, const([1])), const([H, 1, M])), bk,
                       axis=1)                                               # [H, N, M]
        return Bq, Bk

    def translation(q: FLOAT, k: FLOAT, v: FLOAT, h: int, w: int, ph: int, pw: int,
                    topk: int, router_topk: int, num_prefix_tokens: int,
                    with_shared_expert: bool, shared_scale: float, block_size: int,
                    backend: str, bias_table: Optional[FLOAT] = None, window_h: int = 0,
                    window_w: int = 0, global_prefix: int = 0, global_suffix: int = 0
                    ) -> FLOAT:
        B, H, N, d = _static_shape(q)
        gp, gs = global_prefix, global_suffix
        settings = (h, w, ph, pw, topk, router_topk, with_shared_expert, shared_scale,
                    bias_table, window_h, window_w)
        if not gp and not gs:
            return mita_graph(q, k, v, B, H, N, d, num_prefix_tokens, *settings)
        # Global tokens (mita_seg.ops.global_tokens.with_global_tokens): MiTA on the other
        # tokens with the global keys in every query's softmax; the global queries' dense
        # attention over all N keys; the outputs concatenated in token order.

        def tokens(t, start, end):
            return op.Slice(t, const([start]), const([end]), const([2]))

        def global_part(t):                                                # [B, H, T, d]
            parts = ([tokens(t, 0, gp)] if gp else []) + ([tokens(t, N - gs, N)] if gs else [])
            return parts[0] if len(parts) == 1 else op.Concat(*parts, axis=2)

        q_o, k_o, v_o = (tokens(t, gp, N - gs) for t in (q, k, v))
        out_o = mita_graph(q_o, k_o, v_o, B, H, N - gp - gs, d, num_prefix_tokens - gp,
                           *settings, global_kv=(global_part(k), global_part(v), gp + gs))
        logits_g = op.MatMul(op.Mul(global_part(q), const(d ** -0.5, np.float32)),
                             op.Transpose(k, perm=[0, 1, 3, 2]))             # [B, H, T, N]
        out_g = op.MatMul(op.Softmax(logits_g, axis=-1), v)                 # [B, H, T, d]
        parts = ([tokens(out_g, 0, gp)] if gp else []) + [out_o] + (
            [tokens(out_g, gp, gp + gs)] if gs else [])
        return op.Concat(*parts, axis=2)

    def mita_graph(q, k, v, B: int, H: int, N: int, d: int, p: int, h: int, w: int,
                   ph: int, pw: int, topk: int, router_topk: int, with_shared_expert: bool,
                   shared_scale: float, bias_table, window_h: int, window_w: int,
                   global_kv: Optional[tuple] = None):
        """MiTA of ``q, k, v`` (``[B, H, N, d]``, ``p`` prefix tokens): ``[B, H, N, d]``.
        ``global_kv``: ``(k_g, v_g, T)``, ``T`` global keys and values (``[B, H, T, d]``)
        in every query's softmax, next to the shared and routed logits."""
        BH, M, r = B * H, ph * pw, router_topk
        T_bias = table_size((window_h, window_w)) if bias_table is not None else 0
        scale = d ** -0.5
        shape3 = const([BH, N, d])
        q3, k3, v3 = (op.Reshape(t, shape3) for t in (q, k, v))
        L_g = None
        if global_kv is not None:
            kg, vg, TG = global_kv
            vg = op.Reshape(vg, const([BH, TG, d]))
            L_g = op.MatMul(op.Mul(q3, const(scale, np.float32)),
                            op.Transpose(op.Reshape(kg, const([BH, TG, d])),
                                         perm=[0, 2, 1]))                   # [BH, N, TG]

        # Landmarks, scores, router logits: mita_seg.ops.routing.mita_routing.
        # Adaptive average pooling is separable: rows, then columns (two thin MatMuls with
        # constant averaging matrices, h/ph and w/pw times cheaper than one [M, h*w] matrix).
        grid = q3 if (p, h * w) == (0, N) else op.Slice(q3, const([p]), const([p + h * w]),
                                                         const([1]))
        rows = op.MatMul(const(pool_matrix((h, 1), (ph, 1)), np.float32),
                         op.Reshape(grid, const([BH, h, w * d])))            # [BH, ph, w d]
        R = op.Reshape(op.MatMul(const(pool_matrix((w, 1), (pw, 1)), np.float32),
                                 op.Reshape(rows, const([BH * ph, w, d]))),
                       const([BH, M, d]))                                   # [BH, M, d]
        # The scales are scalar Muls on a MatMul's input or output, which ONNX Runtime
        # folds into the MatMul (MatMulScaleFusion).
        S = op.MatMul(op.Mul(R, const(scale, np.float32)),
                      op.Transpose(k3, perm=[0, 2, 1]))                     # [BH, M, N]
        G = op.MatMul(q3, op.Transpose(op.Mul(R, const(shared_scale, np.float32)),
                                       perm=[0, 2, 1]))                     # [BH, N, M]
        table_flat = None
        if bias_table is not None:
            Bq, Bk = landmark_bias_graph(bias_table, H, window_h, window_w, ph, pw)
            S = op.Reshape(op.Add(op.Reshape(S, const([B, H, M, N])), Bq), const([BH, M, N]))
            G = op.Reshape(op.Add(op.Reshape(G, const([B, H, N, M])), Bk), const([BH, N, M]))
            table_flat = op.Reshape(bias_table, const([-1]))                 # [H T]
        # one TopK over [BH M, N] rows, unsorted (the order of an expert's keys does not
        # matter; ONNX Runtime spreads 2-D TopK rows over its threads, not 3-D ones)
        _, keys = op.TopK(op.Reshape(S, const([BH * M, N])), const([topk]), axis=-1,
                          sorted=0)
        keys = op.Reshape(keys, const([BH, M, topk]))                        # [BH, M, k]
        if r == 1:
            choice = op.ArgMax(G, axis=-1, keepdims=1)                       # [BH, N, 1]
        else:
            _, choice = op.TopK(G, const([r]), axis=-1)                      # [BH, N, r]
        NR = N * r
        items_e = op.Reshape(choice, const([BH, NR]))

        def routed_bias(qidx, kidx, rank):
            # qidx, kidx: int64 of ``rank`` dims, broadcast to [BH, ...]: B[head, q, k],
            # read from the table (mmseg's relative_position_index computed, not stored).
            head = const((np.arange(BH) % H).reshape([BH] + [1] * (rank - 1)) * T_bias)
            idx = bias_index(qidx, kidx, window_h, window_w)
            return op.Gather(table_flat, op.Add(head, idx), axis=0)

        if formulation == 'gather':
            qkeys = op.Reshape(gather_rows(keys, items_e, BH, M, [topk]),
                               const([BH, N * r * topk]))
            Kq = op.Reshape(gather_rows(k3, qkeys, BH, N, [d]), const([BH, N, r * topk, d]))
            Vq = op.Reshape(gather_rows(v3, qkeys, BH, N, [d]), const([BH, N, r * topk, d]))
            logits = op.Mul(op.MatMul(op.Unsqueeze(q3, const([2])),
                                      op.Transpose(Kq, perm=[0, 1, 3, 2])),
                            const(scale, np.float32))                        # [BH,N,1,rk]
            if table_flat is not None:
                qi = op.Unsqueeze(op.Range(const(0), const(N), const(1)), const([0, 2, 3]))
                logits = op.Add(logits, routed_bias(
                    qi, op.Reshape(qkeys, const([BH, N, 1, r * topk])), 4))
            logits = op.Reshape(logits, const([BH, N, r * topk]))
            # one softmax over [shared M,] routed r k[, global TG] logits
            M_s, RK = (M if with_shared_expert else 0), r * topk
            parts = ([G] if with_shared_expert else []) + [logits] + (
                [] if L_g is None else [L_g])
            if with_shared_expert:
                V_R = op.MatMul(op.Softmax(S, axis=-1), v3)                  # [BH, M, d]
            attn = op.Softmax(op.Concat(*parts, axis=-1) if len(parts) > 1 else logits,
                              axis=-1)
            # the slices in the order of their columns: onnxscript's optimizer fuses them
            # into one Split placed at the last one, before which no slice may be used
            a_s = op.Slice(attn, const([0]), const([M]), const([2])) if M_s else None
            a_r = op.Slice(attn, const([M_s]), const([M_s + RK]), const([2]))
            a_g = None if L_g is None else op.Slice(attn, const([M_s + RK]),
                                                    const([M_s + RK + TG]), const([2]))
            out = op.Reshape(op.MatMul(op.Unsqueeze(a_r, const([2])), Vq),
                             const([BH, N, d]))
            if a_s is not None:
                out = op.Add(op.MatMul(a_s, V_R), out)
            if a_g is not None:
                out = op.Add(out, op.MatMul(a_g, vg))
            return op.Reshape(out, const([B, H, N, d]))

        # Expert-pure tiles: mita_seg.ops.blocked._tile_layout. The buffers are sized by the
        # static bound (num_tiles), then trimmed to the tiles used (the largest over heads),
        # so no work goes to the bound's empty tiles.
        T = tile_size or onnx_block_size(N, r, M)
        NT = num_tiles(NR, M, T)
        L = NT * T
        # Sort the items by expert (TopK on the unique key e * NR + item): an item's rank
        # within its expert is its sorted position less the expert's start.
        items = op.Expand(const(np.arange(NR).reshape(1, NR)), const([BH, NR]))
        _, order = op.TopK(op.Add(op.Mul(items_e, const(NR)), items), const([NR]), axis=-1,
                           largest=0, sorted=1)                              # [BH, NR]
        position = op.ScatterElements(items, order, items, axis=1)          # inverse
        count = op.ScatterElements(op.Expand(const(np.zeros((1, 1), np.int64)),
                                             const([BH, M])), items_e,
                                   op.Expand(const(np.ones((1, 1), np.int64)),
                                             const([BH, NR])), axis=1, reduction='add')
        first = op.CumSum(count, const(1), exclusive=1)                      # [BH, M]
        rank = op.Sub(position, op.GatherElements(first, items_e, axis=1))   # [BH, NR]
        ntile = op.Div(op.Add(count, const(T - 1)), const(T))
        tile_start = op.CumSum(ntile, const(1), exclusive=1)                 # [BH, M]
        tile_end = op.Add(tile_start, ntile)
        item_slot = op.Add(op.Mul(op.GatherElements(tile_start, items_e, axis=1), const(T)),
                           rank)                                             # [BH, NR]
        used = op.ReduceMax(tile_end, keepdims=1)                            # [1, 1] tiles
        used_slots = op.Reshape(op.Mul(used, const(T)), const([1]))
        slot_item = op.ScatterElements(op.Expand(const(np.zeros((1, 1), np.int64)),
                                                 const([BH, L])),
                                       item_slot, items, axis=1)             # [BH, L]
        slot_item = op.Slice(slot_item, const([0]), used_slots, const([1]))  # [BH, Lu]
        slot_query = op.Div(slot_item, const(r)) if r > 1 else slot_item
        tile_ids = op.Range(const(0), op.Reshape(used, const([])), const(1))  # [NTu]
        tile_expert = op.Min(op.ReduceSum(
            op.Cast(op.LessOrEqual(op.Unsqueeze(tile_end, const([1])),
                                   op.Unsqueeze(tile_ids, const([0, 2]))), to=7),
            const([2]), keepdims=0), const(M - 1))                           # [BH, NTu]
        # Each tile's k keys and values, gathered straight from K and V (an intermediate
        # [BH, M, k, d] copy of the experts costs more); K^T comes in as MatMul's transB.
        tile_keys = op.Reshape(gather_rows(keys, tile_expert, BH, M, [topk]),
                               const([BH, -1]))                              # [BH, NTu k]
        shape_kv = const([BH, -1, topk, d])
        Kt = op.Reshape(gather_rows(k3, tile_keys, BH, N, [d]), shape_kv)  # [BH,NTu,k,d]
        Vt = op.Reshape(gather_rows(v3, tile_keys, BH, N, [d]), shape_kv)
        Qs = op.Reshape(gather_rows(q3, slot_query, BH, N, [d]), const([BH, -1, T, d]))
        logits = op.Mul(op.MatMul(Qs, op.Transpose(Kt, perm=[0, 1, 3, 2])),
                        const(scale, np.float32))                            # [BH,NTu,T,k]
        if table_flat is not None:
            logits = op.Add(logits, routed_bias(
                op.Reshape(slot_query, const([BH, -1, T, 1])),
                op.Reshape(tile_keys, const([BH, -1, 1, topk])), 4))
        # The shared and global logits' maximum of each query is known before the tiles: a
        # slot subtracts the larger of it and its own routed maximum, so that with one
        # choice (r = 1) its partial sums come back already on the query's common maximum.
        m_q = None
        if with_shared_expert:
            m_q = op.ReduceMax(G, const([-1]), keepdims=1)                   # [BH, N, 1]
        if L_g is not None:
            m_g = op.ReduceMax(L_g, const([-1]), keepdims=1)
            m_q = m_g if m_q is None else op.Max(m_q, m_g)
        mx = op.ReduceMax(logits, const([-1]), keepdims=1)                   # [BH,NTu,T,1]
        if m_q is not None:
            mx = op.Max(mx, op.Reshape(gather_rows(m_q, slot_query, BH, N, [1]),
                                       const([BH, -1, T, 1])))
        ex = op.Exp(op.Sub(logits, mx))
        sm = op.ReduceSum(ex, const([-1]), keepdims=1)
        ov = op.MatMul(ex, Vt)                                               # [BH,NTu,T,d]
        # Back to the items, then to the queries: [BH, N, r, .] (r = 1: [BH, N, .]); the
        # outputs apart from their (max, sum) pairs, so that no d-wide copy packs them.
        o_r = gather_rows(op.Reshape(ov, const([BH, -1, d])), item_slot, BH, used_slots,
                          [d])                                               # [BH, NR, d]
        ml = gather_rows(op.Concat(op.Reshape(mx, const([BH, -1, 1])),
                                   op.Reshape(sm, const([BH, -1, 1])), axis=-1),
                         item_slot, BH, used_slots, [2])                     # [BH, NR, 2]
        if r > 1:
            o_r = op.Reshape(o_r, const([BH, N, r, d]))
            ml = op.Reshape(ml, const([BH, N, r, 2]))
        axis = 3 if r > 1 else 2
        m_r = op.Slice(ml, const([0]), const([1]), const([axis]))            # [BH,N,(r,)1]
        l_r = op.Slice(ml, const([1]), const([2]), const([axis]))
        if r > 1:
            # the choices' partial sums rescaled to their largest maximum (lse merge)
            m_all = op.ReduceMax(m_r, const([2]), keepdims=1)                # [BH, N, 1, 1]
            w_r = op.Exp(op.Sub(m_r, m_all))                                 # [BH, N, r, 1]
            num = op.ReduceSum(op.Mul(o_r, w_r), const([2]), keepdims=0)     # [BH, N, d]
            den = op.ReduceSum(op.Mul(l_r, w_r), const([2]), keepdims=0)     # [BH, N, 1]
            m_all = op.Reshape(m_all, const([BH, N, 1]))
        else:
            m_all, num, den = m_r, o_r, l_r     # m_r >= m_q: already the common maximum
        if with_shared_expert:
            V_R = op.MatMul(op.Softmax(S, axis=-1), v3)                      # [BH, M, d]
            e_s = op.Exp(op.Sub(G, m_all))                                   # [BH, N, M]
            num = op.Add(num, op.MatMul(e_s, V_R))
            den = op.Add(den, op.ReduceSum(e_s, const([-1]), keepdims=1))
        if L_g is not None:
            # the global keys' partial softmax, on the same maximum
            e_g = op.Exp(op.Sub(L_g, m_all))                                 # [BH, N, TG]
            num = op.Add(num, op.MatMul(e_g, vg))
            den = op.Add(den, op.ReduceSum(e_g, const([-1]), keepdims=1))
        return op.Reshape(op.Div(num, den), const([B, H, N, d]))

    return {torch.ops.mita_seg.mita_attention.default: translation}
