"""FLOP counts that count attention: mmengine's ``FlopAnalyzer`` plus the handles it lacks.

mmengine's ``FlopAnalyzer`` (a jit trace, fvcore's rules: **one multiply-accumulate (MAC) =
one FLOP**) counts ``linear/matmul/bmm/einsum/conv`` but gives zero for
``scaled_dot_product_attention``, for the fast path of ``nn.MultiheadAttention``
(``_native_multi_head_attention``), for ``baddbmm`` and for MiTA. :func:`flop_analyzer`
registers handles for them (:data:`EXTRA_FLOP_HANDLES`):

============================================  ==============================================
traced op                                     MACs
============================================  ==============================================
``aten::scaled_dot_product_attention``        ``B L S (E + Ev)`` (``B``: the broadcast batch
                                              and head dims, query heads under GQA; masks
                                              and ``is_causal`` do not reduce it)
``aten::_native_multi_head_attention``        projections ``(2 L + 2 S) E^2`` and attention
                                              ``2 L S E``, per batch item
``aten::baddbmm``                             ``b n m p``, as ``bmm``
``mita_seg::mita_attention``                  :func:`mita_seg.ops.mita_flops`
``topk, sort, argsort, gather, scatter, ...`` 0 (memory traffic, no MACs)
============================================  ==============================================

For full attention over ``N`` tokens of width ``C = H d`` this gives ``2 N^2 C`` per layer
and batch item whichever path torch takes (mmcv's ``bmm`` path, SDPA, the fused fast path).
MiTA's count is :func:`mita_seg.ops.mita_flops` for the backend the traced call ran::

    S = R K^T                 M N d
    G = q R^T                 N M d     (router logits, also the shared logits)
    V_R = softmax(S) V        M N d     (shared expert only)
    shared output  P_s V_R    N M d     (shared expert only)
    routed logits + output    2 L k d   L = N r routed query slots

per head, i.e. ``(4M + 2k) N C`` with the shared expert and ``(2M + 2k) N C`` without
(router top-1). The plain-PyTorch ``'blocked'`` backend also computes the padding slots
of its tiles, ``L = T * ceil((N r + M (T - 1)) / T)``; a ``meta`` trace is counted for the
backend a CPU run would pick.

*Attention* in the breakdown (:class:`FlopBreakdown`) means the token-mixing core only:
``QK^T`` and ``AV`` (``bmm/baddbmm/matmul/einsum`` executed inside an attention module, i.e.
a module whose class name ends in ``Attention`` or ``MSA``), SDPA, the attention part of the
fused MHA kernels and MiTA; the q/k/v and output projections are not attention.
Element-wise ops (softmax, add, GELU, scaling) are not counted, as in mmengine.

Tracing notes (torch 2.13): MiTA's ``torch.library.custom_op`` appears in the jit trace as
one node of kind ``mita_seg::mita_attention`` (not ``prim::PythonOp``, which is what an
``autograd.Function`` would give), its scalar arguments as ``prim::Constant`` inputs.
:class:`SegmentorFlops` counts segmentors built from configs, on CPU or, for large inputs,
on the ``meta`` device (:func:`meta_tracing`), baseline and MiTA side by side.
"""
import contextlib
import copy
import warnings
from collections import Counter
from dataclasses import dataclass, field
from math import prod
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from mmengine.analysis import FlopAnalyzer
from mmengine.analysis.jit_handles import get_shape

__all__ = [
    'CONVENTION', 'EXTRA_FLOP_HANDLES', 'ZERO_FLOP_OPS', 'FlopBreakdown', 'flop_analyzer',
    'count_flops', 'is_attention_module', 'meta_tracing', 'slide_crops', 'inference_crops',
    'load_config', 'build_segmentor', 'decode_head_called_as_module', 'FlopComparison',
    'SegmentorFlops'
]

CONVENTION = ('one multiply-accumulate (MAC) = one FLOP (mmengine/fvcore convention; '
              'FlopCounterMode and "2 FLOPs per MAC" papers report twice these numbers)')

