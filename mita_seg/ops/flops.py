"""Multiply-accumulate counts of MiTA and of standard attention (one MAC = one FLOP,
mmengine's convention; multiply by 2 for FlopCounterMode's)."""
from typing import Optional

from .blocked import default_block_size, num_tiles


def attention_flops(batch: int, num_heads: int, num_tokens: int, head_dim: int) -> int:
    """Softmax attention: ``q k^T`` and ``attn v``, ``2 N^2 C`` per batch item."""
    return 2 * batch * num_heads * num_tokens ** 2 * head_dim


def mita_flops(batch: int, num_heads: int, num_tokens: int, head_dim: int, num_experts: int,
               topk: int, router_topk: int = 1, with_shared_expert: bool = True,
               block_size: Optional[int] = None, backend: Optional[str] = None) -> int:
    """MACs of one MiTA call, per batch item and head times ``B * H``::

        S = R K^T                 M N d
        G = q R^T                 N M d     (router logits, also the shared logits)
        V_R = softmax(S) V        M N d     (shared expert only)
        shared output  P_s V_R    N M d     (shared expert only)
        routed logits + output    2 L k d   L = N r routed query slots

    which is the paper's ``(4M + 2k) N C`` for r = 1 (``(2M + 2k) N C`` route-only). This is
    what the fused CPU backend (the default) executes. The plain-PyTorch ``'blocked'``
    backend (``backend='blocked'``) also computes its padding slots, ``L = T * ceil((N r +
    M (T - 1)) / T)`` with tile size ``T = block_size``. Pooling, top-k, sort, gather and
    the softmax are memory traffic, not MACs.
    """
    N, M = num_tokens, num_experts
    L = N * router_topk
    if backend == 'blocked':
        T = block_size or default_block_size(N * router_topk, M)
        L = num_tiles(N * router_topk, M, T) * T
    per_head = 2 * M * N + 2 * L * topk
    if with_shared_expert:
        per_head += 2 * M * N
    return batch * num_heads * head_dim * per_head
