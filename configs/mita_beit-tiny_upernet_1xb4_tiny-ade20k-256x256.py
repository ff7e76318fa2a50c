# A small MiTA BEiT UperNet for CPU runs on the synthetic tiny ADE20K at 256x256
# (tools/dataset/make_tiny_ade20k.py --out data/ade/tiny_ade20k_256 --size 256; the demo's
# data/ade/tiny_ade20k is 128x128), at the paper's token count: a 32x32 patch grid (patch 8)
# plus cls, N = 1025, with MiTA in every encoder layer (BEiT's relative position bias inside
# MiTA; 49 landmark experts of 49 keys, the published Segmenter setting at this N). mmseg's
# BEiT-B UperNet scaled down: the tiny Segmenter's ViT size (64-dim tokens, 4 layers, 2
# heads), a narrow UperNet and no auxiliary head (at 256x256 the full-resolution losses cost
# as much as the backbone), BN instead of SyncBN, a short schedule. BEiT's bias table fixes
# the grid: train and test on 256x256 crops (slide inference).
# configs/baselines/beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py is the same model with
# standard attention (a checkpoint to swap).
_base_ = ['mmseg::beit/beit-base_upernet_8xb2-160k_ade20k-640x640.py']
custom_imports = dict(imports=['mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)

data_root = 'data/ade/tiny_ade20k_256'
crop_size = (256, 256)
max_iters = 600
interval = 200  # validation and checkpoint interval
embed_dims = 64
norm_cfg = dict(type='BN', requires_grad=True)

model = dict(
    type='SlimEncoderDecoder',  # mmseg's EncoderDecoder, lighter slide inference
    pretrained=None,
    data_preprocessor=dict(size=crop_size),
    backbone=dict(
        type='MiTABEiT',
        mita_cfg=dict(pool_size=7, topk=49),
        img_size=crop_size,
        patch_size=8,
        embed_dims=embed_dims,
        num_layers=4,
        num_heads=2,
        out_indices=(0, 1, 2, 3),
        drop_path_rate=0.1),
    # patch 8: features at strides 4, 8, 16, 32 as BEiT-B's with patch 16 and [4, 2, 1, 0.5]
    neck=dict(embed_dim=embed_dims, rescales=[2, 1, 0.5, 0.25]),
    decode_head=dict(
        in_channels=[embed_dims] * 4, channels=32, num_classes=150, norm_cfg=norm_cfg),
    auxiliary_head=None,
    test_cfg=dict(mode='slide', crop_size=crop_size, stride=(171, 171)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(1024, 256), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(1024, 256), keep_ratio=True),
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

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01))
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
