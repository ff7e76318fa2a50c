"""The fast dense path (:func:`mita_seg.models.set_dense_attn`): mmseg's models as released
(``EncoderDecoder``, mmcv ``MultiheadAttention`` with ``need_weights=True``) are the
reference. On mmseg's Segmenter ViT-T and DeiT-S UperNet configs (seeded random weights):
seg logits equal to float32 rounding and the same classes, slide and whole, batch 2; the
switch back gives mmseg's results bit for bit; state dict keys unchanged; training (loss
and gradients); the path reaches every model mita_seg builds (init_model, the tools'
``--dense-attn``, configs, a swap's dense layers and :func:`use_dense`)."""
import argparse
import copy

import pytest
import torch
import torch.nn as nn
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmengine.structures import PixelData
from torch.utils._python_dispatch import TorchDispatchMode

from mmseg.models.segmentors import EncoderDecoder
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample

from mita_seg.apis import init_model, load_config, use_slim_inference
from mita_seg.cli import InputError, KeyValueAction, add_mita_args
from mita_seg.models import (FastMultiheadAttention, MiTAAttention, SlimEncoderDecoder,
                             dense_attn_of, set_dense_attn, use_dense)

VIT_T = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
UPERNET = 'mmseg::vit/vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py'


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def model_cfg(config, crop=64, stride=48):
    """mmseg's config at its own width and depth, no pretrained weights, slide over
    ``crop`` crops (the full crops of 512 would be slow here)."""
    cfg = load_config(config)
    m = cfg.model
    m.pop('pretrained', None)
    m.pop('data_preprocessor', None)
    m.backbone.init_cfg = None
    m.test_cfg = dict(mode='slide', crop_size=(crop, crop), stride=(stride, stride))
    return m


def build_pair(config, **kwargs):
    """mmseg's ``EncoderDecoder`` as released, with seeded random weights, and
    ``SlimEncoderDecoder`` (fast dense path by default) holding the same weights."""
    init_default_scope('mmseg')
    m = model_cfg(config, **kwargs)
    torch.manual_seed(0)
    ref = MODELS.build(dict(copy.deepcopy(m), type='EncoderDecoder')).eval()
    ref.init_weights()
    fast = MODELS.build(dict(copy.deepcopy(m), type='SlimEncoderDecoder')).eval()
    fast.load_state_dict(ref.state_dict(), strict=True)
    assert type(ref) is EncoderDecoder and dense_attn_of(ref) == 'mmseg'
    assert type(fast) is SlimEncoderDecoder and dense_attn_of(fast) == 'fast'
    return ref, fast


@pytest.fixture(scope='module')
def vit_t():
    return build_pair(VIT_T)


@pytest.fixture(scope='module')
def upernet():
    return build_pair(UPERNET)


def samples(n, shape):
    h, w = shape
    meta = dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w))
    return [SegDataSample(metainfo=dict(meta)) for _ in range(n)]


def predict(model, inputs):
    with torch.no_grad():
        out = model.predict(inputs.clone(), samples(len(inputs), inputs.shape[-2:]))
    return (torch.stack([s.seg_logits.data for s in out]),
            torch.stack([s.pred_sem_seg.data for s in out]))


def assert_same_result(want, got):
    """Logits equal to float32 rounding (relative to their scale), the same classes."""
    (w_logits, w_cls), (g_logits, g_cls) = want, got
    scale = w_logits.abs().max()
    torch.testing.assert_close(g_logits, w_logits, rtol=1e-4, atol=1e-5 * scale)
    assert torch.equal(g_cls, w_cls)
    assert w_cls.unique().numel() >= 2     # one class everywhere would prove little


class AtenOps(TorchDispatchMode):
    """Records the aten ops a forward runs, and the shapes of their outputs."""

    def __enter__(self):
        self.calls = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        self.calls.append((str(func.overloadpacket.__name__), shape))
        return out


# ------------------------------------------------------------------ bad input
def test_bad_mode():
    init_default_scope('mmseg')
    model = MultiheadAttention(32, 4, batch_first=True)
    # the mode must be one of the two paths, named in the message
    with pytest.raises(ValueError, match="dense_attn='flash'.*'fast'.*'mmseg'"):
        set_dense_attn(model, 'flash')
    # the segmentor's option is checked before anything is built
    with pytest.raises(ValueError, match="dense_attn='Fast'"):
        MODELS.build(dict(model_cfg(VIT_T), type='SlimEncoderDecoder', dense_attn='Fast'))
    # init_model's argument
    with pytest.raises(ValueError, match='dense_attn=True'):
        init_model(VIT_T, dense_attn=True)
    # a config's (as --cfg-options dense_attn=... sets it): a user error of the tools
    cfg = load_config(VIT_T, dict(dense_attn='sdpa'))
    with pytest.raises(InputError, match="dense_attn='sdpa'"):
        use_slim_inference(cfg)
    # the tools' flag: a usage error (argparse's choices)
    parser = tool_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(['--dense-attn', 'flash'])


