"""The swap study's runner: its settings, its stages and the run (``tools/swap_study.py``,
``make swap-study``; the tables and figures are :mod:`projects.swap_study.report`'s).

For each ``(name, config)`` of a standard-attention segmentor on the generated ADE20K-format
data and each training seed (``randomness.seed`` of every training), :func:`run_swap_study`:

1. trains it with MMEngine's Runner (what ``tools/train.py`` runs: :func:`load_config`,
   :func:`prepare_config`, :func:`build_runner`) for ``train_iters`` iterations;
2. evaluates it unswapped, with its training-free peer, token merging (ToMe,
   :func:`~mita_seg.merge_tokens`) at every merge ratio, swapped to MiTA with no retraining for
   every (pool size, top-k) of the sweep, and MiTA with ToMe together
   (:func:`~mita_seg.apis.swap_sweep`: the test loop of ``tools/test.py``), MiTA and ToMe in the
   encoder only (the paper's swap); then with Segmenter's mask head too, its class tokens global
   and, to show why, routed like patches; each row with the whole-model GFLOPs, the attention GMACs
   and the measured images/s; then route-only MiTA with every key in every expert, which is exactly
   softmax attention, so its mIoU must equal the unswapped one (a check of the whole path);
3. calibrates per-layer swap plans (:class:`~mita_seg.apis.calibrate.SwapCalibrator`, on
   training images) at several FLOP budgets (the FLOPs of uniform settings, and ToMe's
   largest reduction) and with fewer calibration images, and evaluates each plan on the
   validation images;
4. for each fine-tune setting, writes the MiTA config + checkpoint pair with
   :func:`~mita_seg.apis.export_swapped` (``tools/export_swapped.py``) and fine-tunes that pair
   with the Runner for ``finetune_iters``; as a control, trains the unswapped model for the
   same iterations from the same checkpoint with the same schedule;
5. records which tokens the routed experts select at one setting (the paper's M = k = 49 by
   default) on a few validation images (:mod:`mita_seg.analysis.token_selection`);
6. trains the same architecture from scratch *with MiTA* at each ``native`` setting (the
   paper's second claim: train with small experts, enlarge them at inference) for as many
   iterations, evaluates each over the same (pool size, top-k) grid with no retraining, and
   maps its token selection by depth.

Every row is then reported over the seeds (:func:`aggregate`: mean, sample standard deviation
and the per-seed values). It writes ``WORK_DIR/swap_study.json`` (every number, the machine,
the settings, the times),
``WORK_DIR/swap_study.md`` (the tables) and the figures (mIoU against GFLOPs and against
images/s, mIoU against the test-time setting of the MiTA-trained models, the selection maps).
Each training run's results are also kept in ``WORK_DIR/<name>/seed<seed>/result.json``; with
``reuse=True`` a run whose results were computed with the same settings is not run again (so a
model or a seed can be added to a finished study), and trained checkpoints already there
(``WORK_DIR/<name>/seed<seed>/train/iter_<iters>.pth``) are taken as they are.
"""
import copy
import gc
import json
import os
import os.path as osp
import platform
import time
import traceback
from statistics import mean, stdev
from dataclasses import dataclass, fields, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmengine.config import Config, ConfigDict
from mmengine.model import is_model_wrapper
from mmengine.runner import Runner

from mita_seg.analysis.attention_macs import attention_gmacs
from mita_seg.analysis.timing import cpu_description, median_time
from mita_seg.apis import (build_runner, export_swapped, init_model, load_config,
                           merge_model, mita_config, prepare_config, swap_model, swap_sweep)
from mita_seg.apis.calibrate import CalibrationError, SwapCalibrator
from mita_seg.apis.sweep import SweepPoint, SweepRow, model_gflops, sweep_points
from mita_seg.models import NothingToMergeError, SwapPlan
from mita_seg.models.grid import grid_context
from mita_seg.setting import CALIBRATION_CANDIDATES, MiTASetting, label as label_of
from .report import markdown, plot_native, plot_study

LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')
# route-only MiTA with every key in every expert: exactly softmax attention (k is clamped to N)
EXACT = dict(with_shared_expert=False, topk=10**6)
# the calibration's per-layer candidates in the study: finer steps of cost than
# calibrate_swap's default (P 4/5/7 x k 16/49/100), so that the knapsack has settings to trade
# between layers (docs/swap_study.md shows both)
STUDY_CANDIDATES = ('dense', ) + tuple(
    f'{p}:{k}' for p in (4, 5, 6, 7, 8, 9, 10) for k in (8, 16)) + ('7:49', '4:16:route',
                                                                    '7:16:route')
PAPER = MiTASetting.parse('7:49')   # the paper's M = k = 49
# the row kinds in the order of the tables (the paper's row, MiTA M = k = 49 in the encoder
# only, goes first: :func:`aggregate`)
KINDS = ('baseline', 'swap', 'swap-head', 'swap-head-routed', 'tome', 'tome-head', 'swap+tome',
         'check', 'plan', 'finetune', 'control')
# the numbers of a row that are averaged over the seeds
NUMBERS = ('mIoU', 'mAcc', 'aAcc', 'attn_GMACs', 'model_GFLOPs', 'img_per_s', 'delta_mIoU',
           'model_reduction_%', 'speedup')


