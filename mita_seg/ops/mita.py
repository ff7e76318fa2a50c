"""The public MiTA operator: argument checks, backend choice, autograd.

Three layers, as in FlashAttention: the backends are plain functions, each in its own
module and differentiable by its own autograd (:mod:`.dispatch` chooses one);
``torch.ops.mita_seg.mita_attention`` is a ``torch.library.custom_op`` around them with a
fake implementation, which runs wherever no gradient is needed and in jit traces (inference,
FLOP counting: ``torch.compile`` and tracers see one opaque node, which the FLOP tools count
analytically); :func:`mita_attention` checks arguments and calls one or the other. Where a
gradient is needed the backend runs directly, so its backward uses what its forward saved
(no recomputation of the forward).
"""
import math
import warnings
from typing import Optional

import torch

from .bias import RelPosBias, check_bias
from .blocked import default_block_size
from .dispatch import BACKENDS, Inputs, select_backend
from .flops import bias_flops_per_head, global_flops_per_head, mita_flops_per_head
from .global_tokens import with_global_tokens
from .routing import IntPair, pair
from .selected_keys import check_count, check_grid_args

__all__ = ['mita_attention', 'mita_flops', 'check_mita_args', 'attend_setting']


def check_mita_args(q, k, v, hw_shape, pool_size, topk, router_topk, num_prefix_tokens,
                    shared_scale=None, global_tokens=(0, 0)):
    """Validate the arguments of :func:`mita_attention`.

    Returns:
        tuple: ``(hw_shape, pool_size, topk)`` normalised (pairs of ints; ``topk`` clamped
        to the tokens that are not global).
    """
    h, w = check_grid_args(q, k, v, hw_shape, num_prefix_tokens)
    N, p = q.shape[2], num_prefix_tokens
    ph, pw = pair(pool_size, 'pool_size')
    if ph < 1 or pw < 1 or ph > h or pw > w:
        raise ValueError(
            f'pool_size {(ph, pw)} must be >= 1 and no larger than the grid {(h, w)}: '
            f'use a pool_size of at most {(h, w)}')
    gp, gs = pair(global_tokens, 'global_tokens')
    if not 0 <= gp <= p or not 0 <= gs <= N - p - h * w:
        raise ValueError(
            f'global_tokens {(gp, gs)} must be (prefix, suffix) counts of the tokens before '
            f'and after the grid: here at most ({p}, {N - p - h * w}) (num_prefix_tokens={p}, '
            f'N - p - h*w = {N - p - h * w} suffix tokens)')
    routed = N - gp - gs  # the keys of MiTA's experts: every token but the global ones
    topk = check_count(topk, 'topk', 'give the keys each expert gathers, at least 1')
    check_count(router_topk, 'router_topk', 'give the experts each query reads, at least 1')
    if topk > routed:
        what = f'N={N}' if routed == N else f'N={N} less {gp + gs} global = {routed}'
        warnings.warn(f'MiTA topk={topk} is larger than the number of tokens {what}; '
                      f'using topk={routed} (every key)', stacklevel=3)
        topk = routed
    if shared_scale is not None and not 0 < shared_scale < math.inf:
        raise ValueError(f'shared_scale must be finite and > 0 (it scales the router '
                         f'logits), got {shared_scale}; None means 1/d')
    M = ph * pw
    if not 1 <= router_topk <= M:
        raise ValueError(f'router_topk must be in [1, M] with M = Ph*Pw = {M} experts, '
                         f'got {router_topk}')
    return (h, w), (ph, pw), topk


def _run(inp: Inputs, backend: str) -> torch.Tensor:
    # The operator picks its own precision (routing and softmax in float32): autocast
    # (e.g. mmengine's --amp) must not push its matmuls into bf16/fp16.
    with torch.autocast(inp.device.type, enabled=False):
        return with_global_tokens(inp, BACKENDS[backend].fn)


@torch.library.custom_op('mita_seg::mita_attention', mutates_args=())
def _mita_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, w: int, ph: int,
             pw: int, topk: int, router_topk: int, num_prefix_tokens: int,
             with_shared_expert: bool, shared_scale: float, block_size: int,
             backend: str, bias_table: Optional[torch.Tensor] = None, window_h: int = 0,
             window_w: int = 0, global_prefix: int = 0, global_suffix: int = 0
             ) -> torch.Tensor:
    """The operator as one opaque node, for calls that need no gradient (torch.library
    takes primitive arguments: :class:`Inputs` flattened). Returns ``[B, N, H, d]``,
    contiguous whatever the backend and the layout of ``q``: the module's ``[B, N, C]``,
    so its head merge is a view (the fused CPU kernel writes this layout: no copy; the
    other backends' ``[B, H, N, d]`` is copied once, here instead of in the module).
    :func:`mita_attention` hands on its ``transpose(1, 2)``."""
    bias = None if bias_table is None else RelPosBias(bias_table, (window_h, window_w))
    out = _run(Inputs(q, k, v, (h, w), (ph, pw), topk, router_topk, num_prefix_tokens,
                      with_shared_expert, shared_scale, bias, block_size,
                      (global_prefix, global_suffix)), backend)
    return out.transpose(1, 2).contiguous()                          # [B, N, H, d]


