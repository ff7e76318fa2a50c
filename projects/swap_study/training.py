"""Stage 1 of the study: the standard-attention model trained with MMEngine's Runner (what
``tools/train.py`` runs: :func:`~mita_seg.apis.load_config`,
:func:`~mita_seg.apis.prepare_config`, :func:`~mita_seg.apis.build_runner`) on the study's
schedule (:func:`schedule`) or its config's, or its checkpoint reused; :func:`train` is also
what the fine-tune, the control and the MiTA-trained runs train with. With ``reuse``, a
training that was killed resumes from its last checkpoint (MMEngine's resume)."""
import datetime
import gc
import glob
import hashlib
import os.path as osp
import re
import time
from typing import NamedTuple, Optional

from mmengine.config import Config

from mita_seg.apis import build_runner, load_config, prepare_config
from mita_seg.engine import atomic_write_text
from .model_study import ModelStudy

__all__ = ['FINGERPRINT', 'schedule', 'training_schedule', 'Trained', 'train',
           'config_fingerprint', 'unfinished', 'logged_training_seconds', 'train_record',
           'iters_text', 'iters_of', 'training_config', 'run', 'restore']


# the SHA-256 of the config a training in a work dir was started with (train, unfinished)
FINGERPRINT = 'train_config.sha256'