# ------------------------------------------------------------------ layer
def test_layer_is_mmseg_to_rounding():
    """One mmcv ``MultiheadAttention`` (ViT's: batch first, packed q/k/v, residual): the
    same output, forward and backward, the same parameters and keys; and the N x N
    weights are formed on mmseg's path only."""
    torch.manual_seed(0)
    ref = MultiheadAttention(96, 3, batch_first=True).train()
    fast = copy.deepcopy(ref)
    assert set_dense_attn(fast, 'fast') == 1 and type(fast.attn) is FastMultiheadAttention
    assert list(fast.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 37, 96)                          # batch 2, N = 37 (cls + 6x6)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = ref(xr), fast(xf)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    # which ops run: the N x N weights (B*H, N, N) on mmseg's path only
    ref.eval(), fast.eval()
    for model, materialised in ((ref, True), (fast, False)):
        with torch.no_grad(), AtenOps() as ops:
            model(x)
        assert ((3 * 2, 37, 37) in [s for _, s in ops.calls]) is materialised
        assert any('scaled_dot_product' in f for f, _ in ops.calls) is not materialised
    # and back: mmseg's class, mmseg's output bit for bit
    assert set_dense_attn(fast, 'mmseg') == 1 and type(fast.attn) is nn.MultiheadAttention
    with torch.no_grad():
        assert torch.equal(fast(x), ref(x))


