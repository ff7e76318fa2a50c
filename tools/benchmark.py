"""Benchmark MiTA against softmax attention: operator level and model level.

Operator level (``--level op``, ``--device cpu`` or ``cuda``): MiTA (the auto-selected
backend: ``fused_cpu`` on CPU, ``varlen`` on CUDA; and the plain PyTorch ``blocked`` one)
against ``F.scaled_dot_product_attention`` (flash on CUDA) and against the path mmseg's ViT
actually takes (mmcv ``MultiheadAttention`` -> ``nn.MultiheadAttention`` with
``need_weights=True``, which materialises the N x N weights), ViT-B heads (H=12, d=64) by
default, for forward and forward+backward, float32 and bfloat16 (and float16 on CUDA).
Prints median times, the speed-up of MiTA over each alternative measured in the same run,
the multiply-add ratio beside it, and peak memory.

With ``--bias`` the operator level measures BEiT's relative position bias instead
(:class:`mita_seg.ops.RelPosBias`, a random table for the ``s x s`` grid): each MiTA backend
that takes it on the device (``fused_cpu`` and ``varlen`` on CPU) and SDPA with the dense
``[H, N, N]`` bias gathered from the table through a precomputed ``[N, N]`` index as mmseg's
``BEiTAttention`` does, each with and without the bias; the bias's cost is part of each
call (MiTA's landmark means, SDPA's gather), and in fwd+bwd the table gets a gradient too.

Model level (``--level model``): images per second and peak memory of mmseg segmenters
(``mmseg::`` configs, random weights), each ``--images`` a row (``slide``: a 512x683 image
under the config's slide inference over 512 crops; ``S`` or ``HxW``: the whole image at
once), four ways: ``mmseg`` as released (mmcv's attention calls ``nn.MultiheadAttention``
with ``need_weights=True``, which materialises the N x N weights), ``dense``, the fast
dense model a user would run instead (the same attention on PyTorch's fused SDPA path,
``need_weights=False``, and :class:`~mita_seg.models.SlimEncoderDecoder`'s lighter slide
inference: the same results), ``MiTA`` (the fast dense model swapped to MiTA, the encoder
only as the paper unless ``--swap-head``; the header says which layers) and ``bound`` (the
same layers with their attention mixing removed, ``out = v`` with the q, k, v and output
projections kept, :mod:`mita_seg.analysis.bound`: what no attention there can beat).
Every speed-up names its baseline (``MiTA/dense``: MiTA's img/s over the fast dense
model's, the headline); ``MiTA %bnd`` is MiTA/dense over bound/dense. The variants are
timed in turn, a call of each per round (a call takes seconds: timed one after the other,
their ratios carried the host's drift). ``--dtypes bfloat16``: each under
``torch.autocast`` (the float32 model, as CPU serving in bf16 runs it). With
``--merge-ratio R``, token merging (ToMe, ``mita_seg.merge_tokens``) on the fast dense
model is a fifth column. With ``--compile``, the fast dense model and MiTA compiled with
``torch.compile`` (inductor; the backbone's and the decode head's forward, a graph per input
shape, compiled in the warm-up calls) are two more columns, ``MiTA+c/dense+c`` their ratio.
With ``--profile``, MiTA's time is split into the kernel and the rest of its attention (MiTA's
time less the bound's).

ONNX Runtime (``--level onnx``): the same checkpoint exported to ONNX unswapped, swapped to
MiTA at each ``--onnx-settings`` (MiTA as standard ONNX operators, :mod:`mita_seg.ops.onnx`)
and with MiTA's node exported as ``out = v`` (attention removed, projections kept: the bound
no attention in the same graph beats), images per second of each file in ONNX Runtime on
the CPU, timed in turn, whole image at ``--onnx-sizes``, the ratio to the unswapped file,
MiTA's ratio as a share of the bound's, and each file's peak memory (a file is skipped
where the ``H x N x N`` weights of one of its dense attention layers exceed
``--max-onnx-gib``: ViT-B at 2048, the unswapped encoder's 12 GiB, and Segmenter's dense
mask head's 12.2 GiB in the swapped files too unless ``--swap-head``).

One attention layer in ONNX Runtime (``--level onnx-op``): softmax attention (exported from
``F.scaled_dot_product_attention``) and MiTA (:mod:`mita_seg.ops.onnx`), ``--heads`` x
``--head-dim`` at each ``--tokens``, float32, exported alone and timed in turn, MiTA's
speed-up and its largest difference to PyTorch's MiTA on the same inputs: where MiTA's ORT
graph stands against dense attention's, without the rest of a model.

Thread scaling (``--level threads``): SDPA and MiTA's forward on one thread and on
``--threads``, all four timed in turn, with MiTA's ratio to SDPA at each thread count and
its own speed-up over one thread.

Peak memory on CPU is the rise of the process's peak RSS during one call
(``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``), with glibc's mmap
threshold lowered so freed buffers go back to the OS (the script re-executes itself to set
that); on CUDA it is the rise of ``torch.cuda.max_memory_allocated``. Times are taken with
glibc's thresholds where a running process has them
(:func:`mita_seg.analysis.timing.steady_allocator`): buffers below 32 MiB reused, not
page-faulted in afresh on every call. The timers, the memory peak and the CPU's description
are :mod:`mita_seg.analysis.timing`'s.

Examples::

    python tools/benchmark.py --level op
    python tools/benchmark.py --level op --tokens 1025 4097 --dtypes float32 --passes fwd
    python tools/benchmark.py --level model --models segmenter-vit-t
    python tools/benchmark.py --level model --models segmenter-vit-b --images 1024 2048
    python tools/benchmark.py --level model --models segmenter-vit-t --merge-ratio 0.3
    python tools/benchmark.py --level op --threads 1
    python tools/benchmark.py --level op --profile            # + where MiTA's time goes
    python tools/benchmark.py --level model --profile         # + the kernel's share
    python tools/benchmark.py --level model --models segmenter-vit-b --dtype bfloat16
    python tools/benchmark.py --level model --models segmenter-vit-t --compile
    python tools/benchmark.py --level threads --tokens 1025 4097 --dtypes float32
    python tools/benchmark.py --level op --bias --tokens 1025 --dtypes float32
    python tools/benchmark.py --level op --device cuda          # fp16/bf16/fp32, N up to 65537
    python tools/benchmark.py --level onnx --models segmenter-vit-b --onnx-sizes 512 1024
    python tools/benchmark.py --level onnx --models segmenter-vit-b --onnx-settings 7:49 4:16
    python tools/benchmark.py --level onnx-op --tokens 1025 4097
    python tools/benchmark.py --level onnx-op --tokens 1025 --profile   # + per operator type
"""
import argparse
import copy
import gc
import os
import sys
import time