@dataclass
class StudySettings:
    """What the study runs; every model gets the same.

    Args:
        data_root (str): the ADE20K-format data (``tools/dataset/make_tiny_ade20k.py``), set
            as ``data_root`` of the three dataloaders of every config.
        seeds (tuple[int]): training seeds (``randomness.seed`` of every training of a run):
            every model is trained, and studied, once per seed. Default: (2027, 2028, 2029).
        train_iters (int): iterations of the standard-attention training. Default: 120.
        model_train_iters (dict, optional): training iterations of some models, by name,
            instead of ``train_iters`` (a model that needs longer to use its attention).
            Default: None.
        finetune_iters (int): iterations of each fine-tune (and of the control). Default: 40.
        finetune_lr_mult (float): the fine-tune's (and control's) learning rate, as a multiple
            of the config's. Default: 0.1.
        pool_sizes (tuple[int]): landmark grid sides P of the sweep (M = P * P).
            Default: (4, 5, 7, 8, 10).
        topks (tuple[int]): keys per routed expert of the sweep. Default: (8, 16, 49, 100).
        finetune (tuple[MiTASetting]): the settings exported and fine-tuned.
            Default: (``7:49``, ), the paper's M = k = 49.
        control (bool): also train the unswapped model for ``finetune_iters`` more
            iterations (what the fine-tune gains from training alone). Default: True.
        exact_check (bool): evaluate route-only MiTA with every key (must equal the
            unswapped mIoU). Default: True.
        selection (MiTASetting, optional): the setting of the token-selection maps; None
            for none. Default: ``7:49``.
        selection_images (int): validation images mapped. Default: 2.
        merge_ratios (tuple[float]): token-merging (ToMe) ratios evaluated beside the sweep,
            in ``[0, 0.5]``; none for no ToMe rows. Default: (0.2, 0.3, 0.4, 0.5).
        head_settings (tuple[MiTASetting]): settings at which Segmenter's mask head is
            swapped too (``include_head=True``), once with its class tokens global (the
            default), once routed like patches (``global_suffix=False``). Default: (``7:49``, ).
        merge_head (bool): each ToMe ratio also with Segmenter's mask head merged (besides the
            encoder only). Default: True.
        merged_swaps (tuple[tuple[MiTASetting, float]]): ``(setting, ratio)``: MiTA with
            ToMe (the MLPs of MiTA layers merged). Default: ((``7:49``, 0.5), ).
        plan_budgets (tuple[str]): FLOP budgets of the calibrated plans: a setting (``7:49``)
            the FLOPs of every layer on it, ``'tome'`` the reduction of the largest ToMe
            ratio. Default: ('7:49', '7:16', '4:16', 'tome').
        calibration_images (int): training images each plan is calibrated on. Default: 16.
        calibration_counts (tuple[int]): further image counts, calibrated at the first
            budget only (how the plan moves with the images). Default: (4, 8).
        calibration_candidates (tuple[str], optional): per-layer candidates
            (``dense``, ``7:49``, ``4:16:route``); None for the calibration's
            defaults (dense, pool 4/5/7 x k 16/49/100, with and without the shared expert).
            Default: :data:`STUDY_CANDIDATES` (dense, P 4 to 10 x k 8/16, 7:49, two
            route-only).
        native (tuple[MiTASetting]): settings the architecture is also trained with from
            scratch, with MiTA, for as many iterations, then evaluated over the sweep's grid.
            Default: (``4:16``, ``7:49``).
        native_models (tuple[str], optional): the models that get the ``native`` runs; None
            for all. Default: ('segmenter', ).
        speed_min_run_time (float): seconds of timing per row (images/s is the median of
            ``torch.utils.benchmark.Timer`` over one test batch). Default: 1.0.
        workers (int): dataloader worker processes. Default: 0.
        cfg_options (dict, optional): ``--cfg-options`` for every config. Default: None.
        reuse (bool): reuse models' results and trained checkpoints already in the work
            dir when they were made with the same settings. Default: False.
        verbose (bool): the Runner's full console (config dump, per-class tables).
            Default: False.
    """
    data_root: str
    seeds: Tuple[int, ...] = (2027, 2028, 2029)
    train_iters: int = 120
    model_train_iters: Optional[Dict[str, int]] = None
    finetune_iters: int = 40
    finetune_lr_mult: float = 0.1
    pool_sizes: Tuple[int, ...] = (4, 5, 7, 8, 10)
    topks: Tuple[int, ...] = (8, 16, 49, 100)
    finetune: Tuple[MiTASetting, ...] = (PAPER, )
    control: bool = True
    exact_check: bool = True
    selection: Optional[MiTASetting] = PAPER
    selection_images: int = 2
    merge_ratios: Tuple[float, ...] = (0.2, 0.3, 0.4, 0.5)
    head_settings: Tuple[MiTASetting, ...] = (PAPER, )
    merge_head: bool = True
    merged_swaps: Tuple[Tuple[MiTASetting, float], ...] = ((PAPER, 0.5), )
    plan_budgets: Tuple[str, ...] = ('7:49', '7:16', '4:16', 'tome')
    calibration_images: int = 16
    calibration_counts: Tuple[int, ...] = (4, 8)
    calibration_candidates: Optional[Tuple[str, ...]] = STUDY_CANDIDATES
    native: Tuple[MiTASetting, ...] = (MiTASetting.parse('4:16'), PAPER)
    native_models: Optional[Tuple[str, ...]] = ('segmenter', )
    speed_min_run_time: float = 1.0
    workers: int = 0
    cfg_options: Optional[dict] = None
    reuse: bool = False
    verbose: bool = False

    def check(self) -> 'StudySettings':
        """Raise ``ValueError`` naming a bad setting and what it must be."""
        if not osp.isdir(osp.join(self.data_root, 'images')):
            raise FileNotFoundError(
                f'data_root {self.data_root!r} has no images/ folder: write the data with '
                f'tools/dataset/make_tiny_ade20k.py --out {self.data_root} --size 256')
        iters = dict(train_iters=self.train_iters, finetune_iters=self.finetune_iters)
        iters.update({f'model_train_iters[{k!r}]': v
                      for k, v in (self.model_train_iters or {}).items()})
        for name, value in iters.items():
            if value < 2:
                raise ValueError(f'{name} must be >= 2 (warm-up, then decay), got {value}')
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f'give at least one seed, each once; got {self.seeds}')
        if not self.pool_sizes or not self.topks or min((*self.pool_sizes, *self.topks)) < 1:
            raise ValueError('pool sizes and top-k values must be >= 1, got '
                             f'pool_sizes={self.pool_sizes}, topks={self.topks}')
        settings = dict(finetune=self.finetune, native=self.native,
                        head_settings=self.head_settings,
                        selection=() if self.selection is None else (self.selection, ),
                        merged_swaps=tuple(m for m, _ in self.merged_swaps))
        for name, values in settings.items():
            bad = [v for v in values if not isinstance(v, MiTASetting)]
            if bad:
                raise ValueError(f'{name}: {bad[0]!r} is not a MiTASetting; give e.g. '
                                 "MiTASetting.parse('7:49')")
        if self.finetune_lr_mult <= 0 or self.speed_min_run_time <= 0:
            raise ValueError('finetune_lr_mult and speed_min_run_time must be > 0, got '
                             f'{self.finetune_lr_mult} and {self.speed_min_run_time}')
        if self.selection_images < 0 or self.workers < 0:
            raise ValueError('selection_images and workers must be >= 0, got '
                             f'{self.selection_images} and {self.workers}')
        ratios = list(self.merge_ratios) + [r for _, r in self.merged_swaps]
        if any(not 0 <= r <= 0.5 for r in ratios):
            raise ValueError(f'merge ratios must be in [0, 0.5] (bipartite matching merges at '
                             f'most half of the tokens), got {ratios}')
        if self.calibration_images < 1 or any(n < 1 for n in self.calibration_counts):
            raise ValueError('calibration_images and calibration_counts must be >= 1, got '
                             f'{self.calibration_images} and {self.calibration_counts}')
        candidates = self.candidates()
        # a bad candidate: MiTASettingError, a ValueError
        settings = [MiTASetting.parse_or_dense(c) for c in candidates]
        for budget in self.plan_budgets:
            if budget == 'tome':
                if not self.merge_ratios:
                    raise ValueError("plan budget 'tome' needs merge_ratios (it is the FLOPs "
                                     'of the largest ratio): give some, or drop the budget')
            elif MiTASetting.parse_or_dense(budget) not in settings:
                raise ValueError(f'plan budget {budget!r}: give a calibration candidate '
                                 f"({' '.join(candidates)}) or 'tome'")
        return self

    def candidates(self) -> Tuple[str, ...]:
        """The calibration's per-layer candidates (the calibration's defaults if None)."""
        return tuple(self.calibration_candidates or CALIBRATION_CANDIDATES)

    def for_run(self, name: str, seed: int) -> 'StudySettings':
        """The settings of model ``name`` trained with ``seed``: that seed only;
        ``train_iters`` from ``model_train_iters`` if it names the model; no ``native`` runs
        unless ``native_models`` names it (or is None)."""
        native = self.native if self.native_models is None or name in self.native_models \
            else ()
        return replace(self, seeds=(seed, ), model_train_iters=None, native_models=None,
                       native=native,
                       train_iters=(self.model_train_iters or {}).get(name, self.train_iters))

    def key(self) -> dict:
        """The settings that determine a model's results (not ``reuse``/``verbose``)."""
        d = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        for k in ('reuse', 'verbose'):
            d.pop(k)
        for k in ('model_train_iters', 'native_models'):   # resolved by for_model
            if d[k] is None:
                d.pop(k)
        return json.loads(json.dumps(d))


