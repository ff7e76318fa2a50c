# A small Segmenter with STANDARD attention on the synthetic tiny ADE20K: a checkpoint to
# swap to MiTA at test time (docs/swap.md). Same data, schedule and ViT size as
# mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py (4 layers x 64 dims, patch 8, a
# 16x16 grid), mmseg's VisionTransformer and Segmenter mask head (2 layers).
_base_ = ['../mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py']

embed_dims = 64
model = dict(
    backbone=dict(
        _delete_=True,
        type='VisionTransformer',
        img_size=(128, 128),
        patch_size=8,
        embed_dims=embed_dims,
        num_layers=4,
        num_heads=2,
        out_indices=3,
        drop_path_rate=0.1,
        with_cls_token=True,
        norm_cfg=dict(type='LN', eps=1e-6),
        interpolate_mode='bicubic'),
    neck=None,
    decode_head=dict(
        _delete_=True,
        type='SegmenterMaskTransformerHead',
        in_channels=embed_dims,
        channels=embed_dims,
        num_classes=150,
        num_layers=2,
        num_heads=2,
        embed_dims=embed_dims,
        dropout_ratio=0.0,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    auxiliary_head=None)
