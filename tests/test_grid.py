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
    swap_attention(model, pool_size=2, topk=10_000, with_shared_expert=False, include_head=True,
                   verbose=False)
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
    swap_attention(model, pool_size=2, topk=8, include_head=True, verbose=False)
    assert isinstance(model.decode_head, MyHead)
    _step(model, 96, 128)
    assert head.called and head._mita_grid.hw_shape == (6, 8)


def test_swapped_head_class_tokens_are_global():
    """The mask head's class embeddings (its tokens after the grid) are global tokens: as
    queries they attend to every key exactly (standard attention's rows); the patch tokens
    are routed. The backbone's cls is routed (the paper's MiTA) unless chosen."""
    model = _segmenter('whole')
    swap_attention(model, pool_size=2, topk=8, include_head=True, verbose=False)
    head = model.decode_head
    assert head._mita_grid.global_suffix and not head._mita_grid.global_prefix
    assert not model.backbone._mita_grid.global_prefix
    assert model.backbone._mita_grid.global_tokens(1 + 48, (6, 8)) == (0, 0)
    assert head._mita_grid.global_tokens(48 + 150, (6, 8)) == (0, 150)
    attn = head.layers[0].attn
    dense = attn.__dict__['_mita_dense_original'][0]    # the mmcv module it replaced
    head._mita_grid.hw_shape = (6, 8)
    x = torch.randn(2, 48 + 150, 192, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, ref = attn(x), dense(x)
    torch.testing.assert_close(out[:, 48:], ref[:, 48:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[:, :48], ref[:, :48], atol=1e-3)   # patches: MiTA
    head._mita_grid.global_suffix = False                             # routed, as before
    with torch.no_grad():
        assert not torch.allclose(attn(x)[:, 48:], ref[:, 48:], atol=1e-3)