def _plain(value):
    """``value`` for JSON: a setting as its spelling (``7:49``), tuples as lists."""
    if isinstance(value, MiTASetting):
        return value.text
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def tag_of(setting: MiTASetting) -> str:
    """A setting in file names: ``p7_k49``, ``p4x6_k16``, ``p7_k49_route``."""
    text = setting.text.replace(':route', '_route').replace(':', '_k')
    return 'p' + text.replace(' ', '_').replace('=', '')


class Progress:
    """Prints ``[swap_study +MMmSSs] line`` and appends it to ``log_file``."""

    def __init__(self, log_file: Optional[str] = None,
                 echo: Callable[[str], None] = lambda s: print(s, flush=True)):
        self.start = time.time()
        self.log_file = log_file
        self.echo = echo

    def elapsed(self) -> float:
        return time.time() - self.start

    def __call__(self, line: str) -> None:
        m, s = divmod(int(self.elapsed()), 60)
        text = f'[swap_study +{m:d}m{s:02d}s] {line}'
        self.echo(text)
        if self.log_file:
            with open(self.log_file, 'a') as f:
                f.write(f'{time.strftime("%H:%M:%S")} {text}\n')


def machine() -> dict:
    """The CPU in words (name, family, vCPUs, vector units:
    :func:`mita_seg.analysis.timing.cpu_description`), torch's threads and the versions."""
    import mmcv
    import mmengine
    import mmseg
    return dict(cpu=cpu_description(), cores=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, mmseg=mmseg.__version__,
                mmengine=mmengine.__version__, mmcv=mmcv.__version__,
                python=platform.python_version())


def data_options(data_root: str, workers: int = 0) -> dict:
    """``--cfg-options`` that point the three dataloaders at ``data_root``."""
    opts = {}
    for loader in LOADERS:
        opts[f'{loader}.dataset.data_root'] = data_root
        opts[f'{loader}.num_workers'] = workers
        opts[f'{loader}.persistent_workers'] = workers > 0
    return opts


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


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if is_model_wrapper(model) else model


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


def images_per_second(model: nn.Module, batch: dict, min_run_time: float) -> Dict[str, float]:
    """Test-mode images/s of ``model`` on ``batch`` (``test_step``: preprocessing, forward
    under the config's test mode, post-processing), the median of
    :func:`mita_seg.analysis.timing.median_time` (``torch.utils.benchmark.Timer`` with
    torch's threads)."""

    def run():
        with torch.no_grad():
            model.test_step(batch)

    model.eval()
    return {'img_per_s': len(batch['inputs']) / median_time(run, min_run_time)}


