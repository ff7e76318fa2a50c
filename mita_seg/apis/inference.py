"""Segment images: mmseg's ``inference_model`` on :func:`~mita_seg.apis.init_model`'s
models, and :class:`MiTASegInferencer`, mmseg's ``MMSegInferencer`` with strict
weights-only loading and an optional swap to MiTA."""
from typing import Optional

import torch.nn as nn
from mmseg.apis import MMSegInferencer, inference_model, show_result_pyplot

from mita_seg.utils.checkpoint import check_checkpoint_keys
from .config import use_slim_inference
from .model import swap_model

__all__ = ['inference_model', 'show_result_pyplot', 'MiTASegInferencer']


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
        mita_cfg (dict, optional): swap the attention to MiTA with these settings
            (``--mita-cfg``); None runs the model as configured. Default: None.
        **kwargs: the other arguments of ``MMSegInferencer`` (``device``, ``palette``...).

    Raises:
        CheckpointMismatchError: ``weights`` does not fit the model.
        NothingToSwapError: ``mita_cfg`` given and the model has nothing to swap.
    """

    def __init__(self, model: str, weights: Optional[str] = None,
                 mita_cfg: Optional[dict] = None, **kwargs):
        self.mita_cfg = mita_cfg
        self.weights_source = weights
        super().__init__(model, weights=weights, **kwargs)

    def _init_model(self, cfg, weights: Optional[str], device: str = 'cpu') -> nn.Module:
        """``MMSegInferencer``'s model, built as ``SlimEncoderDecoder`` where the config has
        an ``EncoderDecoder`` (:func:`~mita_seg.apis.use_slim_inference`)."""
        return super()._init_model(use_slim_inference(cfg), weights, device)

    def _load_weights_to_model(self, model: nn.Module, checkpoint: Optional[dict], cfg) -> None:
        """Check the checkpoint's keys, let mmseg load it (and its class names), then
        swap the attention (keys are unchanged by the swap)."""
        if checkpoint is not None:
            check_checkpoint_keys(model, checkpoint, source=self.weights_source or '')
        super()._load_weights_to_model(model, checkpoint, cfg)
        if self.mita_cfg is not None:
            swap_model(model, self.mita_cfg)
