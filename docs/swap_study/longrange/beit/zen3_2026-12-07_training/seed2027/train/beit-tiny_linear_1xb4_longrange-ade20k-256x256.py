crop_size = (
    256,
    256,
)
custom_imports = dict(
    allow_failed_imports=False,
    imports=[
        'mita_seg.models',
        'mita_seg.engine',
        'mita_seg.evaluation',
    ])
data_preprocessor = dict(
    _scope_='mmseg',
    bgr_to_rgb=True,
    mean=[
        123.675,
        116.28,
        103.53,
    ],
    pad_val=0,
    seg_pad_val=255,
    size=(
        512,
        512,
    ),
    std=[
        58.395,
        57.12,
        57.375,
    ],
    type='SegDataPreProcessor')
data_root = 'data/ade/longrange_ade20k'
dataset_type = 'ADE20KDataset'
decay = 300
default_hooks = dict(
    checkpoint=dict(
        _scope_='mmseg',
        by_epoch=False,
        interval=400,
        max_keep_ckpts=2,
        type='SafeCheckpointHook'),
    logger=dict(
        _scope_='mmseg',
        interval=20,
        log_metric_by_epoch=False,
        type='LoggerHook'),
    param_scheduler=dict(_scope_='mmseg', type='ParamSchedulerHook'),
    sampler_seed=dict(_scope_='mmseg', type='DistSamplerSeedHook'),
    timer=dict(_scope_='mmseg', type='IterTimerHook'),
    visualization=dict(_scope_='mmseg', type='SegVisualizationHook'))
default_scope = 'mmseg'
dense_attn = 'fast'
embed_dims = 64
env_cfg = dict(
    cudnn_benchmark=False,
    dist_cfg=dict(backend='gloo'),
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0))
img_ratios = [
    0.5,
    0.75,
    1.0,
    1.25,
    1.5,
    1.75,
]
interval = 400
launcher = 'none'
load_from = None
log_level = 'INFO'
log_processor = dict(by_epoch=False)
max_iters = 2400
model = dict(
    _scope_='mmseg',
    auxiliary_head=None,
    backbone=dict(
        act_cfg=dict(type='GELU'),
        attn_drop_rate=0.0,
        drop_path_rate=0.1,
        embed_dims=64,
        img_size=(
            256,
            256,
        ),
        in_channels=3,
        init_values=0.1,
        mlp_ratio=4,
        norm_cfg=dict(eps=1e-06, type='LN'),
        norm_eval=False,
        num_heads=2,
        num_layers=4,
        out_indices=(3, ),
        patch_size=8,
        qv_bias=True,
        type='BEiT'),
    data_preprocessor=dict(
        bgr_to_rgb=True,
        mean=[
            123.675,
            116.28,
            103.53,
        ],
        pad_val=0,
        seg_pad_val=255,
        size=(
            256,
            256,
        ),
        std=[
            58.395,
            57.12,
            57.375,
        ],
        type='SegDataPreProcessor'),
    decode_head=dict(
        channels=64,
        dropout_ratio=0.0,
        embed_dims=64,
        in_channels=64,
        loss_decode=dict(
            loss_weight=1.0, type='CrossEntropyLoss', use_sigmoid=False),
        num_classes=150,
        num_heads=2,
        num_layers=0,
        type='SegmenterMaskTransformerHead'),
    dense_attn='fast',
    neck=None,
    pretrained=None,
    test_cfg=dict(mode='whole'),
    train_cfg=dict(),
    type='SlimEncoderDecoder')
norm_cfg = dict(_scope_='mmseg', requires_grad=True, type='BN')
optim_wrapper = dict(
    _scope_='mmseg',
    optimizer=dict(
        betas=(
            0.9,
            0.999,
        ), lr=0.001, type='AdamW', weight_decay=0.01),
    paramwise_cfg=dict(
        custom_keys=dict(
            cls_token=dict(decay_mult=0.0),
            norm=dict(decay_mult=0.0),
            pos_embed=dict(decay_mult=0.0))),
    type='OptimWrapper')
optimizer = dict(
    _scope_='mmseg', lr=0.01, momentum=0.9, type='SGD', weight_decay=0.0005)
