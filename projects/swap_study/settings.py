"""The swap study's settings and defaults, with no torch or mmengine import (the command,
``tools/swap_study.py``, parses against them before the stack is loaded):
:class:`StudySettings` (what the study runs, its defaults the command's), the defaults of
the study as ``make swap-study`` runs it (its models, data and work dir) and a setting in file
names (:func:`tag_of`)."""
import json
import os.path as osp
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from mita_seg.setting import CALIBRATION_CANDIDATES, MITA, OTHER_KINDS, MiTASetting

# the calibration's per-layer candidates in the study: finer steps of cost than
# calibrate_swap's default (P 4/5/7 x k 16/49/100), so that the knapsack has settings to trade
# between layers (docs/swap_study.md shows both)
STUDY_CANDIDATES = ('dense', ) + tuple(
    f'{p}:{k}' for p in (4, 5, 6, 7, 8, 9, 10) for k in (8, 16)) + ('7:49', '4:16:route',
                                                                    '7:16:route')
PAPER = MiTASetting.parse('7:49')   # the paper's M = k = 49
# the paper's compression: 42% fewer model FLOPs (the sweep gets MiTA settings there, at the
# pool side each model's own FLOP count puts nearest it; the taxonomy and the plans a budget)
PAPER_REDUCTION = 0.42

# The study as `make swap-study` runs it (tools/swap_study.py's defaults beyond the settings'):
# its models, standard-attention configs on the 256x256 data (32x32 grid, N = 1025 with cls),
# relative to the repository's root;
MODELS = {
    'segmenter': 'configs/baselines/segmenter_vit-tiny_mask_1xb4_tiny-ade20k-256x256.py',
    'beit': 'configs/baselines/beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py',
}
# the data (written by tools/dataset/make_tiny_ade20k.py when missing: its side, training and
# validation images), the work dir;
DATA_ROOT = 'data/ade/tiny_ade20k_256'
DATA = dict(size=256, train=200, val=40)
WORK_DIR = 'work_dirs/swap_study'
# models trained longer than train_iters (the tiny BEiT barely uses its attention after 120;
# see docs/swap_study.md).
MODEL_TRAIN_ITERS = {'beit': 400}


@dataclass(frozen=True)
class Dataset:
    """A dataset of the study (``tools/swap_study.py --dataset``): its scenes, the tool
    that writes them when missing (``tools/dataset/<tool>``), its models (standard-attention
    configs), their training iterations, the fine-tune's, and the study's work dir."""
    data_root: str
    tool: str
    models: Dict[str, str]
    train_iters: Union[int, str]
    model_train_iters: Dict[str, int]
    finetune_iters: int
    work_dir: str


LONGRANGE_SEGMENTER = \
    'configs/longrange/segmenter_vit-tiny_linear_1xb4_longrange-ade20k-256x256.py'
LONGRANGE_BEIT = 'configs/longrange/beit-tiny_linear_1xb4_longrange-ade20k-256x256.py'
DATASETS = {
    # the local scenes: a region's own pixels decide its label
    'local': Dataset(DATA_ROOT, 'make_tiny_ade20k.py', MODELS, 120, MODEL_TRAIN_ITERS, 40,
                     WORK_DIR),
    # the long-range scenes (docs/longrange_data.md): the Segmenter without cls token or head
    # attention and the BEiT with the same head, trained on their configs' schedule (1600
    # iterations, the BEiT 2400, a constant rate first)
    'longrange': Dataset('data/ade/longrange_ade20k', 'make_longrange_ade20k.py',
                         {'segmenter': LONGRANGE_SEGMENTER, 'beit': LONGRANGE_BEIT}, 'config',
                         {}, 100, 'work_dirs/swap_study_longrange'),
}


