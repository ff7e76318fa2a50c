"""Fused MiTA on CPU: routing and read-out in one C++ forward
(``mita_seg/ops/csrc/mita_cpu.cpp``), and a backward that reuses what it saved.

The forward computes the landmarks, the scores ``S``, each expert's top-k keys (a selection,
not a sort), the shared logits ``G`` and each query's expert, groups the queries by expert
(counting sort), reads each expert's keys and values once for all its queries, and merges
shared and routed logits in one softmax per query. It saves the routing (keys, choices,
expert offsets and order), the per-query log-sum-exp, the landmarks, ``softmax(S)``, ``G``
and ``V_R``: the backward (C++ too, read-out and routing parts) recomputes nothing of the
forward (FlashAttention's pattern).

Precision: bfloat16/float16 inputs are routed in float32 (routing decisions identical to
the float32 reference's on the same values, softmax statistics, log-sum-exp, top-k and the
merge in float32): the forward's phases widen them a tile or a row at a time as they read
them (no float32 copies of q, k, v), the backward converts them on entry; outputs and
gradients come back in the inputs' dtype. The forward's read-out GEMMs (``V_R = softmax(S)
V``, the routed logits and ``P V``) run in bf16/fp16 with float32 accumulation on oneDNN's
brgemm micro-kernels (``at::native::cpublas::brgemm``, as PyTorch's CPU flash attention; P
rounded to the inputs' dtype as FlashAttention does) when ``MITA_CPU_BF16_GEMM=1``; by
default they run in float32 on the widened inputs, the faster choice on every CPU measured
(on an AMD EPYC with AVX2 a [1025, 64] x [64, 49] bf16 product through MKL took 29x the
float32 one; on an AMD EPYC Zen 4 with AVX512-BF16 oneDNN's bf16 kernel ran the forward no
faster than MKL's float32 GEMMs; on an AMX Xeon the tiles ran it 4-6% slower at N = 1025,
see docs/benchmark.md). The backward's five routed GEMMs per expert (``q K_e^T``, ``dout
V_e^T``, ``dS^T q``, ``P^T dout``, ``dS K_e``; P and dS rounded) take the same path under the
same rule; its routing part (shared expert, scores, landmarks) stays float32.
oneDNN's kernel reads its B operand in a layout that depends on the kernel it generates for
the CPU (AMX tiles, interleaved pairs of rows, plain rows), so the C++ probes each layout
once per dtype with a product of distinct values on an odd shape, checked bit for bit
against float32, and never runs one that failed (``_C.lowp_probe(dtype)`` lists the
results: on a Sapphire Rapids Xeon the fp16 kernel reads plain rows, on an AMD Zen 4 the bf16
one interleaved pairs). ``MITA_CPU_BF16_GEMM=1`` turns the bf16/fp16 GEMMs on in both: the
layout that passed, else cpublas's plain GEMM (slow, it tests the path on any CPU), with a
warning saying why (:func:`lowp_gemm_path`); unset or ``=0`` off; ``_C.lowp_gemm_path(dtype)``
says which runs. The GEMMs that decide the routing (the scores,
the shared logits) stay float32.

BEiT's relative position bias (:mod:`.bias`): the kernel takes the landmarks' mean biases
``Bq [H, M, N]`` and ``Bk [H, N, M]`` and the table itself, whose entries of the routed
logits it computes from the tokens' positions; never ``N x N``. ``Bq, Bk`` are
:func:`~.bias.landmark_bias`'s (the same integral-image box means, tested equal), computed
in C++ (:class:`LandmarkBias`, differentiable in the table): the PyTorch version costs more
than the whole kernel on CPU. The kernel's backward returns the gradients of ``Bq``
(scores), ``Bk`` (shared logits) and the table (routed logits, scatter-added); autograd
carries the first two back to the table through :class:`LandmarkBias`.

The forward and the backward are ``torch.library`` custom ops with fake implementations, so
tracers (``torch.compile``) see opaque nodes.
"""
import importlib.util
import os
import sys
import warnings
from typing import Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from .bias import table_size
from .flops import mita_flops_per_head
from .global_tokens import attend_with_lse, merge_lse
from .routing import routing_dtype


