# BEiT-B UperNet, ADE20K 640x640, 160k iterations, with MiTA in all 12 encoder layers
# (BEiT's relative position bias inside MiTA; N = 1 + 40 x 40 = 1601 tokens). mmseg's
# BEiT-B checkpoints (pretrained and model zoo) load as they are: same keys.
_base_ = ['mmseg::beit/beit-base_upernet_8xb2-160k_ade20k-640x640.py']
custom_imports = dict(imports=['mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)

model = dict(
    type='SlimEncoderDecoder',  # mmseg's EncoderDecoder, lighter slide inference
    backbone=dict(type='MiTABEiT', mita_cfg=dict(pool_size=7, topk=49)))
# crash-safe saves, strict weights-only loads (mita_seg.engine), with any train/test tool
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))
