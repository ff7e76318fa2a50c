"""MMEngine runners for ``tools/train.py`` and ``tools/test.py``: the config as mmseg's tools
prepare it, plus what they lack (strict weights-only checkpoints for any config, gloo on
CPU, bf16 AMP on CPU), and a console without the long records unless asked for."""
import logging
import os
from typing import Optional

from mmengine.config import Config
from mmengine.runner import Runner

from mita_seg.engine import use_amp, use_plain_param_groups, use_safe_checkpoint
from mita_seg.models import guard_grids
from mita_seg.utils import setup_cpu_distributed
from mita_seg.utils.cfg_options import blame_cfg_options
from mita_seg.utils.errors import InputError
from mita_seg.utils.stack_noise import is_stack_noise
from .config import use_dense_attn, use_slim_inference

# The environment each launcher reads (mmengine's init_dist), and what sets it.
LAUNCHER_ENV = {'pytorch': (('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'),
                            'torchrun, e.g. tools/dist_train.sh / tools/dist_test.sh'),
                'slurm': (('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_NODELIST'), 'srun'),
                'mpi': (('OMPI_COMM_WORLD_LOCAL_RANK', 'MASTER_ADDR'),
                        'mpirun (Open MPI) with MASTER_ADDR exported (the first node)')}

# Multi-line info records longer than this go to the log file only (config dump,
# environment, mmseg's per-class table of 150 rows).
MAX_CONSOLE_LINES = 6


def _short_record(record: logging.LogRecord) -> bool:
    """Console filter: drop long info records, the heading of the per-class table and the
    stack's known noise (:func:`~mita_seg.utils.stack_noise.is_stack_noise`)."""
    if not is_stack_noise(record):
        return False
    if record.levelno > logging.INFO:
        return True
    msg = record.getMessage()
    return msg.count('\n') < MAX_CONSOLE_LINES and msg.strip() != 'per class results:'


class CheckedRunner(Runner):
    """mmengine's ``Runner`` on which a ``--cfg-options`` value the model, a loop (its
    dataloader, dataset, evaluator), the optimizer or the schedulers cannot be built with is
    a :class:`~mita_seg.utils.cfg_options.CfgOptionsError` naming the option (one ``error:``
    line in the tools), not a traceback; only while those are built, never while they run
    (:func:`~mita_seg.utils.cfg_options.blame_cfg_options`)."""

    def build_model(self, model):
        with blame_cfg_options(self.cfg, 'the model', ('model', 'data_preprocessor')):
            return super().build_model(model)

    def build_train_loop(self, loop):
        with blame_cfg_options(self.cfg, 'the training loop', ('train_cfg', 'train_dataloader')):
            return super().build_train_loop(loop)

    def build_val_loop(self, loop):
        with blame_cfg_options(self.cfg, 'the validation loop',
                               ('val_cfg', 'val_dataloader', 'val_evaluator')):
            return super().build_val_loop(loop)

    def build_test_loop(self, loop):
        with blame_cfg_options(self.cfg, 'the test loop',
                               ('test_cfg', 'test_dataloader', 'test_evaluator')):
            return super().build_test_loop(loop)

    def build_optim_wrapper(self, optim_wrapper):
        with blame_cfg_options(self.cfg, 'the optimizer', ('optim_wrapper', )):
            return super().build_optim_wrapper(optim_wrapper)

    def build_param_scheduler(self, scheduler):
        with blame_cfg_options(self.cfg, 'the schedulers', ('param_scheduler', )):
            return super().build_param_scheduler(scheduler)


class QuietRunner(CheckedRunner):
    """mmengine's ``Runner`` (a :class:`CheckedRunner`) whose console leaves out long info
    records (they stay in the log file of ``work_dir``); everything else is the Runner's."""

    def build_logger(self, log_level='INFO', log_file: Optional[str] = None, **kwargs):
        """The Runner's logger, with :func:`_short_record` on its console handlers."""
        logger = super().build_logger(log_level=log_level, log_file=log_file, **kwargs)
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and _short_record not in handler.filters:
                handler.addFilter(_short_record)
        return logger


