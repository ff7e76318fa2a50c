"""A MiTA config + checkpoint pair from a standard-attention one (``tools/export_swapped.py``).

The written config is the original one (all bases merged) with the ``VisionTransformer``
backbone switched to ``MiTAVisionTransformer`` (``mita_cfg``, ``mita_layers``), a ``BEiT`` or
``MAE`` backbone to ``MiTABEiT`` / ``MiTAMAE``, Segmenter's mask head left on mmseg's
``SegmenterMaskTransformerHead`` (the paper's swap, the encoder only) unless
``include_head=True`` switches it to ``MiTASegmenterMaskTransformerHead``, ``mita_seg.models``
and ``mita_seg.engine`` in ``custom_imports``, the crash-safe checkpoint hook, pretrained
initialisation removed, an ``EncoderDecoder`` on ``SlimEncoderDecoder`` (mmseg's results,
lighter slide inference; not with ``slim_inference=False``) and ``load_from`` pointing at
the written checkpoint; its first lines say what is on MiTA and what is not. MiTA adds no
parameters, so the checkpoint holds the very same ``state_dict``. Both models are built and
the checkpoint is loaded into each strictly before anything is written.

A swap plan (``mita_cfg={'plan': SwapPlan}``, ``--mita-plan``) is carried by the config as
``mita_layer_cfgs`` of the backbone and the head (one entry per layer, None for standard
attention), and in the checkpoint's ``meta['mita_plan']``.
"""
import copy
import io
import os
import os.path as osp
from typing import Optional, Sequence, Tuple, Union

import torch
from mmengine.config import Config

from mita_seg.engine import use_safe_checkpoint
from mita_seg.utils.atomic_files import atomic_write_bytes, atomic_write_text
from mita_seg.models import (SETTING_KEYS, MiTASetting, NothingToSwapError, PlanError, SwapPlan,
                             check_plan_fits, current_plan)
from mita_seg.utils import CheckpointMismatchError, load_local_checkpoint
from mita_seg.utils.cfg_options import add_custom_imports
from .config import config_name, load_config, use_slim_inference
from .mita_cfg import as_mita_cfg
from .model import init_model

# backbone type -> its MiTA version
MITA_BACKBONES = {
    **{t: 'MiTAVisionTransformer'
       for t in ('VisionTransformer', 'mmseg.VisionTransformer', 'MiTAVisionTransformer')},
    **{t: 'MiTABEiT' for t in ('BEiT', 'mmseg.BEiT', 'MiTABEiT')},
    **{t: 'MiTAMAE' for t in ('MAE', 'mmseg.MAE', 'MiTAMAE')},
}
HEAD_TYPES = ('SegmenterMaskTransformerHead', 'mmseg.SegmenterMaskTransformerHead',
              'MiTASegmenterMaskTransformerHead')


def mita_config(cfg: Config, mita_cfg: Union[dict, str, MiTASetting, None]) -> Config:
    """The MiTA version of ``cfg`` (a copy).

    Args:
        cfg (Config): the standard-attention config.
        mita_cfg (dict | str | MiTASetting, optional): ``--mita-cfg`` (settings, ``layers``,
            ``include_head``; the whole setting as ``setting``, a
            :class:`~mita_seg.setting.MiTASetting` or its text), a whole setting
            (``'7:49'``), None (MiTA's defaults), or ``{'plan': SwapPlan}``
            (``--mita-plan``; checked against the model by :func:`export_swapped`).

    Raises:
        NothingToSwapError: the backbone is not mmseg's ``VisionTransformer`` family,
            ``BEiT`` or ``MAE``.
        PlanError: a plan with layers outside the backbone and the decode head.
        MiTASettingError: a setting that is not one.
    """
    cfg = copy.deepcopy(cfg)
    mita_cfg = as_mita_cfg(mita_cfg)
    plan = mita_cfg.get('plan')
    if plan is not None:
        return _plan_config(cfg, plan)
    setting = mita_cfg.get('setting')  # a whole setting (--swap-attn 7:49, agent:7...)

    def over(old: dict) -> dict:
        """A MiTA config's ``mita_cfg`` with the swap's settings: a whole setting replaces
        its setting keys (a key of another kind would be refused), single keys go over
        them; the rest (``with_dwc``) stays."""
        if setting is not None:
            return {**{k: v for k, v in old.items() if k not in SETTING_KEYS},
                    **setting.cfg()}
        return {**old, **{k: v for k, v in mita_cfg.items() if k in SETTING_KEYS}}

    backbone = _mita_backbone(cfg)
    backbone.mita_cfg = over(backbone.get('mita_cfg', {}))
    layers = mita_cfg.get('layers')
    backbone.mita_layers = list(layers) if layers is not None else None
    head = cfg.model.decode_head
    if (mita_cfg.get('include_head', False) and isinstance(head, dict)
            and head.get('type') in HEAD_TYPES):
        head.type = 'MiTASegmenterMaskTransformerHead'
        head.mita_cfg = over(head.get('mita_cfg', {}))
    return _finish(cfg)


