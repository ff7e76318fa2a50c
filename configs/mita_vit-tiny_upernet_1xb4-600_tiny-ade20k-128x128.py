# A small MiTA ViT UperNet for CPU runs on the synthetic tiny ADE20K
# (tools/dataset/make_tiny_ade20k.py): the demo and the end-to-end tests. Same family as
# mita_upernet_ade20k.py (mmseg's ViT UperNet with a multi-level neck), scaled down:
# ViT with 64-dim tokens, 4 layers, patch 8 (a 16x16 grid at 128x128), BN instead of
# SyncBN, gloo for distributed runs, a short schedule.
_base_ = ['mmseg::vit/vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py']
custom_imports = dict(imports=['mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)

data_root = 'data/ade/tiny_ade20k'
crop_size = (128, 128)
max_iters = 600
interval = 200  # validation and checkpoint interval
embed_dims = 64
norm_cfg = dict(type='BN', requires_grad=True)

model = dict(
    type='SlimEncoderDecoder',  # mmseg's EncoderDecoder, lighter slide inference
    pretrained=None,
    data_preprocessor=dict(size=crop_size),
    backbone=dict(
        type='MiTAVisionTransformer',
        img_size=crop_size,
        patch_size=8,
        embed_dims=embed_dims,
        num_layers=4,
        num_heads=2,
        out_indices=(0, 1, 2, 3),
        mita_cfg=dict(pool_size=4, topk=32)),  # 16 experts of 32 keys over 256 tokens
    neck=dict(in_channels=[embed_dims] * 4, out_channels=embed_dims, scales=[2, 1, 0.5, 0.25]),
    decode_head=dict(
        in_channels=[embed_dims] * 4, channels=64, num_classes=150, norm_cfg=norm_cfg),
    auxiliary_head=dict(
        in_channels=embed_dims, channels=32, num_classes=150, norm_cfg=norm_cfg))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(512, 128), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(512, 128), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
train_dataloader = dict(
    batch_size=4,
    num_workers=2,
    dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=1,
    dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader

optim_wrapper = dict(optimizer=dict(lr=1e-3, weight_decay=0.01))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=50),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=50, end=max_iters, by_epoch=False)
]
train_cfg = dict(max_iters=max_iters, val_interval=interval)
default_hooks = dict(
    logger=dict(interval=20),
    checkpoint=dict(type='SafeCheckpointHook', interval=interval, max_keep_ckpts=2))
env_cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend='gloo'))
randomness = dict(seed=0)
