# The same model and schedule as segmenter_vit-tiny_linear_1xb4_longrange-ade20k-256x256.py
# with the encoder's attention restricted to a 3x3 window of patches around each token
# (window:3, mita_seg.ops.window_attention; 4 layers reach 4 patches, 32 pixels, away): the
# "local window" control of the long-range benchmark, trained from scratch.
_base_ = ['./segmenter_vit-tiny_linear_1xb4_longrange-ade20k-256x256.py']

model = dict(backbone=dict(type='MiTAVisionTransformer', mita_cfg=dict(kind='window', window=3)))
