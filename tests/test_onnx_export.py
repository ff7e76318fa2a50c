"""MiTA to ONNX: the translation of ``mita_seg::mita_attention`` into default-domain ONNX
operators, run in ONNX Runtime against the dense reference operator, the routing-aware
check (near-ties told from a wrong graph), and ``tools/export_onnx.py`` end to end (ONNX
Runtime's logits against PyTorch's)."""
import functools
import os
import os.path as osp

import pytest
import torch
import torch.nn.functional as F

import onnx  # requirements.txt: onnx, onnxruntime, onnxscript
import onnxruntime as ort

from mita_seg import swap_attention
from mita_seg.ops import Inputs, RelPosBias, mita_attention, mita_attention_reference
from mita_seg.ops.bias import table_size
from mita_seg.ops.global_tokens import with_global_tokens
from mita_seg.ops.onnx import (OnnxExportError, mita_translation_table,
                               onnx_unsupported, pool_matrix, routing_ties)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY_SEGMENTER = osp.join(ROOT, 'configs', 'baselines',
                          'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')
TINY_UPERNET = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
TINY_BEIT = osp.join(ROOT, 'configs', 'baselines', 'beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py')


class MiTACall(torch.nn.Module):
    """One MiTA operator call with fixed settings (the relative position bias table is a
    parameter, as in BEiT)."""

    def __init__(self, hw, pool, topk, router_topk=1, prefix=1, shared=True, table=None,
                 global_tokens=(0, 0)):
        super().__init__()
        self.settings = (hw, pool, topk, router_topk, prefix, shared)
        self.table = None if table is None else torch.nn.Parameter(table)
        self.global_tokens = global_tokens

    def forward(self, q, k, v):
        hw, pool, topk, r, p, shared = self.settings
        bias = None if self.table is None else RelPosBias(self.table, hw)
        return mita_attention(q, k, v, hw, pool, topk, r, p, shared, rel_pos_bias=bias,
                              global_tokens=self.global_tokens)


def run_in_ort(module, inputs, path, formulation='tiles', tile_size=None):
    """Export ``module`` with MiTA's translation, check the file, run it in ORT."""
    with torch.no_grad():
        program = torch.onnx.export(
            module.eval(), inputs, dynamo=True, opset_version=18, verbose=False,
            custom_translation_table=mita_translation_table(formulation, tile_size))
    program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    # default domain only: no custom operator library needed by any runtime
    assert {n.domain for n in model.graph.node} <= {'', 'ai.onnx'}
    assert 'mita_attention' not in {n.op_type for n in model.graph.node}
    sess = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    feed = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)}
    return torch.from_numpy(sess.run(None, feed)[0])


# id: (B, H, d, hw, prefix, suffix, pool, topk, router_topk, shared, bias)
CASES = {
    'nonsquare-cls-suffix': (2, 3, 8, (5, 7), 1, 4, (2, 3), 6, 1, True, False),
    'pool-not-dividing-grid': (1, 2, 16, (9, 11), 1, 0, (4, 3), 10, 1, True, False),
    'grid-equal-to-pool': (1, 2, 8, (3, 2), 1, 5, (3, 2), 4, 1, True, False),
    'no-prefix-odd-head-dim': (2, 2, 7, (4, 6), 0, 3, (2, 2), 5, 1, True, False),
    'router-top2': (1, 3, 8, (6, 5), 1, 4, (2, 3), 7, 2, True, False),
    'router-top3-route-only': (1, 2, 8, (6, 6), 1, 0, (3, 3), 5, 3, False, False),
    'route-only': (2, 2, 8, (5, 7), 1, 2, (2, 2), 9, 1, False, False),
    'rel-pos-bias': (1, 3, 8, (5, 6), 1, 0, (3, 2), 7, 1, True, True),
    'rel-pos-bias-top2': (1, 2, 8, (4, 7), 1, 0, (2, 3), 6, 2, True, True),
}


def case_inputs(B, H, d, hw, prefix, suffix, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = prefix + hw[0] * hw[1] + suffix
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))
    table = torch.randn(H, table_size(hw), generator=g) if bias else None
    return q, k, v, table


# the tiled formulation on every case; the per-query gather (kept for measurement) on a few
GATHER_CASES = ('nonsquare-cls-suffix', 'router-top2', 'rel-pos-bias')


@pytest.mark.parametrize('case,formulation',
                         [(c, 'tiles') for c in CASES] + [(c, 'gather') for c in GATHER_CASES])
def test_translation_matches_reference(case, formulation, tmp_path):
    B, H, d, hw, p, s, pool, topk, r, shared, bias = CASES[case]
    q, k, v, table = case_inputs(B, H, d, hw, p, s, bias)
    rb = None if table is None else RelPosBias(table, hw)
    ref = mita_attention_reference(Inputs(q, k, v, hw, pool, topk, r, p, shared, None, rb))
    out = run_in_ort(MiTACall(hw, pool, topk, r, p, shared, table), (q, k, v),
                     tmp_path / 'mita.onnx', formulation)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


# id: (B, H, d, hw, prefix, suffix, pool, topk, router_topk, shared, global (prefix, suffix))
GLOBAL_CASES = {
    # Segmenter's head: class embeddings after the grid, global; no prefix
    'global-suffix': (2, 3, 8, (5, 7), 0, 6, (2, 3), 6, 1, True, (0, 6)),
    # ViT's cls global, routed suffix tokens beside it; a pool not dividing the grid
    'global-cls': (2, 2, 16, (9, 11), 1, 3, (4, 3), 10, 1, True, (1, 0)),
    'global-both-top2': (2, 2, 8, (6, 5), 2, 4, (2, 3), 7, 2, True, (1, 4)),
    'global-route-only': (1, 2, 7, (4, 6), 1, 5, (2, 2), 5, 1, False, (1, 2)),
    'global-top3-route-only': (3, 2, 8, (6, 6), 0, 2, (3, 3), 5, 3, False, (0, 2)),
    'global-grid-equal-to-pool': (2, 2, 8, (3, 2), 1, 5, (3, 2), 4, 1, True, (1, 5)),
}


@pytest.mark.parametrize('case,formulation',
                         [(c, 'tiles') for c in GLOBAL_CASES] +
                         [(c, 'gather') for c in ('global-suffix', 'global-both-top2',
                                                  'global-route-only')])
