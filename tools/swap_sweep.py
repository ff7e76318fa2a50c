"""Sweep MiTA settings on one checkpoint trained with standard attention.

Evaluates the checkpoint unswapped (baseline) and after ``mita_seg.swap_attention`` with every
(pool size, top-k) pair, on the config's test set with mmengine's Runner (the same
pipeline, whole/slide mode and metric as ``tools/test.py``), and writes a CSV and a
markdown table (mIoU and cost per setting) and a plot of mIoU against cost.

Cost: the attention multiply-adds (one MAC = one FLOP, mmengine's convention) of every
global attention layer, counted per image on the first test image(s) as the model actually
runs them (all crops in slide mode), with the analytic counts
``mita_seg.ops.attention_flops`` (``2 N^2 C``) and ``mita_seg.ops.mita_flops`` (the blocked
MiTA implementation). The whole-model count (``model_GFLOPs``: every layer, attention included,
times the crops of the test mode) comes from :mod:`mita_seg.analysis.flops` (a jit trace with
handles for attention and MiTA, same convention).

Usage::

    python tools/swap_sweep.py CONFIG CHECKPOINT --pool-sizes 5 7 --topks 25 49 \\
        [--mita-cfg router_topk=1 with_shared_expert=True] [--layers 0 1 ...] [--no-head] \\
        [--work-dir DIR] [--out DIR/table.md] [--plot DIR/sweep.png] [--cfg-options k=v ...]
"""
import argparse
import csv
import itertools
import os
import os.path as osp
import sys
import time

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch  # noqa: E402
from mmcv.cnn.bricks.transformer import MultiheadAttention  # noqa: E402
from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

from mita_seg.models import MiTAAttention, swap_attention  # noqa: E402  (registers MiTA)
from mita_seg.ops import attention_flops, mita_flops  # noqa: E402
from mita_seg.ops.routing import pair  # noqa: E402
from mita_seg.utils import setup_cpu_distributed  # noqa: E402

