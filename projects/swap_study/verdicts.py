"""The swap study's verdicts on the paper's claims, computed from the per-seed values of the
JSON the study writes, by rules stated once (:data:`RULES`, which docs/swap_study.md quotes
through :mod:`.docs`).

A claim is tested by one or more :class:`Test` s: an inequality on one number per seed (a
row's value, or the difference of two rows of the same seed), read from one model's result
(an entry of the JSON's ``models``). :func:`judge` gives a test's values on a model and its
verdict (:func:`verdict`); :func:`claim_tests` the tests of the paper's claims over the
results at hand (the budgets, grids and MiTA-trained settings they hold). Torch-free: rows
are plain dicts, as the JSON holds them."""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from mita_seg.setting import MiTASetting
from .stats import mean_std

__all__ = ['CONTROL', 'CONTROL_LOSS', 'WITHIN', 'PAPER_REDUCTION', 'PAPER_BAND', 'PRUNED_SHARE',
           'RULES', 'Measured', 'Test', 'Judged', 'control_row', 'control_losses', 'verdict',
           'judge', 'claim_tests', 'equal_cost_row', 'ACROSS', 'plan_row', 'plan_tests',
           'paper_row', 'nearest_paper_row', 'finetune_row']

# the destructive control (every token reads one key: no token mixing) and what it must lose,
# on every seed, for a model's rows to decide anything
CONTROL = '1:1:route'
CONTROL_LOSS = 15.0
# "about 1 point", "within a point": a loss of at most this many mIoU points
WITHIN = 1.0
# the paper's "up to 42% fewer FLOPs", and the band around it that counts as that point
PAPER_REDUCTION = 42.0
PAPER_BAND = 2.0
# the share of tokens read by no routed expert, in every layer, that counts as "many"
PRUNED_SHARE = 50.0
# the field that marks a plan whose layers may take every kind (the study's ACROSS_MARK)
ACROSS = 'across_kinds'
# the field that marks the sweep's rows at the paper's compression (the study's PAPER_MARK):
# claim 1's, not the grid's
AT_PAPER = 'paper_reduction_%'

NOT_MEASURED = 'not measured'
CANNOT_TELL = 'cannot tell'
REPRODUCED = 'reproduced'
NOT_REPRODUCED = 'not reproduced'

# the rules, in the order they are applied (docs/swap_study.md, "Verdict rules", is this text)
RULES = (
    f'**{NOT_MEASURED}**: the model\'s JSON has no row (or pair of rows) the inequality '
    'reads.',
    f'**{CANNOT_TELL}**: the model\'s destructive control (`{CONTROL}`: every token reads one '
    f'key, no token mixing) does not lose at least {CONTROL_LOSS:.0f} mIoU points on every '
    'seed, or has no row in the JSON: its scenes could not tell a harmless swap from a '
    'harmful one (how many seeds the inequality holds on is given beside it).',
    f'**{REPRODUCED}**: the inequality holds on every seed.',
    f'**{NOT_REPRODUCED}**: it fails on every seed.',
    '**mixed (k of n seeds)**: it holds on k of the model\'s n seeds.',
)


@dataclass(frozen=True)
class Measured:
    """A test's number on one model: ``values`` by seed (the JSON's seed keys, as strings)
    and ``rows``, which rows of that model's JSON it read when that varies by model (e.g.
    the setting nearest 42% fewer FLOPs), else ''."""
    values: Dict[str, float]
    rows: str = ''


@dataclass(frozen=True)
class Test:
    """One inequality of a claim: ``claim`` (its number), ``words`` (the claim as the paper
    states it), ``inequality`` (which rows of the JSON, which threshold), ``measure`` (a
    model's result to its :class:`Measured`, None where the rows are missing), ``holds``
    (the inequality on one seed's value) and ``signed`` (a difference: shown with its
    sign)."""
    claim: int
    words: str
    inequality: str
    measure: Callable[[dict], Optional[Measured]]
    holds: Callable[[float], bool]
    signed: bool = True


