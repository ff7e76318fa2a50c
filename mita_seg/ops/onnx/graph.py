"""The ONNX graph of one ``mita_seg::mita_attention`` call, in default-domain operators
(opset 18), for ``torch.onnx.export(..., dynamo=True, custom_translation_table=...)``; the
package's docstring (:mod:`mita_seg.ops.onnx`) says what it computes and why it is laid out
as it is.

This module imports ``onnxscript`` at its top: :func:`mita_seg.ops.onnx.mita_translation_table`
imports it when a table is built (and turns a missing onnxscript into an
:class:`~mita_seg.ops.onnx.OnnxExportError`). The graph is built in named steps over two
records: :class:`Call`, the call's static settings, and :class:`Values`, the graph values that
the steps share. The steps emit their operators in the order of the graph (the exported file
depends on it), so a step's operators are never reordered.
"""
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import FLOAT
from onnxscript import opset18 as op

from .. import mita  # noqa: F401  (registers torch.ops.mita_seg.mita_attention)
from ..bias import table_size
from ..blocked import num_tiles
from .common import OnnxExportError, onnx_block_size, onnx_unsupported, pool_matrix

__all__ = ['Call', 'Values', 'translation_table', 'stand_in_translation', 'mita_call_graph',
           'mita_graph']


@dataclass(frozen=True)
class Call:
    """The static settings of one MiTA call in the graph: the shapes (``[B, H, N, d]``,
    ``p`` prefix tokens), the operator's arguments (``r``: router top-r, ``shared``: with the
    shared expert, ``window_h, window_w``: the bias table's window) and the translation's
    (``formulation``, ``tile_size``: None picks :func:`~mita_seg.ops.onnx.onnx_block_size`)."""
    B: int
    H: int
    N: int
    d: int
    p: int
    h: int
    w: int
    ph: int
    pw: int
    topk: int
    r: int
    shared: bool
    shared_scale: float
    window_h: int
    window_w: int
    formulation: str = 'tiles'
    tile_size: Optional[int] = None

    @property
    def BH(self) -> int:
        return self.B * self.H

    @property
    def M(self) -> int:
        return self.ph * self.pw

    @property
    def scale(self) -> float:
        return self.d ** -0.5


@dataclass
class Values:
    """The graph values of one call that the steps share: ``q3, k3, v3`` (``[BH, N, d]``),
    the scores ``S`` (``[BH, M, N]``) and router logits ``G`` (``[BH, N, M]``), each
    expert's ``keys`` (``[BH, M, k]``) and each item's expert ``items_e`` (``[BH, N r]``);
    ``table_flat`` (``[H T]``) with a relative position bias; with global tokens their
    logits ``L_g`` (``[BH, N, TG]``) and values ``vg`` (``[BH, TG, d]``), ``TG`` of them."""
    q3: Any
    k3: Any
    v3: Any
    S: Any = None
    G: Any = None
    keys: Any = None
    items_e: Any = None
    table_flat: Any = None
    L_g: Any = None
    vg: Any = None
    TG: int = 0


class TileLayout(NamedTuple):
    """Where the routed items sit in the expert-pure tiles (:func:`tile_layout`)."""
    item_slot: Any     # [BH, NR]: each item's slot
    used_slots: Any    # [1]: the slots of the tiles used (the largest over heads)
    slot_query: Any    # [BH, Lu]: each slot's query
    tile_expert: Any   # [BH, NTu]: each tile's expert


def const(arr, dtype=np.int64):
    """A ``Constant`` of ``arr`` (int64 unless ``dtype``)."""
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


def _static_shape(value) -> Tuple[int, ...]:
    """The static ``[B, H, N, d]`` of a float32 input; :class:`OnnxExportError` if it has
    none (or another dtype)."""
    shape = tuple(getattr(value, 'shape', None) or ())
    dims = tuple(int(s) if isinstance(s, int) or str(s).isdigit() else s for s in shape)
    dtype = getattr(value, 'dtype', None)
    why = onnx_unsupported(torch.float32 if str(dtype).upper().endswith('FLOAT') else dtype,
                           dims)
    if why:
        raise OnnxExportError('; '.join(why))
    return dims


# --- relative position bias -------------------------------------------------------------


