"""Analytic attention multiply-adds of a model as it runs: :class:`AttentionMacCounter`
counts every global attention call (standard, MiTA and the other kinds of
:mod:`mita_seg.setting`, BEiT/MAE with their bias adds, ToMe over its merged tokens) with the
formulas of :mod:`mita_seg.ops.flops`, and records the settings
the MiTA calls ran with; :func:`attention_gmacs` is its per-image figure on test batches
(the ``attn_GMACs`` column of ``tools/swap_sweep.py``)."""
from typing import Optional, Sequence

import torch
import torch.nn as nn
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmseg.models.backbones.beit import BEiTAttention

from mita_seg.models import MiTAAttention, MiTABEiTAttention, MiTASettingsMixin, ToMeAttention
from mita_seg.ops import attention_flops


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
        # each call of a swapped module (any kind): (grid (h, w), N, head_dim, global
        # tokens, batch x heads), what :func:`mita_seg.analysis.equal_cost.cost_of` prices
        self.calls = []
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
                grid, glob = module.grid_shape(N), (0, 0)
            else:
                grid, _ = module.token_layout(N, kwargs.get('hw_shape'))
                glob = module.global_tokens_of(N, grid, kwargs.get('global_tokens'))
            # global tokens (a swapped Segmenter head's class tokens): MiTA's, exact both
            # ways; every other kind takes the tokens off the grid as global
            T = sum(glob) if module.setting.is_mita else N - grid[0] * grid[1]
            setting = module.setting_on(N - sum(glob), grid)   # as the forward runs it
            if setting.is_mita:
                self.ran.add((setting.pool, setting.topk, setting.router_topk, N))
            self.calls.append((tuple(grid), N, d, T, B * H))
            self.macs += B * H * setting.attention_macs(grid, N, d, T)
            if with_bias:   # BEiT's bias, added to the kind's logits
                self.macs += B * H * setting.bias_adds(grid, N, T)
        else:
            self.macs += attention_flops(B, H, N, d, with_bias=with_bias)


def attention_gmacs(model: nn.Module, batches: Sequence[dict],
                    ran: Optional[set] = None, calls: Optional[list] = None) -> float:
    """Per-image attention GMACs of ``model`` on ``batches`` (test-mode forward);
    ``ran``, if given, receives the settings the MiTA calls ran with
    (:attr:`AttentionMacCounter.ran`), ``calls`` the calls of its swapped modules
    (:attr:`AttentionMacCounter.calls`)."""
    images = 0
    model.eval()                          # a test-mode forward (BatchNorm, dropout)
    with AttentionMacCounter(model) as counter, torch.no_grad():
        for batch in batches:
            model.test_step(batch)
            images += len(batch['inputs'])
    if ran is not None:
        ran.update(counter.ran)
    if calls is not None:
        calls.extend(counter.calls)
    return counter.macs / images / 1e9