def test_translation_with_global_tokens(case, formulation, tmp_path):
    # global tokens: the other tokens' MiTA with the global keys lse-merged, the global
    # queries' dense attention, concatenated in token order, against PyTorch's reference
    B, H, d, hw, p, s, pool, topk, r, shared, glob = GLOBAL_CASES[case]
    q, k, v, _ = case_inputs(B, H, d, hw, p, s, False, seed=4)
    ref = with_global_tokens(Inputs(q, k, v, hw, pool, topk, r, p, shared, None, None,
                                    None, glob), mita_attention_reference)
    out = run_in_ort(MiTACall(hw, pool, topk, r, p, shared, global_tokens=glob), (q, k, v),
                     tmp_path / 'mita.onnx', formulation)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_global_tokens_route_only_all_keys_is_softmax_attention(tmp_path):
    # a dense oracle outside the operator's code: route-only with k >= N - T, so every
    # query reads every other key, and the global keys exactly: softmax attention
    q, k, v, _ = case_inputs(2, 2, 8, (5, 6), 1, 4, False, seed=5)
    N = q.shape[2]
    out = run_in_ort(MiTACall((5, 6), (2, 3), N - 5, shared=False, global_tokens=(1, 4)),
                     (q, k, v), tmp_path / 'm.onnx')
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v),
                               atol=2e-6, rtol=1e-5)


def test_routing_ties_global_rows_are_never_ties():
    # the global rows are not routed; the other rows' routing is that of the other tokens
    q, k, v, _ = case_inputs(2, 2, 8, (4, 5), 1, 3, False, seed=6)
    ties = routing_ties(q, k, (4, 5), (2, 2), 5, 1, 1, None, None, rtol=1.0,
                        global_tokens=(1, 3))
    assert ties.shape == q.shape[:3] and ties.dtype == torch.bool
    assert not ties[:, :, :1].any() and not ties[:, :, -3:].any()
    inner = routing_ties(q[:, :, 1:-3], k[:, :, 1:-3], (4, 5), (2, 2), 5, 1, 0, None, None,
                         rtol=1.0)
    assert torch.equal(ties[:, :, 1:-3], inner) and inner.any()


@pytest.mark.parametrize('tile_size', [1, 4, 64])
def test_tile_sizes_agree(tile_size, tmp_path):
    # one slot per tile, a few, and one tile larger than any expert's queries
    q, k, v, _ = case_inputs(1, 2, 8, (6, 7), 1, 3, False, seed=1)
    ref = mita_attention_reference(Inputs(q, k, v, (6, 7), (3, 2), 8, 1, 1))
    out = run_in_ort(MiTACall((6, 7), (3, 2), 8), (q, k, v), tmp_path / 'm.onnx',
                     tile_size=tile_size)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_route_only_all_keys_is_softmax_attention(tmp_path):
    # route-only MiTA with k >= N: every query reads every key: softmax attention
    q, k, v, _ = case_inputs(1, 2, 8, (5, 6), 1, 3, False, seed=2)
    N = q.shape[2]
    out = run_in_ort(MiTACall((5, 6), (2, 3), N, shared=False), (q, k, v),
                     tmp_path / 'm.onnx')
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v),
                               atol=2e-6, rtol=1e-5)


def test_route_only_all_keys_with_bias_is_beit_attention(tmp_path):
    q, k, v, table = case_inputs(1, 2, 8, (4, 5), 1, 0, True, seed=3)
    from mita_seg.ops.bias import dense_bias
    dense = dense_bias(RelPosBias(table, (4, 5)))
    out = run_in_ort(MiTACall((4, 5), (2, 2), q.shape[2], shared=False, table=table),
                     (q, k, v), tmp_path / 'm.onnx')
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, dense[None]),
                               atol=2e-6, rtol=1e-5)


