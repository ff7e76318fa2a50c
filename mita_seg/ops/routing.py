"""Landmarks and expert selection of MiTA, shared by every implementation.

All implementations (the dense reference and the fast paths) take their routing
decisions from :func:`mita_routing`, so that they select the very same keys; the
selection itself is checked against a brute-force sort in the tests.
"""
from numbers import Integral
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

IntPair = Union[int, Tuple[int, int]]


class MiTARouting(NamedTuple):
    """Routing decisions of one MiTA call (``M = Ph * Pw`` landmarks).

    Attributes:
        landmarks (Tensor): ``R``, ``[B, H, M, d]``, pooled grid queries (float32 or wider).
        scores (Tensor): ``S / sqrt(d) = R K^T / sqrt(d)`` (``+ Bq`` with a relative position
            bias), ``[B, H, M, N]``.
        router (Tensor): ``G * shared_scale = q R^T * shared_scale`` (``+ Bk`` with a
            relative position bias), ``[B, H, N, M]``, the shared logits.
        expert_keys (Tensor): ``I``, ``[B, H, M, k]``, the top-k keys of each expert.
        choice (Tensor): ``e``, ``[B, H, N, r]``, the experts each query is routed to.
    """
    landmarks: torch.Tensor
    scores: torch.Tensor
    router: torch.Tensor
    expert_keys: torch.Tensor
    choice: torch.Tensor


def is_int(x) -> bool:
    """Whether ``x`` is an integer (numpy's too), not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def pair(x: IntPair, name: str) -> Tuple[int, int]:
    """``x`` as a pair of ints; ``name`` is used in the error message."""
    if is_int(x):
        return int(x), int(x)
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(map(is_int, x)):
        return int(x[0]), int(x[1])
    raise TypeError(f'{name} must be an int or a pair of ints (h, w), got {x!r}')


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing is computed in at least float32, so that low-precision inputs select the
    same keys as the float32 reference on the same values."""
    return torch.promote_types(dtype, torch.float32)


def landmarks(q: torch.Tensor, hw_shape: Tuple[int, int], pool_size: Tuple[int, int],
              num_prefix_tokens: int) -> torch.Tensor:
    """Average-pool the grid part of ``q`` ([B, H, N, d]) down to ``pool_size``.

    Returns ``R``: ``[B, H, Ph * Pw, d]`` in :func:`routing_dtype`.
    """
    B, H, _, d = q.shape
    h, w = hw_shape
    p = num_prefix_tokens
    grid = q[:, :, p:p + h * w].to(routing_dtype(q.dtype))           # [B, H, h*w, d]
    grid = grid.reshape(B * H, h, w, d).permute(0, 3, 1, 2)           # [BH, d, h, w]
    r = F.adaptive_avg_pool2d(grid, pool_size)                        # [BH, d, Ph, Pw]
    return r.flatten(2).transpose(1, 2).reshape(B, H, pool_size[0] * pool_size[1], d)


def mita_routing(q: torch.Tensor,
                 k: torch.Tensor,
                 hw_shape: Tuple[int, int],
                 pool_size: Tuple[int, int],
                 topk: int,
                 router_topk: int = 1,
                 num_prefix_tokens: int = 1,
                 shared_scale: Optional[float] = None,
                 landmark_bias: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> MiTARouting:
    """Landmarks, scores and the two top-k decisions of MiTA (no gradient flows through
    the indices). Arguments are assumed validated (see :func:`mita_attention`); the scales
    are positive, so selecting on scaled scores selects the same keys and experts.
    ``shared_scale=None`` means ``1 / d``. ``landmark_bias``: ``(Bq [H, M, N], Bk [H, N, M])``
    of a relative position bias (:func:`mita_seg.ops.bias.landmark_bias`), added to the
    scores and to the router logits."""
    d = q.shape[-1]
    shared_scale = 1.0 / d if shared_scale is None else shared_scale
    R = landmarks(q, hw_shape, pool_size, num_prefix_tokens)
    dt = R.dtype
    S = (R * d ** -0.5) @ k.to(dt).transpose(-1, -2)                  # [B, H, M, N]
    G = q.to(dt) @ (R * shared_scale).transpose(-1, -2)               # [B, H, N, M]
    if landmark_bias is not None:
        S = S + landmark_bias[0].to(dt)
        G = G + landmark_bias[1].to(dt)
    expert_keys = S.detach().topk(topk, dim=-1, sorted=False).indices   # [B, H, M, k]
    if router_topk == 1:
        choice = G.detach().argmax(dim=-1, keepdim=True)              # [B, H, N, 1]
    else:
        choice = G.detach().topk(router_topk, dim=-1, sorted=False).indices  # [B, H, N, r]
    return MiTARouting(R, S, G, expert_keys, choice)
