"""``tools/benchmark.py`` run as users run it, on sizes that take seconds: each level prints
one row per configuration, with positive times and ratios (the figures themselves are the
benchmark's to report, never asserted here)."""
import re

import pytest


def _rows(out, first):
    """The table rows of ``out`` that start with the value ``first``, split on ``|``."""
    return [[c.split() for c in line.split('|')] for line in out.splitlines()
            if re.match(rf'\s*{first}\s', line)]


def _ratio(cell):
    assert cell.endswith('x'), cell
    value = float(cell[:-1])
    assert value > 0, cell
    return value


def test_op_level(tools):
    _, out = tools('tools/benchmark.py', '--level', 'op', '--tokens', 65, '--dtypes',
                   'float32', '--min-run-time', 0.01, '--profile')
    rows = _rows(out, 65)
    assert [r[0][2] for r in rows] == ['fwd', 'fwd+bwd'], out
    for _, times, ratios, _ in rows:  # N, dtype, pass | times | ratios | memory
        assert all(float(t) > 0 for t in times if t != 'n/a')
        for cell in ratios:
            _ratio(cell)
    assert 'fwd.routed' in out and 'bwd.routed' in out, out  # --profile: the kernel's phases


def test_thread_level(tools):
    _, out = tools('tools/benchmark.py', '--level', 'threads', '--tokens', 65, '--dtypes',
                   'float32', 'bfloat16', '--threads', 2, '--min-run-time', 0.01)
    rows = _rows(out, 65)
    assert [(r[0][1], r[0][2]) for r in rows] == [('float32', '1'), ('float32', '2'),
                                                  ('bfloat16', '1'), ('bfloat16', '2')], out
    for _, times, ratios in rows:  # N, dtype, threads | SDPA, MiTA ms | ratios
        assert all(float(t) > 0 for t in times)
        assert len([_ratio(c) for c in ratios]) == 2
    assert [r[2][1] for r in rows[::2]] == ['1.00x', '1.00x']  # against itself on 1 thread


@pytest.mark.slow
def test_onnx_level(tools):
    # softmax attention, one MiTA setting and the bound, each exported and timed in ORT
    _, out = tools('tools/benchmark.py', '--level', 'onnx', '--models', 'segmenter-vit-t',
                   '--onnx-sizes', 64, '--onnx-settings', '2:8', '--min-run-time', 0.01)
    rows = _rows(out, 'segmenter-vit-t')
    assert [' '.join(r[0][3:]) for r in rows] == ['softmax', 'MiTA 2:8',
                                                   'no mixing (bound)'], out
    # model, image, N, attention | img/s, x (, % of the bound's) | peak MiB | diff
    for _, (speed, ratio, *share), (peak, ), (diff, ) in rows:
        assert float(speed) > 0 and float(peak) >= 0
        _ratio(ratio)
    assert rows[0][1][1] == '1.00x' and rows[0][3] == ['0'], out
    assert rows[1][1][2].endswith('%') and len(rows[2][1]) == 2, out  # MiTA's share
    assert float(rows[1][3][0]) > 0, out  # MiTA is not softmax attention
    # the softmax file skipped where its N x N weights exceed --max-onnx-gib
    _, out = tools('tools/benchmark.py', '--level', 'onnx', '--models', 'segmenter-vit-t',
                   '--onnx-sizes', 64, '--onnx-settings', '2:8', '--min-run-time', 0.01,
                   '--max-onnx-gib', 1e-6)
    rows = _rows(out, 'segmenter-vit-t')
    assert 'skipped' in ' '.join(rows[0][1]) and len(rows) == 3, out
    assert rows[1][1][1] == 'n/a' and rows[1][3] == ['n/a'], out