MMAP_ENV = 'MALLOC_MMAP_THRESHOLD_'  # mita_seg.analysis.timing.MMAP_ENV (torch not yet loaded)
if os.environ.get(MMAP_ENV) is None and __name__ == '__main__':
    # Large buffers through mmap, so RSS falls when they are freed and peaks are exact.
    os.environ[MMAP_ENV] = '65536'
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mita_seg.analysis.timing import (cpu_description, interleaved_medians,  # noqa: E402
                                      median_time, peak_memory_rise, steady_allocator)
from mita_seg.ops import (Inputs, RelPosBias, attention_flops, mita_attention,  # noqa: E402
                          mita_flops, select_backend)
from mita_seg.ops.bias import bias_index, table_size  # noqa: E402
from mita_seg.apis.token_merge import merge_ratio  # noqa: E402


# name -> config (every one with 16x16 patches)
MODELS = {
    'segmenter-vit-t': 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py',
    'segmenter-vit-s': 'mmseg::segmenter/segmenter_vit-s_mask_8xb1-160k_ade20k-512x512.py',
    'segmenter-vit-b': 'mmseg::segmenter/segmenter_vit-b_mask_8xb1-160k_ade20k-512x512.py',
    'upernet-vit-b': 'mmseg::vit/vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py',
}


def describe(device):
    """The device, in words: the GPU's name, or the CPU (:func:`cpu_description`) and
    torch's thread count."""
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    return f'{cpu_description()}; {torch.get_num_threads()} threads'


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


def timed_call(f, pass_, inputs, grad):
    """What one measurement runs: ``f()`` under no_grad, or ``f()`` and the gradients of
    ``inputs``."""
    if pass_ == 'fwd+bwd':
        return lambda: torch.autograd.grad(f(), inputs, grad)

    def run():
        with torch.no_grad():
            return f()
    return run


def profiled(run, reps=5):
    """Seconds per call of ``run`` and the fused CPU kernel's phases within it (seconds per
    call, each phase's wall time), with the allocator of the timings (steady_allocator)."""
    from mita_seg.ops.fused_cpu import profile
    with steady_allocator():
        run()  # buffers of the steady state
        profile(True)
        try:
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            total = (time.perf_counter() - t0) / reps
        finally:
            phases = profile(False)
    return total, {k: v / reps for k, v in phases.items() if v > 0}


def kernel_profile(run, reps=5):
    """One line: the fused CPU kernel's phases (ms per call, summed over threads' wall
    time of each phase; ``other`` is the rest: Python, dtype conversions, allocation)."""
    total, phases = profiled(run, reps)
    parts = [f'{k} {v * 1e3:.2f}' for k, v in phases.items()]
    other = total - sum(phases.values())
    return f"#   MiTA {total * 1e3:.2f} ms: {', '.join(parts)}, other {other * 1e3:.2f}"


def grid_side(num_tokens):
    """``s`` of ``--tokens`` ``N = 1 + s * s`` (a cls token and an ``s x s`` grid)."""
    side = int(round((num_tokens - 1) ** 0.5))
    if side * side + 1 != num_tokens:
        raise SystemExit(f'--tokens must be 1 + s*s (a cls token and an s x s grid), '
                         f'got {num_tokens}')
    return side


