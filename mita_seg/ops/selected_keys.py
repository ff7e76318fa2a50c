"""What the training-free attention kinds share (:mod:`.agent`, :mod:`.block`,
:mod:`.topk`, :mod:`.window`): the argument checks, the global tokens (:func:`attend_grid`:
the tokens off the grid are keys in every grid query's softmax and attend to every key),
attention of each query over its own set of keys, in chunks of queries
(:func:`attend_selected`: never ``N x N`` at once) and BEiT's relative position bias on
those logits, each pair's own entry (:func:`grid_bias`; the kinds that select keys by
position or by logit take it: window and top-k).
"""
import contextlib
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .bias import RelPosBias, check_bias, gather_bias
from .global_tokens import attend_with_lse, merge_lse, split_tokens
from .routing import IntPair, is_int, pair, routing_dtype

__all__ = ['check_grid_args', 'check_count', 'attend_grid', 'attend_selected', 'gather_rows',
           'grid_bias', 'Selection', 'BiasOf']

# The keys of queries start:stop: None (every key) or (idx, valid), idx ``[c, K]`` (the same
# for every batch item and head) or ``[B, H, c, K]``, valid a bool mask like idx or None.
Selection = Optional[Tuple[Tensor, Optional[Tensor]]]
# The bias of queries start:stop towards their keys (None: every key; else idx as above),
# added to their logits: [H, c, K] (broadcast over the batch) or [B, H, c, K].
BiasOf = Callable[[int, int, Optional[Tensor]], Tensor]


def no_bias(kind: str, rel_pos_bias) -> None:
    """Refuse a relative position bias for a kind that does not take one."""
    if rel_pos_bias is not None:
        raise ValueError(f'{kind} attention does not take a relative position bias; give '
                         'a MiTA, top-k or window setting (e.g. 7:49, topk:49, window:7)')


def grid_bias(bias: Optional[RelPosBias], num_heads: int, num_prefix_tokens: int,
              num_grid: int) -> Optional[BiasOf]:
    """The :data:`BiasOf` of the grid queries towards grid keys under ``bias`` (grid position
    ``i`` is token ``num_prefix_tokens + i``): each pair's own table entry, gathered for the
    chunk's keys only (:func:`~.bias.gather_bias`, never ``N x N``); None without a bias."""
    if bias is None:
        return None
    p, dev = num_prefix_tokens, bias.table.device
    heads = torch.arange(num_heads, device=dev).view(-1, 1, 1)            # [H, 1, 1]

    def bias_of(start: int, stop: int, idx: Optional[Tensor]) -> Tensor:
        qi = torch.arange(start + p, stop + p, device=dev).view(-1, 1)     # [c, 1]
        # keys [n], [c, K] or [B, H, c, K]: broadcast from the right to [H, c, n],
        # [H, c, K] or [B, H, c, K]
        kj = torch.arange(p, p + num_grid, device=dev) if idx is None else idx + p
        return gather_bias(bias, heads, qi, kj)
    return bias_of


def check_count(x, name: str, hint: str) -> int:
    """``x`` as an int >= 1 (numpy's integers too); ``hint`` says what to pass instead."""
    if not is_int(x):
        raise TypeError(f'{name} must be an int, got {x!r}')
    if x < 1:
        raise ValueError(f'{name} must be >= 1, got {x}: {hint}')
    return int(x)


def check_grid_args(q: Tensor, k: Tensor, v: Tensor, hw_shape: IntPair,
                    num_prefix_tokens: int) -> Tuple[int, int]:
    """Validate the arguments every kind takes; returns ``hw_shape`` as a pair of ints."""
    if not (q.dim() == 4 and q.shape == k.shape == v.shape):
        raise ValueError('q, k, v must all have shape [B, H, N, d]; got '
                         f'{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}')
    if not q.is_floating_point() or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f'q, k, v must be of one floating point dtype, got {q.dtype}, '
                        f'{k.dtype}, {v.dtype}')
    if not q.device == k.device == v.device:
        raise ValueError(f'q, k, v must be on one device, got {q.device}, {k.device}, '
                         f'{v.device}')
    h, w = pair(hw_shape, 'hw_shape')
    p = num_prefix_tokens
    if not is_int(p):
        raise TypeError(f'num_prefix_tokens must be an int, got {p!r}')
    if h < 1 or w < 1:
        raise ValueError(f'hw_shape must be positive, got {(h, w)}')
    if p < 0:
        raise ValueError(f'num_prefix_tokens must be >= 0, got {p}')
    N = q.shape[2]
    if p + h * w > N:
        raise ValueError(
            f'hw_shape {(h, w)} with num_prefix_tokens={p} needs p + h*w = {p + h * w} '
            f'tokens, but the input has N = {N}: pass the patch grid of these tokens')
    return h, w


