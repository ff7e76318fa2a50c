"""FLOP handles that count attention: mmengine's ``FlopAnalyzer`` plus the handles it lacks.

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
``mita_seg::mita_attention``                  :func:`mita_seg.ops.mita_flops`, with the
                                              bias cost when it has a relative-position
                                              bias (``with_bias=True``)
``aten::add`` of BEiT/MAE's bias              ``B H N^2`` (``attn + bias`` in mmseg's
                                              ``BEiTAttention``; every other add stays 0)
``aten::adaptive_avg_pool2d`` in a swapped    0 (the agent kind's landmark pooling, like
attention module                              MiTA's inside its op: not MACs); mmengine's
                                              count elsewhere
``aten::index_add_`` (ToMe's merge)         the adds: ``source`` elements less
                                              ``output`` elements, e.g. ``r (C + 1)`` per item to
                                              merge ``n`` tokens into ``n - r`` (one add =
                                              one FLOP, key ``token_merge_adds``)
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

**Relative-position bias** (BEiT/MAE): adding a bias is not a multiply-accumulate, but it is
what separates BEiT's attention from a ViT's, so it is counted, on one convention for both
sides: **one add = one FLOP**. mmseg's ``BEiTAttention`` adds the dense bias to the logits,
``N^2`` adds per head and batch item (:func:`rel_pos_bias_add_handle`, key
``rel_pos_bias``); MiTA adds ``(2M + k) N`` per head (the landmark scores ``M N``, the
shared logits ``N M``, the routed logits ``N k``) plus the box sums that form the landmark
means (:func:`mita_seg.ops.bias_flops_per_head`; :func:`mita_seg.ops.mita_flops` with
``with_bias=True``). Gathering the bias from the table is memory traffic (0), like top-k.

Tracing notes (torch 2.13): MiTA's ``torch.library.custom_op`` appears in the jit trace as
one node of kind ``mita_seg::mita_attention`` (not ``prim::PythonOp``, which is what an
``autograd.Function`` would give), its scalar arguments as ``prim::Constant`` inputs.
:func:`meta_tracing` lets the tracer run on the ``meta`` device (shapes only).
"""
import contextlib
import warnings
from collections import Counter
from math import prod
from typing import Any, List, Sequence, Tuple, Union

import torch
import torch.nn as nn
from mmengine.analysis import FlopAnalyzer
from mmengine.analysis.jit_handles import get_shape

__all__ = [
    'CONVENTION', 'EXTRA_FLOP_HANDLES', 'ZERO_FLOP_OPS', 'REL_POS_BIAS', 'MERGE_ADDS',
    'flop_analyzer', 'landmark_pool_handle', 'meta_tracing', 'rel_pos_bias_add_handle'
]

# Op-count key of the relative-position bias add of unswapped BEiT/MAE attention.
REL_POS_BIAS = 'rel_pos_bias'
# Op-count key of the adds of an index_add (ToMe's merge of tokens).
MERGE_ADDS = 'token_merge_adds'

CONVENTION = ('one multiply-accumulate (MAC) = one FLOP (mmengine/fvcore convention; '
              'FlopCounterMode and "2 FLOPs per MAC" papers report twice these numbers)')

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


def index_add_flop_jit(inputs: List[Any], outputs: List[Any]) -> Counter:
    """``aten::index_add_(self, dim, index, source, alpha)``: summing ``source`` into a
    zero output takes ``source.numel() - output.numel()`` adds (every output element gets
    at least one ``source`` element, as in ToMe's merge); one add = one FLOP."""
    src = prod(_shape(inputs[3], 'index_add source'))
    out = prod(_shape(outputs[0], 'index_add output'))
    return Counter({MERGE_ADDS: max(src - out, 0)})


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
    """``mita_seg::mita_attention(q, k, v, h, w, ph, pw, topk, router_topk, ...,
    bias_table, ..., global_prefix, global_suffix)``: :func:`mita_seg.ops.mita_flops` with
    the op's scalar arguments, read from the trace, ``with_bias`` when a bias table is
    passed and the global tokens' count."""
    from mita_seg.ops import Inputs, RelPosBias, mita_flops, select_backend
    args = dict(zip(_mita_arg_names(), inputs))
    B, H, N, d = _shape(args['q'], 'the MiTA query')
    c = {n: _constant(args[n], n) for n in ('h', 'w', 'ph', 'pw', 'topk', 'router_topk',
                                            'num_prefix_tokens', 'with_shared_expert',
                                            'shared_scale', 'block_size', 'backend')}
    global_tokens = tuple(_constant(args[n], n) if n in args else 0
                          for n in ('global_prefix', 'global_suffix'))
    bias = args.get('bias_table')       # a traced tensor, or a None constant / left out
    with_bias = bias is not None and not isinstance(bias.type(), torch._C.NoneType)
    device = args['q'].type().device()
    if device is not None and device.type == 'meta':
        # A meta trace stands for a CPU run: count the backend a CPU run would pick.
        q = torch.empty(1, 1, 1, d).expand(B, H, N, d)
        rel_pos_bias = None
        if with_bias:   # a backend that cannot take the bias is not picked on CPU either
            table = torch.empty(_shape(bias, 'the bias table'))
            rel_pos_bias = RelPosBias(table, (_constant(args['window_h'], 'window_h'),
                                              _constant(args['window_w'], 'window_w')))
        c['backend'] = select_backend(Inputs(
            q, q, q, (c['h'], c['w']), (c['ph'], c['pw']), c['topk'], c['router_topk'],
            c['num_prefix_tokens'], c['with_shared_expert'], c['shared_scale'],
            rel_pos_bias, global_tokens=global_tokens))
    return Counter({
        'mita_attention':
        mita_flops(B, H, N, d, num_experts=c['ph'] * c['pw'], topk=c['topk'],
                   router_topk=c['router_topk'], with_shared_expert=c['with_shared_expert'],
                   block_size=c['block_size'], backend=c['backend'], with_bias=with_bias,
                   num_global_tokens=sum(global_tokens))
    })


