# The tiny BEiT UperNet of configs/baselines/ with MiTA in every encoder layer (BEiT's
# relative position bias inside MiTA): 49 landmark experts of 49 keys over N = 1025 tokens,
# the published Segmenter setting at the same token count. Checkpoints of the baseline load
# into it as they are (same keys).
_base_ = ['./baselines/beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py']

model = dict(backbone=dict(type='MiTABEiT', mita_cfg=dict(pool_size=7, topk=49)))
