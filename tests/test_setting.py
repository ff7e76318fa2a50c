"""One MiTA setting (:mod:`mita_seg.setting`): the spelling users type, its label, its
config dict and back, the errors (naming the text and showing the spelling), and that the
module loads without torch or the mm stack (tools parse settings before importing them)."""
import subprocess
import sys

import pytest

from mita_seg.cli import setting_arg
from mita_seg.setting import MITA_DEFAULTS, MiTASetting, MiTASettingError, label


def test_spelling_label_and_config():
    s = MiTASetting.parse('7:49')
    assert s == MiTASetting(7, 49) == MiTASetting((7, 7), 49)    # a square pool: its side
    assert (s.text, s.label, s.num_experts) == ('7:49', 'M=7x7 k=49', 49)
    assert s.cfg() == dict(MITA_DEFAULTS, pool_size=7, topk=49)
    r = MiTASetting.parse('4x6:16:route')
    assert r.pool_size == (4, 6) and r.pool == (4, 6) and r.num_experts == 24
    assert not r.with_shared_expert
    assert (r.text, r.label) == ('4x6:16:route', 'M=4x6 k=16 route-only')
    # the spelling reads back, whitespace around it aside
    for text in ('7:49', '4x6:16', '5:16:route', '1:1'):
        assert MiTASetting.parse(f' {text} ').text == text
    # settings the spelling has no place for: key=value in text and label
    x = MiTASetting(7, 49, router_topk=2, shared_scale=0.02)
    assert x.text == '7:49 router_topk=2 shared_scale=0.02'
    assert x.label == 'M=7x7 k=49 router_topk=2 shared_scale=0.02'
    # ... which parse reads back (a tool's line pasted into --settings)
    assert MiTASetting.parse(x.text) == x
    assert MiTASetting.parse('agent:7 shared_scale=0.5') == MiTASetting(
        7, kind='agent', shared_scale=0.5)
    with pytest.raises(MiTASettingError, match="'top_k=2' is not key=value of router_topk or "
                       'shared_scale'):
        MiTASetting.parse('7:49 top_k=2')
    with pytest.raises(MiTASettingError, match='router_topk=two is not a number'):
        MiTASetting.parse('7:49 router_topk=two')
    with pytest.raises(MiTASettingError, match='router_topk is not a setting of window'):
        MiTASetting.parse('window:7 router_topk=2')
    # a config dict and back; settings not given are the defaults
    assert MiTASetting.from_cfg(x.cfg()) == x
    assert MiTASetting.from_cfg(dict(topk=16)) == MiTASetting(7, 16)
    assert MiTASetting.from_cfg(dict(pool_size=[4, 6], topk=8)).pool_size == (4, 6)
    # dense where a list allows it
    assert MiTASetting.parse_or_dense('dense') is None
    assert MiTASetting.parse_or_dense('2:8:route') == MiTASetting(2, 8, with_shared_expert=False)


def test_label_of_a_plan_layer():
    # a plan's layer may give some settings only: the label shows those given
    assert label(None) == 'dense'
    assert label(dict(topk=16)) == 'k=16'
    assert label(dict(pool_size=[2, 3], topk=8, with_shared_expert=False)) == \
        'M=2x3 k=8 route-only'
    assert label(dict(pool_size=4, topk=16, router_topk=1, shared_scale=None)) == 'M=4x4 k=16'
    assert label({}) == 'MiTA (defaults)'


def test_ran_label():
    # as asked, a pool larger than the grid (run on the grid), several grids, k >= N
    assert MiTASetting(4, 8).ran_label() == 'M=4x4 k=8'
    assert MiTASetting(20, 49).ran_label([(16, 16)]) == 'M=16x16 k=49 (asked M=20x20)'
    assert MiTASetting(4, 8).ran_label([(2, 2), (4, 4)], [True, False]) == \
        'M=2x2/4x4 k=8 (every key in some layers) (asked M=4x4)'
    assert MiTASetting(2, 10**5, with_shared_expert=False).ran_label([(2, 2)], [True]) == \
        'M=2x2 k=100000 (every key) route-only'
    assert MiTASetting(4, 8, router_topk=2).ran_label([(4, 4)]) == 'M=4x4 k=8 router_topk=2'


@pytest.mark.parametrize('text', ['7', '7:0', '0:49', '0x3:4', 'x:49', '7:49:shared',
                                  '7:49:route:1', '7:49x', 'dense', '', '7.5:49'])
