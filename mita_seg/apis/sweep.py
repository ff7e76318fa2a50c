"""Evaluate one standard-attention checkpoint unswapped, with token merging (ToMe) at
several ratios, on MiTA with several (pool size, top-k) settings and with swap plans
(per-layer settings) (``tools/swap_sweep.py``): mIoU and cost of each setting."""
import itertools
import os.path as osp
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmengine.model import is_model_wrapper
from mmengine.runner import Runner

from mmseg.models.backbones.beit import BEiTAttention

from mita_seg.models import (MiTAAttention, MiTABEiTAttention, MiTASettingsMixin, SwapPlan,
                             ToMeAttention)
from mita_seg.ops import attention_flops, mita_flops
from .model import swap_model
from .token_merge import merge_label, merge_model

FLOP_NOTE = ('attn_GMACs: analytic multiply-adds per image of the global attention layers '
             '(2 N^2 C standard, mita_seg.ops.mita_flops for MiTA; BEiT/MAE: plus the '
             'relative position bias adds, one add = one FLOP; ToMe: 2 N\'^2 C over the N\' '
             'merged tokens), counted on the calls the model makes; model_GFLOPs: whole '
             'model per image (mita_seg.analysis, jit trace with attention handles, times '
             'the test-mode crops); 1 MAC = 1 FLOP')


class AttentionMacCounter:
    """Counts, while active, the analytic MACs of every global attention call (mmcv
    ``MultiheadAttention``, :class:`MiTAAttention`, BEiT/MAE attention and
    :class:`MiTABEiTAttention`, their bias adds included, and ToMe's
    :class:`ToMeAttention` over its merged tokens) in ``model``."""

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules()
                        if type(m) in (MultiheadAttention, MiTAAttention, ToMeAttention)
                        or isinstance(m, BEiTAttention)]
        self.macs = 0
        # what the MiTA calls ran with: {(pool (h, w), topk, router_topk, N)}
        self.ran = set()
        self._handles = []

    def __enter__(self):
        self._handles = [m.register_forward_pre_hook(self._count, with_kwargs=True)
                         for m in self.modules]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _count(self, module, args, kwargs):
        query = args[0] if args else kwargs.get('query', kwargs.get('x'))
        batch_first = getattr(module, 'batch_first', True)   # BEiT: always [B, N, C]
        N = query.shape[1] if batch_first else query.shape[0]
        B = query.shape[0] if batch_first else query.shape[1]
        if isinstance(module, ToMeAttention) and len(args) < 2 and not any(
                kwargs.get(k) is not None for k in ('key', 'value', 'query_pos')):
            N = module.token_merger.num_merged(N)   # self-attention over merged tokens
        H = module.num_heads
        d = module.embed_dims // H
        with_bias = getattr(module, 'relative_position_bias_table', None) is not None
        if isinstance(module, MiTASettingsMixin):
            if isinstance(module, MiTABEiTAttention):
                grid = module.grid_shape(N)
            else:
                grid, _ = module.token_layout(N, kwargs.get('hw_shape'))
            (ph, pw), topk, router_topk = module.effective_settings(N, grid)
            self.ran.add(((ph, pw), topk, router_topk, N))
            self.macs += mita_flops(B, H, N, d, ph * pw, topk, router_topk,
                                    module.with_shared_expert, with_bias=with_bias)
        else:
            self.macs += attention_flops(B, H, N, d, with_bias=with_bias)


def attention_gmacs(model: nn.Module, batches: Sequence[dict],
                    ran: Optional[set] = None) -> float:
    """Per-image attention GMACs of ``model`` on ``batches`` (test-mode forward);
    ``ran``, if given, receives the settings the MiTA calls ran with
    (:attr:`AttentionMacCounter.ran`)."""
    images = 0
    model.eval()                          # a test-mode forward (BatchNorm, dropout)
    with AttentionMacCounter(model) as counter, torch.no_grad():
        for batch in batches:
            model.test_step(batch)
            images += len(batch['inputs'])
    if ran is not None:
        ran.update(counter.ran)
    return counter.macs / images / 1e9


