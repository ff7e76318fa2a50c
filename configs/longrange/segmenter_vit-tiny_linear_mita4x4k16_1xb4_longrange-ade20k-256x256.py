# The same model and schedule as segmenter_vit-tiny_linear_1xb4_longrange-ade20k-256x256.py
# trained from scratch with MiTA in every encoder layer at small experts, M = 4x4 landmarks
# and k = 16 keys each: the "train small, test large" model of the paper, to be evaluated at
# larger settings without retraining (tools/swap_sweep.py --pool-sizes 4 7 10 --topks 16 49).
_base_ = ['./segmenter_vit-tiny_linear_1xb4_longrange-ade20k-256x256.py']

model = dict(backbone=dict(type='MiTAVisionTransformer', mita_cfg=dict(pool_size=4, topk=16)))