# Op-count keys of the token-mixing core, counted as attention wherever they run.
ATTENTION_KEYS = ('scaled_dot_product_attention', 'native_mha_attention', 'mita_attention')
# Matrix products that are attention when executed inside an attention module.
MATMUL_KEYS = ('bmm', 'baddbmm', 'matmul', 'einsum')
# mmengine's counts of ops that are not multiply-accumulates of a matrix product.
NON_MAC_KEYS = ('batch_norm', 'group_norm', 'layer_norm', 'instance_norm',
                'upsample_nearest2d', 'upsample_bilinear2d', 'adaptive_avg_pool2d',
                'grid_sampler')

# Index selection, sorting, top-k: memory traffic, no multiply-accumulates.
ZERO_FLOP_OPS = ('aten::topk', 'aten::sort', 'aten::argsort', 'aten::argmax', 'aten::argmin',
                 'aten::gather', 'aten::index_select', 'aten::scatter', 'aten::scatter_',
                 'aten::scatter_add', 'aten::scatter_add_', 'aten::take_along_dim',
                 'aten::one_hot', 'aten::cumsum')


def _shape(value: torch._C.Value, what: str) -> List[int]:
    shape = get_shape(value)
    if shape is None:
        raise ValueError(f'FLOP count: the trace has no static shape for {what} (nested '
                         'tensors from a key_padding_mask on the fast path?); count with '
                         'torch.enable_grad() or without masks')
    return list(shape)


def _batch(*shapes: Sequence[int]) -> int:
    """Product of the right-aligned broadcast (max) of batch dims; GQA's query heads
    exceed the key heads, so the larger count is used, not strict broadcasting."""
    n = max(len(s) for s in shapes)
    padded = [[1] * (n - len(s)) + list(s) for s in shapes]
    return prod(max(dims) for dims in zip(*padded))


def sdpa_flop_jit(inputs: List[Any], outputs: List[Any]) -> Counter:
    """``aten::scaled_dot_product_attention(q, k, v, ...)``: ``B L S (E + Ev)``."""
    q = _shape(inputs[0], 'the SDPA query')
    k = _shape(inputs[1], 'the SDPA key')
    v = _shape(inputs[2], 'the SDPA value')
    B = _batch(q[:-2], k[:-2], v[:-2])
    L, E, S, Ev = q[-2], q[-1], k[-2], v[-1]
    return Counter({'scaled_dot_product_attention': B * L * S * (E + Ev)})


def native_mha_flop_jit(inputs: List[Any], outputs: List[Any]) -> Counter:
    """``aten::_native_multi_head_attention(query, key, value, embed_dim, ...)``, the fused
    inference path of ``nn.MultiheadAttention``: projections and attention."""
    q = _shape(inputs[0], 'the MHA query')
    k = _shape(inputs[1], 'the MHA key')
    B, L, S, E = prod(q[:-2]), q[-2], k[-2], q[-1]
    return Counter({
        'native_mha_proj': B * (2 * L + 2 * S) * E * E,  # q and out from L, k and v from S
        'native_mha_attention': 2 * B * L * S * E,
    })


def baddbmm_flop_jit(inputs: List[Any], outputs: List[Any]) -> Counter:
    """``aten::baddbmm(input, batch1, batch2, beta, alpha)``: ``b n m p``."""
    b, n, m = _shape(inputs[1], 'baddbmm batch1')
    p = _shape(inputs[2], 'baddbmm batch2')[-1]
    return Counter({'baddbmm': b * n * m * p})


def _mita_arg_names() -> List[str]:
    from mita_seg import ops  # noqa: F401  (registers torch.ops.mita_seg)
    return [a.name for a in torch.ops.mita_seg.mita_attention.default._schema.arguments]


def _constant(value: torch._C.Value, name: str):
    out = value.toIValue()
    if out is None and value.node().kind() != 'prim::Constant':
        raise ValueError(f'FLOP count: MiTA argument {name!r} is not a constant of the trace '
                         f'(it is computed by {value.node().kind()}); pass Python ints')
    return out