def bias_index(qi, kj, Wh, Ww):
    """mmseg's ``relative_position_index[qi, kj]`` (:func:`~mita_seg.ops.bias.bias_index`)."""
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


def unfolded(x, dtype=np.float32):
    """``x`` plus a scalar zero that onnxscript's optimizer never folds (it keeps every
    ``ConstantOfShape``), so that it folds nothing computed from ``x`` into the file.
    The optimizer folds a node whose inputs are constants of up to 8192 values (a small
    bias table is one) into a constant of up to 512 x 512 values, stored per layer: the box
    sums' indices, the table's float64 integral image, rows gathered from it. ONNX Runtime
    folds the zero and all that follows it when it loads the file, so none of it runs per
    inference. ``dtype``: ``x``'s numpy dtype."""
    zero = op.ConstantOfShape(const([]), value=ir.tensor(np.zeros(1, dtype)))
    return op.Add(x, zero)


def filled(shape, value, dtype=np.int64):
    """A ``shape`` tensor of ``value`` (int64 unless ``dtype``): a ``ConstantOfShape``, which
    onnxscript's optimizer never folds into the file (an ``Expand`` of a one-value constant
    it folds, up to 512 x 512 values)."""
    return op.ConstantOfShape(const(shape), value=ir.tensor(np.full(1, value, dtype)))


def _offsets(outer, inner):
    """``outer[i] + inner[j]`` flattened, ``i`` major: ``[len(outer) len(inner)]``."""
    return op.Reshape(op.Add(op.Unsqueeze(outer, const([1])), op.Unsqueeze(inner, const([0]))),
                      const([-1]))


def _box_sums(ii, a0, a1, b0, b1, A: Tuple[int, int], B: Tuple[int, int]):
    """Sums over ``[a0, a1) x [b0, b1)`` of the table's offsets, four reads of the integral
    image ``ii`` (``[H, 2Wh, 2Ww]``) in the reference's order (bit for bit its sums), as
    ``[H, A1 B1, A2 B2]``. ``a*``: the ``[A1 A2]`` row offsets (``A = (A1, A2)``, ``A1``
    major), ``b*``: the ``[B1 B2]`` column offsets. Separable: the rows are gathered first
    (``[H, A1 A2, 2Ww]``), then their columns, so no index of one value per sum is formed."""
    (A1, A2), (B1, B2) = A, B

    def read(rows, b):
        return op.Gather(rows, b, axis=2)                                     # [H, A, B]

    R0, R1 = op.Gather(ii, a0, axis=1), op.Gather(ii, a1, axis=1)            # [H, A, 2Ww]
    s = op.Add(op.Sub(op.Sub(read(R1, b1), read(R0, b1)), read(R1, b0)), read(R0, b0))
    s = op.Transpose(op.Reshape(s, const([0, A1, A2, B1, B2])), perm=[0, 1, 3, 2, 4])
    return op.Reshape(s, const([0, A1 * B1, A2 * B2]))


