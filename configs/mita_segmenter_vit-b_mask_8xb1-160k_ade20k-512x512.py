# Segmenter ViT-B mask transformer, ADE20K 512x512, 160k: MiTA in all encoder layers, as
# the paper (and the authors' Segmenter code) puts it; the mask head stays mmseg's, on
# standard attention: its 150 class tokens, routed like patches, would each read one expert
# and lose the whole image (docs/swap.md).
_base_ = ['mmseg::segmenter/segmenter_vit-b_mask_8xb1-160k_ade20k-512x512.py']
custom_imports = dict(imports=['mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)

mita_cfg = dict(pool_size=7, topk=49)
model = dict(
    type='SlimEncoderDecoder',  # mmseg's EncoderDecoder, lighter slide inference
    backbone=dict(type='MiTAVisionTransformer', mita_cfg=mita_cfg))
# crash-safe saves, strict weights-only loads (mita_seg.engine), with any train/test tool
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))
