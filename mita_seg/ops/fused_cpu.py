"""Fused MiTA on CPU: routing with ATen ops, then the read-out in C++
(``mita_seg/ops/csrc/mita_cpu.cpp``): each expert's keys and values are read once from K and
V for all queries routed to it, and each query's shared and routed logits share one softmax.

Differentiable end to end: the routing ops (landmarks, ``S``, ``G``, ``V_R``) are plain
torch, the indices carry no gradient, and the read-out is :class:`MiTAReadout`, an
``autograd.Function`` whose backward is a C++ kernel too. The two kernels are registered as
``torch.library`` custom ops with fake implementations, so that tracers (``torch.compile``)
see opaque nodes.
"""
from typing import List, Tuple

import torch
from torch import Tensor

from .flops import mita_flops_per_head
from .routing import mita_routing, routing_dtype

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


@torch.library.custom_op('mita_seg::readout_fwd', mutates_args=())
def _readout_fwd(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, choice: Tensor,
                 shared_logits: Tensor, shared_values: Tensor, shared: bool,
                 scale: float) -> Tuple[Tensor, Tensor]:
    out, lse = _C.mita_readout_forward(q, k, v, keys, choice, shared_logits, shared_values,
                                       shared, scale)
    return out, lse


@_readout_fwd.register_fake
def _(q, k, v, keys, choice, shared_logits, shared_values, shared, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2])


@torch.library.custom_op('mita_seg::readout_bwd', mutates_args=())
def _readout_bwd(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, choice: Tensor,
                 shared_logits: Tensor, shared_values: Tensor, shared: bool, scale: float,
                 out: Tensor, lse: Tensor,
                 grad_out: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _C.mita_readout_backward(q, k, v, keys, choice, shared_logits, shared_values,
                                     shared, scale, out, lse, grad_out)
    return tuple(grads)


@_readout_bwd.register_fake
def _(q, k, v, keys, choice, shared_logits, shared_values, shared, scale, out, lse, grad_out):
    BH, N, d = q.shape
    M = keys.shape[1]
    shape_ls, shape_vr = ((BH, N, M), (BH, M, d)) if shared else ((0, ), (0, ))
    return (torch.empty_like(q), torch.empty_like(q), torch.empty_like(q),
            q.new_empty(shape_ls), q.new_empty(shape_vr))


class MiTAReadout(torch.autograd.Function):
    """The read-out of MiTA given its routing: for every query ``n`` one softmax over its
    shared logits ``Ls[n]`` (values ``V_R``) and its routed logits ``q_n . k_j * scale`` for
    the keys ``j`` of its experts (values ``v_j``).

    ``apply(q, k, v, keys, choice, shared_logits, shared_values, shared, scale)``:

    Args:
        q, k, v (Tensor): ``[BH, N, d]``, float32 or float64, CPU.
        keys (Tensor): ``[BH, M, K]`` int64, the keys of each expert.
        choice (Tensor): ``[BH, N, R]`` int64, the experts of each query.
        shared_logits (Tensor): ``Ls``, ``[BH, N, M]``, already scaled (ignored, and may be
            empty, unless ``shared``).
        shared_values (Tensor): ``V_R``, ``[BH, M, d]`` (same).
        shared (bool): whether the shared expert takes part.
        scale (float): scale of the routed logits, ``1 / sqrt(d)`` in MiTA.

    Returns:
        Tensor: ``[BH, N, d]``. Gradients flow to q, k, v and (if ``shared``) to
        ``shared_logits`` and ``shared_values``.
    """

    @staticmethod
    def forward(ctx, q, k, v, keys, choice, shared_logits, shared_values, shared, scale):
        if shared:
            shared_logits = shared_logits.to(q.dtype).contiguous()
            shared_values = shared_values.to(q.dtype).contiguous()
        out, lse = _readout_fwd(q.contiguous(), k.contiguous(), v.contiguous(), keys, choice,
                                shared_logits, shared_values, shared, scale)
        ctx.save_for_backward(q, k, v, keys, choice, shared_logits, shared_values, out, lse)
        ctx.shared, ctx.scale = shared, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        dq, dk, dv, dls, dvr = _readout_bwd(*ctx.saved_tensors[:7], ctx.shared, ctx.scale,
                                            *ctx.saved_tensors[7:], grad_out.contiguous())
        if not ctx.shared:
            dls = dvr = None
        return dq, dk, dv, None, None, dls, dvr, None, None


def mita_attention_fused_cpu(q, k, v, hw_shape, pool_size, topk, router_topk=1,
                             num_prefix_tokens=1, with_shared_expert=True,
                             shared_scale=None, block_size=None):
    """Fused CPU MiTA; arguments as :func:`mita_seg.ops.mita_attention` (validated;
    ``block_size`` is unused).

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``; differentiable with respect to q, k, v.
    """
    B, H, N, d = q.shape
    BH = B * H
    scale = d ** -0.5
    rt = mita_routing(q, k, hw_shape, pool_size, topk, router_topk, num_prefix_tokens,
                      shared_scale)
    M = rt.landmarks.shape[2]
    acc = routing_dtype(q.dtype)
    qb, kb, vb = (t.to(acc).reshape(BH, N, d) for t in (q, k, v))
    if with_shared_expert:
        v_r = (torch.softmax(rt.scores, dim=-1) @ v.to(acc)).reshape(BH, M, d)
        logits_s = rt.router.reshape(BH, N, M)
    else:
        v_r = logits_s = qb.new_empty(0)
    out = MiTAReadout.apply(qb, kb, vb, rt.expert_keys.reshape(BH, M, topk),
                            rt.choice.reshape(BH, N, router_topk), logits_s, v_r,
                            with_shared_expert, scale)
    return out.view(B, H, N, d).to(q.dtype)
