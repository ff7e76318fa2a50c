"""Stage 4 of the study: the swap at each fine-tune setting written as a MiTA config +
checkpoint pair (:func:`~mita_seg.apis.export_swapped`, ``tools/export_swapped.py``) and
fine-tuned with the Runner; as a control, the unswapped model trained for the same
iterations from the same checkpoint with the same schedule."""
import os.path as osp

from mita_seg.apis import export_swapped, load_config
from mita_seg.setting import MiTASetting
from .model_study import ModelStudy
from .rows import study_row
from .runner import evaluate
from .settings import tag_of
from .training import Trained, schedule, train

__all__ = ['run', 'control']


def run(study: ModelStudy, setting: MiTASetting) -> None:
    """Export the swap at ``setting`` (:func:`~mita_seg.apis.export_swapped`) and fine-tune
    it."""
    s, tag = study.s, tag_of(setting)
    ft_dir = osp.join(study.work_dir, f'finetune_{tag}')

    def do_finetune():
        out_cfg, out_ckpt = export_swapped(study.config, study.ckpt,
                                           osp.join(ft_dir, 'export'), setting.cfg(),
                                           study.opts)
        cfg = schedule(load_config(out_cfg), s.finetune_iters, s.finetune_lr_mult)
        trained = train(cfg, osp.join(ft_dir, 'train'), s.verbose, s.reuse)
        values = evaluate(load_config(out_cfg), trained.checkpoint, osp.join(ft_dir, 'test'), s)
        return dict(values, exported=[out_cfg, out_ckpt], trained=trained)

    ft = study.stage(f'export MiTA {setting.label} and fine-tune it '
                     f'{s.finetune_iters} iterations', do_finetune)
    if ft is not None:
        exported, trained = ft.pop('exported'), ft.pop('trained')
        study.add_row(study_row(f'MiTA {setting.label}, fine-tuned {s.finetune_iters} it',
                                'finetune', setting.num_experts, setting.topk, ft, study.base),
                      exported=exported, **_trained(trained))


def control(study: ModelStudy) -> None:
    """The unswapped model trained as long as the fine-tune, from the same checkpoint."""
    s = study.s

    def do_control():
        cfg = schedule(load_config(study.config, study.opts), s.finetune_iters,
                       s.finetune_lr_mult)
        cfg.load_from = study.ckpt
        trained = train(cfg, osp.join(study.work_dir, 'control', 'train'), s.verbose, s.reuse)
        values = evaluate(load_config(study.config, study.opts), trained.checkpoint,
                          osp.join(study.work_dir, 'control', 'test'), s)
        return dict(values, trained=trained)

    ctl = study.stage(f'control: unswapped, trained {s.finetune_iters} more iterations',
                      do_control)
    if ctl is not None:
        trained = ctl.pop('trained')
        study.add_row(study_row(f'unswapped, trained {s.finetune_iters} it more (control)',
                                'control', None, None, ctl, study.base),
                      **_trained(trained))


def _trained(trained: Trained) -> dict:
    """A fine-tune's or control's training in its row: ``checkpoint``, ``train_seconds``
    and, resumed, ``resumed_from``."""
    return dict(checkpoint=trained.checkpoint, train_seconds=round(trained.seconds, 1),
                **trained.resumed())
