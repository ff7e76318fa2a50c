"""mita_seg.analysis.timing: the timers' bookkeeping, the memory peak and the CPU's
description (the figures are the benchmark's; no time is asserted here)."""
import json
import os
import subprocess
import sys
import time

import pytest

from mita_seg.analysis.timing import (MMAP_ENV, cpu_description, interleaved_medians,
                                      median_time, vector_units)


def test_interleaved_medians_rounds_and_order():
    # rounds < 1 cannot give a median
    with pytest.raises(ValueError, match='rounds must be >= 1'):
        interleaved_medians([lambda: None], rounds=0)
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times = interleaved_medians(fns, rounds=4)
    assert len(times) == 3 and all(t >= 0 for t in times)
    # one warm-up call of each, then one call of each per round, in turn
    assert calls == [0, 1, 2] * 5
    calls.clear()
    interleaved_medians(fns, rounds=2, warmup=False)
    assert calls == [0, 1, 2] * 2


def test_interleaved_medians_runs_until_min_run_time():
    calls = []

    def slow():
        calls.append(0)
        time.sleep(0.05)

    interleaved_medians([slow], min_run_time=0.2, rounds=1, warmup=False)
    assert len(calls) >= 2  # one call of 50 ms does not fill 200 ms


def test_interleaved_medians_pauses_outside_the_timing():
    # a pause before each call (the variant before's threads go idle) is not timed
    stamps = []
    times = interleaved_medians([lambda: stamps.append(time.perf_counter())] * 2, rounds=3,
                                warmup=False, pause=0.05)
    assert len(stamps) == 6 and all(b - a >= 0.05 for a, b in zip(stamps, stamps[1:]))
    assert max(times) < 0.05


def test_median_time_warms_up_and_is_positive():
    calls = []
    t = median_time(lambda: calls.append(0), min_run_time=0.01)
    assert t > 0 and len(calls) > 2


_PEAKS = """
import json, torch
from mita_seg.analysis.timing import peak_memory_rise
out, rise = peak_memory_rise(lambda: float(torch.ones(16 * 2**20).sum()))
_, small = peak_memory_rise(lambda: torch.ones(16).sum())
print(json.dumps([out, rise, small]))
"""


@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason='needs Linux /proc')
@pytest.mark.parametrize('mmap_env', [None, '65536'], ids=['glibc-default', 'benchmark'])
def test_peak_memory_rise_sees_a_large_buffer(tools, mmap_env):
    # In a fresh interpreter, as the benchmark measures (it re-executes itself with the mmap
    # threshold lowered): the state that a long test session leaves in this process's
    # allocator (a CI run once saw 0.0 here, in-process) is not what is under test.
    # 64 MiB is above glibc's largest dynamic mmap threshold (32 MiB): mapped afresh and
    # touched, so the process's peak RSS rises by it during the call.
    env = dict(tools.env)
    env.pop(MMAP_ENV, None)
    if mmap_env:
        env[MMAP_ENV] = mmap_env
    proc = subprocess.run([sys.executable, '-c', _PEAKS], cwd=tools.root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out, rise, small = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == 16 * 2**20
    assert rise is not None and 60 <= rise < 80, rise
    assert small < 30, small


@pytest.mark.parametrize('flags, text', [
    ('fma avx avx2 f16c', 'AVX2, no AVX-512, no AMX'),
    ('avx avx2 avx512f avx512_vnni avx512_bf16', 'AVX-512 (BF16, VNNI), no AMX'),
    ('avx2 avx512f amx_tile amx_bf16 amx_int8', 'AVX-512, AMX (BF16, INT8)'),
    ('sse4_2', 'no AVX, no AVX-512, no AMX'),
], ids=['zen3', 'zen4', 'sapphire-rapids', 'no-avx'])
def test_vector_units(flags, text):
    assert vector_units(flags.split()) == text


def test_cpu_description_names_the_cpus():
    text = cpu_description()
    assert f'{os.cpu_count()} ' in text and 'CPUs' in text, text
    if os.path.exists('/proc/cpuinfo'):
        assert 'AMX' in text, text  # the vector units are said, present or not


def test_core_generation():
    from mita_seg.analysis.timing import _core
    assert _core('AuthenticAMD', 25, 1) == 'Zen 3'
    assert _core('AuthenticAMD', 25, 17) == 'Zen 4'
    assert _core('GenuineIntel', 6, 106) == 'Ice Lake-SP'
    assert _core('GenuineIntel', 6, 143) == 'Sapphire Rapids'
    assert _core('GenuineIntel', 6, 1) is None and _core('Other', 6, 106) is None


def test_timing_imports_no_mm_stack():
    # the study and the benchmark import it before (or without) the mm stack
    code = ('import sys, mita_seg.analysis.timing; '
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mmseg', 'mmengine', 'mmcv')))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == '[]', out


def test_interleaved_medians_budget_is_per_variant_on_average():
    # a fast variant beside a slow one gets as many calls as the slow one: the rounds stop
    # when the calls together fill min_run_time per variant (0.2 s here: at most 4 rounds of
    # 51 ms), not when the fast one alone has run min_run_time (100 rounds of 1 ms)
    calls = []

    def sleeper(name, seconds):
        def call():
            calls.append(name)
            time.sleep(seconds)
        return call

    interleaved_medians([sleeper('slow', 0.05), sleeper('fast', 0.001)], min_run_time=0.1,
                        rounds=1, warmup=False)
    assert calls.count('fast') == calls.count('slow') <= 4, calls