def landmark_bias_graph(table, H, Wh, Ww, Ph, Pw):
    """``(Bq [H, M, N], Bk [H, N, M])`` of :func:`mita_seg.ops.bias.landmark_bias`: box
    sums over the 2-D table (an integral image in float64, four reads each), never the
    ``[H, N, N]`` bias.

    Nothing of the grid's size is a constant of the file: the reads are separable
    (:func:`_box_sums`), their indices built in the graph from the regions' bounds
    (``Ph``, ``Pw`` values) and a ``Range`` over each axis of the grid, and ``table``
    (``[H, T]``) comes through :func:`unfolded` (:func:`landmark_scores`), as do the
    ranges, so the exporter's optimizer folds neither the indices (it stored 8 int64
    tensors of ``M N`` values per layer, 12.8 MB of the tiny BEiT's 15.6 MB at 256) nor the
    table's integral image into the file. ONNX Runtime computes ``Bq`` and ``Bk`` once,
    when it loads the file (all of it is constant there)."""
    T = table_size((Wh, Ww))
    t2 = op.Reshape(op.Cast(op.Slice(table, const([0]), const([T - 3]), const([1])),
                            to=11), const([H, 2 * Wh - 1, 2 * Ww - 1]))
    ii = op.CumSum(op.CumSum(t2, const(1)), const(2))
    ii = op.Pad(ii, const([0, 1, 1, 0, 0, 0]))                                # [H, 2Wh, 2Ww]
    r0, r1 = (np.arange(Ph) * Wh) // Ph, -(-((np.arange(Ph) + 1) * Wh) // Ph)
    c0, c1 = (np.arange(Pw) * Ww) // Pw, -(-((np.arange(Pw) + 1) * Ww) // Pw)
    start = unfolded(const(0), np.int64)
    y = op.Range(start, const(Wh), const(1))                                 # [Wh]
    x = op.Range(start, const(Ww), const(1))                                 # [Ww]
    area = ((r1 - r0)[:, None] * (c1 - c0)[None, :]).reshape(-1).astype(np.float64)
    M = Ph * Pw
    # Bq: queries in region m (rows yi in [r0, r1)), key at (y, x): dy = yi - y.
    ny, nx = op.Neg(y), op.Neg(x)
    bq = _box_sums(ii, _offsets(const(r0 + Wh - 1), ny), _offsets(const(r1 + Wh - 1), ny),
                   _offsets(const(c0 + Ww - 1), nx), _offsets(const(c1 + Ww - 1), nx),
                   (Ph, Wh), (Pw, Ww))
    bq = op.Cast(op.Div(bq, const(area.reshape(1, M, 1), np.float64)), to=1)
    # Bk: query at (y, x), keys in region m (yj in [r0, r1)): dy = y - yj.
    bk = _box_sums(ii, _offsets(y, const(Wh - r1)), _offsets(y, const(Wh - r0)),
                   _offsets(x, const(Ww - c1)), _offsets(x, const(Ww - c0)),
                   (Wh, Ph), (Ww, Pw))
    bk = op.Cast(op.Div(bk, const(area.reshape(1, 1, M), np.float64)), to=1)
    # cls: grid queries towards the cls key use token-to-cls (T - 2); the cls query
    # towards grid keys uses cls-to-token (T - 3).
    to_cls = op.Slice(table, const([T - 2]), const([T - 1]), const([1]))     # [H, 1]
    from_cls = op.Slice(table, const([T - 3]), const([T - 2]), const([1]))
    Bq = op.Concat(op.Expand(op.Unsqueeze(to_cls, const([1])), const([H, M, 1])), bq,
                   axis=2)                                                   # [H, M, N]
    Bk = op.Concat(op.Expand(op.Unsqueeze(from_cls, const([1])), const([H, 1, M])), bk,
                   axis=1)                                                   # [H, N, M]
    return Bq, Bk


def routed_bias(c: Call, table_flat, qidx, kidx, rank: int):
    """The bias ``B[head, q, k]`` of routed logits, read from the table (mmseg's
    ``relative_position_index`` computed, not stored); ``qidx, kidx``: int64 of ``rank``
    dims, broadcast to ``[BH, ...]``."""
    T_bias = table_size((c.window_h, c.window_w))
    head = const((np.arange(c.BH) % c.H).reshape([c.BH] + [1] * (rank - 1)) * T_bias)
    idx = bias_index(qidx, kidx, c.window_h, c.window_w)
    return op.Gather(table_flat, op.Add(head, idx), axis=0)


# --- the steps of one call ----------------------------------------------------------------


def global_logits(c: Call, x: Values, global_kv: tuple) -> None:
    """``x.L_g`` (``[BH, N, TG]``), ``x.vg`` and ``x.TG`` of the global keys and values
    ``global_kv = (k_g, v_g, TG)`` (``[B, H, TG, d]``)."""
    kg, vg, TG = global_kv
    x.vg, x.TG = op.Reshape(vg, const([c.BH, TG, c.d])), TG
    x.L_g = op.MatMul(op.Mul(x.q3, const(c.scale, np.float32)),
                      op.Transpose(op.Reshape(kg, const([c.BH, TG, c.d])),
                                   perm=[0, 2, 1]))                          # [BH, N, TG]


