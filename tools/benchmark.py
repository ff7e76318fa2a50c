"""Benchmark MiTA against softmax attention: operator level and model level.

The levels (``--level``): ``op``, the operator against SDPA and the path mmseg's ViT takes
(``--bias``: with BEiT's relative position bias); ``threads``, thread scaling; ``model``,
images per second of mmseg segmenters, mmseg as released, the fast dense model, MiTA and
the bound (attention mixing removed); ``onnx``, a segmenter's ONNX files in ONNX Runtime;
``onnx-op``, one attention layer in ONNX Runtime; ``kinds``, SDPA and each setting (MiTA and
the taxonomy's other kinds) at the operator level. The attention is ``--settings``, spelt as
every tool spells a setting (``7:49``, ``4x6:16``, ``7:49:route``, ``agent:7``...): one MiTA
setting at ``op``, ``threads``, ``model`` and ``onnx-op`` (default ``7:49``), a row per MiTA
setting at ``onnx`` (default ``7:49``), a column per setting of any kind at ``kinds``. What
each level measures, and how, is in :mod:`mita_seg.benchmark` (a module per level); this
script parses the arguments, calls the level and prints its table. The script re-executes
itself with glibc's mmap threshold lowered, so that freed buffers go back to the OS and the
memory peaks are exact.

Examples::

    python tools/benchmark.py --level op
    python tools/benchmark.py --level op --tokens 1025 4097 --dtypes float32 --passes fwd
    python tools/benchmark.py --level op --settings 4:16       # MiTA M = 4x4, k = 16
    python tools/benchmark.py --level model --models segmenter-vit-t
    python tools/benchmark.py --level model --models segmenter-vit-b --images 1024 2048
    python tools/benchmark.py --level op --profile            # + where MiTA's time goes
    python tools/benchmark.py --level model --models segmenter-vit-b --dtype bfloat16
    python tools/benchmark.py --level model --models segmenter-vit-t --compile
    python tools/benchmark.py --level threads --tokens 1025 4097 --dtypes float32
    python tools/benchmark.py --level op --bias --tokens 1025 --dtypes float32
    python tools/benchmark.py --level op --device cuda          # fp16/bf16/fp32, N up to 65537
    python tools/benchmark.py --level onnx --models segmenter-vit-b --onnx-sizes 512 1024
    python tools/benchmark.py --level onnx --models segmenter-vit-b --settings 7:49 4:16
    python tools/benchmark.py --level onnx-op --tokens 1025 4097
    python tools/benchmark.py --level onnx-op --tokens 1025 --profile   # + per operator type
    python tools/benchmark.py --level kinds --tokens 1025 4097 --settings 7:49 agent:7 topk:49
"""
import argparse
import os
import sys
import time

MMAP_ENV = 'MALLOC_MMAP_THRESHOLD_'  # mita_seg.analysis.timing.MMAP_ENV (torch not yet loaded)
if os.environ.get(MMAP_ENV) is None and __name__ == '__main__':
    # Large buffers through mmap, so RSS falls when they are freed and peaks are exact.
    os.environ[MMAP_ENV] = '65536'
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mita_seg.cli import merge_ratio, output_file, run_tool  # noqa: E402
from mita_seg.cli.core import ToolParser, ensure_parent  # noqa: E402
from mita_seg.benchmark import kinds, model, onnx, onnx_op, op, threads  # noqa: E402
from mita_seg.benchmark.common import (DEFAULT_SETTING, MODELS, TokenCountError,  # noqa: E402
                                       grid_side, level_settings)

CPU_ONLY = dict(onnx='times ONNX Runtime on', threads='compares thread counts of')
CPU_ONLY['onnx-op'] = CPU_ONLY['onnx']


def token_count(text):
    """An argparse ``type``: a token count ``N = 1 + s*s``, ``s >= 1``."""
    from mita_seg.cli import int_range
    n = int_range(2)(text)
    try:
        grid_side(n)
    except TokenCountError as e:
        raise argparse.ArgumentTypeError(f'{text!r}: {e}')
    return n


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


def parse_args(argv=None):
    from mita_seg.cli import float_range, int_range, setting_arg
    p = ToolParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--level', choices=['op', 'model', 'threads', 'onnx', 'onnx-op', 'kinds',
                                       'all'],
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
    p.add_argument('--settings', type=setting_arg, nargs='+', metavar='SETTING',
                   default=None,
                   help='the attention, spelt as every tool spells a setting: MiTA 7:49 (pool '
                   '7x7, top-k 49), 4x6:16, 7:49:route (route-only); --level kinds also '
                   'agent:7, block:8:4, topk:49, window:7. --level op, threads, model, '
                   f'onnx-op: one MiTA setting (default: {DEFAULT_SETTING}); --level onnx: a '
                   f'row per MiTA setting (default: {DEFAULT_SETTING}); --level kinds: a column '
                   f'per setting (default: {" ".join(kinds.DEFAULT_SETTINGS)}). A pool is at '
                   'most the grid side of every --tokens')
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
                   help='seconds of calls per variant of a row, on average (the variants '
                   'in interleaved rounds; medians reported)')
    p.add_argument('--max-onnx-gib', type=float_range(0), default=8.0,
                   help='--level onnx: skip a file where the H x N x N weights of one of its '
                   'dense attention layers exceed this (GiB); --level onnx-op: skip a token '
                   'count where softmax attention\'s do')
    p.add_argument('--max-mmcv-gib', type=float_range(0), default=8.0,
                   help='skip the mmcv path (mmseg as released at the model level) where its '
                   'N x N weights exceed this many GiB')
    p.add_argument('--json', metavar='FILE', type=output_file('--json', ('.json', )),
                   help='also write what was printed as data: the command, the machine (CPU '
                   'and vector units, threads, versions, commit), each level\'s header '
                   'lines and measured rows (written whole at the end)')
    args = p.parse_args(argv)
    try:   # the default, a setting the level takes, a pool that fits the grid
        args.settings = level_settings(args.level, args.settings, args.tokens,
                                       args.onnx_sizes)
    except ValueError as e:
        p.error(str(e))
    cuda = args.device == 'cuda'
    if cuda and not torch.cuda.is_available():
        p.error('--device cuda: torch sees no CUDA device (torch '
                f'{torch.__version__}, built for CUDA {torch.version.cuda}): use --device cpu')
    if cuda and args.level in CPU_ONLY:
        p.error(f'--level {args.level} {CPU_ONLY[args.level]} the CPU: use --device cpu')
    if args.compile and args.level not in ('model', 'all'):
        p.error('--compile adds compiled columns to the model level: use it with --level model '
                'or all')
    if args.profile and (args.bias or args.level in ('threads', 'onnx')
                         or args.device != 'cpu'):
        p.error('--profile measures the fused CPU kernel without a bias, or MiTA\'s ONNX '
                'Runtime graph: use it with --device cpu, --level op/model/all/onnx-op, and '
                'without --bias')
    return args


