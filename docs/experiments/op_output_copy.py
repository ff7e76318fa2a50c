"""The copy the no-gradient custom op no longer makes (issue 57): ``contiguous()`` of the fused
kernel's output, one ViT-B layer's ``[B, H, N, d]`` view of a ``[B, N, H, d]`` tensor at
N = 4097, float32, 2 threads, interleaved with handing the view on (200 rounds).
``python docs/experiments/op_output_copy.py``; its output of 2026-12-06 is in
docs/benchmark/2026-12-06_zen3_op_layout.txt."""
import torch

from mita_seg.analysis.timing import interleaved_medians

torch.set_num_threads(2)
B, H, N, d = 1, 12, 4097, 64
o = torch.randn(B, N, H, d).transpose(1, 2)   # the kernel's output as [B, H, N, d]


def copy_once():
    return o.contiguous()


def hand_on():
    return o


t_copy, t_none = interleaved_medians([copy_once, hand_on], 0.0, rounds=200)
print(f'one [B, N, C] output copy at N = {N}, C = {H * d}, float32: '
      f'{1e3 * (t_copy - t_none):.2f} ms (x 12 layers: {12e3 * (t_copy - t_none):.1f} ms)')
