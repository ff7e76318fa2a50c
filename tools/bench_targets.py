"""Issue 57's speed targets on this CPU: run the benchmarks that measure them and print
what each measured against what is asked (the table of docs/benchmark.md, for these records).

The runs (``TARGET_RUNS`` in :mod:`mita_seg.benchmark.docs`): the operator against SDPA
(N = 1025 and 4097, float32 and bf16, forward and forward+backward), Segmenter ViT-B at whole
1024 in float32 and under bf16 autocast, and its ONNX export in ONNX Runtime at 512 and 1024;
each is a ``tools/benchmark.py ... --json`` run whose record is written as
``<out-dir>/<date>_<cpu tag>_<run>.json`` with its console output beside it as ``.txt``.
About 8 minutes on a 2-vCPU AMX Xeon (its records: 83 + 119 + 265 s), 35 on a 2-vCPU Zen 3
(its bf16 emulated).

Usage::

    python tools/bench_targets.py                    # all three runs, then the table
    python tools/bench_targets.py --runs op onnx     # some of them
    python tools/bench_targets.py --dry-run          # the commands, nothing run
    python tools/bench_targets.py --records docs/benchmark/2026-12-06_xeon-amx_*.json

To put new records in docs/benchmark.md, add them to ``CURRENT_RECORDS`` and run
``make bench-docs``.
"""
import os
import os.path as osp
import subprocess
import sys
import time

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, ROOT)

from mita_seg.cli import (InputError, ToolParser, input_file, output_dir,  # noqa: E402
                          python_command, run_tool)

RUNS = ('op', 'vit-b', 'onnx')   # mita_seg.benchmark.docs.TARGET_RUNS (not imported yet)


def parse_args(argv=None):
    parser = ToolParser(description="Measure issue 57's speed targets on this CPU, or print "
                        'them for records already made')
    parser.add_argument('--runs', nargs='+', choices=RUNS, default=list(RUNS),
                        help='the runs to make (default: all)')
    parser.add_argument('--out-dir', type=output_dir('--out-dir'),
                        default=osp.join('docs', 'benchmark'),
                        help='where the records go (default: docs/benchmark)')
    parser.add_argument('--tag', default=None,
                        help="the CPU's part of the file names (default: its core, e.g. "
                        'zen3, xeon-amx)')
    parser.add_argument('--dry-run', action='store_true', help='print the commands only')
    parser.add_argument('--records', nargs='+', type=input_file('record', ('.json', )),
                        help='print the targets of these records; run nothing')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from mita_seg.analysis.timing import cpu_tag
    from mita_seg.benchmark.docs import TARGET_RUNS, read_record, targets_table
    records = args.records
    if records is None:
        stem = osp.join(args.out_dir, f"{time.strftime('%Y-%m-%d')}_{args.tag or cpu_tag()}")
        records = [f'{stem}_{run}.json' for run in args.runs]
        taken = [r for r in records if osp.exists(r)]
        if taken and not args.dry_run:
            raise InputError(f'{", ".join(taken)} exist: give another --tag or --out-dir')
        for run, record in zip(args.runs, records):
            cmd = [osp.join(ROOT, 'tools', 'benchmark.py'), *TARGET_RUNS[run], '--json', record]
            print('$ ' + python_command(*cmd), flush=True)
            if args.dry_run:
                continue
            os.makedirs(args.out_dir, exist_ok=True)
            text = record[:-len('.json')] + '.txt'
            try:   # the output as it comes, the file whole once the run ends
                with open(text + '.part', 'w', encoding='utf-8') as log:
                    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
                    for line in proc.stdout:   # the benchmark's progress, shown and kept
                        print(line, end='', flush=True)
                        log.write(line)
            finally:
                os.replace(text + '.part', text)
            if proc.wait():
                raise InputError(f'the {run} run failed (exit {proc.returncode}): its output '
                                 f'is above and in {record[:-len(".json")]}.txt')
        if args.dry_run:
            return []
    lines = targets_table([(read_record(r), r) for r in records])
    print('\n'.join(lines))
    return lines


if __name__ == '__main__':
    run_tool(main)