class MiTAStack(torch.nn.Module):
    """``layers`` MiTA calls in a row, each with its own relative position bias table (a
    parameter, as in BEiT's layers) or none."""

    def __init__(self, hw, pool, topk, layers, bias, seed=0, router_topk=1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.calls = torch.nn.ModuleList(
            MiTACall(hw, pool, topk, router_topk,
                     table=torch.randn(2, table_size(hw), generator=g) if bias else None)
            for _ in range(layers))

    def forward(self, q, k, v):
        for call in self.calls:
            q = call(q, k, v)
        return q


def initializer_bytes(path, skip=()):
    """``(total, [(bytes, name), ...] largest first)`` of the file's initializers, those
    named in ``skip`` left out."""
    from onnx import numpy_helper
    sizes = sorted(((numpy_helper.to_array(t).nbytes, t.name)
                    for t in onnx.load(str(path)).graph.initializer if t.name not in skip),
                   reverse=True)
    return sum(n for n, _ in sizes), sizes


def test_bias_adds_no_constant_of_the_grid(tmp_path):
    # The relative position bias adds constants of the landmarks' size to the file, none of
    # the grid's, however many layers. The exporter's optimizer folded its box sums'
    # indices (8 int64 [Ph, Pw, Wh, Ww] per layer) into the file, and from a table of up to
    # 8192 values the float64 integral image or Bq and Bk themselves, layer by layer: 12.8
    # MB of the tiny BEiT's 15.6 MB at 256 (here 37 KB at 8 x 8, 147 KB at 16 x 16)
    added = {}
    for hw in ((8, 8), (16, 16)):
        q, k, v, _ = case_inputs(1, 2, 8, hw, 1, 0, False, seed=7)
        consts = []
        for bias in (False, True):
            module = MiTAStack(hw, (4, 4), 8, 2, bias)
            path = tmp_path / f'{hw[0]}-{bias}.onnx'
            out = run_in_ort(module, (q, k, v), path)
            params = {name for name, _ in module.named_parameters()}
            consts.append(initializer_bytes(path, params))
        added[hw] = consts[1][0] - consts[0][0]
        with torch.no_grad():      # the two layers with their bias, as PyTorch runs them
            torch.testing.assert_close(out, module(q, k, v), atol=1e-5, rtol=1e-5)
    assert added[(16, 16)] <= added[(8, 8)] < 2048, (added, consts[1][1][:4])


@pytest.mark.parametrize('router_topk', [1, 2])
def test_mita_adds_no_constant_of_the_grid(router_topk, tmp_path):
    # A MiTA layer's constants do not grow with the grid (nor with B H): the pooling's
    # two averaging matrices ([Ph, h], [Pw, w]) are all that does. The tiles' layout built
    # its item numbers, a ones and a zeros tensor by Expand of small constants, which the
    # exporter's optimizer folded into int64 constants of [BH, N r], [BH, N r] and [BH, L]
    # per layer (the tiny BEiT: 236 KB of its 4 layers; BEiT-B at 1024: about 18 MB): here
    # 26 KB at 8 x 8 and 67 KB at 16 x 16 with r = 1 (34 and 133 KB with r = 2), now under
    # 1 KB at both
    total, sizes = {}, {}
    for hw in ((8, 8), (16, 16)):
        q, k, v, _ = case_inputs(2, 2, 8, hw, 1, 0, False, seed=11)
        module = MiTAStack(hw, (4, 4), 8, 2, False, router_topk=router_topk)
        path = tmp_path / f'{hw[0]}.onnx'
        out = run_in_ort(module, (q, k, v), path)
        total[hw], sizes[hw] = initializer_bytes(path)
        with torch.no_grad():      # the two layers, as PyTorch runs them
            torch.testing.assert_close(out, module(q, k, v), atol=1e-5, rtol=1e-5)
    grown = total[(16, 16)] - total[(8, 8)]
    # the averaging matrices grow by at most 2 layers x 2 x 4 x 8 float32 (512 B; the
    # exporter keeps one copy of equal constants: 128 B)
    assert grown <= 1024 and total[(16, 16)] < 4096, (total, sizes[(16, 16)][:4])


def test_pool_matrix_is_adaptive_avg_pool():
    x = torch.randn(3, 7, 10, dtype=torch.float64)
    P = torch.from_numpy(pool_matrix((7, 10), (3, 4))).double()
    ref = F.adaptive_avg_pool2d(x, (3, 4)).flatten(1)
    torch.testing.assert_close(x.flatten(1) @ P.T, ref, atol=1e-6, rtol=1e-6)


def test_unsupported_inputs_say_why():
    # float16/bfloat16 inputs: the translation is float32
    assert 'float32' in onnx_unsupported(torch.float16, (1, 2, 10, 8))[0]
    # a symbolic shape: the tile counts are constants of N
    assert 'static shapes' in onnx_unsupported(torch.float32, (1, 2, 's0', 8))[0]
    assert onnx_unsupported(torch.float32, (1, 2, 10, 8)) == []
    # an unknown formulation
    with pytest.raises(OnnxExportError, match='formulation'):
        mita_translation_table('dense')


# ------------------------------------------------------------------- routing-aware check

def test_routing_ties():
    # every key the same: every expert's top-k is an exact tie, so every query is at one
    q, k, _, _ = case_inputs(1, 2, 8, (5, 6), 1, 2, False, seed=4)
    k_same = k[:, :, :1].expand_as(k).contiguous()
    assert routing_ties(q, k_same, (5, 6), (2, 3), 6).all()
    # every query the same: the landmarks are equal, so every router argmax is a tie
    q_same = q[:, :, :1].expand_as(q).contiguous()
    assert routing_ties(q_same, k, (5, 6), (2, 3), 6).all()
    # random inputs: near-ties (margins within 1e-5 of the scores' scale) are rare
    q, k, _, _ = case_inputs(2, 3, 16, (9, 11), 1, 3, False, seed=5)
    ties = routing_ties(q, k, (9, 11), (3, 3), 10)
    assert ties.shape == (2, 3, 103) and ties.float().mean() < 0.05
    # k >= N and M = r: no decision to tie
    assert not routing_ties(q, k, (9, 11), (1, 1), 103).any()
    # with a relative position bias (BEiT's tokens: cls + grid)
    q, k, _, table = case_inputs(1, 3, 8, (5, 6), 1, 0, True, seed=6)
    assert routing_ties(q, k, (5, 6), (3, 2), 7, bias=RelPosBias(table, (5, 6))).dim() == 3


def test_compare_layer_counts_flipped_ties():
    from mita_seg.apis.onnx_export import compare_layer
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 2, 10, 4, generator=g)
    out = ref + 1e-7 * torch.randn(1, 2, 10, 4, generator=g)    # float32 rounding
    ties = torch.zeros(1, 2, 10, dtype=torch.bool)
    ties[0, 1, 3] = ties[0, 0, 7] = True
    out[0, 1, 3] += 0.5                                          # a flipped near-tie
    c = compare_layer('layer', out, ref, ties)
    assert c.ok and (c.rows, c.ties, c.flipped, c.mismatched) == (20, 2, 1, 0)
    assert c.max_diff < 1e-6 < c.tolerance
    out[0, 0, 5] += 1e-3                                         # a row of clear routing
    c = compare_layer('layer', out, ref, ties)
    assert not c.ok and c.mismatched == 1 and c.max_diff > c.tolerance


def test_compare_layer_nan_rows_never_pass():
    # a NaN (or inf) row is a wrong graph whether its routing is clear or at a near-tie;
    # NaN > tol is False, so counting "diff > tol" let such rows through
    from mita_seg.apis.onnx_export import compare_layer
    ref = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(0))
    ties = torch.zeros(1, 2, 10, dtype=torch.bool)
    ties[0, 1, 3] = True
    out = ref.clone()
    out[0, 1, 3, 0] = float('nan')                               # at a near-tie
    c = compare_layer('layer', out, ref, ties)
    assert not c.ok and (c.mismatched, c.flipped, c.nonfinite) == (1, 0, 1)
    out = ref.clone()
    out[0, 0, 5, 2] = float('inf')                               # routing clear
    c = compare_layer('layer', out, ref, ties)
    assert not c.ok and (c.mismatched, c.nonfinite) == (1, 1)
    c = compare_layer('layer', ref * float('nan'), ref, ties)     # everything NaN
    assert not c.ok and c.mismatched == c.rows == 20
    with pytest.raises(OnnxExportError, match='a wrong graph'):   # [B, H, N, d] mixed up
        compare_layer('layer', ref.transpose(1, 2), ref, ties)


