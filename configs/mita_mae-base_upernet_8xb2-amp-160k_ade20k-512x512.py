# MAE ViT-B UperNet, ADE20K 512x512, 160k iterations (AMP), with MiTA in all 12 encoder
# layers (the relative position bias inside MiTA; N = 1 + 32 x 32 = 1025 tokens). mmseg's
# MAE checkpoints load as they are: same keys. AMP: the base's `fp16 = dict(loss_scale=
# 'dynamic')`, which mmengine no longer reads, is what tools/train.py's --amp does here.
_base_ = ['mmseg::mae/mae-base_upernet_8xb2-amp-160k_ade20k-512x512.py']
custom_imports = dict(imports=['mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)

model = dict(
    type='SlimEncoderDecoder',  # mmseg's EncoderDecoder, lighter slide inference
    backbone=dict(type='MiTAMAE', mita_cfg=dict(pool_size=7, topk=49)))
# crash-safe saves, strict weights-only loads (mita_seg.engine), with any train/test tool
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))