@dataclass(frozen=True)
class Judged:
    """A test on one model: ``measured`` (None: not measured) and ``verdict`` (the rule's
    words, then after ': ' why where the rows cannot tell)."""
    measured: Optional[Measured]
    verdict: str

    @property
    def rule(self) -> str:
        """The verdict without its why: the words of the rule that gave it."""
        return self.verdict.split(': ')[0]

    def cell(self, signed: bool = True) -> str:
        """``mean ± std (v1 / v2 / v3)``, after the rows read where they vary by model."""
        if self.measured is None:
            return 'no rows'
        values = list(self.measured.values.values())
        avg, std = mean_std(values)
        fmt, spread = ('+.2f', '.2f') if signed else ('.1f', '.1f')
        text = (f'{avg:{fmt}} ± {std:{spread}} ('
                + ' / '.join(f'{v:{fmt}}' for v in values) + ')')
        return f'{self.measured.rows}: {text}' if self.measured.rows else text


def control_row(res: dict) -> Optional[dict]:
    """The destructive control's row (its setting spelt :data:`CONTROL`), None if none."""
    return next((r for r in res['rows'] if CONTROL in r['setting']), None)


def control_losses(res: dict) -> Optional[Dict[str, float]]:
    """The destructive control's mIoU change by seed, None where the result has no row for
    it."""
    row = control_row(res)
    return None if row is None else _by_seed(row, 'delta_mIoU')


def verdict(values: Dict[str, float], holds: Callable[[float], bool],
            control: Optional[Dict[str, float]]) -> str:
    """The verdict of :data:`RULES` on per-seed ``values`` (empty: not measured), given the
    control's mIoU change by seed (:func:`control_losses`; None: no control row)."""
    if not values:
        return NOT_MEASURED
    # mIoUs have 2 decimals: a difference's float noise (31.02 - 32.02 = -1.0000000000000036,
    # 55.02 - 70.02 = -14.999999999999993) must not decide a bound the tables print as met
    held = sum(bool(holds(round(v, 9))) for v in values.values())
    n = len(values)
    if control is None:
        return f'{CANNOT_TELL}: no `{CONTROL}` row; holds on {held} of {n} seeds'
    weak = [s for s in values if round(control.get(s, 0.0), 9) > -CONTROL_LOSS]
    if weak:
        return (f'{CANNOT_TELL}: `{CONTROL}` loses under {CONTROL_LOSS:.0f} on seed '
                f"{', '.join(weak)}; holds on {held} of {n} seeds")
    if held == n:
        return REPRODUCED
    return NOT_REPRODUCED if held == 0 else f'mixed ({held} of {n} seeds)'


def judge(test: Test, res: dict) -> Judged:
    """``test`` on one model's result: its values by seed and its verdict."""
    measured = test.measure(res)
    if measured is None or not measured.values:
        return Judged(None, NOT_MEASURED)
    return Judged(measured, verdict(measured.values, test.holds, control_losses(res)))


def _by_seed(row: dict, key: str) -> Dict[str, float]:
    """``row``'s ``key`` by seed (a row of one seed: its value under '')."""
    values = row.get('per_seed', {}).get(key)
    if values is None:
        return {} if row.get(key) is None else {'': row[key]}
    return dict(values)


def _difference(a: Optional[dict], b: Optional[dict], key: str = 'mIoU') -> Optional[Measured]:
    """Row ``a``'s ``key`` minus row ``b``'s, seed by seed (the seeds both have)."""
    if a is None or b is None:
        return None
    va, vb = _by_seed(a, key), _by_seed(b, key)
    return Measured({s: va[s] - vb[s] for s in va if s in vb})


def _swap(res: dict, M: int, topk: int) -> Optional[dict]:
    """The encoder-only MiTA row at (M, k) (no retraining)."""
    return next((r for r in res['rows'] if r['kind'] == 'swap' and r['M'] == M
                 and r['topk'] == topk), None)


def equal_cost_row(res: dict, budget: str, attention: str,
                   within: bool = True) -> Optional[dict]:
    """The ``attention`` row (a kind's name) at MiTA ``budget``'s cost; with ``within``, only
    if it is within the budget's tolerance."""
    return next((r for r in res['rows'] if r['kind'] == 'equal-cost' and r['budget'] == budget
                 and r['attention'] == attention and (r['within'] or not within)), None)


