"""Which MiTA implementation runs: the backend registry and the dispatcher.

As in xformers' ``fmha`` dispatch, every backend lives in its own module and declares what
it cannot run, given *all* the inputs (:class:`Inputs`: device, dtype, head dim, router
top-r, ...), with a reason a user can act on. ``backend=`` or ``$MITA_BACKEND`` forces one;
otherwise the first of the device's order that can run is used, and when none can, the error
lists each backend's reasons, one per line. Each backend also carries its multiply-add
formula (what it executes, padding included), which the FLOP tools count.

Adding a backend: a module with ``fn(inp: Inputs) -> out`` (as
:func:`~mita_seg.ops.reference.mita_attention_reference`, differentiable with respect to q,
k, v), ``unsupported(inp) -> list[str]`` and ``flops(...)``, one entry in :data:`BACKENDS`,
and its place in :data:`AUTO_ORDER`.
"""
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from . import blocked, fused_cpu, reference, varlen
from .bias import RelPosBias

__all__ = ['Inputs', 'Backend', 'BACKENDS', 'AUTO_ORDER', 'select_backend']


class Inputs(NamedTuple):
    """One MiTA call's arguments, validated (see :func:`mita_seg.ops.mita_attention`), as
    the backends see them when deciding whether they can run, and run them."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    hw_shape: Tuple[int, int]
    pool_size: Tuple[int, int]
    topk: int
    router_topk: int = 1
    num_prefix_tokens: int = 1
    with_shared_expert: bool = True
    shared_scale: Optional[float] = None
    bias: Optional[RelPosBias] = None
    block_size: Optional[int] = None
    # (prefix, suffix): the first and last tokens that are global (mita_attention's
    # global_tokens); a backend sees (0, 0) and the global keys and values as global_kv
    # ([B, H, T, d] each: keys in every query's softmax, not routed; see .global_tokens)
    global_tokens: Tuple[int, int] = (0, 0)
    global_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def num_experts(self) -> int:
        return self.pool_size[0] * self.pool_size[1]

    @property
    def requires_grad(self) -> bool:
        tensors = (self.q, self.k, self.v) + (() if self.bias is None else (self.bias.table, ))
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class Backend(NamedTuple):
    """An implementation of MiTA.

    Attributes:
        fn (Callable): ``fn(inp: Inputs) -> out`` (``[B, H, N, d]``), differentiable with
            respect to q, k, v (and the bias table) by its own autograd; the keys and
            values of ``inp.global_kv`` (if any) in every query's softmax.
        unsupported (Callable): ``unsupported(inp: Inputs) -> list[str]``, why it cannot run
            these inputs (empty when it can).
        flops (Callable): ``flops(num_tokens, head_dim, num_experts, topk, router_topk,
            with_shared_expert, block_size) -> int``, the multiply-adds it executes per batch
            item and head (one MAC = one FLOP).
    """
    fn: Callable
    unsupported: Callable[[Inputs], List[str]]
    flops: Callable[..., int]


BACKENDS: Dict[str, Backend] = {
    'fused_cpu': Backend(fused_cpu.mita_attention_fused_cpu, fused_cpu.unsupported,
                         fused_cpu.flops),
    'varlen': Backend(varlen.mita_attention_varlen, varlen.unsupported, varlen.flops),
    'blocked': Backend(blocked.mita_attention_blocked, blocked.unsupported, blocked.flops),
    'reference': Backend(reference.mita_attention_reference, reference.unsupported,
                         reference.flops),
}

# The automatic choice, per device type: the first backend that can run the inputs.
AUTO_ORDER: Dict[str, Tuple[str, ...]] = {
    'cpu': ('fused_cpu', 'varlen', 'blocked'),
    'cuda': ('varlen', 'blocked'),
}
_DEFAULT_ORDER = ('blocked', )


def _reasons(why: Dict[str, List[str]]) -> str:
    return '\n'.join(f'  {name}: ' + '; '.join(r) for name, r in why.items())


def select_backend(inp: Inputs, backend: Optional[str] = None) -> str:
    """Name of the backend that runs ``inp``; ``backend`` (or ``$MITA_BACKEND``) forces one.

    Raises:
        ValueError: the forced backend is unknown or cannot run these inputs, or no backend
            can; the message gives each backend's reasons.
    """
    backend = backend or os.environ.get('MITA_BACKEND') or None
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f'unknown MiTA backend {backend!r}; choose one of {sorted(BACKENDS)}')
        why = BACKENDS[backend].unsupported(inp)
        if why:
            raise ValueError(f'MiTA backend {backend!r} cannot run these inputs:\n' +
                             _reasons({backend: why}) +
                             '\nunset MITA_BACKEND / backend= to let the dispatcher choose')
        return backend
    why = {}
    for name in AUTO_ORDER.get(inp.device.type, _DEFAULT_ORDER):
        why[name] = BACKENDS[name].unsupported(inp)
        if not why[name]:
            return name
    raise ValueError('no MiTA backend can run these inputs:\n' + _reasons(why))