def _mita_backbone(cfg: Config) -> dict:
    """The config's backbone, switched to its MiTA type (in place)."""
    backbone = cfg.model.backbone
    if backbone.type not in MITA_BACKBONES:
        raise NothingToSwapError(
            f'export_swapped needs a VisionTransformer backbone (ViT, DeiT, Segmenter, SETR, '
            f'DPT configs) or a BEiT/MAE one; this config has {backbone.type!r}, whose '
            'attention MiTA cannot replace')
    backbone.type = MITA_BACKBONES[backbone.type]
    backbone.init_cfg = None         # the weights come from load_from
    backbone.pop('pretrained', None)
    cfg.model.pretrained = None
    return backbone


def _plan_config(cfg: Config, plan: SwapPlan, with_dwc: Sequence[str] = ()) -> Config:
    """:func:`mita_config` of a plan: per-layer ``mita_layer_cfgs`` of backbone and head;
    the layers named in ``with_dwc`` keep a DWC branch (``with_dwc=True``)."""
    owners = plan.owners()
    other = [o for o in owners if o not in ('backbone', 'decode_head')]
    if other:
        raise PlanError(f'{plan.what} has layers under {other[0]}: an exported config can '
                        'carry plans over the backbone and the decode head only')
    backbone = _mita_backbone(cfg)
    for key in ('mita_layers', 'mita_cfg'):
        backbone.pop(key, None)
    ids = [int(n.split('.')[-2]) for n in plan.layers if n.startswith('backbone.')]
    backbone.mita_layer_cfgs = plan.owner_settings('backbone', max(ids) + 1 if ids else 0)
    for i, layer_cfg in enumerate(backbone.mita_layer_cfgs):
        if f'backbone.layers.{i}.attn' in with_dwc:
            layer_cfg['with_dwc'] = True
    head = cfg.model.decode_head
    if 'decode_head' in owners:
        if not (isinstance(head, dict) and head.get('type') in HEAD_TYPES):
            raise PlanError(f'{plan.what} has decode_head layers, but the config\'s decode '
                            'head is not a Segmenter mask head')
        head.type = 'MiTASegmenterMaskTransformerHead'
        head.pop('mita_cfg', None)
        ids = [int(n.split('.')[-2]) for n in plan.layers if n.startswith('decode_head.')]
        head.mita_layer_cfgs = plan.owner_settings('decode_head', max(ids) + 1)
    return _finish(cfg)


def _finish(cfg: Config) -> Config:
    """``custom_imports`` of mita_seg and the crash-safe checkpoint hook."""
    add_custom_imports(cfg, 'mita_seg.models', 'mita_seg.engine')
    use_safe_checkpoint(cfg)
    return use_slim_inference(cfg)