def test_onnx_check_near_ties_are_no_free_pass():
    # routing: beyond float32 rounding end to end, near-ties in MiTA calls explain the
    # difference only where the graph around MiTA agrees with MiTA's node replaced by the
    # stand-in; NaN logits never pass, near-ties or not
    from mita_seg.apis.onnx_export import LayerCheck, OnnxCheck, StandInCheck
    layers = (LayerCheck('attn', 2056, 2, 0, 0, 3e-7, 7.7e-5), )
    clean = OnnxCheck('routing', 9e-6, 9.0, 1.0, 150, layers)
    assert clean.ok and clean.stand_in is None and not clean.needs_stand_in
    far = OnnxCheck('routing', 1.1, 9.0, 0.856, 150, layers)    # the wrong GELU's figures
    assert far.needs_stand_in and not far.ok                       # unchecked: refused
    assert far._replace(stand_in=StandInCheck(4e-6, 9.0, 1.0)).ok  # only a flip differs
    wrong = far._replace(stand_in=StandInCheck(0.7, 9.0, 0.92))
    assert not wrong.ok and 'outside MiTA' in wrong.problem(), wrong.problem()
    nan_stand_in = far._replace(stand_in=StandInCheck(float('nan'), 9.0, 0.0, (5, 0)))
    assert not nan_stand_in.ok
    nan = OnnxCheck('routing', float('nan'), 9.0, 0.0, 150, layers, nonfinite=(2457600, 0))
    assert not nan.ok and not nan.needs_stand_in and 'NaN' in nan.problem()
    assert not nan._replace(level='strict').ok
    ref_nan = OnnxCheck('routing', float('nan'), 9.0, 0.0, 150, layers, nonfinite=(0, 7))
    assert not ref_nan.ok and "PyTorch's own logits" in ref_nan.problem()
    # no near-tie: nothing to explain a difference, as before
    untied = OnnxCheck('routing', 1.1, 9.0, 0.856, 150, (layers[0]._replace(ties=0), ))
    assert not untied.needs_stand_in and not untied.ok


def test_onnx_session_errors_are_export_errors(tmp_path):
    # ONNX Runtime's own errors (a file it cannot load, a graph that fails to run) are the
    # export's error, one line, not a raw traceback of onnxruntime's classes
    from onnx import TensorProto, helper

    from mita_seg.apis.onnx_export import onnx_session, run_session
    junk = tmp_path / 'junk.onnx'
    junk.write_bytes(b'not a model')
    with pytest.raises(OnnxExportError, match='cannot load'):
        onnx_session(str(junk))
    x = helper.make_tensor_value_info('x', TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info('y', TensorProto.FLOAT, None)
    shape = helper.make_tensor('shape', TensorProto.INT64, [1], [3])   # 4 values into 3
    graph = helper.make_graph([helper.make_node('Reshape', ['x', 'shape'], ['y'])], 'g',
                              [x], [y], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)])
    model.ir_version = 8
    path = tmp_path / 'reshape.onnx'
    onnx.save(model, str(path))
    sess = onnx_session(str(path))
    with pytest.raises(OnnxExportError, match='fails to run'):
        run_session(sess, {'x': torch.zeros(4).numpy()}, str(path))


def test_opsets_the_installed_packages_support():
    # the range is derived from onnx, onnxscript's version converter and onnxruntime; the
    # export refuses outside it before building anything, naming the package that bounds it
    from mita_seg.apis import onnx_export
    limits = dict(onnx_export.opset_limits())
    top = onnx_export.max_opset()
    assert top == min(limits.values()) >= onnx_export.MIN_OPSET
    assert top <= onnx.defs.onnx_opset_version()
    for opset in (onnx_export.MIN_OPSET - 1, top + 1):
        with pytest.raises(OnnxExportError, match=f'--opset {opset}: '):
            onnx_export.export_onnx(TINY_SEGMENTER, 'no-such.pth', 'never.onnx', opset=opset)
    with pytest.raises(OnnxExportError, match='goes up to opset') as err:
        onnx_export.check_opset(top + 1)
    assert f'give --opset {onnx_export.MIN_OPSET} to {top}' in str(err.value)


def test_export_module_verifies_the_declared_opset(tmp_path):
    # above onnxscript's version converter the exporter fell back on onnx's, which fails on
    # GELU and left a file declaring opset 18 with opset-20 operators: read back, refused
    from mita_seg.apis.onnx_export import export_module, max_opset, verify_onnx
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()).eval()
    path = str(tmp_path / 'gelu.onnx')
    export_module(module, (torch.zeros(1, 4), ), path, 18, {}, ['x'], ['y'], 'a test')
    with pytest.raises(OnnxExportError, match='wrote opset 18, not the opset 20'):
        verify_onnx(path, 20)
    with pytest.raises(OnnxExportError, match='opset'):
        export_module(module, (torch.zeros(1, 4), ), str(tmp_path / 'o.onnx'),
                      max_opset() + 1, {}, ['x'], ['y'], 'a test')
    # a file the checker refuses (an operator the opset does not have)
    model = onnx.load(path)
    model.graph.node[0].op_type = 'NoSuchOp'
    onnx.save(model, path)
    with pytest.raises(OnnxExportError, match="checker"):
        verify_onnx(path, 18)


def test_atomic_path_fsyncs_what_another_writer_wrote(tmp_path, monkeypatch):
    # torch.onnx writes the temporary file itself, without fsync: atomic_path syncs its
    # bytes before the rename makes them the file (and the directory after)
    from mita_seg.engine import atomic_io
    events = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        events.append(('fsync', os.fstat(fd).st_ino))
        fsync(fd)

    def logged_replace(src, dst):
        events.append(('replace', os.stat(src).st_ino))
        replace(src, dst)

    monkeypatch.setattr(os, 'fsync', logged_fsync)
    monkeypatch.setattr(os, 'replace', logged_replace)
    with atomic_io.atomic_path(tmp_path / 'm.onnx', suffix='.onnx.part') as tmp:
        with open(tmp, 'wb') as f:   # no flush, no fsync: as the exporter writes
            f.write(b'onnx')
    ino = os.stat(tmp_path / 'm.onnx').st_ino
    assert ('fsync', ino) in events, events
    assert events.index(('fsync', ino)) < events.index(('replace', ino)), events
    assert events[-1] == ('fsync', os.stat(tmp_path).st_ino), events     # the directory


def wrong_table(factor):
    """MiTA's translation with the shared logits' scale multiplied by ``factor``: a wrong
    graph (the exporter reads the translation's signature, which ``functools.wraps``
    keeps)."""
    (key, right), = mita_translation_table().items()

    @functools.wraps(right)
    def wrong(*args, **kwargs):
        if 'shared_scale' in kwargs:
            kwargs['shared_scale'] *= factor
        else:
            args = args[:11] + (args[11] * factor, ) + args[12:]
        return right(*args, **kwargs)

    return {key: wrong}


# ---------------------------------------------------------------------- export_onnx

def random_checkpoint(config, path, seed=0, **init):
    """A checkpoint in the model zoo's format (``meta`` + ``state_dict``) of ``config``'s
    model with random weights of ``seed``."""
    from mita_seg.apis import init_model
    torch.manual_seed(seed)
    model = init_model(config, **init)
    torch.save({'meta': {}, 'state_dict': model.state_dict()}, path)
    return str(path)