def mita_flop_jit(inputs: List[Any], outputs: List[Any]) -> Counter:
    """``mita_seg::mita_attention(q, k, v, h, w, ph, pw, topk, router_topk, ...)``:
    :func:`mita_seg.ops.mita_flops` with the op's scalar arguments, read from the trace."""
    from mita_seg.ops import Inputs, mita_flops, select_backend
    args = dict(zip(_mita_arg_names(), inputs))
    B, H, N, d = _shape(args['q'], 'the MiTA query')
    c = {n: _constant(args[n], n) for n in ('h', 'w', 'ph', 'pw', 'topk', 'router_topk',
                                             'num_prefix_tokens', 'with_shared_expert',
                                             'shared_scale', 'block_size', 'backend')}
    device = args['q'].type().device()
    if device is not None and device.type == 'meta':
        # A meta trace stands for a CPU run: count the backend a CPU run would pick.
        q = torch.empty(1, 1, 1, d).expand(B, H, N, d)
        c['backend'] = select_backend(Inputs(
            q, q, q, (c['h'], c['w']), (c['ph'], c['pw']), c['topk'], c['router_topk'],
            c['num_prefix_tokens'], c['with_shared_expert'], c['shared_scale']))
    return Counter({
        'mita_attention':
        mita_flops(B, H, N, d, num_experts=c['ph'] * c['pw'], topk=c['topk'],
                   router_topk=c['router_topk'], with_shared_expert=c['with_shared_expert'],
                   block_size=c['block_size'], backend=c['backend'])
    })


EXTRA_FLOP_HANDLES = {
    'aten::scaled_dot_product_attention': sdpa_flop_jit,
    'aten::_native_multi_head_attention': native_mha_flop_jit,
    'aten::baddbmm': baddbmm_flop_jit,
    'mita_seg::mita_attention': mita_flop_jit,
}


def _convolution_meta(input, weight, bias, stride, padding, dilation, transposed,
                      output_padding, groups):
    # The flags are those aten::convolution passes on CPU.
    return torch.ops.aten._convolution.default(input, weight, bias, stride, padding,
                                               dilation, transposed, output_padding, groups,
                                               False, False, True, True)


@contextlib.contextmanager
def meta_tracing():
    """Lets the jit tracer record convolutions of ``meta`` tensors.

    The tracer records a convolution as ``aten::_convolution`` (what mmengine's handle
    counts), which ``aten::convolution`` calls on CPU; on ``meta`` its Python meta kernel
    computes the shape itself, so nothing is recorded, and it fails anyway because the
    tracer turns ``tensor.shape`` into tensors. For the duration of the context, the meta
    kernel of ``aten::convolution`` calls ``aten::_convolution`` as the CPU kernel does; the
    original kernel is restored afterwards.
    """
    lib = torch.library.Library('aten', 'IMPL', 'Meta')
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # "overriding a previously registered kernel"
            lib.impl(torch.ops.aten.convolution.default, _convolution_meta)
        yield
    finally:
        lib._destroy()


