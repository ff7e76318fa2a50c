"""Careless input to the Python APIs (the operator, the attention module, the swap): a
setting in any of its spellings works, anything else is an error that says what to give,
never a silent wrong answer or a traceback from two libraries down."""
import numpy as np
import pytest
import torch
from mmseg.models.backbones import VisionTransformer

from mita_seg import swap_attention
from mita_seg.apis.model import swap_model
from mita_seg.models import MiTAAttention
from mita_seg.ops import mita_attention
from mita_seg.setting import MiTASetting, MiTASettingError

SMALL = dict(img_size=(32, 32), patch_size=8, embed_dims=32, num_layers=2, num_heads=2)


def qkv(B=1, N=37, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, 2, N, 8, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize('setting', ['4:16', dict(pool_size=4, topk=16),
                                     MiTASetting(pool_size=4, topk=16)])
def test_a_setting_in_any_spelling(setting):
    model = VisionTransformer(**SMALL)
    assert swap_attention(model, setting, verbose=False) == 2
    assert model.layers[1].attn.setting == MiTASetting(pool_size=4, topk=16)
    assert MiTAAttention(32, 4, setting=setting).setting.text == '4:16'
    model = VisionTransformer(**SMALL)   # init_model's and the inferencer's mita_cfg
    assert swap_model(model, setting, verbose=False) == 2


def test_what_is_not_a_setting():
    with pytest.raises(MiTASettingError, match=r'a dict of settings .* not list'):
        swap_attention(VisionTransformer(**SMALL), [4, 16], verbose=False)
    with pytest.raises(MiTASettingError, match='unknown MiTA setting'):
        MiTAAttention(32, 4, setting=dict(pool=4))
    with pytest.raises(MiTASettingError, match=r'give a Python int, int\(topk\)'):
        MiTASetting.from_cfg(dict(topk=np.int64(16)))
    with pytest.raises(MiTASettingError, match='shared_scale must be a finite number'):
        MiTASetting.from_cfg(dict(shared_scale=float('inf')))
    with pytest.raises(MiTASettingError, match=r'must be True or False$'):   # no int hint
        MiTASetting.from_cfg(dict(with_shared_expert=np.int64(1)))
    with pytest.raises(MiTASettingError, match='not list'):   # not Python's ** TypeError
        swap_model(VisionTransformer(**SMALL), ['4:16'], verbose=False)
    attn = MiTAAttention(32, 4)
    with pytest.raises(MiTASettingError, match='a whole setting or single keys, not both'):
        attn.configure('4:16', topk=8)


def test_swap_layers_and_include_head_are_checked():
    """A string 'False' is truthy: the head would be swapped; checked before any change."""
    model = VisionTransformer(**SMALL)
    for bad, what in ((dict(include_head='False'), 'include_head'), (dict(layers=0), 'layers'),
                      (dict(layers=['1']), 'layers'), (dict(layers=[1.0]), 'layers')):
        with pytest.raises(MiTASettingError, match=f'{what}=.* must be'):
            swap_attention(model, '4:16', verbose=False, **bad)
    assert not isinstance(model.layers[0].attn, MiTAAttention)  # nothing changed
    assert swap_attention(model, '4:16', layers=range(1, 2), verbose=False) == 1


def test_attention_module_arguments():
    with pytest.raises(TypeError, match=r'unexpected keyword argument\(s\) topK; its '
                       r'settings are pool_size, topk'):
        MiTAAttention(32, 4, topK=16)
    MiTAAttention(32, 4, add_bias_kv=False)   # torch's own arguments still pass
    MiTAAttention(32, 4, dropout=0.0)          # and mmcv's deprecated one


def test_operator_arguments():
    q, k, v = qkv()
    for name, kwargs in (('topk', dict(topk=5.0)), ('router_topk', dict(router_topk=1.0)),
                         ('block_size', dict(block_size=8.0))):
        with pytest.raises(TypeError, match=f'{name} must be an int'):
            mita_attention(q, k, v, (6, 6), 3, **{'topk': 5, **kwargs})
    with pytest.raises(TypeError, match='float32, torch.float64, torch.float32'):
        mita_attention(q, k.double(), v, (6, 6), 3, 5, backend='blocked')
    with pytest.raises(ValueError, match='one device, got cpu, meta, cpu'):
        mita_attention(q, k.to('meta'), v, (6, 6), 3, 5)
    with pytest.raises(ValueError, match='shared_scale must be finite'):
        mita_attention(q, k, v, (6, 6), 3, 5, shared_scale=float('inf'))
    want = mita_attention(q, k, v, (6, 6), 3, 5)
    grid = tuple(np.array([6, 6]))   # numpy's integers are ints
    torch.testing.assert_close(mita_attention(q, k, v, grid, np.int64(3), np.int64(5),
                                              np.int64(1), np.int64(1), block_size=np.int64(8)),
                               want)


@pytest.mark.parametrize('backend', ['reference', 'blocked', 'varlen', 'fused_cpu'])
def test_an_empty_batch(backend):
    q, k, v = qkv(B=0)
    out = mita_attention(q, k, v, (6, 6), 3, 5, backend=backend)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match='unknown MiTA backend'):   # still checked
        mita_attention(q, k, v, (6, 6), 3, 5, backend=backend + 'x')


def test_a_sweep_tells_route_only_from_shared_as_they_run():
    """A sweep skips a point that runs exactly as an earlier one (a pool clamped to the
    grid); route-only and the shared expert run the same pools and k, not the same."""
    from mita_seg.apis.sweep import run_key
    ran = {((4, 4), 17, 1, 17)}
    shared, route = MiTASetting.parse('7:49'), MiTASetting.parse('7:49:route')
    assert run_key(shared, ran) != run_key(route, ran)
    assert run_key(shared, ran) == run_key(MiTASetting.parse('5:49'), ran)  # both clamped
    assert run_key(MiTASetting.parse('topk:5'), set()) != run_key(MiTASetting.parse('topk:6'),
                                                                  set())
