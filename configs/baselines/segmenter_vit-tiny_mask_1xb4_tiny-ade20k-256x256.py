# The standard-attention tiny Segmenter of segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py
# at 256x256: with patch 8 the grid is 32x32, so the backbone attends over N = 1025 tokens
# (1024 patches + cls) and the mask head over 1024 + 150 class tokens, the token count of
# Segmenter ViT-T on ADE20K at 512x512 with patch 16 (the paper's setting for the swap).
# Data: tools/dataset/make_tiny_ade20k.py --out data/ade/tiny_ade20k_256 --size 256.
# Used by tools/swap_study.py (`make swap-study`), which sets the schedule's length.
_base_ = ['./segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py']

data_root = 'data/ade/tiny_ade20k_256'
crop_size = (256, 256)

model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(img_size=crop_size))

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
train_dataloader = dict(dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