def random_inputs(H, N, d, device, dtype, requires_grad):
    """Seeded ``q, k, v`` ``[1, H, N, d]``, an output gradient, and the generator (for
    further seeded inputs of the same call)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, d, generator=g).to(device, dtype).requires_grad_(
        requires_grad) for _ in range(3))
    grad = torch.randn(1, H, N, d, generator=g).to(device, dtype)
    return q, k, v, grad, g


def op_level(args):
    H, d = args.heads, args.head_dim
    M = args.pool_size ** 2
    dev = torch.device(args.device)
    x = torch.empty(1, 1, 1, d, device=dev)
    auto = select_backend(Inputs(x, x, x, (1, 1), (1, 1), args.topk))
    where = describe(dev)
    print(f'# operator: B=1, H={H}, d={d}, MiTA pool {args.pool_size}x{args.pool_size} '
          f'(M={M}), k={args.topk}; torch {torch.__version__}, {dev.type} ({where}); '
          f'MiTA = the automatic backend ({auto}), blocked = the plain PyTorch one')
    print('# ratio = time(alternative) / time(MiTA) measured in this run; '
          'MAC ratio = multiply-adds of softmax attention / of MiTA; memory = peak rise '
          f"({'CUDA allocated' if dev.type == 'cuda' else 'RSS'})")
    header = (f"{'N':>6} {'dtype':>8} {'pass':>7} | {'SDPA ms':>9} {'mmcv ms':>9} "
              f"{'MiTA ms':>9} {'blocked':>9} | {'vs SDPA':>7} {'vs mmcv':>7} "
              f"{'vs blk':>7} {'MACs':>6} | {'SDPA MiB':>8} {'mmcv MiB':>8} "
              f"{'MiTA MiB':>8} {'blk MiB':>8}")
    print(header)
    print('-' * len(header))
    # Memory first, every row, before any timing: after a timing's steady state
    # (steady_allocator) glibc keeps memory resident that later peaks would reuse unseen.
    peaks = [{name: peak_memory_rise(run, dev)[1] for name, run in runs.items() if run}
             for *_, runs in op_rows(args, dev)]
    for (N, dtype, pass_, macs, runs), mems in zip(op_rows(args, dev), peaks):
        times = {name: median_time(run, args.min_run_time) if run else None
                 for name, run in runs.items()}
        fmt = lambda t: f'{t * 1e3:9.2f}' if t else f"{'n/a':>9}"  # noqa
        ratio = lambda a: f"{times[a] / times['MiTA']:6.2f}x" if times[a] else \
            f"{'n/a':>7}"  # noqa
        mem = lambda a: f'{mems[a]:8.0f}' if mems.get(a) is not None else \
            f"{'n/a':>8}"  # noqa
        print(f"{N:>6} {dtype:>8} {pass_:>7} | {fmt(times['SDPA'])} "
              f"{fmt(times['mmcv'])} {fmt(times['MiTA'])} {fmt(times['blocked'])} | "
              f"{ratio('SDPA')} {ratio('mmcv')} {ratio('blocked')} {macs:5.1f}x | "
              f"{mem('SDPA')} {mem('mmcv')} {mem('MiTA')} {mem('blocked')}", flush=True)
        if args.profile and auto == 'fused_cpu':
            print(kernel_profile(runs['MiTA']), flush=True)


def op_rows(args, dev):
    """The rows of the operator table: ``(N, dtype, pass, MAC ratio, runs)``, ``runs``
    the call of each alternative by name (None where skipped); the inputs live until the
    next row."""
    H, d = args.heads, args.head_dim
    M = args.pool_size ** 2
    for N in args.tokens:
        side = grid_side(N)
        macs = attention_flops(1, H, N, d) / mita_flops(1, H, N, d, M, args.topk)
        for dtype in args.dtypes:
            dt = getattr(torch, dtype)
            for pass_ in args.passes:
                q, k, v, grad, _ = random_inputs(H, N, d, dev, dt, pass_ == 'fwd+bwd')
                fns = {
                    'SDPA': lambda: F.scaled_dot_product_attention(q, k, v),
                    'mmcv': lambda: mmcv_attention_core(q, k, v)[0],
                    'MiTA': lambda: mita_attention(q, k, v, (side, side), args.pool_size,
                                                   args.topk),
                    'blocked': lambda: mita_attention(q, k, v, (side, side), args.pool_size,
                                                      args.topk, backend='blocked'),
                }
                # the mmcv path holds ~2 H N^2 floats: skip it where that does not fit
                mmcv_bytes = 2 * H * N * N * dt.itemsize * (3 if pass_ == 'fwd+bwd' else 1)
                runs = {}
                for name, f in fns.items():
                    skip = name == 'mmcv' and mmcv_bytes > args.max_mmcv_gib * 2**30
                    runs[name] = None if skip else timed_call(f, pass_, (q, k, v), grad)
                yield N, dtype, pass_, macs, runs
                del q, k, v, grad, runs


def thread_scaling(args):
    """``--level threads``: SDPA and MiTA timed in turn on one thread and on ``--threads``
    (all of them in each round, so the host's drift falls on every figure alike): whether
    MiTA's ratio to SDPA holds with more threads."""
    H, d, dev = args.heads, args.head_dim, torch.device(args.device)
    most = args.threads or torch.get_num_threads()
    counts = sorted({1, most})
    print(f'# thread scaling: B=1, H={H}, d={d}, pool {args.pool_size}x{args.pool_size}, '
          f'k={args.topk}, forward, no_grad; {dev.type}; SDPA and MiTA at {counts} threads '
          'timed in turn (a call of each per round)')
    header = (f"{'N':>6} {'dtype':>8} {'threads':>7} | {'SDPA ms':>9} {'MiTA ms':>9} | "
              f"{'vs SDPA':>7} {'MiTA x':>7}")
    print(header)
    print('-' * len(header))

    def on(threads, fn):
        def run():
            torch.set_num_threads(threads)
            fn()
        return run

    for N in args.tokens:
        side = grid_side(N)
        for dtype in args.dtypes:
            q, k, v, _, _ = random_inputs(H, N, d, dev, getattr(torch, dtype), False)
            fns = [lambda: F.scaled_dot_product_attention(q, k, v),
                   lambda: mita_attention(q, k, v, (side, side), args.pool_size, args.topk)]
            runs = [on(t, fn) for t in counts for fn in fns]
            with torch.no_grad():
                times = interleaved_medians(runs, args.min_run_time, rounds=5, device=dev)
            for i, t in enumerate(counts):
                sdpa, mita = times[2 * i], times[2 * i + 1]
                print(f'{N:>6} {dtype:>8} {t:>7} | {sdpa * 1e3:9.2f} {mita * 1e3:9.2f} | '
                      f'{sdpa / mita:6.2f}x {times[1] / mita:6.2f}x', flush=True)
            torch.set_num_threads(most)


def op_bias_level(args):
    """Operator level with BEiT's relative position bias: the bias's overhead on each
    implementation, and MiTA against SDPA with the dense bias, all measured in one run."""
    H, d = args.heads, args.head_dim
    dev = torch.device(args.device)
    backends = ['fused_cpu', 'varlen'] if dev.type == 'cpu' else ['varlen']
    print(f'# operator with relative position bias: B=1, H={H}, d={d}, MiTA pool '
          f'{args.pool_size}x{args.pool_size} (M={args.pool_size ** 2}), k={args.topk}; torch '
          f'{torch.__version__}, {dev.type} ({describe(dev)}); SDPA+B = SDPA with the dense '
          '[H, N, N] bias gathered from the table in each call through a precomputed index '
          '(as mmseg\'s BEiTAttention)')
    print('# ms = median time; +B = with the bias; overhead = time(+B) / time(without), '
          'vs SDPA+B = time(SDPA+B) / time(MiTA backend +B), all in this run')
    cols = ['SDPA', 'SDPA+B'] + [n + s for n in backends for s in ('', '+B')]
    header = (f"{'N':>6} {'dtype':>8} {'pass':>7} | " + ' '.join(f'{c:>12}' for c in cols) +
              ' | ' + ' '.join(f"{'ovh ' + c:>14}" for c in ['SDPA'] + backends) + ' | ' +
              ' '.join(f"{'SDPA+B/' + n:>16}" for n in backends))
    print(header)
    print('-' * len(header))
    for N in args.tokens:
        side = grid_side(N)
        for dtype in args.dtypes:
            dt = getattr(torch, dtype)
            for pass_ in args.passes:
                train = pass_ == 'fwd+bwd'
                q, k, v, grad, g = random_inputs(H, N, d, dev, dt, train)
                # float32 as the model's parameter (BEiT's tables train from zero to ~+-1)
                table = torch.randn(H, table_size((side, side)), generator=g).to(
                    dev).requires_grad_(train)
                bias = RelPosBias(table, (side, side))
                t = torch.arange(N, device=dev)
                index = bias_index((side, side), t.view(-1, 1), t.view(1, -1))  # mmseg's buffer
                fns = {
                    'SDPA': lambda: F.scaled_dot_product_attention(q, k, v),
                    'SDPA+B': lambda: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=table[:, index].to(dt)),
                }
                for n in backends:
                    fns[n] = lambda n=n: mita_attention(q, k, v, (side, side), args.pool_size,
                                                        args.topk, backend=n)
                    fns[n + '+B'] = lambda n=n: mita_attention(
                        q, k, v, (side, side), args.pool_size, args.topk, backend=n,
                        rel_pos_bias=bias)
                times = {}
                for name, f in fns.items():
                    run = timed_call(f, pass_, (q, k, v) + ((table, ) if '+B' in name else ()),
                                     grad)
                    times[name] = median_time(run, args.min_run_time)
                ovh = [times[c + '+B'] / times[c] for c in ['SDPA'] + backends]
                vs = [times['SDPA+B'] / times[n + '+B'] for n in backends]
                print(f'{N:>6} {dtype:>8} {pass_:>7} | ' +
                      ' '.join(f'{times[c] * 1e3:12.2f}' for c in cols) + ' | ' +
                      ' '.join(f'{r:13.2f}x' for r in ovh) + ' | ' +
                      ' '.join(f'{r:15.2f}x' for r in vs), flush=True)
                del q, k, v, grad, table, bias, index


