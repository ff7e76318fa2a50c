"""Does a dataset need distance? The long-range benchmark's check (issue 43): the same
Segmenter trained identically twice for one seed, once with softmax attention and once with
its encoder's attention restricted to a 3x3 window (``configs/longrange/``: no cls token, no
attention in the mask head, so the window model is local), both evaluated with the test loop
of ``tools/test.py``. A dataset discriminates swaps if the first is learnable but not
saturated and the second clearly below it."""
import os.path as osp
import time
from typing import Callable, Dict, Optional

from mita_seg.apis import load_config, mita_config
from mita_seg.evaluation import ACCURACY_KEYS
from mita_seg.setting import MiTASetting

from .settings import DATASETS, LONGRANGE_SEGMENTER, StudySettings
from .runner import data_options, evaluate
from .sweep import ONE_KEY
from .training import schedule, train

__all__ = ['NO_MIXING', 'LONGRANGE_CONFIGS', 'LONGRANGE_ROOT', 'check_discrimination',
           'format_check', 'run_check']

LONGRANGE_ROOT = DATASETS['longrange'].data_root
# the pair: (the model's directory under WORK_DIR, its config); the unswapped model's is the
# study's (``WORK_DIR/segmenter/seed<seed>/train``), so that the study on the long-range
# scenes with ``--reuse`` takes the check's checkpoints
LONGRANGE_CONFIGS = {
    'unswapped': ('segmenter', LONGRANGE_SEGMENTER),
    'local window': ('segmenter_window3',
                     'configs/longrange/segmenter_vit-tiny_linear_window3_1xb4_longrange-ade20k-'
                     '256x256.py'),
}


# swaps of the unswapped model (no retraining) that leave its encoder no token mixing: each
# token reads itself alone (``window:1``); and every token reads the one key that a single
# landmark (the mean query) routes to (``1:1:route``: pool 1, k 1, no shared expert), which
# mixes nothing of a token's neighbours but broadcasts one token to all
NO_MIXING = ('window:1', ONE_KEY.text)


def check_discrimination(seed: int, work_dir: str, data_root: str = LONGRANGE_ROOT,
                         reuse: bool = False, verbose: bool = False,
                         progress: Optional[Callable[[str], None]] = None,
                         iters: Optional[int] = None) -> Dict:
    """Train and evaluate the pair of :data:`LONGRANGE_CONFIGS` for ``seed`` (their own
    schedule, or ``iters`` iterations of the study's), in ``WORK_DIR/<model>/seed<seed>``;
    with ``reuse`` a finished checkpoint is evaluated as it is.

    Returns:
        dict: ``seed``, ``iters``, and per model (``unswapped``, ``local window``) the
        test row of :func:`~projects.swap_study.runner.evaluate` with ``train_seconds``;
        ``no mixing``: the unswapped model swapped to each of :data:`NO_MIXING` without
        retraining, ``{spelling: test row}``.
    """
    progress = progress or (lambda line: print(f'[check] {line}', flush=True))
    out = dict(seed=seed)
    opts = {**data_options(data_root), 'randomness.seed': seed}
    settings = StudySettings(data_root, verbose=verbose, speed_min_run_time=0.2)
    for name, (dirname, config) in LONGRANGE_CONFIGS.items():
        mdir = osp.join(work_dir, dirname, f'seed{seed}')
        cfg = load_config(config, opts)
        if iters is not None:
            schedule(cfg, iters)
        out['iters'] = cfg.train_cfg.max_iters
        progress(f'{name}: training {config} for {out["iters"]} iterations, seed {seed}')
        t0 = time.time()
        ckpt, seconds, reused, _ = train(cfg, osp.join(mdir, 'train'), verbose, reuse)
        progress(f'{name}: {"reused" if reused else "trained in"} {seconds:.0f} s; evaluating')
        row = evaluate(load_config(config, opts), ckpt, osp.join(mdir, 'test'),
                       settings)
        out[name] = dict(row, train_seconds=round(seconds, 1), checkpoint=ckpt,
                         seconds=round(time.time() - t0, 1))
    ckpt, (_, config) = out['unswapped']['checkpoint'], LONGRANGE_CONFIGS['unswapped']
    out['no mixing'] = {}
    for spec in NO_MIXING:
        progress(f'unswapped, swapped to {spec} without retraining: evaluating')
        cfg = mita_config(load_config(config, opts), dict(setting=MiTASetting.parse(spec)))
        out['no mixing'][spec] = evaluate(
            cfg, ckpt, osp.join(work_dir, 'segmenter', f'seed{seed}', f'test_{spec}'),
            settings)
    return out


def format_check(res: Dict) -> str:
    """The check's one line: ``unswapped <mIoU>`` and ``local window <mIoU>``, the gap."""
    a, b = res['unswapped']['mIoU'], res['local window']['mIoU']
    seconds = sum(res[k]['seconds'] for k in LONGRANGE_CONFIGS)
    return (f'seed {res["seed"]}, {res["iters"]} iterations each, long-range scenes: '
            f'unswapped {a:.2f} mIoU, local window {b:.2f} mIoU, gap {a - b:+.2f}; '
            + ', '.join(f"swapped to {k} (no retraining) {v['mIoU'] - a:+.2f}"
                        for k, v in res.get('no mixing', {}).items())
            + _evidence(res) + f' ({seconds / 60:.0f} min)')


def _evidence(res: Dict) -> str:
    """The pixel accuracy by evidence of each model of the check (the configs'
    ``EvidenceAccuracyMetric``), or nothing when the rows lack it."""
    rows = dict(unswapped=res['unswapped'], window=res['local window'],
                **res.get('no mixing', {}))
    if not all(k in r for r in rows.values() for k in ACCURACY_KEYS):
        return ''
    return ('; pixel accuracy ' + '/'.join(k[len('acc_'):] for k in ACCURACY_KEYS) + ': '
            + ', '.join(name + ' ' + '/'.join(f'{r[k]:.0f}' for k in ACCURACY_KEYS)
                        for name, r in rows.items()))


def run_check(seeds, work_dir: str, data_root: str = LONGRANGE_ROOT, reuse: bool = False,
              verbose: bool = False) -> list:
    """:func:`check_discrimination` for each seed (the scenes must be in ``data_root``:
    ``tools/dataset/make_longrange_ade20k.py``), each seed's line printed and its result
    written to ``WORK_DIR/check_seed<seed>.json``."""
    import json
    import os
    os.makedirs(work_dir, exist_ok=True)
    results = []
    for seed in seeds:
        res = check_discrimination(seed, work_dir, data_root, reuse, verbose)
        with open(osp.join(work_dir, f'check_seed{seed}.json'), 'w') as f:
            json.dump(res, f, indent=1)
        print(format_check(res), flush=True)
        results.append(res)
    return results
