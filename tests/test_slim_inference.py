"""SlimEncoderDecoder against mmseg's own EncoderDecoder on the same weights: seg logits and
class maps equal bit for bit (compared as integers, so -0.0 and NaN payloads count), on
mmseg's Segmenter ViT-T config (scaled down for the fast tests; at its own size, slow),
whole and slide, flipped, padded, smaller than a crop, batch 2; and the config switch."""
import copy
import os.path as osp

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope

from mmseg.models.segmentors import EncoderDecoder
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample

from mita_seg.apis import init_model, load_config, use_slim_inference
from mita_seg.models import SlimEncoderDecoder, swap_attention

VIT_T = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
CONFIGS = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs')
TINY_UPERNET = osp.join(CONFIGS, 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')


def bits(t):
    """The tensor's bits as integers (equal bits, not merely equal values)."""
    t = t.contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def tiny_cfg(crop=64, stride=42, **head):
    """mmseg's Segmenter ViT-T config, scaled down: 2 layers of 64 channels, patch 8, one
    mask-head layer, 150 classes, slide over ``crop`` crops."""
    cfg = load_config(VIT_T)
    m = cfg.model
    m.pop('pretrained', None)
    m.pop('data_preprocessor', None)
    m.backbone.update(img_size=(crop, crop), patch_size=8, embed_dims=64, num_layers=2,
                      num_heads=2, init_cfg=None)
    m.decode_head.update(in_channels=64, channels=64, embed_dims=64, num_layers=1,
                         num_heads=2, **head)
    m.test_cfg = dict(mode='slide', crop_size=(crop, crop), stride=(stride, stride))
    return cfg


def build_pair(model_cfg, swap=False):
    """mmseg's EncoderDecoder with seeded random weights and a SlimEncoderDecoder holding the
    same weights, on mmseg's dense attention path (the fast one is equal to rounding, not
    bit for bit: tests/test_fast_attention.py)."""
    init_default_scope('mmseg')
    torch.manual_seed(0)
    ref = MODELS.build(dict(copy.deepcopy(model_cfg), type='EncoderDecoder')).eval()
    for p in ref.parameters():   # trained-like scales: class scores spread over the classes
        p.data.normal_(0, 0.3)
    if swap:
        swap_attention(ref, pool_size=2, topk=8, verbose=False)
    slim_cfg = copy.deepcopy(model_cfg)
    slim_cfg.type = 'SlimEncoderDecoder'
    slim_cfg.dense_attn = 'mmseg'
    slim = MODELS.build(slim_cfg).eval()
    if swap:
        swap_attention(slim, pool_size=2, topk=8, verbose=False)
    slim.load_state_dict(ref.state_dict(), strict=True)
    assert type(ref) is EncoderDecoder and type(slim) is SlimEncoderDecoder
    return ref, slim


def samples(n, shape, **meta):
    """``n`` data samples of an image of ``shape`` (img, pad and ori shape) with ``meta``."""
    h, w = shape
    base = dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w))
    return [SegDataSample(metainfo={**base, **meta}) for _ in range(n)]


def check_equal(ref, slim, inputs, data_samples):
    """Both models' ``predict`` on the same inputs: logits and class maps, bit for bit."""
    with torch.no_grad():
        want = ref.predict(inputs.clone(), copy.deepcopy(data_samples))
        got = slim.predict(inputs.clone(), copy.deepcopy(data_samples))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert g.seg_logits.data.shape == w.seg_logits.data.shape
        assert g.seg_logits.data.dtype == w.seg_logits.data.dtype
        assert torch.equal(bits(g.seg_logits.data), bits(w.seg_logits.data))
        assert torch.equal(g.pred_sem_seg.data, w.pred_sem_seg.data)
        assert g.pred_sem_seg.data.dtype == w.pred_sem_seg.data.dtype
    return want


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


@pytest.fixture(scope='module')
def tiny():
    return build_pair(tiny_cfg().model)


CASES = {
    # name: (image h, w, batch, extra meta)
    'two-crops': (64, 86, 1, {}),
    'grid-3x3': (130, 150, 1, {}),
    'smaller-than-crop': (40, 56, 1, {}),
    'one-side-smaller': (40, 150, 1, {}),
    'batch-2': (64, 100, 2, {}),
    'flip-horizontal': (64, 86, 1, dict(flip=True, flip_direction='horizontal')),
    'flip-vertical': (100, 64, 1, dict(flip=True, flip_direction='vertical')),
    'resized-to-ori': (64, 86, 1, dict(ori_shape=(96, 129))),
}


@pytest.mark.parametrize('case,mode', [(c, 'slide') for c in CASES] + [
    (c, 'whole') for c in ('batch-2', 'flip-horizontal', 'resized-to-ori')])
