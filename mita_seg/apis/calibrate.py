"""A calibrated swap (``tools/calibrate_swap.py``): per-layer attention settings (any kind of
:data:`mita_seg.setting.KINDS`, or dense) chosen for a FLOP budget from a few training
images, with no retraining.

0. The dense model: the config's model with the checkpoint; a MiTA config (layers built on
   MiTA, or on another kind) is calibrated against its dense model, the same weights with
   every attention layer put back on standard attention (MiTA has no parameters, so a MiTA
   checkpoint is a dense model's weights), and says so (a progress line, and the plan's
   ``model.config_attention``). A config whose MiTA layers have the DWC branch (trained
   parameters dense attention does not have) has no such dense model and is refused.
1. Cost in FLOPs: the project's counter (:mod:`mita_seg.analysis`, one ``mode='tensor'``
   forward of one crop at the config's crop size, else 512x512 as ``tools/get_flops.py``
   counts, which the output then says) of the dense model, and of the model with every
   layer on each candidate setting; a layer's cost under a candidate is what its attention
   module counts. Layers add up exactly, so a plan's FLOPs are
   ``dense + sum over layers (candidate - dense)``.
2. Cost in accuracy: on ``images`` images drawn (by ``seed``) from the config's *training*
   split through its *test* pipeline, the error each candidate of each layer causes in the
   final segmentation logits with only that layer swapped, against the dense model: the mean
   per-pixel ``KL(softmax(dense) || softmax(swapped))``. The dense forward is run once and
   kept: its logits, and the output of every encoder layer, so that the forward with layer
   ``l`` swapped replays the (unchanged) dense outputs of the layers before ``l`` and runs
   only the rest. ``layers x candidates`` forwards over the images.
3. The choice: the plan of least total error (the sum of the layers' errors) within the
   budget, by a multiple-choice knapsack over layers (dynamic programming over the FLOPs
   above the cheapest plan, cut into at most :data:`KNAPSACK_BINS` steps: exact when the
   rounded-down relaxation fits, else rounded up, always within the budget; :func:`choose`),
   and never worse than a uniform setting of the candidates within the budget.

:func:`calibrate_swap` does the three steps; :class:`SwapCalibrator` keeps steps 1-2 to
choose plans at several budgets (:meth:`SwapCalibrator.plan`).
"""
import copy
import math
import os.path as osp
import random
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.config import Config

from mita_seg.models import PlanError, SwapPlan, attention_layers, current_plan
from mita_seg.models.plan import attention_shape
from mita_seg.setting import CALIBRATION_CANDIDATES, DENSE, MiTASetting
from mita_seg.utils.cfg_options import merge_cfg_options
from .config import load_config
from .model import init_model, swap_model

KNAPSACK_BINS = 4000
METRIC = ('mean per-pixel KL(softmax(dense) || softmax(swapped)) of the segmentation logits, '
          'with only that layer swapped')
# the longest side of the logits the error is measured on (a strided subsample above it;
# mmseg's logits are upsampled from the decode head's, so little is lost)
ERROR_SIDE = 128


class _Replay(nn.Module):
    """Stands in for an encoder layer whose output is known: returns the dense model's
    output of the current batch (``batch``), whatever the input."""

    def __init__(self, outputs: List[torch.Tensor]):
        super().__init__()
        self.outputs, self.batch = outputs, 0

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.outputs[self.batch].clone()


class CalibrationError(PlanError):
    """A calibration that cannot run or a budget no plan meets (the message says which and
    what to give instead)."""


def _candidate(c: Union[str, MiTASetting, None]) -> Optional[MiTASetting]:
    """A candidate: a :class:`~mita_seg.setting.MiTASetting`, None for dense, or the
    spelling of either (``7:49``, ``5:16:route``, ``dense``)."""
    return c if c is None or isinstance(c, MiTASetting) else MiTASetting.parse_or_dense(c)