def schedule(cfg: Config, iters: int, lr_mult: float = 1.0) -> Config:
    """Set ``cfg`` (in place) to train ``iters`` iterations: the config's optimizer with its
    learning rate times ``lr_mult``, linear warm-up over ``min(50, iters // 5)`` iterations,
    then poly decay to 0 at ``iters``, a checkpoint every quarter of it (the last one kept: a
    killed run resumes from it, :func:`train`) and at the end, and no validation loop (the
    study evaluates with the test loop)."""
    warm = max(1, min(50, iters // 5))
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=iters)
    cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    cfg.param_scheduler = [
        dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=warm),
        dict(type='PolyLR', eta_min=0.0, power=1.0, begin=warm, end=iters, by_epoch=False)
    ]
    cfg.optim_wrapper.optimizer.lr = cfg.optim_wrapper.optimizer.lr * lr_mult
    cfg.default_hooks.checkpoint.interval = max(1, iters // 4)
    cfg.default_hooks.checkpoint.max_keep_ckpts = 1
    cfg.default_hooks.logger.interval = min(20, iters)
    return cfg


def training_schedule(cfg: Config, iters) -> Config:
    """``cfg`` on the study's schedule of ``iters`` iterations (:func:`schedule`), or on
    its own (its iterations, learning-rate schedule and validation) when ``iters`` is
    ``'config'``."""
    return cfg if iters == 'config' else schedule(cfg, iters)


class Trained(NamedTuple):
    """What :func:`train` gives: the last checkpoint, the training seconds (for a reused or
    resumed training, as its logs show them: :func:`logged_training_seconds`), whether the
    checkpoint was reused as it was, and the iteration a killed training resumed from (None:
    not resumed)."""
    checkpoint: str
    seconds: float
    reused: bool
    resumed_from: Optional[int] = None

    def resumed(self) -> dict:
        """``{'resumed_from': iteration}`` for a resumed training, else ``{}`` (for a
        record)."""
        return {} if self.resumed_from is None else dict(resumed_from=self.resumed_from)


def train(cfg: Config, work_dir: str, verbose: bool = False, reuse: bool = False) -> Trained:
    """Train ``cfg`` (already :func:`schedule`-d) with the Runner in ``work_dir``. With
    ``reuse``, a checkpoint of the last iteration already there is taken as it is, and a
    training that stopped short of it (killed: :func:`unfinished`) resumes from its last
    checkpoint: MMEngine restores the model, the optimizer, the schedulers and the iteration
    and skips the data already seen (not the random state of the iterations after it)."""
    iters = cfg.train_cfg.max_iters
    done = osp.join(work_dir, f'iter_{iters}.pth')
    if reuse and osp.isfile(done):
        return Trained(done, logged_training_seconds(work_dir, iters), True)
    fingerprint = config_fingerprint(cfg)
    resume_from = unfinished(work_dir, iters, fingerprint) if reuse else None
    atomic_write_text(fingerprint + '\n', osp.join(work_dir, FINGERPRINT))
    cfg.work_dir = work_dir
    if resume_from:
        cfg.load_from = resume_from   # what MMEngine resumes from when ``resume`` is set
    prepare_config(cfg, resume=resume_from is not None)
    runner = build_runner(cfg, verbose)
    t0 = time.time()
    runner.train()
    seconds = time.time() - t0
    ckpt = runner.message_hub.get_info('last_ckpt') or done
    del runner
    gc.collect()
    if resume_from:
        return Trained(ckpt, logged_training_seconds(work_dir, iters) or seconds, False,
                       iters_of(resume_from))
    return Trained(ckpt, seconds, False)


def config_fingerprint(cfg: Config) -> str:
    """The SHA-256 of ``cfg``'s text: what :func:`train` writes beside a training
    (:data:`FINGERPRINT`) and :func:`unfinished` compares before resuming it."""
    return hashlib.sha256(cfg.pretty_text.encode()).hexdigest()


def unfinished(work_dir: str, iters: int, fingerprint: str) -> Optional[str]:
    """The checkpoint a training in ``work_dir`` that stopped before ``iters`` saved last
    (the one ``last_checkpoint`` names, looked up in ``work_dir`` if the folder was moved);
    None if there is none, if it is at ``iters`` or beyond, or if that training's config
    (its ``FINGERPRINT``: the SHA-256 of its text, written by :func:`train`) is not the one
    of ``fingerprint`` (another schedule, rate or model: a finished shorter training is not
    resumed with the schedule it ended)."""
    marker, mark = (osp.join(work_dir, f) for f in ('last_checkpoint', FINGERPRINT))
    if not (osp.isfile(marker) and osp.isfile(mark)):
        return None
    with open(mark) as f:
        if f.read().strip() != fingerprint:
            return None
    with open(marker) as f:
        named = f.read().strip()
    for ckpt in (named, osp.join(work_dir, osp.basename(named))):
        if re.fullmatch(r'iter_\d+\.pth', osp.basename(ckpt)) and osp.isfile(ckpt):
            return ckpt if iters_of(ckpt) < iters else None
    return None


def train_record(trained: Trained, **extra) -> dict:
    """A training in the study's result: ``iters, seconds, checkpoint, reused`` and, for a
    resumed one, ``resumed_from`` (the iteration)."""
    return dict(iters=iters_of(trained.checkpoint), seconds=round(trained.seconds, 1),
                checkpoint=trained.checkpoint, reused=trained.reused, **extra,
                **trained.resumed())


def iters_text(iters) -> str:
    """``iters`` (a study setting) in a progress line."""
    return "on the config's schedule" if iters == 'config' else f'{iters} iterations'


def iters_of(checkpoint: str) -> int:
    """The iterations a checkpoint ``iter_<n>.pth`` was trained for."""
    return int(osp.basename(checkpoint)[len('iter_'):-len('.pth')])


_STAMP = re.compile(r'^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) - mmengine')
_SAVED = re.compile(r'Saving checkpoint at (\d+) iterations')
_RESUMED = re.compile(r'resumed epoch: \d+, iter: (\d+)')


def _log_segment(log: str):
    """One Runner log: when training started, the time of each checkpoint saved (by
    iteration) and the iteration it resumed from (0: not resumed)."""
    start, saved, resumed = None, {}, 0
    with open(log) as f:
        for line in f:
            m = _STAMP.match(line)
            if not m:
                continue
            t = datetime.datetime.strptime(m.group(1), '%Y/%m/%d %H:%M:%S')
            if 'Checkpoints will be saved to' in line:
                start = t
            elif _SAVED.search(line):
                saved[int(_SAVED.search(line).group(1))] = t
            elif _RESUMED.search(line):
                resumed = int(_RESUMED.search(line).group(1))
    return start, saved, resumed


def logged_training_seconds(work_dir: str, iters: int) -> float:
    """Seconds the Runner's logs in ``work_dir`` show from the start of training to the
    checkpoint at ``iters``: the newest log that saved it, plus, where that run resumed from
    a checkpoint, the older run's seconds up to that checkpoint (and so on back); 0.0 if no
    log shows the start and the checkpoint."""
    total, want = 0.0, iters
    for log in sorted(glob.glob(osp.join(work_dir, '*', '*.log')), reverse=True):
        start, saved, resumed = _log_segment(log)
        if start is None or want not in saved:
            continue
        total += (saved[want] - start).total_seconds()
        if not resumed:
            return total
        want = resumed
    return 0.0   # no log of the start, or of a checkpoint a later run resumed from


def training_config(study: ModelStudy) -> Config:
    """The config ``study``'s standard-attention model is trained with (its data and seed,
    on the study's schedule)."""
    return training_schedule(load_config(study.config, study.opts), study.s.train_iters)


def run(study: ModelStudy) -> bool:
    """Train the standard-attention model (or reuse its checkpoint): True if it is."""
    s = study.s

    def do_train():
        return train(training_config(study), osp.join(study.work_dir, 'train'), s.verbose,
                     s.reuse)

    trained = study.stage(f'training {iters_text(s.train_iters)} (standard attention)',
                          do_train)
    if trained is None:
        return False
    study.ckpt = trained.checkpoint
    study.result['train'] = train_record(trained)
    return True


def restore(study: ModelStudy) -> None:
    """The training of a resumed run: its checkpoint from the result."""
    study.ckpt = study.result['train']['checkpoint']
