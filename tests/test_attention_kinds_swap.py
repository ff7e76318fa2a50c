"""The kinds of attention of the paper's taxonomy (``agent``, ``block``, ``topk``,
``window``, :mod:`mita_seg.setting`) as swaps of mmseg models: one spelling everywhere, a
setting checked once on a swap, the parameters and state-dict keys untouched (a model-zoo
checkpoint reloads strictly), each kind's multiply-adds by formula equal to the traced
count, BEiT/MAE refusing them in one line, the long-range configs with the local window
building, and ``tools/test.py --swap-attn KIND`` on a released-layout checkpoint (slow).
The operators themselves are tested against dense oracles in tests/test_attention_kinds.py."""
import copy
import os.path as osp

import pytest
import torch

from mita_seg.setting import MiTASetting, MiTASettingError

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
KINDS = ['7:49', 'agent:7', 'block:8:4', 'topk:49', 'window:7']


@pytest.fixture(scope='module')
def segmenter(tiny_cfg):
    """mmseg's Segmenter ViT-T, narrowed (tests/conftest.py), seeded random weights."""
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    import mita_seg.models  # noqa: F401
    torch.manual_seed(0)
    return MODELS.build(copy.deepcopy(tiny_cfg.model)).eval()


@pytest.mark.parametrize('spec', KINDS)
def test_swap_each_kind_keeps_keys_and_runs(segmenter, spec):
    from mita_seg import swap_attention
    model = copy.deepcopy(segmenter)
    keys = model.state_dict()
    assert swap_attention(model, spec, include_head=True, verbose=False) == 3
    attn = model.backbone.layers[0].attn
    assert attn.setting == MiTASetting.parse(spec) and attn.setting.text == spec
    swapped = model.state_dict()
    assert list(swapped) == list(keys)                    # the very keys, in order
    assert all(torch.equal(swapped[k], keys[k]) for k in keys)
    model.load_state_dict(keys, strict=True)
    with torch.no_grad():
        out = model.backbone(torch.randn(2, 3, 64, 96))   # a non-square 8x12 grid
    assert all(torch.isfinite(o).all() for o in out)
    # a whole setting and single keys are not given together
    with pytest.raises(ValueError, match='give a setting or single settings, not both'):
        swap_attention(model, spec, topk=3)


@pytest.mark.parametrize('what', ['text', 'setting', 'keys'])
def test_a_swap_passes_one_setting_whole(segmenter, what):
    """However many layers, a setting is made once where it enters and travels whole
    (issue 55): by the parser (a spelling), by the caller (a MiTASetting), at the top of
    use_mita (single keys); every module holds that very object."""
    from mita_seg import swap_attention
    from mita_seg.models import MiTASettingsMixin
    arg = (('window:5', ) if what == 'text' else
           (MiTASetting(topk=8, kind='topk'), ) if what == 'setting' else ())
    kw = dict(pool_size=3, topk=5) if what == 'keys' else {}
    model = copy.deepcopy(segmenter)
    assert swap_attention(model, *arg, include_head=True, verbose=False, **kw) == 3
    settings = [m.setting for m in model.modules() if isinstance(m, MiTASettingsMixin)]
    assert len(settings) == 3
    if what == 'setting':
        assert all(s is arg[0] for s in settings)
    assert len({id(s) for s in settings[:2]}) == 1   # one owner's layers: one object


def test_bad_settings_are_one_clear_error(segmenter):
    from mita_seg import swap_attention
    from mita_seg.models import MiTABEiTAttention
    model = copy.deepcopy(segmenter)
    with pytest.raises(MiTASettingError, match=r"window setting 'window:0': write window:W"):
        swap_attention(model, 'window:0')
    with pytest.raises(MiTASettingError, match=r"topk is not|unknown MiTA setting 'topk'"):
        MiTASetting.from_cfg(dict(kind='agent', topk=16))    # agent reads no top-k
    with pytest.raises(MiTASettingError, match="num_blocks=0: num_blocks must be an int >= 1"):
        swap_attention(model, kind='block', num_blocks=0)
    assert not any(type(m).__name__ == 'MiTAAttention' for m in model.modules())  # untouched
    # BEiT/MAE: the relative position bias enters MiTA, top-k and window attention
    with pytest.raises(MiTASettingError, match='MiTABEiTAttention runs mita, topk, window '
                       'attention, not agent: compression only .* give it a MiTA setting'):
        MiTABEiTAttention(64, 4, (4, 4), kind='agent')