def export_swapped(config: str, checkpoint: str, out_dir: str,
                   mita_cfg: Union[dict, str, MiTASetting, None],
                   cfg_options: Optional[dict] = None) -> Tuple[str, str]:
    """Write ``OUT_DIR/<config>_mita.py`` and ``OUT_DIR/<checkpoint>_mita.pth``, each
    atomically (the old file or the new one, never half; the user's umask).

    Args:
        config (str): config of the standard-attention model (file or ``mmseg::``).
        checkpoint (str): its checkpoint.
        out_dir (str): where to write the pair.
        mita_cfg (dict | str | MiTASetting, optional): ``--mita-cfg`` (checked by
            :func:`~mita_seg.apis.check_mita_cfg`), a whole setting (``'7:49'``), None
            (MiTA's defaults), or ``{'plan': SwapPlan}`` (``--mita-plan``).
        cfg_options (dict, optional): ``--cfg-options``.

    Returns:
        tuple[str, str]: the config and checkpoint paths.

    Raises:
        CheckpointMismatchError: the checkpoint does not fit the original or the MiTA model.
        PlanError: the plan does not fit the model.
    """
    config, checkpoint = os.fspath(config), os.fspath(checkpoint)
    mita_cfg = as_mita_cfg(mita_cfg)
    cfg = load_config(config, cfg_options)
    plan = mita_cfg.get('plan')
    new_cfg = mita_config(cfg, mita_cfg)    # first: a config MiTA cannot take says so
    base = init_model(copy.deepcopy(cfg), checkpoint)  # strict
    exported = None
    if plan is not None:
        check_plan_fits(plan, base, config_name(config), config)
    else:
        # the exported model must run what `tools/test.py --mita-cfg` evaluates: where the
        # config's own settings make the two differ (a config that holds a plan, layers of
        # a MiTA config not swapped by it), the config carries the swapped model's plan
        swapped = init_model(copy.deepcopy(cfg), checkpoint, mita_cfg=dict(mita_cfg))
        want = current_plan(swapped)
        try:
            exported = init_model(copy.deepcopy(new_cfg), checkpoint)  # strict
        except CheckpointMismatchError:   # e.g. the DWC weights of a layer it leaves dense
            pass
        if exported is None or current_plan(exported).layers != want.layers:
            dwc = [n for n in want.layers if getattr(swapped.get_submodule(n), 'dwc', None)
                   is not None]
            plan, new_cfg = want, _plan_config(copy.deepcopy(cfg), want, dwc)
            exported = None
    if exported is None:
        exported = init_model(copy.deepcopy(new_cfg), checkpoint)  # strict
    models = [base, exported]
    meta = load_local_checkpoint(checkpoint, map_location='cpu').get('meta') or {}
    os.makedirs(out_dir, exist_ok=True)
    out_cfg = osp.join(out_dir, config_name(config) + '_mita.py')
    out_ckpt = osp.abspath(osp.join(
        out_dir, osp.splitext(osp.basename(checkpoint))[0] + '_mita.pth'))
    new_cfg.load_from = out_ckpt
    keep = {k: v for k, v in meta.items()
            if k in ('dataset_meta', 'CLASSES', 'PALETTE')
            or isinstance(v, (str, int, float, bool))}
    if plan is None:
        keep.update(mita_cfg=dict(new_cfg.model.backbone.mita_cfg),
                    mita_layers=new_cfg.model.backbone.mita_layers)
    else:
        keep.update(mita_plan=plan.to_dict())
    keep.update(exported_from=dict(config=str(config), checkpoint=str(checkpoint)))
    text = swap_comment(new_cfg, config) + new_cfg.pretty_text  # what Config.dump writes
    buffer = io.BytesIO()      # not saved to a temporary name: the archive would carry it
    torch.save({'meta': keep, 'state_dict': models[1].state_dict()}, buffer)
    atomic_write_bytes(buffer.getvalue(), out_ckpt)
    atomic_write_text(text, out_cfg)
    return out_cfg, out_ckpt


def _kinds(cfgs) -> str:
    """The kinds of attention of settings dicts (None: dense), by name: ``MiTA``,
    ``MiTA, agent``."""
    names = [MiTASetting.from_cfg({k: v for k, v in c.items() if k in SETTING_KEYS}).swap_name
             for c in cfgs if c is not None]
    return ', '.join(dict.fromkeys(names)) or 'MiTA'


def swap_comment(cfg: Config, source: str) -> str:
    """The comment lines that open an exported config: what is swapped, to which kind of
    attention (``MiTA``, ``agent``...), and what is not."""
    backbone, head = cfg.model.backbone, cfg.model.get('decode_head')
    if backbone.get('mita_layer_cfgs') is not None:
        dense = sum(c is None for c in backbone.mita_layer_cfgs)
        what = (f'{_kinds(backbone.mita_layer_cfgs)} per layer (a swap plan) in the backbone '
                f'({backbone.type}; {dense} of {len(backbone.mita_layer_cfgs)} layers dense)')
    else:
        layers = backbone.get('mita_layers')
        mita_cfg = backbone.get('mita_cfg', {})
        settings = ', '.join(f'{k}={v}' for k, v in mita_cfg.items())
        what = (f'{_kinds([mita_cfg])} in '
                f'{"all" if layers is None else f"layers {list(layers)} of"} the '
                f'backbone\'s attention layers ({backbone.type}'
                f'{"; " + settings if settings else ""})')
    lines = [f'MiTA version of {source} (tools/export_swapped.py): {what}']
    if isinstance(head, dict) and head.get('type') in HEAD_TYPES:
        if head.get('mita_layer_cfgs') is not None:
            dense = sum(c is None for c in head.mita_layer_cfgs)
            lines.append(f'Segmenter mask head per layer (the swap plan; {dense} of '
                         f'{len(head.mita_layer_cfgs)} layers dense)')
        else:
            lines.append(
                'Segmenter mask head on MiTA too (include_head=True)'
                if head.type == 'MiTASegmenterMaskTransformerHead' else
                'Segmenter mask head on standard attention (the paper\'s swap: the encoder '
                'only; --mita-cfg include_head=True swaps it)')
    return ''.join(f'# {line}\n' for line in lines)
