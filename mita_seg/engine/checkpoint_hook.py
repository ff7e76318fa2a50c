"""``SafeCheckpointHook``: mmengine's ``CheckpointHook`` that never loses the last good
checkpoint, refuses checkpoints that do not fit the model, and resumes RNG state.

mmengine 0.10.7's ``CheckpointHook._save_checkpoint_with_step`` (1) deletes the oldest
checkpoint when ``max_keep_ckpts`` is reached, (2) writes the new one with a plain
``open(path, 'wb')`` and (3) rewrites ``work_dir/last_checkpoint`` in place. A crash or an
exception in (2) leaves a truncated file and, with ``max_keep_ckpts=1``, no usable checkpoint
at all; a crash in (3) leaves ``last_checkpoint`` empty, so ``--resume`` starts from scratch.
This hook overrides that one method to (1) write the new checkpoint atomically
(:class:`~mita_seg.engine.atomic_io.AtomicLocalBackend`), (2) then point ``last_checkpoint``
at it atomically, and (3) only then delete the checkpoints that fell out of
``max_keep_ckpts``.

On load (``--resume``, ``load_from``, ``tools/test.py``) it checks the checkpoint's
``state_dict`` keys against the model before mmengine's non-strict load, and raises a
:class:`~mita_seg.utils.CheckpointMismatchError` listing missing, unexpected and
mis-shaped keys instead of a silent partial load.

It also stores every process's torch RNG states (CPU, and its CUDA device when present) in
every checkpoint and restores them when training resumes, each process its own, so that
stochastic layers (dropout, drop path) draw the same numbers after ``--resume`` as in an
uninterrupted run, on one process or several (``randomness.diff_rank_seed=True`` gives each
its own stream). A run resumed by another number of processes than saved it keeps the
config's seeding, and says so. The data pipeline's numpy/python RNG needs no such care:
mmengine's ``IterBasedTrainLoop`` replays the skipped batches.
"""
import logging
import os.path as osp
from typing import Optional

import torch
from mmengine.dist import all_gather_object, get_rank, get_world_size, is_main_process
from mmengine.logging import print_log
from mmengine.fileio import LocalBackend, get_file_backend
from mmengine.hooks import CheckpointHook
from mmseg.registry import HOOKS

from mita_seg.utils.cfg_options import add_custom_imports
from mita_seg.utils.checkpoint import check_checkpoint_keys
from .atomic_io import ATOMIC_BACKEND, atomic_write_text

__all__ = ['SafeCheckpointHook', 'use_safe_checkpoint']

RNG_KEY = 'mita_rng_state'