@pytest.fixture(scope='module')
def tiny_ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('onnx_ckpts')
    return dict(segmenter=random_checkpoint(TINY_SEGMENTER, tmp / 'segmenter.pth'),
                upernet=random_checkpoint(TINY_UPERNET, tmp / 'mita_upernet.pth'))


def ort_vs_pytorch(path, config, ckpt, shape, mita_cfg=None, seed=5):
    """ORT's logits of ``path`` against a PyTorch model built anew from the same files, on
    another seeded input than the tool's own check."""
    from mita_seg.apis import init_model
    from mita_seg.apis.onnx_export import SegLogits
    model = SegLogits(init_model(config, ckpt, mita_cfg=mita_cfg), shape).eval()
    img = torch.randn(1, 3, *shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model(img)
    sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    assert [i.name for i in sess.get_inputs()] == ['img']
    out = torch.from_numpy(sess.run(['seg_logits'], {'img': img.numpy()})[0])
    return out, ref


@pytest.mark.slow
@pytest.mark.parametrize('which,args,mita_cfg,mita_layers', [
    ('segmenter', ['--swap-attn', 'mita', '--mita-cfg', 'pool_size=3', 'topk=12'],
     dict(pool_size=3, topk=12), 4),       # the encoder's (the paper's swap)
    ('segmenter', ['--swap-attn', 'mita', '--mita-cfg', 'pool_size=3', 'topk=12',
                   'include_head=True'],
     dict(pool_size=3, topk=12, include_head=True), 6),  # + the head's, class tokens global
    ('segmenter', [], None, 0),
    ('upernet', [], None, 4),
], ids=['swapped', 'swapped-with-head', 'unswapped', 'mita-trained'])
def test_export_onnx_tool(which, args, mita_cfg, mita_layers, tiny_ckpts, tools, tmp_path):
    config = {'segmenter': TINY_SEGMENTER, 'upernet': TINY_UPERNET}[which]
    out_file = tmp_path / 'model.onnx'
    _, out = tools('tools/export_onnx.py', config, tiny_ckpts[which], '--out', out_file, *args)
    assert f'wrote {out_file}' in out
    assert (f'{mita_layers} MiTA attention layers' if mita_layers else 'no MiTA layer') in out
    # routing-aware: every MiTA call checked on its own inputs (none without MiTA)
    assert ('MiTA calls on their own q, k, v' in out) == bool(mita_layers), out
    assert "input  'img'        float32 [1, 3, 128, 128]" in out
    assert "output 'seg_logits' float32 [1, 150, 128, 128]" in out
    assert 'classes agree on 100.00% of pixels' in out
    assert os.listdir(tmp_path) == ['model.onnx']
    got, ref = ort_vs_pytorch(str(out_file), config, tiny_ckpts[which], (128, 128), mita_cfg)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(1), ref.argmax(1))


@pytest.mark.slow
def test_export_onnx_head_calls_have_global_tokens(tiny_ckpts):
    # the with-head export above checks calls with global tokens: the head's two layers
    # carry its 150 class embeddings as global suffix tokens, the encoder's none
    from mita_seg.apis import init_model
    from mita_seg.apis.onnx_export import SegLogits, _MiTACalls
    model = SegLogits(init_model(TINY_SEGMENTER, tiny_ckpts['segmenter'],
                                 mita_cfg=dict(pool_size=3, topk=12, include_head=True)),
                      (128, 128)).eval()
    calls = []
    with torch.no_grad(), _MiTACalls(model, lambda name, args, out: calls.append(
            (name.split('.')[1], args['global_prefix'], args['global_suffix']))):
        model(torch.randn(1, 3, 128, 128))
    assert sorted(set(calls)) == [('backbone', 0, 0), ('decode_head', 0, 150)], calls


@pytest.mark.slow
def test_export_onnx_tool_plan(tiny_ckpts, tools, tmp_path):
    # a swap plan: dense, shared-expert and route-only layers side by side, each MiTA
    # setting its own per-call graph in the check
    import json
    import re

    from mita_seg.apis import init_model
    names = [n for n, _ in init_model(TINY_SEGMENTER).named_modules()
             if re.search(r'layers\.\d+\.attn$', n)]
    settings = ['dense', dict(pool_size=3, topk=12),
                dict(pool_size=2, topk=8, with_shared_expert=False)]
    plan = dict(format='mita_seg.swap_plan/1',
                layers=[dict(name=n, setting=settings[i % 3]) for i, n in enumerate(names)])
    plan_file = tmp_path / 'plan.json'
    plan_file.write_text(json.dumps(plan))
    out_file = tmp_path / 'm.onnx'
    _, out = tools('tools/export_onnx.py', TINY_SEGMENTER, tiny_ckpts['segmenter'], '--out',
                   out_file, '--mita-plan', plan_file)
    mita = sum(i % 3 != 0 for i in range(len(names)))
    assert f'{mita} MiTA attention layers' in out and f'{mita} MiTA calls' in out, out
    got, ref = ort_vs_pytorch(str(out_file), TINY_SEGMENTER, tiny_ckpts['segmenter'],
                              (128, 128), dict(plan=str(plan_file)), seed=0)
    assert (got.argmax(1) == ref.argmax(1)).float().mean() > 0.99


@pytest.mark.slow
def test_export_onnx_non_square_grid_smaller_than_pool(tiny_ckpts, tmp_path):
    # a 5x6 patch grid with pool_size=7: the modules run pool 5x6 (clamped, with a warning)
    from mita_seg.apis import export_onnx
    out = str(tmp_path / 'small.onnx')
    r = export_onnx(TINY_SEGMENTER, tiny_ckpts['segmenter'], out, shape=(40, 48),
                    mita_cfg=dict(pool_size=7, topk=49))
    assert r.ok and r.mita_layers == 4 and r.shape == (40, 48)   # the encoder's
    got, ref = ort_vs_pytorch(out, TINY_SEGMENTER, tiny_ckpts['segmenter'], (40, 48),
                              dict(pool_size=7, topk=49))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_quiet_exporter_silences_only_the_exporters_noise():
    # within: torch.export's LeafSpec deprecation and the notes of the exporter's passes are
    # silenced; any other warning (mita_seg's own) and the passes' errors still show; the
    # loggers' levels and the warning filters are as they were after
    import logging
    import warnings

    from mita_seg.utils.stack_noise import EXPORTER_LOGGERS, quiet_exporter
    folding = logging.getLogger('onnxscript.optimizer._constant_folding')
    assert folding.name in EXPORTER_LOGGERS
    level, filters = folding.level, list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with quiet_exporter():
            warnings.warn('`isinstance(treespec, LeafSpec)` is deprecated, use ...',
                          FutureWarning)
            warnings.warn('MiTA topk=500 is larger than the number of tokens N=65',
                          UserWarning)
            assert not folding.isEnabledFor(logging.WARNING)
            assert folding.isEnabledFor(logging.ERROR)
    assert [str(w.message) for w in caught] == [
        'MiTA topk=500 is larger than the number of tokens N=65']
    assert folding.level == level and warnings.filters == filters