def _load_extension():
    """``mita_seg._C``, or the build at the path in ``MITA_C_LIBRARY`` (``make
    test-sanitize`` loads the sanitizer build from build/sanitize that way)."""
    path = os.environ.get('MITA_C_LIBRARY')
    if not path:
        from mita_seg import _C
        return _C
    if not os.path.isfile(path):
        raise ImportError(f'MITA_C_LIBRARY={path} is not a file')
    spec = importlib.util.spec_from_file_location('mita_seg._C', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules['mita_seg._C'] = module
    return module


try:
    _C = _load_extension()
    _IMPORT_ERROR = None
except ImportError as e:  # not compiled: the blocked backend runs instead
    _C = None
    _IMPORT_ERROR = str(e)


def unsupported(inp) -> List[str]:
    """Why :func:`mita_attention_fused_cpu` cannot run ``inp`` (a
    :class:`mita_seg.ops.dispatch.Inputs`; empty if it can)."""
    why = []
    if _C is None:
        why.append(f'the C++ extension mita_seg._C is not built ({_IMPORT_ERROR}); '
                   'run scripts/setup_env.sh')
    if inp.device.type != 'cpu':
        why.append(f'it runs on CPU tensors, got {inp.device.type}')
    if inp.bias is not None and inp.bias.table.device.type != 'cpu':
        why.append('the relative position bias table must be on the CPU, got '
                   f'{inp.bias.table.device.type}')
    return why


_LOWP_WARNED = set()


def lowp_gemm_path(dtype: torch.dtype) -> str:
    """The path of the kernel's bf16/fp16 GEMMs for inputs of ``dtype`` now
    (``_C.lowp_gemm_path``). Forced on (``MITA_CPU_BF16_GEMM=1``) where oneDNN's kernel
    failed its probe in every layout, it warns once per dtype, saying why and what runs."""
    path = _C.lowp_gemm_path(dtype)
    forced = os.environ.get('MITA_CPU_BF16_GEMM', '') not in ('', '0')
    if forced and not path.startswith('brgemm') and dtype not in _LOWP_WARNED:
        _LOWP_WARNED.add(dtype)
        why = '; '.join(f'{layout}: {result}' for layout, result in _C.lowp_probe(dtype)
                        if layout.startswith('brgemm') and not result.startswith('not tried'))
        runs = ("cpublas's plain kernel" if path == 'cpublas'
                else 'float32 (cpublas failed its probe too)')
        warnings.warn(f'MITA_CPU_BF16_GEMM=1: oneDNN\'s {str(dtype)[6:]} GEMM failed its '
                      f'check on this CPU ({why}); those GEMMs run on {runs}', stacklevel=3)
    return path


# What the kernel executes: exactly MiTA's multiply-adds.
flops = mita_flops_per_head


class FusedState(NamedTuple):
    """What the fused forward returns and its backward reads (``_C.mita_forward``'s list, in
    this order; ``FusedState`` in the C++). ``BH`` rows of ``N`` tokens, ``M`` experts of
    ``K`` keys, ``r`` choices per query; float tensors in the compute dtype (float32, float64
    for float64 inputs) unless said otherwise. For ``[B, H, N, d]`` inputs (the kernel reads
    their rows in place, any strides) ``out`` and ``out_float`` are ``[B, N, H, d]``: the
    module's ``[B, N, C]``, its ``[B, H, N, d]`` result their ``transpose(1, 2)``."""
    out: Tensor            # [BH, N, d] ([B, N, H, d]) in the inputs' dtype
    lse: Tensor            # [BH, N] log-sum-exp of each query's M + r K logits
    keys: Tensor           # [BH, M, K] int64, each expert's keys
    choice: Tensor         # [BH, N, r] int64, each query's experts
    offsets: Tensor        # [BH, M + 1] int64: expert m's items are order[offsets[m]:..[m+1]]
    order: Tensor          # [BH, N r] int64, the items (query n, choice c) by expert
    landmarks: Tensor      # [BH, M, d] R
    probs: Tensor          # [BH, M, N] softmax(S) (empty unless shared and saved for backward)
    shared_logits: Tensor  # [BH, N, M] Ls (empty unless shared and saved for backward)
    shared_values: Tensor  # [BH, M, d] V_R (empty route-only)
    out_float: Tensor      # out in float32 for bf16/fp16 inputs (empty otherwise)


@torch.library.custom_op('mita_seg::fused_fwd', mutates_args=())
def _fused_fwd(q: Tensor, k: Tensor, v: Tensor, h: int, w: int, ph: int, pw: int, prefix: int,
               topk: int, router_topk: int, shared: bool, shared_scale: float,
               save_probs: bool, bias_q: Optional[Tensor] = None,
               bias_k: Optional[Tensor] = None, table: Optional[Tensor] = None,
               window_h: int = 0, window_w: int = 0) -> List[Tensor]:
    """:class:`FusedState` as a list (custom ops return lists)."""
    return _C.mita_forward(q, k, v, h, w, ph, pw, prefix, topk, router_topk, shared,
                           shared_scale, save_probs, bias_q, bias_k, table, window_h, window_w)


@_fused_fwd.register_fake
def _(q, k, v, h, w, ph, pw, prefix, topk, router_topk, shared, shared_scale, save_probs,
      bias_q=None, bias_k=None, table=None, window_h=0, window_w=0):
    N, d = q.shape[-2:]
    BH = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
    shape = (q.shape[0], N, q.shape[1], d) if q.dim() == 4 else (BH, N, d)   # out's
    M, r = ph * pw, router_topk
    long, acc = dict(dtype=torch.long), dict(dtype=routing_dtype(q.dtype))
    saved = BH if shared and save_probs else 0
    return list(FusedState(
        out=q.new_empty(shape), lse=q.new_empty(BH, N, **acc),
        keys=q.new_empty(BH, M, topk, **long), choice=q.new_empty(BH, N, r, **long),
        offsets=q.new_empty(BH, M + 1, **long), order=q.new_empty(BH, N * r, **long),
        landmarks=q.new_empty(BH, M, d, **acc), probs=q.new_empty(saved, M, N, **acc),
        shared_logits=q.new_empty(saved, N, M, **acc),
        shared_values=q.new_empty(BH if shared else 0, M, d, **acc),
        out_float=q.new_empty(shape if acc['dtype'] != q.dtype else (0, ), **acc)))


@torch.library.custom_op('mita_seg::fused_bwd', mutates_args=())
def _fused_bwd(q: Tensor, k: Tensor, v: Tensor, h: int, w: int, ph: int, pw: int, prefix: int,
               shared: bool, shared_scale: float, state: List[Tensor], grad_out: Tensor,
               table: Optional[Tensor] = None, window_h: int = 0, window_w: int = 0,
               grad_lse: Optional[Tensor] = None) -> List[Tensor]:
    """``state``: the forward's :class:`FusedState` (``out`` may be empty where
    ``out_float`` is not: the backward reads the latter); ``grad_lse``: the gradient of its
    lse, where that was used."""
    return _C.mita_backward(q, k, v, h, w, ph, pw, prefix, shared, shared_scale, state,
                            grad_out, table, window_h, window_w, grad_lse)


@_fused_bwd.register_fake
def _(q, k, v, h, w, ph, pw, prefix, shared, shared_scale, state, grad_out, table=None,
      window_h=0, window_w=0, grad_lse=None):
    # dq, dk, dv; with a bias, in the compute dtype: dbias_q [H, M, N], dbias_k [H, N, M]
    # (empty without the shared expert) and dtable [H, T]; empty without a bias.
    N, M = q.shape[1], ph * pw
    acc = dict(dtype=routing_dtype(q.dtype))
    if not window_h:
        return [torch.empty_like(q) for _ in range(3)] + [q.new_empty(0, **acc)
                                                          for _ in range(3)]
    H = table.shape[0]
    return [torch.empty_like(q) for _ in range(3)] + [
        q.new_empty((H, M, N) if shared else (0, ), **acc),
        q.new_empty((H, N, M) if shared else (0, ), **acc), q.new_empty(table.shape, **acc)]


@torch.library.custom_op('mita_seg::landmark_bias', mutates_args=())
def _landmark_bias(table: Tensor, window_h: int, window_w: int, ph: int,
                   pw: int) -> List[Tensor]:
    return _C.landmark_bias(table, window_h, window_w, ph, pw)


@_landmark_bias.register_fake
def _(table, window_h, window_w, ph, pw):
    H, N, M = table.shape[0], 1 + window_h * window_w, ph * pw
    return [table.new_empty(H, M, N), table.new_empty(H, N, M)]


@torch.library.custom_op('mita_seg::landmark_bias_bwd', mutates_args=())
def _landmark_bias_bwd(grad_q: Tensor, grad_k: Tensor, window_h: int, window_w: int, ph: int,
                       pw: int) -> Tensor:
    return _C.landmark_bias_backward(grad_q, grad_k, window_h, window_w, ph, pw)


@_landmark_bias_bwd.register_fake
def _(grad_q, grad_k, window_h, window_w, ph, pw):
    return grad_q.new_empty(grad_q.shape[0], table_size((window_h, window_w)))


class LandmarkBias(torch.autograd.Function):
    """:func:`mita_seg.ops.bias.landmark_bias` in C++ (the same float64 integral image
    and box means; ``O(T + M N)`` per head, on the CPU).

    ``apply(table, window, pool_size)``: ``table`` ``[H, T]`` float32/float64 ->
    ``(Bq [H, M, N], Bk [H, N, M])`` in its dtype, differentiable in the table.
    """

    @staticmethod
    def forward(ctx, table, window, pool_size):
        ctx.args = (*window, *pool_size)
        ctx.set_materialize_grads(False)  # route-only MiTA gives these means no gradient
        bias_q, bias_k = _landmark_bias(table, *window, *pool_size)
        return bias_q, bias_k

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q, grad_k):
        if grad_q is None and grad_k is None:
            return None, None, None
        Wh, Ww, ph, pw = ctx.args
        like = grad_q if grad_q is not None else grad_k
        H, M, N = like.shape[0], ph * pw, 1 + Wh * Ww
        grad_q = like.new_zeros(H, M, N) if grad_q is None else grad_q.contiguous()
        grad_k = like.new_zeros(H, N, M) if grad_k is None else grad_k.contiguous()
        return _landmark_bias_bwd(grad_q, grad_k, *ctx.args), None, None