def _grid(M: int) -> str:     # the square pool of M experts: 7x7
    return '{0}x{0}'.format(int(round(M ** 0.5)))


def _delta_of(row: Optional[dict], rows: str = '') -> Optional[Measured]:
    return None if row is None else Measured(_by_seed(row, 'delta_mIoU'), rows)


def _reduced(row: Optional[dict]) -> Optional[Measured]:
    """``row``'s change, its reduction of model FLOPs named."""
    return _delta_of(row, row and f"{row['model_reduction_%']:.1f}% fewer FLOPs")


def paper_row(res: dict) -> Optional[dict]:
    """The paper's swap: encoder-only MiTA at M = k = 49, no retraining (None if none)."""
    return _swap(res, 49, 49)


def nearest_paper_row(res: dict) -> Optional[dict]:
    """The sweep's MiTA row (no retraining) whose model FLOPs are nearest
    :data:`PAPER_REDUCTION` fewer (None if no swap row has FLOPs)."""
    swaps = [r for r in res['rows'] if r['kind'] == 'swap' and r.get('model_GFLOPs')]
    return min(swaps, key=lambda r: abs(r['model_reduction_%'] - PAPER_REDUCTION),
               default=None)


def finetune_row(res: dict) -> Optional[dict]:
    """The paper's swap (M = k = 49) exported and fine-tuned (None if not run)."""
    return next((r for r in res['rows'] if r['kind'] == 'finetune' and r['M'] == 49
                 and r['topk'] == 49), None)


def _nearest_42(res: dict) -> Optional[Measured]:
    row = nearest_paper_row(res)
    if row is None:
        return None
    red = row['model_reduction_%']
    at = abs(red - PAPER_REDUCTION) <= PAPER_BAND
    return _delta_of(row, f"{row['setting']}, {red:.1f}% fewer"
                     + ('' if at else f' (no point at {PAPER_REDUCTION - PAPER_BAND:.0f}-'
                        f'{PAPER_REDUCTION + PAPER_BAND:.0f}% in this run)'))


def _finetuned(res: dict) -> Optional[Measured]:
    row = finetune_row(res)
    return _delta_of(row, row and row['setting'])


def _selection(res: dict, of: Callable[[List[float]], float]) -> Optional[Measured]:
    """``of`` the per-layer shares (%) of tokens in no routed expert, per seed (each run's
    token selection at M = k = 49)."""
    values = {}
    for run in res.get('runs', []):
        sel = run.get('selection')
        if sel and sel.get('setting') == '7:49' and sel.get('layers'):
            values[str(run['seed'])] = of(
                [100.0 * v['never_selected'] for v in sel['layers'].values()])
    return Measured(values) if values else None


def _native(res: dict, trained: str, M: int, topk: int) -> Optional[Measured]:
    """The model trained with MiTA ``trained``: tested at (M, k) minus tested as trained."""
    native = next((n for n in res.get('native', []) if n['setting'] == trained), None)
    if native is None:
        return None
    rows = [r for r in native['rows'] if r['kind'] == 'native']
    as_trained = next((r for r in rows if r.get('trained_setting')), None)
    at = next((r for r in rows if r['M'] == M and r['topk'] == topk), None)
    return _difference(at, as_trained)


