"""The operator level: MiTA at one setting (a :class:`~mita_seg.setting.MiTASetting`)
against SDPA and mmseg's attention core, the calls of a row timed in interleaved rounds
(``--level op``), or with BEiT's relative position bias (``--level op --bias``)."""
import torch
import torch.nn.functional as F

from mita_seg.analysis.timing import interleaved_medians, peak_memory_rise
from mita_seg.ops import Inputs, RelPosBias, select_backend
from mita_seg.ops.bias import bias_index, table_size

from .common import (describe, format_kernel_profile, grid_side, mac_ratio, mita_call,
                     profiled, random_inputs, timed_call)

__all__ = ['mmcv_attention_core', 'auto_backend', 'op_header', 'op_rows', 'format_op_row',
           'op_bias_header', 'op_bias_rows', 'format_op_bias_row']


def mmcv_attention_core(q, k, v):
    """The attention core of mmseg's ViT layer. mmcv's ``MultiheadAttention`` calls
    ``nn.MultiheadAttention`` with ``need_weights=True``, so torch's
    ``F.multi_head_attention_forward`` runs this (between the projections, which are the
    same for MiTA and are left out here): scaled ``bmm``, softmax, ``bmm``, and the
    head-averaged N x N weights it returns."""
    B, H, N, d = q.shape
    qs, ks, vs = (t.reshape(B * H, N, d) for t in (q, k, v))
    w = torch.softmax(torch.bmm(qs * d ** -0.5, ks.transpose(1, 2)), dim=-1)
    out = torch.bmm(w, vs).view(B, H, N, d)
    return out, w.view(B, H, N, N).mean(dim=1)


def auto_backend(head_dim, topk, device):
    """The MiTA backend ``mita_attention`` selects on ``device`` (a name)."""
    x = torch.empty(1, 1, 1, head_dim, device=torch.device(device))
    return select_backend(Inputs(x, x, x, (1, 1), (1, 1), topk))


def op_header(heads, head_dim, setting, device):
    """The lines above the operator table: what runs, what the columns are, the header."""
    dev = torch.device(device)
    auto = auto_backend(head_dim, setting.topk, dev)
    lines = [
        f'# operator: B=1, H={heads}, d={head_dim}, MiTA {setting.text} ({setting.label}); '
        f'torch {torch.__version__}, {dev.type} '
        f'({describe(dev)}); MiTA = the automatic backend ({auto}), blocked = the plain '
        'PyTorch one',
        '# ms = median time, the alternatives in interleaved rounds; ratio = '
        'time(alternative) / time(MiTA) measured in this run; '
        'MAC ratio = multiply-adds of softmax attention / of MiTA; memory = peak rise '
        f"({'CUDA allocated' if dev.type == 'cuda' else 'RSS'})"]
    header = (f"{'N':>6} {'dtype':>8} {'pass':>7} | {'SDPA ms':>9} {'mmcv ms':>9} "
              f"{'MiTA ms':>9} {'blocked':>9} | {'vs SDPA':>7} {'vs mmcv':>7} "
              f"{'vs blk':>7} {'MACs':>6} | {'SDPA MiB':>8} {'mmcv MiB':>8} "
              f"{'MiTA MiB':>8} {'blk MiB':>8}")
    return lines + [header, '-' * len(header)]


def _op_calls(q, k, v, side, setting):
    """The calls of a row of :func:`op_rows` by alternative: SDPA, mmcv, MiTA, blocked."""
    return {
        'SDPA': lambda: F.scaled_dot_product_attention(q, k, v),
        'mmcv': lambda: mmcv_attention_core(q, k, v)[0],
        'MiTA': lambda: mita_call(setting, q, k, v, side),
        'blocked': lambda: mita_call(setting, q, k, v, side, backend='blocked'),
    }