def _candidates(given, name: str) -> List[Optional[MiTASetting]]:
    """The settings of a list of candidates (:func:`_candidate`); a single one is refused
    (a text would be read character by character)."""
    if isinstance(given, (str, MiTASetting)) or given is None:
        raise TypeError(f'{name}={given!r}: give a list of settings, e.g. [\'dense\', '
                        '\'7:49\', \'4:16\']')
    return [_candidate(c) for c in given]


def _text(setting: Optional[MiTASetting]) -> str:
    return DENSE if setting is None else setting.text


def train_images(cfg: Config, count: int, seed: int = 0):
    """``count`` images of the config's training split (drawn by ``seed``, in index order),
    loaded through the config's *test* pipeline (no augmentation).

    Returns:
        tuple: ``(dataset, indices)``.

    Raises:
        CalibrationError: the training split has no images.
    """
    from mmseg.registry import DATASETS
    ds_cfg = copy.deepcopy(cfg.train_dataloader.dataset)
    while 'dataset' in ds_cfg and 'pipeline' not in ds_cfg:  # RepeatDataset and the like
        ds_cfg = ds_cfg.dataset
    test_ds = cfg.get('test_dataloader', cfg.get('val_dataloader')).dataset
    ds_cfg.pipeline = copy.deepcopy(test_ds.pipeline)
    ds_cfg.serialize_data = False                     # a few images; and none is an error
    dataset = DATASETS.build(ds_cfg)
    if len(dataset) == 0:
        where = osp.join(ds_cfg.get('data_root', ''),
                         ds_cfg.get('data_prefix', {}).get('img_path', ''))
        raise CalibrationError(
            f'the training split of the config ({where or ds_cfg.get("type")}) has no images: '
            'calibration draws its images from the training split (never the evaluation '
            'images); point train_dataloader.dataset at them (--cfg-options '
            'train_dataloader.dataset.data_root=...)')
    indices = sorted(random.Random(seed).sample(range(len(dataset)), min(count, len(dataset))))
    return dataset, indices


