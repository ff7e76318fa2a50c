"""Do the kernel's bf16 GEMMs on the matrix units pay? The fused kernel can run its read-out
GEMMs (forward) and routed GEMMs (backward) in bf16 on oneDNN's brgemm
(``MITA_CPU_BF16_GEMM=1``: AMX tiles where the CPU has them) or in float32 on the widened
inputs (``=0``, the default since this measurement: until 55c5631 the tiles ran by default on
AMX). This times both on the same bf16 inputs, called in turn in one process (the kernel
reads the variable on every call), so the host's drift falls on both.

    python docs/experiments/lowp_path_ab.py [--calls 20]

B = 1, H = 12, d = 64, MiTA 7:49, q, k, v views of one packed qkv tensor (as the module makes
them), N = 1025 and 4097, forward and forward+backward, 2 threads; the median of each, and
the forward's phases (``_C.profile``). See docs/benchmark.md, "Where the kernel's bf16 time
goes".
"""
import argparse
import os

import torch

from mita_seg.analysis.timing import interleaved_medians
from mita_seg.benchmark.common import describe
from mita_seg.ops import mita_attention
from mita_seg.ops.fused_cpu import _C

SETTINGS = {'bf16 GEMMs (=1)': '1', 'float32 GEMMs (=0)': '0'}


def call(q, k, v, side, grad, dout):
    out = mita_attention(q, k, v, (side, side), (7, 7), 49, num_prefix_tokens=1,
                         backend='fused_cpu')
    if grad:
        torch.autograd.grad(out, (q, k, v), dout)


def set_path(value):
    os.environ.pop('MITA_CPU_BF16_GEMM', None)
    if value is not None:
        os.environ['MITA_CPU_BF16_GEMM'] = value


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--calls', type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"# {describe(torch.device('cpu'))}; torch {torch.__version__}")
    for name, value in SETTINGS.items():
        set_path(value)
        print(f'#   {name}: path {_C.lowp_gemm_path(torch.bfloat16)}')
    for N in (1025, 4097):
        side = int((N - 1) ** 0.5)
        g = torch.Generator().manual_seed(0)
        qkv = torch.randn(1, N, 3, 12, 64, generator=g).to(torch.bfloat16)
        dout = torch.randn(1, 12, N, 64, generator=g).to(torch.bfloat16)
        for grad in (False, True):
            x = qkv.clone().requires_grad_(grad)
            q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)                    # [B, H, N, d]
            fns = [lambda value=value: (set_path(value), call(q, k, v, side, grad, dout))
                   for value in SETTINGS.values()]
            with torch.set_grad_enabled(grad):
                times = interleaved_medians(fns, rounds=args.calls)
            med = {n: t * 1e3 for n, t in zip(SETTINGS, times)}
            bf16, fp32 = med.values()
            print(f'N = {N} {"fwd+bwd" if grad else "fwd"}: ' +
                  ', '.join(f'{n} {m:.2f} ms' for n, m in med.items()) +
                  f'; the bf16 GEMMs\' speed-up (float32-GEMM time / bf16-GEMM time) '
                  f'{fp32 / bf16:.3f}x')
            if not grad:
                for name, value in SETTINGS.items():
                    set_path(value)
                    _C.profile(True)
                    for _ in range(5):
                        call(q, k, v, side, False, dout)
                    phases = {n: s / 5 for n, s in _C.profile(False) if s}
                    print(f'   phases, {name}: ' +
                          ', '.join(f'{n} {s * 1e3:.2f}' for n, s in phases.items()))


if __name__ == '__main__':
    main()
