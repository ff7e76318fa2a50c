"""The swap study's runner: its stages and the run (``tools/swap_study.py``, ``make
swap-study``; its settings are :mod:`projects.swap_study.settings`', the tables and figures
:mod:`projects.swap_study.report`'s).

For each ``(name, config)`` of a standard-attention segmentor on the generated ADE20K-format
data and each training seed (``randomness.seed`` of every training), :func:`run_swap_study`
(a :class:`ModelStudy` per model and seed, a method per stage):

1. trains it with MMEngine's Runner (what ``tools/train.py`` runs: :func:`load_config`,
   :func:`prepare_config`, :func:`build_runner`) for ``train_iters`` iterations;
2. evaluates it unswapped, with its training-free peer, token merging (ToMe,
   :func:`~mita_seg.merge_tokens`) at every merge ratio, swapped to MiTA with no retraining for
   every (pool size, top-k) of the sweep, and MiTA with ToMe together
   (:func:`~mita_seg.apis.swap_sweep`: the test loop of ``tools/test.py``), MiTA and ToMe in the
   encoder only (the paper's swap); then with Segmenter's mask head too, its class tokens global
   and, to show why, routed like patches; each row with the whole-model GFLOPs, the attention GMACs
   and the measured images/s; then route-only MiTA with every key in every expert, which is exactly
   softmax attention, so its mIoU must equal the unswapped one (a check of the whole path),
   and the destructive control, every token reading one key (no token mixing: what a swap
   loses counts only beside what this loses);
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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
from mita_seg.evaluation import ACCURACY_KEYS
from mita_seg.models import NothingToMergeError, SwapPlan
from mita_seg.models.grid import grid_context
from mita_seg.setting import MiTASetting, label as label_of
from mita_seg.utils.cfg_options import CfgOptionsError
from .kinds import kind_points, kind_rows, match_budgets, plot_kinds
from .report import markdown, plot_native, plot_study
from .settings import PAPER, STUDY_CANDIDATES, StudySettings  # noqa: F401 (STUDY_CANDIDATES)

LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')
# route-only MiTA with every key in every expert: exactly softmax attention (k is clamped to N)
EXACT = dict(with_shared_expert=False, topk=10**6)
# the destructive control: one landmark, one key, no shared expert: every token reads the
# same single key, no token mixing (a swap that loses as little as this one says nothing)
ONE_KEY = MiTASetting.parse('1:1:route')
# the row kinds in the order of the tables (the paper's row, MiTA M = k = 49 in the encoder
# only, goes first: :func:`aggregate`)
KINDS = ('baseline', 'swap', 'swap-head', 'swap-head-routed', 'tome', 'tome-head', 'swap+tome',
         'check', 'equal-cost', 'plan', 'finetune', 'control')
# the numbers of a row that are averaged over the seeds (with the long-range scenes' pixel
# accuracy by evidence, their configs' EvidenceAccuracyMetric)
NUMBERS = ('mIoU', 'mAcc', 'aAcc', 'attn_GMACs', 'model_GFLOPs', 'img_per_s', 'delta_mIoU',
           'model_reduction_%', 'speedup') + ACCURACY_KEYS


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


def training_schedule(cfg: Config, iters) -> Config:
    """``cfg`` on the study's schedule of ``iters`` iterations (:func:`schedule`), or on
    its own (its iterations, learning-rate schedule and validation) when ``iters`` is
    ``'config'``."""
    return cfg if iters == 'config' else schedule(cfg, iters)


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


def _iters(iters) -> str:
    """``iters`` (a study setting) in a progress line."""
    return "on the config's schedule" if iters == 'config' else f'{iters} iterations'


def _iters_of(checkpoint: str) -> int:
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
    """The metrics of the test loop of ``tools/test.py`` (mIoU, mAcc, aAcc and whatever
    else the config's test evaluator gives), cost and images/s of ``cfg`` with
    ``checkpoint``."""
    cfg.work_dir = work_dir
    prepare_config(cfg, checkpoint=checkpoint)
    runner = build_runner(cfg, settings.verbose)
    metrics = runner.test()
    model = _unwrap(runner.model)
    batch = next(iter(runner.test_dataloader))
    row = dict({k: float(v) for k, v in metrics.items()},   # mIoU, mAcc, aAcc, acc_* ...
               attn_GMACs=attention_gmacs(model, [batch]),
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
    row.update({k: values[k] for k in ACCURACY_KEYS if k in values})
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


def _merge_error(model: nn.Module) -> Optional[NothingToMergeError]:
    """Why ToMe cannot merge ``model``'s encoder (tried on a copy); None if it can."""
    try:
        merge_model(copy.deepcopy(model), 0.5, verbose=False, **ENCODER_ONLY)
    except NothingToMergeError as e:
        return e
    return None


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


# the layers of ToMe in the study's sweep (the encoder only, as MiTA's swap), and of the rows
# with the mask head too
ENCODER_ONLY = dict(include_head=False)
WITH_HEAD = dict(include_head=True)


class ModelStudy:
    """One model trained with one seed through the study's stages (the module docstring's 1
    to 6), a method per stage, each writing its rows, notes and errors into :attr:`result`
    (what :func:`study_model` returns). A stage that fails is recorded in
    ``result['errors']`` and the study goes on with the others, except after the training
    or the sweep, which the others need; a ``--cfg-options`` value a model cannot be built
    with (:class:`~mita_seg.utils.cfg_options.CfgOptionsError`) ends the study at once.

    Args:
        name (str): the model's name (in progress lines and file names).
        config (str): its standard-attention config.
        work_dir (str): this run's directory (``WORK_DIR/<name>/seed<seed>``).
        settings (StudySettings): the run's settings, one seed (:meth:`StudySettings.for_run`).
        progress (Callable): called with each progress line.
        fig_dir (str): where the selection maps go.

    Attributes:
        opts (dict): the ``--cfg-options`` of every config of the run (the data, the seed).
        result (dict): the run's result so far.
        files (str): the stem of the run's figure names.
        ckpt (str): the trained standard-attention checkpoint (after the training).
        base (dict): the unswapped row, which every row's reductions are against (after the
            sweep).
    """

    def __init__(self, name: str, config: str, work_dir: str, settings: StudySettings,
                 progress: Callable[[str], None], fig_dir: str):
        self.t_model = time.time()
        self.name, self.config, self.work_dir, self.fig_dir = name, config, work_dir, fig_dir
        self.s, self.progress = settings, progress
        (seed, ) = settings.seeds
        self.opts = dict(data_options(settings.data_root, settings.workers),
                         **(settings.cfg_options or {}))
        self.opts['randomness.seed'] = seed
        self.result = dict(name=name, config=config, seed=seed, settings=settings.key(),
                           rows=[], errors=[], load=[], notes=[], native=[],
                           started=time.strftime('%Y-%m-%d %H:%M:%S'))
        self.files = f'{name}_seed{seed}'   # figure names
        self.ckpt: Optional[str] = None
        self.base: Optional[dict] = None

    def run(self) -> dict:
        """Every stage, in order: :attr:`result` (without ``seconds`` and ``finished`` when
        the training or the sweep failed)."""
        s = self.s
        if not self.train_model() or not self.sweep():
            return self.result
        self.head()
        if s.kind_budgets:
            self.kinds()
        if s.plan_budgets:
            self.plans()
        for setting in s.finetune:
            self.finetune(setting)
        if s.control:
            self.control()
        if s.selection and s.selection_images:
            self.selection()
        for setting in s.native:
            self.native(setting)
        self.load('end')
        self.result['seconds'] = round(time.time() - self.t_model, 1)
        self.result['finished'] = time.strftime('%Y-%m-%d %H:%M:%S')
        return self.result

    # --- the machinery of the stages

    def load(self, stage: str) -> None:
        """Record the machine's load (1-minute average) at the start of ``stage``."""
        self.result['load'].append((stage, round(os.getloadavg()[0], 2)))

    def stage(self, label: str, fn: Callable[[], Any]) -> Any:
        """Run one stage, ``fn()``; an error is recorded (and the study goes on with the
        others): None then."""
        progress, name = self.progress, self.name
        progress(f'{name}: {label}')
        self.load(label)
        t0 = time.time()
        try:
            out = fn()
        except CfgOptionsError:   # a --cfg-options value fails every stage alike: one line
            raise
        except Exception as e:  # noqa: BLE001  recorded, reported, exit status 1 at the end
            msg = f'{label}: {type(e).__name__}: {e}'
            self.result['errors'].append(msg)
            progress(f'{name}: FAILED {msg}\n{traceback.format_exc()}')
            return None
        progress(f'{name}: {label} done in {time.time() - t0:.0f}s')
        return out

    def say(self, prefix: str) -> Callable[[str], None]:
        """A progress callback: each line as ``NAME: PREFIXline``."""
        return lambda line: self.progress(f'{self.name}: {prefix}{line}')

    def measure(self, model: nn.Module, batch: dict) -> Dict[str, float]:
        """The images/s of a sweep's row (:func:`images_per_second`)."""
        return images_per_second(model, batch, self.s.speed_min_run_time)

    def sweep_with(self, checkpoint: str, work_dir: str, points, prefix: str,
                   mita_cfg: Optional[dict] = None, after: Optional[Callable] = None,
                   **sweep_cfg) -> Optional[Tuple[List[SweepRow], Any]]:
        """A test Runner of the config with ``checkpoint`` (on MiTA with ``mita_cfg``) in
        ``work_dir``, swept over ``points`` (:func:`swap_sweep` with ``sweep_cfg``, progress
        lines ``PREFIX...``), then freed.

        Args:
            points (list[SweepPoint] | Callable): the points, or
                ``points(runner, model)`` giving them (None: nothing to sweep).
            after (Callable, optional): ``after(runner, model, points)`` after the sweep.

        Returns:
            tuple | None: the rows and what ``after`` returned (None without it); None when
            ``points`` gave None.
        """
        runner, model = _test_runner(self.config, self.opts, checkpoint, work_dir, self.s,
                                     mita_cfg)
        todo = points(runner, model) if callable(points) else points
        out = None
        if todo is not None:
            rows = swap_sweep(runner, todo, measure=self.measure, progress=self.say(prefix),
                              **sweep_cfg)
            out = rows, (after(runner, model, todo) if after else None)
        del runner, model
        gc.collect()
        return out

    def check_base(self, row: SweepRow, what: str, when: str = '') -> None:
        """An error unless ``row``, the unswapped row of a later sweep of the same model on
        the same test, has the sweep's mIoU."""
        if row.mIoU != self.base['mIoU']:
            self.result['errors'].append(f'{what}: the unswapped model gave mIoU '
                                         f"{row.mIoU}{when}, {self.base['mIoU']} in the sweep")

    def add_row(self, row: dict, **extra) -> None:
        """Append ``row`` (with ``extra``) to the result's rows."""
        row.update(extra)
        self.result['rows'].append(row)

    # --- 1. train with standard attention

    def train_model(self) -> bool:
        """Train the standard-attention model (or reuse its checkpoint): True if it is."""
        s = self.s

        def do_train():
            cfg = training_schedule(load_config(self.config, self.opts), s.train_iters)
            return train(cfg, osp.join(self.work_dir, 'train'), s.verbose, s.reuse)

        trained = self.stage(f'training {_iters(s.train_iters)} (standard attention)',
                             do_train)
        if trained is None:
            return False
        self.ckpt, seconds, reused = trained
        self.result['train'] = dict(iters=_iters_of(self.ckpt), seconds=round(seconds, 1),
                                    checkpoint=self.ckpt, reused=reused)
        return True

    # --- 2. unswapped, ToMe, the sweep, MiTA + ToMe, route-only check

    def sweep(self) -> bool:
        """The encoder's sweep (the baseline row first) and the every-key check: True if it
        ran."""
        s = self.s
        swept = self.stage(
            f'unswapped, {len(s.merge_ratios)} ToMe ratios, '
            f'{len(s.pool_sizes) * len(s.topks)} MiTA settings and '
            f'{len(s.merged_swaps)} MiTA + ToMe in the encoder, no retraining',
            lambda: self.sweep_with(self.ckpt, osp.join(self.work_dir, 'sweep'),
                                    self._sweep_points, 'sweep ', after=self._after_sweep,
                                    merge_cfg=ENCODER_ONLY))
        if swept is None:
            return False
        rows, checks = swept
        for r in rows:
            self.result['rows'].append(_sweep_row(r, self.base))
            self.base = self.base or self.result['rows'][0]
        if checks is not None:
            exact, control = checks
            self.add_row(_row('route-only MiTA, every key (check: = unswapped)', 'check',
                              None, 'N', dict(mIoU=exact), self.base))
            self.add_row(_row(f'every token reads one key ({ONE_KEY.text}: no token mixing, '
                              'the destructive control)', 'check', ONE_KEY.num_experts,
                              ONE_KEY.topk, control, self.base))
        return True

    def _sweep_points(self, runner: Runner, model: nn.Module) -> List[SweepPoint]:
        """The sweep's points; no ToMe points when the model has nothing to merge (a note)."""
        s = self.s
        swap_model(copy.deepcopy(model), {}, verbose=False)  # nothing to swap: error now
        ratios, merged = s.merge_ratios, s.merged_swaps
        if ratios or merged:
            error = _merge_error(model)
            if error is not None:
                self.result['notes'].append(f'no ToMe rows: {error}')
                self.progress(f'{self.name}: no ToMe rows: {error}')
                ratios, merged = (), ()
        return sweep_points(s.pool_sizes, s.topks, merge_ratios=ratios, merged_swaps=merged)

    def _after_sweep(self, runner: Runner, model: nn.Module,
                     points: List[SweepPoint]) -> Optional[Tuple[float, dict]]:
        """The test input's shape, images and patch size into the result; the every-key
        mIoU and the metrics of the destructive control (:data:`ONE_KEY`); None without
        the checks."""
        batch = next(iter(runner.test_dataloader))
        self.result['input'] = list(batch['inputs'][0].shape[-2:])
        self.result['test_images'] = len(runner.test_dataloader.dataset)
        self.result['patch_size'] = runner.cfg.model.backbone.get('patch_size')
        if not self.s.exact_check:
            return None
        self.progress(f'{self.name}: route-only MiTA with every key (exactly softmax attention)')
        if any(p.merge_ratio is not None for p in points):   # ToMe ran: unmerge
            merge_model(model, 0.0, verbose=False, **ENCODER_ONLY)
        exact = _every_key_miou(runner, model, min(self.s.pool_sizes))
        self.progress(f'{self.name}: every token reads one key ({ONE_KEY.text}: no mixing)')
        swap_model(model, ONE_KEY.cfg(), verbose=False)
        return exact, dict(runner.test())

    # --- 2b. the mask head too: MiTA with its class tokens global, and routed like patches
    # (each on a model of its own: a later encoder-only swap keeps a swapped head); ToMe

    def head(self) -> None:
        """The rows with Segmenter's mask head swapped (merged) too."""
        s = self.s
        head_ratios = s.merge_ratios if s.merge_head and any(
            r['kind'] == 'tome' for r in self.result['rows']) else ()
        if s.head_settings or head_ratios:
            head = self.stage(f'the mask head too: MiTA at {len(s.head_settings)} setting(s) '
                              '(class tokens global, then routed), '
                              f'{len(head_ratios)} ToMe ratio(s)',
                              lambda: self._head_rows(head_ratios))
            self.result['rows'] += head or []

    def _head_rows(self, head_ratios: Sequence[float]) -> List[dict]:
        """The head's rows: its class tokens global, then routed (each a sweep of its own
        model); none, and a note, when the decode head has no attention."""
        out = []
        for kind, routed in (('swap-head', False), ('swap-head-routed', True)):
            swept = self.sweep_with(
                self.ckpt, osp.join(self.work_dir, 'head'),
                lambda runner, model: self._head_points(model, routed, head_ratios),
                f'{kind} ', swap_cfg=WITH_HEAD, merge_cfg=WITH_HEAD)
            if swept is None:
                self.result['notes'].append('no head rows: the decode head has no attention')
                return out
            rows, _ = swept
            self.check_base(rows[0], kind)
            how = 'class tokens routed' if routed else 'class tokens global'
            for r in rows[1:]:
                if r.kind == 'tome':
                    out.append(_sweep_row(r, self.base, f'{r.label}, with the head',
                                          'tome-head'))
                else:
                    out.append(_sweep_row(r, self.base, f'{r.label}, with the head ({how})',
                                          kind))
        return out

    def _head_points(self, model: nn.Module, routed: bool,
                     head_ratios: Sequence[float]) -> Optional[List[SweepPoint]]:
        """The points with the head, its class tokens global or routed; None if the decode
        head has no attention to swap."""
        if swap_model(copy.deepcopy(model), dict(WITH_HEAD), verbose=False) == \
                swap_model(copy.deepcopy(model), {}, verbose=False):
            return None
        grid_context(model.decode_head).global_suffix = not routed
        points = sweep_points(merge_ratios=() if routed else head_ratios)
        return points + [SweepPoint('swap', h) for h in self.s.head_settings]

    # --- 2c. the attention kinds of the taxonomy and ToMe at equal cost

    def kinds(self) -> None:
        """Each attention kind at the MACs of each budget, ToMe at its GFLOPs
        (:mod:`projects.swap_study.kinds`), evaluated without retraining."""
        s = self.s
        matched: List[dict] = []

        def points(runner: Runner, model: nn.Module) -> List[SweepPoint]:
            batch = next(iter(runner.test_dataloader))
            merge = ENCODER_ONLY if _merge_error(model) is None else None
            matched.extend(match_budgets(model, batch, s.kind_budgets, s.kinds, merge))
            skipped = {k: why for entry in matched for k, why in entry['skipped'].items()}
            by_why: Dict[str, List[str]] = {}   # the kinds left out, by why
            for kind, why in skipped.items():
                by_why.setdefault(why, []).append(kind)
            if by_why:
                note = 'no equal-cost rows for ' + '; '.join(
                    f"{', '.join(kinds)} ({why})" for why, kinds in by_why.items())
                self.result['notes'].append(note)
                self.progress(f'{self.name}: {note}')
            return kind_points(matched)

        swept = self.stage(f"{', '.join(('mita', ) + s.kinds)} and ToMe at the cost of MiTA "
                           f"{', '.join(b.text for b in s.kind_budgets)}, no retraining",
                           lambda: self.sweep_with(self.ckpt, osp.join(self.work_dir, 'kinds'),
                                                   points, 'kinds ', merge_cfg=ENCODER_ONLY))
        if swept is not None:
            rows, _ = swept
            self.check_base(rows[0], 'kinds', ' before the kinds')
            self.result['equal_cost'] = matched
            self.result['rows'] += kind_rows(matched, rows,
                                             lambda r, label: _sweep_row(r, self.base, label))

    # --- 3. calibrated per-layer plans at several budgets, then evaluated

    def plans(self) -> None:
        """Calibrate the plans (:func:`calibrate_plans`), then evaluate them."""
        s = self.s
        plans = self.stage(f'calibrated plans at {len(s.plan_budgets)} budget(s) on '
                           f'{s.calibration_images} training images, and at the first with '
                           f'{list(s.calibration_counts)} images',
                           lambda: calibrate_plans(self.config, self.opts, self.ckpt,
                                                   self.work_dir, s, self.result['rows'],
                                                   self.say(''), self.result['notes']))
        if not plans:
            return
        evaluated = self.stage(
            f'{len(plans)} calibrated plan(s) on the validation images',
            lambda: self.sweep_with(self.ckpt, osp.join(self.work_dir, 'plans'),
                                    sweep_points(plans=[p for p, _ in plans]), 'plans '))
        if evaluated is not None:
            rows, _ = evaluated
            self.check_base(rows[0], 'plans', ' before the plans')
            for r, (plan, info) in zip(rows[1:], plans):
                self.add_row(_sweep_row(r, self.base, info['label']), plan=info)

    # --- 4. fine-tune the exported pair, and the control

    def finetune(self, setting: MiTASetting) -> None:
        """Export the swap at ``setting`` (:func:`export_swapped`) and fine-tune it."""
        s, tag = self.s, tag_of(setting)

        def do_finetune():
            out_cfg, out_ckpt = export_swapped(
                self.config, self.ckpt, osp.join(self.work_dir, f'finetune_{tag}', 'export'),
                setting.cfg(), self.opts)
            cfg = schedule(load_config(out_cfg), s.finetune_iters, s.finetune_lr_mult)
            ft_ckpt, ft_s, _ = train(cfg, osp.join(self.work_dir, f'finetune_{tag}', 'train'),
                                     s.verbose, s.reuse)
            values = evaluate(load_config(out_cfg), ft_ckpt,
                              osp.join(self.work_dir, f'finetune_{tag}', 'test'), s)
            return dict(values, exported=[out_cfg, out_ckpt], checkpoint=ft_ckpt,
                        seconds=round(ft_s, 1))

        ft = self.stage(f'export MiTA {setting.label} and fine-tune it '
                        f'{s.finetune_iters} iterations', do_finetune)
        if ft is not None:
            self.add_row(_row(f'MiTA {setting.label}, fine-tuned {s.finetune_iters} it',
                              'finetune', setting.num_experts, setting.topk, ft, self.base),
                         exported=ft['exported'], checkpoint=ft['checkpoint'],
                         train_seconds=ft['seconds'])

    def control(self) -> None:
        """The unswapped model trained as long as the fine-tune, from the same checkpoint."""
        s = self.s

        def do_control():
            cfg = schedule(load_config(self.config, self.opts), s.finetune_iters,
                           s.finetune_lr_mult)
            cfg.load_from = self.ckpt
            c_ckpt, c_s, _ = train(cfg, osp.join(self.work_dir, 'control', 'train'),
                                   s.verbose, s.reuse)
            values = evaluate(load_config(self.config, self.opts), c_ckpt,
                              osp.join(self.work_dir, 'control', 'test'), s)
            return dict(values, checkpoint=c_ckpt, seconds=round(c_s, 1))

        ctl = self.stage(f'control: unswapped, trained {s.finetune_iters} more iterations',
                         do_control)
        if ctl is not None:
            self.add_row(_row(f'unswapped, trained {s.finetune_iters} it more (control)',
                              'control', None, None, ctl, self.base),
                         checkpoint=ctl['checkpoint'], train_seconds=ctl['seconds'])

    # --- 5. token selection at one setting

    def selection_maps(self, checkpoint: str, setting: MiTASetting, name: str,
                       mita_cfg: Optional[dict] = None, **how) -> dict:
        """:func:`selection_maps` of ``checkpoint`` (a MiTA-trained one: ``mita_cfg``) on
        the first validation images."""
        cfg = load_config(self.config, self.opts)
        if mita_cfg:
            cfg = mita_config(cfg, mita_cfg)
        return selection_maps(cfg, checkpoint, setting,
                              validation_images(cfg, self.s.selection_images), self.fig_dir,
                              name, **how)

    def selection(self) -> None:
        """The token-selection maps of the swap at ``settings.selection``."""
        s = self.s
        sel = self.stage(f'token selection at {s.selection.label} on '
                         f'{s.selection_images} validation image(s)',
                         lambda: self.selection_maps(self.ckpt, s.selection, self.files))
        if sel is not None:
            self.result['selection'] = sel

    # --- 6. trained with MiTA from scratch, evaluated over the grid

    def native(self, setting: MiTASetting) -> None:
        """Train with MiTA at ``setting`` from scratch, evaluate it over the sweep's grid
        (and with every key), map its token selection."""
        s = self.s
        native = dict(setting=setting.text, label=setting.label, rows=[])
        mita = setting.cfg()
        ndir = osp.join(self.work_dir, f'native_{tag_of(setting)}')

        def do_native_train():
            cfg = mita_config(load_config(self.config, self.opts), mita)
            os.makedirs(ndir, exist_ok=True)
            cfg.dump(osp.join(ndir, 'config.py'))   # for tools/test.py --mita-cfg ...
            return train(training_schedule(cfg, s.train_iters), osp.join(ndir, 'train'), s.verbose,
                         s.reuse)

        trained = self.stage(f'training {_iters(s.train_iters)} with MiTA {setting.label} '
                             'from scratch', do_native_train)
        if trained is None:
            return
        n_ckpt, n_s, n_reused = trained
        native['train'] = dict(iters=_iters_of(n_ckpt), seconds=round(n_s, 1), checkpoint=n_ckpt,
                               reused=n_reused, config=osp.join(ndir, 'config.py'))
        every_key = (lambda runner, model, _: _every_key_miou(runner, model,
                                                              min(s.pool_sizes)))
        swept = self.stage(
            f'MiTA-trained {setting.label}: as trained and at '
            f'{len(s.pool_sizes) * len(s.topks)} test-time settings',
            lambda: self.sweep_with(n_ckpt, osp.join(ndir, 'sweep'),
                                    sweep_points(s.pool_sizes, s.topks), 'native ', mita,
                                    after=every_key if s.exact_check else None))
        if swept is not None:
            self._native_rows(native, setting, *swept)
        if s.selection_images:
            sel = self.stage(f'token selection of the MiTA-trained {setting.label}',
                             lambda: self.selection_maps(
                                 n_ckpt, setting, f'{self.files}_native_{tag_of(setting)}',
                                 mita, how='trained with it'))
            if sel is not None:
                native['selection'] = sel
        self.result['native'].append(native)

    def _native_rows(self, native: dict, setting: MiTASetting, rows: List[SweepRow],
                     exact: Optional[float]) -> None:
        """The MiTA-trained model's rows: as trained, at the grid's other settings (an error
        if its own setting at test time differs from as trained), with every key."""
        base, trained = self.base, f'trained {setting.label}'
        trained_row = _row(f'{trained}, tested as trained', 'native', setting.num_experts,
                           setting.topk, rows[0].as_dict(), base)
        trained_row['trained_setting'] = True
        native['rows'].append(trained_row)
        for r in rows[1:]:
            if (r.M, r.topk) == (setting.num_experts, setting.topk):   # itself
                if r.mIoU != trained_row['mIoU']:
                    self.result['errors'].append(
                        f"native {setting.label}: set to its own setting at test "
                        f"time it gave mIoU {r.mIoU}, as trained {trained_row['mIoU']}")
                continue
            native['rows'].append(_sweep_row(r, base, f'{trained}, tested at {r.ran}',
                                             'native'))
        if exact is not None:
            native['rows'].append(_row(f'{trained}, tested with softmax attention '
                                       '(route-only, every key)', 'native-dense', None, 'N',
                                       dict(mIoU=exact), base))


def study_model(name: str, config: str, work_dir: str, settings: StudySettings,
                progress: Callable[[str], None], fig_dir: str) -> dict:
    """Train, sweep, fine-tune and map one model with one seed (``settings.seeds``, one:
    :meth:`StudySettings.for_run`; see the module docstring): :meth:`ModelStudy.run`.

    Returns:
        dict: ``name, config, seed, input, train, rows, selection, seconds, load, errors``;
        ``rows`` as in :func:`_row` with ``kind`` one of :data:`KINDS`.
    """
    return ModelStudy(name, config, work_dir, settings, progress, fig_dir).run()


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
    study['figures'] += [plot_kinds(study['models'], osp.join(fig_dir, 'swap_study_kinds.png'))
                         ] if any(r['kind'] == 'equal-cost' for res in study['models']
                                  for r in res['rows']) else []
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