def claim_tests(results: Sequence[dict]) -> List[Test]:
    """The tests of the paper's claims over ``results`` (one entry of a JSON's ``models``
    per model): the budgets of the equal-cost rows, the sweep's grid and the MiTA-trained
    settings are those any of them holds."""
    rows = [r for res in results for r in res['rows']]
    budgets = list(dict.fromkeys(r['budget'] for r in rows if r['kind'] == 'equal-cost'))
    # the sweep's grid (pool sizes x top-k), its points at the paper's compression aside
    grid = {(r['M'], r['topk']) for r in rows if r['kind'] == 'swap' and AT_PAPER not in r}
    Ms = sorted({M for M, _ in grid})
    ks = sorted({k for _, k in grid})
    natives = list(dict.fromkeys(n['setting'] for res in results for n in res.get('native', [])))
    loses = f'delta mIoU >= -{WITHIN:.2f}'
    tests = [
        Test(1, 'about 1 mIoU point lost at up to 42% fewer FLOPs, swapping without '
             'retraining (M = k = 49)',
             f"MiTA M = k = 49 (the paper's setting), encoder, no retraining (row `swap` "
             f'7x7 k=49): {loses}', lambda res: _reduced(paper_row(res)),
             lambda v: v >= -WITHIN),
        Test(1, '', f'the MiTA setting of the sweep nearest {PAPER_REDUCTION:.0f}% fewer model '
             f'FLOPs (rows `swap`; the {PAPER_REDUCTION:.0f}% point itself: '
             f'{PAPER_REDUCTION - PAPER_BAND:.0f}-{PAPER_REDUCTION + PAPER_BAND:.0f}%): '
             f'{loses}', _nearest_42, lambda v: v >= -WITHIN),
    ]
    at_paper = list(dict.fromkeys((r['M'], r['topk']) for r in rows
                                  if r['kind'] == 'swap' and AT_PAPER in r))
    tests += [Test(1, '', f'MiTA M={_grid(M)} k={k}, a setting at the paper\'s '
                   f'compression (row `swap`): {loses}',
                   lambda res, M=M, k=k: _reduced(_swap(res, M, k)), lambda v: v >= -WITHIN)
              for M, k in at_paper]
    for number, other, words in (
            (2, 'agent', 'routing with compression (MiTA) beats compression alone at equal '
             'cost'),
            (3, 'block', 'MiTA beats block routing at equal cost')):
        for i, b in enumerate(budgets):
            tests.append(Test(
                number, '' if i else words,
                f'at the encoder attention cost of MiTA {b}: MiTA minus {other}, mIoU > 0 '
                f'(rows `equal-cost` of budget {b}, each within 10% of it)',
                lambda res, b=b, other=other: _difference(
                    equal_cost_row(res, b, 'mita'), equal_cost_row(res, b, other)),
                lambda v: v > 0))
    pairs = [(M, k0, M, k1) for M in Ms for k0, k1 in zip(ks, ks[1:])
             if (M, k0) in grid and (M, k1) in grid]
    pairs += [(M0, k, M1, k) for k in ks for M0, M1 in zip(Ms, Ms[1:])
              if (M0, k) in grid and (M1, k) in grid]
    for i, (M0, k0, M1, k1) in enumerate(pairs):
        what = (f'M={_grid(M0)}: k={k1} minus k={k0}' if M0 == M1 else
                f'k={k0}: M={_grid(M1)} minus M={_grid(M0)}')
        tests.append(Test(
            4, '' if i else 'more landmarks (larger M) and larger k lose less',
            f'{what}, mIoU > 0 (rows `swap`)',
            lambda res, a=(M0, k0), b=(M1, k1): _difference(_swap(res, *b), _swap(res, *a)),
            lambda v: v > 0))
    tests.append(Test(
        5, 'fine-tuning the swap recovers the accuracy (within a point)',
        f'MiTA M = k = 49 exported and fine-tuned (row `finetune`): {loses} against the '
        "same seed's unswapped model", _finetuned, lambda v: v >= -WITHIN))
    first = True
    for trained in natives:
        setting = MiTASetting.parse(trained)
        tM, tk = setting.num_experts, setting.topk
        larger = sorted((M, k) for M, k in grid if k == max(ks) and M >= tM and k >= tk
                        and (M, k) != (tM, tk))
        for M, k in larger:
            tests.append(Test(
                6, 'train small, test large: a model trained with small experts gains when '
                'they are enlarged at test time' if first else '',
                f'trained with MiTA {trained}, tested at M={_grid(M)} k={k} minus '
                f'tested as trained, mIoU > 0 (rows `native`)',
                lambda res, trained=trained, M=M, k=k: _native(res, trained, M, k),
                lambda v: v > 0))
            first = False
    tests += [
        Test(7, 'the routed experts prune tokens: many are read by no routed expert, more '
             'in the last layer than the first',
             f'share of tokens in no routed expert at M = k = 49 (each seed\'s token '
             f'selection), in the layer with the fewest: >= {PRUNED_SHARE:.0f}%',
             lambda res: _selection(res, min), lambda v: v >= PRUNED_SHARE, signed=False),
        Test(7, '', 'the same share in the last layer minus the first, points > 0',
             lambda res: _selection(res, lambda s: s[-1] - s[0]), lambda v: v > 0),
    ]
    return tests