@pytest.mark.slow
def test_export_onnx_prints_no_exporter_noise(tiny_ckpts, tools, tmp_path):
    # Python's default warning filters (not the tests' PYTHONWARNINGS=ignore): no
    # FutureWarning of torch.export, no "Skipping constant folding" of onnxscript, nothing on
    # stderr; the tool's own lines on stdout
    env = {k: v for k, v in tools.env.items() if k != 'PYTHONWARNINGS'}
    code, out = tools('tools/export_onnx.py', TINY_SEGMENTER, tiny_ckpts['segmenter'],
                      '--out', tmp_path / 'm.onnx', '--swap-attn', '2:8', '--shape', 64, 64,
                      env=env)
    assert code == 0 and 'wrote ' in out, out
    noisy = [line for line in out.splitlines()
             if 'warn' in line.lower() or 'Skipping constant folding' in line]
    assert not noisy, out


@pytest.mark.slow
def test_export_onnx_bad_input(tiny_ckpts, tools, tmp_path):
    seg = tiny_ckpts['segmenter']
    out = tmp_path / 'x.onnx'
    # an argument wrong on its own: one error line (no usage block), exit 2
    for args in (['--shape', '0', '64'], ['--opset', '17'], ['--opset', '99'],
                 ['--swap-attn', 'none', '--mita-cfg', 'topk=4']):
        code, text = tools('tools/export_onnx.py', TINY_SEGMENTER, seg, '--out', out, *args,
                           check=False)
        lines = text.strip().splitlines()
        assert code == 2 and 'usage:' not in text, (args, text)
        assert lines[-1].startswith('error: ') and len(lines) == 1, (args, text)
    # nothing to swap: one error line, exit 1
    code, text = tools('tools/export_onnx.py', 'mmseg::segformer/segformer_mit-b0_8xb2-'
                       '160k_ade20k-512x512.py', seg, '--out', out, '--swap-attn', 'mita',
                       check=False)
    assert code == 1 and 'error: swap_attention found no global attention' in text, text
    assert 'Traceback' not in text
    # a checkpoint that does not fit the model
    code, text = tools('tools/export_onnx.py', TINY_UPERNET, seg, '--out', out, check=False)
    assert code == 1 and 'error: ' in text and 'Traceback' not in text, text
    # onnxruntime missing (a module that fails to import, first on the path)
    shim = tmp_path / 'shim'
    shim.mkdir()
    (shim / 'onnxruntime.py').write_text('raise ImportError("no onnxruntime here")\n')
    env = dict(tools.env, PYTHONPATH=f'{shim}{os.pathsep}' + tools.env.get('PYTHONPATH', ''))
    code, text = tools('tools/export_onnx.py', TINY_SEGMENTER, seg, '--out', out,
                       check=False, env=env)
    assert code == 1 and 'error: ' in text and 'onnxruntime' in text, text
    assert 'Traceback' not in text
    # --out a directory: refused at parsing, like every tool's output path
    code, text = tools('tools/export_onnx.py', TINY_SEGMENTER, seg, '--out', tmp_path,
                       check=False)
    assert code == 2 and 'is a directory' in text, text
    # nothing half-written anywhere
    assert sorted(os.listdir(tmp_path)) == ['shim']


@pytest.mark.slow
def test_export_onnx_disagreement_leaves_nothing(tiny_ckpts, tmp_path, monkeypatch):
    # a strict check that fails (a negative tolerance) writes nothing at --out
    from mita_seg.apis import onnx_export
    monkeypatch.setattr(onnx_export, 'ATOL', -1.0)
    out = tmp_path / 'm.onnx'
    with pytest.raises(OnnxExportError, match='disagrees'):
        onnx_export.export_onnx(TINY_SEGMENTER, tiny_ckpts['segmenter'], str(out),
                                check='strict')
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize('factor', [2.0, 1.01])
def test_export_onnx_wrong_translation_is_caught(factor, tiny_ckpts, tmp_path):
    # a translation with a wrong scale fails the routing-aware check in the MiTA calls
    # themselves (rows of clear routing differ), even by 1%; nothing is written
    from mita_seg.apis import export_onnx
    out = tmp_path / 'm.onnx'
    with pytest.raises(OnnxExportError, match='wrong graph, not a flipped near-tie'):
        export_onnx(TINY_SEGMENTER, tiny_ckpts['segmenter'], str(out),
                    mita_cfg=dict(pool_size=3, topk=12), table=wrong_table(factor))
    assert os.listdir(tmp_path) == []


def gelu_table(wrong):
    """MiTA's translation, and ``aten.gelu`` translated wrongly outside MiTA: as SiLU
    (``'silu'``) or as NaN (``'nan'``)."""
    import numpy as np
    import onnx_ir as ir
    from onnxscript import FLOAT
    from onnxscript import opset18 as op

    def silu(x: FLOAT, approximate: str = 'none') -> FLOAT:
        return op.Mul(x, op.Sigmoid(x))

    def nan(x: FLOAT, approximate: str = 'none') -> FLOAT:
        return op.Mul(x, op.Constant(value=ir.tensor(np.array(np.nan, np.float32))))

    gelu = dict(silu=silu, nan=nan)[wrong]
    return {**mita_translation_table(), torch.ops.aten.gelu.default: gelu}


