"""Stage 5 of the study: which tokens the routed experts select at one setting (the paper's
M = k = 49 by default) on a few validation images (:mod:`mita_seg.analysis.token_selection`):
a map per image and, per layer, the share of tokens no routed expert selects or reads. The
MiTA-trained models are mapped the same way (:mod:`.native`)."""
import copy
import os
import os.path as osp
from typing import List, Optional, Sequence

from mmengine.config import Config, ConfigDict

from mita_seg.apis import init_model, load_config, mita_config
from mita_seg.setting import MiTASetting
from .model_study import ModelStudy

__all__ = ['validation_images', 'selection_maps', 'model_maps', 'run']


def validation_images(cfg: Config, count: int) -> List[str]:
    """The first ``count`` images (sorted) of the config's test set."""
    ds = cfg.test_dataloader.dataset
    folder = osp.join(ds.data_root, ds.get('data_prefix', {}).get('img_path', ''))
    names = sorted(n for n in os.listdir(folder)
                   if n.lower().endswith(('.jpg', '.jpeg', '.png')))
    return [osp.join(folder, n) for n in names[:count]]


def selection_maps(cfg: Config, checkpoint: str, setting: MiTASetting, images: Sequence[str],
                   fig_dir: str, name: str, how: str = 'swapped without retraining') -> dict:
    """Token-selection maps of the checkpoint on MiTA at ``setting`` (a standard-attention
    one swapped, or a MiTA one set to it): one PNG per image in ``fig_dir`` and the per-layer
    fractions of tokens that no routed expert selects / reads, averaged over ``images``."""
    from mita_seg.analysis.token_selection import plot_selection_overlay, record_image
    model = init_model(copy.deepcopy(cfg), checkpoint, mita_cfg=setting.cfg())
    model.test_cfg = ConfigDict(mode='whole')  # one grid per image, aligned with the input
    patch = model.cfg.model.backbone.get('patch_size', None)
    figures, never_sel, never_used, layers = [], {}, {}, {}
    for path in images:
        records, image = record_image(model, path)
        stem = osp.splitext(osp.basename(path))[0]
        figures.append(plot_selection_overlay(
            image, records, osp.join(fig_dir, f'{name}_token_selection_{stem}.png'),
            cell_size=(patch, patch) if patch else None,
            title=f'{name}, {stem}: tokens selected by MiTA routed experts ({setting.label}, '
            f'{how})'))
        for r in records:
            never_sel.setdefault(r.name, []).append(r.frac_never_selected)
            never_used.setdefault(r.name, []).append(r.frac_never_used)
            layers[r.name] = dict(grid=list(r.hw_shape), M=r.num_experts, topk=r.topk,
                                  tokens=int(r.selected.shape[-1]))
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return dict(setting=setting.text, label=setting.label, how=how, images=list(images),
                figures=figures,
                layers={k: dict(v, never_selected=mean(never_sel[k]),
                                never_used=mean(never_used[k])) for k, v in layers.items()})


def model_maps(study: ModelStudy, checkpoint: str, setting: MiTASetting, name: str,
               mita_cfg: Optional[dict] = None, **how) -> dict:
    """:func:`selection_maps` of ``checkpoint`` (a MiTA-trained one: ``mita_cfg``) on the
    study's first validation images."""
    cfg = load_config(study.config, study.opts)
    if mita_cfg:
        cfg = mita_config(cfg, mita_cfg)
    return selection_maps(cfg, checkpoint, setting,
                          validation_images(cfg, study.s.selection_images), study.fig_dir,
                          name, **how)


def run(study: ModelStudy) -> None:
    """The token-selection maps of the swap at ``settings.selection``."""
    s = study.s
    sel = study.stage(f'token selection at {s.selection.label} on '
                      f'{s.selection_images} validation image(s)',
                      lambda: model_maps(study, study.ckpt, s.selection, study.files))
    if sel is not None:
        study.result['selection'] = sel