def rel_pos_bias_modules(model: nn.Module) -> List[str]:
    """Names of the modules of ``model`` that add a relative-position bias to their
    attention logits in the trace: mmseg's ``BEiTAttention`` / ``MAEAttention`` with a bias
    table, and their swapped versions running a kind other than MiTA (top-k, window),
    whose logits take the bias by plain adds; not those on MiTA, whose bias cost is the MiTA
    op's."""
    from mmseg.models.backbones.beit import BEiTAttention

    from mita_seg.models.attention import MiTASettingsMixin
    return [name for name, m in model.named_modules()
            if isinstance(m, BEiTAttention)
            and getattr(m, 'relative_position_bias_table', None) is not None
            and not (isinstance(m, MiTASettingsMixin) and m.setting.is_mita)]


_VIEWS = ('aten::view', 'aten::reshape', 'aten::permute', 'aten::unsqueeze',
          'aten::expand', 'aten::contiguous', 'aten::to', 'aten::transpose')


def _gathered_from_table(value: Any) -> bool:
    """Whether a traced value is entries gathered from a table (``aten::index``), seen
    through views: the bias term of ``logits + bias``."""
    node = value.node()
    while node.kind() in _VIEWS:
        node = next(node.inputs()).node()
    return node.kind() == 'aten::index'


def _scope(value: torch._C.Value) -> str:
    """Name of the innermost module whose forward computed a traced value."""
    scope = value.node().scopeName().split('/')[-1]
    return scope[len('__module.'):] if scope.startswith('__module.') else scope


def landmark_pool_handle(module_names: Sequence[str]):
    """An ``aten::adaptive_avg_pool2d`` handle: 0 for the landmark pooling executed directly
    in one of the modules named ``module_names``
    (:func:`~mita_seg.models.swapped_attention_modules`: the
    agent kind's landmarks, traced as plain ops), as for MiTA's (inside its op) and as
    :mod:`mita_seg.ops.flops` prices both (pooling is not a multiply-accumulate); mmengine's
    count (the input's elements) everywhere else (a PSP head's pooling)."""
    names = set(module_names)

    def handle(inputs: List[Any], outputs: List[Any]) -> Counter:
        if _scope(outputs[0]) in names:
            return Counter()
        return Counter({'adaptive_avg_pool2d': prod(_shape(inputs[0], 'the pooled input'))})

    return handle


def rel_pos_bias_add_handle(module_names: Sequence[str]):
    """An ``aten::add`` handle that counts the relative-position bias add of the modules
    named ``module_names`` (:func:`rel_pos_bias_modules`): ``attn + bias`` executed directly
    in one of them, one add = one FLOP, i.e. ``B H N^2`` for logits ``[B, H, N, N]``. Every
    other add (residuals, embeddings) stays uncounted, as in mmengine."""
    names = set(module_names)

    def handle(inputs: List[Any], outputs: List[Any]) -> Counter:
        if _scope(outputs[0]) not in names or not any(map(_gathered_from_table, inputs[:2])):
            return Counter()   # index arithmetic, outputs merged: not the bias add
        return Counter({REL_POS_BIAS: prod(_shape(outputs[0], 'the biased attention logits'))})

    return handle


EXTRA_FLOP_HANDLES = {
    'aten::scaled_dot_product_attention': sdpa_flop_jit,
    'aten::_native_multi_head_attention': native_mha_flop_jit,
    'aten::baddbmm': baddbmm_flop_jit,
    'aten::index_add_': index_add_flop_jit,
    'aten::index_add': index_add_flop_jit,
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
    :data:`ZERO_FLOP_OPS`, the bias add of unswapped BEiT/MAE attention if ``model`` has any
    (:func:`rel_pos_bias_add_handle`), and its warnings off (unsupported ops are listed by
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
    biased = rel_pos_bias_modules(model)
    if biased:
        analyzer.set_op_handle('aten::add', rel_pos_bias_add_handle(biased))
    from mita_seg.models import swapped_attention_modules
    swapped = [name for name, _ in swapped_attention_modules(model)]
    if swapped:
        analyzer.set_op_handle('aten::adaptive_avg_pool2d', landmark_pool_handle(swapped))
    analyzer.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    analyzer.tracer_warnings('none')
    return analyzer