@pytest.mark.slow
@pytest.mark.parametrize('wrong,match', [
    ('silu', 'disagrees with PyTorch outside MiTA: with MiTA\'s node replaced by the same '
             'deterministic stand-in'),
    ('nan', 'logits hold .* NaN or infinite values where PyTorch\'s are finite'),
])
def test_export_onnx_wrong_graph_outside_mita_is_caught(wrong, match, tiny_ckpts, tmp_path):
    # the MiTA-trained UperNet has query rows at near-ties (2 of 2056): they used to excuse
    # any end-to-end difference, a GELU exported as SiLU (max diff 1.1, 86% of the classes)
    # and all-NaN logits included. Near-ties explain nothing around MiTA: the graph with
    # MiTA's node replaced by a stand-in on both sides must agree, and NaN never passes
    from mita_seg.apis import onnx_export
    out = tmp_path / 'm.onnx'
    checks = []
    check_onnx = onnx_export.check_onnx

    def kept(*args, **kwargs):
        checks.append(check_onnx(*args, **kwargs))
        return checks[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnx_export, 'check_onnx', kept)
        with pytest.raises(OnnxExportError, match=match):
            onnx_export.export_onnx(TINY_UPERNET, tiny_ckpts['upernet'], str(out),
                                    table=gelu_table(wrong))
    assert checks[0].ties > 0 and all(layer.ok for layer in checks[0].layers)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_export_onnx_nan_translation_is_caught(tiny_ckpts, tmp_path):
    # MiTA's translation with its output multiplied by NaN: every row of every call is NaN,
    # near-tie or not: refused in the calls themselves, nothing written
    import numpy as np
    import onnx_ir as ir
    from onnxscript import opset18 as op

    from mita_seg.apis import export_onnx
    (key, right), = mita_translation_table().items()

    @functools.wraps(right)
    def nan(*args, **kwargs):
        return op.Mul(right(*args, **kwargs),
                      op.Constant(value=ir.tensor(np.array(np.nan, np.float32))))

    out = tmp_path / 'm.onnx'
    with pytest.raises(OnnxExportError, match='NaN or infinite .* a wrong graph'):
        export_onnx(TINY_UPERNET, tiny_ckpts['upernet'], str(out), table={key: nan})
    assert os.listdir(tmp_path) == []


def beit_checkpoint(path):
    """Random weights of the tiny BEiT UperNet (no pretrained file), and its config."""
    from mita_seg.apis import load_config
    cfg = load_config(TINY_BEIT)
    cfg.model.pop('pretrained', None)
    cfg.model.backbone.init_cfg = None
    return cfg, random_checkpoint(cfg, path)


@pytest.mark.slow
@pytest.mark.parametrize('which', ['upernet', 'beit'])
def test_stand_in_graph_agrees_on_honest_models(which, tiny_ckpts, tmp_path):
    # the graph around MiTA, MiTA's node a stand-in on both sides (with BEiT's relative
    # position bias table read by it): within float32 rounding, every MiTA call replaced
    # (no TopK of MiTA's routing left in the graph)
    from mita_seg.apis import init_model
    from mita_seg.apis.onnx_export import SegLogits, _check_stand_in
    if which == 'beit':
        cfg, ckpt = beit_checkpoint(tmp_path / 'beit.pth')
        model, shape = init_model(cfg, ckpt, mita_cfg={}), (256, 256)
    else:
        model, shape = init_model(TINY_UPERNET, tiny_ckpts['upernet']), (128, 128)
    module = SegLogits(model, shape).eval()
    img = torch.randn(1, 3, *shape, generator=torch.Generator().manual_seed(0))
    workdir = tmp_path / 'work'
    workdir.mkdir()
    r = _check_stand_in(module, img, mita_translation_table(), 18, str(workdir))
    assert r.ok and r.nonfinite == (0, 0) and r.max_diff < 1e-4 * (1 + r.max_ref), r
    assert r.class_agreement == 1.0
    ops = {n.op_type for n in onnx.load(str(workdir / 'stand_in.onnx')).graph.node}
    assert 'TopK' not in ops and 'Sigmoid' in ops, ops


@pytest.mark.slow
def test_export_onnx_beit_file_is_its_weights(tmp_path):
    # the tiny BEiT on MiTA at 256 (4 layers, N = 1025, 7 x 7 landmarks): the file's
    # initializers are its weights and little more. Its relative position bias stored 8
    # int64 [7, 7, 32, 32] box-sum indices per layer: 15.0 MB of initializers for 1.6 MB of
    # weights (BEiT-B at 1024: about 154 MB of indices)
    from mita_seg.apis import export_onnx
    _, ckpt = beit_checkpoint(tmp_path / 'beit.pth')
    weights = sum(t.numel() * t.element_size()
                  for t in torch.load(ckpt, map_location='cpu')['state_dict'].values()
                  if t.is_floating_point())
    out = tmp_path / 'beit.onnx'
    r = export_onnx(TINY_BEIT, ckpt, str(out), mita_cfg={}, check='none')
    assert r.mita_layers == 4 and r.data is None
    total, sizes = initializer_bytes(out)
    assert total < 1.25 * weights, (total, weights, sizes[:6])


@pytest.mark.slow
def test_export_onnx_global_tokens_routed_is_caught(tiny_ckpts, tmp_path):
    # a translation that routes the head's class tokens instead of treating them as global
    # (the translation before global tokens, silently): the per-call check catches it
    from mita_seg.apis import export_onnx
    (key, right), = mita_translation_table().items()

    @functools.wraps(right)
    def routed(*args, **kwargs):
        args = args[:17]
        kwargs.update(global_prefix=0, global_suffix=0)
        return right(*args, **kwargs)

    out = tmp_path / 'm.onnx'
    with pytest.raises(OnnxExportError, match='wrong graph, not a flipped near-tie'):
        export_onnx(TINY_SEGMENTER, tiny_ckpts['segmenter'], str(out),
                    mita_cfg=dict(pool_size=3, topk=12, include_head=True),
                    table={key: routed})
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_export_onnx_external_data_beside_out(tiny_ckpts, tmp_path, monkeypatch):
    # weights over torch's large-model threshold (1.5 GiB; BEiT-L UperNet) go to an
    # external data file: lowered to 0 here. The file names its data by the final name,
    # both are moved whole with the umask, and ORT runs the file from where it lies; a
    # failing check leaves neither
    import torch.onnx._internal.exporter._onnx_program as program
    from mita_seg.apis import onnx_export
    monkeypatch.setattr(program, '_LARGE_MODEL_THRESHOLD', 0)
    out = tmp_path / 'm.onnx'
    old = os.umask(0o027)
    try:
        r = onnx_export.export_onnx(TINY_UPERNET, tiny_ckpts['upernet'], str(out))
    finally:
        os.umask(old)
    assert r.ok and r.data == str(out) + '.data'
    assert sorted(os.listdir(tmp_path)) == ['m.onnx', 'm.onnx.data']
    for f in ('m.onnx', 'm.onnx.data'):
        assert os.stat(tmp_path / f).st_mode & 0o777 == 0o640, f
    model = onnx.load(str(out), load_external_data=False)
    places = {e.value for t in model.graph.initializer for e in t.external_data
              if e.key == 'location'}
    assert places == {'m.onnx.data'}, places
    got, ref = ort_vs_pytorch(str(out), TINY_UPERNET, tiny_ckpts['upernet'], (128, 128))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # a check that fails: nothing new, neither file of the failed export left behind
    monkeypatch.setattr(onnx_export, 'ATOL', -1.0)
    with pytest.raises(OnnxExportError, match='disagrees'):
        onnx_export.export_onnx(TINY_UPERNET, tiny_ckpts['upernet'],
                                str(tmp_path / 'n.onnx'), check='strict')
    assert sorted(os.listdir(tmp_path)) == ['m.onnx', 'm.onnx.data']


