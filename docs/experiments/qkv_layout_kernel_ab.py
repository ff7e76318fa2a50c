"""The fused kernel (issue 57) on q, k, v as the module makes them, [B, H, N, d] views of one
qkv projection read in place, against the same on [BH, N, d] copies (the layout before), at
ViT-B's N = 4097 (64x64 grid + cls, H = 12, d = 64), M = k = 49, 2 threads: each one's
phases (``_C.profile``, ms per call over 5 calls) and the interleaved medians of the two
kernels and of the three copies the old layout paid. ``python
docs/experiments/qkv_layout_kernel_ab.py ROOT`` (ROOT: the checkout to import); its output
of 2026-12-06 is in docs/benchmark/2026-12-06_zen3_qkv_layout.txt."""
import sys

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

from mita_seg.analysis.timing import interleaved_medians  # noqa: E402
from mita_seg.ops.fused_cpu import _C, profile  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
C, H, s = 768, 12, 64
N, d = 1 + s * s, C // H
qkv = torch.randn(1, N, 3 * C)
q, k, v = qkv.reshape(1, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)   # views
qc, kc, vc = (t.reshape(H, N, d).contiguous() for t in (q, k, v))   # [BH, N, d] copies
args = (s, s, 7, 7, 1, 49, 1, True, 1.0 / d, False, None, None, None, 0, 0)


def strided():
    return _C.mita_forward(q, k, v, *args)


def contig():
    return _C.mita_forward(qc, kc, vc, *args)


def copies():
    return [t.reshape(H, N, d).contiguous() for t in (q, k, v)]


for name, f in (('strided', strided), ('contig', contig)):
    f()
    profile(True)
    for _ in range(5):
        f()
    ph = profile(False)
    print(name, {k[4:]: round(v * 200, 2) for k, v in ph.items() if k.startswith('fwd') and v})
t = interleaved_medians([strided, contig, copies], 0.0, rounds=15)
print('kernel ms: strided %.2f contiguous %.2f; the three copies %.2f'
      % tuple(1e3 * x for x in t))