def flop_analyzer(model: nn.Module, inputs: Union[torch.Tensor, Tuple]) -> FlopAnalyzer:
    """mmengine's ``FlopAnalyzer`` with the handles of :data:`EXTRA_FLOP_HANDLES`, zero for
    :data:`ZERO_FLOP_OPS`, and its warnings off (unsupported ops are listed by
    :func:`count_flops` instead).

    Args:
        model (nn.Module): the model; ``model(*inputs)`` is traced.
        inputs (Tensor | tuple): its inputs.

    Returns:
        FlopAnalyzer: lazily evaluated (the trace runs on the first query).
    """
    analyzer = FlopAnalyzer(model, inputs)
    analyzer.set_op_handle(**EXTRA_FLOP_HANDLES)
    analyzer.set_op_handle(**{op: None for op in ZERO_FLOP_OPS})
    analyzer.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    analyzer.tracer_warnings('none')
    return analyzer


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` is an attention module: its matrix products (other than
    ``linear``) are the attention core. Covers ``nn.MultiheadAttention``, mmcv's
    ``MultiheadAttention``, MiTA, and by name timm/mmseg attentions (``*Attention``,
    Swin's ``WindowMSA``)."""
    name = type(module).__name__
    return (isinstance(module, nn.MultiheadAttention) or name.endswith('Attention')
            or name.endswith('MSA'))


def _attention_roots(model: nn.Module) -> List[str]:
    """Names of the attention modules that have no attention module above them."""
    roots: List[str] = []
    for name, module in model.named_modules():
        if is_attention_module(module) and not any(_under(name, r) for r in roots):
            roots.append(name)
    return roots


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
        macs (int): matrix-product and convolution MACs only (``total`` minus the
            norm/upsample/pool estimates mmengine adds), comparable with
            ``FlopCounterMode`` (which reports ``2 * macs``).
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
    macs: int = 0
    params: int = 0
    by_operator: Dict[str, int] = field(default_factory=dict)
    not_counted: Dict[str, int] = field(default_factory=dict)

    @property
    def backbone_rest(self) -> int:
        """Backbone FLOPs outside the attention core (projections, MLPs, embeddings)."""
        return self.backbone - self.backbone_attention

    def summary(self, scale: float = 1e9) -> Dict[str, float]:
        """The main figures divided by ``scale`` (GFLOPs by default; params by 1e6)."""
        return dict(total=self.total / scale, backbone=self.backbone / scale,
                    backbone_attention=self.backbone_attention / scale,
                    head=self.head / scale, params=self.params / 1e6)


def _attention_under(analyzer: FlopAnalyzer, roots: List[str], prefix: str) -> int:
    ops = analyzer.by_module_and_operator()
    inside = [r for r in roots if _under(r, prefix)]
    total = sum(ops[prefix][k] for k in ATTENTION_KEYS)  # wherever they run
    for r in inside:
        total += sum(ops[r][k] for k in MATMUL_KEYS)  # matrix products of attention modules
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
    by_op = analyzer.by_operator()

    def part(name: str) -> int:
        return int(by_module[name]) if name in names else 0

    def attention(name: str) -> int:
        return int(_attention_under(analyzer, roots, name)) if name in names else 0

    return FlopBreakdown(
        total=int(analyzer.total()),
        backbone=part(backbone),
        neck=part(neck),
        head=part(head),
        attention=int(_attention_under(analyzer, roots, '')),
        backbone_attention=attention(backbone),
        head_attention=attention(head),
        macs=int(sum(v for k, v in by_op.items() if k not in NON_MAC_KEYS)),
        params=sum(p.numel() for p in model.parameters()),
        by_operator={k: int(v) for k, v in by_op.items()},
        not_counted=dict(analyzer.unsupported_ops()))


def slide_crops(image_shape: Sequence[int], crop_size: Sequence[int],
                stride: Sequence[int]) -> Tuple[int, Tuple[int, int]]:
    """Crops of mmseg's ``EncoderDecoder.slide_inference`` for one image.

    Args:
        image_shape (tuple[int, int]): ``(H, W)`` of the (resized) test image.
        crop_size (tuple[int, int]): ``test_cfg.crop_size``.
        stride (tuple[int, int]): ``test_cfg.stride``.

    Returns:
        tuple: ``(number of crops, crop shape)``; every crop has the same shape
        (``crop_size``, clipped to the image).
    """
    (H, W), (hc, wc), (hs, ws) = image_shape, crop_size, stride
    if min(H, W, hc, wc, hs, ws) < 1:
        raise ValueError(f'image_shape, crop_size and stride must be positive, got '
                         f'{image_shape}, {crop_size}, {stride}')
    h_grids = max(H - hc + hs - 1, 0) // hs + 1
    w_grids = max(W - wc + ws - 1, 0) // ws + 1
    return h_grids * w_grids, (min(hc, H), min(wc, W))


def inference_crops(test_cfg: Optional[dict],
                    image_shape: Sequence[int]) -> Tuple[str, int, Tuple[int, int]]:
    """How a segmentor's ``test_cfg`` runs one image of ``image_shape``.

    Returns:
        tuple: ``(mode, number of forwards, shape of each forward)``: ``('whole', 1,
        image_shape)`` or ``('slide', crops, crop shape)``.
    """
    test_cfg = test_cfg or {}
    mode = test_cfg.get('mode', 'whole')
    if mode == 'slide':
        n, crop = slide_crops(image_shape, test_cfg['crop_size'], test_cfg['stride'])
        return mode, n, crop
    if mode != 'whole':
        raise ValueError(f"test_cfg.mode must be 'whole' or 'slide', got {mode!r}")
    return mode, 1, (int(image_shape[0]), int(image_shape[1]))


# --------------------------------------------------------------------------------------
# Segmentors built from configs: baseline and MiTA side by side.
# --------------------------------------------------------------------------------------
def load_config(config: str, cfg_options: Optional[dict] = None):
    """An mmengine ``Config`` from a file, or from an installed package
    (``'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'``).

    Raises:
        ValueError: the file does not exist.
    """
    import os.path as osp

    from mmengine import Config
    if osp.isfile(config):
        cfg = Config.fromfile(config)
    elif '::' in config:
        from mmengine.hub import get_config
        cfg = get_config(config)
    else:
        raise ValueError(f'config {config!r} does not exist: give a config file or '
                         "'mmseg::<dir>/<config>.py'")
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def build_segmentor(cfg, seed: int = 0) -> nn.Module:
    """The segmentor of ``cfg`` as mmseg's ``get_flops.py`` counts it: random weights
    (no checkpoint is loaded), auxiliary head removed, SyncBN reverted, eval mode, CPU."""
    from mmengine.model import revert_sync_batchnorm
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    import mita_seg.models  # noqa: F401  (registers MiTA types for MiTA configs)
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    torch.manual_seed(seed)
    model = MODELS.build(copy.deepcopy(cfg.model))  # building edits the config
    if getattr(model, 'auxiliary_head', None) is not None:
        model.auxiliary_head = None
    return revert_sync_batchnorm(model).eval()


def _pair(shape: Union[int, Sequence[int]], name: str) -> Tuple[int, int]:
    if isinstance(shape, int):
        shape = (shape, shape)
    shape = tuple(shape)
    if len(shape) != 2 or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(f'{name} must be one or two positive ints (H W), got {shape}')
    return shape


@contextlib.contextmanager
def decode_head_called_as_module(model: nn.Module):
    """Make ``EncoderDecoder``'s ``mode='tensor'`` forward call ``decode_head(x)``.

    mmseg's ``EncoderDecoder._forward`` (like ``predict`` and ``loss``) calls
    ``decode_head.forward(x)`` directly, so the head's forward hooks do not run: the
    analyzer's scope for the head (its own ops would count for the root module only) and
    the hook that gives swapped MiTA head layers their grid. Within this context the same
    computation goes through ``decode_head.__call__``. Other segmentors are left as they are.
    """
    from mmseg.models.segmentors import EncoderDecoder
    if not (isinstance(model, EncoderDecoder)
            and type(model)._forward is EncoderDecoder._forward):
        yield
        return

    def _forward(inputs, data_samples=None):
        return model.decode_head(model.extract_feat(inputs))

    model._forward = _forward
    try:
        yield
    finally:
        del model._forward


@dataclass
class FlopComparison:
    """Baseline and MiTA FLOPs of one segmentor at one input shape.

    Attributes:
        name (str): what was counted (the config's name).
        shape (tuple[int, int]): input shape of the counted forward (one crop).
        baseline (FlopBreakdown): the model as configured.
        mita (FlopBreakdown, optional): after :func:`mita_seg.swap_attention`; None when
            nothing could be swapped.
        mita_cfg (dict): the MiTA settings.
        num_swapped (int): attention modules on MiTA.
        note (str): why there is no MiTA column, or other remarks.
        image (dict, optional): whole-image cost under the model's ``test_cfg``: ``shape``,
            ``mode``, ``crops``, ``crop_shape``, ``baseline`` and ``mita`` (FLOPs).
    """
    name: str
    shape: Tuple[int, int]
    baseline: FlopBreakdown
    mita: Optional[FlopBreakdown] = None
    mita_cfg: Dict[str, Any] = field(default_factory=dict)
    num_swapped: int = 0
    note: str = ''
    image: Optional[Dict[str, Any]] = None

    def reduction(self, key: str) -> Optional[float]:
        """Percent fewer FLOPs of MiTA in ``key`` (``'total'``, ``'backbone'``...)."""
        if self.mita is None:
            return None
        base, new = getattr(self.baseline, key), getattr(self.mita, key)
        return 100.0 * (1 - new / base) if base else 0.0

    def to_json(self) -> Dict[str, Any]:
        """The figures for scripts: GFLOPs, params in millions."""
        return {
            'convention': CONVENTION + '; FLOPs in GFLOPs (1e9), params in M (1e6)',
            'shape': list(self.shape),
            'baseline': self.baseline.summary(),
            'mita': None if self.mita is None else self.mita.summary(),
            'reduction_percent': None if self.mita is None else {
                'total': self.reduction('total'),
                'backbone': self.reduction('backbone')
            },
        }

    def format(self) -> str:
        """The side-by-side table the tool prints."""
        g = 1e9
        rows = [('total', 'total'), ('backbone', 'backbone'),
                ('  attention (QK^T, AV, SDPA, MiTA)', 'backbone_attention'),
                ('  rest (projections, MLP, embed)', 'backbone_rest')]
        if self.baseline.neck or (self.mita and self.mita.neck):
            rows.append(('neck', 'neck'))
        rows.append(('decode head', 'head'))
        if self.baseline.head_attention or (self.mita and self.mita.head_attention):
            rows.append(('  attention', 'head_attention'))
        H, W = self.shape
        lines = [f'FLOPs of {self.name}: input {H}x{W} (one crop, mode=\'tensor\', '
                 'auxiliary head removed)',
                 f'Convention: {CONVENTION}. GFLOPs = 1e9 MACs.']
        if self.mita is not None:
            lines.append(f'MiTA: {self.num_swapped} attention modules swapped, '
                         + ', '.join(f'{k}={v}' for k, v in self.mita_cfg.items()))
        if self.note:
            lines.append(self.note)
        label = 'as config' if self.note.startswith('note: the config already') else 'baseline'
        head = f'{"":36s}{label:>12s}'
        if self.mita is not None:
            head += f'{"MiTA":>12s}{"reduction":>11s}'
        lines += ['', head]
        for label, key in rows:
            line = f'{label + " (GFLOPs)" if key == "total" else label:36s}'
            line += f'{getattr(self.baseline, key) / g:12.2f}'
            if self.mita is not None:
                line += f'{getattr(self.mita, key) / g:12.2f}{self.reduction(key):10.1f}%'
            lines.append(line)
        line = f'{"params (M)":36s}{self.baseline.params / 1e6:12.2f}'
        if self.mita is not None:
            line += f'{self.mita.params / 1e6:12.2f}'
        lines.append(line)
        if self.image is not None:
            im = self.image
            ih, iw = im['shape']
            ch, cw = im['crop_shape']
            how = 'whole'
            if im['mode'] == 'slide':
                how = f"slide: {im['crops']} crop{'s' * (im['crops'] > 1)} of {ch}x{cw}"
            lines.append(f'whole image {ih}x{iw} under test_cfg ({how}):')
            line = f'{"  total (GFLOPs)":36s}{im["baseline"] / g:12.2f}'
            if self.mita is not None and im.get('mita') is not None:
                red = 100.0 * (1 - im['mita'] / im['baseline'])
                line += f'{im["mita"] / g:12.2f}{red:10.1f}%'
            lines.append(line)
        return '\n'.join(lines)


class SegmentorFlops:
    """Counts a config's segmentor, and the same segmentor swapped to MiTA, at any shape.

    Args:
        cfg (Config): an mmseg config (:func:`load_config`).
        mita_cfg (dict, optional): arguments of :func:`mita_seg.swap_attention`
            (``pool_size``, ``topk``, ...); None counts the baseline only. Default: None.
        device (str): ``'cpu'`` runs the traced forward for real (as mmseg's tool does);
            ``'meta'`` traces with shape-only tensors, same graph and counts without the
            compute or memory (for large inputs). Default: ``'cpu'``.
        name (str): how the model is named in the output. Default: ``'segmentor'``.
    """

    def __init__(self, cfg, mita_cfg: Optional[dict] = None, device: str = 'cpu',
                 name: str = 'segmentor'):
        if device not in ('cpu', 'meta'):
            raise ValueError(f"device must be 'cpu' or 'meta', got {device!r}")
        self.name, self.device = name, device
        self.mita_cfg = dict(mita_cfg or {})
        self.baseline = build_segmentor(cfg)
        self.preprocessor = copy.deepcopy(self.baseline.data_preprocessor)
        self.test_cfg = getattr(self.baseline, 'test_cfg', None)
        self.note = ''
        if any(type(m).__name__ == 'MiTAAttention' for m in self.baseline.modules()):
            self.note = 'note: the config already uses MiTA; "baseline" is the model as configured'
        self.baseline.to(device)
        self.mita, self.num_swapped = None, 0
        if mita_cfg is not None:
            from mita_seg.models import swap_attention
            model = copy.deepcopy(self.baseline)
            try:
                self.num_swapped = swap_attention(model, verbose=False, **self.mita_cfg)
                self.mita = model
            except ValueError as e:
                lines = str(e).splitlines()
                more = f' ... ({len(lines) - 4} more)' if len(lines) > 4 else ''
                self.note = ('cannot swap to MiTA, baseline only: '
                             + ' '.join(s.strip() for s in lines[:4]) + more)

    def inputs(self, shape: Sequence[int]) -> torch.Tensor:
        """Preprocessed inputs ``[1, 3, H', W']`` for an image of ``shape`` (as mmseg's
        data preprocessor pads it in test mode), on the counting device."""
        from mmseg.structures import SegDataSample
        H, W = _pair(shape, 'shape')
        meta = dict(ori_shape=(H, W), img_shape=(H, W), pad_shape=(H, W))
        data = dict(inputs=[torch.zeros(3, H, W, dtype=torch.uint8)],
                    data_samples=[SegDataSample(metainfo=meta)])
        return self.preprocessor(data, training=False)['inputs'].to(self.device)

    def count(self, shape: Sequence[int]) -> Tuple[FlopBreakdown, Optional[FlopBreakdown]]:
        """FLOPs of one ``mode='tensor'`` forward of an input of ``shape``, baseline and
        MiTA (None if not swapped)."""
        x = self.inputs(shape)
        out = []
        for model in (self.baseline, self.mita):
            if model is not None:
                with torch.no_grad(), decode_head_called_as_module(model):
                    model = count_flops(model, (x, ))
            out.append(model)
        return out[0], out[1]

    def compare(self, shape: Sequence[int],
                image_shape: Optional[Sequence[int]] = None) -> FlopComparison:
        """Side-by-side counts at ``shape``, and the whole-image cost of an image of
        ``image_shape`` (default: ``shape``) under the config's ``test_cfg``."""
        shape = _pair(shape, 'shape')
        image_shape = shape if image_shape is None else _pair(image_shape, 'image_shape')
        base, mita = self.count(shape)
        padded = tuple(self.inputs(image_shape).shape[-2:])  # test-time padding, if any
        mode, crops, crop = inference_crops(self.test_cfg, padded)
        cbase, cmita = (base, mita) if tuple(crop) == shape else self.count(crop)
        image = dict(shape=image_shape, mode=mode, crops=crops, crop_shape=crop,
                     baseline=crops * cbase.total,
                     mita=None if cmita is None else crops * cmita.total)
        return FlopComparison(self.name, shape, base, mita, self.mita_cfg, self.num_swapped,
                              self.note, image)