@pytest.mark.slow
def test_export_onnx_check_none_verifies_the_opset(tiny_ckpts, tmp_path, monkeypatch):
    # an opset past onnxscript's version converter (allowed here by a raised bound): the
    # exporter leaves opset 18 with newer operators; even unchecked, the file is read back
    # and refused, nothing written
    from mita_seg.apis import onnx_export
    top = onnx_export.max_opset()
    monkeypatch.setattr(onnx_export, 'max_opset', lambda: top + 5)
    out = tmp_path / 'm.onnx'
    with pytest.raises(OnnxExportError, match=f'wrote opset 18, not the opset {top + 1}'):
        onnx_export.export_onnx(TINY_UPERNET, tiny_ckpts['upernet'], str(out),
                                opset=top + 1, check='none')
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_export_onnx_check_none(tiny_ckpts, tools, tmp_path):
    out_file = tmp_path / 'm.onnx'
    _, out = tools('tools/export_onnx.py', TINY_SEGMENTER, tiny_ckpts['segmenter'], '--out',
                   out_file, '--swap-attn', 'mita', '--check', 'none')
    assert 'not checked (--check none)' in out and os.listdir(tmp_path) == ['m.onnx']
    got, ref = ort_vs_pytorch(str(out_file), TINY_SEGMENTER, tiny_ckpts['segmenter'],
                              (128, 128), {}, seed=0)
    assert (got.argmax(1) == ref.argmax(1)).float().mean() > 0.99


@pytest.mark.slow
@pytest.mark.parametrize('config,shape,seed', [
    ('mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py', 512, 11),
    (TINY_BEIT, 256, 0),
], ids=['segmenter-vit-t-512-seed11', 'beit-tiny-256'])
def test_export_onnx_tool_at_crop(config, shape, seed, tools, tmp_path):
    # Segmenter ViT-T at 512 with seed 11 weights is the near-tie case: ORT's
    # logits differ from PyTorch's end to end beyond float32 rounding (0.0097 on a Zen 4,
    # 0.084 on a Zen 3), as PyTorch's own backends differ from each other, because
    # near-tied routing decisions flip and the flips grow through the layers. The
    # routing-aware check writes it: every MiTA call agrees where its routing is clear.
    from mita_seg.apis import load_config
    cfg = load_config(config)
    cfg.model.pop('pretrained', None)
    cfg.model.backbone.init_cfg = None
    ckpt = random_checkpoint(cfg, tmp_path / 'model.pth', seed=seed)
    out_file = tmp_path / 'model.onnx'
    _, out = tools('tools/export_onnx.py', config, ckpt, '--out', out_file, '--swap-attn',
                   'mita')
    assert f'float32 [1, 3, {shape}, {shape}]' in out and 'MiTA attention layers' in out
    assert 'check (routing)' in out and 'MiTA calls on their own q, k, v' in out
    assert "PyTorch's own noise floor (fused_cpu vs blocked backend)" in out
    # beyond float32 rounding end to end, the graph around MiTA was checked with MiTA's
    # node a stand-in on both sides, and agreed
    import re
    diff, tol = map(float, re.search(r'end to end max \|ORT - PyTorch\| = (\S+) \(float32 '
                                     r'rounding (\S+)\)', out).groups())
    assert ('around MiTA (its node a deterministic stand-in in both)' in out) == (diff > tol)
    assert sorted(os.listdir(tmp_path)) == ['model.onnx', 'model.pth']
    # against a PyTorch model built anew from the files, on the tool's input and another:
    # the classes agree (a flipped near-tie moves a few pixels, never the map)
    for s in (0, 5):
        got, ref = ort_vs_pytorch(str(out_file), cfg, ckpt, (shape, shape), {}, seed=s)
        assert (got.argmax(1) == ref.argmax(1)).float().mean() > 0.99


def test_dense_attention_weights_counts_what_runs(tiny_ckpts):
    # the dense layers a forward calls and the bytes of their float32 weights in ORT (the
    # scores and their softmax); MiTA layers hold their dense module but never call it
    from mita_seg.apis import init_model
    from mita_seg.apis.onnx_export import SegLogits, dense_attention_weights
    model = init_model(TINY_SEGMENTER, tiny_ckpts['segmenter'])
    run = SegLogits(model, (128, 160)).eval()
    heads = model.backbone.layers[0].attn.num_heads
    layers = len(model.backbone.layers) + len(model.decode_head.layers)
    patch = model.cfg.model.backbone.patch_size
    n, classes = 1 + (128 // patch) * (160 // patch), model.decode_head.num_classes
    with torch.no_grad():
        dense = dense_attention_weights(model, lambda: run(torch.zeros(1, 3, 128, 160)))
    assert len(dense) == layers
    sizes = dict(dense)
    assert sizes['backbone.layers.0.attn'] == 2 * 4 * heads * n * n
    head = 2 * 4 * model.decode_head.layers[0].attn.num_heads * (n - 1 + classes) ** 2
    assert sizes['decode_head.layers.0.attn'] == head
    swap_attention(model, include_head=True, verbose=False)
    with torch.no_grad():
        assert dense_attention_weights(model, lambda: run(torch.zeros(1, 3, 128, 160))) == []


def test_export_onnx_refuses_dense_weights_over_memory(tiny_ckpts, tmp_path, monkeypatch):
    # dense attention whose N x N weights would not fit: refused before any export, with
    # what to change, nothing written; --check none writes it for a larger machine
    from mita_seg.apis import onnx_export
    monkeypatch.setattr(onnx_export, 'physical_memory', lambda: 2**20)
    out = tmp_path / 'm.onnx'
    with pytest.raises(OnnxExportError) as err:
        onnx_export.export_onnx(TINY_SEGMENTER, tiny_ckpts['segmenter'], str(out))
    message = str(err.value)
    assert 'the dense attention of decode_head.layers.' in message, message
    assert "over half of this machine's 0 GiB" in message and 'include_head=True' in message
    assert os.listdir(tmp_path) == []