def plan_row(res: dict, budget: str, across: bool, images: Optional[int] = None
             ) -> Optional[dict]:
    """A calibrated plan of one model's result.

    Args:
        res (dict): the model's result (an entry of the JSON's ``models``).
        budget (str): the plan's budget as the study spells it (``'7:49'``).
        across (bool): the plan across kinds, else the one among MiTA settings only.
        images (int, optional): calibrated on this many images; None: on the most.

    Returns:
        dict | None: the row, None if the result has none.
    """
    plans = [r for r in res['rows'] if r['kind'] == 'plan' and r['plan']['budget'] == budget
             and bool(r.get(ACROSS)) == across
             and (images is None or r['plan']['images'] == images)]
    return max(plans, key=lambda r: r['plan']['images'], default=None)


def _over_best_uniform(res: dict, budget: str) -> Optional[Measured]:
    """The plan across kinds at ``budget`` minus, seed by seed, the best uniform kind of
    that seed at the budget's cost (rows ``equal-cost`` within its tolerance; ToMe, which no
    plan can take, aside), on the seeds every such kind has; ``rows`` names each seed's
    best."""
    plan = plan_row(res, budget, True)
    uniform = [(r['attention'], _by_seed(r, 'mIoU')) for r in res['rows']
               if r['kind'] == 'equal-cost' and r['budget'] == budget and r['within']
               and r['attention'] != 'tome']
    if plan is None or not uniform:
        return None
    values, best = {}, []
    for seed, v in _by_seed(plan, 'mIoU').items():
        if all(seed in u for _, u in uniform):
            top, kind = max((u[seed], kind) for kind, u in uniform)
            values[seed] = v - top
            best.append(kind)
    return Measured(values, 'best uniform kind by seed: ' + ' / '.join(best))


def _over_mita_plan(res: dict, budget: str) -> Optional[Measured]:
    """The plan across kinds at ``budget`` minus the MiTA-only plan calibrated on as many
    images, seed by seed."""
    across = plan_row(res, budget, True)
    return None if across is None else _difference(
        across, plan_row(res, budget, False, across['plan']['images']))


def plan_tests(results: Sequence[dict]) -> List[Test]:
    """This project's question, not the paper's (its ``claim`` 0): does a calibrated plan
    whose layers may take different kinds beat every uniform kind at equal FLOPs, and the
    plan among MiTA settings only? One pair of tests per budget that is a setting (the
    kinds' equal-cost rows are at settings' costs, not at ToMe's) and that any of
    ``results`` holds a plan across kinds for."""
    budgets = dict.fromkeys(r['plan']['budget'] for res in results for r in res['rows']
                            if r['kind'] == 'plan' and r.get(ACROSS)
                            and r['plan']['budget'] != 'tome')
    tests = []
    for i, b in enumerate(budgets):
        tests += [
            Test(0, '' if i else 'a plan across kinds beats every uniform kind at equal '
                 'FLOPs',
                 f'at the FLOPs of {b}: the calibrated plan across kinds minus the best '
                 f'uniform kind of the same seed (rows `equal-cost` of budget {b}, each within '
                 '10% of it, ToMe aside), mIoU > 0',
                 lambda res, b=b: _over_best_uniform(res, b), lambda v: v > 0),
            Test(0, '', f'at the FLOPs of {b}: the plan across kinds minus the plan among MiTA '
                 f'settings only on as many calibration images (rows `plan` of budget {b}), '
                 'mIoU > 0', lambda res, b=b: _over_mita_plan(res, b), lambda v: v > 0)]
    return tests
