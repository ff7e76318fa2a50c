"""One attention layer in ONNX Runtime (``--level onnx-op``): softmax attention (exported
from ``F.scaled_dot_product_attention``) and MiTA (:mod:`mita_seg.ops.onnx`), ``heads`` x
``head_dim`` at each token count, float32, exported alone and timed in turn, MiTA's
speed-up and its largest difference to PyTorch's MiTA on the same inputs: where MiTA's ORT
graph stands against dense attention's, without the rest of a model."""
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from mita_seg.analysis.timing import cpu_description, interleaved_medians

from .common import grid_side, mita_call

__all__ = ['onnx_op_header', 'onnx_op_rows', 'format_onnx_op_row', 'ort_profile',
           'format_ort_profile']


def onnx_op_header(heads, head_dim, setting, threads=None):
    """The lines above the table of :func:`onnx_op_rows` (MiTA at ``setting``, a
    :class:`~mita_seg.setting.MiTASetting`)."""
    import onnxruntime
    lines = [f'# one attention layer in ONNX Runtime {onnxruntime.__version__} CPU, '
             f'{threads or "default"} intra-op threads, on {cpu_description()}; B=1, '
             f'H={heads}, d={head_dim}, float32, forward; MiTA {setting.text} '
             f'({setting.label}) as standard ONNX operators; speed-up = softmax ms / MiTA ms '
             'in this run; max |diff| = ORT\'s MiTA against PyTorch\'s on the same inputs']
    header = (f"{'N':>6} | {'softmax ms':>10} {'MiTA ms':>9} | {'speed-up':>8} | "
              f"{'max |diff|':>10}")
    return lines + [header, '-' * len(header)]


class _Softmax(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class _MiTA(torch.nn.Module):
    def __init__(self, side, setting):
        super().__init__()
        self.side, self.setting = side, setting

    def forward(self, q, k, v):
        return mita_call(self.setting, q, k, v, self.side)


def _session_run(module, inputs, feed, path, threads, N):
    """``module`` exported alone to ``path`` (in eval mode) and opened in ORT: ``(its
    output, a timed call of it, calls per timed call)``; a timed call is calls of the layer
    for 0.2 s at least (the first one after the pause, its threads waking up, must not be
    the whole measurement)."""
    from mita_seg.apis.onnx_export import MIN_OPSET, export_module, onnx_session
    from mita_seg.ops.onnx import mita_translation_table
    export_module(module.eval(), inputs, path, MIN_OPSET, mita_translation_table(),
                  ['q', 'k', 'v'], ['out'], f'at N = {N}')
    sess = onnx_session(path, threads)
    out = sess.run(None, feed)[0]
    t0 = time.perf_counter()
    sess.run(None, feed)
    reps = max(1, int(0.2 / (time.perf_counter() - t0)))
    return out, lambda: [sess.run(None, feed) for _ in range(reps)], reps


def onnx_op_rows(tokens, heads, head_dim, setting, threads=None, min_run_time=1.0,
                 max_onnx_gib=8.0, profile=False):
    """One attention layer, softmax and MiTA, each exported alone and timed in turn in ONNX
    Runtime (ORT's default sessions, a pause before each call so that one session's
    spinning threads do not take the cores from the other's run). A row (dict) per token
    count: ``N`` and either ``skipped`` (GiB of softmax attention's ``[H, N, N]`` weights,
    over ``max_onnx_gib``) or ``softmax``, ``mita`` (seconds per call), ``diff`` (max
    |ORT's MiTA - PyTorch's|) and ``profile`` (:func:`ort_profile` of MiTA's file, or
    None)."""
    H, d, threads = heads, head_dim, threads or None
    with tempfile.TemporaryDirectory(prefix='mita-onnx-op-') as tmp:
        for N in tokens:
            gib = H * N * N * 4 / 2**30      # the [H, N, N] weights ORT materialises
            if gib > max_onnx_gib:
                yield dict(N=N, skipped=gib, max_gib=max_onnx_gib)
                continue
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, H, N, d) for _ in range(3))
            feed = {'q': q.numpy(), 'k': k.numpy(), 'v': v.numpy()}
            runs, outs, per_call = [], [], []
            mita_layer = _MiTA(grid_side(N), setting)
            for name, module in (('softmax', _Softmax()), ('mita', mita_layer)):
                path = os.path.join(tmp, f'{name}-{N}.onnx')
                out, run, reps = _session_run(module, (q, k, v), feed, path, threads, N)
                outs.append(out)
                runs.append(run)
                per_call.append(reps)
            diff = float(abs(outs[1] - mita_layer(q, k, v).numpy()).max())
            soft, mita = (t / r for t, r in zip(
                interleaved_medians(runs, min_run_time, rounds=3, warmup=False, pause=0.2),
                per_call))
            prof = None
            if profile:
                prof = ort_profile(os.path.join(tmp, f'mita-{N}.onnx'), threads, feed,
                                   per_call[1], tmp)
            yield dict(N=N, softmax=soft, mita=mita, diff=diff, profile=prof)


def format_onnx_op_row(row):
    """A row of :func:`onnx_op_rows` as printed (MiTA's profile on a line below)."""
    N = row['N']
    if 'skipped' in row:
        return (f'{N:>6} | skipped: softmax attention\'s weights take {row["skipped"]:.1f} '
                f'GiB > --max-onnx-gib {row["max_gib"]:g}')
    soft, mita = row['softmax'], row['mita']
    line = (f'{N:>6} | {soft * 1e3:10.2f} {mita * 1e3:9.2f} | {soft / mita:7.2f}x | '
            f'{row["diff"]:10.2g}')
    if row['profile'] is not None:
        line += '\n' + format_ort_profile(*row['profile'])
    return line


def ort_profile(path, threads, feed, reps, tmp):
    """Where an ONNX file's time goes in ONNX Runtime, per operator type (ORT's profiler,
    ``reps`` runs after one untimed): ``({operator type: microseconds of its nodes' kernel
    time}, runs profiled)``, the runs ``reps + 1`` (the first run's nodes are in the
    profile too)."""
    from mita_seg.apis.onnx_export import onnx_session
    sess = onnx_session(path, threads, profile_prefix=os.path.join(tmp, 'profile'))
    sess.run(None, feed)
    for _ in range(reps):
        sess.run(None, feed)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    per_type = {}
    for e in events:
        if e.get('cat') == 'Node' and e['name'].endswith('_kernel_time'):
            op = e.get('args', {}).get('op_name', '?')
            per_type[op] = per_type.get(op, 0) + e['dur']
    return per_type, reps + 1


def format_ort_profile(per_type, runs):
    """One line of :func:`ort_profile`: each operator type's share of the nodes' summed
    kernel time and ms per run, the largest first, types under 2% as ``other``."""
    total = sum(per_type.values())
    parts, other = [], 0
    for op, us in sorted(per_type.items(), key=lambda kv: -kv[1]):
        if us < 0.02 * total:
            other += us
        else:
            parts.append(f'{op} {100 * us / total:.0f}%')
    if other:
        parts.append(f'other {100 * other / total:.0f}%')
    ms = total / runs / 1e3
    return f"#   MiTA's nodes {ms:.2f} ms per run: {', '.join(parts)}"