def evaluate(cfg: Config, checkpoint: str, work_dir: str, settings: StudySettings) -> dict:
    """mIoU (the test loop of ``tools/test.py``), cost and images/s of ``cfg`` with
    ``checkpoint``."""
    cfg.work_dir = work_dir
    prepare_config(cfg, checkpoint=checkpoint)
    runner = build_runner(cfg, settings.verbose)
    metrics = runner.test()
    model = _unwrap(runner.model)
    batch = next(iter(runner.test_dataloader))
    row = dict(mIoU=float(metrics['mIoU']), mAcc=float(metrics['mAcc']),
               aAcc=float(metrics['aAcc']), attn_GMACs=attention_gmacs(model, [batch]),
               model_GFLOPs=model_gflops(model, batch),
               **images_per_second(model, batch, settings.speed_min_run_time))
    del runner, model
    gc.collect()
    return row


def validation_images(cfg: Config, count: int) -> List[str]:
    """The first ``count`` images (sorted) of the config's test set."""
    ds = cfg.test_dataloader.dataset
    folder = osp.join(ds.data_root, ds.get('data_prefix', {}).get('img_path', ''))
    names = sorted(n for n in os.listdir(folder)
                   if n.lower().endswith(('.jpg', '.jpeg', '.png')))
    return [osp.join(folder, n) for n in names[:count]]


def selection_maps(cfg: Config, checkpoint: str, setting: MiTASetting, images: Sequence[str],
                   fig_dir: str, name: str, how: str = 'swapped without retraining') -> dict:
    """Token-selection maps of the checkpoint on MiTA at ``setting`` (a standard-attention
    one swapped, or a MiTA one set to it): one PNG per image in ``fig_dir`` and the per-layer
    fractions of tokens that no routed expert selects / reads, averaged over ``images``."""
    from mita_seg.analysis.token_selection import plot_selection_overlay, record_image
    model = init_model(copy.deepcopy(cfg), checkpoint, mita_cfg=setting.cfg())
    model.test_cfg = ConfigDict(mode='whole')  # one grid per image, aligned with the input
    patch = model.cfg.model.backbone.get('patch_size', None)
    figures, never_sel, never_used, layers = [], {}, {}, {}
    for path in images:
        records, image = record_image(model, path)
        stem = osp.splitext(osp.basename(path))[0]
        figures.append(plot_selection_overlay(
            image, records, osp.join(fig_dir, f'{name}_token_selection_{stem}.png'),
            cell_size=(patch, patch) if patch else None,
            title=f'{name}, {stem}: tokens selected by MiTA routed experts ({setting.label}, '
            f'{how})'))
        for r in records:
            never_sel.setdefault(r.name, []).append(r.frac_never_selected)
            never_used.setdefault(r.name, []).append(r.frac_never_used)
            layers[r.name] = dict(grid=list(r.hw_shape), M=r.num_experts, topk=r.topk,
                                  tokens=int(r.selected.shape[-1]))
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return dict(setting=setting.text, label=setting.label, how=how, images=list(images),
                figures=figures,
                layers={k: dict(v, never_selected=mean(never_sel[k]),
                                never_used=mean(never_used[k])) for k, v in layers.items()})


def _row(setting: str, kind: str, M, topk, values: dict, base: Optional[dict],
         merge_ratio: Optional[float] = None) -> dict:
    """A table row with the reductions against ``base`` (the unswapped row)."""
    row = dict(setting=setting, kind=kind, M=M, topk=topk)
    if merge_ratio is not None:
        row['merge_ratio'] = merge_ratio
    row.update({k: values.get(k) for k in ('mIoU', 'mAcc', 'aAcc', 'attn_GMACs',
                                           'model_GFLOPs', 'img_per_s')})
    base = base or row
    row['delta_mIoU'] = row['mIoU'] - base['mIoU']
    if row['model_GFLOPs'] is not None:
        row['model_reduction_%'] = 100.0 * (1 - row['model_GFLOPs'] / base['model_GFLOPs'])
    if row['img_per_s'] is not None:
        row['speedup'] = row['img_per_s'] / base['img_per_s']
    return row


def _sweep_row(r: SweepRow, base: Optional[dict], setting: Optional[str] = None,
               kind: Optional[str] = None) -> dict:
    """:func:`_row` of a :func:`swap_sweep` row (its label and kind unless given)."""
    if setting is None:
        setting = 'unswapped (softmax attention)' if r.kind == 'baseline' else r.label
    return _row(setting, kind or r.kind, r.M, r.topk, r.as_dict(), base,
                merge_ratio=r.merge_ratio)


def _test_runner(config, opts: dict, checkpoint: str, work_dir: str, s: StudySettings,
                 mita_cfg: Optional[dict] = None) -> Tuple[Runner, nn.Module]:
    """A Runner with the test loop of ``config`` (on MiTA with ``mita_cfg`` if given) and
    ``checkpoint``, and its model."""
    cfg = load_config(config, opts, work_dir)
    if mita_cfg:
        cfg = mita_config(cfg, mita_cfg)
    prepare_config(cfg, checkpoint=checkpoint)
    runner = build_runner(cfg, s.verbose)
    return runner, _unwrap(runner.model)


def _every_key_miou(runner: Runner, model: nn.Module, pool: int) -> float:
    """The test mIoU of ``model`` on route-only MiTA with every key in every expert: exactly
    softmax attention."""
    swap_model(model, dict(EXACT, pool_size=pool), verbose=False)
    return float(runner.test()['mIoU'])