@_mita_op.register_fake
def _(q, k, v, *args):
    B, H, N, d = q.shape
    return q.new_empty(B, N, H, d)   # contiguous, as the op returns it


def mita_flops(batch: int, num_heads: int, num_tokens: int, head_dim: int, num_experts: int,
               topk: int, router_topk: int = 1, with_shared_expert: bool = True,
               block_size: Optional[int] = None, backend: Optional[str] = None,
               with_bias: bool = False, num_global_tokens: int = 0) -> int:
    """Multiply-adds of one MiTA call (one MAC = one FLOP): the paper's ``(4M + 2k) N C``
    for router top-1 (:func:`mita_seg.ops.flops.mita_flops_per_head`), or with ``backend``
    what that backend executes (``BACKENDS[backend].flops``: the blocked backend's padding
    slots, the varlen backend's recomputed scores, the reference's dense logits).
    ``with_bias`` adds a relative position bias's additions
    (:func:`mita_seg.ops.flops.bias_flops_per_head`, one add = one FLOP).
    ``num_global_tokens`` (``T``, of the ``num_tokens``): MiTA runs on the other ``N - T``
    tokens, plus their ``N - T`` queries over the ``T`` global keys and the ``T`` global
    queries over all ``N`` keys (:func:`mita_seg.ops.flops.global_flops_per_head`)."""
    per_head = BACKENDS[backend].flops if backend else mita_flops_per_head
    T = num_global_tokens
    topk = min(topk, num_tokens - T)   # as mita_attention runs a k beyond the keys
    total = batch * num_heads * (
        per_head(num_tokens - T, head_dim, num_experts, topk, router_topk, with_shared_expert,
                 block_size) + global_flops_per_head(num_tokens, T, head_dim))
    if with_bias:
        total += batch * num_heads * bias_flops_per_head(num_tokens, num_experts, topk,
                                                         router_topk)
    return total