def show(lines, rows, fmt, record=None):
    """Print a level's header lines, then each row as it is measured; with ``record`` (a
    list), append the level's lines and rows to it."""
    lines = list(lines)
    print('\n'.join(lines), flush=True)
    done = []
    for row in rows:
        print(fmt(row), flush=True)
        done.append(row)
    if record is not None:
        record.append(dict(header=lines, rows=done))


def main(argv=None):
    args = parse_args(argv)
    cuda = args.device == 'cuda'
    args.model_dtypes = args.dtypes or ['float32']
    if args.tokens is None:
        args.tokens = ([1025, 4097] if args.level == 'onnx-op' else
                       [1025, 4097, 16385] + ([65537] if cuda else []))
    if args.dtypes is None:
        args.dtypes = ['float16', 'bfloat16', 'float32'] if cuda else ['float32', 'bfloat16']
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = dict(heads=args.heads, head_dim=args.head_dim, setting=args.settings[0])
    cases = dict(tokens=args.tokens, dtypes=args.dtypes, **shape, device=args.device,
                 min_run_time=args.min_run_time)
    t0 = time.time()
    levels = []
    if args.level in ('op', 'all') and args.bias:
        show(op.op_bias_header(**shape, device=args.device),
             op.op_bias_rows(passes=args.passes, **cases), op.format_op_bias_row, levels)
    elif args.level in ('op', 'all'):
        show(op.op_header(**shape, device=args.device),
             op.op_rows(passes=args.passes, **cases, max_mmcv_gib=args.max_mmcv_gib,
                        profile=args.profile), op.format_op_row, levels)
    if args.level in ('model', 'all'):
        level = model.ModelLevel(
            args.models, args.images, args.model_dtypes, args.device, args.settings[0],
            args.swap_head, args.merge_ratio, args.compile, args.rounds, args.memory,
            args.min_run_time, args.max_mmcv_gib, args.profile)
        show(level.header(), level.rows(), level.format_row, levels)
    if args.level == 'onnx':
        level = onnx.OnnxLevel(
            args.models, args.onnx_sizes, args.settings, args.threads,
            args.swap_head, args.min_run_time, args.max_onnx_gib,
            progress=lambda line: print(line, file=sys.stderr, flush=True))
        show(onnx.onnx_header(args.threads), level.rows(), onnx.format_onnx_line, levels)
    if args.level == 'onnx-op':
        show(onnx_op.onnx_op_header(**shape, threads=args.threads),
             onnx_op.onnx_op_rows(args.tokens, **shape, threads=args.threads,
                                  min_run_time=args.min_run_time,
                                  max_onnx_gib=args.max_onnx_gib, profile=args.profile),
             onnx_op.format_onnx_op_row, levels)
    if args.level == 'kinds':
        level = kinds.KindsLevel(args.settings, args.heads, args.head_dim, args.device)
        show(level.header(), level.rows(args.tokens, args.dtypes, args.passes,
                                        args.min_run_time), kinds.format_kinds_row, levels)
    if args.level == 'threads':
        show(threads.thread_header(**shape, device=args.device, threads=args.threads),
             threads.thread_rows(**cases, threads=args.threads),
             threads.format_thread_row, levels)
    print(f'# done in {time.time() - t0:.0f} s')
    if args.json:
        write_record(args.json, argv, levels, time.time() - t0)


def write_record(path, argv, levels, seconds):
    """The run as JSON at ``path`` (written whole): the command, when, the machine, the
    seconds and each level's header lines and rows (values JSON cannot hold as text)."""
    import json

    from mita_seg.analysis.timing import machine
    from mita_seg.utils.atomic_files import atomic_write_text
    record = dict(command='python tools/benchmark.py ' + ' '.join(
        sys.argv[1:] if argv is None else argv), finished=time.strftime('%Y-%m-%d %H:%M:%S'),
        seconds=round(seconds, 1), machine=machine(), levels=levels)
    atomic_write_text(json.dumps(record, indent=1, default=str) + '\n', ensure_parent(path))
    print(f'# wrote {path}')


if __name__ == '__main__':
    run_tool(main)
