"""The fused CPU kernel's paths on every instruction set this CPU can be held to.

Each row runs a fresh interpreter with the instruction sets capped: oneDNN's
(``ONEDNN_MAX_CPU_ISA``: the bf16/fp16 GEMM kernels it can generate), PyTorch's own
(``ATEN_CPU_CAPABILITY``: the reference's and SDPA's kernels) and the kernel's
(``MITA_CPU_ISA=scalar``: its AVX2 exponential and F16C conversions off). So one machine runs
the paths of the CPUs below it: AVX2 only (AMD Zen 3), AVX-512 without BF16 (Ice Lake),
AVX512-BF16 (AMD Zen 4), AVX512-FP16 and AMX-BF16 (Sapphire Rapids). A row whose instruction
set this CPU lacks skips, naming what is missing.

In each row, for bf16 and fp16 inputs and ``MITA_CPU_BF16_GEMM`` unset, ``0`` and ``1``:
the path chosen passed its probe (the kernel's product of distinct values, checked bit for bit;
a layout that failed is never chosen, however the variable forces it), and the fused forward
and backward on a shape no other test uses agree with the float32 reference within the
dtype's rounding. About 20 s on 2 cores (one interpreter per row).
"""
import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest

from mita_seg.ops.fused_cpu import _C

pytestmark = pytest.mark.skipif(_C is None, reason='the C++ extension mita_seg._C is not built')

# name: (environment, /proc/cpuinfo flags it needs)
ROWS = {
    'as-is': ({}, ()),
    'scalar-kernel': ({'MITA_CPU_ISA': 'scalar', 'ATEN_CPU_CAPABILITY': 'default'}, ()),
    'avx2': ({'ONEDNN_MAX_CPU_ISA': 'AVX2', 'ATEN_CPU_CAPABILITY': 'avx2'}, ('avx2', 'fma')),
    'avx512': ({'ONEDNN_MAX_CPU_ISA': 'AVX512_CORE', 'ATEN_CPU_CAPABILITY': 'avx512'},
               ('avx512f', 'avx512bw', 'avx512vl', 'avx512dq')),
    'avx512-bf16': ({'ONEDNN_MAX_CPU_ISA': 'AVX512_CORE_BF16'}, ('avx512_bf16', )),
    'avx512-fp16': ({'ONEDNN_MAX_CPU_ISA': 'AVX512_CORE_FP16'}, ('avx512_bf16', 'avx512_fp16')),
    'amx-bf16': ({'ONEDNN_MAX_CPU_ISA': 'AVX512_CORE_AMX'}, ('amx_bf16', 'amx_tile')),
}

# Run in the capped interpreter: every (dtype, setting)'s path, the probes, and the errors of
# the fused forward and backward against the float32 reference.
SCRIPT = r'''
import json, os, sys, warnings
import torch
from mita_seg import _C
from mita_seg.ops import Inputs, mita_attention, mita_attention_reference
from mita_seg.ops.fused_cpu import lowp_gemm_path

B, H, h, w, p, s, d, pool, topk, r = 1, 3, 9, 13, 1, 2, 24, (3, 4), 21, 2
N = p + h * w + s
g = torch.Generator().manual_seed(11)
rows = {'has_avx2': _C.has_avx2(), 'has_f16c': _C.has_f16c()}
for dtype in (torch.bfloat16, torch.float16):
    name = str(dtype)[6:]
    # the reference on the rounded values (routed as the kernel routes them)
    q, k, v, dout = (torch.randn(B, H, N, d, generator=g).to(dtype).float() for _ in range(4))
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mita_attention_reference(Inputs(*x, (h, w), pool, topk, r, p))
    ref_grads = torch.autograd.grad(ref, x, dout)
    rows[name] = {'probe': dict(_C.lowp_probe(dtype))}
    for setting in ('unset', '0', '1'):
        os.environ.pop('MITA_CPU_BF16_GEMM', None)
        if setting != 'unset':
            os.environ['MITA_CPU_BF16_GEMM'] = setting
        lowp = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            path = lowp_gemm_path(dtype)
            out = mita_attention(*lowp, (h, w), pool, topk, router_topk=r, num_prefix_tokens=p,
                                 backend='fused_cpu')
        grads = torch.autograd.grad(out, lowp, dout.to(dtype))
        rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()
        rows[name][setting] = {
            'path': path, 'warnings': [str(c.message) for c in caught],
            'out': rel(out, ref), 'grads': max(rel(a, b) for a, b in zip(grads, ref_grads))}
print(json.dumps(rows))
'''


def _cpu_flags():
    if not osp.exists('/proc/cpuinfo'):
        return None
    with open('/proc/cpuinfo') as f:
        m = re.search(r'^flags\s*:(.*)$', f.read(), re.M)
    return set(m.group(1).split()) if m else None


@pytest.mark.parametrize('row', list(ROWS))
def test_kernel_paths_under_capped_instruction_sets(row):
    env_cap, needs = ROWS[row]
    flags = _cpu_flags()
    if needs and flags is None:
        pytest.skip('reads the CPU flags from /proc/cpuinfo')
    missing = [f for f in needs if f not in flags] if needs else []
    if missing:
        pytest.skip(f'this CPU lacks {", ".join(missing)}: the {row} paths cannot run here')
    env = {k: v for k, v in os.environ.items()
           if k not in ('MITA_CPU_BF16_GEMM', 'ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA',
                        'ATEN_CPU_CAPABILITY', 'MITA_CPU_ISA')}
    env.update(env_cap, OMP_NUM_THREADS='2')
    done = subprocess.run([sys.executable, '-c', SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    if row == 'scalar-kernel':
        assert not rows['has_avx2'] and not rows['has_f16c'], 'MITA_CPU_ISA=scalar ignored'
    for name, tol in (('bfloat16', 2e-2), ('float16', 3e-3)):
        res, probe = rows[name], rows[name]['probe']
        assert res['unset']['path'] == 'float32', res['unset']
        assert res['0']['path'] == 'float32'
        for setting in ('unset', '0', '1'):
            path = res[setting]['path']
            if path != 'float32':  # a path runs only if its probe passed
                assert probe[path] == 'ok', (f'{name}, MITA_CPU_BF16_GEMM={setting}: {path} '
                                             f'chosen, its probe said {probe[path]!r}')
            assert res[setting]['out'] <= tol, (name, setting, path, res[setting])
            assert res[setting]['grads'] <= 1.5 * tol, (name, setting, path, res[setting])
        forced = res['1']
        native_ok = [p for p, said in probe.items() if p.startswith('brgemm') and said == 'ok']
        # forced on: the first oneDNN layout that passed, else cpublas, with one warning
        if native_ok:
            assert forced['path'] == native_ok[0] and not forced['warnings'], forced
        else:
            assert forced['path'] in ('cpublas', 'float32'), forced
            assert len(forced['warnings']) == 1 and 'failed its check' in forced['warnings'][0]
            assert '\n' not in forced['warnings'][0]


def test_probe_rejects_a_layout_the_kernel_does_not_read():
    """The probe tells layouts apart: where oneDNN's bf16 kernel runs on interleaved pairs
    of rows (AVX512-BF16 without AMX), the same product with B in plain rows is reported
    wrong, not accepted (a product of ones, the old probe, comes out right in every layout)."""
    probe = dict(_C.lowp_probe(__import__('torch').bfloat16))
    if probe['brgemm-vnni'] != 'ok' or probe['brgemm-packed'] == 'ok':
        pytest.skip(f"oneDNN's bf16 kernel on interleaved rows is not this CPU's path: {probe}")
    assert probe['brgemm-rows'].startswith('wrong results'), probe
