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


# ----------------------------------------------------------------------------------------
# Training-free attention kinds (mita_seg.ops.agent / block / topk / window): MACs per batch
# item and head of what each executes on an ``h x w`` grid (``n = h*w`` grid tokens), plus
# ``T`` global tokens (every token outside the grid) counted by global_flops_per_head.
# ----------------------------------------------------------------------------------------
def _pair(x) -> tuple:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


def agent_flops_per_head(hw_shape, head_dim: int, pool_size, num_global_tokens: int = 0) -> int:
    """MACs of :func:`mita_seg.ops.agent_attention` (``M = Ph * Pw`` landmarks)::

        S = R K^T                 M n d
        V_R = softmax(S) V        M n d
        G = q R^T                 n M d
        output P V_R              n M d
        global tokens             global_flops_per_head(n + T, T, d)

    MiTA's shared expert alone (:func:`mita_flops_per_head` less the routed part). The
    pooling and the softmax are not MACs."""
    (h, w), (ph, pw) = _pair(hw_shape), _pair(pool_size)
    n, M, T = h * w, ph * pw, num_global_tokens
    return 4 * M * n * head_dim + global_flops_per_head(n + T, T, head_dim)


def block_flops_per_head(hw_shape, head_dim: int, block_size, num_blocks: int,
                         num_global_tokens: int = 0) -> int:
    """MACs of :func:`mita_seg.ops.block_attention` (``nb`` blocks of ``bh x bw`` tokens,
    the block clamped to the grid, each query attending to ``b = min(num_blocks, nb)``),
    as it executes::

        block scores q . mean_k           n nb d
        logits + output over its blocks   2 n b bh bw d
        global tokens                     global_flops_per_head(n + T, T, d)

    Each chosen block is gathered padded to ``bh * bw`` slots (the smaller blocks of the
    last row and column of a grid that is not a multiple of the block too; their padding
    slots are masked, but computed): this is what a trace of the kind counts
    (``tools/get_flops.py``), independent of which blocks are chosen. With every block
    (``b = nb``) it is softmax attention and no scores are computed: ``2 n^2 d``. The block
    means are sums, not MACs."""
    (h, w), (bh, bw) = _pair(hw_shape), _pair(block_size)
    bh, bw = min(bh, h), min(bw, w)
    n, d, T = h * w, head_dim, num_global_tokens
    nb = -(-h // bh) * -(-w // bw)
    b = min(num_blocks, nb)
    if b == nb:
        return 2 * n * n * d + global_flops_per_head(n + T, T, d)
    return n * nb * d + 2 * n * b * bh * bw * d + global_flops_per_head(n + T, T, d)


def topk_flops_per_head(hw_shape, head_dim: int, topk: int, num_global_tokens: int = 0) -> int:
    """MACs of :func:`mita_seg.ops.topk_attention` (``k = min(topk, n)``)::

        scores q K^T (in chunks)          n n d
        logits + output over top-k        2 n k d
        global tokens                     global_flops_per_head(n + T, T, d)

    With ``k = n`` it is softmax attention and no scores are computed: ``2 n^2 d``. Top-k
    and gather are not MACs."""
    h, w = _pair(hw_shape)
    n, d, T = h * w, head_dim, num_global_tokens
    k = min(topk, n)
    grid = 2 * n * n * d if k == n else n * n * d + 2 * n * k * d
    return grid + global_flops_per_head(n + T, T, d)


def window_flops_per_head(hw_shape, head_dim: int, window_size,
                          num_global_tokens: int = 0) -> int:
    """MACs of :func:`mita_seg.ops.window_attention` (window ``wh x ww`` clamped to the
    grid; it stays whole at the borders, so every query has ``wh ww`` keys)::

        logits + output over the window   2 n wh ww d
        global tokens                     global_flops_per_head(n + T, T, d)
    """
    (h, w), (wh, ww) = _pair(hw_shape), _pair(window_size)
    n, T = h * w, num_global_tokens
    return (2 * n * min(wh, h) * min(ww, w) * head_dim
            + global_flops_per_head(n + T, T, head_dim))


def global_bias_adds_per_head(num_grid: int, num_global_tokens: int) -> int:
    """Additions of a relative position bias on the global tokens' logits of the kinds that
    take the tokens off the grid as global: each grid query's ``T`` global keys, each global
    query's ``n + T`` keys."""
    n, T = num_grid, num_global_tokens
    return n * T + T * (n + T)


def topk_bias_adds_per_head(hw_shape, topk: int, num_global_tokens: int = 0) -> int:
    """Additions of a relative position bias in :func:`mita_seg.ops.topk_attention`: on the
    ``n n`` scores the top-k is taken on and on the ``n k`` logits (``n n`` once with
    ``k = n``: no scores), and on the global tokens' logits."""
    h, w = _pair(hw_shape)
    n = h * w
    k = min(topk, n)
    grid = n * n if k == n else n * n + n * k
    return grid + global_bias_adds_per_head(n, num_global_tokens)


def window_bias_adds_per_head(hw_shape, window_size, num_global_tokens: int = 0) -> int:
    """Additions of a relative position bias in :func:`mita_seg.ops.window_attention`: on
    the ``n wh ww`` window logits and on the global tokens' logits."""
    (h, w), (wh, ww) = _pair(hw_shape), _pair(window_size)
    n = h * w
    return n * min(wh, h) * min(ww, w) + global_bias_adds_per_head(n, num_global_tokens)