def calibrate_plans(config: str, opts: dict, checkpoint: str, work_dir: str,
                    s: StudySettings, rows: Sequence[dict], progress: Callable[[str], None],
                    notes: List[str]) -> List[Tuple[SwapPlan, dict]]:
    """Per-layer swap plans of ``checkpoint`` calibrated on training images: one per budget of
    ``s.plan_budgets`` with ``s.calibration_images`` images, and one at the first budget for
    each count of ``s.calibration_counts``; each saved as ``WORK_DIR/plans/<tag>.json``.

    Args:
        rows (Sequence[dict]): the study's rows so far (budget ``'tome'``: the reduction of
            the ToMe row of the largest ratio).
        notes (list[str]): gets a line for each budget skipped (no ToMe row, or ToMe
            cheaper than the cheapest plan).

    Returns:
        list[tuple[SwapPlan, dict]]: each plan and what the table says of it: ``label``,
        ``budget``, ``images``, ``file``, ``summary``, ``layers`` (each layer's setting),
        ``predicted_error``, ``calibration_seconds``.
    """
    candidates = s.candidates()
    tome = [r for r in rows if r['kind'] == 'tome']
    out = []
    counts = [s.calibration_images] + [n for n in s.calibration_counts
                                       if n != s.calibration_images]
    for count in counts:
        cal = SwapCalibrator(load_config(config, opts), checkpoint, count, candidates,
                             progress=progress)
        budgets = s.plan_budgets if count == s.calibration_images else s.plan_budgets[:1]
        for budget in budgets:
            if budget == 'tome':
                if not tome:
                    notes.append("no plan at budget 'tome': this model has no ToMe rows")
                    continue
                top = max(tome, key=lambda r: r['merge_ratio'])
                what = f"the FLOPs of ToMe r={top['merge_ratio']:.2f}"
                tag = 'tome'
                try:
                    plan = cal.plan(reduction=top['model_reduction_%'] / 100)
                except CalibrationError as e:    # ToMe cheaper than any plan: a finding
                    notes.append(f'no plan at {what}: {e}')
                    continue
            else:
                plan = cal.plan(budget_uniform=budget)
                setting = MiTASetting.parse_or_dense(budget)
                what = f"the FLOPs of {'MiTA ' + setting.label if setting else 'dense'}"
                tag = tag_of(setting) if setting else 'dense'
            os.makedirs(osp.join(work_dir, 'plans'), exist_ok=True)
            path = plan.save(osp.join(work_dir, 'plans', f'{tag}_{count}img.json'))
            info = dict(label=f'calibrated plan, {what}, {count} images', budget=budget,
                        images=count, file=path, summary=plan.summary(),
                        layers={n: label_of(v) for n, v in plan.layers.items()},
                        predicted_error=plan.info['calibration']['predicted_error'],
                        calibration_seconds=plan.info['calibration']['seconds'])
            progress(f"plan at {what}, {count} images: {info['summary']}; "
                     + ', '.join(f'{n}: {v}' for n, v in info['layers'].items()))
            out.append((plan, info))
    return out


