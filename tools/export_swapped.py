"""Export a MiTA config + checkpoint pair from a standard-attention one.

The written config is the original one (all bases merged) with the ``VisionTransformer``
backbone switched to ``MiTAVisionTransformer`` (``mita_cfg``, ``mita_layers``) and Segmenter's
``SegmenterMaskTransformerHead`` to ``MiTASegmenterMaskTransformerHead``, ``mita_seg.models``
added to ``custom_imports``, pretrained-weight initialisation removed and ``load_from``
pointing at the written checkpoint. MiTA adds no parameters, so the checkpoint holds the very
same ``state_dict`` (keys and values unchanged; optimizer state and run history dropped). Both
models are built and the state dict is loaded with ``strict=True`` before anything is
written. ``tools/test.py OUT_CONFIG OUT_CKPT`` evaluates the pair; ``tools/train.py OUT_CONFIG``
fine-tunes from it.

Usage::

    python tools/export_swapped.py CONFIG CHECKPOINT --out-dir DIR
        [--mita-cfg pool_size=7 topk=49 router_topk=1 with_shared_expert=True]
        [--layers 0 1 ...] [--no-head] [--cfg-options key=value ...]
"""
import argparse
import copy
import os
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch  # noqa: E402
from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.runner.checkpoint import _load_checkpoint  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

import mita_seg.models  # noqa: E402,F401  (registers MiTA modules)

VIT_TYPES = ('VisionTransformer', 'mmseg.VisionTransformer', 'MiTAVisionTransformer')
HEAD_TYPES = ('SegmenterMaskTransformerHead', 'mmseg.SegmenterMaskTransformerHead',
              'MiTASegmenterMaskTransformerHead')
MITA_KEYS = ('pool_size', 'topk', 'router_topk', 'with_shared_expert', 'shared_scale')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Write a MiTA config + checkpoint pair')
    parser.add_argument('config', help='config of the standard-attention model')
    parser.add_argument('checkpoint', help='its checkpoint')
    parser.add_argument('--out-dir', required=True, help='where to write the pair')
    parser.add_argument('--mita-cfg', nargs='+', action=DictAction, default={},
                        help=f'MiTA settings ({", ".join(MITA_KEYS)}), key=value')
    parser.add_argument('--layers', type=int, nargs='+', default=None,
                        help='backbone layers on MiTA (default: all)')
    parser.add_argument('--no-head', action='store_true',
                        help="keep standard attention in Segmenter's mask head")
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings before exporting, key=value')
    return parser.parse_args(argv)


def mita_config(cfg: Config, mita_cfg: dict, layers=None, include_head: bool = True) -> Config:
    """The MiTA version of ``cfg`` (a copy).

    Raises:
        ValueError: the backbone is not mmseg's ``VisionTransformer`` family, or
            ``mita_cfg`` has an unknown or parameter-adding key.
    """
    bad = sorted(set(mita_cfg) - set(MITA_KEYS))
    if bad:
        extra = (' (with_dwc adds parameters the checkpoint does not have: train with '
                 'a MiTA config instead)' if 'with_dwc' in bad else '')
        raise ValueError(f'unknown --mita-cfg keys {bad}{extra}; allowed: {list(MITA_KEYS)}')
    cfg = copy.deepcopy(cfg)
    backbone = cfg.model.backbone
    if backbone.type not in VIT_TYPES:
        raise ValueError(f'export_swapped needs a VisionTransformer backbone (ViT, DeiT, '
                         f'Segmenter, SETR, DPT configs); this config has '
                         f'{backbone.type!r}, whose attention MiTA cannot replace')
    backbone.type = 'MiTAVisionTransformer'
    backbone.mita_cfg = dict(mita_cfg)
    backbone.mita_layers = list(layers) if layers is not None else None
    backbone.init_cfg = None         # the weights come from load_from
    backbone.pop('pretrained', None)
    cfg.model.pretrained = None
    head = cfg.model.decode_head
    if include_head and isinstance(head, dict) and head.get('type') in HEAD_TYPES:
        head.type = 'MiTASegmenterMaskTransformerHead'
        head.mita_cfg = dict(mita_cfg)
    imports = list(cfg.get('custom_imports', {}).get('imports', []))
    if 'mita_seg.models' not in imports:
        imports.append('mita_seg.models')
    cfg.custom_imports = dict(imports=imports, allow_failed_imports=False)
    return cfg


def load_state_dict(checkpoint: str):
    """``(state_dict, meta)`` of a checkpoint, loaded with torch's safe unpickler."""
    ckpt = _load_checkpoint(checkpoint, map_location='cpu')
    state_dict = ckpt.get('state_dict', ckpt)
    state_dict = {k[7:] if k.startswith('module.') else k: v for k, v in state_dict.items()}
    meta = ckpt.get('meta', {}) if isinstance(ckpt.get('meta'), dict) else {}
    return state_dict, meta


def export(config: str, checkpoint: str, out_dir: str, mita_cfg: dict, layers=None,
           include_head: bool = True, cfg_options: dict = None):
    """Write ``OUT_DIR/<config>_mita.py`` and ``OUT_DIR/<checkpoint>_mita.pth``.

    Returns:
        tuple[str, str]: the config and checkpoint paths.
    """
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    new_cfg = mita_config(cfg, mita_cfg, layers, include_head)
    state_dict, meta = load_state_dict(checkpoint)

    # Both models must take the state dict as it is.
    for c, what in ((cfg, 'original'), (new_cfg, 'MiTA')):
        model_cfg = copy.deepcopy(c.model)
        model_cfg.pretrained = None
        model_cfg.backbone.init_cfg = None
        model = MODELS.build(model_cfg)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f'{checkpoint} does not match the {what} model of {config}: '
                             f'missing keys {missing[:5]}, unexpected keys {unexpected[:5]}')

    os.makedirs(out_dir, exist_ok=True)
    out_cfg = osp.join(out_dir, osp.splitext(osp.basename(config))[0] + '_mita.py')
    out_ckpt = osp.abspath(osp.join(
        out_dir, osp.splitext(osp.basename(checkpoint))[0] + '_mita.pth'))
    new_cfg.load_from = out_ckpt
    keep = {k: v for k, v in meta.items()
            if k in ('dataset_meta', 'CLASSES', 'PALETTE')
            or isinstance(v, (str, int, float, bool))}
    keep.update(mita_cfg=dict(mita_cfg), mita_layers=new_cfg.model.backbone.mita_layers,
                exported_from=dict(config=str(config), checkpoint=str(checkpoint)))
    torch.save({'meta': keep, 'state_dict': state_dict}, out_ckpt)
    new_cfg.dump(out_cfg)
    return out_cfg, out_ckpt


def main(argv=None):
    args = parse_args(argv)
    out_cfg, out_ckpt = export(args.config, args.checkpoint, args.out_dir, args.mita_cfg,
                               args.layers, not args.no_head, args.cfg_options)
    print(f'wrote {out_cfg}\nwrote {out_ckpt}\n'
          f'evaluate: python tools/test.py {out_cfg} {out_ckpt}\n'
          f'fine-tune: python tools/train.py {out_cfg}')


if __name__ == '__main__':
    main()