def ran_label(pool: int, topk: int, ran: set) -> Tuple[str, int]:
    """The label of a sweep row asked as ``pool x pool``, ``topk`` that ran as ``ran``
    (:attr:`AttentionMacCounter.ran`), and the number of landmarks that ran: a pool
    larger than the patch grid runs on the grid (``'MiTA M=16x16 k=49 (asked M=20x20)'``), a
    ``k`` of at least ``N`` reads every key (``'k=100000 (every key)'``)."""
    pools = {p for p, *_ in ran} or {(pool, pool)}
    if len(pools) == 1:
        (ph, pw), = pools
        label = f'MiTA M={ph}x{pw}'
        M = ph * pw
    else:   # grids of several sizes among the counted inputs
        label = 'MiTA M=' + '/'.join(f'{h}x{w}' for h, w in sorted(pools))
        M = max(h * w for h, w in pools)
    label += f' k={topk}'
    clamped = [k < topk for _, k, _, _ in ran]
    if clamped and all(clamped):
        label += ' (every key)'
    elif any(clamped):
        label += ' (every key in some layers)'
    if pools != {(pool, pool)}:
        label += f' (asked M={pool}x{pool})'
    return label, M


def model_gflops(model: nn.Module, batch: dict) -> float:
    """Whole-model GFLOPs (MACs) of the first image of ``batch`` under the model's test
    mode: one traced ``mode='tensor'`` forward per crop, times the crops."""
    from mita_seg.analysis.flop_count import count_flops
    from mita_seg.analysis.segmentor_cost import inference_crops
    x = model.data_preprocessor(batch, False)['inputs'][:1]
    _, crops, (hc, wc) = inference_crops(getattr(model, 'test_cfg', None),
                                         tuple(x.shape[-2:]))
    return crops * count_flops(model, (x[..., :hc, :wc].contiguous(), )).total / 1e9


