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

:func:`settings_near` gives each kind's setting nearest each of several budgets (the
per-layer candidates of a plan across kinds); :func:`setting_at_reduction` the setting,
of a list ordered by cost, whose *model* FLOPs (counted, not priced) come nearest a
fraction below the unswapped model's (the paper's 42%).
"""
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from mita_seg.setting import KINDS, MiTASetting

__all__ = ['Call', 'cost_of', 'kind_candidates', 'setting_at_cost', 'settings_near',
           'setting_at_reduction', 'within', 'TOLERANCE']

# (grid (h, w), tokens N, head dim d, global tokens T, batch x heads)
Call = Tuple[Tuple[int, int], int, int, int, int]
TOLERANCE = 0.10   # "at equal cost": within 10% of the target's attention MACs


def cost_of(setting: MiTASetting, calls: Sequence[Call]) -> int:
    """Attention MACs of ``setting`` over ``calls`` (each call's formula times its batch x
    heads)."""
    total = 0
    for (grid, n, d, t), bh in _merged(calls).items():
        total += bh * setting.attention_macs(grid, n, d, t)
    return total


def _merged(calls: Sequence[Call]) -> dict:
    """``{(grid, N, d, T): batch x heads}`` over ``calls`` (layers of one shape priced once)."""
    out: dict = {}
    for grid, n, d, t, bh in calls:
        out[(tuple(grid), n, d, t)] = out.get((tuple(grid), n, d, t), 0) + bh
    return out


def kind_candidates(kind: str, grid: Tuple[int, int]) -> Iterator[MiTASetting]:
    """The settings of ``kind`` worth pricing on an ``h x w`` grid (larger ones are clamped
    to the grid and cost the same): its record's ``candidates``
    (:data:`mita_seg.setting.KINDS`; e.g. agent every pool up to the grid's whose sides
    differ by at most one, MiTA every pool side with
    :data:`~mita_seg.setting.MITA_TOPKS`).

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f'attention kind {kind!r}: one of {", ".join(sorted(KINDS))}')
    return KINDS[kind].candidates(tuple(grid))


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


def settings_near(budgets: Sequence[MiTASetting], kinds: Sequence[str],
                  calls: Sequence[Call]) -> List[MiTASetting]:
    """Each of ``kinds`` at the setting whose MACs over ``calls`` come nearest each budget's
    (:func:`setting_at_cost`), budget by budget, each setting once: the candidates of every
    kind near the budgets of a plan across kinds
    (:class:`~mita_seg.apis.calibrate.SwapCalibrator`). A budget's own kind gives the budget.

    Raises:
        ValueError: no calls, or an unknown kind.
    """
    out: List[MiTASetting] = []
    for budget in budgets:
        target = cost_of(budget, calls)
        for kind in kinds:
            setting = budget if kind == budget.kind else setting_at_cost(kind, target, calls)[0]
            if setting not in out:
                out.append(setting)
    return out


def setting_at_reduction(settings: Sequence[MiTASetting], reduction: float, dense_flops: float,
                         flops: Callable[[MiTASetting], float],
                         start: Optional[int] = None) -> Tuple[MiTASetting, float, int]:
    """Of ``settings``, ordered by cost (none costs less than the one before it: MiTA's pool
    sides at one k), the one whose model FLOPs ``flops(setting)`` come nearest
    ``(1 - reduction) x dense_flops`` (on a tie the cheaper), with its reduction (a fraction
    of ``dense_flops``) and its index. ``flops`` is called a few times, not once per
    setting: from ``start`` (an index, e.g. the answer for a neighbouring k; default the
    middle) the step doubles until the target is bracketed, then halves.

    Raises:
        ValueError: no settings, or a reduction outside [0, 1).
    """
    if not settings:
        raise ValueError('no settings to search: give at least one')
    if not 0 <= reduction < 1:
        raise ValueError(f'reduction must be in [0, 1) (0.42: 42% fewer FLOPs), got {reduction}')
    target, n = (1 - reduction) * dense_flops, len(settings)
    counted: Dict[int, float] = {}

    def cost(i: int) -> float:
        if i not in counted:
            counted[i] = flops(settings[i])
        return counted[i]

    i = n // 2 if start is None else min(max(start, 0), n - 1)
    # bracket: cost(lo) <= target < cost(hi), lo = -1 and hi = n standing for the ends
    if cost(i) <= target:
        lo, step = i, 1
        while lo + step < n and cost(lo + step) <= target:
            lo, step = lo + step, 2 * step
        hi = min(lo + step, n)
    else:
        hi, step = i, 1
        while hi - step >= 0 and cost(hi - step) > target:
            hi, step = hi - step, 2 * step
        lo = max(hi - step, -1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= target else (lo, mid)
    best = min((j for j in (lo, hi) if 0 <= j < n), key=lambda j: abs(cost(j) - target))
    return settings[best], 1 - cost(best) / dense_flops, best