param_scheduler = [
    dict(begin=0, by_epoch=False, end=50, start_factor=0.001, type='LinearLR'),
    dict(
        begin=2100,
        by_epoch=False,
        end=2400,
        eta_min=0.0,
        power=1.0,
        type='PolyLR'),
]
randomness = dict(seed=2027)
resume = False
test_cfg = dict(_scope_='mmseg', type='TestLoop')
test_dataloader = dict(
    batch_size=1,
    dataset=dict(
        _scope_='mmseg',
        data_prefix=dict(
            img_path='images/validation',
            seg_map_path='annotations/validation'),
        data_root='data/ade/longrange_ade20k',
        pipeline=[
            dict(type='LoadImageFromFile'),
            dict(reduce_zero_label=True, type='LoadAnnotations'),
            dict(type='PackSegInputs'),
        ],
        type='ADE20KDataset'),
    num_workers=0,
    persistent_workers=False,
    sampler=dict(_scope_='mmseg', shuffle=False, type='DefaultSampler'))
test_evaluator = [
    dict(iou_metrics=[
        'mIoU',
    ], type='LabelledIoUMetric'),
    dict(type='EvidenceAccuracyMetric'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(reduce_zero_label=True, type='LoadAnnotations'),
    dict(type='PackSegInputs'),
]
train_cfg = dict(
    _scope_='mmseg',
    max_iters=2400,
    type='IterBasedTrainLoop',
    val_interval=400)
train_dataloader = dict(
    batch_size=4,
    dataset=dict(
        _scope_='mmseg',
        data_prefix=dict(
            img_path='images/training', seg_map_path='annotations/training'),
        data_root='data/ade/longrange_ade20k',
        pipeline=[
            dict(type='LoadImageFromFile'),
            dict(reduce_zero_label=True, type='LoadAnnotations'),
            dict(prob=0.5, type='RandomFlip'),
            dict(type='PackSegInputs'),
        ],
        type='ADE20KDataset'),
    num_workers=0,
    persistent_workers=False,
    sampler=dict(_scope_='mmseg', shuffle=True, type='InfiniteSampler'))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(reduce_zero_label=True, type='LoadAnnotations'),
    dict(prob=0.5, type='RandomFlip'),
    dict(type='PackSegInputs'),
]
tta_model = dict(_scope_='mmseg', type='SegTTAModel')
tta_pipeline = [
    dict(_scope_='mmseg', backend_args=None, type='LoadImageFromFile'),
    dict(
        _scope_='mmseg',
        transforms=[
            [
                dict(keep_ratio=True, scale_factor=0.5, type='Resize'),
                dict(keep_ratio=True, scale_factor=0.75, type='Resize'),
                dict(keep_ratio=True, scale_factor=1.0, type='Resize'),
                dict(keep_ratio=True, scale_factor=1.25, type='Resize'),
                dict(keep_ratio=True, scale_factor=1.5, type='Resize'),
                dict(keep_ratio=True, scale_factor=1.75, type='Resize'),
            ],
            [
                dict(direction='horizontal', prob=0.0, type='RandomFlip'),
                dict(direction='horizontal', prob=1.0, type='RandomFlip'),
            ],
            [
                dict(type='LoadAnnotations'),
            ],
            [
                dict(type='PackSegInputs'),
            ],
        ],
        type='TestTimeAug'),
]
val_cfg = dict(_scope_='mmseg', type='ValLoop')
val_dataloader = dict(
    batch_size=1,
    dataset=dict(
        _scope_='mmseg',
        data_prefix=dict(
            img_path='images/validation',
            seg_map_path='annotations/validation'),
        data_root='data/ade/longrange_ade20k',
        pipeline=[
            dict(type='LoadImageFromFile'),
            dict(reduce_zero_label=True, type='LoadAnnotations'),
            dict(type='PackSegInputs'),
        ],
        type='ADE20KDataset'),
    num_workers=0,
    persistent_workers=False,
    sampler=dict(_scope_='mmseg', shuffle=False, type='DefaultSampler'))
val_evaluator = [
    dict(iou_metrics=[
        'mIoU',
    ], type='LabelledIoUMetric'),
    dict(type='EvidenceAccuracyMetric'),
]
vis_backends = [
    dict(_scope_='mmseg', type='LocalVisBackend'),
]
visualizer = dict(
    _scope_='mmseg',
    name='visualizer',
    type='SegLocalVisualizer',
    vis_backends=[
        dict(type='LocalVisBackend'),
    ])
work_dir = 'work_dirs/swap_study_longrange_beit/beit/seed2027/train'
