"""Fused MiTA on CPU: routing and read-out in one C++ forward
(``mita_seg/ops/csrc/mita_cpu.cpp``), and a backward that reuses what it saved.

The forward computes the landmarks, the scores ``S``, each expert's top-k keys (a selection,
not a sort), the shared logits ``G`` and each query's expert, groups the queries by expert
(counting sort), reads each expert's keys and values once for all its queries, and merges
shared and routed logits in one softmax per query. It saves the routing (keys, choices,
expert offsets and order), the per-query log-sum-exp, the landmarks, ``softmax(S)``, ``G``
and ``V_R``: the backward recomputes nothing of the forward (FlashAttention's pattern). Its
read-out part is C++; the routing part (through ``R``, ``S``, ``G``, ``V_R`` to q, k, v) is a
few batched ATen products, :func:`_routing_backward`.

Precision: bfloat16/float16 inputs are computed in float32 (routing decisions identical to
the float32 reference's on the same values, softmax statistics in float32). On CPUs without
bf16 matrix units (AVX2, AVX-512 without AMX) float32 GEMMs are the fast ones: on an AMD EPYC
with AVX2, a [1025, 64] x [64, 49] bf16 product took 29x the float32 one (see
docs/benchmark.md).

The forward and the read-out backward are ``torch.library`` custom ops with fake
implementations, so tracers (``torch.compile``) see opaque nodes.
"""
import time
from typing import Dict, List, Tuple

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
    long = dict(dtype=torch.long)
    return [torch.empty_like(q), q.new_empty(BH, N), q.new_empty(BH, M, topk, **long),
            q.new_empty(BH, N, r, **long), q.new_empty(BH, M + 1, **long),
            q.new_empty(BH, N * r, **long), q.new_empty(BH, M, d),
            q.new_empty(BH if shared and save_probs else 0, M, N), q.new_empty(BH, N, M),
            q.new_empty(BH if shared else 0, M, d)]


@torch.library.custom_op('mita_seg::readout_bwd', mutates_args=())
def _readout_bwd(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, choice: Tensor,
                 offsets: Tensor, order: Tensor, shared_logits: Tensor, shared_values: Tensor,
                 shared: bool, scale: float, out: Tensor, lse: Tensor,
                 grad_out: Tensor) -> List[Tensor]:
    return _C.mita_readout_backward(q, k, v, keys, choice, offsets, order, shared_logits,
                                    shared_values, shared, scale, out, lse, grad_out)


@_readout_bwd.register_fake
def _(q, k, v, keys, choice, offsets, order, shared_logits, shared_values, shared, scale, out,
      lse, grad_out):
    BH, N, d = q.shape
    M, n = keys.shape[1], BH if shared else 0
    return [torch.empty_like(q), torch.empty_like(q), torch.empty_like(q),
            q.new_empty(n, N, M), q.new_empty(n, M, d)]


# Seconds spent in _routing_backward while the kernel profile is on (see profile()).
_ROUTING_BWD = {'on': False, 'seconds': 0.0}


def profile(enable: bool) -> Dict[str, float]:
    """Wall time of each phase of the kernels, summed over calls: ``profile(True)`` resets
    the counters and starts counting, ``profile(False)`` stops; both return
    ``{phase: seconds}`` accumulated since the last reset (``bwd.routing`` is the ATen part
    of the backward)."""
    res = dict(_C.profile(enable))
    res['bwd.routing'] = _ROUTING_BWD['seconds']
    if enable:
        _ROUTING_BWD['seconds'] = 0.0
    _ROUTING_BWD['on'] = enable
    return res