def test_predict_equals_mmseg(tiny, case, mode):
    ref, slim = tiny
    h, w, n, meta = CASES[case]
    for m in (ref, slim):
        m.test_cfg.mode = mode
    try:
        inputs = torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(1))
        want = check_equal(ref, slim, inputs, samples(n, (h, w), **meta))
        if mode == 'slide':  # classes differ across the image: one class would prove little
            assert want[0].pred_sem_seg.data.unique().numel() >= 2
    finally:
        for m in (ref, slim):
            m.test_cfg.mode = 'slide'


@pytest.mark.parametrize('key', ['padding_size', 'img_padding_size'])
def test_padded_image(tiny, key):
    ref, slim = tiny
    # an 60x75 image padded to 64x86 (left, right, top, bottom): the padding is cut off,
    # leaving the original size (no resize) or, with another ori_shape, resized
    pad = [3, 8, 1, 3]
    inputs = torch.randn(1, 3, 64, 86, generator=torch.Generator().manual_seed(2))
    for ori in ((60, 75), (120, 150)):
        check_equal(ref, slim, inputs, samples(1, (64, 86), ori_shape=ori, **{key: pad}))


@pytest.mark.parametrize('crop,stride', [(64, 24), (64, 64), (64, 80), (48, 40)],
                         ids=['overlap-3', 'no-overlap', 'stride-over-crop', 'crop-48'])
def test_slide_strides(crop, stride):
    ref, slim = build_pair(tiny_cfg(crop, stride).model)
    inputs = torch.randn(1, 3, 64, 100, generator=torch.Generator().manual_seed(3))
    check_equal(ref, slim, inputs, samples(1, (64, 100)))
    metas = [s.metainfo for s in samples(1, (64, 100))]
    with torch.no_grad():   # slide_inference alone, and its side effect on the meta
        want = ref.slide_inference(inputs, copy.deepcopy(metas))
        got_metas = copy.deepcopy(metas)
        got = slim.slide_inference(inputs, got_metas)
    assert torch.equal(bits(got), bits(want))
    ref.slide_inference(inputs, metas)
    assert got_metas == metas


def test_swapped_batch_flip_padding(tiny):
    """A model swapped to MiTA, batch 2, flipped and padded, align_corners=True."""
    ref, slim = build_pair(tiny_cfg(align_corners=True).model, swap=True)
    inputs = torch.randn(2, 3, 70, 90, generator=torch.Generator().manual_seed(4))
    meta = dict(ori_shape=(66, 85), padding_size=[0, 5, 0, 4], flip=True,
                flip_direction='horizontal')
    check_equal(ref, slim, inputs, samples(2, (70, 90), **meta))


