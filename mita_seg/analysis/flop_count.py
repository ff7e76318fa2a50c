"""Counting the FLOPs of a forward, attention included, split by part of a segmentor.

*Attention* in the breakdown (:class:`FlopBreakdown`) means the token-mixing core only:
``QK^T`` and ``AV`` (``bmm/baddbmm/matmul/einsum`` executed inside an attention module,
:func:`mita_seg.utils.is_attention_module`), SDPA, the attention part of the fused MHA
kernels, BEiT/MAE's relative-position bias add (one add = one FLOP,
:func:`~mita_seg.analysis.flop_handles.rel_pos_bias_add_handle`) and MiTA (its bias
included); the q/k/v and output projections are not attention. Element-wise ops
(softmax, add, GELU, scaling) are not counted, as in mmengine.

*Token merging* (ToMe, :func:`mita_seg.merge_tokens`) is everything its
:class:`~mita_seg.models.token_merge.TokenMerger` modules run: the bipartite matching
(a ``matmul``, MACs) and the merge (``index_add_``, one add = one FLOP); it is reported
on its own (``token_merge``), never as attention, even for the merger inside an attention
module. The attention over the merged tokens (and its proportional ``log(size)`` mask, an
element-wise add fused in ``baddbmm``, not counted) is attention as usual.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple, Union

import torch
import torch.nn as nn
from mmengine.analysis import FlopAnalyzer

from mita_seg.utils.modules import is_attention_module, is_token_merger
from .flop_handles import MERGE_ADDS, REL_POS_BIAS, flop_analyzer, meta_tracing

__all__ = ['FlopBreakdown', 'count_flops']

# Op-count keys of the token-mixing core, counted as attention wherever they run.
ATTENTION_KEYS = ('scaled_dot_product_attention', 'native_mha_attention', 'mita_attention',
                  REL_POS_BIAS)
# Matrix products that are attention when executed inside an attention module.
MATMUL_KEYS = ('bmm', 'baddbmm', 'matmul', 'einsum')
# Counts of ops that are not multiply-accumulates of a matrix product: mmengine's estimates,
# and BEiT's bias adds (MiTA's bias adds stay inside its 'mita_attention' count).
NON_MAC_KEYS = ('batch_norm', 'group_norm', 'layer_norm', 'instance_norm',
                'upsample_nearest2d', 'upsample_bilinear2d', 'adaptive_avg_pool2d',
                'grid_sampler', REL_POS_BIAS, MERGE_ADDS)


def _attention_roots(model: nn.Module) -> List[str]:
    """Names of the attention modules that have no attention module above them."""
    roots: List[str] = []
    for name, module in model.named_modules():
        if is_attention_module(module) and not any(_under(name, r) for r in roots):
            roots.append(name)
    return roots


def _token_mergers(model: nn.Module) -> List[str]:
    """Names of the token mergers (ToMe) of ``model``."""
    return [name for name, module in model.named_modules() if is_token_merger(module)]


def _under(name: str, prefix: str) -> bool:
    return prefix == '' or name == prefix or name.startswith(prefix + '.')


@dataclass
class FlopBreakdown:
    """FLOPs (MACs) of one forward, split by part of a segmentor.

    Attributes:
        total (int): the whole forward.
        backbone, neck, head (int): ``model.backbone``, ``model.neck``,
            ``model.decode_head`` (0 where the model has no such part).
        attention (int): the attention core everywhere in the model.
        backbone_attention, head_attention (int): the attention core inside the backbone
            and the decode head.
        token_merge (int): ToMe's matching and merging everywhere in the model (0 without
            :func:`mita_seg.merge_tokens`).
        macs (int): matrix-product and convolution MACs only (``total`` minus the
            norm/upsample/pool estimates mmengine adds and BEiT's bias adds), comparable
            with ``FlopCounterMode`` (which reports ``2 * macs``; for MiTA with a bias,
            ``macs`` still holds its bias adds, :func:`mita_seg.ops.bias_flops_per_head`).
        params (int): parameters of the model.
        by_operator (dict): FLOPs by op name.
        not_counted (dict): traced ops counted as zero FLOPs (element-wise ops), with
            their number of calls.
    """
    total: int
    backbone: int = 0
    neck: int = 0
    head: int = 0
    attention: int = 0
    backbone_attention: int = 0
    head_attention: int = 0
    token_merge: int = 0
    macs: int = 0
    params: int = 0
    by_operator: Dict[str, int] = field(default_factory=dict)
    not_counted: Dict[str, int] = field(default_factory=dict)

    @property
    def backbone_rest(self) -> int:
        """Backbone FLOPs outside the attention core (projections, MLPs, embeddings)."""
        return self.backbone - self.backbone_attention

    def summary(self, scale: float = 1e9) -> Dict[str, float]:
        """The main figures divided by ``scale`` (GFLOPs by default; params by 1e6), and
        ``token_merge`` where tokens are merged."""
        out = dict(total=self.total / scale, backbone=self.backbone / scale,
                   backbone_attention=self.backbone_attention / scale,
                   head=self.head / scale, params=self.params / 1e6)
        if self.token_merge:
            out['token_merge'] = self.token_merge / scale
        return out


def _attention_under(analyzer: FlopAnalyzer, roots: List[str], prefix: str,
                     mergers: Sequence[str] = ()) -> int:
    ops = analyzer.by_module_and_operator()
    inside = [r for r in roots if _under(r, prefix)]
    total = sum(ops[prefix][k] for k in ATTENTION_KEYS)  # wherever they run
    for r in inside:
        total += sum(ops[r][k] for k in MATMUL_KEYS)  # matrix products of attention modules
        for m in mergers:  # but not ToMe's matching inside them
            if _under(m, r):
                total -= sum(ops[m][k] for k in MATMUL_KEYS)
    return total


def count_flops(model: nn.Module,
                inputs: Union[torch.Tensor, Tuple],
                backbone: str = 'backbone',
                neck: str = 'neck',
                head: str = 'decode_head') -> FlopBreakdown:
    """Count the FLOPs of ``model(*inputs)``, attention included, split by part.

    The model is traced as it is, in the caller's grad mode (``model.eval()`` and
    ``torch.no_grad()`` for inference, where torch may take fused attention paths; the
    counts are the same on every path).

    Args:
        model (nn.Module): a segmentor (``mode='tensor'`` forward) or any module.
        inputs (Tensor | tuple): inputs of one forward.
        backbone, neck, head (str): names of the submodules reported as backbone, neck
            and decode head; missing ones count 0. Defaults: mmseg's names.

    Returns:
        FlopBreakdown: the counts, in MACs (:data:`CONVENTION`).
    """
    analyzer = flop_analyzer(model, inputs)
    tensors = [x for x in (inputs if isinstance(inputs, tuple) else (inputs, ))
               if isinstance(x, torch.Tensor)]
    on_meta = any(x.is_meta for x in tensors)
    with meta_tracing() if on_meta else contextlib.nullcontext():
        by_module = analyzer.by_module()
    names = dict(model.named_modules())
    roots = _attention_roots(model)
    mergers = _token_mergers(model)
    by_op = analyzer.by_operator()

    def part(name: str) -> int:
        return int(by_module[name]) if name in names else 0

    def attention(name: str) -> int:
        return int(_attention_under(analyzer, roots, name, mergers)) if name in names else 0

    return FlopBreakdown(
        total=int(analyzer.total()),
        backbone=part(backbone),
        neck=part(neck),
        head=part(head),
        attention=int(_attention_under(analyzer, roots, '', mergers)),
        backbone_attention=attention(backbone),
        head_attention=attention(head),
        token_merge=sum(int(by_module[m]) for m in mergers),
        macs=int(sum(v for k, v in by_op.items() if k not in NON_MAC_KEYS)),
        params=sum(p.numel() for p in model.parameters()),
        by_operator={k: int(v) for k, v in by_op.items()},
        not_counted=dict(analyzer.unsupported_ops()))