def landmark_scores(c: Call, x: Values, bias_table) -> None:
    """The landmarks, the scores ``x.S`` and the router logits ``x.G``
    (:func:`mita_seg.ops.routing.mita_routing`), with the landmarks' mean bias, and
    ``x.table_flat``, when there is a bias table."""
    BH, M, N, d, p, h, w = c.BH, c.M, c.N, c.d, c.p, c.h, c.w
    # Adaptive average pooling is separable: rows, then columns (two thin MatMuls with
    # constant averaging matrices, h/ph and w/pw times cheaper than one [M, h*w] matrix).
    grid = x.q3 if (p, h * w) == (0, N) else op.Slice(x.q3, const([p]), const([p + h * w]),
                                                      const([1]))
    rows = op.MatMul(const(pool_matrix((h, 1), (c.ph, 1)), np.float32),
                     op.Reshape(grid, const([BH, h, w * d])))                # [BH, ph, w d]
    R = op.Reshape(op.MatMul(const(pool_matrix((w, 1), (c.pw, 1)), np.float32),
                             op.Reshape(rows, const([BH * c.ph, w, d]))),
                   const([BH, M, d]))                                       # [BH, M, d]
    # The scales are scalar Muls on a MatMul's input or output, which ONNX Runtime
    # folds into the MatMul (MatMulScaleFusion).
    S = op.MatMul(op.Mul(R, const(c.scale, np.float32)),
                  op.Transpose(x.k3, perm=[0, 2, 1]))                       # [BH, M, N]
    G = op.MatMul(x.q3, op.Transpose(op.Mul(R, const(c.shared_scale, np.float32)),
                                     perm=[0, 2, 1]))                       # [BH, N, M]
    if bias_table is not None:
        # no copy of the table, nor anything computed from it, folded into the file
        bias_table = unfolded(bias_table)
        Bq, Bk = landmark_bias_graph(bias_table, c.H, c.window_h, c.window_w, c.ph, c.pw)
        S = op.Reshape(op.Add(op.Reshape(S, const([c.B, c.H, M, N])), Bq), const([BH, M, N]))
        G = op.Reshape(op.Add(op.Reshape(G, const([c.B, c.H, N, M])), Bk), const([BH, N, M]))
        x.table_flat = op.Reshape(bias_table, const([-1]))                  # [H T]
    x.S, x.G = S, G


def expert_keys_and_choices(c: Call, x: Values) -> None:
    """Each expert's top-k keys ``x.keys`` and each query's router choices, as the experts
    of its ``r`` items ``x.items_e`` (``[BH, N r]``)."""
    BH, M, N, topk, r = c.BH, c.M, c.N, c.topk, c.r
    # one TopK over [BH M, N] rows, unsorted (the order of an expert's keys does not
    # matter; ONNX Runtime spreads 2-D TopK rows over its threads, not 3-D ones)
    _, keys = op.TopK(op.Reshape(x.S, const([BH * M, N])), const([topk]), axis=-1,
                      sorted=0)
    x.keys = op.Reshape(keys, const([BH, M, topk]))                          # [BH, M, k]
    if r == 1:
        choice = op.ArgMax(x.G, axis=-1, keepdims=1)                         # [BH, N, 1]
    else:
        _, choice = op.TopK(x.G, const([r]), axis=-1)                        # [BH, N, r]
    x.items_e = op.Reshape(choice, const([BH, N * r]))