def _routing_backward(dq, dk, dv, dls, dvr, q, k, v, R, probs, hw, pool, prefix,
                      shared_scale):
    """Adds the gradients that flow through the routing to ``dq, dk, dv`` (in place), given
    those of the shared logits ``Ls = q (R * shared_scale)^T`` (``dls``, ``[BH, N, M]``) and
    of the shared values ``V_R = P V`` (``dvr``, ``[BH, M, d]``), ``P = softmax(S)``,
    ``S = (R / sqrt(d)) K^T`` (``probs``: ``P``, ``[BH, M, N]``). ``R`` pools the ``hw`` grid
    of q (after ``prefix`` tokens) down to ``pool``."""
    t0 = time.perf_counter()
    c = q.shape[-1] ** -0.5
    dq.baddbmm_(dls, R, alpha=shared_scale)                          # dLs R s
    dR = torch.bmm(dls.transpose(1, 2), q).mul_(shared_scale)        # dLs^T q s   [BH, M, d]
    dv.baddbmm_(probs.transpose(1, 2), dvr)                          # P^T dV_R
    dP = torch.bmm(dvr, v.transpose(1, 2))                           # [BH, M, N]
    dS = dP.sub_((dP * probs).sum(-1, keepdim=True)).mul_(probs)     # softmax backward
    dR.baddbmm_(dS, k, alpha=c)                                      # dS K c
    dk.baddbmm_(dS.transpose(1, 2), R, alpha=c)                      # dS^T R c
    h, w = hw
    BH, M, d = R.shape
    grid = q[:, prefix:prefix + h * w].transpose(1, 2).reshape(BH, d, h, w)
    dgrid = torch.ops.aten._adaptive_avg_pool2d_backward(
        dR.transpose(1, 2).reshape(BH, d, *pool), grid)             # [BH, d, h, w]
    dq[:, prefix:prefix + h * w] += dgrid.reshape(BH, d, h * w).transpose(1, 2)
    if _ROUTING_BWD['on']:
        _ROUTING_BWD['seconds'] += time.perf_counter() - t0


class MiTAFused(torch.autograd.Function):
    """MiTA on ``[BH, N, d]`` float32/float64 CPU tensors, routing included.

    ``apply(q, k, v, hw_shape, pool_size, prefix, topk, router_topk, shared, shared_scale)``
    returns ``[BH, N, d]``; gradients flow to q, k, v (not through the indices).
    """

    @staticmethod
    def forward(ctx, q, k, v, hw_shape, pool_size, prefix, topk, router_topk, shared,
                shared_scale):
        save = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        (out, lse, keys, choice, offsets, order, R, probs, ls, vr) = _fused_fwd(
            q, k, v, *hw_shape, *pool_size, prefix, topk, router_topk, shared, shared_scale,
            save)
        if save:
            ctx.save_for_backward(q, k, v, keys, choice, offsets, order, R, probs, ls, vr,
                                  out, lse)
            ctx.args = (hw_shape, pool_size, prefix, shared, shared_scale)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, keys, choice, offsets, order, R, probs, ls, vr, out, lse = ctx.saved_tensors
        hw_shape, pool_size, prefix, shared, shared_scale = ctx.args
        scale = q.shape[-1] ** -0.5
        dq, dk, dv, dls, dvr = _readout_bwd(q, k, v, keys, choice, offsets, order, ls, vr,
                                            shared, scale, out, lse, grad_out.contiguous())
        if shared:
            _routing_backward(dq, dk, dv, dls, dvr, q, k, v, R, probs, hw_shape, pool_size,
                              prefix, shared_scale)
        return dq, dk, dv, None, None, None, None, None, None, None


def mita_attention_fused_cpu(q, k, v, hw_shape, pool_size, topk, router_topk=1,
                             num_prefix_tokens=1, with_shared_expert=True,
                             shared_scale=None, block_size=None):
    """Fused CPU MiTA; arguments as :func:`mita_seg.ops.mita_attention` (validated;
    ``block_size`` is unused).

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``; differentiable with respect to q, k, v.
    """
    B, H, N, d = q.shape
    shared_scale = 1.0 / d if shared_scale is None else float(shared_scale)
    acc = routing_dtype(q.dtype)
    qb, kb, vb = (t.to(acc).reshape(B * H, N, d) for t in (q, k, v))
    out = MiTAFused.apply(qb, kb, vb, tuple(hw_shape), tuple(pool_size), num_prefix_tokens,
                          topk, router_topk, with_shared_expert, shared_scale)
    return out.view(B, H, N, d).to(q.dtype)
