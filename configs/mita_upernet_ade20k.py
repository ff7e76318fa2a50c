# UperNet with a MiTA ViT-B/16 (multi-level neck), ADE20K 512x512, 160k iterations.
# mmseg's ViT-B UperNet with MiTA attention in all 12 encoder layers; ViT-B/DeiT-B
# pretrained weights load strictly (MiTA adds no parameters).
_base_ = ['mmseg::vit/vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py']
custom_imports = dict(imports=['mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)

model = dict(
    type='SlimEncoderDecoder',  # mmseg's EncoderDecoder, lighter slide inference
    backbone=dict(
        type='MiTAVisionTransformer',
        mita_cfg=dict(pool_size=7, topk=49),  # M = 7x7 experts of k = 49 keys
        mita_layers=None))  # all layers
# crash-safe saves, strict weights-only loads (mita_seg.engine), with any train/test tool
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))