# The model level's columns: (label, what it is). Every one but mmseg runs the lighter
# slide inference and the fused SDPA path in its dense attention layers
# (SlimEncoderDecoder with dense_attn='fast': mmseg's results to float32 rounding).
MODEL_VARIANTS = (
    ('mmseg', 'mmseg as released (EncoderDecoder; mmcv MultiheadAttention calls '
              'nn.MultiheadAttention with need_weights=True: the N x N weights materialised)'),
    ('dense', 'the fast dense model: SlimEncoderDecoder(dense_attn=\'fast\'), the same '
              'attention on PyTorch\'s fused SDPA path (need_weights=False, '
              'mita_seg.models.set_dense_attn) and the lighter slide inference'),
    ('MiTA', 'the fast dense model swapped to MiTA {setting}; what runs: {swapped}'),
    ('bound', 'the fast dense model with the attention mixing of those layers removed (out '
              '= v; q, k, v and output projections kept): what no attention there can beat'),
)
# image label -> (h, w, test mode): slide over the config's 512 crops of an ADE20K-like
# image, or the whole image
SLIDE_IMAGE = (512, 683)


def image_size(text):
    """An argparse ``type`` for ``--images``: ``slide`` (a 512x683 image, the config's 512
    crops slid over it), ``S`` or ``HxW`` (the whole image at once)."""
    if text == 'slide':
        return text
    try:
        h, w = (int(t) for t in (text.split('x') if 'x' in text else (text, text)))
    except ValueError:
        h = w = 0
    if h < 16 or w < 16:
        raise argparse.ArgumentTypeError(
            f'{text!r}: give slide, a size S or HxW of at least 16 (one 16x16 patch), '
            'e.g. 1024 or 512x683')
    return f'{h}x{w}'


