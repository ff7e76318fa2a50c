"""Does the bound's layout of ``v`` matter? One ViT-B layer (768 dims, 12 heads) at N = 4097
(64x64 patches and a cls token): MiTA 7:49, the bound reading ``v`` as a strided view of the
q, k, v projection, and the bound reading a contiguous copy of it; float32, then under bf16
autocast; interleaved, median of 7 calls, 2 threads. A measurement, not a feature: see
docs/benchmark.md, "The bf16 bound read v strided".

    python docs/experiments/bound_layout_bf16.py
"""
import copy
import time

import torch
import torch.nn.functional as F
from mmcv.cnn.bricks.transformer import MultiheadAttention

from mita_seg.analysis.bound import NoMixingAttention
from mita_seg.models.attention import MiTAAttention
from mita_seg.setting import MiTASetting


class Strided(NoMixingAttention):
    """The bound as it was: ``v`` read in place."""

    def forward(self, query, **kwargs):
        C = query.shape[-1]
        qkv = F.linear(query, self.attn.in_proj_weight, self.attn.in_proj_bias)
        return query + self.attn.out_proj(qkv[..., 2 * C:])


class Contiguous(NoMixingAttention):
    """``v`` copied before the output projection."""

    def forward(self, query, **kwargs):
        C = query.shape[-1]
        qkv = F.linear(query, self.attn.in_proj_weight, self.attn.in_proj_bias)
        return query + self.attn.out_proj(qkv[..., 2 * C:].contiguous())


def main():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    mha = MultiheadAttention(768, 12, batch_first=True).eval()
    mita = MiTAAttention.from_mmcv(mha, MiTASetting.parse('7:49')).eval()
    strided, contiguous = copy.deepcopy(mita), copy.deepcopy(mita)
    strided.__class__, contiguous.__class__ = Strided, Contiguous
    x = torch.randn(1, 4097, 768)
    fns = {'MiTA': lambda: mita(x, hw_shape=(64, 64), global_tokens=(1, 0)),
           'bound strided': lambda: strided(x), 'bound contiguous': lambda: contiguous(x)}
    for dtype in ('float32', 'bfloat16'):
        times = {k: [] for k in fns}
        with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16,
                                             enabled=dtype == 'bfloat16'):
            for fn in fns.values():
                fn()
            for _ in range(7):
                for k, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t)
        print(dtype, {k: round(sorted(v)[3] * 1e3, 1) for k, v in times.items()}, 'ms')


if __name__ == '__main__':
    main()
