"""MiTAVisionTransformer: mmseg ViT weights load strictly, clear errors when they don't fit."""
import pytest
import torch
from mmseg.models.backbones import VisionTransformer

from mita_seg.models import MiTAAttention, MiTAVisionTransformer

SMALL = dict(img_size=(64, 64), patch_size=8, embed_dims=64, num_layers=2, num_heads=2,
             out_indices=(0, 1))


def save_vit(path, seed=0, **kwargs):
    """Seeded random mmseg VisionTransformer weights in mmseg's checkpoint format."""
    torch.manual_seed(seed)
    vit = VisionTransformer(**{**SMALL, **kwargs})
    vit.init_weights()
    torch.save({'meta': {'seed': seed}, 'state_dict': vit.state_dict()}, path)
    return vit


def pretrained(path, **kwargs):
    return MiTAVisionTransformer(
        **{**SMALL, **kwargs}, init_cfg=dict(type='Pretrained', checkpoint=str(path)))


def test_vit_weights_load_strictly(tmp_path):
    vit = save_vit(tmp_path / 'vit.pth', final_norm=True)
    mita = pretrained(tmp_path / 'vit.pth', final_norm=True)
    assert sum(isinstance(m, MiTAAttention) for m in mita.modules()) == 2
    mita.init_weights()
    ref = vit.state_dict()
    assert mita.state_dict().keys() == ref.keys()
    for k, v in mita.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_same_output_as_vit_when_mita_is_full_attention(tmp_path):
    # route-only MiTA with k >= N is exactly softmax attention: same outputs as mmseg's ViT,
    # on a non-square input (8x11 grid)
    vit = save_vit(tmp_path / 'vit.pth')
    mita = pretrained(tmp_path / 'vit.pth',
                      mita_cfg=dict(topk=8 * 11 + 1, with_shared_expert=False))
    mita.init_weights()
    vit.eval(), mita.eval()
    x = torch.randn(2, 3, 64, 88)
    with torch.no_grad():
        outs, refs = mita(x), vit(x)
    assert mita._mita_grid.hw_shape == (8, 11)
    for out, ref in zip(outs, refs):
        assert out.shape == (2, 64, 8, 11)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_pos_embed_resized_and_classifier_norm_skipped(tmp_path):
    # a 64x64 checkpoint (with a final norm) into a 96x96 backbone without one
    save_vit(tmp_path / 'vit.pth', final_norm=True)
    mita = pretrained(tmp_path / 'vit.pth', img_size=(96, 96), final_norm=False)
    mita.init_weights()
    assert mita.pos_embed.shape == (1, 1 + 12 * 12, 64)


def test_pretrained_part_prefix(tmp_path):
    vit = save_vit(tmp_path / 'vit.pth')
    part = {f'image_encoder.{k}': v for k, v in vit.state_dict().items()}
    torch.save(part, tmp_path / 'part.pth')
    mita = MiTAVisionTransformer(
        **SMALL, init_cfg=dict(type='Pretrained_Part', checkpoint=str(tmp_path / 'part.pth')))
    mita.init_weights()
    assert torch.equal(mita.layers[1].attn.attn.in_proj_weight,
                       vit.layers[1].attn.attn.in_proj_weight)


def test_checkpoint_that_does_not_fit(tmp_path):
    save_vit(tmp_path / 'vit.pth')
    # a deeper model: the missing layer is listed
    with pytest.raises(ValueError, match=r'missing keys \(\d+\): layers\.2\.'):
        pretrained(tmp_path / 'vit.pth', num_layers=3, out_indices=(2, )).init_weights()
    # a shallower model: the extra layer is listed
    with pytest.raises(ValueError, match=r'unexpected keys \(\d+\): layers\.1\.'):
        pretrained(tmp_path / 'vit.pth', num_layers=1, out_indices=(0, )).init_weights()
    # wider tokens: shapes are listed (pos_embed included: its channels differ)
    with pytest.raises(ValueError, match=r'shape mismatch .*cls_token: checkpoint '
                       r'\(1, 1, 64\) vs model \(1, 1, 128\)'):
        pretrained(tmp_path / 'vit.pth', embed_dims=128).init_weights()
    # mmseg's behaviour on request: mismatches are only logged
    pretrained(tmp_path / 'vit.pth', num_layers=3, out_indices=(2, ),
               strict_pretrained=False).init_weights()


def test_timm_checkpoint_gets_a_conversion_hint(tmp_path):
    torch.save({'blocks.0.attn.qkv.weight': torch.zeros(192, 64)}, tmp_path / 'timm.pth')
    with pytest.raises(ValueError, match='vit2mmseg'):
        pretrained(tmp_path / 'timm.pth').init_weights()


def test_mita_layers_and_cfg():
    mita = MiTAVisionTransformer(**SMALL, mita_layers=[-1], mita_cfg=dict(pool_size=2, topk=8))
    assert type(mita.layers[0].attn).__name__ == 'MultiheadAttention'
    assert isinstance(mita.layers[1].attn, MiTAAttention)
    assert (mita.layers[1].attn.pool_size, mita.layers[1].attn.topk) == (2, 8)