def test_a_key_the_kind_does_not_read_is_refused_where_it_enters(segmenter):
    """Issue 55: Python, a config's mita_cfg and a swap over a model on another kind all
    refuse a key that the kind does not read, naming the key and the kind, before anything
    changes."""
    from mita_seg import swap_attention
    from mita_seg.models import MiTASettingsMixin, MiTAVisionTransformer
    message = r'^topk is not a setting of agent attention \(agent:7 reads pool_size'
    model = copy.deepcopy(segmenter)
    with pytest.raises(MiTASettingError, match=message):
        swap_attention(model, kind='agent', topk=16)
    assert not any(isinstance(m, MiTASettingsMixin) for m in model.modules())   # untouched
    with pytest.raises(MiTASettingError, match=message):       # a config's mita_cfg
        MiTAVisionTransformer(img_size=(32, 32), patch_size=8, embed_dims=32, num_layers=1,
                              num_heads=2, mita_cfg=dict(kind='agent', topk=16))
    swap_attention(model, 'agent:2', verbose=False)     # single keys over a model on agent
    with pytest.raises(MiTASettingError, match=message):
        swap_attention(model, topk=16)
    swap_attention(model, pool_size=3, verbose=False)   # a key it reads: fine
    assert {m.setting.text for m in model.modules() if isinstance(m, MiTASettingsMixin)} == {
        'agent:3'}


