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
:class:`CheckpointMismatchError` listing missing and unexpected keys instead of a silent
partial load.

It also stores the torch RNG states (CPU, and CUDA when present) in every checkpoint and
restores them when training resumes, so that stochastic layers (dropout, drop path) draw the
same numbers after ``--resume`` as in an uninterrupted run. The data pipeline's numpy/python
RNG needs no such care: mmengine's ``IterBasedTrainLoop`` replays the skipped batches.
"""
import os.path as osp
import re
from typing import Dict, Optional

import torch
from mmengine.dist import is_main_process
from mmengine.fileio import LocalBackend, get_file_backend
from mmengine.hooks import CheckpointHook
from mmengine.model import BaseTTAModel, is_model_wrapper
from mmseg.registry import HOOKS

from .atomic_io import ATOMIC_BACKEND, atomic_write_text

__all__ = [
    'SafeCheckpointHook', 'use_safe_checkpoint', 'CheckpointMismatchError',
    'check_checkpoint_keys'
]

RNG_KEY = 'mita_rng_state'


class CheckpointMismatchError(KeyError):
    """A checkpoint's ``state_dict`` does not fit the model (see the message)."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0])


def _short(keys, limit: int = 20) -> str:
    keys = sorted(keys)
    more = f' ... and {len(keys) - limit} more' if len(keys) > limit else ''
    return ', '.join(keys[:limit]) + more


def check_checkpoint_keys(model: torch.nn.Module, checkpoint: Dict, source: str = '') -> None:
    """Check that a checkpoint's weights fit ``model`` exactly, as ``strict=True`` would.

    Keys are compared as mmengine loads them (``state_dict`` entry if present, a leading
    ``module.`` removed).

    Args:
        model (nn.Module): the model (a wrapper's or a test-time-augmentation model's
            ``module`` is used, as mmengine loads into it).
        checkpoint (dict): the loaded checkpoint.
        source (str): where the checkpoint comes from, for the message. Default: ''.

    Raises:
        CheckpointMismatchError: keys are missing, unexpected, or of another shape; the
            message lists them.
    """
    if is_model_wrapper(model) or isinstance(model, BaseTTAModel):
        model = model.module
    state = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise CheckpointMismatchError(f'checkpoint {source} holds no state_dict')
    state = {re.sub(r'^module\.', '', k): v for k, v in state.items()}
    expected = model.state_dict()
    missing = expected.keys() - state.keys()
    unexpected = state.keys() - expected.keys()
    shapes = [
        f'{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}'
        for k, v in expected.items()
        if k in state and hasattr(state[k], 'shape') and tuple(state[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        lines = [f'checkpoint {source} does not fit {type(model).__name__}:']
        if missing:
            lines.append(f'  missing keys ({len(missing)}): {_short(missing)}')
        if unexpected:
            lines.append(f'  unexpected keys ({len(unexpected)}): {_short(unexpected)}')
        if shapes:
            lines.append(f'  shape mismatch ({len(shapes)}): {_short(shapes)}')
        lines.append('  Use the config this checkpoint was trained with, or convert the '
                     'checkpoint; set default_hooks.checkpoint.strict_load=False to accept '
                     'a partial load knowingly.')
        raise CheckpointMismatchError('\n'.join(lines))


@HOOKS.register_module()
class SafeCheckpointHook(CheckpointHook):
    """``CheckpointHook`` with atomic saves, save-before-delete and resumable RNG state.

    Takes every argument of mmengine's ``CheckpointHook``. On a local ``out_dir`` (the
    usual case) checkpoint files are written through the atomic backend; remote backends
    (``s3://`` and the like, whose uploads are atomic already) are used as they are.

    Args:
        save_rng_state (bool): store the torch RNG states in checkpoints and restore them
            on resume. Default: True.
        strict_load (bool): raise :class:`CheckpointMismatchError` when a loaded
            checkpoint's keys or shapes do not fit the model. Default: True.
        **kwargs: arguments of ``mmengine.hooks.CheckpointHook``.
    """

    def __init__(self, save_rng_state: bool = True, strict_load: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.save_rng_state = save_rng_state
        self.strict_load = strict_load
        self._resumed_rng: Optional[dict] = None

    def before_train(self, runner) -> None:
        """Resolve ``out_dir`` as mmengine does, switch a local backend to the atomic one
        and, when training resumes, restore the RNG states of the checkpoint."""
        super().before_train(runner)
        if self.file_client_args is None and type(self.file_backend) is LocalBackend:
            self.backend_args = dict(self.backend_args or {}, backend=ATOMIC_BACKEND)
            self.file_backend = get_file_backend(self.out_dir, backend_args=self.backend_args)
        resumed = runner.iter > 0 or runner.epoch > 0
        if self._resumed_rng is not None and resumed:
            torch.set_rng_state(self._resumed_rng['cpu'])
            cuda = self._resumed_rng.get('cuda')
            if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        self._resumed_rng = None

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        """Add the torch RNG states (plain uint8 tensors) to the checkpoint."""
        if self.save_rng_state:
            state = dict(cpu=torch.get_rng_state())
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                state['cuda'] = torch.cuda.get_rng_state_all()
            checkpoint[RNG_KEY] = state

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        """Check that the checkpoint fits the model (before mmengine loads it) and keep its
        RNG states for :meth:`before_train` (which applies them only when the run resumes,
        not for ``load_from``)."""
        if self.strict_load:
            check_checkpoint_keys(runner.model, checkpoint,
                                  source=runner._load_from or '(latest in work_dir)')
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
        custom_imports = cfg.setdefault('custom_imports', dict(imports=[]))
        imports = list(custom_imports.get('imports', []))
        if 'mita_seg.engine' not in imports:
            custom_imports['imports'] = imports + ['mita_seg.engine']
