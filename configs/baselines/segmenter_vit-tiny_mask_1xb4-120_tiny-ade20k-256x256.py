# The tiny standard-attention Segmenter of segmenter_vit-tiny_mask_1xb4_tiny-ade20k-256x256.py
# (N = 1025 tokens in the backbone, 1024 + 150 class tokens in the mask head) with the swap
# study's schedule written out: 120 iterations of batch 4, linear warm-up over 24, poly decay,
# no validation loop, and a seed of its own (2027; the study's seeds are its settings'). What
# issue 32's check trains: `tools/train.py` this config, then `tools/test.py` it unswapped,
# with `--swap-attn mita` (the encoder, the paper's swap) and with `--mita-cfg
# include_head=True` (the mask head too, its class tokens global). Other seeds:
# `--cfg-options randomness.seed=2028`.
_base_ = ['./segmenter_vit-tiny_mask_1xb4_tiny-ade20k-256x256.py']

iters = 120
warmup = 24
train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=iters)
val_cfg = None
val_dataloader = None
val_evaluator = None
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=warmup),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=warmup, end=iters, by_epoch=False)
]
default_hooks = dict(checkpoint=dict(interval=iters), logger=dict(interval=20))
train_dataloader = dict(num_workers=0, persistent_workers=False)
test_dataloader = dict(num_workers=0, persistent_workers=False)
randomness = dict(seed=2027)
