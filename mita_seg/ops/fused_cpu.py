"""Fused MiTA on CPU: routing with ATen ops, then one C++ pass per query
(``mita_seg/ops/csrc/mita_cpu.cpp``) that reads its shared logits and its experts' keys
and values straight from K and V, with a single softmax in registers. Forward only: the
autograd wrapper differentiates a recomputation by :mod:`.blocked` (same function)."""
from typing import List

import torch

from .routing import mita_routing, routing_dtype

try:
    from mita_seg import _C
    _IMPORT_ERROR = None
except ImportError as e:  # not compiled: the blocked backend runs instead
    _C = None
    _IMPORT_ERROR = str(e)


def fused_cpu_unsupported(q: torch.Tensor) -> List[str]:
    """Why :func:`mita_attention_fused_cpu` cannot run on ``q`` (empty if it can)."""
    why = []
    if _C is None:
        why.append(f'the C++ extension mita_seg._C is not built ({_IMPORT_ERROR}); '
                   'run scripts/setup_env.sh')
    if q.device.type != 'cpu':
        why.append(f'it runs on CPU tensors, got {q.device.type}')
    return why


def mita_attention_fused_cpu(q, k, v, hw_shape, pool_size, topk, router_topk=1,
                             num_prefix_tokens=1, with_shared_expert=True,
                             shared_scale=None, block_size=None):
    """Fused CPU MiTA; arguments as :func:`mita_seg.ops.mita_attention` (validated;
    ``block_size`` is unused). Returns ``[B, H, N, d]`` in ``q.dtype``; no autograd."""
    B, H, N, d = q.shape
    BH = B * H
    scale = d ** -0.5
    rt = mita_routing(q, k, hw_shape, pool_size, topk, router_topk, num_prefix_tokens,
                      shared_scale)
    M = rt.landmarks.shape[2]
    acc = routing_dtype(q.dtype)
    qb, kb, vb = (t.to(acc).reshape(BH, N, d) for t in (q, k, v))
    if with_shared_expert:
        v_r = torch.softmax(rt.scores, dim=-1) @ v.to(acc)             # [B, H, M, d]
        logits_s = rt.router                                           # [B, H, N, M]
    else:
        v_r = logits_s = qb.new_empty(0)
    out = _C.mita_readout(qb, kb, vb, rt.expert_keys.reshape(BH, M, topk),
                          rt.choice.reshape(BH, N, router_topk), logits_s, v_r,
                          with_shared_expert, scale)
    return out.view(B, H, N, d).to(q.dtype)
