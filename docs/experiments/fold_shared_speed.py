"""Is the fused kernel faster with the shared expert read out inside the routed phase?
A lever of issue 57 (cut the kernel's work per row). Today phase 3 (router) computes each
query's shared logits Ls, its softmax, the read-out softmax(Ls) V_R (one [128, M] x [M, d]
GEMM per chunk of queries) and its log-sum-exp, and phase 5 (routed) merges each routed
partial into it (two exponentials, a logarithm and three passes over d per query).
``fold_shared_expert.patch`` (beside this file, against the kernel of c440e9a) keeps Ls in
phase 3 and, when ``MITA_CPU_FOLD_SHARED=1``, gives each query one softmax over its M shared
and K routed logits in phase 5, read out of [V_R; V_e] by one [G, M + K] x [M + K, d] GEMM per
expert: no partial, no merge. (It also takes phase 3's argmax from a vectorised maximum.)
A measurement, not a feature: the patch is not in the kernel (see docs/benchmark.md).

    git apply docs/experiments/fold_shared_expert.patch && python setup.py build_ext --inplace
    python docs/experiments/fold_shared_speed.py [--calls 40] [--dtype bfloat16]

One forward of B = 1, H = 12, d = 64, MiTA 7:49, N = 1025 and 4097, on 1 and 2 threads, in
float32 or with bf16 inputs (computed in float32, the kernel's default): the two layouts
called in turn, the median of each, their largest difference, and the phases' times
(``_C.profile``).
"""
import argparse
import os

import torch

from mita_seg.analysis.timing import interleaved_medians
from mita_seg.benchmark.common import describe
from mita_seg.ops.fused_cpu import _C


def forward(q, k, v, side, fold):
    os.environ['MITA_CPU_FOLD_SHARED'] = fold
    return _C.mita_forward(q, k, v, side, side, 7, 7, 1, 49, 1, True, 64 ** -0.5, False,
                           None, None, None, 0, 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--calls', type=int, default=40)
    parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        print(f"# {describe(torch.device('cpu'))}; torch {torch.__version__}; {args.dtype}")
        for N in (1025, 4097):
            side = int((N - 1) ** 0.5)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, 12, N, 64, generator=g).to(dtype) for _ in range(3))
            outs = {f: forward(q, k, v, side, f)[0] for f in ('0', '1')}
            diff = (outs['0'].float() - outs['1'].float()).abs().max().item()
            if diff == 0:
                raise SystemExit('the two layouts gave the same bits: is the patch applied '
                                 'and the kernel rebuilt? (see --help)')
            times = interleaved_medians(
                [lambda f=f: forward(q, k, v, side, f) for f in ('0', '1')],
                rounds=args.calls)
            med = {f: t * 1e3 for f, t in zip(('0', '1'), times)}
            print(f'{threads} thread(s), N = {N}: today {med["0"]:.2f} ms, folded '
                  f'{med["1"]:.2f} ms (folded {med["0"] / med["1"]:.3f}x as fast); '
                  f'max |diff| {diff:.1e}')
            for f, name in (('0', 'today'), ('1', 'folded')):
                _C.profile(True)
                for _ in range(10):
                    forward(q, k, v, side, f)
                phases = {n: s / 10 for n, s in _C.profile(False) if s}
                print(f'   phases, {name}: ' +
                      ', '.join(f'{n} {s * 1e3:.2f}' for n, s in phases.items()))


if __name__ == '__main__':
    main()
