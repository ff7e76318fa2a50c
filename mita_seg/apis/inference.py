"""Segment images: mmseg's ``inference_model`` on :func:`~mita_seg.apis.init_model`'s
models, and :class:`MiTASegInferencer`, mmseg's ``MMSegInferencer`` with strict
weights-only loading and an optional swap to MiTA."""
from typing import Optional, Union

import numpy as np
import torch.nn as nn
from mmseg.apis import MMSegInferencer, inference_model, show_result_pyplot

from mita_seg.models import check_dense_attn, guard_grids
from mita_seg.setting import MiTASetting
from mita_seg.utils.checkpoint import check_checkpoint_keys
from .config import use_dense_attn, use_slim_inference
from .model import dataset_meta, swap_model

__all__ = ['inference_model', 'show_result_pyplot', 'MiTASegInferencer', 'draw_title']


def draw_title(image: np.ndarray, title: str) -> np.ndarray:
    """``image`` (``H x W x 3``, uint8) with ``title`` in a white band above it, in black,
    wrapped to the image's width (the whole title, on as many lines as it needs)."""
    import cv2
    h, w = image.shape[:2]
    font, scale = cv2.FONT_HERSHEY_SIMPLEX, max(0.35, min(1.0, w / 800))
    thick = 1 if scale < 0.8 else 2

    def width(text):
        return cv2.getTextSize(text, font, scale, thick)[0][0]

    lines = []
    for word in title.split():
        while width(word) > w - 8 and len(word) > 1:   # a word wider than the image
            cut = max(i for i in range(1, len(word) + 1) if width(word[:i]) <= w - 8 or i == 1)
            lines.append(word[:cut])
            word = word[cut:]
        if lines and width(lines[-1] + ' ' + word) <= w - 8:
            lines[-1] += ' ' + word
        else:
            lines.append(word)
    (_, ch), base = cv2.getTextSize('Xg', font, scale, thick)
    step = ch + base + 4
    band = np.full((max(1, len(lines)) * step + 6, w, 3), 255, np.uint8)
    for i, line in enumerate(lines):
        cv2.putText(band, line, (4, 3 + ch + i * step), font, scale, (0, 0, 0), thick,
                    cv2.LINE_AA)
    return np.concatenate([band, np.ascontiguousarray(image)], axis=0)


class MiTASegInferencer(MMSegInferencer):
    """``MMSegInferencer`` whose checkpoint must fit the model exactly, optionally on MiTA,
    an ``EncoderDecoder`` on :class:`~mita_seg.models.SlimEncoderDecoder` (mmseg's results,
    lighter slide inference; not where the config says ``slim_inference=False``).

    Example::

        inferencer = MiTASegInferencer(config, weights=ckpt, mita_cfg=dict(pool_size=7, topk=49))
        result = inferencer('demo.png', out_dir='out')   # out/vis/demo.png

    Args:
        model (str): a config file or ``'mmseg::...'`` config (as ``MMSegInferencer``).
        weights (str, optional): a local checkpoint (loaded weights-only).
        mita_cfg (dict | str | MiTASetting, optional): swap the attention to MiTA with
            these settings (``--mita-cfg``, or a whole setting such as ``'7:49'``); None runs
            the model as configured. Default: None.
        dense_attn (str, optional): ``'fast'`` or ``'mmseg'``, the dense attention path
            (:func:`~mita_seg.apis.init_model`'s); None: the config's, else ``'fast'``.
            Default: None.
        **kwargs: the other arguments of ``MMSegInferencer`` (``device``, ``palette``...).

    Raises:
        CheckpointMismatchError: ``weights`` does not fit the model.
        NothingToSwapError: ``mita_cfg`` given and the model has nothing to swap.
    """

    def __init__(self, model: str, weights: Optional[str] = None,
                 mita_cfg: Union[dict, str, MiTASetting, None] = None,
                 dense_attn: Optional[str] = None, **kwargs):
        self.mita_cfg = mita_cfg
        self.dense_attn = None if dense_attn is None else check_dense_attn(dense_attn)
        self.weights_source = weights
        super().__init__(model, weights=weights, **kwargs)

    def _init_model(self, cfg, weights: Optional[str], device: str = 'cpu') -> nn.Module:
        """``MMSegInferencer``'s model, built as ``SlimEncoderDecoder`` where the config has
        an ``EncoderDecoder`` (:func:`~mita_seg.apis.use_slim_inference`), its dense
        attention on the config's path (``dense_attn``, ``'fast'`` by default), a BEiT/MAE
        given another grid an error that says what to do (:func:`guard_grids`)."""
        if self.dense_attn is not None:
            cfg.dense_attn = self.dense_attn
        model = super()._init_model(use_slim_inference(cfg), weights, device)
        use_dense_attn(model, cfg)
        guard_grids(model)
        return model

    def _load_weights_to_model(self, model: nn.Module, checkpoint: Optional[dict], cfg) -> None:
        """Check the checkpoint's keys, let mmseg load it, take the class names of
        :func:`~mita_seg.apis.model.dataset_meta` (the checkpoint's, else the config's
        test dataset's, where mmseg takes Cityscapes' 19 whatever the model), then swap the
        attention (keys are unchanged by the swap)."""
        if checkpoint is not None:
            check_checkpoint_keys(model, checkpoint, source=self.weights_source or '')
        super()._load_weights_to_model(model, checkpoint, cfg)
        meta = dataset_meta(cfg, checkpoint,
                            getattr(getattr(model, 'decode_head', None), 'num_classes', None))
        if meta is not None:   # what the visualizer takes (set_dataset_meta(**meta))
            model.dataset_meta = dict(classes=meta['classes'], palette=meta['palette'])
        if self.mita_cfg is not None:
            swap_model(model, self.mita_cfg)