def model_level(args):
    from mmengine.config import ConfigDict
    from mmengine.hub import get_config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS as SEG_MODELS
    from mmseg.structures import SegDataSample

    import mita_seg.models  # noqa: F401
    from mita_seg import merge_tokens, swap_attention
    from mita_seg.analysis.bound import remove_attention_mixing
    from mita_seg.models import MITA_DEFAULTS, current_plan, dense_attn_of

    init_default_scope('mmseg')
    dev = torch.device(args.device)
    names = ([v[0] for v in MODEL_VARIANTS] + (['ToMe'] if args.merge_ratio is not None else [])
             + (['dense+c', 'MiTA+c'] if args.compile else []))
    speedups = [('dense/mmseg', 'mmseg', 'dense'), ('MiTA/dense', 'dense', 'MiTA'),
                ('bound/dense', 'dense', 'bound'), ('MiTA/mmseg', 'mmseg', 'MiTA')] + (
        [('ToMe/dense', 'dense', 'ToMe')] if args.merge_ratio is not None else []) + (
        [('dense+c/dense', 'dense', 'dense+c'), ('MiTA+c/dense+c', 'dense+c', 'MiTA+c')]
        if args.compile else [])

    def build(name):  # {variant: model}, the swap plan in words
        cfg = get_config(MODELS[name])
        cfg.model.pop('pretrained', None)
        cfg.model.backbone.pop('init_cfg', None)
        cfg.model.pop('data_preprocessor', None)
        torch.manual_seed(0)
        base = SEG_MODELS.build(cfg.model).eval().to(dev)
        state = base.state_dict()
        models = {'mmseg': base}
        for variant in names[1:]:
            m = SEG_MODELS.build(dict(cfg.model, type='SlimEncoderDecoder',
                                      dense_attn='fast')).eval().to(dev)
            m.load_state_dict(state)            # the same weights in each
            if variant in ('MiTA', 'bound', 'MiTA+c'):
                swap_attention(m, include_head=args.swap_head, pool_size=args.pool_size,
                               topk=args.topk, verbose=False)
            if variant == 'bound':
                remove_attention_mixing(m)
            if variant == 'ToMe':
                merge_tokens(m, args.merge_ratio, verbose=False)
            if variant.endswith('+c'):        # a graph per input shape, no dynamic shapes
                for part in (m.backbone, m.decode_head):
                    part.forward = torch.compile(part.forward, dynamic=False)
            models[variant] = m
        plan = current_plan(models['MiTA']).describe(MITA_DEFAULTS)
        paths = {v: dense_attn_of(m) for v, m in models.items()}  # what each runs
        if paths['mmseg'] != 'mmseg' or paths['dense'] != 'fast':
            raise RuntimeError(f'{name}: the dense attention paths are {paths}; expected '
                               "mmseg's own for mmseg and the fast one for dense")
        return models, plan, cfg.model.test_cfg, cfg.model.backbone.get('patch_size', 16)

    built = {name: build(name) for name in args.models}
    threads = describe(dev)
    print(f'# model level: random weights, batch 1, eval, no_grad; {dev.type} ({threads}); '
          f'torch {torch.__version__}; bfloat16 = the float32 model under torch.autocast')
    for label, what in MODEL_VARIANTS:
        if label == 'MiTA':
            what = what.format(swapped='; '.join(
                f'{name}: {plan}' for name, (_, plan, *_) in built.items()),
                setting=f'(pool {args.pool_size}x{args.pool_size}, k={args.topk}), '
                + ('the mask head too (--swap-head)' if args.swap_head else
                   'the encoder only as the paper (--swap-head: the mask head too)'))
        print(f'# {label} = {what}')
    if args.merge_ratio is not None:
        print(f'# ToMe = the fast dense model with tokens merged at ratio {args.merge_ratio:g} '
              'before each attention and MLP of the ViT layers (mita_seg.merge_tokens)')
    if args.compile:
        print('# dense+c, MiTA+c = dense and MiTA with the forward of the backbone and the '
              'decode head under torch.compile (inductor, dynamic=False; compiled in the '
              'warm-up calls, not timed)')
    print(f'# img/s of each, timed in turn (a call of each per round, the median of at least '
          f'{args.rounds} rounds); a speed-up A/B = img/s of A over B in this run; MiTA %bnd = '
          'MiTA/dense over bound/dense; N = tokens per forward; memory = peak rise (MiB, '
          f"RSS{'' if args.memory else ': not measured, --no-memory'}); n/a: mmseg's N x N "
          'weights over --max-mmcv-gib')
    wide = lambda text, w: max(w, len(text))  # noqa: a column as wide as its name
    header = (f"{'model':>16} {'image':>9} {'mode':>5} {'N':>6} {'dtype':>8} | " +
              ' '.join(f'{n:>8}' for n in names) + ' | ' +
              ' '.join(f'{s[0]:>{wide(s[0], 11)}}' for s in speedups) + f" {'MiTA %bnd':>9} | "
              + ' '.join(f'{n + " MiB":>{wide(n + " MiB", 9)}}' for n in names))
    print(header)
    print('-' * len(header), flush=True)

    def row_calls(name, image, dtype):  # (mode, N, {variant: one predict call})
        models, _, test_cfg, patch = built[name]
        if image == 'slide':
            (h, w), cfg = SLIDE_IMAGE, test_cfg
            crop = test_cfg.get('crop_size', (512, 512))
            n = 1 + -(-crop[0] // patch) * -(-crop[1] // patch)
        else:
            h, w = (int(t) for t in image.split('x'))
            cfg = ConfigDict(mode='whole')
            n = 1 + -(-h // patch) * -(-w // patch)
        g = torch.Generator().manual_seed(0)
        img = torch.randn(1, 3, h, w, generator=g).to(dev)
        meta = [SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w),
                                            pad_shape=(h, w)))]
        dt = getattr(torch, dtype)
        heads = models['mmseg'].backbone.layers[0].attn.num_heads
        calls = {}
        for variant, m in models.items():
            if variant == 'mmseg' and 2 * heads * n * n * 4 > args.max_mmcv_gib * 2**30:
                calls[variant] = None
                continue

            def run(m=m):
                m.test_cfg = cfg
                with torch.autocast(dev.type, dtype=dt, enabled=dt != torch.float32):
                    return m.predict(img, meta)
            calls[variant] = run
        return cfg.get('mode', 'whole'), n, calls

    rows = [(name, image, dtype) for name in args.models for image in args.images
            for dtype in args.model_dtypes]
    with torch.no_grad():
        # memory first, every row, before any timing (see op_level)
        peaks = {}
        for row in rows:
            calls = row_calls(*row)[2]
            peaks[row] = {v: peak_memory_rise(c, dev)[1] if c and args.memory else None
                          for v, c in calls.items()}
        for row in rows:
            name, image, dtype = row
            mode, n, calls = row_calls(*row)
            live = [v for v in names if calls[v]]
            times = dict(zip(live, interleaved_medians([calls[v] for v in live],
                                                       args.min_run_time, rounds=args.rounds,
                                                       device=dev)))
            speed = lambda v: f'{1 / times[v]:8.3g}' if v in times else f"{'n/a':>8}"  # noqa
            ratio = lambda a, b, w: (f'{times[a] / times[b]:{w - 1}.2f}x' if a in times and
                                     b in times else f"{'n/a':>{w}}")  # noqa
            mem = lambda v, w: (f'{peaks[row][v]:{w}.0f}' if peaks[row][v] is not None
                                else f"{'n/a':>{w}}")  # noqa
            print(f'{name:>16} {image:>9} {mode:>5} {n:>6} {dtype:>8} | ' +
                  ' '.join(speed(v) for v in names) + ' | ' +
                  ' '.join(ratio(a, b, wide(s, 11)) for s, a, b in speedups) +
                  f" {100 * times['bound'] / times['MiTA']:8.0f}% | " +
                  ' '.join(mem(v, wide(v + ' MiB', 9)) for v in names), flush=True)
            if args.profile and dev.type == 'cpu':  # the kernel's seconds per image
                mita, bound = times['MiTA'], times['bound']
                kernel = sum(profiled(calls['MiTA'], reps=2)[1].values())
                print(f'#   MiTA {mita:.3f} s per image, bound {bound:.3f} s: MiTA\'s '
                      f'attention {mita - bound:.3f} s, of it {kernel:.3f} s in the kernel and '
                      f'{mita - bound - kernel:.3f} s outside it (projections excluded); with '
                      f"the kernel free MiTA/dense would be {times['dense'] / (mita - kernel):.2f}"
                      'x', flush=True)


def no_mixing_table():
    """A translation of MiTA's node to ``out = v``: the model with its attention mixing
    removed and its projections kept, the bound any attention in the same graph stays
    under (measurement only: not attention)."""
    from onnxscript import opset18 as op

    import mita_seg.ops  # noqa: F401  (registers torch.ops.mita_seg.mita_attention)

    def no_mixing(q, k, v, *args, **kwargs):
        return op.Identity(v)

    return {torch.ops.mita_seg.mita_attention.default: no_mixing}