def attend_grid(q: Tensor, k: Tensor, v: Tensor, hw_shape: Tuple[int, int],
                num_prefix_tokens: int,
                grid_fn: Callable[[Tensor, Tensor, Tensor], Tuple[Tensor, Tensor]],
                bias: Optional[RelPosBias] = None) -> Tensor:
    """One kind of attention on the grid, the tokens outside it global.

    ``grid_fn(q_o, k_o, v_o)`` (the grid tokens, ``[B, H, h*w, d]``, in
    :func:`~.routing.routing_dtype`) returns ``(out, lse)``: each grid query's attention over
    its grid logits and their log-sum-exp. The global keys join each grid query's softmax
    (:func:`~.global_tokens.merge_lse`); the global queries attend to every key densely.
    Arguments are taken as validated (:func:`check_grid_args`). With ``bias`` (checked
    here against the tokens), the global logits take their entries; ``grid_fn`` adds the
    grid ones (:func:`grid_bias`).

    Returns:
        Tensor: ``[B, H, N, d]`` in ``q.dtype``.
    """
    h, w = hw_shape
    p = num_prefix_tokens
    H, N = q.shape[1], q.shape[2]
    s = N - p - h * w
    dt = routing_dtype(q.dtype)
    bias_og = bias_g = None                    # grid queries -> global keys; global -> all
    if bias is not None:
        check_bias(bias, H, N, (h, w), p)
        dev, heads = q.device, torch.arange(H, device=q.device).view(H, 1, 1)
        glob = torch.cat([torch.arange(p, device=dev), torch.arange(p + h * w, N, device=dev)])
        grid = torch.arange(p, p + h * w, device=dev)
        bias_og = gather_bias(bias, heads, grid.view(1, -1, 1), glob.view(1, 1, -1))
        bias_g = gather_bias(bias, heads, glob.view(1, -1, 1),
                             torch.arange(N, device=dev).view(1, 1, -1))     # [H, p + s, N]
    # The kinds pick their own precision: autocast must not push their matmuls into bf16
    # (the meta device of FLOP counting has no autocast to turn off).
    no_autocast = (contextlib.nullcontext() if q.device.type == 'meta' else
                   torch.autocast(q.device.type, enabled=False))
    with no_autocast:
        qf, kf, vf = (t.to(dt) for t in (q, k, v))
        (q_o, q_g), (k_o, k_g), (v_o, v_g) = (split_tokens(t, (p, s)) for t in (qf, kf, vf))
        out, lse = grid_fn(q_o, k_o, v_o)                              # [B, H, h*w, d]
        if p + s:
            out = merge_lse(out, lse, *attend_with_lse(q_o, k_g, v_g, bias_og))
            out_g = attend_with_lse(q_g, kf, vf, bias_g)[0]            # [B, H, p + s, d]
            out = torch.cat([out_g[:, :, :p], out, out_g[:, :, p:]], 2)
    return out.to(q.dtype)


def gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """``x`` (``[B, H, n, d]``) at ``idx`` (``[c, K]`` or ``[B, H, c, K]``): ``[B, H, c, K,
    d]``."""
    if idx.dim() == 2:
        return x[:, :, idx]
    B, H, n, d = x.shape
    base = torch.arange(B * H, device=x.device).view(B, H, 1, 1) * n
    return x.reshape(B * H * n, d)[idx + base]


def attend_selected(q: Tensor, k: Tensor, v: Tensor, select: Callable[[int, int], Selection],
                    chunk_size: int, bias_of: Optional[BiasOf] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention (scale ``1 / sqrt(d)``) of each query over its own keys,
    ``chunk_size`` queries at a time.

    ``select(start, stop)`` gives the keys of queries ``start:stop``: None (every key) or
    ``(idx, valid)``, ``idx`` ``[c, K]`` (the same for every batch item and head) or
    ``[B, H, c, K]`` (positions in ``k``), ``valid`` a bool mask of ``idx``'s shape or None
    (all valid); every query needs one valid key. ``bias_of`` (:data:`BiasOf`, e.g.
    :func:`grid_bias`) adds a bias to each chunk's logits. Differentiable in ``q, k, v``; the
    selections carry no gradient. MACs: ``2 c K d`` per chunk (``2 c n d`` for every key).

    Returns:
        tuple: ``(out [B, H, L, d], lse [B, H, L])``.
    """
    L, d = q.shape[2], q.shape[3]
    outs, lses = [], []
    for start in range(0, L, chunk_size):
        stop = min(start + chunk_size, L)
        qc = q[:, :, start:stop] * d ** -0.5                          # [B, H, c, d]
        sel = select(start, stop)
        if sel is None:
            logits = qc @ k.transpose(-1, -2)                          # [B, H, c, n]
        else:
            idx, valid = sel
            ks, vs = gather_rows(k, idx), gather_rows(v, idx)          # [B, H, c, K, d]
            logits = (qc.unsqueeze(-2) @ ks.transpose(-1, -2)).squeeze(-2)   # [B, H, c, K]
            if valid is not None:
                logits = logits.masked_fill(~valid, float('-inf'))
        if bias_of is not None:
            logits = logits + bias_of(start, stop, None if sel is None else sel[0]).to(
                logits.dtype)
        lse = torch.logsumexp(logits, -1)                              # [B, H, c]
        probs = torch.exp(logits - lse.unsqueeze(-1))
        if sel is None:
            outs.append(probs @ v)
        else:
            outs.append((probs.unsqueeze(-2) @ vs).squeeze(-2))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)