def swap_sweep(runner: Runner,
               pool_sizes: Sequence[int],
               topks: Sequence[int],
               mita_cfg: Optional[dict] = None,
               flops_images: int = 1,
               progress: Optional[Callable[[str], None]] = None,
               measure: Optional[Callable[[nn.Module, dict], Dict]] = None,
               merge_ratios: Sequence[float] = (),
               plans: Sequence[SwapPlan] = (),
               merge_cfg: Optional[dict] = None,
               merged_swaps: Sequence[Tuple[int, int, float]] = ()) -> List[Dict]:
    """Evaluate ``runner``'s model (checkpoint in ``load_from``) as configured, with
    token merging (ToMe, :func:`mita_seg.merge_tokens`) at every ratio of
    ``merge_ratios``, then on MiTA with every ``(pool size, top-k)``, then on MiTA and
    ToMe together (``merged_swaps``), then with every swap plan of ``plans``.

    Args:
        runner (Runner): a built runner with a test loop and ``load_from``.
        pool_sizes (Sequence[int]): landmark grid sides ``P`` (``M = P * P``).
        topks (Sequence[int]): keys per routed expert.
        mita_cfg (dict, optional): further ``--mita-cfg`` settings (``router_topk``,
            ``layers``...); not ``pool_size``/``topk``.
        flops_images (int): test images the attention MACs are averaged over. Default: 1.
        progress (Callable, optional): called with a line per step.
        measure (Callable, optional): ``measure(model, batch)`` -> further columns of each
            row, measured on the model as evaluated (e.g. images/s) with the first test
            batch; its keys come after ``delta_mIoU``. Default: None.
        merge_ratios (Sequence[float]): token-merging ratios evaluated after the baseline,
            one row each (``merge_ratio`` column), the model unmerged again after them.
            Default: ().
        plans (Sequence[SwapPlan]): swap plans (per-layer settings) evaluated after the
            uniform settings, one row each (``M`` = ``'plan'``). Default: ().
        merge_cfg (dict, optional): further :func:`mita_seg.merge_tokens` arguments of
            every merged row (``include_head``, ``layers``). Default: None.
        merged_swaps (Sequence[tuple[int, int, float]]): ``(pool size, top-k, ratio)``:
            MiTA at ``(pool size, top-k)`` with ToMe at ``ratio`` (layers on MiTA get their
            MLP merged), one row each, after the uniform settings; the model is unmerged
            again before the plans. Default: ().

    Returns:
        list[dict]: one row per setting that ran, baseline first: ``setting, M, topk,
        mIoU, mAcc, aAcc, attn_GMACs, model_GFLOPs, attn_reduction_%, model_reduction_%,
        delta_mIoU`` and ``measure``'s columns. ``setting`` and ``M`` say what ran
        (:func:`ran_label`: a pool larger than the grid runs on the grid); a setting that
        runs exactly as an earlier one (two pools clamped to the same grid, two ``k`` of at
        least ``N``) is not evaluated again, and its row is left out (``progress`` says so).
    """
    progress = progress or (lambda line: None)
    settings: List[Optional[Tuple]] = [None]
    settings += [('tome', r) for r in merge_ratios]
    settings += list(itertools.product(pool_sizes, topks))
    settings += [('mita+tome', ) + tuple(c) for c in merged_swaps] + list(plans)
    merge_cfg = dict(merge_cfg or {})
    unmerge_at = {len(merge_ratios) + 1} if merge_ratios else set()
    if merged_swaps:
        unmerge_at.add(len(settings) - len(plans))
    batches = list(itertools.islice(iter(runner.test_dataloader), flops_images))
    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    rows: List[Dict] = []
    seen: Dict[frozenset, str] = {}      # what ran -> the label of its row
    t0 = time.time()
    for i, setting in enumerate(settings):
        if i in unmerge_at:
            merge_model(model, 0.0, verbose=False, **merge_cfg)  # exactly unmerged again
        ran: set = set()
        M = topk = merge_ratio = ''
        attn = None     # after runner.test(), which loads the checkpoint, sets eval()
        if setting is None:
            configured = any(isinstance(m, MiTASettingsMixin) for m in model.modules())
            label = 'baseline (MiTA as configured)' if configured else 'baseline'
        elif isinstance(setting, tuple) and setting[0] == 'tome':
            merge_ratio = setting[1]
            merge_model(model, merge_ratio, verbose=(i == 1), **merge_cfg)
            label = merge_label(merge_ratio)
        elif isinstance(setting, tuple) and setting[0] == 'mita+tome':
            _, pool, topk, merge_ratio = setting
            swap_model(model, dict(mita_cfg or {}, pool_size=pool, topk=topk), verbose=False)
            merge_model(model, merge_ratio, verbose=False, **merge_cfg)
            attn = attention_gmacs(model, batches, ran)
            label, M = ran_label(pool, topk, ran)
            label = f'{label} + {merge_label(merge_ratio)}'
        elif isinstance(setting, SwapPlan):
            swap_model(model, dict(plan=setting), verbose=False)
            label, M = f'plan {osp.basename(setting.source) or i}', 'plan'
        else:
            pool, topk = setting
            swap_model(model, dict(mita_cfg or {}, pool_size=pool, topk=topk),
                       verbose=(i == 1))
            attn = attention_gmacs(model, batches, ran)   # first: what runs
            label, M = ran_label(pool, topk, ran)
            same = seen.get(frozenset(ran))
            if same is not None:
                progress(f'[{i + 1}/{len(settings)}] MiTA M={pool}x{pool} k={topk} runs '
                         f'exactly as {same!r} on these inputs: not evaluated again, no row')
                continue
            seen[frozenset(ran)] = label
        progress(f'[{i + 1}/{len(settings)}] {label}: evaluating '
                 f'({time.time() - t0:.0f}s elapsed)')
        metrics = runner.test()
        if attn is None:
            attn = attention_gmacs(model, batches)
        row = dict(setting=label, M=M, topk=topk)
        if merge_ratios or merged_swaps:
            row['merge_ratio'] = merge_ratio
        row.update(mIoU=float(metrics['mIoU']),
                   mAcc=float(metrics['mAcc']), aAcc=float(metrics['aAcc']),
                   attn_GMACs=attn, model_GFLOPs=model_gflops(model, batches[0]))
        base = rows[0] if rows else row
        row['attn_reduction_%'] = 100.0 * (1 - row['attn_GMACs'] / base['attn_GMACs'])
        row['model_reduction_%'] = 100.0 * (1 - row['model_GFLOPs'] / base['model_GFLOPs'])
        row['delta_mIoU'] = row['mIoU'] - base['mIoU']
        if measure is not None:
            row.update(measure(model, batches[0]))
        rows.append(row)
        progress(f'[{i + 1}/{len(settings)}] {label}: mIoU {row["mIoU"]:.2f}, attention '
                 f'{row["attn_GMACs"]:.3f} GMACs/img, model {row["model_GFLOPs"]:.3f} '
                 'GFLOPs/img')
    return rows
