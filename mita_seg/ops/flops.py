"""Multiply-accumulate counts of MiTA and of standard attention (one MAC = one FLOP,
mmengine's convention; multiply by 2 for FlopCounterMode's). Each backend's own count (what
it executes) sits beside it in its module and in :data:`mita_seg.ops.dispatch.BACKENDS`."""


def attention_flops(batch: int, num_heads: int, num_tokens: int, head_dim: int,
                    with_bias: bool = False) -> int:
    """Softmax attention: ``q k^T`` and ``attn v``, ``2 N^2 C`` per batch item; with an
    additive bias (BEiT's relative position bias) ``N^2`` more per head (one add = one
    FLOP)."""
    per_head = 2 * num_tokens ** 2 * head_dim + (num_tokens ** 2 if with_bias else 0)
    return batch * num_heads * per_head


def bias_flops_per_head(num_tokens: int, num_experts: int, topk: int,
                        router_topk: int = 1) -> int:
    """Additions of a relative position bias in MiTA, per batch item and head (one add =
    one FLOP): ``Bq`` on the ``M N`` scores, ``Bk`` on the ``N M`` router / shared logits
    and the gathered bias on the ``N r k`` routed logits. The box sums that form ``Bq`` and
    ``Bk`` (:func:`mita_seg.ops.bias.landmark_bias`) are per head, not per batch item, and
    are counted here once per item too (3 adds per mean: ``6 M N``), an upper bound."""
    N, M = num_tokens, num_experts
    return 2 * M * N + N * router_topk * topk + 6 * M * N


def mita_flops_per_head(num_tokens: int, head_dim: int, num_experts: int, topk: int,
                        router_topk: int = 1, with_shared_expert: bool = True,
                        block_size=None) -> int:
    """MACs of MiTA for one batch item and head::

        S = R K^T                 M N d
        G = q R^T                 N M d     (router logits, also the shared logits)
        V_R = softmax(S) V        M N d     (shared expert only)
        shared output  P_s V_R    N M d     (shared expert only)
        routed logits + output    2 N r k d

    which is the paper's ``(4M + 2k) N C`` for r = 1 (``(2M + 2k) N C`` route-only), and
    what the fused CPU backend executes. Pooling, top-k, sort, gather and the softmax are
    memory traffic, not MACs. ``block_size`` is unused (the signature of every backend's
    ``flops``).
    """
    N, M = num_tokens, num_experts
    per_head = 2 * M * N + 2 * N * router_topk * topk
    if with_shared_expert:
        per_head += 2 * M * N
    return head_dim * per_head


def global_flops_per_head(num_tokens: int, num_global_tokens: int, head_dim: int) -> int:
    """MACs of ``T`` global tokens among ``N`` (:mod:`mita_seg.ops.global_tokens`), per batch
    item and head, on top of MiTA over the other ``N - T`` tokens::

        other queries x global keys: logits and output    2 (N - T) T d
        global queries x every key:  logits and output    2 T N d
    """
    N, T = num_tokens, num_global_tokens
    return 2 * (N - T) * T * head_dim + 2 * T * N * head_dim