def mita_attention(q: torch.Tensor,
                   k: torch.Tensor,
                   v: torch.Tensor,
                   hw_shape: IntPair,
                   pool_size: IntPair = 7,
                   topk: int = 49,
                   router_topk: int = 1,
                   num_prefix_tokens: int = 1,
                   with_shared_expert: bool = True,
                   shared_scale: Optional[float] = None,
                   block_size: Optional[int] = None,
                   backend: Optional[str] = None,
                   rel_pos_bias: Optional[RelPosBias] = None,
                   global_tokens: IntPair = (0, 0)) -> torch.Tensor:
    """Mixture-of-Top-k Attention.

    Tokens ``p:p + h*w`` (``p = num_prefix_tokens``) form an ``h x w`` grid; tokens before it
    (cls) and after it (e.g. Segmenter's class tokens) are queries, keys and values too but
    are not pooled. Equivalent PyTorch code (one batch item and head; the tests hold every
    backend to :func:`mita_seg.ops.mita_attention_reference`, which is this, batched)::

        R = adaptive_avg_pool2d(q[p:p + h*w].T.reshape(d, h, w), pool_size).flatten(1).T
        S = R @ k.T                                   # [M, N]  landmark scores
        I = S.topk(topk, dim=-1).indices              # [M, k]  routed experts' keys
        G = q @ R.T                                   # [N, M]  router / shared logits
        V_R = softmax(S / sqrt(d), -1) @ v            # [M, d]  shared expert's values
        for n in range(N):
            e = G[n].topk(router_topk).indices        # the query's experts
            logits = cat([G[n] * shared_scale] + [q[n] @ k[I[c]].T / sqrt(d) for c in e])
            values = cat([V_R] + [v[I[c]] for c in e])
            out[n] = softmax(logits, -1) @ values

    Args:
        q, k, v (Tensor): ``[B, H, N, d]``, float32 / float16 / bfloat16, CPU or CUDA.
        hw_shape (int | tuple[int, int]): the patch grid ``(h, w)``.
        pool_size (int | tuple[int, int]): landmark grid ``(Ph, Pw)``, ``M = Ph * Pw``
            experts; at most the patch grid. Default: 7.
        topk (int): keys per routed expert, ``k``. Values above N are clamped to N with a
            warning. Default: 49.
        router_topk (int): experts each query reads (``r``, 1 in the paper). Default: 1.
        num_prefix_tokens (int): tokens before the grid (1 for ViT's cls). Default: 1.
        with_shared_expert (bool): False gives route-only MiTA, which with ``topk >= N`` is
            exactly softmax attention. Default: True.
        shared_scale (float, optional): scale of the shared logits ``G``; None means the
            published ``1 / d``. Default: None.
        block_size (int, optional): tile size of the blocked backend; None picks one from
            N and M (:func:`mita_seg.ops.blocked.default_block_size`). Default: None.
        backend (str, optional): force an implementation (``'fused_cpu'``, ``'varlen'``,
            ``'blocked'``, ``'reference'``); None takes ``$MITA_BACKEND`` or the first that
            can run of ``fused_cpu, varlen, blocked`` on CPU, ``varlen, blocked`` on CUDA
            (:data:`mita_seg.ops.dispatch.AUTO_ORDER`). Default: None.
        rel_pos_bias (RelPosBias, optional): BEiT's relative position bias ``B``
            (:mod:`mita_seg.ops.bias`; tokens ``[cls, grid]``), added to the routed logits
            exactly and, averaged over the landmarks' regions, to the scores and the shared
            logits; never formed as ``N x N``. Route-only with ``topk >= N`` is then exactly
            BEiT's attention. Default: None.
        global_tokens (tuple[int, int]): ``(prefix, suffix)``: the first ``prefix`` of the
            prefix tokens and the last ``suffix`` tokens are global (BigBird's global
            tokens; :mod:`mita_seg.ops.global_tokens`): as queries they attend to every key
            exactly, as keys they are in every query's softmax exactly, and MiTA (pooling,
            top-k, routing) runs on the other tokens. E.g. ``(0, 150)`` for Segmenter's
            class tokens, ``(1, 0)`` for a global ViT cls. Not with ``rel_pos_bias``.
            Default: (0, 0).

    Returns:
        Tensor: ``[B, H, N, d]``, the dtype of ``q``; where no gradient is needed, the
        ``transpose(1, 2)`` of a contiguous ``[B, N, H, d]`` (the module's ``[B, N, C]``
        is then a view).
    """
    hw_shape, pool_size, topk = check_mita_args(q, k, v, hw_shape, pool_size, topk,
                                                router_topk, num_prefix_tokens, shared_scale,
                                                global_tokens)
    global_tokens = pair(global_tokens, 'global_tokens')
    router_topk, num_prefix_tokens = int(router_topk), int(num_prefix_tokens)  # checked ints
    d = q.shape[-1]
    shared_scale = 1.0 / d if shared_scale is None else float(shared_scale)
    if rel_pos_bias is not None:
        rel_pos_bias = RelPosBias(rel_pos_bias.table, tuple(rel_pos_bias.window))
        check_bias(rel_pos_bias, q.shape[1], q.shape[2], hw_shape, num_prefix_tokens)
        if global_tokens != (0, 0):
            raise ValueError(f'global_tokens={global_tokens} with a relative position bias: '
                             'not supported (BEiT\'s bias covers every token pair); pass '
                             'global_tokens=(0, 0)')
    if block_size is None:
        block_size = default_block_size((q.shape[2] - sum(global_tokens)) * router_topk,
                                        pool_size[0] * pool_size[1])
    else:
        check_count(block_size, 'block_size', 'give the queries of a block, at least 1, or '
                    'None for the default')
    inp = Inputs(q, k, v, hw_shape, pool_size, topk, router_topk, num_prefix_tokens,
                 with_shared_expert, shared_scale, rel_pos_bias, block_size, global_tokens)
    name = select_backend(inp, backend)
    if q.numel() == 0:  # no queries (B = 0 or H = 0): an empty output, in the graph
        return (q + k + v) * 0
    # One opaque node wherever no gradient is needed, and in jit traces (FLOP counting);
    # the backend's own autograd otherwise.
    if not torch.jit.is_tracing() and inp.requires_grad:
        return _run(inp, name)
    bias_args = () if rel_pos_bias is None else (rel_pos_bias.table, *rel_pos_bias.window)
    # (no global tokens: the node of the operator without them, as exporters know it)
    global_args = {} if global_tokens == (0, 0) else dict(global_prefix=global_tokens[0],
                                                          global_suffix=global_tokens[1])
    return _mita_op(q, k, v, *hw_shape, *pool_size, topk, router_topk, num_prefix_tokens,
                    with_shared_expert, shared_scale, block_size, name, *bias_args,
                    **global_args).transpose(1, 2)                  # [B, H, N, d]


def attend_setting(setting, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   hw_shape: IntPair, num_prefix_tokens: int, global_tokens: IntPair = (0, 0),
                   rel_pos_bias: Optional[RelPosBias] = None) -> torch.Tensor:
    """MiTA of a setting (:class:`~mita_seg.setting.MiTASetting`, as it runs on this grid:
    :meth:`~mita_seg.setting.MiTASetting.fit`) (:func:`mita_seg.ops.attend`)."""
    setting = setting.fit(hw_shape, q.shape[2] - sum(global_tokens))
    return mita_attention(q, k, v, hw_shape, setting.pool_size, setting.topk,
                          setting.router_topk, num_prefix_tokens, setting.with_shared_expert,
                          setting.shared_scale, rel_pos_bias=rel_pos_bias,
                          global_tokens=global_tokens)
