"""Fused MiTA on CPU: routing and read-out in one C++ forward
(``mita_seg/ops/csrc/mita_cpu.cpp``), and a backward that reuses what it saved.

The forward computes the landmarks, the scores ``S``, each expert's top-k keys (a selection,
not a sort), the shared logits ``G`` and each query's expert, groups the queries by expert
(counting sort), reads each expert's keys and values once for all its queries, and merges
shared and routed logits in one softmax per query. It saves the routing (keys, choices,
expert offsets and order), the per-query log-sum-exp, the landmarks, ``softmax(S)``, ``G``
and ``V_R``: the backward (C++ too, read-out and routing parts) recomputes nothing of the
forward (FlashAttention's pattern).

Precision: bfloat16/float16 inputs are converted to float32 inside the kernel and computed
in float32 (routing decisions identical to the float32 reference's on the same values,
softmax statistics in float32); outputs and gradients come back in the inputs' dtype. On CPUs
without bf16 matrix units (AVX2, AVX-512 without AMX) float32 GEMMs are the fast ones: on an
AMD EPYC with AVX2, a [1025, 64] x [64, 49] bf16 product took 29x the float32 one (see
docs/benchmark.md).

The forward and the backward are ``torch.library`` custom ops with fake implementations, so
tracers (``torch.compile``) see opaque nodes.
"""
from typing import Dict, List

import torch
from torch import Tensor

from .flops import mita_flops_per_head
from .routing import routing_dtype

try:
    from mita_seg import _C
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
    if inp.bias is not None:
        why.append('relative position bias: not in the C++ kernel yet')
    return why


# What the kernel executes: exactly MiTA's multiply-adds.
flops = mita_flops_per_head


@torch.library.custom_op('mita_seg::fused_fwd', mutates_args=())
def _fused_fwd(q: Tensor, k: Tensor, v: Tensor, h: int, w: int, ph: int, pw: int, prefix: int,
               topk: int, router_topk: int, shared: bool, shared_scale: float,
               save_probs: bool) -> List[Tensor]:
    return _C.mita_forward(q, k, v, h, w, ph, pw, prefix, topk, router_topk, shared,
                           shared_scale, save_probs)


@_fused_fwd.register_fake
def _(q, k, v, h, w, ph, pw, prefix, topk, router_topk, shared, shared_scale, save_probs):
    BH, N, d = q.shape
    M, r = ph * pw, router_topk
    long, acc = dict(dtype=torch.long), dict(dtype=routing_dtype(q.dtype))
    return [torch.empty_like(q), q.new_empty(BH, N, **acc), q.new_empty(BH, M, topk, **long),
            q.new_empty(BH, N, r, **long), q.new_empty(BH, M + 1, **long),
            q.new_empty(BH, N * r, **long), q.new_empty(BH, M, d, **acc),
            q.new_empty(BH if shared and save_probs else 0, M, N, **acc),
            q.new_empty(BH, N, M, **acc), q.new_empty(BH if shared else 0, M, d, **acc),
            q.new_empty((BH, N, d) if acc['dtype'] != q.dtype else (0, ), **acc)]


@torch.library.custom_op('mita_seg::fused_bwd', mutates_args=())
def _fused_bwd(q: Tensor, k: Tensor, v: Tensor, h: int, w: int, ph: int, pw: int, prefix: int,
               shared: bool, shared_scale: float, saved: List[Tensor],
               grad_out: Tensor) -> List[Tensor]:
    return _C.mita_backward(q, k, v, h, w, ph, pw, prefix, shared, shared_scale, *saved,
                            grad_out)


@_fused_bwd.register_fake
def _(q, k, v, h, w, ph, pw, prefix, shared, shared_scale, saved, grad_out):
    return [torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)]


def profile(enable: bool) -> Dict[str, float]:
    """Wall time of each phase of the C++ kernels, summed over calls: ``profile(True)``
    resets the counters and starts counting, ``profile(False)`` stops; both return
    ``{phase: seconds}`` accumulated since the last reset."""
    return dict(_C.profile(enable))


class MiTAFused(torch.autograd.Function):
    """MiTA on ``[BH, N, d]`` CPU tensors (float32/float64, or bf16/fp16 computed in
    float32 inside the kernel), routing included.

    ``apply(q, k, v, hw_shape, pool_size, prefix, topk, router_topk, shared, shared_scale)``
    returns ``[BH, N, d]``; gradients flow to q, k, v (not through the indices).
    """

    @staticmethod
    def forward(ctx, q, k, v, hw_shape, pool_size, prefix, topk, router_topk, shared,
                shared_scale):
        save = any(ctx.needs_input_grad[:3])
        # out (q.dtype), lse, keys, choice, offsets, order, R, probs, Ls, V_R, and for bf16 /
        # fp16 inputs out in float32 (empty otherwise)
        out, lse, *routing, out_float = _fused_fwd(q, k, v, *hw_shape, *pool_size, prefix,
                                                   topk, router_topk, shared, shared_scale,
                                                   save)
        if save:
            ctx.save_for_backward(q, k, v, *routing, out_float if out_float.numel() else out,
                                  lse)
            ctx.args = (*hw_shape, *pool_size, prefix, shared, shared_scale)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, *saved = ctx.saved_tensors
        dq, dk, dv = _fused_bwd(q, k, v, *ctx.args, saved, grad_out.contiguous())
        return dq, dk, dv, None, None, None, None, None, None, None


def mita_attention_fused_cpu(q, k, v, hw_shape, pool_size, topk, router_topk=1,
                             num_prefix_tokens=1, with_shared_expert=True,
                             shared_scale=None, block_size=None, bias=None):
    """Fused CPU MiTA; arguments as :func:`mita_seg.ops.mita_attention` (validated;
    ``block_size`` is unused).

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``; differentiable with respect to q, k, v.
    """
    B, H, N, d = q.shape
    shared_scale = 1.0 / d if shared_scale is None else float(shared_scale)
    qb, kb, vb = (t.reshape(B * H, N, d) for t in (q, k, v))
    out = MiTAFused.apply(qb, kb, vb, tuple(hw_shape), tuple(pool_size), num_prefix_tokens,
                          topk, router_topk, with_shared_expert, shared_scale)
    return out.view(B, H, N, d)
