"""Each attention kind at a given cost (:mod:`mita_seg.analysis.equal_cost`, the taxonomy's
comparison in the study: :mod:`projects.swap_study.kinds`): the calls the MAC counter
records price a swapped model exactly as it counts it, the nearest setting is the nearest
of every candidate, the paper's budget is reachable by compression, block routing and a
window but not by per-query top-k (its scores alone cost n n d), and the study's sweep of
the matched points puts ToMe before the swaps."""
import copy
import itertools

import pytest
import torch

from mita_seg.analysis.equal_cost import (TOLERANCE, cost_of, kind_candidates, setting_at_cost,
                                          setting_at_reduction, settings_near, within)
from mita_seg.setting import MiTASetting

KINDS = ('agent', 'block', 'topk', 'window', 'mita')


@pytest.fixture(scope='module')
def segmenter(tiny_cfg):
    """mmseg's Segmenter ViT-T, narrowed (tests/conftest.py), seeded random weights."""
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    import mita_seg.models  # noqa: F401
    torch.manual_seed(0)
    return MODELS.build(copy.deepcopy(tiny_cfg.model)).eval()


@pytest.mark.parametrize('spec', ['7:49', '2:8', 'agent:3', 'block:2:3', 'topk:5', 'window:3'])
def test_recorded_calls_price_the_model_as_counted(segmenter, spec):
    """Every attention module swapped (head too): the counter's total is the price of its
    calls, for this setting and (re-priced) for any other of the same kind family."""
    from mita_seg import swap_attention
    from mita_seg.analysis.attention_macs import AttentionMacCounter
    model = copy.deepcopy(segmenter)
    swap_attention(model, spec, include_head=True, verbose=False)
    with AttentionMacCounter(model) as counter, torch.no_grad():
        model.backbone(torch.randn(2, 3, 64, 96))   # an 8x12 grid
    setting = MiTASetting.parse(spec)
    assert counter.calls and {c[0] for c in counter.calls} == {(8, 12)}
    assert {c[4] for c in counter.calls} == {2 * model.backbone.layers[0].attn.num_heads}
    assert cost_of(setting, counter.calls) == counter.macs


def test_the_nearest_setting_is_the_nearest_candidate():
    calls = [((6, 9), 55, 16, 1, 4), ((6, 9), 55, 16, 1, 4)]   # two layers, one cls token
    for kind, target in itertools.product(KINDS, (3e5, 1e6, 4e6)):
        got, macs = setting_at_cost(kind, target, calls)
        best = min(abs(cost_of(s, calls) - target) for s in kind_candidates(kind, (6, 9)))
        assert abs(macs - target) == best and cost_of(got, calls) == macs and got.kind == kind


def test_the_paper_budget_per_kind():
    """At N = 1025 (32x32 + cls, d = 32: the study's Segmenter), MiTA M = k = 49's attention
    MACs: compression, block routing and a window reach it within 10%; per-query top-k
    cannot (scoring every key alone costs n n d), its cheapest setting is k = 1."""
    calls = [((32, 32), 1025, 32, 1, 2)] * 4
    budget = MiTASetting.parse('7:49')
    target = cost_of(budget, calls)
    for kind in ('agent', 'block', 'window'):
        setting, macs = setting_at_cost(kind, target, calls)
        assert within(macs, target), (kind, setting.text, macs / target)
    setting, macs = setting_at_cost('topk', target, calls)
    assert setting.text == 'topk:1' and not within(macs, target)
    assert macs > 4 * 1024 * 1024 * 32 * 2 > (1 + TOLERANCE) * target
    assert setting_at_cost('mita', target, calls)[1] == target


def test_settings_near_every_budget():
    """A plan across kinds gets each kind at its setting nearest each budget, each once;
    a budget's own kind is the budget itself."""
    calls = [((32, 32), 1025, 32, 1, 2)] * 4
    budgets = [MiTASetting.parse(b) for b in ('7:49', '4:16', '7:49')]
    got = settings_near(budgets, ('agent', 'block', 'topk', 'mita'), calls)
    want = []
    for b in budgets[:2]:
        want += [setting_at_cost(k, cost_of(b, calls), calls)[0]
                 for k in ('agent', 'block', 'topk')] + [b]
    assert got == list(dict.fromkeys(want))
    assert budgets[0] in got and budgets[1] in got
    assert [s.text for s in got].count('topk:1') == 1   # nearest both budgets: once
    assert settings_near(budgets, (), calls) == []


