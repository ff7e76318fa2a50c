"""Stage 1 of the study: the standard-attention model trained with MMEngine's Runner (what
``tools/train.py`` runs: :func:`~mita_seg.apis.load_config`,
:func:`~mita_seg.apis.prepare_config`, :func:`~mita_seg.apis.build_runner`) on the study's
schedule (:func:`schedule`) or its config's, or its checkpoint reused; :func:`train` is also
what the fine-tune, the control and the MiTA-trained runs train with."""
import gc
import os.path as osp
import time
from typing import Tuple

from mmengine.config import Config

from mita_seg.apis import build_runner, load_config, prepare_config
from .model_study import ModelStudy

__all__ = ['schedule', 'training_schedule', 'train', 'logged_training_seconds', 'iters_text',
           'iters_of', 'run']


def schedule(cfg: Config, iters: int, lr_mult: float = 1.0) -> Config:
    """Set ``cfg`` (in place) to train ``iters`` iterations: the config's optimizer with its
    learning rate times ``lr_mult``, linear warm-up over ``min(50, iters // 5)`` iterations,
    then poly decay to 0 at ``iters``, one checkpoint at the end and no validation loop (the
    study evaluates with the test loop)."""
    warm = max(1, min(50, iters // 5))
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=iters)
    cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    cfg.param_scheduler = [
        dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=warm),
        dict(type='PolyLR', eta_min=0.0, power=1.0, begin=warm, end=iters, by_epoch=False)
    ]
    cfg.optim_wrapper.optimizer.lr = cfg.optim_wrapper.optimizer.lr * lr_mult
    cfg.default_hooks.checkpoint.interval = iters
    cfg.default_hooks.logger.interval = min(20, iters)
    return cfg


def training_schedule(cfg: Config, iters) -> Config:
    """``cfg`` on the study's schedule of ``iters`` iterations (:func:`schedule`), or on
    its own (its iterations, learning-rate schedule and validation) when ``iters`` is
    ``'config'``."""
    return cfg if iters == 'config' else schedule(cfg, iters)


def train(cfg: Config, work_dir: str, verbose: bool = False,
          reuse: bool = False) -> Tuple[str, float, bool]:
    """Train ``cfg`` (already :func:`schedule`-d) with the Runner in ``work_dir``; with
    ``reuse``, a checkpoint of the last iteration already there is taken as it is.

    Returns:
        tuple[str, float, bool]: the last checkpoint, the training seconds (for a reused
        checkpoint, as its log shows them) and whether it was reused.
    """
    iters = cfg.train_cfg.max_iters
    done = osp.join(work_dir, f'iter_{iters}.pth')
    if reuse and osp.isfile(done):
        return done, logged_training_seconds(work_dir, iters), True
    cfg.work_dir = work_dir
    prepare_config(cfg)
    runner = build_runner(cfg, verbose)
    t0 = time.time()
    runner.train()
    seconds = time.time() - t0
    ckpt = runner.message_hub.get_info('last_ckpt') or done
    del runner
    gc.collect()
    return ckpt, seconds, False


def iters_text(iters) -> str:
    """``iters`` (a study setting) in a progress line."""
    return "on the config's schedule" if iters == 'config' else f'{iters} iterations'


def iters_of(checkpoint: str) -> int:
    """The iterations a checkpoint ``iter_<n>.pth`` was trained for."""
    return int(osp.basename(checkpoint)[len('iter_'):-len('.pth')])


def logged_training_seconds(work_dir: str, iters: int) -> float:
    """Seconds the Runner's log in ``work_dir`` shows from the start of training to the
    checkpoint at ``iters`` (for a reused checkpoint); 0.0 if no log shows both."""
    import datetime
    import glob
    import re
    stamp = re.compile(r'^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) - mmengine')
    for log in sorted(glob.glob(osp.join(work_dir, '*', '*.log')), reverse=True):
        start = end = None
        with open(log) as f:
            for line in f:
                m = stamp.match(line)
                if m and 'Checkpoints will be saved to' in line:
                    start = m.group(1)
                elif m and f'Saving checkpoint at {iters} iterations' in line:
                    end = m.group(1)
        if start and end:
            t = [datetime.datetime.strptime(v, '%Y/%m/%d %H:%M:%S') for v in (start, end)]
            return (t[1] - t[0]).total_seconds()
    return 0.0


def run(study: ModelStudy) -> bool:
    """Train the standard-attention model (or reuse its checkpoint): True if it is."""
    s = study.s

    def do_train():
        cfg = training_schedule(load_config(study.config, study.opts), s.train_iters)
        return train(cfg, osp.join(study.work_dir, 'train'), s.verbose, s.reuse)

    trained = study.stage(f'training {iters_text(s.train_iters)} (standard attention)',
                          do_train)
    if trained is None:
        return False
    study.ckpt, seconds, reused = trained
    study.result['train'] = dict(iters=iters_of(study.ckpt), seconds=round(seconds, 1),
                                 checkpoint=study.ckpt, reused=reused)
    return True
