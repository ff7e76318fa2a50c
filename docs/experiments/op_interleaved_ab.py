"""A/B of the operator level's timing (docs/benchmark.md, "Current figures"): MiTA 7:49 and
SDPA, forward+backward, B=1, H=12, d=64, float32, 2 threads, at N tokens (argv, default 1025
4097), timed alone (torch Timer, 1 s each, as ``--level op`` did before 2026-12-07) and in
interleaved rounds (with SDPA only, and with the four alternatives of the table, as it does
since), twice, in one process.

Run: ``.venv/bin/python docs/experiments/op_interleaved_ab.py 1025 4097``
"""
import os.path as osp
import sys

import torch

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))
from mita_seg.analysis.timing import (cpu_description, interleaved_medians,  # noqa: E402
                                      median_time)
from mita_seg.benchmark.common import grid_side, random_inputs, timed_call  # noqa: E402
from mita_seg.benchmark.op import _op_calls  # noqa: E402
from mita_seg.setting import MiTASetting  # noqa: E402


def main(tokens):
    torch.set_num_threads(2)
    H, d, setting = 12, 64, MiTASetting.parse('7:49')
    print(f'# {cpu_description()}; torch {torch.__version__}, 2 threads; fwd+bwd, float32, '
          'ms (median); ratio = SDPA / MiTA', flush=True)
    for N in tokens:
        q, k, v, grad, _ = random_inputs(H, N, d, torch.device('cpu'), torch.float32, True)
        fns = _op_calls(q, k, v, grid_side(N), setting)
        runs = {n: timed_call(f, 'fwd+bwd', (q, k, v), grad) for n, f in fns.items()}
        for rep in range(2):
            alone = [median_time(runs[n], 1.0) for n in ('SDPA', 'MiTA')]
            pair = interleaved_medians([runs['SDPA'], runs['MiTA']], 1.0)
            four = interleaved_medians([runs[n] for n in ('SDPA', 'mmcv', 'MiTA', 'blocked')],
                                       1.0)
            cells = [(alone[0], alone[1]), (pair[0], pair[1]), (four[0], four[2])]
            print(f'N={N} rep {rep}: ' + ' | '.join(
                f'{name}: SDPA {s * 1e3:.1f} MiTA {m * 1e3:.1f} ({s / m:.2f}x)'
                for name, (s, m) in zip(('alone', 'interleaved with SDPA',
                                         'interleaved, all four'), cells)), flush=True)
        del q, k, v, grad, fns, runs


if __name__ == '__main__':
    main([int(n) for n in sys.argv[1:]] or [1025, 4097])
