"""The taxonomy at the operator level (``--level kinds``): SDPA and each setting (MiTA
``7:49``, ``agent:7``, ``block:8:4``, ``topk:49``, ``window:7``...) on the same inputs, so
that each kind's multiply-adds and its time can be set side by side."""
import itertools

import torch
import torch.nn.functional as F

from mita_seg.analysis.timing import interleaved_medians
from mita_seg.ops import attend
from mita_seg.setting import MiTASetting

from .common import (KINDS_SETTINGS, describe, grid_side, mac_ratio, mita_call, random_inputs,
                     timed_call)

__all__ = ['DEFAULT_SETTINGS', 'KindsLevel', 'attention_call', 'format_kinds_row']

# the kinds at settings of about MiTA M = k = 49's attention cost at N = 1025 and less
DEFAULT_SETTINGS = KINDS_SETTINGS


def attention_call(setting, q, k, v, side):
    """A call of ``setting``'s attention on ``q, k, v`` (``[B, H, 1 + side^2, d]``: cls
    and a square grid), as a swapped module runs it."""
    if not setting.is_mita:
        return lambda: attend(setting, q, k, v, (side, side), 1)
    return lambda: mita_call(setting, q, k, v, side)


class KindsLevel:
    """The kinds level: SDPA and each of ``settings`` (:class:`~mita_seg.setting.MiTASetting`
    or its spelling) on ``heads`` heads of ``head_dim`` on ``device``."""

    def __init__(self, settings, heads, head_dim, device='cpu'):
        self.settings = [MiTASetting.parse(s) if isinstance(s, str) else s for s in settings]
        self.heads, self.head_dim, self.device = heads, head_dim, torch.device(device)

    def header(self):
        """The lines above the table."""
        lines = [
            f'# attention kinds: B=1, H={self.heads}, d={self.head_dim}, cls + a square grid; '
            f'torch {torch.__version__}, {self.device.type} ({describe(self.device)}); '
            'settings: ' + ', '.join(f'{s.text} ({s.label})' for s in self.settings),
            '# ms = median time, the kinds and SDPA in interleaved rounds; vs SDPA = '
            'time(SDPA) / time(kind); MACs = softmax attention\'s multiply-adds / the kind\'s '
            '(its formula, mita_seg.ops.flops), all in this run']
        header = (f"{'N':>6} {'dtype':>8} {'pass':>7} | {'SDPA ms':>9} | "
                  + ' | '.join(f'{s.text:>24}' for s in self.settings))
        return lines + [header, '-' * len(header)]

    def rows(self, tokens, dtypes, passes, min_run_time=1.0):
        """A row (dict) per token count, dtype and pass: ``N``, ``dtype``, ``pass_``,
        ``sdpa`` (seconds) and ``kinds``: per setting ``(seconds, MAC ratio)``."""
        H, d = self.heads, self.head_dim
        for N in tokens:
            side = grid_side(N)
            macs = [mac_ratio(s, H, N, d) for s in self.settings]
            for dtype, pass_ in itertools.product(dtypes, passes):
                q, k, v, grad, _ = random_inputs(H, N, d, self.device, getattr(torch, dtype),
                                                 pass_ == 'fwd+bwd')
                calls = [lambda: F.scaled_dot_product_attention(q, k, v)] + [
                    attention_call(s, q, k, v, side) for s in self.settings]
                sdpa, *times = interleaved_medians(
                    [timed_call(f, pass_, (q, k, v), grad) for f in calls], min_run_time,
                    device=self.device)
                yield dict(N=N, dtype=dtype, pass_=pass_, sdpa=sdpa, kinds=list(zip(times, macs)))


def format_kinds_row(row):
    """A row of :func:`kinds_rows` as printed: per kind ``ms (x vs SDPA, MACs x)``."""
    cells = [f'{t * 1e3:8.2f} ({row["sdpa"] / t:5.2f}x, {m:4.1f}x)'
             for t, m in row['kinds']]
    return (f"{row['N']:>6} {row['dtype']:>8} {row['pass_']:>7} | {row['sdpa'] * 1e3:9.2f} | "
            + ' | '.join(f'{c:>24}' for c in cells))
