"""mmseg's BEiT and MAE backbones with MiTA attention."""
from typing import Optional, Sequence

from mmseg.models.backbones import BEiT, MAE
from mmseg.registry import MODELS

from ..attention import use_mita_layers
from ..beit_attention import MiTABEiTAttention  # noqa: F401  (registers the conversion)


class MiTALayersMixin:
    """Builds the backbone as mmseg does, then puts the attention of the chosen encoder
    layers on MiTA in place (:func:`~mita_seg.models.attention.use_mita`): module names and
    checkpoint keys stay mmseg's, so BEiT/MAE pretrained weights and model-zoo checkpoints
    load as they are (mmseg's ``resize_rel_pos_embed`` included)."""

    def __init__(self,
                 mita_cfg: Optional[dict] = None,
                 mita_layers: Optional[Sequence[int]] = None,
                 mita_layer_cfgs: Optional[Sequence[Optional[dict]]] = None,
                 **kwargs):
        super().__init__(**kwargs)
        use_mita_layers(self, mita_cfg, mita_layers, mita_layer_cfgs)


@MODELS.register_module()
class MiTABEiT(MiTALayersMixin, BEiT):
    """BEiT whose encoder layers use :class:`~mita_seg.models.MiTABEiTAttention` (MiTA with
    BEiT's relative position bias).

    Everything else is mmseg's ``BEiT`` (all of its arguments apply). As in mmseg, every
    forward must have the patch grid of ``img_size`` (the bias table's); another grid is a
    :class:`~mita_seg.models.GridMismatchError` saying how to evaluate (slide inference at
    the training crop size).

    Args:
        mita_cfg (dict, optional): MiTA settings (``pool_size``, ``topk``, ``router_topk``,
            ``with_shared_expert``, ``shared_scale``). Default: None (the published
            ``pool_size=7, topk=49``).
        mita_layers (Sequence[int], optional): encoder layers on MiTA; None for all.
            Default: None.
        mita_layer_cfgs (Sequence[dict | None], optional): per encoder layer, MiTA settings
            over ``mita_cfg``, or None for BEiT's attention (a swap plan); not with
            ``mita_layers``. Default: None.
        **kwargs: arguments of mmseg's ``BEiT``.
    """


@MODELS.register_module()
class MiTAMAE(MiTALayersMixin, MAE):
    """MAE whose encoder layers use :class:`~mita_seg.models.MiTAMAEAttention`.

    Everything else is mmseg's ``MAE`` (all of its arguments apply; its absolute position
    embedding, like the bias table, fixes the grid to that of ``img_size``).

    Args:
        mita_cfg (dict, optional): MiTA settings, as :class:`MiTABEiT`'s. Default: None.
        mita_layers (Sequence[int], optional): encoder layers on MiTA; None for all.
            Default: None.
        mita_layer_cfgs (Sequence[dict | None], optional): as :class:`MiTABEiT`'s.
            Default: None.
        **kwargs: arguments of mmseg's ``MAE``.
    """