def gather_attention(c: Call, x: Values):
    """The ``'gather'`` formulation (kept for measurement): each query gathers its experts'
    ``r k`` keys and values; one softmax over its shared, routed and global logits.
    ``[BH, N, d]``."""
    BH, M, N, d, r, topk = c.BH, c.M, c.N, c.d, c.r, c.topk
    qkeys = op.Reshape(gather_rows(x.keys, x.items_e, BH, M, [topk]),
                       const([BH, N * r * topk]))
    Kq = op.Reshape(gather_rows(x.k3, qkeys, BH, N, [d]), const([BH, N, r * topk, d]))
    Vq = op.Reshape(gather_rows(x.v3, qkeys, BH, N, [d]), const([BH, N, r * topk, d]))
    logits = op.Mul(op.MatMul(op.Unsqueeze(x.q3, const([2])),
                              op.Transpose(Kq, perm=[0, 1, 3, 2])),
                    const(c.scale, np.float32))                              # [BH,N,1,rk]
    if x.table_flat is not None:
        qi = op.Unsqueeze(op.Range(const(0), const(N), const(1)), const([0, 2, 3]))
        logits = op.Add(logits, routed_bias(
            c, x.table_flat, qi, op.Reshape(qkeys, const([BH, N, 1, r * topk])), 4))
    logits = op.Reshape(logits, const([BH, N, r * topk]))
    # one softmax over [shared M,] routed r k[, global TG] logits
    M_s, RK, TG = (M if c.shared else 0), r * topk, x.TG
    parts = ([x.G] if c.shared else []) + [logits] + ([] if x.L_g is None else [x.L_g])
    if c.shared:
        V_R = op.MatMul(op.Softmax(x.S, axis=-1), x.v3)                      # [BH, M, d]
    attn = op.Softmax(op.Concat(*parts, axis=-1) if len(parts) > 1 else logits, axis=-1)
    # the slices in the order of their columns: onnxscript's optimizer fuses them
    # into one Split placed at the last one, before which no slice may be used
    a_s = op.Slice(attn, const([0]), const([M]), const([2])) if M_s else None
    a_r = op.Slice(attn, const([M_s]), const([M_s + RK]), const([2]))
    a_g = None if x.L_g is None else op.Slice(attn, const([M_s + RK]),
                                              const([M_s + RK + TG]), const([2]))
    out = op.Reshape(op.MatMul(op.Unsqueeze(a_r, const([2])), Vq), const([BH, N, d]))
    if a_s is not None:
        out = op.Add(op.MatMul(a_s, V_R), out)
    if a_g is not None:
        out = op.Add(out, op.MatMul(a_g, x.vg))
    return out


def tile_layout(c: Call, items_e, T: int) -> TileLayout:
    """The expert-pure tiles (:func:`mita_seg.ops.blocked._tile_layout`): each item's slot,
    each slot's query, each tile's expert. The buffers are sized by the static bound
    (:func:`~mita_seg.ops.blocked.num_tiles`), then trimmed to the tiles used (the largest
    over heads), so no work goes to the bound's empty tiles."""
    BH, M, r = c.BH, c.M, c.r
    NR = c.N * r
    L = num_tiles(NR, M, T) * T
    # Sort the items by expert (TopK on the unique key e * NR + item): an item's rank
    # within its expert is its sorted position less the expert's start. The item numbers,
    # ones and zeros are built in the graph (a Range from an unfolded start, ConstantOfShape),
    # so that the exporter's optimizer folds no [BH, NR] or [BH, L] constant into the file.
    items = op.Expand(op.Unsqueeze(op.Range(unfolded(const(0), np.int64), const(NR),
                                            const(1)), const([0])),
                      const([BH, NR]))                                       # [BH, NR]
    _, order = op.TopK(op.Add(op.Mul(items_e, const(NR)), items), const([NR]), axis=-1,
                       largest=0, sorted=1)                                  # [BH, NR]
    position = op.ScatterElements(items, order, items, axis=1)              # inverse
    count = op.ScatterElements(filled([BH, M], 0), items_e, filled([BH, NR], 1), axis=1,
                               reduction='add')
    first = op.CumSum(count, const(1), exclusive=1)                          # [BH, M]
    rank = op.Sub(position, op.GatherElements(first, items_e, axis=1))       # [BH, NR]
    ntile = op.Div(op.Add(count, const(T - 1)), const(T))
    tile_start = op.CumSum(ntile, const(1), exclusive=1)                     # [BH, M]
    tile_end = op.Add(tile_start, ntile)
    item_slot = op.Add(op.Mul(op.GatherElements(tile_start, items_e, axis=1), const(T)),
                       rank)                                                 # [BH, NR]
    used = op.ReduceMax(tile_end, keepdims=1)                                # [1, 1] tiles
    used_slots = op.Reshape(op.Mul(used, const(T)), const([1]))
    slot_item = op.ScatterElements(filled([BH, L], 0), item_slot, items,
                                   axis=1)                                   # [BH, L]
    slot_item = op.Slice(slot_item, const([0]), used_slots, const([1]))      # [BH, Lu]
    slot_query = op.Div(slot_item, const(r)) if r > 1 else slot_item
    tile_ids = op.Range(const(0), op.Reshape(used, const([])), const(1))      # [NTu]
    tile_expert = op.Min(op.ReduceSum(
        op.Cast(op.LessOrEqual(op.Unsqueeze(tile_end, const([1])),
                               op.Unsqueeze(tile_ids, const([0, 2]))), to=7),
        const([2]), keepdims=0), const(M - 1))                               # [BH, NTu]
    return TileLayout(item_slot, used_slots, slot_query, tile_expert)