def test_with_autograd_on(tiny):
    """``predict`` called with autograd on (as ``test_step`` outside a test loop is): the
    same values as mmseg's, and a gradient reaches the input through the slide's sums."""
    ref, slim = tiny
    inputs = torch.randn(1, 3, 64, 86, generator=torch.Generator().manual_seed(6))
    x_ref, x_slim = inputs.clone().requires_grad_(), inputs.clone().requires_grad_()
    want = ref.predict(x_ref, samples(1, (64, 86)))[0].seg_logits.data
    got = slim.predict(x_slim, samples(1, (64, 86)))[0].seg_logits.data
    assert got.requires_grad and torch.equal(bits(got.detach()), bits(want.detach()))
    want.sum().backward()
    got.sum().backward()
    assert torch.allclose(x_slim.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_no_data_samples(tiny):
    """``predict`` without data samples: the logits as they are, and their class map."""
    ref, slim = tiny
    inputs = torch.randn(1, 3, 64, 86, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = ref.predict(inputs), slim.predict(inputs)
    assert torch.equal(bits(got[0].seg_logits.data), bits(want[0].seg_logits.data))
    assert torch.equal(got[0].pred_sem_seg.data, want[0].pred_sem_seg.data)


def test_signed_zeros():
    """Logits of +-0.0 (the mask head's last LayerNorm with weight and bias -0.0): mmseg's
    sum of zeros and the crops turns -0.0 into 0.0, and so does the slim one."""
    ref, slim = build_pair(tiny_cfg().model)
    for m in (ref, slim):
        m.decode_head.mask_norm.weight.data.fill_(-0.0)
        m.decode_head.mask_norm.bias.data.fill_(-0.0)
    inputs = torch.randn(1, 3, 64, 86, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        crop = slim.encode_decode(inputs[..., :64], [dict(img_shape=torch.Size((64, 64)))])
    assert torch.signbit(crop).any() and not crop.any()     # the crops have -0.0
    want = check_equal(ref, slim, inputs, samples(1, (64, 86)))
    assert not torch.signbit(want[0].seg_logits.data).any()


def test_non_finite_logits_take_the_resize(tiny):
    """A non-finite logit spreads through mmseg's resize (0 * inf): the same resize runs."""
    _, slim = tiny
    logits = torch.randn(1, 150, 32, 40)
    logits[0, 5, 10, 10] = float('inf')
    sample = samples(1, (32, 40))
    out = slim.postprocess_result(logits.clone(), copy.deepcopy(sample))
    want = EncoderDecoder.postprocess_result(slim, logits.clone(), copy.deepcopy(sample))
    assert out[0].seg_logits.data.isnan().any()
    assert torch.equal(bits(out[0].seg_logits.data), bits(want[0].seg_logits.data))
    assert torch.equal(out[0].pred_sem_seg.data, want[0].pred_sem_seg.data)


def upernet_cfg(**head):
    """mmseg's ViT UperNet (the small one of configs/, with MiTA), slide over 64x64 crops."""
    cfg = load_config(TINY_UPERNET)
    cfg.model.pop('data_preprocessor', None)
    cfg.model.decode_head.update(head)
    cfg.model.test_cfg = dict(mode='slide', crop_size=(64, 64), stride=(42, 42))
    return cfg


def test_upernet():
    """Another architecture (conv decoder over a multi-level neck): slide, flip, padding."""
    ref, slim = build_pair(upernet_cfg().model)
    inputs = torch.randn(1, 3, 70, 90, generator=torch.Generator().manual_seed(6))
    check_equal(ref, slim, inputs, samples(1, (70, 90), ori_shape=(66, 85),
                                           padding_size=[0, 5, 0, 4], flip=True,
                                           flip_direction='vertical'))


def test_binary_head_threshold():
    """``out_channels == 1``: mmseg's sigmoid and ``threshold``."""
    cfg = upernet_cfg(num_classes=2, out_channels=1, threshold=0.4,
                      loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=True))
    ref, slim = build_pair(cfg.model)
    inputs = torch.randn(1, 3, 64, 86, generator=torch.Generator().manual_seed(6))
    want = check_equal(ref, slim, inputs, samples(1, (64, 86), ori_shape=(60, 80)))
    assert want[0].seg_logits.data.shape[0] == 1


def test_autocast_bfloat16(tiny):
    """Under CPU autocast (bf16): the same logits, of the same dtype, and class maps."""
    ref, slim = tiny
    inputs = torch.randn(1, 3, 64, 86, generator=torch.Generator().manual_seed(7))
    with torch.autocast('cpu', torch.bfloat16):
        check_equal(ref, slim, inputs, samples(1, (64, 86)))


def test_use_slim_inference():
    cfg = load_config(VIT_T)
    assert cfg.model.type == 'EncoderDecoder'
    use_slim_inference(cfg)
    assert cfg.model.type == 'SlimEncoderDecoder'
    assert 'mita_seg.models' in cfg.custom_imports.imports   # its dump builds it too
    # turned off: mmseg's, also for a config that names SlimEncoderDecoder itself
    cfg.slim_inference = False
    assert use_slim_inference(cfg).model.type == 'EncoderDecoder'
    # a TTA model's segmentor
    tta = Config(dict(model=dict(type='SegTTAModel', module=dict(type='EncoderDecoder'))))
    assert use_slim_inference(tta).model.module.type == 'SlimEncoderDecoder'
    # another segmentor is left alone
    other = Config(dict(model=dict(type='CascadeEncoderDecoder')))
    assert use_slim_inference(other).model.type == 'CascadeEncoderDecoder'


def test_init_model_and_mita_configs():
    """init_model builds SlimEncoderDecoder unless told not to; the MiTA configs name it."""
    opts = dict(model=dict(backbone=dict(num_layers=1, init_cfg=None),
                           decode_head=dict(num_layers=1)))
    assert type(init_model(VIT_T, cfg_options=opts)) is SlimEncoderDecoder
    model = init_model(VIT_T, cfg_options=dict(opts, slim_inference=False))
    assert type(model) is EncoderDecoder
    cfg = load_config(osp.join(CONFIGS, 'mita_segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'))
    assert cfg.model.type == 'SlimEncoderDecoder'
    cfg.slim_inference = False
    assert use_slim_inference(cfg).model.type == 'EncoderDecoder'


@pytest.mark.slow
@pytest.mark.parametrize('swap', [False, True], ids=['mmseg', 'swapped'])
def test_vit_t_at_its_size(swap):
    """mmseg's Segmenter ViT-T at its own size: a 512x683 image, slide over 512x512 crops
    (stride 512: two crops), and whole, on MiTA or not."""
    cfg = load_config(VIT_T)
    cfg.model.pop('pretrained', None)
    cfg.model.pop('data_preprocessor', None)
    cfg.model.backbone.init_cfg = None
    ref, slim = build_pair(cfg.model)
    if swap:
        for m in (ref, slim):
            swap_attention(m, pool_size=7, topk=49, verbose=False)
    inputs = torch.randn(1, 3, 512, 683, generator=torch.Generator().manual_seed(8))
    check_equal(ref, slim, inputs, samples(1, (512, 683)))
    check_equal(ref, slim, inputs, samples(1, (512, 683), flip=True,
                                           flip_direction='horizontal'))
