"""MiTA backbones: mmseg ViT, BEiT and MAE weights load strictly, clear errors when they
don't fit."""
import os
import runpy

import pytest
import torch
from mmseg.models.backbones import BEiT, MAE, VisionTransformer

from mita_seg.models import MiTAAttention, MiTABEiT, MiTAMAE, MiTAVisionTransformer
from mita_seg.models.backbones import pretrained as pretrained_init
from mita_seg.utils.checkpoint import CheckpointMismatchError

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
    # pos_embed alone, its channels differing (the message above lists it among 27
    # mismatches, past its cut): the loader resizes its grid, never its channels
    ckpt = torch.load(tmp_path / 'vit.pth', weights_only=True)
    ckpt['state_dict']['pos_embed'] = ckpt['state_dict']['pos_embed'][..., :32].clone()
    torch.save(ckpt, tmp_path / 'narrow_pos.pth')
    with pytest.raises(ValueError, match=r'shape mismatch \(1\): pos_embed: checkpoint '
                       r'\(1, 65, 32\) vs model \(1, 65, 64\)'):
        pretrained(tmp_path / 'narrow_pos.pth').init_weights()
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


BEIT = dict(patch_size=8, embed_dims=32, num_layers=2, num_heads=2, out_indices=(0, 1))


def save_beit(path, cls=BEiT, drop=(), extra=(), img_size=32):
    """Seeded mmseg BEiT/MAE backbone weights as beit2mmseg.py writes them (no
    ``state_dict`` wrapper), without the keys containing any of ``drop``, with ``extra``
    keys of a pretraining checkpoint (its head, its final norm)."""
    torch.manual_seed(0)
    src = cls(img_size=img_size, **BEIT)
    src.init_weights()
    sd = {k: v for k, v in src.state_dict().items() if not any(s in k for s in drop)}
    sd.update({k: torch.ones(3) for k in extra})
    torch.save(sd, path)
    return src


def timm_names(state_dict):
    """mmseg BEiT/MAE keys as BEiT's and MAE's own code names them (what mmseg's
    beit2mmseg.py converts), with a classification head and its norm."""
    renames = (('layers.', 'blocks.'), ('.ln1.', '.norm1.'), ('.ln2.', '.norm2.'),
               ('ffn.layers.0.0.', 'mlp.fc1.'), ('ffn.layers.1.', 'mlp.fc2.'),
               ('patch_embed.projection.', 'patch_embed.proj.'))
    out = {}
    for k, v in state_dict.items():
        for a, b in renames:
            k = k.replace(a, b)
        out[k] = v
    return {**out, 'fc_norm.weight': torch.ones(3), 'head.weight': torch.ones(3)}


def test_beit_checkpoint_converted_by_mmseg_loads_strictly(tmp_path):
    """Through mmseg's own converter (which keeps patch_embed.proj.* beside its renamed
    patch_embed.projection.*), every weight loads and nothing is refused."""
    import mmseg
    tool = os.path.join(os.path.dirname(mmseg.__file__), '.mim', 'tools', 'model_converters',
                        'beit2mmseg.py')
    convert_beit = runpy.run_path(tool)['convert_beit']
    src = save_beit(tmp_path / 'beit.pth')
    torch.save(convert_beit(timm_names(src.state_dict())), tmp_path / 'converted.pth')
    mita = MiTABEiT(img_size=32, **BEIT, init_cfg=dict(
        type='Pretrained', checkpoint=str(tmp_path / 'converted.pth')))
    mita.init_weights()
    for k, v in src.state_dict().items():
        assert torch.equal(mita.state_dict()[k], v), k