FLOP_NOTE = ('attn_GMACs: analytic multiply-adds per image of the global attention layers '
             '(2 N^2 C standard, mita_seg.ops.mita_flops for MiTA), counted on the calls the '
             'model makes; model_GFLOPs: whole model per image (mita_seg.analysis.flops, jit '
             'trace with attention handles, times the test-mode crops); 1 MAC = 1 FLOP')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Sweep MiTA (pool size, top-k) settings '
                                     'on a checkpoint trained with standard attention')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file (standard attention)')
    parser.add_argument('--pool-sizes', type=int, nargs='+', default=[5, 7],
                        help='landmark grid sides P (M = P*P experts)')
    parser.add_argument('--topks', type=int, nargs='+', default=[25, 49],
                        help='keys per routed expert')
    parser.add_argument('--mita-cfg', nargs='+', action=DictAction, default={},
                        help='further swap_attention settings, e.g. router_topk=2 '
                        'with_shared_expert=False')
    parser.add_argument('--layers', type=int, nargs='+', default=None,
                        help='backbone layers to swap (default: all)')
    parser.add_argument('--no-head', action='store_true',
                        help="do not swap Segmenter's mask head")
    parser.add_argument('--flops-images', type=int, default=1,
                        help='test images to count attention MACs on (per-image mean)')
    parser.add_argument('--work-dir', help='directory for logs and outputs')
    parser.add_argument('--out', help='table path; both .md and .csv are written '
                        '(default: WORK_DIR/swap_sweep.md)')
    parser.add_argument('--plot', help='plot path (default: WORK_DIR/swap_sweep.png)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    for key in ('pool_size', 'topk', 'layers', 'include_head', 'verbose'):
        if key in args.mita_cfg:
            raise ValueError(f'--mita-cfg {key}=... is set by the sweep; use --pool-sizes, '
                             '--topks, --layers or --no-head')
    bad = [v for v in args.pool_sizes + args.topks if v < 1]
    if bad:
        raise ValueError(f'--pool-sizes and --topks must be positive, got {bad}')
    return args


class AttentionMacCounter:
    """Counts, while active, the analytic MACs of every global attention call
    (mmcv ``MultiheadAttention`` and :class:`MiTAAttention`) in ``model``."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [m for m in model.modules()
                        if type(m) in (MultiheadAttention, MiTAAttention)]
        self.macs = 0
        self._handles = []

    def __enter__(self):
        self._handles = [m.register_forward_pre_hook(self._count, with_kwargs=True)
                         for m in self.modules]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _count(self, module, args, kwargs):
        query = args[0] if args else kwargs['query']
        N = query.shape[1] if module.batch_first else query.shape[0]
        B = query.shape[0] if module.batch_first else query.shape[1]
        H = module.num_heads
        d = module.embed_dims // H
        if isinstance(module, MiTAAttention):
            ph, pw = pair(module.pool_size, 'pool_size')
            self.macs += mita_flops(B, H, N, d, ph * pw, min(module.topk, N),
                                    module.router_topk, module.with_shared_expert)
        else:
            self.macs += attention_flops(B, H, N, d)


def measure_cost(model, batches):
    """Per-image attention GMACs of ``model`` on ``batches`` (test-mode forward)."""
    images = 0
    with AttentionMacCounter(model) as counter, torch.no_grad():
        for batch in batches:
            model.test_step(batch)
            images += len(batch['inputs'])
    return counter.macs / images / 1e9


def inference_crops(test_cfg, image_shape):
    """``(forwards per image, input shape of each)`` of mmseg's whole/slide inference."""
    H, W = image_shape
    if not test_cfg or test_cfg.get('mode', 'whole') == 'whole':
        return 1, (H, W)
    (hc, wc), (hs, ws) = test_cfg['crop_size'], test_cfg['stride']
    rows = max(H - hc + hs - 1, 0) // hs + 1
    cols = max(W - wc + ws - 1, 0) // ws + 1
    return rows * cols, (min(hc, H), min(wc, W))


def model_gflops(model, batch) -> float:
    """Whole-model GFLOPs (MACs) of the first image of ``batch`` under the model's test
    mode: one traced ``mode='tensor'`` forward per crop
    (:func:`mita_seg.analysis.flops.count_flops`), times the crops."""
    from mita_seg.analysis.flops import count_flops
    x = model.data_preprocessor(batch, False)['inputs'][:1]
    crops, (hc, wc) = inference_crops(getattr(model, 'test_cfg', None), tuple(x.shape[-2:]))
    return crops * count_flops(model, (x[..., :hc, :wc].contiguous(), )).total / 1e9


def write_tables(rows, out_md, note):
    """Write ``rows`` (list of dicts) as markdown and CSV beside it; returns both paths."""
    stem = osp.splitext(out_md)[0]
    out_csv = stem + '.csv'
    out_md = stem + '.md'
    keys = list(rows[0])
    with open(out_csv, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(key, v):
        if not isinstance(v, float):
            return str(v)
        return f'{v:.4g}' if key.endswith(('GMACs', 'GFLOPs')) else f'{v:.2f}'

    lines = ['| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
    lines += ['| ' + ' | '.join(fmt(k, r[k]) for k in keys) + ' |' for r in rows]
    with open(out_md, 'w') as f:
        f.write('\n'.join(lines) + f'\n\n{note}\n')
    return out_md, out_csv


def plot_sweep(rows, out_png, title):
    """mIoU against whole-model GFLOPs and against attention GMACs; one line per pool
    size, the baseline as a star."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    base = rows[0]
    for ax, key, xlabel in ((axes[0], 'model_GFLOPs', 'model GFLOPs per image'),
                            (axes[1], 'attn_GMACs', 'attention GMACs per image')):
        ax.scatter([base[key]], [base['mIoU']], marker='*', s=200, c='k',
                   label=base['setting'], zorder=3)
        for m in sorted({r['M'] for r in rows[1:]}):
            sel = sorted((r for r in rows[1:] if r['M'] == m), key=lambda r: r[key])
            ax.plot([r[key] for r in sel], [r['mIoU'] for r in sel], 'o-', label=f'MiTA M={m}')
            for r in sel:
                ax.annotate(f"k={r['topk']}", (r[key], r['mIoU']), fontsize=7,
                            textcoords='offset points', xytext=(3, 3))
        ax.set_xlabel(f'{xlabel} (1 MAC = 1 FLOP)')
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('mIoU (%)')
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def main(argv=None):
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    cfg.work_dir = args.work_dir or cfg.get('work_dir') or osp.join(
        './work_dirs', 'swap_sweep', osp.splitext(osp.basename(args.config))[0])
    cfg.load_from = args.checkpoint
    cfg.launcher = 'none'
    setup_cpu_distributed(cfg, 'none')
    os.makedirs(cfg.work_dir, exist_ok=True)
    out_md = args.out or osp.join(cfg.work_dir, 'swap_sweep.md')
    out_png = args.plot or osp.join(cfg.work_dir, 'swap_sweep.png')
    for path in (out_md, out_png):
        os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)

    runner = Runner.from_cfg(cfg)
    settings = [None] + list(itertools.product(args.pool_sizes, args.topks))
    batches = list(itertools.islice(iter(runner.test_dataloader), args.flops_images))
    rows = []
    t0 = time.time()
    for i, setting in enumerate(settings):
        if setting is None:
            configured_mita = any(isinstance(m, MiTAAttention) for m in runner.model.modules())
            label = 'baseline (MiTA as configured)' if configured_mita else 'baseline'
        else:
            pool, topk = setting
            swap_attention(runner.model, pool_size=pool, topk=topk, layers=args.layers,
                           include_head=not args.no_head, verbose=(i == 1), **args.mita_cfg)
            label = f'MiTA M={pool}x{pool} k={topk}'
        print(f'[swap_sweep {i + 1}/{len(settings)}] {label}: evaluating '
              f'({time.time() - t0:.0f}s elapsed)', flush=True)
        metrics = runner.test()
        row = dict(setting=label, M=setting[0] ** 2 if setting else '',
                   topk=setting[1] if setting else '',
                   mIoU=float(metrics['mIoU']), mAcc=float(metrics['mAcc']),
                   aAcc=float(metrics['aAcc']),
                   attn_GMACs=measure_cost(runner.model, batches))
        row['model_GFLOPs'] = model_gflops(runner.model, batches[0])
        row['attn_reduction_%'] = (100.0 * (1 - row['attn_GMACs'] / rows[0]['attn_GMACs'])
                                   if rows else 0.0)
        row['model_reduction_%'] = (100.0 * (1 - row['model_GFLOPs'] / rows[0]['model_GFLOPs'])
                                    if rows else 0.0)
        row['delta_mIoU'] = row['mIoU'] - rows[0]['mIoU'] if rows else 0.0
        rows.append(row)
        print(f'[swap_sweep {i + 1}/{len(settings)}] {label}: mIoU {row["mIoU"]:.2f}, '
              f'attention {row["attn_GMACs"]:.3f} GMACs/img, model '
              f'{row["model_GFLOPs"]:.3f} GFLOPs/img', flush=True)

    shape = tuple(batches[0]['inputs'][0].shape[-2:])
    mode = cfg.model.get('test_cfg', {}).get('mode', 'whole')
    note = (f'{FLOP_NOTE}; counted on {len(batches)} test batch(es), first input '
            f'{shape[0]}x{shape[1]}, test mode {mode!r}. Checkpoint: {args.checkpoint}.')
    md, csv_path = write_tables(rows, out_md, note)
    png = plot_sweep(rows, out_png, f'{osp.basename(args.config)} ({mode} inference)')
    with open(md) as f:
        print(f.read())
    print(f'wrote {md}, {csv_path}, {png}')
    return rows


if __name__ == '__main__':
    main()
