"""mmseg's VisionTransformer with MiTA attention."""
from typing import Dict, Optional, Sequence

import torch
from mmseg.models.backbones import VisionTransformer
from mmseg.registry import MODELS

from ..attention import use_mita_layers
from .pretrained import StrictPretrainedMixin


@MODELS.register_module()
class MiTAVisionTransformer(StrictPretrainedMixin, VisionTransformer):
    """Vision Transformer whose encoder layers use :class:`MiTAAttention`.

    Everything else is mmseg's ``VisionTransformer`` (all of its arguments apply), and so
    are the checkpoint keys: ViT/DeiT pretrained weights and model-zoo checkpoints load as
    they are. The grid shape of every forward reaches the layers through a hook on
    ``patch_embed``, so non-square and slide inputs work.

    Unlike mmseg's, ``Pretrained`` / ``Pretrained_Part`` initialisation is strict by default:
    the checkpoint (after mmseg's key handling and ``pos_embed`` resizing) must fit the
    model exactly, or a ``ValueError`` lists the missing, unexpected and mis-shaped keys.
    Two exceptions, both logged: the final norm of a classification checkpoint (``ln1.*``)
    when ``final_norm=False``, and MiTA-only parameters (``with_dwc``).

    Args:
        mita_cfg (dict, optional): :class:`MiTAAttention` settings (``pool_size``, ``topk``,
            ``router_topk``, ``with_shared_expert``, ``shared_scale``, ``with_dwc``).
            Default: None (the published ``pool_size=7, topk=49``).
        mita_layers (Sequence[int], optional): encoder layers on MiTA; None for all.
            Default: None.
        mita_layer_cfgs (Sequence[dict | None], optional): per encoder layer, MiTA settings
            over ``mita_cfg``, or None for standard attention (a swap plan, as
            ``tools/export_swapped.py --mita-plan`` writes it); not with ``mita_layers``.
            Default: None.
        strict_pretrained (bool): check that pretrained weights fit exactly. False is
            mmseg's behaviour (mismatches are only logged). Default: True.
        **kwargs: arguments of mmseg's ``VisionTransformer``.
    """

    pretrained_types = ('Pretrained', 'Pretrained_Part')
    pretrained_resized = ('pos_embed', )  # mmseg resizes it: only the channels must match
    pretrained_converter = 'vit2mmseg.py'

    def __init__(self,
                 mita_cfg: Optional[dict] = None,
                 mita_layers: Optional[Sequence[int]] = None,
                 mita_layer_cfgs: Optional[Sequence[Optional[dict]]] = None,
                 strict_pretrained: bool = True,
                 **kwargs):
        super().__init__(**kwargs)
        self.strict_pretrained = strict_pretrained
        use_mita_layers(self, mita_cfg, mita_layers, mita_layer_cfgs)

    def _pretrained_state_dict(self, checkpoint: dict) -> Dict[str, torch.Tensor]:
        """The state dict mmseg's ``init_weights`` loads from ``checkpoint``."""
        if self.init_cfg['type'] == 'Pretrained':
            return checkpoint.get('state_dict', checkpoint)
        prefix = 'image_encoder.'  # Pretrained_Part
        return {k[len(prefix):]: v for k, v in checkpoint.items() if prefix in k}

    def _pretrained_skip(self, kind: str, key: str) -> bool:
        """A classification checkpoint's final norm (``ln1.*``) with ``final_norm=False``,
        and MiTA-only parameters."""
        if kind == 'unexpected':
            return not self.final_norm and key.startswith('ln1.')
        return super()._pretrained_skip(kind, key)
