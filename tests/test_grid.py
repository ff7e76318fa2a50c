"""The patch grid reaches every swapped attention module, whatever calls the owner."""
import copy

import pytest
import torch
from mmengine.hub import get_config
from mmengine.registry import init_default_scope
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample

import mita_seg.models  # noqa: F401
from mita_seg import swap_attention


def _segmenter(mode):
    init_default_scope('mmseg')
    cfg = get_config('mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py')
    cfg.model.pop('pretrained', None)
    cfg.model.backbone.pop('init_cfg', None)
    cfg.model.backbone.num_layers = 2
    cfg.model.test_cfg = dict(mode=mode, crop_size=(128, 128), stride=(96, 96))
    torch.manual_seed(0)
    return MODELS.build(cfg.model).eval()


def _step(model, h, w):
    meta = dict(ori_shape=(h, w), img_shape=(h, w), pad_shape=(h, w))
    img = torch.randint(0, 255, (3, h, w), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    data = dict(inputs=[img],
                data_samples=[SegDataSample(metainfo=meta)])
    with torch.no_grad():
        return model.test_step(data)[0].seg_logits.data


@pytest.mark.parametrize('mode', ['whole', 'slide'])
def test_swapped_segmenter_head_gets_its_grid_in_test_step(mode):
    """mmseg's segmentors call decode_head.forward(x) directly (no module hooks): the
    swapped head must still see its (non-square) grid."""
    model = _segmenter(mode)
    base = _step(model, 160, 224)
    swap_attention(model, pool_size=2, topk=10_000, with_shared_expert=False, verbose=False)
    out = _step(model, 160, 224)        # k at most N (logged once)
    expected = (128, 128) if mode == 'slide' else (160, 224)
    assert model.decode_head._mita_grid.hw_shape == (expected[0] // 16, expected[1] // 16)
    # route-only with every key is softmax attention: the logits do not change
    torch.testing.assert_close(out, base, atol=1e-4, rtol=1e-4)


def test_deepcopy_rebinds_the_grid_hooks():
    model = _segmenter('whole')
    swap_attention(model, pool_size=2, topk=8, verbose=False)
    clone = copy.deepcopy(model)
    _step(clone, 96, 128)
    assert clone.backbone._mita_grid.hw_shape == (6, 8)
    assert clone.backbone.layers[0].attn.grid is clone.backbone._mita_grid
    assert model.backbone._mita_grid.hw_shape is None      # the original was not run


def test_a_subclassed_head_keeps_its_own_forward():
    from mmseg.models.decode_heads import SegmenterMaskTransformerHead

    class MyHead(SegmenterMaskTransformerHead):
        def forward(self, inputs):
            self.called = True
            return super().forward(inputs)

    model = _segmenter('whole')
    head = MyHead(in_channels=192, channels=192, num_classes=150, num_layers=1, num_heads=3,
                  embed_dims=192, dropout_ratio=0.0)
    model.decode_head = head
    swap_attention(model, pool_size=2, topk=8, verbose=False)
    assert isinstance(model.decode_head, MyHead)
    _step(model, 96, 128)
    assert head.called and head._mita_grid.hw_shape == (6, 8)
