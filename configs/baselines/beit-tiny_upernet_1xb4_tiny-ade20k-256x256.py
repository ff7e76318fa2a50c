# The tiny BEiT UperNet of ../mita_beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py with
# STANDARD attention (mmseg's BEiT: relative position bias, layer scale, q/v bias): a
# checkpoint to swap to MiTA at test time at N = 1025 (docs/swap.md). Same data, schedule and
# sizes; checkpoints load into either (same keys).
_base_ = ['../mita_beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py']

crop_size = (256, 256)
embed_dims = 64
model = dict(
    backbone=dict(
        _delete_=True,
        type='BEiT',
        img_size=crop_size,
        patch_size=8,
        in_channels=3,
        embed_dims=embed_dims,
        num_layers=4,
        num_heads=2,
        mlp_ratio=4,
        out_indices=(0, 1, 2, 3),
        qv_bias=True,
        attn_drop_rate=0.0,
        drop_path_rate=0.1,
        norm_cfg=dict(type='LN', eps=1e-6),
        act_cfg=dict(type='GELU'),
        norm_eval=False,
        init_values=0.1))