def tile_logits(c: Call, x: Values, lay: TileLayout, T: int):
    """Each tile's ``[T, k]`` logits (``[BH, NTu, T, k]``, with the routed bias) and its
    expert's values ``Vt`` (``[BH, NTu, k, d]``)."""
    BH, M, N, d, topk = c.BH, c.M, c.N, c.d, c.topk
    # Each tile's k keys and values, gathered straight from K and V (an intermediate
    # [BH, M, k, d] copy of the experts costs more); K^T comes in as MatMul's transB.
    tile_keys = op.Reshape(gather_rows(x.keys, lay.tile_expert, BH, M, [topk]),
                           const([BH, -1]))                                  # [BH, NTu k]
    shape_kv = const([BH, -1, topk, d])
    Kt = op.Reshape(gather_rows(x.k3, tile_keys, BH, N, [d]), shape_kv)      # [BH,NTu,k,d]
    Vt = op.Reshape(gather_rows(x.v3, tile_keys, BH, N, [d]), shape_kv)
    Qs = op.Reshape(gather_rows(x.q3, lay.slot_query, BH, N, [d]), const([BH, -1, T, d]))
    logits = op.Mul(op.MatMul(Qs, op.Transpose(Kt, perm=[0, 1, 3, 2])),
                    const(c.scale, np.float32))                              # [BH,NTu,T,k]
    if x.table_flat is not None:
        logits = op.Add(logits, routed_bias(
            c, x.table_flat, op.Reshape(lay.slot_query, const([BH, -1, T, 1])),
            op.Reshape(tile_keys, const([BH, -1, 1, topk])), 4))
    return logits, Vt


def tile_softmax(c: Call, x: Values, logits, Vt, slot_query, T: int):
    """Each slot's partial softmax: ``(mx, sm, ov)``, its maximum and sum (``[BH, NTu, T,
    1]``) and its output (``[BH, NTu, T, d]``). The shared and global logits' maximum of
    each query is known before the tiles: a slot subtracts the larger of it and its own
    routed maximum, so that with one choice (r = 1) its partial sums come back already on
    the query's common maximum."""
    m_q = None
    if c.shared:
        m_q = op.ReduceMax(x.G, const([-1]), keepdims=1)                     # [BH, N, 1]
    if x.L_g is not None:
        m_g = op.ReduceMax(x.L_g, const([-1]), keepdims=1)
        m_q = m_g if m_q is None else op.Max(m_q, m_g)
    mx = op.ReduceMax(logits, const([-1]), keepdims=1)                       # [BH,NTu,T,1]
    if m_q is not None:
        mx = op.Max(mx, op.Reshape(gather_rows(m_q, slot_query, c.BH, c.N, [1]),
                                   const([c.BH, -1, T, 1])))
    ex = op.Exp(op.Sub(logits, mx))
    sm = op.ReduceSum(ex, const([-1]), keepdims=1)
    ov = op.MatMul(ex, Vt)                                                   # [BH,NTu,T,d]
    return mx, sm, ov


