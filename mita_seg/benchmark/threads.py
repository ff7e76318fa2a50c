"""Thread scaling (``--level threads``): SDPA and MiTA's forward on one thread and on more,
all timed in turn, with MiTA's ratio to SDPA at each thread count and its own speed-up over
one thread."""
import torch
import torch.nn.functional as F

from mita_seg.analysis.timing import cpu_description, interleaved_medians

from .common import grid_side, mita_call, random_inputs

__all__ = ['thread_counts', 'thread_header', 'thread_rows', 'format_thread_row']


def thread_counts(threads=None):
    """The thread counts compared: one and ``threads`` (None: torch's own count)."""
    return sorted({1, threads or torch.get_num_threads()})


def thread_header(heads, head_dim, setting, device='cpu', threads=None):
    """The lines above the table of :func:`thread_rows` (MiTA at ``setting``, a
    :class:`~mita_seg.setting.MiTASetting`)."""
    dev_type = torch.device(device).type
    lines = [f'# thread scaling: B=1, H={heads}, d={head_dim}, MiTA {setting.text} '
             f'({setting.label}), forward, no_grad; {dev_type} ({cpu_description()}); '
             f'SDPA and MiTA at {thread_counts(threads)} threads timed in turn (a call of each '
             'per round, each on another thread count than the call before it)']
    header = (f"{'N':>6} {'dtype':>8} {'threads':>7} | {'SDPA ms':>9} {'MiTA ms':>9} | "
              f"{'vs SDPA':>7} {'MiTA x':>7}")
    return lines + [header, '-' * len(header)]


def _on(threads, fn):
    def run():
        torch.set_num_threads(threads)
        fn()
    return run


def thread_rows(tokens, dtypes, heads, head_dim, setting, device='cpu', threads=None,
                min_run_time=1.0):
    """SDPA and MiTA timed in turn on one thread and on ``threads`` (all of them in each
    round, so the host's drift falls on every figure alike): whether MiTA's ratio to SDPA
    holds with more threads. A row (dict) per token count, dtype and thread count: ``N``,
    ``dtype``, ``threads``, ``sdpa`` and ``mita`` (seconds), ``mita_one`` (MiTA's seconds
    on one thread). Torch's thread count is ``threads`` again after each row."""
    H, d, dev = heads, head_dim, torch.device(device)
    most = threads or torch.get_num_threads()
    counts = thread_counts(threads)
    for N in tokens:
        side = grid_side(N)
        for dtype in dtypes:
            q, k, v, _, _ = random_inputs(H, N, d, dev, getattr(torch, dtype), False)
            fns = [lambda: F.scaled_dot_product_attention(q, k, v),
                   lambda: mita_call(setting, q, k, v, side)]
            # SDPA on each count, then MiTA on each: with two counts every call follows
            # one on the other count (the switch, the thread team resized in the call's
            # first parallel region, falls on SDPA and MiTA alike), with one none does
            runs = [_on(t, fn) for fn in fns for t in counts]
            with torch.no_grad():
                times = interleaved_medians(runs, min_run_time, rounds=5, device=dev)
            torch.set_num_threads(most)
            n = len(counts)
            for i, t in enumerate(counts):
                yield dict(N=N, dtype=dtype, threads=t, sdpa=times[i], mita=times[n + i],
                           mita_one=times[n])


def format_thread_row(row):
    """A row of :func:`thread_rows` as printed."""
    sdpa, mita = row['sdpa'], row['mita']
    return (f"{row['N']:>6} {row['dtype']:>8} {row['threads']:>7} | {sdpa * 1e3:9.2f} "
            f"{mita * 1e3:9.2f} | {sdpa / mita:6.2f}x {row['mita_one'] / mita:6.2f}x")
