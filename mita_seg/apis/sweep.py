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
            self.macs += mita_flops(B, H, N, d, ph * pw, topk, router_topk,
                                    module.with_shared_expert, with_bias=with_bias)
        else:
            self.macs += attention_flops(B, H, N, d, with_bias=with_bias)


def attention_gmacs(model: nn.Module, batches: Sequence[dict]) -> float:
    """Per-image attention GMACs of ``model`` on ``batches`` (test-mode forward)."""
    images = 0
    with AttentionMacCounter(model) as counter, torch.no_grad():
        for batch in batches:
            model.test_step(batch)
            images += len(batch['inputs'])
    return counter.macs / images / 1e9


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
               plans: Sequence[SwapPlan] = ()) -> List[Dict]:
    """Evaluate ``runner``'s model (checkpoint in ``load_from``) as configured, with
    token merging (ToMe, :func:`mita_seg.merge_tokens`) at every ratio of
    ``merge_ratios``, then on MiTA with every ``(pool size, top-k)``, then with every
    swap plan of ``plans``.

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

    Returns:
        list[dict]: one row per setting, baseline first: ``setting, M, topk, mIoU, mAcc,
        aAcc, attn_GMACs, model_GFLOPs, attn_reduction_%, model_reduction_%, delta_mIoU``
        and ``measure``'s columns.
    """
    progress = progress or (lambda line: None)
    settings: List[Optional[Tuple]] = [None]
    settings += [('tome', r) for r in merge_ratios]
    settings += list(itertools.product(pool_sizes, topks)) + list(plans)
    batches = list(itertools.islice(iter(runner.test_dataloader), flops_images))
    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    rows: List[Dict] = []
    t0 = time.time()
    for i, setting in enumerate(settings):
        if merge_ratios and i == len(merge_ratios) + 1:
            merge_model(model, 0.0, verbose=False)  # exactly the unmerged model again
        if setting is None:
            configured = any(isinstance(m, MiTASettingsMixin) for m in model.modules())
            label = 'baseline (MiTA as configured)' if configured else 'baseline'
        elif isinstance(setting, tuple) and setting[0] == 'tome':
            merge_model(model, setting[1], verbose=(i == 1))
            label = merge_label(setting[1])
        elif isinstance(setting, SwapPlan):
            swap_model(model, dict(plan=setting), verbose=False)
            label = f'plan {osp.basename(setting.source) or i}'
        else:
            pool, topk = setting
            swap_model(model, dict(mita_cfg or {}, pool_size=pool, topk=topk),
                       verbose=(i == 1))
            label = f'MiTA M={pool}x{pool} k={topk}'
        progress(f'[{i + 1}/{len(settings)}] {label}: evaluating '
                 f'({time.time() - t0:.0f}s elapsed)')
        metrics = runner.test()
        tome = isinstance(setting, tuple) and setting[0] == 'tome'
        plan = isinstance(setting, SwapPlan)
        mita = setting is not None and not (tome or plan)
        row = dict(setting=label, M='plan' if plan else setting[0]**2 if mita else '',
                   topk=setting[1] if mita else '')
        if merge_ratios:
            row['merge_ratio'] = setting[1] if tome else ''
        row.update(mIoU=float(metrics['mIoU']),
                   mAcc=float(metrics['mAcc']), aAcc=float(metrics['aAcc']),
                   attn_GMACs=attention_gmacs(model, batches),
                   model_GFLOPs=model_gflops(model, batches[0]))
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