def slots_to_queries(c: Call, lay: TileLayout, mx, sm, ov):
    """The slots' partial softmaxes back to their items, then to their queries: ``(m_all,
    num, den)``, each query's common maximum (``[BH, N, 1]``), its routed numerator
    (``[BH, N, d]``) and denominator (``[BH, N, 1]``) on it."""
    BH, N, d, r = c.BH, c.N, c.d, c.r
    # Back to the items, then to the queries: [BH, N, r, .] (r = 1: [BH, N, .]); the
    # outputs apart from their (max, sum) pairs, so that no d-wide copy packs them.
    o_r = gather_rows(op.Reshape(ov, const([BH, -1, d])), lay.item_slot, BH, lay.used_slots,
                      [d])                                                   # [BH, NR, d]
    ml = gather_rows(op.Concat(op.Reshape(mx, const([BH, -1, 1])),
                               op.Reshape(sm, const([BH, -1, 1])), axis=-1),
                     lay.item_slot, BH, lay.used_slots, [2])                 # [BH, NR, 2]
    if r > 1:
        o_r = op.Reshape(o_r, const([BH, N, r, d]))
        ml = op.Reshape(ml, const([BH, N, r, 2]))
    axis = 3 if r > 1 else 2
    m_r = op.Slice(ml, const([0]), const([1]), const([axis]))                # [BH,N,(r,)1]
    l_r = op.Slice(ml, const([1]), const([2]), const([axis]))
    if r == 1:
        return m_r, o_r, l_r     # m_r >= m_q: already the common maximum
    # the choices' partial sums rescaled to their largest maximum (lse merge)
    m_all = op.ReduceMax(m_r, const([2]), keepdims=1)                        # [BH, N, 1, 1]
    w_r = op.Exp(op.Sub(m_r, m_all))                                         # [BH, N, r, 1]
    num = op.ReduceSum(op.Mul(o_r, w_r), const([2]), keepdims=0)             # [BH, N, d]
    den = op.ReduceSum(op.Mul(l_r, w_r), const([2]), keepdims=0)             # [BH, N, 1]
    return op.Reshape(m_all, const([BH, N, 1])), num, den


def tile_attention(c: Call, x: Values):
    """The ``'tiles'`` formulation: the routed items in expert-pure tiles of ``T`` slots
    (:func:`tile_layout`), each tile a batched ``[T, d] x [d, k]`` MatMul, the partial
    softmaxes merged on each query's common maximum with the shared expert's and the global
    keys'. ``[BH, N, d]``."""
    T = c.tile_size or onnx_block_size(c.N, c.r, c.M)
    lay = tile_layout(c, x.items_e, T)
    logits, Vt = tile_logits(c, x, lay, T)
    mx, sm, ov = tile_softmax(c, x, logits, Vt, lay.slot_query, T)
    m_all, num, den = slots_to_queries(c, lay, mx, sm, ov)
    if c.shared:
        V_R = op.MatMul(op.Softmax(x.S, axis=-1), x.v3)                      # [BH, M, d]
        e_s = op.Exp(op.Sub(x.G, m_all))                                     # [BH, N, M]
        num = op.Add(num, op.MatMul(e_s, V_R))
        den = op.Add(den, op.ReduceSum(e_s, const([-1]), keepdims=1))
    if x.L_g is not None:
        # the global keys' partial softmax, on the same maximum
        e_g = op.Exp(op.Sub(x.L_g, m_all))                                   # [BH, N, TG]
        num = op.Add(num, op.MatMul(e_g, x.vg))
        den = op.Add(den, op.ReduceSum(e_g, const([-1]), keepdims=1))
    return op.Div(num, den)


def mita_graph(q, k, v, c: Call, bias_table=None, global_kv: Optional[tuple] = None):
    """MiTA of ``q, k, v`` (``[B, H, N, d]``, ``c.p`` prefix tokens): ``[B, H, N, d]``.
    ``global_kv``: ``(k_g, v_g, TG)``, ``TG`` global keys and values (``[B, H, TG, d]``)
    in every query's softmax, next to the shared and routed logits."""
    shape3 = const([c.BH, c.N, c.d])
    x = Values(*(op.Reshape(t, shape3) for t in (q, k, v)))
    if global_kv is not None:
        global_logits(c, x, global_kv)
    landmark_scores(c, x, bias_table)
    expert_keys_and_choices(c, x)
    out = gather_attention(c, x) if c.formulation == 'gather' else tile_attention(c, x)
    return op.Reshape(out, const([c.B, c.H, c.N, c.d]))


# --- the call: global tokens, the translation table ---------------------------------------


def _tokens(t, start: int, end: int):
    """Tokens ``[start, end)`` of ``t`` (``[B, H, N, .]``)."""
    return op.Slice(t, const([start]), const([end]), const([2]))


def _global_part(t, N: int, gp: int, gs: int):
    """The ``gp`` first and ``gs`` last tokens of ``t``: ``[B, H, gp + gs, .]``."""
    parts = ([_tokens(t, 0, gp)] if gp else []) + ([_tokens(t, N - gs, N)] if gs else [])
    return parts[0] if len(parts) == 1 else op.Concat(*parts, axis=2)