@pytest.mark.parametrize('cls, mita_cls', [(BEiT, MiTABEiT), (MAE, MiTAMAE)])
def test_beit_mae_pretrained_load_with_their_differences_logged(tmp_path, monkeypatch, cls,
                                                                mita_cls):
    """A pretraining checkpoint at another grid: its head and final norm are not loaded,
    mmseg resizes the relative position table (and MAE's pos_embed), the rest loads; MAE's
    checkpoint lacks the layer scales and the table, as MAE's pretraining does."""
    lacks = ('gamma_', 'relative_position_bias_table') if cls is MAE else ()
    src = save_beit(tmp_path / 'pre.pth', cls, drop=lacks,
                    extra=('head.weight', 'fc_norm.weight'), img_size=32)
    mita = mita_cls(img_size=48, **BEIT,
                    init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'pre.pth')))
    logged = []
    monkeypatch.setattr(pretrained_init, 'print_log', lambda msg, logger: logged.append(msg))
    mita.init_weights()
    log = '\n'.join(logged)
    assert 'not loaded from' in log and 'head.weight' in log and 'fc_norm.weight' in log
    for k in ('layers.1.attn.qkv.weight', 'layers.1.ffn.layers.1.weight', 'cls_token'):
        assert torch.equal(mita.state_dict()[k], src.state_dict()[k]), k
    assert 'relative_position_index' not in log  # mmseg rebuilds it: nothing to say
    if cls is MAE:
        assert 'kept at their initialisation' in log and 'layers.0.gamma_1' in log
    else:  # interpolated to the larger grid by mmseg
        assert mita.layers[0].attn.relative_position_bias_table.shape[0] > \
            src.layers[0].attn.relative_position_bias_table.shape[0]


@pytest.mark.parametrize('mita_cls', [MiTABEiT, MiTAMAE])
def test_beit_mae_pretrained_that_does_not_fit(tmp_path, mita_cls):
    """Weights that would stay silently random in mmseg are an error listing them."""
    cls = BEiT if mita_cls is MiTABEiT else MAE
    save_beit(tmp_path / 'short.pth', cls, drop=('layers.1.', ))
    model = mita_cls(img_size=32, **BEIT,
                     init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'short.pth')))
    with pytest.raises(CheckpointMismatchError, match=r'missing keys \(\d+\): .*layers\.1\.attn'):
        model.init_weights()
    # original key names: a hint to convert, not mmseg's KeyError inside resize_rel_pos_embed
    src = save_beit(tmp_path / 'beit.pth', cls)
    torch.save(timm_names(src.state_dict()), tmp_path / 'timm.pth')
    model = mita_cls(img_size=32, **BEIT,
                     init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'timm.pth')))
    with pytest.raises(CheckpointMismatchError, match='beit2mmseg'):
        model.init_weights()
    # another head count: the relative position table's heads must match
    wide = mita_cls(img_size=32, **{**BEIT, 'num_heads': 4},
                    init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'beit.pth')))
    with pytest.raises(CheckpointMismatchError, match='relative_position_bias_table'):
        wide.init_weights()
    # mmseg's behaviour on request
    short = dict(type='Pretrained', checkpoint=str(tmp_path / 'short.pth'))
    mita_cls(img_size=32, **BEIT, strict_pretrained=False, init_cfg=short).init_weights()


def test_beit_table_resize_without_scipy_interp2d():
    """mmseg resizes a pretrained relative position table with scipy's interp2d, which
    SciPy 1.14 removed; MiTABEiT's bicubic spline keeps rows as rows: a table that varies
    along rows only stays so, in order, with its centre value exact."""
    model = MiTABEiT(img_size=32, **BEIT)
    src, dst = 7, 11
    rows = torch.linspace(-1.0, 2.0, src) ** 3                      # increasing, not linear
    table = torch.stack([rows[:, None].expand(src, src).reshape(-1),
                         torch.full((src * src, ), 0.25)], dim=1)   # [src * src, 2 heads]
    out = model._geometric_sequence_interpolation(src, dst, table, 2)
    assert out.shape == (dst * dst, 2)
    grid = out[:, 0].view(dst, dst)
    torch.testing.assert_close(grid, grid[:, :1].expand(dst, dst))   # constant along a row
    assert bool((grid[1:, 0] > grid[:-1, 0]).all())                   # increasing down rows
    torch.testing.assert_close(grid[dst // 2, dst // 2], rows[src // 2])
    torch.testing.assert_close(out[:, 1], torch.full((dst * dst, ), 0.25))