def _op_cases(tokens, dtypes, passes, heads, head_dim, setting, dev, max_mmcv_gib):
    """The cases of the operator table: ``(N, dtype, pass, MAC ratio, runs)``, ``runs``
    the call of each alternative by name (None where skipped); the inputs live until the
    next case."""
    H, d = heads, head_dim
    for N in tokens:
        side = grid_side(N)
        macs = mac_ratio(setting, H, N, d)
        for dtype in dtypes:
            dt = getattr(torch, dtype)
            for pass_ in passes:
                q, k, v, grad, _ = random_inputs(H, N, d, dev, dt, pass_ == 'fwd+bwd')
                fns = _op_calls(q, k, v, side, setting)
                # the mmcv path holds ~2 H N^2 floats: skip it where that does not fit
                mmcv_bytes = 2 * H * N * N * dt.itemsize * (3 if pass_ == 'fwd+bwd' else 1)
                runs = {}
                for name, f in fns.items():
                    skip = name == 'mmcv' and mmcv_bytes > max_mmcv_gib * 2**30
                    runs[name] = None if skip else timed_call(f, pass_, (q, k, v), grad)
                yield N, dtype, pass_, macs, runs
                del q, k, v, grad, runs, fns, f


def _interleaved(runs, min_run_time, device):
    """Median seconds of each call of ``runs`` (by name; None: skipped, None too), timed in
    interleaved rounds (:func:`~mita_seg.analysis.timing.interleaved_medians`): the
    alternatives of a row see the same load of the host."""
    live = [name for name, run in runs.items() if run is not None]
    medians = interleaved_medians([runs[n] for n in live], min_run_time, device=device)
    return {**dict.fromkeys(runs), **dict(zip(live, medians))}


def op_rows(tokens, dtypes, passes, heads, head_dim, setting, device='cpu',
            min_run_time=1.0, max_mmcv_gib=8.0, profile=False):
    """The operator table, a row (dict) per token count, dtype and pass: ``N``, ``dtype``,
    ``pass``, ``macs`` (softmax attention's multiply-adds over MiTA's), ``times`` and
    ``memory`` (seconds and peak MiB by alternative: SDPA, mmcv, MiTA, blocked; None where
    skipped) and ``kernel`` (``profile`` on the fused CPU backend: :func:`profiled` of
    MiTA's call; else None).

    Memory is measured first, every row, before any timing: after a timing's steady state
    (steady_allocator) glibc keeps memory resident that later peaks would reuse unseen.
    """
    dev = torch.device(device)
    kernel = profile and auto_backend(head_dim, setting.topk, dev) == 'fused_cpu'
    args = (tokens, dtypes, passes, heads, head_dim, setting, dev, max_mmcv_gib)
    peaks = [{name: peak_memory_rise(run, dev)[1] for name, run in runs.items() if run}
             for *_, runs in _op_cases(*args)]
    for (N, dtype, pass_, macs, runs), mems in zip(_op_cases(*args), peaks):
        times = _interleaved(runs, min_run_time, dev)
        yield dict(N=N, dtype=dtype, pass_=pass_, macs=macs, times=times, memory=mems,
                   kernel=profiled(runs['MiTA']) if kernel else None)


def format_op_row(row):
    """A row of :func:`op_rows` as printed (and the kernel's phases on a line below)."""
    times, mems = row['times'], row['memory']
    fmt = lambda t: f'{t * 1e3:9.2f}' if t else f"{'n/a':>9}"  # noqa
    ratio = lambda a: f"{times[a] / times['MiTA']:6.2f}x" if times[a] else \
        f"{'n/a':>7}"  # noqa
    mem = lambda a: f'{mems[a]:8.0f}' if mems.get(a) is not None else \
        f"{'n/a':>8}"  # noqa
    line = (f"{row['N']:>6} {row['dtype']:>8} {row['pass_']:>7} | {fmt(times['SDPA'])} "
            f"{fmt(times['mmcv'])} {fmt(times['MiTA'])} {fmt(times['blocked'])} | "
            f"{ratio('SDPA')} {ratio('mmcv')} {ratio('blocked')} {row['macs']:5.1f}x | "
            f"{mem('SDPA')} {mem('mmcv')} {mem('MiTA')} {mem('blocked')}")
    if row['kernel'] is not None:
        line += '\n' + format_kernel_profile(*row['kernel'])
    return line


def _bias_backends(dev):
    return ['fused_cpu', 'varlen'] if dev.type == 'cpu' else ['varlen']