def onnx_level(args):
    """``--level onnx``: one random-weight checkpoint exported unswapped, swapped to each
    ``--onnx-settings`` and with its attention mixing removed (the bound), all timed in
    turn in ONNX Runtime (median over three interleaved rounds of at least
    ``--min-run-time`` seconds each, a pause before each call so that the sessions' spinning
    threads do not overlap; ORT's memory arena kept where the files' peaks fit in a quarter
    of the memory together),
    with each file's peak memory (one run of a session without ORT's memory arena, so what
    it allocates is given back and the peak is its own). A file is skipped where the
    ``[H, N, N]`` weights of one of its dense attention layers alone exceed
    ``--max-onnx-gib`` (ORT materialises them): the softmax file's encoder, and Segmenter's
    mask head (N - 1 + 150 tokens) unless ``--swap-head``."""
    import tempfile

    import onnxruntime
    from mmengine.hub import get_config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS as SEG_MODELS

    import mita_seg.models  # noqa: F401
    from mita_seg import swap_attention
    from mita_seg.apis.model import physical_memory
    from mita_seg.apis.onnx_export import (SegLogits, dense_attention_weights, onnx_session,
                                           write_onnx)

    init_default_scope('mmseg')
    threads = args.threads or None
    from mita_seg.setting import MiTASetting
    cpu = torch.device('cpu')
    settings = args.onnx_settings or [MiTASetting(args.pool_size, args.topk)]
    print(f'# ONNX Runtime {onnxruntime.__version__} CPU, {threads or "default"} intra-op '
          f'threads, on {cpu_description()}; random weights, batch '
          f'1, whole image; speed-up against softmax attention; "no mixing (bound)": MiTA\'s '
          'node exported as out = v (attention removed, projections kept); "of bound": the '
          'speed-up as a share of the bound\'s; peak: the rise of peak RSS in one run')
    header = (f"{'model':>16} {'image':>10} {'N':>6} {'attention':>18} | {'img/s':>7} "
              f"{'speed-up':>8} {'of bound':>8} | {'peak MiB':>8} | {'max |diff|':>10}")
    print(header)
    print('-' * len(header))
    tmp = tempfile.mkdtemp(prefix='mita-onnx-bench-')
    for name in args.models:
        cfg = get_config(MODELS[name])
        cfg.model.pop('pretrained', None)
        cfg.model.backbone.pop('init_cfg', None)
        cfg.model.test_cfg = dict(mode='whole')
        for size in args.onnx_sizes:
            N = 1 + (size // 16) ** 2
            torch.manual_seed(0)
            model = SEG_MODELS.build(cfg.model).eval()
            variants = [('softmax', model, None)]
            for setting in settings:
                swapped = copy.deepcopy(model)
                swap_attention(swapped, verbose=False, include_head=args.swap_head,
                               **setting.cfg())
                variants.append((f'MiTA {setting.text}', swapped, None))
            variants.append(('no mixing (bound)', swapped, no_mixing_table()))
            kept, sized = [], {}
            for label, m, table in variants:
                # the dense attention layers a forward calls, sized on a copy on the meta
                # device (shapes only, nothing computed); the bound's model is the last
                # MiTA file's, sized once
                if id(m) not in sized:
                    meta = copy.deepcopy(m).to('meta')
                    run = SegLogits(meta, (size, size))
                    with torch.no_grad():
                        sized[id(m)] = dense_attention_weights(
                            meta, lambda: run(torch.zeros(1, 3, size, size, device='meta')))
                    del meta, run
                dense = sized[id(m)]
                # ORT holds a layer's scores and their softmax: the weights are half
                gib = dense[0][1] / 2 / 2**30 if dense else 0.0
                if gib <= args.max_onnx_gib:
                    kept.append((label, m, table))
                    continue
                hint = '' if label == 'softmax' or args.swap_head else ' (--swap-head: MiTA)'
                print(f"{name:>16} {f'{size}x{size}':>10} {N:>6} {label:>18} | skipped: "
                      f'the attention weights of {dense[0][0]}{hint} alone take {gib:.3g} GiB '
                      f'> --max-onnx-gib {args.max_onnx_gib:g}', flush=True)
            variants = kept
            if not variants:
                continue
            img = torch.randn(1, 3, size, size)
            feed = {'img': img.numpy()}
            paths, peaks, base_out, diffs = [], [], None, []
            for i, (label, m, table) in enumerate(variants):
                path = os.path.join(tmp, f'{name}-{size}-{i}.onnx')
                write_onnx(SegLogits(m, (size, size)).eval(), (size, size), path,
                           table=table)
                paths.append(path)
                # memory first, in a session that gives its buffers back after the run
                mem_sess = onnx_session(path, threads, arena=False)
                out, peak = peak_memory_rise(lambda: mem_sess.run(None, feed)[0], cpu)
                del mem_sess
                peaks.append(peak)
                if label == 'softmax':
                    base_out = out
                diffs.append(None if base_out is None else float(abs(base_out - out).max()))
                del out
                print(f'# {name} {size}x{size}: {label} exported and run ({i + 1}/'
                      f'{len(variants)})', file=sys.stderr, flush=True)
            labels = [v[0] for v in variants]
            del model, swapped, variants, base_out
            gc.collect()
            # The timed sessions are alive together (interleaved rounds). ORT's memory arena
            # keeps up to about twice a run's peak between runs: kept where the files' peaks
            # fit in a quarter of the memory together, else every session gives its buffers
            # back after each run.
            total, memory = sum(p or 0.0 for p in peaks), physical_memory()
            arena = not memory or total * 2**20 <= memory / 4
            if not arena:
                print(f'# {name} {size}x{size}: timed without ORT\'s memory arena (the files\' '
                      f'peaks, {total / 1024:.1f} GiB together, exceed a quarter of the '
                      f'{memory / 2**30:.0f} GiB of memory)', flush=True)
            runs = []
            for path in paths:
                sess = onnx_session(path, threads, arena=arena)
                sess.run(None, feed)
                runs.append(lambda sess=sess: sess.run(None, feed))
                os.remove(path)
            print(f'# {name} {size}x{size}: timing {len(paths)} files x 3 rounds',
                  file=sys.stderr, flush=True)
            # interleaved rounds: all see the same load of the host
            # ORT's default sessions, as a user runs one: their intra-op threads spin a while
            # after a run, and would take the cores from the next file's run: a pause first
            medians = interleaved_medians(runs, args.min_run_time, rounds=3, warmup=False,
                                          pause=0.2)
            base = medians[0] if labels[0] == 'softmax' else None
            bound = base / medians[-1] if base else None
            for label, t, peak, diff in zip(labels, medians, peaks, diffs):
                up = f'{base / t:7.2f}x' if base else f"{'n/a':>8}"
                share = (f'{100 * base / t / bound:7.0f}%' if bound and label.startswith('MiTA')
                         else f"{'':>8}")
                mem = f'{peak:8.0f}' if peak is not None else f"{'n/a':>8}"
                dtxt = f'{diff:10.3g}' if diff is not None else f"{'n/a':>10}"
                print(f"{name:>16} {f'{size}x{size}':>10} {N:>6} {label:>18} | "
                      f"{1 / t:7.3f} {up} {share} | {mem} | {dtxt}", flush=True)
            del runs
            gc.collect()
    os.rmdir(tmp)


def onnx_op_level(args):
    """``--level onnx-op``: one attention layer, softmax and MiTA, each exported alone and
    timed in turn in ONNX Runtime (ORT's default sessions, a pause before each call so that
    one session's spinning threads do not take the cores from the other's run)."""
    import tempfile

    import onnxruntime

    from mita_seg.apis.onnx_export import MIN_OPSET, export_module, onnx_session
    from mita_seg.ops.onnx import mita_translation_table

    H, d, P, K = args.heads, args.head_dim, args.pool_size, args.topk
    threads = args.threads or None
    print(f'# one attention layer in ONNX Runtime {onnxruntime.__version__} CPU, '
          f'{threads or "default"} intra-op threads, on {cpu_description()}; B=1, H={H}, '
          f'd={d}, float32, forward; MiTA pool {P}x{P}, k={K} as standard ONNX operators; '
          'speed-up = softmax ms / MiTA ms in this run; max |diff| = ORT\'s MiTA against '
          'PyTorch\'s on the same inputs')
    header = (f"{'N':>6} | {'softmax ms':>10} {'MiTA ms':>9} | {'speed-up':>8} | "
              f"{'max |diff|':>10}")
    print(header)
    print('-' * len(header))

    class Softmax(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    class MiTA(torch.nn.Module):
        def __init__(self, side):
            super().__init__()
            self.side = side

        def forward(self, q, k, v):
            return mita_attention(q, k, v, (self.side, self.side), P, K)

    with tempfile.TemporaryDirectory(prefix='mita-onnx-op-') as tmp:
        for N in args.tokens:
            gib = H * N * N * 4 / 2**30      # the [H, N, N] weights ORT materialises
            if gib > args.max_onnx_gib:
                print(f'{N:>6} | skipped: softmax attention\'s weights take {gib:.1f} GiB > '
                      f'--max-onnx-gib {args.max_onnx_gib:g}', flush=True)
                continue
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, H, N, d) for _ in range(3))
            feed = {'q': q.numpy(), 'k': k.numpy(), 'v': v.numpy()}
            runs, outs, per_call, mita_layer = [], [], [], MiTA(grid_side(N))
            for name, module in (('softmax', Softmax()), ('mita', mita_layer)):
                path = os.path.join(tmp, f'{name}-{N}.onnx')
                export_module(module, (q, k, v), path, MIN_OPSET, mita_translation_table(),
                              ['q', 'k', 'v'], ['out'], f'at N = {N}')
                sess = onnx_session(path, threads)
                outs.append(sess.run(None, feed)[0])
                # a timed call: calls of the layer for 0.2 s at least (the first one after
                # the pause, its threads waking up, must not be the whole measurement)
                t0 = time.perf_counter()
                sess.run(None, feed)
                reps = max(1, int(0.2 / (time.perf_counter() - t0)))
                runs.append(lambda sess=sess, reps=reps: [sess.run(None, feed)
                                                          for _ in range(reps)])
                per_call.append(reps)
            diff = float(abs(outs[1] - mita_layer(q, k, v).numpy()).max())
            soft, mita = (t / r for t, r in zip(
                interleaved_medians(runs, args.min_run_time, rounds=3, warmup=False,
                                    pause=0.2), per_call))
            print(f'{N:>6} | {soft * 1e3:10.2f} {mita * 1e3:9.2f} | {soft / mita:7.2f}x | '
                  f'{diff:10.2g}', flush=True)
            if args.profile:
                path = os.path.join(tmp, f'mita-{N}.onnx')
                print(ort_profile(path, threads, feed, per_call[1], tmp), flush=True)