def test_bad_spelling(text):
    # anything but P:K, PhxPw:K, P:K:route: the message names the text and shows the spelling
    with pytest.raises(MiTASettingError, match=f"MiTA setting {text!r}: write P:K .* e.g. "
                       '7:49, 4x6:16 or 7:49:route'):
        MiTASetting.parse(text)


def test_errors():
    # the old spelling is refused, showing the new one
    with pytest.raises(MiTASettingError, match="'7,49' is the old spelling: write 7:49"):
        MiTASetting.parse('7,49')
    # where dense is allowed, the message says so
    with pytest.raises(MiTASettingError, match='or dense'):
        MiTASetting.parse_or_dense('none')
    # values: the rules of --mita-cfg and the modules
    with pytest.raises(MiTASettingError, match='topk=0: topk must be an int >= 1'):
        MiTASetting(7, 0)
    with pytest.raises(MiTASettingError, match='router_topk=5 is more than the M=4 landmarks'):
        MiTASetting(2, 8, router_topk=5)
    # a dict of swap_attention's other arguments is not a setting
    with pytest.raises(MiTASettingError, match="unknown MiTA setting 'layers'"):
        MiTASetting.from_cfg(dict(topk=8, layers=[0]))
    # argparse's type: a usage error
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="MiTA setting '7,49'"):
        setting_arg('7,49')


def test_no_heavy_imports():
    code = ('import sys, mita_seg.setting as s; s.MiTASetting.parse("7:49"); '
            'print(sorted(m for m in ("torch", "mmseg", "mmengine", "mmcv", "numpy") '
            'if m in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == '[]'


@pytest.mark.parametrize('make', [
    lambda: MiTASetting.parse('agent:7').replace(topk=16),
    lambda: MiTASetting.parse('window:7').replace(pool_size=4),
    lambda: MiTASetting.from_cfg(dict(kind='agent', topk=16)),
    lambda: MiTASetting(kind='block', window=5),
    lambda: MiTASetting().replace(kind='topk', pool_size=3),
], ids=['agent+topk', 'window+pool', 'from_cfg', 'constructor', 'kind-change'])
def test_a_key_the_kind_does_not_read_is_refused(make):
    """Issue 55: a key that the setting's kind does not use is an error naming the key
    and the kind, wherever it enters (one line)."""
    with pytest.raises(MiTASettingError, match=r'^\w+ is not a setting of \w+ attention \('
                       r'[^\n]*reads [^\n]*\): leave \w+ out') as e:
        make()
    assert '\n' not in str(e.value)


def test_every_kind_is_one_record():
    """A kind is its record: spelling, example, label, operator, cost and candidates, and
    the spelling of every kind reads back."""
    import importlib

    from mita_seg.setting import KINDS, MITA, OTHER_KINDS
    assert OTHER_KINDS == tuple(k for k in KINDS if k != MITA)
    for kind in KINDS.values():
        s = MiTASetting.parse(kind.example)
        assert s.kind == kind.name and s.text == kind.example and s.record is kind
        assert MiTASetting.from_cfg(s.cfg()) == s
        module, fn = kind.operator.split(':')
        assert callable(getattr(importlib.import_module(module), fn))
        assert s.attention_macs((8, 8), 65, 16) > 0
        grid = next(iter(kind.candidates((4, 4))))
        assert grid.kind == kind.name
        assert s.fit((2, 2), 5).kind == kind.name


def test_kind_names_are_compared_in_the_registry_only():
    """Issue 55: no ``== 'agent'`` outside the registry: comparisons (==, !=, in) of a
    literal kind name, in the library, the projects and the tools, in at most 2 files."""
    import ast
    from pathlib import Path

    from mita_seg.setting import KINDS, SETTING_KEYS
    root = Path(__file__).resolve().parents[1]
    found = set()
    for path in [p for d in ('mita_seg', 'projects', 'tools') for p in (root / d).rglob('*.py')]:
        text = path.read_text()
        for node in ast.walk(ast.parse(text, str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left] + list(node.comparators)
            literals = [c.value for s in sides
                        for c in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                                  else [s])
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            source = ast.get_source_segment(text, node) or ''
            # a kind compared (not a key that shares a kind's name, as 'topk' in keys)
            if any(v in KINDS and (v not in SETTING_KEYS or 'kind' in source)
                   for v in literals):
                found.add(str(path.relative_to(root)))
    assert len(found) <= 2 and found <= {'mita_seg/setting.py', 'mita_seg/ops/kinds.py'}, found
