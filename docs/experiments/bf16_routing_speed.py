"""How much faster is the fused kernel with its routing GEMMs in bf16, on the matrix units?
The speed half of issue 57's first lever (docs/experiments/bf16_routing.py measured its
accuracy). The kernel keeps ``S = (R / sqrt(d)) K^T`` (experts phase) and ``Ls = q (R s)^T``
(router phase) in float32; ``bf16_routing_gemms.patch`` (beside this file, against the
kernel of 142e433) runs them on the kernel's bf16 GEMM (oneDNN's brgemm: AMX tiles where the
CPU has them) when ``MITA_CPU_BF16_ROUTING=1``, R rounded to bf16, q and k read as they are.
A measurement, not a feature: the patch is not in the kernel (see docs/benchmark.md, "May
the routing GEMMs run in bf16?").

    git apply docs/experiments/bf16_routing_gemms.patch && python setup.py build_ext --inplace
    python docs/experiments/bf16_routing_speed.py [--calls 30]

One bf16 forward of B = 1, H = 12, d = 64, MiTA 7:49, q, k, v views of one packed qkv tensor
(as the module makes them), N = 1025 and 4097, 2 threads: routing in float32 and in bf16
called in turn, the median of each; and the share of the experts' top-k keys and of the
router's choices the float32 routing also makes, and the phases' times (``_C.profile``).
"""
import argparse
import os

import torch

from mita_seg.analysis.timing import interleaved_medians
from mita_seg.benchmark.common import describe
from mita_seg.ops.fused_cpu import _C


def forward(q, k, v, side, routing):
    os.environ['MITA_CPU_BF16_ROUTING'] = routing
    return _C.mita_forward(q, k, v, side, side, 7, 7, 1, 49, 1, True, 64 ** -0.5, False,
                           None, None, None, 0, 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--calls', type=int, default=30)
    args = parser.parse_args()
    if not hasattr(_C, 'lowp_routing'):
        raise SystemExit('the kernel has no MITA_CPU_BF16_ROUTING: apply '
                         'docs/experiments/bf16_routing_gemms.patch and rebuild (see --help)')
    torch.set_num_threads(2)
    print(f"# {describe(torch.device('cpu'))}; torch {torch.__version__}; bf16 GEMM path: "
          f"{_C.lowp_gemm_path(torch.bfloat16)}")
    for N in (1025, 4097):
        side = int((N - 1) ** 0.5)
        qkv = torch.randn(1, N, 3, 12, 64, generator=torch.Generator().manual_seed(0))
        q, k, v = qkv.to(torch.bfloat16).permute(2, 0, 3, 1, 4)            # [B, H, N, d]
        states = {r: forward(q, k, v, side, r) for r in ('0', '1')}
        keys32, keys16 = states['0'][2], states['1'][2]                   # [BH, M, k]
        kept = sum(len(set(a.tolist()) & set(b.tolist()))
                   for a, b in zip(keys32.flatten(0, 1), keys16.flatten(0, 1)))
        same = (states['0'][3] == states['1'][3]).float().mean().item()
        times = interleaved_medians([lambda r=r: forward(q, k, v, side, r) for r in ('0', '1')],
                                    rounds=args.calls)
        med = {r: t * 1e3 for r, t in zip(('0', '1'), times)}
        phases = {}
        for r in ('0', '1'):
            _C.profile(True)
            for _ in range(5):
                forward(q, k, v, side, r)
            phases[r] = {n: s / 5 for n, s in _C.profile(False) if s}
        print(f'N = {N}: routing float32 {med["0"]:.2f} ms, bf16 {med["1"]:.2f} ms '
              f'({med["0"] / med["1"]:.3f}x); top-k keys kept {kept / keys32.numel():.2%}, '
              f'router choices kept {same:.2%}')
        for r, name in (('0', 'float32'), ('1', 'bf16')):
            print(f'   phases, routing {name}: ' +
                  ', '.join(f'{n} {s * 1e3:.2f}' for n, s in phases[r].items()))


if __name__ == '__main__':
    main()