def study_model(name: str, config: str, work_dir: str, settings: StudySettings,
                progress: Callable[[str], None], fig_dir: str) -> dict:
    """Train, sweep, fine-tune and map one model with one seed (``settings.seeds``, one:
    :meth:`StudySettings.for_run`; see the module docstring).

    Returns:
        dict: ``name, config, seed, input, train, rows, selection, seconds, load, errors``;
        ``rows`` as in :func:`_row` with ``kind`` one of :data:`KINDS`.
    """
    t_model = time.time()
    s = settings
    (seed, ) = s.seeds
    opts = dict(data_options(s.data_root, s.workers), **(s.cfg_options or {}))
    opts['randomness.seed'] = seed
    result = dict(name=name, config=config, seed=seed, settings=s.key(), rows=[], errors=[],
                  load=[], notes=[], native=[], started=time.strftime('%Y-%m-%d %H:%M:%S'))
    files = f'{name}_seed{seed}'   # figure names

    def load(stage):
        result['load'].append((stage, round(os.getloadavg()[0], 2)))

    def stage(label, fn):
        """Run one stage; an error is recorded (and the study goes on with the others)."""
        progress(f'{name}: {label}')
        load(label)
        t0 = time.time()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001  recorded, reported, exit status 1 at the end
            msg = f'{label}: {type(e).__name__}: {e}'
            result['errors'].append(msg)
            progress(f'{name}: FAILED {msg}\n{traceback.format_exc()}')
            return None
        progress(f'{name}: {label} done in {time.time() - t0:.0f}s')
        return out

    # 1. train with standard attention
    def do_train():
        cfg = schedule(load_config(config, opts), s.train_iters)
        return train(cfg, osp.join(work_dir, 'train'), s.verbose, s.reuse)

    trained = stage(f'training {s.train_iters} iterations (standard attention)', do_train)
    if trained is None:
        return result
    ckpt, seconds, reused = trained
    result['train'] = dict(iters=s.train_iters, seconds=round(seconds, 1), checkpoint=ckpt,
                           reused=reused)

    # 2. unswapped, ToMe, the sweep, MiTA + ToMe, route-only check
    measure = lambda model, batch: images_per_second(model, batch,  # noqa: E731
                                                     s.speed_min_run_time)
    merge_cfg = dict(include_head=False)   # the encoder only, as MiTA

    def do_sweep():
        runner, model = _test_runner(config, opts, ckpt, osp.join(work_dir, 'sweep'), s)
        swap_model(copy.deepcopy(model), {}, verbose=False)  # nothing to swap: error now
        ratios, merged = s.merge_ratios, s.merged_swaps
        if ratios or merged:
            try:
                merge_model(copy.deepcopy(model), 0.5, verbose=False, **merge_cfg)
            except NothingToMergeError as e:
                result['notes'].append(f'no ToMe rows: {e}')
                progress(f'{name}: no ToMe rows: {e}')
                ratios, merged = (), ()
        points = sweep_points(s.pool_sizes, s.topks, merge_ratios=ratios, merged_swaps=merged)
        rows = swap_sweep(runner, points, measure=measure, merge_cfg=merge_cfg,
                          progress=lambda line: progress(f'{name}: sweep {line}'))
        batch = next(iter(runner.test_dataloader))
        result['input'] = list(batch['inputs'][0].shape[-2:])
        result['test_images'] = len(runner.test_dataloader.dataset)
        result['patch_size'] = runner.cfg.model.backbone.get('patch_size')
        exact = None
        if s.exact_check:
            progress(f'{name}: route-only MiTA with every key (exactly softmax attention)')
            if ratios or merged:
                merge_model(model, 0.0, verbose=False, **merge_cfg)
            exact = _every_key_miou(runner, model, min(s.pool_sizes))
        del runner, model
        gc.collect()
        return rows, exact

    swept = stage(f'unswapped, {len(s.merge_ratios)} ToMe ratios, '
                  f'{len(s.pool_sizes) * len(s.topks)} MiTA settings and '
                  f'{len(s.merged_swaps)} MiTA + ToMe in the encoder, no retraining', do_sweep)
    if swept is None:
        return result
    rows, exact = swept
    base = None
    for r in rows:
        result['rows'].append(_sweep_row(r, base))
        base = base or result['rows'][0]
    if exact is not None:
        result['rows'].append(_row('route-only MiTA, every key (check: = unswapped)', 'check',
                                   None, 'N', dict(mIoU=exact), base))

    # 2b. the mask head too: MiTA with its class tokens global, and routed like patches
    # (each on a model of its own: a later encoder-only swap keeps a swapped head); ToMe
    head_ratios = s.merge_ratios if s.merge_head and any(
        r['kind'] == 'tome' for r in result['rows']) else ()

    def do_head():
        out = []
        for kind, routed in (('swap-head', False), ('swap-head-routed', True)):
            runner, model = _test_runner(config, opts, ckpt, osp.join(work_dir, 'head'), s)
            if swap_model(copy.deepcopy(model), dict(include_head=True), verbose=False) == \
                    swap_model(copy.deepcopy(model), {}, verbose=False):
                result['notes'].append('no head rows: the decode head has no attention')
                return out
            grid_context(model.decode_head).global_suffix = not routed
            points = sweep_points(merge_ratios=() if routed else head_ratios)
            points += [SweepPoint('swap', h) for h in s.head_settings]
            rows = swap_sweep(runner, points, swap_cfg=dict(include_head=True),
                              merge_cfg=dict(include_head=True), measure=measure,
                              progress=lambda line: progress(f'{name}: {kind} {line}'))
            if rows[0].mIoU != base['mIoU']:   # the same model, the same test
                result['errors'].append(f'{kind}: the unswapped model gave mIoU '
                                        f"{rows[0].mIoU}, {base['mIoU']} in the sweep")
            how = 'class tokens routed' if routed else 'class tokens global'
            for r in rows[1:]:
                if r.kind == 'tome':
                    out.append(_sweep_row(r, base, f'{r.label}, with the head', 'tome-head'))
                else:
                    out.append(_sweep_row(r, base, f'{r.label}, with the head ({how})', kind))
            del runner, model
            gc.collect()
        return out

    if s.head_settings or head_ratios:
        head = stage(f'the mask head too: MiTA at {len(s.head_settings)} setting(s) (class '
                     f'tokens global, then routed), {len(head_ratios)} ToMe ratio(s)', do_head)
        result['rows'] += head or []

    # 3. calibrated per-layer plans at several budgets, then evaluated
    if s.plan_budgets:
        plans = stage(f'calibrated plans at {len(s.plan_budgets)} budget(s) on '
                      f'{s.calibration_images} training images, and at the first with '
                      f'{list(s.calibration_counts)} images',
                      lambda: calibrate_plans(config, opts, ckpt, work_dir, s, result['rows'],
                                              lambda line: progress(f'{name}: {line}'),
                                              result['notes']))
        if plans:
            def do_plans():
                runner, _ = _test_runner(config, opts, ckpt, osp.join(work_dir, 'plans'), s)
                out = swap_sweep(runner, sweep_points(plans=[p for p, _ in plans]),
                                 measure=measure,
                                 progress=lambda line: progress(f'{name}: plans {line}'))
                del runner
                gc.collect()
                return out

            evaluated = stage(f'{len(plans)} calibrated plan(s) on the validation images',
                              do_plans)
            if evaluated is not None:
                if evaluated[0].mIoU != base['mIoU']:   # the same model, the same test
                    result['errors'].append(
                        f"plans: the unswapped model gave mIoU {evaluated[0].mIoU} before "
                        f"the plans, {base['mIoU']} in the sweep")
                for r, (plan, info) in zip(evaluated[1:], plans):
                    row = _sweep_row(r, base, info['label'])
                    row.update(plan=info)
                    result['rows'].append(row)

    # 4. fine-tune the exported pair, and the control
    for setting in s.finetune:
        tag = tag_of(setting)

        def do_finetune(setting=setting, tag=tag):
            out_cfg, out_ckpt = export_swapped(config, ckpt,
                                               osp.join(work_dir, f'finetune_{tag}', 'export'),
                                               setting.cfg(), opts)
            cfg = schedule(load_config(out_cfg), s.finetune_iters, s.finetune_lr_mult)
            ft_ckpt, ft_s, _ = train(cfg, osp.join(work_dir, f'finetune_{tag}', 'train'),
                                  s.verbose, s.reuse)
            values = evaluate(load_config(out_cfg), ft_ckpt,
                              osp.join(work_dir, f'finetune_{tag}', 'test'), s)
            return dict(values, exported=[out_cfg, out_ckpt], checkpoint=ft_ckpt,
                        seconds=round(ft_s, 1))

        ft = stage(f'export MiTA {setting.label} and fine-tune it '
                   f'{s.finetune_iters} iterations', do_finetune)
        if ft is not None:
            row = _row(f'MiTA {setting.label}, fine-tuned {s.finetune_iters} it',
                       'finetune', setting.num_experts, setting.topk, ft, base)
            row.update(exported=ft['exported'], checkpoint=ft['checkpoint'],
                       train_seconds=ft['seconds'])
            result['rows'].append(row)

    if s.control:
        def do_control():
            cfg = schedule(load_config(config, opts), s.finetune_iters, s.finetune_lr_mult)
            cfg.load_from = ckpt
            c_ckpt, c_s, _ = train(cfg, osp.join(work_dir, 'control', 'train'), s.verbose,
                                s.reuse)
            values = evaluate(load_config(config, opts), c_ckpt,
                              osp.join(work_dir, 'control', 'test'), s)
            return dict(values, checkpoint=c_ckpt, seconds=round(c_s, 1))

        ctl = stage(f'control: unswapped, trained {s.finetune_iters} more iterations', do_control)
        if ctl is not None:
            row = _row(f'unswapped, trained {s.finetune_iters} it more (control)', 'control',
                       None, None, ctl, base)
            row.update(checkpoint=ctl['checkpoint'], train_seconds=ctl['seconds'])
            result['rows'].append(row)

    # 5. token selection at one setting
    if s.selection and s.selection_images:
        def do_selection():
            cfg = load_config(config, opts)
            return selection_maps(cfg, ckpt, s.selection,
                                  validation_images(cfg, s.selection_images), fig_dir, files)

        sel = stage(f'token selection at {s.selection.label} on '
                    f'{s.selection_images} validation image(s)', do_selection)
        if sel is not None:
            result['selection'] = sel

    # 6. trained with MiTA from scratch, evaluated over the grid
    for setting in s.native:
        native = dict(setting=setting.text, label=setting.label, rows=[])
        mita = setting.cfg()
        ndir = osp.join(work_dir, f'native_{tag_of(setting)}')

        def do_native_train(mita=mita, ndir=ndir):
            cfg = mita_config(load_config(config, opts), mita)
            os.makedirs(ndir, exist_ok=True)
            cfg.dump(osp.join(ndir, 'config.py'))   # for tools/test.py --mita-cfg ...
            return train(schedule(cfg, s.train_iters), osp.join(ndir, 'train'), s.verbose,
                         s.reuse)

        trained = stage(f'training {s.train_iters} iterations with MiTA {setting.label} '
                        'from scratch', do_native_train)
        if trained is None:
            continue
        n_ckpt, n_s, n_reused = trained
        native['train'] = dict(iters=s.train_iters, seconds=round(n_s, 1), checkpoint=n_ckpt,
                               reused=n_reused, config=osp.join(ndir, 'config.py'))

        def do_native_sweep(mita=mita, ndir=ndir, n_ckpt=n_ckpt):
            runner, model = _test_runner(config, opts, n_ckpt, osp.join(ndir, 'sweep'), s,
                                         mita)
            rows = swap_sweep(runner, sweep_points(s.pool_sizes, s.topks), measure=measure,
                              progress=lambda line: progress(f'{name}: native {line}'))
            exact = None
            if s.exact_check:
                exact = _every_key_miou(runner, model, min(s.pool_sizes))
            del runner, model
            gc.collect()
            return rows, exact

        swept = stage(f'MiTA-trained {setting.label}: as trained and at '
                      f'{len(s.pool_sizes) * len(s.topks)} test-time settings', do_native_sweep)
        if swept is not None:
            rows, exact = swept
            trained = f'trained {setting.label}'
            trained_row = _row(f'{trained}, tested as trained', 'native', setting.num_experts,
                               setting.topk, rows[0].as_dict(), base)
            trained_row['trained_setting'] = True
            native['rows'].append(trained_row)
            for r in rows[1:]:
                if (r.M, r.topk) == (setting.num_experts, setting.topk):   # itself
                    if r.mIoU != trained_row['mIoU']:
                        result['errors'].append(
                            f"native {setting.label}: set to its own setting at test "
                            f"time it gave mIoU {r.mIoU}, as trained {trained_row['mIoU']}")
                    continue
                native['rows'].append(_sweep_row(r, base, f'{trained}, tested at {r.ran}',
                                                 'native'))
            if exact is not None:
                native['rows'].append(_row(f'{trained}, tested with softmax attention '
                                           '(route-only, every key)', 'native-dense', None, 'N',
                                           dict(mIoU=exact), base))
        if s.selection_images:
            def do_native_selection(mita=mita, n_ckpt=n_ckpt, setting=setting):
                cfg = mita_config(load_config(config, opts), mita)
                return selection_maps(cfg, n_ckpt, setting,
                                      validation_images(cfg, s.selection_images), fig_dir,
                                      f'{files}_native_{tag_of(setting)}', how='trained with it')

            sel = stage(f'token selection of the MiTA-trained {setting.label}',
                        do_native_selection)
            if sel is not None:
                native['selection'] = sel
        result['native'].append(native)

    load('end')
    result['seconds'] = round(time.time() - t_model, 1)
    result['finished'] = time.strftime('%Y-%m-%d %H:%M:%S')
    return result