def test_masked_attention_tome():
    """A caller's attention mask (ToMe's proportional attention) goes into SDPA."""
    torch.manual_seed(1)
    ref = MultiheadAttention(64, 4, batch_first=True).eval()
    fast = copy.deepcopy(ref)
    set_dense_attn(fast)
    x = torch.randn(2, 20, 64)
    bias = torch.randn(2 * 4, 20, 20)
    with torch.no_grad():
        torch.testing.assert_close(fast(x, attn_mask=bias), ref(x, attn_mask=bias),
                                   rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ models
@pytest.mark.parametrize('mode,shape,batch', [('slide', (64, 100), 2), ('slide', (100, 70), 1),
                                              ('whole', (64, 96), 2)],
                         ids=['slide-batch2', 'slide-tall', 'whole-batch2'])
def test_segmenter_vit_t(vit_t, mode, shape, batch):
    """Segmenter ViT-T (12 layers of 192, 3 heads, the 2-layer mask head with 150 class
    tokens): mmseg's logits to rounding, mmseg's classes."""
    ref, fast = vit_t
    for m in (ref, fast):
        m.test_cfg.mode = mode
    try:
        inputs = torch.randn(batch, 3, *shape, generator=torch.Generator().manual_seed(2))
        assert_same_result(predict(ref, inputs), predict(fast, inputs))
    finally:
        for m in (ref, fast):
            m.test_cfg.mode = 'slide'


@pytest.mark.parametrize('mode', ['slide', 'whole'])
def test_upernet_deit_s(upernet, mode):
    """DeiT-S UperNet (a multi-level neck over 4 of the 12 layers): the same."""
    ref, fast = upernet
    for m in (ref, fast):
        m.test_cfg.mode = mode
    try:
        inputs = torch.randn(2, 3, 64, 90, generator=torch.Generator().manual_seed(3))
        assert_same_result(predict(ref, inputs), predict(fast, inputs))
    finally:
        for m in (ref, fast):
            m.test_cfg.mode = 'slide'


def test_switch_restores_mmseg(vit_t):
    """``set_dense_attn(model, 'mmseg')``: mmseg's results bit for bit; keys unchanged."""
    ref, fast = vit_t
    model = copy.deepcopy(fast)
    assert set_dense_attn(model, 'mmseg') == 14        # 12 encoder + 2 mask-head layers
    assert dense_attn_of(model) == 'mmseg'
    assert all(type(m) is nn.MultiheadAttention for m in model.modules()
               if isinstance(m, nn.MultiheadAttention))
    assert list(model.state_dict()) == list(ref.state_dict()) == list(fast.state_dict())
    inputs = torch.randn(1, 3, 64, 100, generator=torch.Generator().manual_seed(4))
    want, got = predict(ref, inputs), predict(model, inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_training_mode(vit_t):
    """Training (the config's drop path 0.1, the same random draws): the same losses and
    gradients to rounding."""
    ref, fast = vit_t
    ref, fast = copy.deepcopy(ref).train(), copy.deepcopy(fast).train()
    inputs = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    data = []
    for i in range(2):
        s = samples(1, (64, 64))[0]
        s.gt_sem_seg = PixelData(data=torch.randint(
            0, 150, (1, 64, 64), generator=torch.Generator().manual_seed(10 + i)))
        data.append(s)
    losses = []
    for model in (ref, fast):
        torch.manual_seed(7)            # the same stochastic depth in both
        loss = model.loss(inputs.clone(), copy.deepcopy(data))
        total = sum(v for k, v in loss.items() if 'loss' in k)
        total.backward()
        losses.append(total.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-6, msg=name)


# ------------------------------------------------------------------ how models get it
def tool_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=KeyValueAction)
    add_mita_args(parser)
    return parser


def test_tool_flag():
    """``--dense-attn`` is ``--cfg-options dense_attn=...``, before or after it."""
    parser = tool_parser()
    assert parser.parse_args([]).cfg_options is None
    for argv in (['--dense-attn', 'mmseg', '--cfg-options', 'a=1'],
                 ['--cfg-options', 'a=1', '--dense-attn', 'mmseg']):
        args = parser.parse_args(argv)
        assert args.cfg_options == dict(a=1, dense_attn='mmseg') and args.dense_attn == 'mmseg'


SMALL = dict(model=dict(backbone=dict(num_layers=2, init_cfg=None),
                        decode_head=dict(num_layers=1)))


@pytest.mark.parametrize('slim', [True, False], ids=['slim', 'mmseg-segmentor'])
def test_init_model(slim):
    """``init_model``: fast by default, whatever the segmentor; ``dense_attn='mmseg'`` (the
    argument or the config's option) keeps mmseg's path."""
    opts = dict(SMALL, slim_inference=slim)
    assert dense_attn_of(init_model(VIT_T, cfg_options=opts)) == 'fast'
    assert dense_attn_of(init_model(VIT_T, cfg_options=opts, dense_attn='mmseg')) == 'mmseg'
    model = init_model(VIT_T, cfg_options=dict(opts, dense_attn='mmseg'))
    assert dense_attn_of(model) == 'mmseg'
    assert model.cfg.dense_attn == 'mmseg'
    # the argument wins over the config
    model = init_model(VIT_T, cfg_options=dict(opts, dense_attn='mmseg'), dense_attn='fast')
    assert dense_attn_of(model) == 'fast'


def test_config_switch():
    """The config's ``dense_attn`` reaches ``SlimEncoderDecoder``'s option (a dumped config
    builds the same), never mmseg's ``EncoderDecoder``; a config that names the option
    keeps it."""
    cfg = use_slim_inference(load_config(VIT_T))
    assert cfg.dense_attn == 'fast' and cfg.model.dense_attn == 'fast'
    cfg = use_slim_inference(load_config(VIT_T, dict(dense_attn='mmseg')))
    assert cfg.model.type == 'SlimEncoderDecoder' and cfg.model.dense_attn == 'mmseg'
    cfg.slim_inference = False
    use_slim_inference(cfg)
    assert cfg.model.type == 'EncoderDecoder' and 'dense_attn' not in cfg.model
    assert cfg.dense_attn == 'mmseg'
    own = Config(dict(model=dict(type='SlimEncoderDecoder', dense_attn='mmseg')))
    assert use_slim_inference(own).dense_attn == 'mmseg'
    tta = Config(dict(model=dict(type='SegTTAModel', module=dict(type='EncoderDecoder')),
                      dense_attn='mmseg'))
    assert use_slim_inference(tta).model.module.dense_attn == 'mmseg'
    assert 'dense_attn' not in tta.model


def test_swapped_layers_and_use_dense():
    """A swap's dense layers (a partial swap, the head left dense) run the fast path; a
    layer put back on dense by ``use_dense`` runs the model's path, either one."""
    model = init_model(VIT_T, cfg_options=SMALL,
                       mita_cfg=dict(pool_size=2, topk=8, layers=[0], include_head=False))
    backbone, head = model.backbone, model.decode_head
    assert type(backbone.layers[0].attn) is MiTAAttention
    assert type(backbone.layers[1].attn.attn) is FastMultiheadAttention
    assert all(type(layer.attn.attn) is FastMultiheadAttention for layer in head.layers)
    for mode in ('mmseg', 'fast'):
        m = copy.deepcopy(model)
        set_dense_attn(m, mode)    # also the layer MiTA holds for use_dense
        assert use_dense(m.backbone, [0]) == 1
        assert dense_attn_of(m) == mode