@pytest.mark.parametrize('spec', KINDS + ['block:4:2', 'topk:20', 'window:3', 'agent:2x3'])
def test_traced_macs_match_each_kinds_formula(spec):
    """The jit-traced multiply-adds of one swapped attention layer (projections aside) are
    the setting's formula (MiTA's through its custom op's handle, the others through their
    matmuls), and the analytic counter of swap_sweep/get_flops agrees. Pooling is no
    multiply-adds: agent's landmark pooling counts 0 in the trace, as MiTA's (inside its
    op) does."""
    from mmcv.cnn.bricks.transformer import MultiheadAttention
    from mita_seg.analysis.attention_macs import AttentionMacCounter
    from mita_seg.analysis.flop_handles import flop_analyzer
    from mita_seg.models import MiTAAttention
    B, C, H, (h, w) = 2, 32, 4, (8, 12)
    N = 1 + h * w
    setting = MiTASetting.parse(spec)
    attn = MiTAAttention.from_mmcv(MultiheadAttention(C, H, batch_first=True), setting).eval()
    x = torch.randn(B, N, C)
    traced = flop_analyzer(attn, (x, None, None, None, None, None, None, None, (h, w))).total()
    projections = B * N * C * 3 * C + B * N * C * C
    want = B * H * setting.attention_macs((h, w), N, C // H)
    assert traced - projections == want
    with AttentionMacCounter(attn) as counter, torch.no_grad():
        attn(x, hw_shape=(h, w))
    assert counter.macs == want


def test_longrange_configs_build_a_global_and_a_local_model():
    """The long-range benchmark's models: the same Segmenter without a cls token or head
    attention, with softmax attention, with a 3x3 window and with MiTA 4:16 (both trained
    from scratch through the config's mita_cfg, with the same parameters)."""
    from mmseg.registry import MODELS
    from mita_seg.apis import load_config
    import mita_seg.models  # noqa: F401
    cfgs = [load_config(osp.join(ROOT, 'configs', 'longrange', name)) for name in (
        'segmenter_vit-tiny_linear_1xb4_longrange-ade20k-256x256.py',
        'segmenter_vit-tiny_linear_window3_1xb4_longrange-ade20k-256x256.py',
        'segmenter_vit-tiny_linear_mita4x4k16_1xb4_longrange-ade20k-256x256.py')]
    dense, local, mita = (MODELS.build(c.model).eval() for c in cfgs)
    assert not dense.backbone.with_cls_token and len(dense.decode_head.layers) == 0
    for model, setting in ((local, 'window:3'), (mita, '4:16')):
        assert [m.setting.text for m in model.backbone.modules() if hasattr(m, 'kind')] == \
            [setting] * 4
        assert list(model.state_dict()) == list(dense.state_dict())
        with torch.no_grad():
            assert model.backbone(torch.randn(1, 3, 256, 256))[0].shape == (1, 64, 32, 32)


@pytest.mark.slow
def test_test_py_swaps_a_zoo_checkpoint_to_each_kind(tools, segmenter_ckpt, tiny_data):
    """tools/test.py --swap-attn KIND on a checkpoint in the model zoo's format: loads
    strictly, evaluates, says the swap; --mita-cfg keys go over a whole setting."""
    config, ckpt = segmenter_ckpt
    for spec in KINDS[1:] + ['topk:8 --mita-cfg topk=16']:
        spec, *extra = spec.split(' ')
        _, out = tools('tools/test.py', config, ckpt, '--swap-attn', spec, *extra,
                       '--cfg-options', *tools.data_options(tiny_data))
        kind = MiTASetting.parse(spec).swap_name      # each tool names a layer by its kind
        assert f'attention modules on {kind}' in out and tools.miou(out) >= 0, out[-2000:]
    assert "'topk': 16" in out, out[-2000:]


@pytest.mark.slow
def test_swap_sweep_sets_the_kinds_side_by_side(segmenter_ckpt, tools, tmp_path):
    """tools/swap_sweep.py --settings: every kind as a row; a kind that covers every key
    (all blocks, k at least the grid, a window over the grid) is softmax attention (the
    baseline's mIoU); the whole-model trace saves what each kind's formula saves."""
    import csv
    config, ckpt = segmenter_ckpt
    kinds = ['agent:4', 'block:4:2', 'block:4:16', 'topk:16', 'topk:1000', 'window:3',
             'window:16']
    tools('tools/swap_sweep.py', config, ckpt, '--pool-sizes', 4, '--topks', 16, '--settings',
          *kinds, '--work-dir', tmp_path / 'work', '--out', tmp_path / 'sweep.md')
    with open(tmp_path / 'sweep.csv') as f:
        rows = {r['setting']: r for r in csv.DictReader(f)}
    assert list(rows) == ['baseline', 'MiTA M=4x4 k=16', 'agent M=4x4', 'block 4x4 x2',
                          'block 4x4 x16', 'top-k k=16', 'top-k k=1000', 'window 3x3',
                          'window 16x16']
    base = rows['baseline']
    for name, r in rows.items():
        saved_traced = float(base['model_GFLOPs']) - float(r['model_GFLOPs'])
        saved_formula = float(base['attn_GMACs']) - float(r['attn_GMACs'])
        # agent's trace counts its landmark pooling's adds (mmengine's adaptive_avg_pool2d)
        assert saved_traced == pytest.approx(saved_formula, rel=0.02, abs=1e-9), name
        if name in ('block 4x4 x16', 'top-k k=1000', 'window 16x16'):
            assert float(r['mIoU']) == pytest.approx(float(base['mIoU']), abs=0.01), name
            assert saved_formula == pytest.approx(0, abs=1e-9), name
        elif name != 'baseline':
            assert saved_formula > 0, name


SWAPPING_TOOLS = ['test.py', 'image_demo.py', 'get_flops.py', 'export_onnx.py',
                  'export_swapped.py', 'analyze_token_selection.py', 'swap_sweep.py']


@pytest.mark.parametrize('tool', SWAPPING_TOOLS)
def test_every_tool_that_swaps_takes_a_setting(tool):
    """One spelling: --swap-attn SETTING in every tool that swaps (issue 41); a tool that
    always swaps refuses none."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, osp.join(ROOT, 'tools', tool), '--help'],
                         capture_output=True, text=True, check=True).stdout
    assert '--swap-attn SETTING' in out and 'agent:7' in out, out


def test_swap_settings_of_a_tool_that_always_swaps():
    import argparse
    from mita_seg.cli import add_mita_args, swap_settings

    def parse(argv, swap_flag):
        parser = argparse.ArgumentParser()
        add_mita_args(parser, swap_flag=swap_flag)
        return swap_settings(parser, parser.parse_args(argv))

    assert parse([], swap_flag=False) == {}                       # MiTA's defaults
    assert parse([], swap_flag=True) is None                      # no swap asked
    got = parse(['--swap-attn', 'agent:7', '--mita-cfg', 'pool_size=5', 'include_head=True'],
                swap_flag=False)
    assert got == dict(include_head=True, setting=MiTASetting.parse('agent:5'))
    with pytest.raises(SystemExit):
        parse(['--swap-attn', 'none'], swap_flag=False)


def test_single_keys_over_mixed_kinds_change_nothing_when_refused(segmenter):
    """A key that one swapped layer's kind does not read: every layer's new setting is made
    before any changes, so the model is left as it was."""
    from mita_seg import swap_attention
    from mita_seg.models import MiTASettingsMixin, SwapPlan, attention_layers
    model = copy.deepcopy(segmenter)
    names = [n for n, _, _ in attention_layers(model)]
    plan = SwapPlan({n: MiTASetting.parse('4:16' if i == 0 else 'agent:3')
                     for i, n in enumerate(names)})
    swap_attention(model, plan=plan, verbose=False)
    before = [m.setting for m in model.modules() if isinstance(m, MiTASettingsMixin)]
    with pytest.raises(MiTASettingError, match='topk is not a setting of agent attention'):
        swap_attention(model, topk=8, include_head=True, verbose=False)
    assert [m.setting for m in model.modules() if isinstance(m, MiTASettingsMixin)] == before
    # another kind keeps the keys both kinds read: 4:16 as agent is agent:4
    assert MiTASetting.parse('4:16').replace(kind='agent').text == 'agent:4'
    with pytest.raises(MiTASettingError, match="kind must be one of"):
        MiTASetting.from_cfg(dict(kind=['agent']))                # a list: the rule, no crash


def test_a_compiled_first_forward_finds_the_operator():
    """The operator of a kind is imported when the setting is set, not in the forward: a
    module whose first forward is compiled has no graph break for the import."""
    import subprocess
    import sys
    code = ('import torch, torch._dynamo as dynamo\n'
            'from mita_seg.models import MiTAAttention\n'
            'm = MiTAAttention(32, 2, kind="window", window=3).eval()\n'
            'x = torch.randn(1, 1 + 8 * 8, 32)\n'
            'e = dynamo.explain(lambda t: m(t, hw_shape=(8, 8)))(x)\n'
            'print("breaks", e.graph_break_count)\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=600)
    assert 'breaks 0' in out.stdout, out.stdout + out.stderr[-2000:]