def profile(enable: bool) -> Dict[str, float]:
    """Wall time of each phase of the C++ kernels, summed over calls: ``profile(True)``
    resets the counters and starts counting, ``profile(False)`` stops; both return
    ``{phase: seconds}`` accumulated since the last reset."""
    return dict(_C.profile(enable))


class MiTAFused(torch.autograd.Function):
    """MiTA on ``[B, H, N, d]`` CPU tensors of any strides (float32/float64, or bf16/fp16
    computed in float32 inside the kernel), routing included: the forward reads q, k, v
    where they are (views of the qkv projection: no copies) and writes its output as
    ``[B, N, H, d]`` (the module's ``[B, N, C]``: no transpose after).

    ``apply(q, k, v, bias_q, bias_k, table, window, hw_shape, pool_size, prefix, topk,
    router_topk, shared, shared_scale, with_lse)`` returns that ``[B, N, H, d]`` output
    (``with_lse``: ``(out, lse [BH, N])`` in the compute dtype, both differentiable, for a
    merge by log-sum-exp); gradients flow to q, k, v (not through the indices) and, with a
    relative position bias (``window`` ``(Wh, Ww)``; ``(0, 0)`` and None tensors without),
    to ``bias_q [H, M, N]``, ``bias_k [H, N, M]`` and ``table [H, T]`` (in the compute
    dtype: float32, float64 for float64 inputs).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias_q, bias_k, table, window, hw_shape, pool_size, prefix, topk,
                router_topk, shared, shared_scale, with_lse=False):
        save = any(ctx.needs_input_grad[:6])
        state = FusedState(*_fused_fwd(q, k, v, *hw_shape, *pool_size, prefix, topk,
                                       router_topk, shared, shared_scale, save, bias_q,
                                       bias_k, table, *window))
        if save:
            saved = state
            if state.out_float.numel():  # the backward reads out_float: keep no bf16 out
                saved = state._replace(out=state.out.new_empty(0))
            ctx.save_for_backward(q, k, v, table, *saved)
            ctx.args = (*hw_shape, *pool_size, prefix, shared, shared_scale)
            ctx.window = window
        if with_lse:
            return state.out_float if state.out_float.numel() else state.out, state.lse
        return state.out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse=None):
        # The backward's kernel takes [BH, N, d]: q, k, v and the [B, N, H, d] tensors
        # (out, grad_out) copied to it (training pays these copies, inference does not).
        q, k, v, table, *state = ctx.saved_tensors
        B, H, N, d = q.shape
        heads = lambda t: t.reshape(B * H, N, d).contiguous()  # noqa: E731
        state = FusedState(*state)
        state = state._replace(**{f: heads(getattr(state, f).transpose(1, 2))
                                  for f in ('out', 'out_float') if getattr(state, f).numel()})
        dq, dk, dv, *dbias = _fused_bwd(heads(q), heads(k), heads(v), *ctx.args, list(state),
                                        heads(grad_out.transpose(1, 2)), table, *ctx.window,
                                        grad_lse)
        # dbias_q, dbias_k, dtable: empty where there is no such input or no gradient
        dbias = [g if g.numel() else None for g in dbias]
        return (dq.view(B, H, N, d), dk.view(B, H, N, d), dv.view(B, H, N, d),
                *dbias) + (None, ) * 9


def mita_attention_fused_cpu(inp):
    """Fused CPU MiTA of ``inp`` (a :class:`mita_seg.ops.dispatch.Inputs`: the arguments of
    :func:`mita_seg.ops.mita_attention`, validated; ``block_size`` is unused); global keys
    (``inp.global_kv``) by merging the kernel's log-sum-exp with theirs.

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``, the ``transpose(1, 2)`` of a contiguous
        ``[B, N, H, d]`` without global keys; differentiable with respect to q, k, v and the
        bias table.
    """
    q, k, v, bias, pool_size = inp.q, inp.k, inp.v, inp.bias, inp.pool_size
    B, H, N, d = q.shape
    shared_scale = 1.0 / d if inp.shared_scale is None else float(inp.shared_scale)
    bias_q = bias_k = table = None
    window = (0, 0)
    if bias is not None:
        # In the kernel's compute dtype (float64 for float64 inputs, float32 otherwise), so
        # that the bias gradients it returns match these tensors.
        acc = routing_dtype(q.dtype)
        table, window = bias.table.to(acc).contiguous(), tuple(bias.window)
        bias_q, bias_k = LandmarkBias.apply(table, window, tuple(pool_size))
    if q.dtype in (torch.bfloat16, torch.float16):
        lowp_gemm_path(q.dtype)  # warns where a forced path fell back
    with_lse = inp.global_kv is not None
    res = MiTAFused.apply(q, k, v, bias_q, bias_k, table, window, tuple(inp.hw_shape),
                          tuple(pool_size), inp.num_prefix_tokens, inp.topk, inp.router_topk,
                          inp.with_shared_expert, shared_scale, with_lse)
    if not with_lse:
        return res.transpose(1, 2)
    out, lse = res[0].transpose(1, 2), res[1].view(B, H, N)
    return merge_lse(out, lse, *attend_with_lse(q, *inp.global_kv)).to(q.dtype)