def prepare_config(cfg: Config, launcher: str = 'none', checkpoint: Optional[str] = None,
                   resume: bool = False, amp: bool = False, local_rank: int = 0) -> Config:
    """What ``tools/train.py`` and ``tools/test.py`` do to a config before the Runner
    (with :func:`~mita_seg.apis.use_slim_inference`: an ``EncoderDecoder`` tests and
    validates on ``SlimEncoderDecoder`` unless the config says ``slim_inference=False``).

    Args:
        cfg (Config): from :func:`~mita_seg.apis.load_config` (``work_dir`` set).
        launcher (str): ``none``, ``pytorch`` (gloo on CPU), ``slurm`` or ``mpi``.
        checkpoint (str, optional): ``load_from``. Default: None.
        resume (bool): resume from the latest checkpoint in ``work_dir``. Default: False.
        amp (bool): mixed precision (fp16 on CUDA, bf16 on CPU). Default: False. A config
            with mmcv 0.x's ``fp16 = dict(...)`` (mmseg's MAE ``-amp-`` config; mmengine
            reads it no more, so mmseg's own tool trains it in float32) gets it too.

    Returns:
        Config: ``cfg``, changed in place.

    Raises:
        InputError: ``launcher`` is not ``none`` and the process was not started by it.
    """
    if launcher in LAUNCHER_ENV:
        names, how = LAUNCHER_ENV[launcher]
        missing = [n for n in names if n not in os.environ]
        if missing:
            raise InputError(f'--launcher {launcher}: {", ".join(missing)} not set; start the '
                             f'tool through {how}, or leave out --launcher')
    if 'LOCAL_RANK' not in os.environ:
        # the Runner wraps DDP with device_ids=[LOCAL_RANK]; MMEngine's mpi launcher picks the
        # GPU by Open MPI's local rank and leaves LOCAL_RANK unset (every process would wrap
        # GPU 0; mmseg's tool sets 0): take the launcher's own local rank where it has one
        from mita_seg.utils.dist import LAUNCHER_RANKS
        own = LAUNCHER_RANKS.get(launcher, (None, None, None))[2]
        os.environ['LOCAL_RANK'] = os.environ.get(own, str(local_rank)) if own else str(
            local_rank)
    cfg.launcher = launcher
    if checkpoint is not None:
        cfg.load_from = checkpoint
    cfg.resume = resume
    if amp or cfg.get('fp16') is not None:
        use_amp(cfg)
    use_safe_checkpoint(cfg)  # atomic saves, strict weights-only loads, for any config
    use_plain_param_groups(cfg)  # compile=True: param groups Dynamo can trace
    use_slim_inference(cfg)   # mmseg's results, lighter slide inference (unless told not to),
    #                           the dense attention path (dense_attn, 'fast' by default)
    setup_cpu_distributed(cfg, launcher)
    return cfg


def _is_count(x, low: int = 1) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def check_schedule(cfg: Config) -> Config:
    """Refuse a training schedule mmengine would fail on only once the Runner is built (a
    traceback, a work dir left behind): ``train_cfg``'s counts not positive ints, a
    ``param_scheduler`` entry whose ``end`` is not after its ``begin`` (e.g. a schedule
    made shorter than the warm-up before it).

    Args:
        cfg (Config): the training config (``--cfg-options`` merged).

    Returns:
        Config: ``cfg`` unchanged.

    Raises:
        InputError: naming the setting as ``--cfg-options`` spells it, and the fix.
    """
    train_cfg = cfg.get('train_cfg') or {}
    for key in ('max_iters', 'max_epochs', 'val_interval', 'val_begin'):
        if key in train_cfg and not _is_count(train_cfg[key], 0 if key == 'val_begin' else 1):
            raise InputError(
                f'train_cfg.{key}={train_cfg[key]!r} is not a positive int: give e.g. '
                f'--cfg-options train_cfg.{key}={600 if key == "max_iters" else 10}')
    schedulers = cfg.get('param_scheduler') or []
    if isinstance(schedulers, dict):
        schedulers = [schedulers]
    for i, sched in enumerate(schedulers):
        name = f'param_scheduler.{i}' if len(schedulers) > 1 else 'param_scheduler'
        begin, end = sched.get('begin', 0), sched.get('end')
        for key, value in (('begin', begin), ('end', end)):
            if value is not None and not _is_count(value, 0):
                raise InputError(f'{name}.{key}={value!r} ({sched.get("type")}) is not an int '
                                 f'>= 0: give the {"first" if key == "begin" else "last"} '
                                 f'{"epoch" if sched.get("by_epoch", True) else "iteration"}')
        if end is not None and end <= begin:
            before = [f'param_scheduler.{j}.end={s.get("end")}' for j, s in
                      enumerate(schedulers[:i]) if s.get('end') == begin]
            why = f' (it begins where {before[0]} ends)' if before else ''
            raise InputError(
                f'{name} ({sched.get("type")}) ends at {end}, not after it begins at {begin}'
                f'{why}: give {name}.end > {begin}, or shorten what comes before it'
                + (f' ({before[0].split("=")[0]})' if before else ''))
    return cfg


def build_runner(cfg: Config, verbose: bool = False) -> Runner:
    """The Runner of ``cfg`` (``runner_type`` if set), :class:`QuietRunner` by default
    (:class:`CheckedRunner` with ``verbose``: a bad ``--cfg-options`` value is one error
    naming it, on both). A
    BEiT/MAE backbone's grid is checked on every forward
    (:func:`~mita_seg.models.guard_grids`); the model's dense attention is on the path
    ``cfg.dense_attn`` says (:func:`~mita_seg.apis.use_dense_attn`, any segmentor)."""
    if 'runner_type' in cfg:
        from mmseg.registry import RUNNERS
        runner = RUNNERS.build(cfg)
    else:
        runner = (CheckedRunner if verbose else QuietRunner).from_cfg(cfg)
    guard_grids(runner.model)
    use_dense_attn(runner.model, cfg)
    return runner