@dataclass
class StudySettings:
    """What the study runs; every model gets the same.

    Args:
        data_root (str): the ADE20K-format data (``tools/dataset/make_tiny_ade20k.py``), set
            as ``data_root`` of the three dataloaders of every config.
        seeds (tuple[int]): training seeds (``randomness.seed`` of every training of a run):
            every model is trained, and studied, once per seed. Default: (2027, 2028, 2029).
        train_iters (int | str): iterations of the standard-attention training (and of
            the MiTA-trained runs) on the study's schedule (warm-up, poly decay), or
            ``'config'``: each config's own schedule (a task whose learning is a jump after a
            plateau needs a constant rate first: configs/longrange). Default: 120.
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
            unswapped mIoU) and the destructive controls, every token reading one key
            (``1:1:route``) and each token alone (``window:1``, on the models whose
            attention runs windows; a note names the others). Default: True.
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
        kind_budgets (tuple[MiTASetting]): the budgets of the taxonomy's comparison: each
            attention kind of ``kinds`` (and MiTA, and ToMe) at the encoder's attention MACs
            of each of these MiTA settings (:mod:`projects.swap_study.kinds`), then the
            paper's compression (``paper_reduction``); none for no comparison.
            Default: (``7:49``, ``7:16``, ``4:16``).
        kinds (tuple[str]): the attention kinds compared with MiTA.
            Default: ('agent', 'block', 'topk', 'window').
        plan_budgets (tuple[str]): FLOP budgets of the calibrated plans: a setting (``7:49``)
            the FLOPs of every layer on it, ``'tome'`` the reduction of the largest ToMe
            ratio; then the paper's compression (``paper_reduction``); none for no plans.
            Default: ('7:49', '7:16', '4:16', 'tome').
        paper_reduction (float): the paper's compression, a fraction of the
            unswapped model's FLOPs: for each k of ``paper_topks`` the sweep adds the MiTA
            setting (square pool) whose model FLOPs come nearest it, found on each model's
            own FLOP count (:func:`projects.swap_study.sweep.paper_settings`); the first
            (the paper's k = 49) is also a budget of the taxonomy (when ``kind_budgets``
            has any) and of the plans (when ``plan_budgets`` has any). 0 for none.
            Default: :data:`PAPER_REDUCTION` (0.42).
        paper_topks (tuple[int]): the k of those settings. Default: (49, 16, 100).
        plans_across_kinds (bool): also calibrate, at each plan budget, a plan whose
            per-layer candidates add to the MiTA ones each other kind of ``kinds`` at its
            setting nearest each budget that is a setting (attention MACs:
            :func:`mita_seg.analysis.equal_cost.settings_near`), so that layers may get
            different kinds. Default: True.
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
    train_iters: Union[int, str] = 120
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
    kind_budgets: Tuple[MiTASetting, ...] = tuple(MiTASetting.parse(b)
                                                  for b in ('7:49', '7:16', '4:16'))
    kinds: Tuple[str, ...] = OTHER_KINDS
    plan_budgets: Tuple[str, ...] = ('7:49', '7:16', '4:16', 'tome')
    paper_reduction: float = PAPER_REDUCTION
    paper_topks: Tuple[int, ...] = (49, 16, 100)
    plans_across_kinds: bool = True
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

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> 'StudySettings':
        """The settings named in ``values`` (e.g. a command's parsed arguments,
        ``vars(args)``; other names are ignored), lists as tuples; a value None keeps the
        default."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()
                      if k in names and v is not None})

    def check(self) -> 'StudySettings':
        """Raise ``ValueError`` naming a bad setting and what it must be."""
        if not osp.isdir(osp.join(self.data_root, 'images')):
            raise FileNotFoundError(
                f'data_root {self.data_root!r} has no images/ folder: write the data with '
                f'tools/dataset/make_tiny_ade20k.py --out {self.data_root} --size 256')
        if isinstance(self.train_iters, str) and self.train_iters != 'config':
            raise ValueError(f"train_iters must be a number or 'config', got {self.train_iters!r}")
        iters = dict(finetune_iters=self.finetune_iters)
        if self.train_iters != 'config':
            iters['train_iters'] = self.train_iters
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
                        head_settings=self.head_settings, kind_budgets=self.kind_budgets,
                        selection=() if self.selection is None else (self.selection, ),
                        merged_swaps=tuple(m for m, _ in self.merged_swaps))
        for name, values in settings.items():
            bad = [v for v in values if not isinstance(v, MiTASetting)]
            if bad:
                raise ValueError(f'{name}: {bad[0]!r} is not a MiTASetting; give e.g. '
                                 "MiTASetting.parse('7:49')")
        for name in ('finetune', 'native'):   # a stage each (a resumed run tells them apart)
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: give each setting once, got "
                                 f"{' '.join(v.text for v in values)}")
        if any(b.kind != MITA for b in self.kind_budgets):
            raise ValueError(f'kind_budgets: give MiTA settings (7:49), got '
                             f"{' '.join(b.text for b in self.kind_budgets)}")
        bad = sorted(k for k in self.kinds if k not in OTHER_KINDS)
        if bad:
            raise ValueError(f"kinds: {bad}: give some of {', '.join(OTHER_KINDS)} (MiTA is "
                             'always in)')
        if not 0 <= self.paper_reduction < 1 or (self.paper_reduction and not (
                self.paper_topks and all(isinstance(k, int) and k >= 1
                                         for k in self.paper_topks))):
            raise ValueError('paper_reduction must be in [0, 1) (0.42: 42% fewer model FLOPs; '
                             '0: none), with paper_topks ints >= 1; got '
                             f'{self.paper_reduction} and {self.paper_topks}')
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


def default(name: str) -> Any:
    """The default of :class:`StudySettings`' field ``name`` (the command's default)."""
    value = next(f.default for f in fields(StudySettings) if f.name == name)
    if value is MISSING:
        raise ValueError(f'StudySettings.{name} has no default')
    return value