def _mean_std(values: Sequence[float]) -> Tuple[float, float]:
    """The mean and the sample standard deviation (n - 1; 0 for one value)."""
    return mean(values), stdev(values) if len(values) > 1 else 0.0


def aggregate_rows(runs: Sequence[Tuple[int, Sequence[dict]]]) -> List[dict]:
    """Rows of several seeds, ``(seed, rows)``, matched by ``(kind, setting)``: each the first
    seed's row with every number of :data:`NUMBERS` the mean over the seeds that have it,
    ``std`` (sample standard deviation, n - 1), ``per_seed`` (``{number: {seed: value}}``)
    and ``seeds`` (how many); in the order of :data:`KINDS`, the paper's row (MiTA
    M = k = 49, encoder only) first."""
    groups: Dict[tuple, List[Tuple[int, dict]]] = {}
    for seed, rows in runs:
        for r in rows:
            groups.setdefault((r['kind'], r['setting']), []).append((seed, r))
    out = []
    for group in groups.values():
        row = dict(group[0][1], seeds=len(group), std={}, per_seed={})
        for k in NUMBERS:
            values = {str(seed): r[k] for seed, r in group if r.get(k) is not None}
            if values:
                row[k], row['std'][k] = _mean_std(list(values.values()))
                row['per_seed'][k] = values
        out.append(row)
    paper = ('swap', PAPER.num_experts, PAPER.topk)
    return sorted(out, key=lambda r: -1 if (r['kind'], r['M'], r['topk']) == paper
                  else KINDS.index(r['kind']) if r['kind'] in KINDS else len(KINDS))


