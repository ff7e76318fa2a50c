"""Each attention kind at a given cost: the setting of a kind (``agent:P``, ``block:b:n``,
``topk:k``, ``window:w``, MiTA ``P:k``) whose attention multiply-adds on a model's swapped
layers come nearest a target (the MACs of MiTA M = k = 49, say), priced by the formulas of
:meth:`mita_seg.setting.MiTASetting.attention_macs` over the calls that
:class:`~mita_seg.analysis.attention_macs.AttentionMacCounter` records (``calls``: grid,
tokens, head dim, global tokens and batch x heads of each call), so that kinds are compared
at equal cost rather than at equal-looking parameters.

A kind may not reach a target: ``topk`` scores every key, so its cost never falls below
``n n d`` per head (half of softmax attention's); :func:`setting_at_cost` then gives its
cheapest setting and :func:`within` says how far it is.
"""
import itertools
import math
from typing import Iterator, List, Sequence, Tuple

from mita_seg.setting import MiTASetting

__all__ = ['Call', 'cost_of', 'kind_candidates', 'setting_at_cost', 'within', 'TOLERANCE']

# (grid (h, w), tokens N, head dim d, global tokens T, batch x heads)
Call = Tuple[Tuple[int, int], int, int, int, int]
TOLERANCE = 0.10   # "at equal cost": within 10% of the target's attention MACs
# MiTA's top-k values searched (the pool sizes are every side up to the grid's)
MITA_TOPKS = (4, 8, 16, 32, 49, 64, 100, 128, 256)


def cost_of(setting: MiTASetting, calls: Sequence[Call]) -> int:
    """Attention MACs of ``setting`` over ``calls`` (each call's formula times its batch x
    heads)."""
    total = 0
    for (grid, n, d, t), bh in _merged(calls).items():
        extra = dict(num_global_tokens=t) if setting.kind == 'mita' else {}
        total += bh * setting.attention_macs(grid, n, d, **extra)
    return total


def _merged(calls: Sequence[Call]) -> dict:
    """``{(grid, N, d, T): batch x heads}`` over ``calls`` (layers of one shape priced once)."""
    out: dict = {}
    for grid, n, d, t, bh in calls:
        out[(tuple(grid), n, d, t)] = out.get((tuple(grid), n, d, t), 0) + bh
    return out


def kind_candidates(kind: str, grid: Tuple[int, int]) -> Iterator[MiTASetting]:
    """The settings of ``kind`` worth pricing on an ``h x w`` grid (larger ones are clamped
    to the grid and cost the same): agent every pool up to the grid's whose sides differ by
    at most one (``8x9``: finer steps of cost than squares), window every side, block
    every block side from 2 with every number of blocks, topk every k up to ``h w``, MiTA
    every pool side with :data:`MITA_TOPKS`."""
    h, w = grid
    side = min(h, w)
    if kind == 'agent':
        for p in range(1, side + 1):
            yield MiTASetting(kind='agent', pool_size=p)
            if p < side:
                yield MiTASetting(kind='agent', pool_size=(p, p + 1))
    elif kind == 'window':
        yield from (MiTASetting(kind='window', window=s) for s in range(1, max(h, w) + 1))
    elif kind == 'topk':
        yield from (MiTASetting(kind='topk', topk=k) for k in range(1, h * w + 1))
    elif kind == 'block':
        for b in range(2, max(h, w) + 1):
            blocks = math.ceil(h / b) * math.ceil(w / b)
            yield from (MiTASetting(kind='block', block_size=b, num_blocks=n)
                        for n in range(1, blocks + 1))
    elif kind == 'mita':
        yield from (MiTASetting(pool_size=p, topk=k)
                    for p, k in itertools.product(range(1, side + 1), MITA_TOPKS)
                    if k <= h * w)
    else:
        raise ValueError(f'attention kind {kind!r}: one of agent, block, mita, topk, window')


def setting_at_cost(kind: str, macs: float, calls: Sequence[Call]) -> Tuple[MiTASetting, int]:
    """The setting of ``kind`` whose MACs over ``calls`` are nearest ``macs`` (relative
    distance; on a tie the first of :func:`kind_candidates`, the smaller), and its MACs.

    Raises:
        ValueError: no calls (the model had no swapped attention), or an unknown kind.
    """
    if not calls:
        raise ValueError('no swapped attention call to price: swap the model, then count '
                         'its attention (AttentionMacCounter.calls)')
    grids = {c[0] for c in calls}
    grid = (max(g[0] for g in grids), max(g[1] for g in grids))
    priced: List[Tuple[float, MiTASetting, int]] = []
    for s in kind_candidates(kind, grid):
        cost = cost_of(s, calls)
        priced.append((abs(cost - macs) / macs, s, cost))
    best = min(priced, key=lambda p: p[0])
    return best[1], best[2]


def within(macs: float, target: float, tolerance: float = TOLERANCE) -> bool:
    """Whether ``macs`` is within ``tolerance`` (relative) of ``target``."""
    return abs(macs - target) <= tolerance * target
