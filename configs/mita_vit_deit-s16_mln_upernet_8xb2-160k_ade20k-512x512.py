# UperNet with a MiTA DeiT-S/16 (multi-level neck), ADE20K 512x512, 160k iterations.
_base_ = ['mmseg::vit/vit_deit-s16_mln_upernet_8xb2-160k_ade20k-512x512.py']
custom_imports = dict(imports=['mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)

model = dict(
    type='SlimEncoderDecoder',  # mmseg's EncoderDecoder, lighter slide inference
    backbone=dict(type='MiTAVisionTransformer', mita_cfg=dict(pool_size=7, topk=49)))
# crash-safe saves, strict weights-only loads (mita_seg.engine), with any train/test tool
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))