@pytest.mark.parametrize('reduction', [0.0, 0.2, 0.42, 0.5, 0.9])
@pytest.mark.parametrize('start', [None, 0, 13, 31, 99])
def test_setting_at_reduction_is_the_nearest_in_a_few_counts(reduction, start):
    """The setting whose model FLOPs come nearest a fraction below dense: the nearest of
    every setting (a target beyond either end gives that end), found in a few counts from
    any start; ties go to the cheaper."""
    settings = [MiTASetting(pool_size=p, topk=49) for p in range(1, 33)]
    rest, dense = 3e8, 1e9

    def model_flops(s):
        counted.append(s)
        return rest + 2e5 * s.num_experts + (0 if s.pool_size < 20 else 1e5)   # a step

    counted = []
    got, r, i = setting_at_reduction(settings, reduction, dense, model_flops, start)
    target = (1 - reduction) * dense
    best = min(settings, key=lambda s: (abs(model_flops(s) - target), s.num_experts))
    assert got == best == settings[i]
    assert r == pytest.approx(1 - model_flops(got) / dense)
    counted.clear()
    setting_at_reduction(settings, reduction, dense, model_flops, start)
    assert len(counted) <= 12 < len(settings)


def test_setting_at_reduction_from_a_neighbouring_answer():
    # started where the answer is, it counts the answer and at most its two neighbours
    settings = [MiTASetting(pool_size=p, topk=16) for p in range(1, 33)]
    counted = []

    def model_flops(s):
        counted.append(s.pool_size)
        return 1e8 + 1e6 * s.num_experts

    got, r, i = setting_at_reduction(settings, 0.42, 1e9, model_flops)
    counted.clear()
    assert setting_at_reduction(settings, 0.42, 1e9, model_flops, start=i)[0] == got
    assert got.pool_size in counted and len(counted) <= 3
    assert set(counted) <= {got.pool_size - 1, got.pool_size, got.pool_size + 1}
    # bad input: no settings, a reduction outside [0, 1)
    with pytest.raises(ValueError, match='no settings to search'):
        setting_at_reduction([], 0.42, 1e9, model_flops)
    with pytest.raises(ValueError, match=r'reduction must be in \[0, 1\) \(0.42: 42% fewer '
                       r'FLOPs\), got 42'):
        setting_at_reduction(settings, 42, 1e9, model_flops)


def test_bad_input():
    with pytest.raises(ValueError, match='no swapped attention call'):
        setting_at_cost('agent', 1e6, [])
    with pytest.raises(ValueError, match="attention kind 'dense'"):
        list(kind_candidates('dense', (4, 4)))


def test_kind_points_merge_before_any_swap():
    """The study's sweep of the matched settings: ToMe points first (a swap is not undone
    before a merge), each distinct point once; swap_sweep refuses ToMe after a swap."""
    from mita_seg.apis import swap_sweep
    from mita_seg.apis.sweep import SweepPoint
    from projects.swap_study.kinds import kind_points
    matched = [dict(budget=b, kinds=[dict(attention='mita', setting=b),
                                     dict(attention='topk', setting='topk:1'),
                                     dict(attention='tome', merge_ratio=r)])
               for b, r in (('7:49', 0.3), ('4:16', 0.45))]
    points = kind_points(matched)
    assert [p.method for p in points] == ['baseline', 'tome', 'tome', 'swap', 'swap', 'swap']
    assert [p.setting.text for p in points[3:]] == ['7:49', 'topk:1', '4:16']
    with pytest.raises(ValueError, match='ToMe point r=0.3 comes after a swap'):
        swap_sweep(None, [SweepPoint('baseline'), points[3], points[1]])
