"""Stage 6 of the study: the same architecture trained from scratch *with MiTA* at each
``native`` setting (the paper's second claim: train with small experts, enlarge them at
inference) for as many iterations, evaluated over the sweep's (pool size, top-k) grid with
no retraining (and with every key: softmax attention), and its token selection mapped by
depth."""
import os
import os.path as osp
from typing import List, Optional

from mita_seg.apis import load_config, mita_config
from mita_seg.apis.sweep import SweepRow, sweep_points
from mita_seg.setting import MiTASetting
from .model_study import ModelStudy
from .rows import from_sweep, study_row
from .selection import model_maps
from .settings import tag_of
from .sweep import every_key_miou
from .training import iters_text, train, train_record, training_schedule

__all__ = ['run']


def run(study: ModelStudy, setting: MiTASetting) -> None:
    """Train with MiTA at ``setting`` from scratch, evaluate it over the sweep's grid
    (and with every key), map its token selection."""
    s = study.s
    native = dict(setting=setting.text, label=setting.label, rows=[])
    mita = setting.cfg()
    ndir = osp.join(study.work_dir, f'native_{tag_of(setting)}')

    def do_native_train():
        cfg = mita_config(load_config(study.config, study.opts), mita)
        os.makedirs(ndir, exist_ok=True)
        cfg.dump(osp.join(ndir, 'config.py'))   # for tools/test.py --mita-cfg ...
        return train(training_schedule(cfg, s.train_iters), osp.join(ndir, 'train'), s.verbose,
                     s.reuse)

    trained = study.stage(f'training {iters_text(s.train_iters)} with MiTA {setting.label} '
                          'from scratch', do_native_train)
    if trained is None:
        return
    n_ckpt = trained.checkpoint
    native['train'] = train_record(trained, config=osp.join(ndir, 'config.py'))
    every_key = (lambda runner, model, _: every_key_miou(runner, model, min(s.pool_sizes)))
    swept = study.stage(
        f'MiTA-trained {setting.label}: as trained and at '
        f'{len(s.pool_sizes) * len(s.topks)} test-time settings',
        lambda: study.sweep_with(n_ckpt, osp.join(ndir, 'sweep'),
                                 sweep_points(s.pool_sizes, s.topks), 'native ', mita,
                                 after=every_key if s.exact_check else None))
    if swept is not None:
        _rows(study, native, setting, *swept)
    if s.selection_images:
        sel = study.stage(f'token selection of the MiTA-trained {setting.label}',
                          lambda: model_maps(
                              study, n_ckpt, setting, f'{study.files}_native_{tag_of(setting)}',
                              mita, how='trained with it'))
        if sel is not None:
            native['selection'] = sel
    study.result['native'].append(native)


def _rows(study: ModelStudy, native: dict, setting: MiTASetting, rows: List[SweepRow],
          exact: Optional[float]) -> None:
    """The MiTA-trained model's rows: as trained, at the grid's other settings (an error
    if its own setting at test time differs from as trained), with every key."""
    base, trained = study.base, f'trained {setting.label}'
    trained_row = study_row(f'{trained}, tested as trained', 'native', setting.num_experts,
                            setting.topk, rows[0].as_dict(), base)
    trained_row['trained_setting'] = True
    native['rows'].append(trained_row)
    for r in rows[1:]:
        if (r.M, r.topk) == (setting.num_experts, setting.topk):   # itself
            if r.mIoU != trained_row['mIoU']:
                study.result['errors'].append(
                    f"native {setting.label}: set to its own setting at test "
                    f"time it gave mIoU {r.mIoU}, as trained {trained_row['mIoU']}")
            continue
        native['rows'].append(from_sweep(r, base, f'{trained}, tested at {r.ran}', 'native'))
    if exact is not None:
        native['rows'].append(study_row(f'{trained}, tested with softmax attention '
                                        '(route-only, every key)', 'native-dense', None, 'N',
                                        dict(mIoU=exact), base))