def op_bias_header(heads, head_dim, setting, device):
    """The lines above the table of :func:`op_bias_rows`."""
    dev = torch.device(device)
    backends = _bias_backends(dev)
    lines = [
        f'# operator with relative position bias: B=1, H={heads}, d={head_dim}, MiTA '
        f'{setting.text} ({setting.label}); torch {torch.__version__}, {dev.type} '
        f'({describe(dev)}); SDPA+B = SDPA with the dense [H, N, N] bias gathered from the '
        'table in each call through a precomputed index (as mmseg\'s BEiTAttention)',
        '# ms = median time, the columns in interleaved rounds; +B = with the bias; overhead = '
        'time(+B) / time(without), vs SDPA+B = time(SDPA+B) / time(MiTA backend +B), all in '
        'this run']
    cols = ['SDPA', 'SDPA+B'] + [n + s for n in backends for s in ('', '+B')]
    header = (f"{'N':>6} {'dtype':>8} {'pass':>7} | " + ' '.join(f'{c:>12}' for c in cols) +
              ' | ' + ' '.join(f"{'ovh ' + c:>14}" for c in ['SDPA'] + backends) + ' | ' +
              ' '.join(f"{'SDPA+B/' + n:>16}" for n in backends))
    return lines + [header, '-' * len(header)]


def _bias_calls(q, k, v, side, table, setting, backends, dt):
    """The calls of a row of :func:`op_bias_rows` by column, each MiTA backend with and
    without the bias, SDPA without it and with the dense bias gathered from ``table``."""
    N, dev = q.shape[2], q.device
    bias = RelPosBias(table, (side, side))
    t = torch.arange(N, device=dev)
    index = bias_index((side, side), t.view(-1, 1), t.view(1, -1))  # mmseg's buffer
    fns = {
        'SDPA': lambda: F.scaled_dot_product_attention(q, k, v),
        'SDPA+B': lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=table[:, index].to(dt)),
    }
    for n in backends:
        fns[n] = lambda n=n: mita_call(setting, q, k, v, side, backend=n)
        fns[n + '+B'] = lambda n=n: mita_call(setting, q, k, v, side, backend=n,
                                              rel_pos_bias=bias)
    return fns


def op_bias_rows(tokens, dtypes, passes, heads, head_dim, setting, device='cpu',
                 min_run_time=1.0):
    """The operator with BEiT's relative position bias: the bias's overhead on each
    implementation, and MiTA against SDPA with the dense bias, all measured in one run. A
    row (dict) per token count, dtype and pass: ``N``, ``dtype``, ``pass``, ``backends``
    (the MiTA backends measured), ``times`` (seconds by column: SDPA, SDPA+B and each
    backend with and without ``+B``). The bias's cost is part of each call (MiTA's landmark
    means, SDPA's gather); in fwd+bwd the table gets a gradient too."""
    H, d, dev = heads, head_dim, torch.device(device)
    backends = _bias_backends(dev)
    for N in tokens:
        side = grid_side(N)
        for dtype in dtypes:
            dt = getattr(torch, dtype)
            for pass_ in passes:
                train = pass_ == 'fwd+bwd'
                q, k, v, grad, g = random_inputs(H, N, d, dev, dt, train)
                # float32 as the model's parameter (BEiT's tables train from zero to ~+-1)
                table = torch.randn(H, table_size((side, side)), generator=g).to(
                    dev).requires_grad_(train)
                fns = _bias_calls(q, k, v, side, table, setting, backends, dt)
                times = _interleaved({
                    name: timed_call(f, pass_, (q, k, v) + ((table, ) if '+B' in name else ()),
                                     grad) for name, f in fns.items()}, min_run_time, dev)
                yield dict(N=N, dtype=dtype, pass_=pass_, backends=backends, times=times)
                del q, k, v, grad, table, fns


def format_op_bias_row(row):
    """A row of :func:`op_bias_rows` as printed."""
    times, backends = row['times'], row['backends']
    cols = ['SDPA', 'SDPA+B'] + [n + s for n in backends for s in ('', '+B')]
    ovh = [times[c + '+B'] / times[c] for c in ['SDPA'] + backends]
    vs = [times['SDPA+B'] / times[n + '+B'] for n in backends]
    return (f"{row['N']:>6} {row['dtype']:>8} {row['pass_']:>7} | " +
            ' '.join(f'{times[c] * 1e3:12.2f}' for c in cols) + ' | ' +
            ' '.join(f'{r:13.2f}x' for r in ovh) + ' | ' +
            ' '.join(f'{r:15.2f}x' for r in vs))