def ort_profile(path, threads, feed, reps, tmp):
    """One line: where an ONNX file's time goes in ONNX Runtime, per operator type (ORT's
    profiler, ``reps`` runs after one untimed; each type's share of the nodes' summed
    kernel time and ms per run, the largest first, types under 2% as ``other``)."""
    import json

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
    # the first run's nodes are in the file too: (reps + 1) runs
    total = sum(per_type.values())
    parts, other = [], 0
    for op, us in sorted(per_type.items(), key=lambda kv: -kv[1]):
        if us < 0.02 * total:
            other += us
        else:
            parts.append(f'{op} {100 * us / total:.0f}%')
    if other:
        parts.append(f'other {100 * other / total:.0f}%')
    ms = total / (reps + 1) / 1e3
    return f"#   MiTA's nodes {ms:.2f} ms per run: {', '.join(parts)}"


def token_count(text):
    """An argparse ``type``: a token count ``N = 1 + s*s``, ``s >= 1``."""
    from mita_seg.utils.cli import int_range
    n = int_range(2)(text)
    side = int(round((n - 1) ** 0.5))
    if side * side + 1 != n:
        raise argparse.ArgumentTypeError(
            f'{text!r}: give 1 + s*s tokens (a cls token and an s x s grid), e.g. '
            f'{1 + side * side} or {2 + 2 * side + side * side}')
    return n


