"""`make demo`: train a small MiTA UperNet on the tiny ADE20K on CPU, then evaluate it.

(To segment one image with a trained model, see ``tools/image_demo.py``.)

1. writes the synthetic dataset (tools/dataset/make_tiny_ade20k.py) if it is missing or
   incomplete (its last file absent: an interrupted generation),
2. trains the tiny MiTA ViT UperNet config with tools/train.py (Runner progress output),
3. evaluates the last checkpoint with tools/test.py and prints its mIoU, next to the mIoU of
   always predicting the most frequent class.

Usage::

    python tools/train_demo.py [--iters N] [--work-dir work_dirs/demo] [--data-root DIR]
"""
import os
import os.path as osp
import re
import subprocess
import sys
import time
import warnings

import numpy as np

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')


def run(cmd, log_path=None):
    """Run ``cmd`` from the repo root, streaming its output; return the output text."""
    print('$ ' + ' '.join(osp.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd),
          flush=True)
    lines = []
    # One intra-op thread: the dataloader workers share the 2 cores, and OpenMP threads
    # spinning against them (or other jobs) made iterations up to 7x slower here.
    env = {'OMP_NUM_THREADS': '1', **os.environ, 'PYTHONWARNINGS': 'ignore'}
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env) as proc:
        for line in proc.stdout:
            lines.append(line)
            print(line, end='', flush=True)
    if proc.returncode:
        raise SystemExit(f'error: {cmd[1]} failed with exit code {proc.returncode}')
    text = ''.join(lines)
    if log_path:
        with open(log_path, 'w') as f:
            f.write(text)
    return text


def majority_miou(data_root: str) -> float:
    """mIoU (%) of always predicting the most frequent class of the validation labels
    (ADE20K convention: 0 is ignored, classes are 1..150)."""
    import cv2
    ann_dir = osp.join(data_root, 'annotations', 'validation')
    counts = np.zeros(256, np.int64)
    for name in os.listdir(ann_dir):
        counts += np.bincount(cv2.imread(osp.join(ann_dir, name), cv2.IMREAD_UNCHANGED).ravel(),
                              minlength=256)
    counts[0] = 0
    present = np.flatnonzero(counts)
    # predicting class c everywhere: IoU(c) = |c| / |all labelled pixels|, others 0
    return 100 * counts.max() / counts.sum() / len(present)


def main(argv=None):
    sys.path.insert(0, ROOT)
    from mita_seg.cli import int_range, output_dir
    from mita_seg.cli.core import ToolParser
    parser = ToolParser(description=__doc__.split('\n')[0])
    parser.add_argument('--iters', type=int_range(2), default=300,
                        help='training iterations (the config has 600; 300 keep the demo to '
                        'a few minutes on 2 cores); the warm-up is a sixth of them, 50 at '
                        'most')
    parser.add_argument('--work-dir', type=output_dir('--work-dir'),
                        default=osp.join(ROOT, 'work_dirs', 'demo'))
    parser.add_argument('--data-root', type=output_dir('--data-root', if_missing=True),
                        default=osp.join(ROOT, 'data', 'ade', 'tiny_ade20k'))
    args = parser.parse_args(argv)
    py = sys.executable

    # the generator's last file: a folder an interrupted generation left is made again
    last = osp.join(args.data_root, 'annotations', 'validation', 'ADE_val_00000040.png')
    if not osp.isfile(last):
        run([py, osp.join(ROOT, 'tools', 'dataset', 'make_tiny_ade20k.py'), '--out',
             args.data_root, '--train', '200', '--val', '40', '--size', '128'])
    data_opts = [f'{loader}.dataset.data_root={args.data_root}'
                 for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    # the whole schedule (warm-up, poly decay to 0, validation and checkpoint at the end) in
    # --iters: the config's 50 warm-up iterations, fewer in a shorter run
    warm = max(1, min(50, args.iters // 6))
    train_opts = data_opts + [
        f'train_cfg.max_iters={args.iters}', f'param_scheduler.0.end={warm}',
        f'param_scheduler.1.begin={warm}', f'param_scheduler.1.end={args.iters}',
        f'train_cfg.val_interval={args.iters}', f'default_hooks.checkpoint.interval={args.iters}'
    ]

    start = time.time()
    run([py, osp.join(ROOT, 'tools', 'train.py'), CONFIG, '--work-dir', args.work_dir,
         '--cfg-options', *train_opts])
    train_s = time.time() - start
    with open(osp.join(args.work_dir, 'last_checkpoint')) as f:
        checkpoint = f.read().strip()

    start = time.time()
    out = run([py, osp.join(ROOT, 'tools', 'test.py'), CONFIG, checkpoint, '--work-dir',
               osp.join(args.work_dir, 'test'), '--cfg-options', *data_opts],
              log_path=osp.join(args.work_dir, 'test.log'))
    test_s = time.time() - start
    found = re.findall(r'mIoU: ([0-9.]+)', out)
    if not found:
        raise SystemExit('error: tools/test.py printed no mIoU')
    with warnings.catch_warnings():  # mmengine's pkg_resources deprecation
        warnings.simplefilter('ignore')
        from mmengine.config import Config
        vit = Config.fromfile(CONFIG).model.backbone
    print('\n' + '=' * 72)
    print(f'MiTA UperNet (ViT {vit.num_layers}x{vit.embed_dims}, patch {vit.patch_size}, '
          f'MiTA pool_size={vit.mita_cfg.pool_size}, topk={vit.mita_cfg.topk}) on tiny ADE20K, '
          f'{args.iters} iterations')
    shown = osp.relpath(checkpoint, ROOT) if checkpoint.startswith(ROOT + os.sep) else checkpoint
    print(f'  trained in {train_s:.0f} s, evaluated in {test_s:.0f} s: {shown}')
    print(f'  mIoU: {float(found[-1]):.2f}   (always the most frequent class: '
          f'{majority_miou(args.data_root):.2f})')
    print('=' * 72)


if __name__ == '__main__':
    main()