def _subsample(logits: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` logits, strided so the longer side is at most :data:`ERROR_SIDE`."""
    step = max(1, math.ceil(max(logits.shape[-2:]) / ERROR_SIDE))
    return logits[..., ::step, ::step]


def kl_error(dense_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-image mean over pixels of ``KL(p_dense || softmax(logits))`` (``[B]``)."""
    logq = F.log_softmax(logits.float(), dim=1)
    return (dense_logp.exp() * (dense_logp - logq)).sum(1).flatten(1).mean(1)


def choose(costs: np.ndarray, flops: np.ndarray, capacity: int,
           bins: int = KNAPSACK_BINS) -> List[int]:
    """The multiple-choice knapsack: one candidate per layer, least total cost, FLOPs at
    most ``capacity``.

    The FLOPs axis is cut into at most ``bins`` steps. Solved twice: with the weights
    rounded down (a relaxation: its optimum costs at most the true one, so when it fits
    ``capacity`` exactly it is the true optimum) and, when that one does not fit, rounded up
    (always fits; optimal on the rounded weights, within one step per layer of the true one).

    Args:
        costs (ndarray): ``[layers, candidates]`` errors (``inf``: not a choice).
        flops (ndarray): ``[layers, candidates]`` int FLOPs (any offset per layer).
        capacity (int): the budget over the per-layer minima (>= 0).
        bins (int): steps of the FLOPs axis. Default: :data:`KNAPSACK_BINS`.

    Returns:
        list[int]: the chosen candidate of each layer (ties: the first).
    """
    over = flops - flops.min(axis=1, keepdims=True)             # >= 0
    unit = max(1, math.ceil(int(over.max(axis=1).sum()) / bins))
    relaxed = _knapsack(costs, over // unit, capacity // unit)
    if sum(int(over[i, c]) for i, c in enumerate(relaxed)) <= capacity:
        return relaxed
    return _knapsack(costs, -(-over // unit), capacity // unit)


def _knapsack(costs: np.ndarray, weight: np.ndarray, capacity: int) -> List[int]:
    """:func:`choose` on integer weights: DP over ``0..capacity``."""
    L, _ = costs.shape
    cap = int(min(capacity, weight.max(axis=1).sum()))
    best = np.zeros(cap + 1)                                     # layers so far, FLOPs <= b
    picks = np.zeros((L, cap + 1), dtype=np.int64)
    for layer in range(L):
        new = np.full(cap + 1, np.inf)
        for c in range(costs.shape[1]):
            w = int(weight[layer, c])
            if w > cap or not np.isfinite(costs[layer, c]):
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[:cap + 1 - w] + costs[layer, c]
            better = cand < new
            new[better], picks[layer, better] = cand[better], c
        best = new
    if not np.isfinite(best[cap]):
        raise ValueError('no plan within the capacity')
    out, b = [], cap
    for layer in reversed(range(L)):
        c = int(picks[layer, b])
        out.append(c)
        b -= int(weight[layer, c])
    return out[::-1]


class SwapCalibrator:
    """Measures, for a standard-attention checkpoint, what each candidate setting of each
    attention layer costs in FLOPs and in accuracy, and chooses plans for budgets.

    A MiTA config (its layers built on MiTA or another kind) is calibrated against its dense
    model: :attr:`model` is put on dense attention everywhere before anything is measured,
    and :attr:`config_attention` says what the config ran (None: the config is dense).

    Args:
        config (str | Config): the model's config (file, ``mmseg::`` or a ``Config``).
        checkpoint (str): its checkpoint (a standard-attention one, or a MiTA config's: the
            same weights).
        images (int): calibration images from the training split. Default: 16.
        candidates (Sequence[str | MiTASetting]): candidate settings (``7:49``,
            ``5:16:route``: :meth:`~mita_seg.setting.MiTASetting.parse_or_dense`); dense is
            always one. Default: :data:`CALIBRATION_CANDIDATES`.
        seed (int): which training images. Default: 0.
        cfg_options (dict, optional): ``--cfg-options``. Default: None.
        batch_size (int): images per forward. Default: 4.
        progress (Callable, optional): called with a line per step. Default: None.
        replay (bool): replay the dense outputs of the layers before the swapped one
            instead of running them (same results, fewer FLOPs). Default: True.

    Raises:
        CalibrationError: a MiTA config with no dense model to calibrate against (the DWC
            branch, or a layer built on MiTA with no standard attention to put back), or no
            candidate but dense.
        TypeError: ``candidates`` is one setting, not a list of them.
    """

    def __init__(self, config, checkpoint: str, images: int = 16,
                 candidates: Sequence[str] = CALIBRATION_CANDIDATES, seed: int = 0,
                 cfg_options: Optional[dict] = None, batch_size: int = 4,
                 progress: Optional[Callable[[str], None]] = None, replay: bool = True):
        if images < 1 or batch_size < 1:
            raise ValueError(f'images and batch_size must be >= 1, got {images}, {batch_size}')
        settings = _candidates(candidates, 'candidates')
        self.candidates: List[Optional[MiTASetting]] = [None] + [
            s for i, s in enumerate(settings) if s is not None and s not in settings[:i]]
        if len(self.candidates) == 1:
            raise CalibrationError(
                f'candidates {" ".join(_text(s) for s in settings) or "(none)"}: dense '
                'attention alone leaves nothing to choose; give settings to choose among, '
                'e.g. 7:49 4:16 agent:7 (dense is always one)')
        self.config, self.checkpoint, self.seed = config, checkpoint, seed
        self.num_images, self.batch_size, self.replay = images, batch_size, replay
        self.progress = progress or (lambda line: None)
        # a Config of the caller's is copied: cfg_options are merged into this one only
        self.cfg = copy.deepcopy(config) if isinstance(config, Config) else load_config(config)
        merge_cfg_options(self.cfg, cfg_options)
        self.model = init_model(copy.deepcopy(self.cfg), checkpoint)
        self.layers = [name for name, _, _ in attention_layers(self.model)]
        if not self.layers:
            swap_model(self.model, {}, verbose=False)  # NothingToSwapError, listing them
        self.config_attention: Optional[str] = self._to_dense()
        self.shape = tuple(int(v) for v in _default_shape(self.cfg))
        # why that shape, where it is not the config's own
        self.shape_note = '' if _crop_size(self.cfg) else (
            " (the config sets no crop size: tools/get_flops.py's default)")
        self._flops: Optional[np.ndarray] = None
        self._errors: Optional[np.ndarray] = None
        self.dense_flops = 0
        self.seconds = 0.0
        self.image_paths: List[str] = []

    def _to_dense(self) -> Optional[str]:
        """Put every attention layer of :attr:`model` on dense attention where the config
        built some on MiTA (or another kind), so that the errors are measured against the
        dense model; returns what the config's layers ran
        (:meth:`~mita_seg.models.plan.SwapPlan.describe`), None where they were all dense.

        Raises:
            CalibrationError: a layer with the DWC branch, or built on MiTA with no standard
                attention to put back.
        """
        built = current_plan(self.model)
        if all(s is None for s in built.layers.values()):
            return None
        what = self._what()
        dwc = [n for n in self.layers if getattr(self.model.get_submodule(n), 'dwc', None)
               is not None]
        if dwc:
            raise CalibrationError(
                f'{what} builds {len(dwc)} attention layers on MiTA with the DWC branch '
                f'({dwc[0]}...): trained parameters dense attention does not have, so the '
                'config has no dense model to calibrate against; calibrate the '
                'standard-attention config (and checkpoint) it was trained from instead, or '
                'a MiTA config without with_dwc')
        try:
            swap_model(self.model, dict(plan=self._plan({})), verbose=False)
        except PlanError as e:
            raise CalibrationError(
                f'{what}: its attention layers cannot be put on dense attention to calibrate '
                f'against ({e}); calibrate the standard-attention config instead') from None
        described = built.describe()
        self.progress(f'{what} runs {built.summary()} ({described}): calibrating against its '
                      'dense model, the same weights with every attention layer on standard '
                      'attention (MiTA has no parameters)')
        return described

    def _what(self) -> str:
        """The config, for messages."""
        name = self.config if not isinstance(self.config, Config) else getattr(
            self.config, 'filename', None)
        return f'config {name}' if name else 'the config'

    # -- step 1: FLOPs ------------------------------------------------------------------
    def _plan(self, settings: Dict[str, Optional[MiTASetting]]) -> SwapPlan:
        return SwapPlan({n: settings.get(n) for n in self.layers})

    def flops(self) -> np.ndarray:
        """``[layers, candidates]`` FLOPs of each layer's attention module (counted once)."""
        if self._flops is not None:
            return self._flops
        from mita_seg.analysis.flop_handles import flop_analyzer
        from mita_seg.analysis.segmentor_cost import decode_head_called_as_module, test_inputs
        t0 = time.time()
        model = copy.deepcopy(self.model)
        if getattr(model, 'auxiliary_head', None) is not None:
            model.auxiliary_head = None                 # as tools/get_flops.py counts
        x = test_inputs(model.data_preprocessor, self.shape)
        out = np.zeros((len(self.layers), len(self.candidates)), dtype=np.int64)
        for c, setting in enumerate(self.candidates):
            plan = SwapPlan.uniform(self.layers, setting)
            swap_model(model, dict(plan=plan), verbose=False)
            with torch.no_grad(), decode_head_called_as_module(model):
                analyzer = flop_analyzer(model, (x, ))
                by_module = analyzer.by_module()
                if setting is None:
                    self.dense_flops = int(analyzer.total())
            out[:, c] = [int(by_module[n]) for n in self.layers]
        self._flops = out
        self.seconds += time.time() - t0
        self.progress(f'FLOPs of {len(self.candidates)} candidates x {len(self.layers)} '
                      f'layers counted at {self.shape[0]}x{self.shape[1]}'
                      f'{self.shape_note}: dense '
                      f'{self.dense_flops / 1e9:.4g} GFLOPs, cheapest plan '
                      f'{self.cheapest_flops() / 1e9:.4g} ({time.time() - t0:.0f}s)')
        return out

    def plan_flops(self, choice: Sequence[int]) -> int:
        """FLOPs of the plan that puts layer ``i`` on candidate ``choice[i]``."""
        f = self.flops()
        return self.dense_flops + int(sum(f[i, c] - f[i, 0] for i, c in enumerate(choice)))

    def cheapest_flops(self) -> int:
        """FLOPs of the cheapest plan of the candidates."""
        f = self.flops()
        return self.plan_flops([int(np.argmin(f[i])) for i in range(len(self.layers))])

    def uniform_gflops(self, candidate: Union[str, MiTASetting]) -> float:
        """GFLOPs of every layer on ``candidate`` (e.g. ``'7:49'``), as a budget to match."""
        return self.plan_flops(self._uniform(candidate)) / 1e9

    def _uniform(self, candidate: Union[str, MiTASetting]) -> List[int]:
        """The choice of every layer on ``candidate``."""
        setting = _candidate(candidate)
        if setting not in self.candidates:
            raise CalibrationError(f'{_text(setting)!r} is not one of the candidates '
                                   f'({" ".join(self.candidate_names)}): add it to them')
        return [self.candidates.index(setting)] * len(self.layers)

    @property
    def candidate_names(self) -> List[str]:
        """The candidates' spellings (``dense``, ``7:49``, ``5:16:route``)."""
        return [_text(s) for s in self.candidates]

    def budget(self, reduction: Optional[float] = None,
               budget_gflops: Optional[float] = None,
               budget_uniform: Union[str, MiTASetting, None] = None) -> int:
        """The budget in FLOPs: ``(1 - reduction)`` x dense, ``budget_gflops``, or the
        FLOPs of every layer on the setting ``budget_uniform`` (e.g. ``'7:49'``).

        Raises:
            ValueError: not exactly one given, or a reduction outside [0, 1).
            CalibrationError: a budget above the dense model's cost or below the cheapest
                plan's.
        """
        if sum(v is not None for v in (reduction, budget_gflops, budget_uniform)) != 1:
            raise ValueError('give one of reduction, budget_gflops and budget_uniform')
        self.flops()
        if budget_uniform is not None:
            return self.plan_flops(self._uniform(budget_uniform))
        dense, cheapest = self.dense_flops, self.cheapest_flops()
        if reduction is not None:
            if not 0 <= reduction < 1:
                raise ValueError(f'reduction must be in [0, 1), got {reduction}')
            budget, asked = int(dense * (1 - reduction)), f'reduction {reduction:g}'
        else:
            budget, asked = round(budget_gflops * 1e9), f'budget {budget_gflops:g} GFLOPs'
        at = f'at {self.shape[0]}x{self.shape[1]}'
        if budget > dense:
            raise CalibrationError(
                f'{asked} is above the dense model\'s cost ({dense / 1e9:.4g} GFLOPs {at}): '
                'a plan cannot cost more than dense attention; give at most that')
        if budget < cheapest:
            raise CalibrationError(
                f'{asked} is below the cheapest plan of the candidates ({cheapest / 1e9:.4g} '
                f'GFLOPs {at}, {100 * (1 - cheapest / dense):.1f}% below dense): give at least '
                'that, or add cheaper --candidates')
        return budget

    # -- step 2: errors -----------------------------------------------------------------
    def _batches(self) -> List[Tuple[torch.Tensor, List[dict]]]:
        from mmengine.dataset import pseudo_collate
        dataset, indices = train_images(self.cfg, self.num_images, self.seed)
        self.image_paths = [dataset.get_data_info(i)['img_path'] for i in indices]
        items = [dataset[i] for i in indices]
        by_shape: Dict[tuple, list] = {}
        for item in items:                          # batches of images of one shape
            by_shape.setdefault(tuple(item['inputs'].shape), []).append(item)
        batches = []
        for group in by_shape.values():
            for s in range(0, len(group), self.batch_size):
                data = self.model.data_preprocessor(
                    pseudo_collate(group[s:s + self.batch_size]), False)
                batches.append((data['inputs'],
                                [d.metainfo for d in data['data_samples']]))
        return batches

    def _logits(self, batches, replays: Sequence[_Replay] = ()) -> List[torch.Tensor]:
        out = []
        with torch.no_grad():
            for b, (x, metas) in enumerate(batches):
                for r in replays:
                    r.batch = b
                out.append(_subsample(self.model.inference(x, metas)))
        return out

    def _owner_layers(self) -> List[Tuple[nn.Module, int]]:
        """Every ``(owner, index)`` of the token owners' encoder layers, in forward order
        (a backbone's before a head's)."""
        out: List[Tuple[nn.Module, int]] = []
        for _, owner, _ in attention_layers(self.model):
            if not any(o is owner for o, _ in out):
                out += [(owner, j) for j in range(len(owner.layers))]
        return out

    def _record(self, batches) -> Tuple[List[torch.Tensor], Dict[int, List[torch.Tensor]]]:
        """The dense logits, and each encoder layer's dense outputs (per batch) when every
        layer returns a tensor (else none: no replay)."""
        units = self._owner_layers()
        outputs: Dict[int, List[torch.Tensor]] = {u: [] for u in range(len(units))}

        def hook(u):
            return lambda module, args, out: outputs[u].append(
                out.detach().clone() if isinstance(out, torch.Tensor) else None)

        handles = [owner.layers[j].register_forward_hook(hook(u))
                   for u, (owner, j) in enumerate(units)] if self.replay else []
        try:
            dense = self._logits(batches)
        finally:
            for h in handles:
                h.remove()
        ok = self.replay and all(len(v) == len(batches) and all(t is not None for t in v)
                                 for v in outputs.values())
        return dense, outputs if ok else {}

    def errors(self) -> np.ndarray:
        """``[layers, candidates]`` errors (:data:`METRIC`), measured once."""
        if self._errors is not None:
            return self._errors
        t0 = time.time()
        torch.manual_seed(self.seed)
        batches = self._batches()
        n = sum(len(m) for _, m in batches)
        dense_logits, outputs = self._record(batches)
        dense = [F.log_softmax(x.float(), dim=1) for x in dense_logits]
        units = self._owner_layers()
        out = np.zeros((len(self.layers), len(self.candidates)))
        todo = len(self.layers) * (len(self.candidates) - 1)
        self.progress(f'errors: {len(self.layers)} layers x {len(self.candidates) - 1} '
                      f'candidates on {n} training images ({todo * n} image forwards'
                      + (', the dense layers before the swapped one replayed' if outputs else '')
                      + ')')
        for i, (name, owner, idx) in enumerate(attention_layers(self.model)):
            # the layers before this one run as in the dense model: replay their outputs
            unit = next(u for u, (o, j) in enumerate(units) if o is owner and j == idx)
            replays = [(units[u], _Replay(outputs[u])) for u in range(unit)] if outputs else []
            for c, setting in enumerate(self.candidates):
                if setting is None:
                    continue
                swap_model(self.model, dict(plan=self._plan({name: setting})), verbose=False)
                layers = [o.layers[j] for (o, j), _ in replays]
                for (o, j), r in replays:
                    o.layers[j] = r
                try:
                    err = sum(float(kl_error(d, x).sum()) for d, x in zip(
                        dense, self._logits(batches, [r for _, r in replays])))
                finally:
                    for ((o, j), _), layer in zip(replays, layers):
                        o.layers[j] = layer
                out[i, c] = max(err / n, 0.0)   # KL >= 0 (rounding can dip below)
            swap_model(self.model, dict(plan=self._plan({})), verbose=False)  # dense again
            spent = time.time() - t0
            left = spent / (i + 1) * (len(self.layers) - i - 1)
            row = out[i, 1:]
            self.progress(f'layer {i + 1}/{len(self.layers)} {name}: error {row.min():.3g}'
                          f'-{row.max():.3g} ({spent:.0f}s elapsed, ~{left:.0f}s left)')
        self._errors = out
        self.seconds += time.time() - t0
        return out

    # -- step 3: the choice -------------------------------------------------------------
    def _among(self, among: Optional[Sequence[Union[str, MiTASetting, None]]]) -> List[int]:
        """The indices of the candidates ``among`` names, dense always (None: every one).

        Raises:
            CalibrationError: one that is not a candidate (it was not measured).
        """
        if among is None:
            return list(range(len(self.candidates)))
        wanted = _candidates(among, 'among')
        missing = [_text(s) for s in wanted if s not in self.candidates]
        if missing:
            raise CalibrationError(f'{missing[0]!r} is not one of the candidates '
                                   f'({" ".join(self.candidate_names)}): a plan chooses among '
                                   'the measured candidates; add it to them')
        return [i for i, s in enumerate(self.candidates) if i == 0 or s in wanted]

    def plan(self, reduction: Optional[float] = None,
             budget_gflops: Optional[float] = None,
             budget_uniform: Union[str, MiTASetting, None] = None,
             among: Optional[Sequence[Union[str, MiTASetting, None]]] = None) -> SwapPlan:
        """The plan of least total error within the budget (give one of ``reduction``,
        ``budget_gflops`` and ``budget_uniform``: :meth:`budget`), choosing each layer's
        setting among ``among`` (some of the candidates, dense always; None: every one).
        A plan among some candidates is the plan a calibrator of those alone would choose
        (each candidate is measured on its own): one calibrator over every kind gives the
        plan across kinds and the MiTA-only plan of the same measurements.

        Raises:
            CalibrationError: a budget no plan of ``among`` meets (:meth:`budget`), or one
                of ``among`` that is not a candidate.
        """
        budget = self.budget(reduction, budget_gflops, budget_uniform)
        cols = self._among(among)
        flops = self.flops()[:, cols]
        full = lambda ch: [cols[c] for c in ch]  # noqa: E731  (indices of self.candidates)
        cheapest = self.plan_flops(full(np.argmin(flops, axis=1)))
        if budget < cheapest:
            names = ' '.join(self.candidate_names[c] for c in cols)
            raise CalibrationError(
                f'budget {budget / 1e9:.4g} GFLOPs is below the cheapest plan of the '
                f'candidates it may choose ({names}: {cheapest / 1e9:.4g} GFLOPs): give at '
                'least that, or let it choose cheaper ones')
        errors = self.errors()[:, cols]      # measured after the budget is known to be met
        if budget >= self.dense_flops:      # errors are >= 0: dense everywhere is the best
            choice = [0] * len(self.layers)
        else:
            choice = choose(errors, flops, budget - cheapest)
            # never worse than a uniform setting within the budget (the knapsack's rounding)
            total = lambda ch: sum(errors[i, c] for i, c in enumerate(ch))  # noqa: E731
            for c in range(len(cols)):
                uniform = [c] * len(self.layers)
                if self.plan_flops(full(uniform)) <= budget and total(uniform) < total(choice):
                    choice = uniform
        choice = full(choice)
        flops, errors = self.flops(), self.errors()
        total = self.plan_flops(choice)
        assert total <= budget, (total, budget)
        layers = {n: self.candidates[c] for n, c in zip(self.layers, choice)}
        layer_info = {n: dict(error=float(errors[i, c]), gflops=float(flops[i, c]) / 1e9,
                              dense_gflops=float(flops[i, 0]) / 1e9,
                              # the model the plan is for (SwapPlan.check_fits)
                              **attention_shape(self.model.get_submodule(n)))
                      for i, (n, c) in enumerate(zip(self.layers, choice))}
        dense = self.dense_flops
        if budget_uniform is not None:   # what the uniform swap of the same FLOPs would err
            uniform_error = float(sum(errors[i, c]
                                      for i, c in enumerate(self._uniform(budget_uniform))))
            budget_uniform = _text(_candidate(budget_uniform))
        info = dict(
            model=dict(config=str(self.config) if not isinstance(self.config, Config) else
                       getattr(self.config, 'filename', None), checkpoint=str(self.checkpoint),
                       attention_layers=len(self.layers),
                       **({} if self.config_attention is None else dict(
                           config_attention=self.config_attention,
                           reference='dense: the same weights, every attention layer on '
                           'standard attention'))),
            budget=dict(gflops=budget / 1e9, reduction=reduction, uniform=budget_uniform,
                        **({} if budget_uniform is None else dict(
                            uniform_predicted_error=uniform_error)),
                        counted=f'one {self.shape[0]}x{self.shape[1]} crop{self.shape_note}, '
                        'mode=tensor, auxiliary head removed (tools/get_flops.py)'),
            flops=dict(plan_gflops=total / 1e9, dense_gflops=dense / 1e9,
                       cheapest_gflops=cheapest / 1e9,
                       reduction_percent=100.0 * (1 - total / dense)),
            calibration=dict(split='train', images=self.image_paths, seed=self.seed,
                             metric=METRIC, predicted_error=float(sum(
                                 errors[i, c] for i, c in enumerate(choice))),
                             candidates=[self.candidate_names[c] for c in cols],
                             image_forwards=len(self.image_paths) * (
                                 1 + len(self.layers) * (len(self.candidates) - 1)),
                             seconds=round(self.seconds, 1)),
            layer_info=layer_info)
        return SwapPlan(layers, info)


def _default_shape(cfg: Config) -> Tuple[int, int]:
    from mita_seg.analysis.segmentor_cost import default_shape
    return default_shape(cfg)


def _crop_size(cfg: Config):
    from mita_seg.analysis.segmentor_cost import crop_size
    return crop_size(cfg)


def calibrate_swap(config,
                   checkpoint: str,
                   reduction: Optional[float] = None,
                   budget_gflops: Optional[float] = None,
                   images: int = 16,
                   candidates: Sequence[str] = CALIBRATION_CANDIDATES,
                   seed: int = 0,
                   cfg_options: Optional[dict] = None,
                   progress: Optional[Callable[[str], None]] = None,
                   budget_uniform: Union[str, MiTASetting, None] = None) -> SwapPlan:
    """A swap plan for ``checkpoint``: per-layer MiTA settings (dense allowed) of least
    calibration error within a FLOP budget (the module's docstring says how).

    Args:
        config (str | Config): the standard-attention model's config (or a MiTA config:
            calibrated against its dense model, :class:`SwapCalibrator`).
        checkpoint (str): its checkpoint.
        reduction (float, optional): the budget as a fraction of the dense FLOPs saved
            (0.4: at most 60% of dense).
        budget_gflops (float, optional): the budget in GFLOPs (one crop at the config's crop
            size, else 512x512, as ``tools/get_flops.py`` counts).
        images (int): calibration images from the training split. Default: 16.
        candidates (Sequence[str | MiTASetting]): candidate settings (``dense``, ``P:K``,
            ``PhxPw:K``, ``P:K:route``). Default: :data:`CALIBRATION_CANDIDATES`.
        seed (int): which training images. Default: 0.
        cfg_options (dict, optional): ``--cfg-options``. Default: None.
        progress (Callable, optional): called with a line per step. Default: None.
        budget_uniform (str, optional): the budget as the FLOPs of every layer on this
            candidate (e.g. ``'7:49'``: a plan for the FLOPs of uniform M = k = 49).

    Returns:
        SwapPlan: the plan; ``plan.save(path)`` writes it (``--mita-plan``), with the budget,
        the FLOPs it reaches, the calibration images and each layer's choice and error.

    Raises:
        CalibrationError: no training images, a budget above dense or below the cheapest
            plan (checked before the errors are measured), a MiTA config with no dense
            model (the DWC branch), or no candidate but dense.
    """
    cal = SwapCalibrator(config, checkpoint, images, candidates, seed, cfg_options,
                         progress=progress)
    cal.budget(reduction, budget_gflops, budget_uniform)  # a bad budget fails before the long part
    return cal.plan(reduction, budget_gflops, budget_uniform)