def parse_args():
    from mita_seg.setting import setting_arg
    from mita_seg.utils.cli import float_range, int_range
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--level', choices=['op', 'model', 'threads', 'onnx', 'onnx-op', 'all'],
                   default='op',
                   help='threads: MiTA against SDPA on 1 and --threads threads, timed in turn; '
                   'onnx-op: one attention layer in ONNX Runtime')
    p.add_argument('--device', default='cpu', choices=['cpu', 'cuda'],
                   help='where the tensors and models live')
    p.add_argument('--tokens', type=token_count, nargs='+', default=None,
                   help='token counts N = 1 + s*s (default: 1025 4097 16385 on CPU, '
                   'and 65537 on CUDA; 1025 4097 at --level onnx-op)')
    p.add_argument('--dtypes', '--dtype', nargs='+', default=None,
                   choices=['float32', 'bfloat16', 'float16'],
                   help='operator level: the inputs\' dtype (default: float32 bfloat16 on '
                   'CPU, float16 bfloat16 float32 on CUDA); model level: float32, or the '
                   'float32 model under torch.autocast to this dtype (default: float32)')
    p.add_argument('--passes', nargs='+', default=['fwd', 'fwd+bwd'],
                   choices=['fwd', 'fwd+bwd'])
    p.add_argument('--heads', type=int_range(1), default=12)
    p.add_argument('--head-dim', type=int_range(1), default=64)
    p.add_argument('--pool-size', type=int_range(1), default=7,
                   help='landmark grid side P (M = P*P), at most the grid side of every '
                   '--tokens')
    p.add_argument('--topk', type=int_range(1), default=49)
    p.add_argument('--merge-ratio', type=merge_ratio, default=None, metavar='R',
                   help='model level: also time token merging (ToMe, mita_seg.merge_tokens) '
                   'at this ratio of the grid tokens, in [0, 0.5]')
    p.add_argument('--models', nargs='+', default=['segmenter-vit-t', 'segmenter-vit-b',
                                                   'upernet-vit-b'], choices=list(MODELS))
    p.add_argument('--images', type=image_size, nargs='+', default=['slide', '1024'],
                   metavar='slide|S|HxW',
                   help='model level: slide (a 512x683 image, the config\'s 512 crops slid '
                   'over it) or a whole image of S x S / H x W, each a row (default: slide '
                   '1024)')
    p.add_argument('--rounds', type=int_range(1), default=3,
                   help='model level: rounds at least (a call of each variant per round)')
    p.add_argument('--no-memory', dest='memory', action='store_false',
                   help='model level: skip the peak memory (two calls of each variant '
                   'before the timing)')
    p.add_argument('--compile', action='store_true',
                   help='model level: also the fast dense model and MiTA under torch.compile '
                        '(inductor), two more columns')
    p.add_argument('--swap-head', action='store_true',
                   help='model and onnx levels: swap Segmenter\'s mask head to MiTA too '
                   '(default: the encoder only, as the paper)')
    p.add_argument('--onnx-sizes', type=int_range(32), nargs='+', default=[512, 1024],
                   help='--level onnx: square image sizes (whole-image inference)')
    p.add_argument('--onnx-settings', type=setting_arg, nargs='+', default=None,
                   metavar='P:K[:route]',
                   help='--level onnx: MiTA settings, each a row (default: --pool-size and '
                   '--topk), e.g. 7:49 4:16 5:16:route')
    p.add_argument('--threads', type=int_range(1), default=None,
                   help='torch threads (default: torch\'s own choice, the number of cores)')
    p.add_argument('--bias', action='store_true',
                   help='operator level: with BEiT\'s relative position bias (each MiTA '
                   'backend that takes it and SDPA with the dense bias, with and without it)')
    p.add_argument('--profile', action='store_true',
                   help='fused CPU backend: under each row, the time of each phase of the '
                   'kernel (operator level), or the kernel\'s share of the swapped model\'s '
                   'time and the speed-up that leaves at most (model level); --level onnx-op: '
                   'MiTA\'s ORT time per operator type (ORT\'s profiler)')
    p.add_argument('--min-run-time', type=float_range(0, low_open=True), default=1.0,
                   help='seconds of repeated calls per measurement (median reported)')
    p.add_argument('--max-onnx-gib', type=float_range(0), default=8.0,
                   help='--level onnx: skip a file where the H x N x N weights of one of its '
                   'dense attention layers exceed this (GiB); --level onnx-op: skip a token '
                   'count where softmax attention\'s do')
    p.add_argument('--max-mmcv-gib', type=float_range(0), default=8.0,
                   help='skip the mmcv path (mmseg as released at the model level) where its '
                   'N x N weights exceed this many GiB')
    args = p.parse_args()
    if args.level == 'onnx':        # every model of MODELS has 16x16 patches
        side = min(args.onnx_sizes) // 16
        pools = ([max(s.pool) for s in args.onnx_settings] if args.onnx_settings
                 else [args.pool_size])
        if max(pools) > side:
            p.error(f'pool size {max(pools)} is larger than the {side}x{side} patch grid of '
                    f'--onnx-sizes {min(args.onnx_sizes)}: give settings with P <= {side} or '
                    f'sizes of at least {16 * max(pools)}')
    elif args.level != 'model':     # default tokens: 1025 (32x32) and more
        small = [n for n in args.tokens or [1025] if grid_side(n) < args.pool_size]
        if small:
            p.error(f'--pool-size {args.pool_size} is larger than the grid of --tokens '
                    f'{small} ({grid_side(small[0])}x{grid_side(small[0])}): give --pool-size '
                    f'<= {min(grid_side(n) for n in args.tokens or [1025])} or more tokens')
    if args.compile and args.level not in ('model', 'all'):
        p.error('--compile adds compiled columns to the model level: use it with --level model '
                'or all')
    if args.profile and (args.bias or args.level in ('threads', 'onnx')
                         or args.device != 'cpu'):
        p.error('--profile measures the fused CPU kernel without a bias, or MiTA\'s ONNX '
                'Runtime graph: use it with --device cpu, --level op/model/all/onnx-op, and '
                'without --bias')
    return args


def main():
    args = parse_args()
    cuda = args.device == 'cuda'
    if cuda and not torch.cuda.is_available():
        raise SystemExit('--device cuda: torch sees no CUDA device '
                         f'(torch {torch.__version__}, built for CUDA {torch.version.cuda})')
    args.model_dtypes = args.dtypes or ['float32']
    if args.tokens is None:
        args.tokens = ([1025, 4097] if args.level == 'onnx-op' else
                       [1025, 4097, 16385] + ([65537] if cuda else []))
    if args.dtypes is None:
        args.dtypes = ['float16', 'bfloat16', 'float32'] if cuda else ['float32', 'bfloat16']
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    if args.level in ('op', 'all'):
        op_bias_level(args) if args.bias else op_level(args)
    if args.level in ('model', 'all'):
        model_level(args)
    if args.level == 'onnx':
        if cuda:
            raise SystemExit('--level onnx times ONNX Runtime on the CPU: use --device cpu')
        onnx_level(args)
    if args.level == 'onnx-op':
        if cuda:
            raise SystemExit('--level onnx-op times ONNX Runtime on the CPU: use --device cpu')
        onnx_op_level(args)
    if args.level == 'threads':
        if cuda:
            raise SystemExit('--level threads compares CPU thread counts: use --device cpu')
        thread_scaling(args)
    print(f'# done in {time.time() - t0:.0f} s')


if __name__ == '__main__':
    main()