def rng_state() -> dict:
    """This process's torch RNG states: ``cpu``, and ``cuda`` (its current device's) where
    CUDA is in use."""
    state = dict(cpu=torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state()
    return state


@HOOKS.register_module()
class SafeCheckpointHook(CheckpointHook):
    """``CheckpointHook`` with atomic saves, save-before-delete and resumable RNG state.

    Takes every argument of mmengine's ``CheckpointHook``. On a local ``out_dir`` (the
    usual case) checkpoint files are written through the atomic backend; remote backends
    (``s3://`` and the like, whose uploads are atomic already) are used as they are.

    Args:
        save_rng_state (bool): store the torch RNG states in checkpoints and restore them
            on resume. Default: True.
        strict_load (bool): raise ``CheckpointMismatchError`` when a loaded
            checkpoint's keys or shapes do not fit the model. Default: True.
        **kwargs: arguments of ``mmengine.hooks.CheckpointHook``.
    """

    def __init__(self, save_rng_state: bool = True, strict_load: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.save_rng_state = save_rng_state
        self.strict_load = strict_load
        self._resumed_rng: Optional[dict] = None
        self._gathered_rng: Optional[list] = None

    def before_train(self, runner) -> None:
        """Resolve ``out_dir`` as mmengine does, switch a local backend to the atomic one
        and, when training resumes, restore the RNG states of the checkpoint."""
        super().before_train(runner)
        if self.file_client_args is None and type(self.file_backend) is LocalBackend:
            self.backend_args = dict(self.backend_args or {}, backend=ATOMIC_BACKEND)
            self.file_backend = get_file_backend(self.out_dir, backend_args=self.backend_args)
        resumed = runner.iter > 0 or runner.epoch > 0
        if self._resumed_rng is not None and resumed:
            self._restore_rng(self._resumed_rng)
        self._resumed_rng = None

    @staticmethod
    def _restore_rng(saved: dict) -> None:
        """Set this process's RNG states to those it saved (``saved['ranks'][rank]``)."""
        ranks = saved.get('ranks')
        if ranks is None:   # saved before the states were per rank: one process's
            ranks = [dict(cpu=saved['cpu'], cuda_all=saved.get('cuda'))]
        if len(ranks) != get_world_size():
            print_log(f'the checkpoint holds the RNG states of {len(ranks)} processes and '
                      f'{get_world_size()} resume it: they keep the seeding of the config '
                      '(randomness), so dropout and drop path draw other numbers than an '
                      'uninterrupted run would', logger='current', level=logging.WARNING)
            return
        state = ranks[get_rank()]
        torch.set_rng_state(state['cpu'])
        if not torch.cuda.is_available():
            return
        if state.get('cuda') is not None:
            torch.cuda.set_rng_state(state['cuda'])
        elif state.get('cuda_all') and len(state['cuda_all']) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state['cuda_all'])

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        """Add the torch RNG states (plain uint8 tensors) to the checkpoint: every process's
        (gathered by :meth:`_save_checkpoint_with_step`, where all of them take part), else
        this one's, and rank 0's as ``cpu`` (what readers of one process's state read)."""
        if self.save_rng_state:
            ranks = self._gathered_rng or [rng_state()]
            checkpoint[RNG_KEY] = dict(cpu=ranks[0]['cpu'], ranks=ranks)

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        """Check that the checkpoint fits the model (before mmengine loads it) and keep its
        RNG states for :meth:`before_train` (which applies them only when the run resumes,
        not for ``load_from``)."""
        if self.strict_load:
            check_checkpoint_keys(
                runner.model, checkpoint, source=runner._load_from or '(latest in work_dir)',
                hint='  Use the config this checkpoint was trained with, or convert the '
                'checkpoint; set default_hooks.checkpoint.strict_load=False to accept a '
                'partial load knowingly.')
        if self.save_rng_state:
            self._resumed_rng = checkpoint.get(RNG_KEY)

    def _save_checkpoint_with_step(self, runner, step, meta):
        # Same bookkeeping as mmengine's, in a crash-safe order: save, point
        # last_checkpoint at the new file, and only then delete the outdated ones.
        stale = []
        if self.max_keep_ckpts > 0 and not (self.keep_ckpt_ids
                                            and self.keep_ckpt_ids[-1] == step):
            if len(self.keep_ckpt_ids) == self.max_keep_ckpts:
                stale.append(self.keep_ckpt_ids.popleft())
            self.keep_ckpt_ids.append(step)
            runner.message_hub.update_info('keep_ckpt_ids', list(self.keep_ckpt_ids))

        if self.save_rng_state:   # every rank is here; only rank 0 saves (master_only)
            self._gathered_rng = all_gather_object(rng_state())
        ckpt_filename = self.filename_tmpl.format(step)
        self.last_ckpt = self.file_backend.join_path(self.out_dir, ckpt_filename)
        runner.message_hub.update_info('last_ckpt', self.last_ckpt)
        runner.save_checkpoint(
            self.out_dir,
            ckpt_filename,
            self.file_client_args,
            save_optimizer=self.save_optimizer,
            save_param_scheduler=self.save_param_scheduler,
            meta=meta,
            by_epoch=self.by_epoch,
            backend_args=self.backend_args,
            **self.args)
        self._gathered_rng = None
        if not is_main_process():
            return
        atomic_write_text(self.last_ckpt, osp.join(runner.work_dir, 'last_checkpoint'))
        for old in stale:
            path = self.file_backend.join_path(self.out_dir, self.filename_tmpl.format(old))
            if self.file_backend.isfile(path):
                self.file_backend.remove(path)
            elif self.file_backend.isdir(path):  # deepspeed checkpoints are folders
                self.file_backend.rmtree(path)


def use_safe_checkpoint(cfg) -> None:
    """Switch a config's checkpoint hook to :class:`SafeCheckpointHook`, in place.

    For ``tools/train.py`` and ``tools/test.py``: any mmseg config (ours or mmseg's own)
    then saves atomically and loads strictly. A hook type other than mmengine's plain
    ``CheckpointHook`` is left alone; ``mita_seg.engine`` is added to ``custom_imports`` so
    that the config the runner dumps in ``work_dir`` works on its own.

    Args:
        cfg (mmengine.Config): the training config.
    """
    hook = cfg.get('default_hooks', {}).get('checkpoint')
    if hook is not None and hook.get('type') in ('CheckpointHook', CheckpointHook):
        hook['type'] = 'SafeCheckpointHook'
        add_custom_imports(cfg, 'mita_seg.engine')