def mita_call_graph(q, k, v, c: Call, bias_table=None, global_tokens: Tuple[int, int] = (0, 0)):
    """One ``mita_seg::mita_attention`` call: :func:`mita_graph`, and with global tokens
    (:func:`mita_seg.ops.global_tokens.with_global_tokens`) MiTA on the other tokens with
    the global keys in every query's softmax, the global queries' dense attention over all
    ``N`` keys, the outputs concatenated in token order."""
    gp, gs = global_tokens
    if not gp and not gs:
        return mita_graph(q, k, v, c, bias_table)
    N, d = c.N, c.d
    q_o, k_o, v_o = (_tokens(t, gp, N - gs) for t in (q, k, v))
    out_o = mita_graph(q_o, k_o, v_o, replace(c, N=N - gp - gs, p=c.p - gp), bias_table,
                       global_kv=(_global_part(k, N, gp, gs), _global_part(v, N, gp, gs),
                                  gp + gs))
    logits_g = op.MatMul(op.Mul(_global_part(q, N, gp, gs), const(d ** -0.5, np.float32)),
                         op.Transpose(k, perm=[0, 1, 3, 2]))                 # [B, H, T, N]
    out_g = op.MatMul(op.Softmax(logits_g, axis=-1), v)                     # [B, H, T, d]
    parts = ([_tokens(out_g, 0, gp)] if gp else []) + [out_o] + (
        [_tokens(out_g, gp, gp + gs)] if gs else [])
    return op.Concat(*parts, axis=2)


def translation_table(formulation: str = 'tiles', tile_size: Optional[int] = None
                      ) -> Dict[Callable, Callable]:
    """``{torch.ops.mita_seg.mita_attention.default: translation}`` of this formulation and
    tile size (checked by :func:`mita_seg.ops.onnx.mita_translation_table`, the entry point).
    ``translation`` has the operator's signature, which the exporter reads (its
    annotations, ``FLOAT`` for the tensors), and builds :func:`mita_call_graph`."""

    def translation(q: FLOAT, k: FLOAT, v: FLOAT, h: int, w: int, ph: int, pw: int,
                    topk: int, router_topk: int, num_prefix_tokens: int,
                    with_shared_expert: bool, shared_scale: float, block_size: int,
                    backend: str, bias_table: Optional[FLOAT] = None, window_h: int = 0,
                    window_w: int = 0, global_prefix: int = 0, global_suffix: int = 0
                    ) -> FLOAT:
        B, H, N, d = _static_shape(q)
        c = Call(B, H, N, d, num_prefix_tokens, h, w, ph, pw, topk, router_topk,
                 with_shared_expert, shared_scale, window_h, window_w, formulation, tile_size)
        out = mita_call_graph(q, k, v, c, bias_table, (global_prefix, global_suffix))
        return op.Transpose(out, perm=[0, 2, 1, 3])     # [B, N, H, d], as the op returns

    return {torch.ops.mita_seg.mita_attention.default: translation}


def stand_in_translation(q: FLOAT, k: FLOAT, v: FLOAT, h: int, w: int, ph: int, pw: int,
                         topk: int, router_topk: int, num_prefix_tokens: int,
                         with_shared_expert: bool, shared_scale: float, block_size: int,
                         backend: str, bias_table: Optional[FLOAT] = None, window_h: int = 0,
                         window_w: int = 0, global_prefix: int = 0, global_suffix: int = 0
                         ) -> FLOAT:
    """The graph of :func:`mita_seg.ops.onnx.stand_in_attention` with the operator's
    signature (MiTA's settings unused): ``v * sigmoid(q . mean_n(k) / sqrt(d) +
    mean(bias_table[h]))`` as ``[B, N, H, d]``."""
    B, H, N, d = _static_shape(q)
    logit = op.Mul(op.ReduceSum(op.Mul(q, op.ReduceMean(k, const([2]), keepdims=1)),
                                const([-1]), keepdims=1),
                   const(d ** -0.5, np.float32))                          # [B, H, N, 1]
    if bias_table is not None:
        logit = op.Add(logit, op.Reshape(op.ReduceMean(bias_table, const([-1]), keepdims=0),
                                         const([1, H, 1, 1])))
    return op.Transpose(op.Mul(v, op.Sigmoid(logit)), perm=[0, 2, 1, 3])