def aggregate(runs: Sequence[dict]) -> dict:
    """One model's runs (:func:`study_model`, one per seed) as one result: its rows, and
    those of each MiTA-trained setting, over the seeds (:func:`aggregate_rows`); the
    training seconds averaged; the first seed's token selection; every run kept in
    ``runs``; the runs' errors and notes, each with its seed."""
    first = runs[0]
    res = dict(name=first['name'], config=first['config'], seeds=[r['seed'] for r in runs],
               runs=list(runs), rows=aggregate_rows([(r['seed'], r['rows']) for r in runs]),
               load=[v for r in runs for v in r['load']],
               seconds=sum(r.get('seconds', 0) for r in runs),
               errors=[f"seed {r['seed']}: {e}" for r in runs for e in r['errors']],
               notes=sorted({n for r in runs for n in r['notes']}), native=[])
    for key in ('input', 'test_images', 'patch_size', 'selection'):
        if key in first:
            res[key] = first[key]
    trained = [r['train'] for r in runs if 'train' in r]
    if trained:
        res['train'] = dict(trained[0], seconds=mean(t['seconds'] for t in trained),
                            reused=any(t['reused'] for t in trained))
    for native in first['native']:
        same = [(r['seed'], n) for r in runs for n in r['native']
                if n['setting'] == native['setting']]
        train = [n['train'] for _, n in same if 'train' in n]
        res['native'].append(dict(
            native, rows=aggregate_rows([(seed, n['rows']) for seed, n in same]),
            **(dict(train=dict(train[0], seconds=mean(t['seconds'] for t in train),
                               reused=any(t['reused'] for t in train))) if train else {})))
    return res


def run_swap_study(models: Sequence[Tuple[str, str]], work_dir: str, settings: StudySettings,
                   fig_dir: Optional[str] = None,
                   progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run the study on every ``(name, config)`` and write its JSON, table and figures.

    Args:
        models (Sequence[tuple[str, str]]): names (used in file names and the table) and
            standard-attention configs (files or ``mmseg::`` names).
        work_dir (str): runs, checkpoints, ``swap_study.json``, ``swap_study.md``.
        settings (StudySettings): what to run (checked first).
        fig_dir (str, optional): where the PNGs go. Default: ``WORK_DIR/figures``.
        progress (Callable, optional): called with each progress line. Default: a
            :class:`Progress` printing to stdout and ``WORK_DIR/progress.log``.

    Returns:
        dict: the study, as written to ``swap_study.json``: ``machine, settings, models,
        figures, outputs, errors``; each model as :func:`study_model` returns it.

    Raises:
        ValueError: a bad setting, duplicate names or no model.
        FileNotFoundError: the data or a config is missing.
    """
    settings.check()
    names = [n for n, _ in models]
    if not models or len(set(names)) != len(names):
        raise ValueError(f'give at least one model, each name once; got {names}')
    for n, c in models:
        if '::' not in c and not osp.isfile(c):
            raise FileNotFoundError(f'config of model {n!r} not found: {c}')
        if not n.replace('-', '').replace('_', '').isalnum():
            raise ValueError(f'model name {n!r}: use letters, digits, - and _ (it names files)')
    fig_dir = fig_dir or osp.join(work_dir, 'figures')
    os.makedirs(work_dir, exist_ok=True)
    os.makedirs(fig_dir, exist_ok=True)
    progress = progress or Progress(osp.join(work_dir, 'progress.log'))
    study = dict(machine=machine(), settings=settings.key(),
                 started=time.strftime('%Y-%m-%d %H:%M:%S'), models=[])
    progress(f"{len(models)} model(s): {', '.join(names)}; {study['machine']['cpu']}, "
             f"{study['machine']['threads']} thread(s); work dir {work_dir}")
    for i, (name, config) in enumerate(models):
        runs = []
        for seed in settings.seeds:
            what = f'[{i + 1}/{len(models)}] {name}, seed {seed}'
            mdir = osp.join(work_dir, name, f'seed{seed}')
            cached = osp.join(mdir, 'result.json')
            run_settings = settings.for_run(name, seed)
            if settings.reuse and osp.isfile(cached):
                with open(cached) as f:
                    res = json.load(f)
                if res.get('settings') == run_settings.key() and \
                        res.get('config') == config and not res.get('errors'):
                    progress(f'{what}: reusing {cached} '
                             f"(computed {res['started']} to {res['finished']})")
                    runs.append(res)
                    continue
            progress(f'{what}: {config}')
            os.makedirs(mdir, exist_ok=True)
            res = study_model(name, config, mdir, run_settings, progress, fig_dir)
            with open(cached, 'w') as f:
                json.dump(res, f, indent=1)
            runs.append(res)
            progress(f"{what}: done in {res.get('seconds', 0):.0f}s")
        study['models'].append(aggregate(runs))
    loads = [v for res in study['models'] for _, v in res['load']]
    study['load_range'] = [min(loads), max(loads)] if loads else [0.0, 0.0]
    study['finished'] = time.strftime('%Y-%m-%d %H:%M:%S')
    study['figures'] = [plot_study(study['models'], osp.join(fig_dir, 'swap_study.png'))]
    study['figures'] += [plot_native(res, osp.join(fig_dir, f"{res['name']}_native.png"))
                         for res in study['models'] if any(
                             n.get('rows') for n in res.get('native', []))]
    study['figures'] += [p for res in study['models']
                         for sel in [res.get('selection', {})] + [
                             n.get('selection', {}) for n in res.get('native', [])]
                         for p in sel.get('figures', [])]
    study['errors'] = [f"{res['name']}: {e}" for res in study['models'] for e in res['errors']]
    study['outputs'] = [osp.join(work_dir, 'swap_study.json'),
                        osp.join(work_dir, 'swap_study.md')]
    with open(study['outputs'][0], 'w') as f:
        json.dump(study, f, indent=1)
    with open(study['outputs'][1], 'w') as f:
        f.write(markdown(study))
    return study
