"""mmseg's BEiT and MAE backbones with MiTA attention."""
from typing import Optional, Sequence

import numpy as np
import torch
from mmseg.models.backbones import BEiT, MAE
from mmseg.registry import MODELS

from ..attention import use_mita_layers
from ..beit_attention import MiTABEiTAttention  # noqa: F401  (registers the conversion)
from .pretrained import StrictPretrainedMixin


def interpolate_rel_pos_grid(grid: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """A BEiT relative position bias table's grid part resized as mmseg's
    ``BEiT.resize_rel_pos_embed`` does (BEiT's own geometric-sequence interpolation: the
    ``src x src`` offsets placed at geometrically spaced distances, read at the unit
    distances of ``dst x dst``), with SciPy's cubic ``interp2d``, which SciPy 1.14 removed,
    replaced by the same interpolating spline on a regular grid (``RectBivariateSpline``,
    SciPy's stated replacement; rows stay rows).

    Args:
        grid (Tensor): ``[src * src, H]``, the table without its class-token rows.
        src (int): the table's side, ``2 S - 1`` for a pretrained ``S x S`` patch grid.
        dst (int): the side wanted.

    Returns:
        Tensor: ``[dst * dst, H]``, the dtype of ``grid``.
    """
    from scipy.interpolate import RectBivariateSpline
    left, right = 1.01, 1.5          # the ratio q whose geometric sequence spans dst // 2
    while right - left > 1e-6:
        q = (left + right) / 2.0
        if (1.0 - q ** (src // 2)) / (1.0 - q) > dst // 2:
            right = q
        else:
            left = q
    dis, cur = [], 1.0
    for i in range(src // 2):
        dis.append(cur)
        cur += q ** (i + 1)
    x = np.array([-d for d in reversed(dis)] + [0] + dis)          # the table's distances
    t = dst // 2.0
    dx = np.arange(-t, t + 0.1, 1.0)                                # the unit ones wanted
    z = grid.float().numpy()
    heads = [torch.from_numpy(RectBivariateSpline(x, x, z[:, h].reshape(src, src))(dx, dx))
             .reshape(-1, 1) for h in range(grid.shape[1])]         # each [dst * dst, 1]
    return torch.cat(heads, dim=1).to(grid)


class MiTALayersMixin(StrictPretrainedMixin):
    """Builds the backbone as mmseg does, then puts the attention of the chosen encoder
    layers on MiTA in place (:func:`~mita_seg.models.attention.use_mita`): module names and
    checkpoint keys stay mmseg's, so BEiT/MAE pretrained weights and model-zoo checkpoints
    load as they are (mmseg's ``resize_rel_pos_embed`` included).

    ``Pretrained`` weights are checked before mmseg loads them (``strict=False`` there):
    a model key the checkpoint lacks, or a key of another shape, is a
    :class:`~mita_seg.utils.checkpoint.CheckpointMismatchError` listing them all. Logged,
    not raised: ``relative_position_index`` (mmseg drops it and keeps the model's), the
    tables mmseg resizes to the grid, and checkpoint keys outside the backbone's own
    modules (a pretraining head, a final ``norm``, a decoder), which mmseg does not load.
    """
    pretrained_may_carry = ('patch_embed.proj.', )
    pretrained_resized = ('relative_position_bias_table', )  # heads must match
    pretrained_rebuilt = ('relative_position_index', )
    pretrained_converter = 'beit2mmseg.py'

    def __init__(self,
                 mita_cfg: Optional[dict] = None,
                 mita_layers: Optional[Sequence[int]] = None,
                 mita_layer_cfgs: Optional[Sequence[Optional[dict]]] = None,
                 strict_pretrained: bool = True,
                 **kwargs):
        super().__init__(**kwargs)
        self.strict_pretrained = strict_pretrained
        use_mita_layers(self, mita_cfg, mita_layers, mita_layer_cfgs)

    def _geometric_sequence_interpolation(self, src_size: int, dst_size: int,
                                          sequence: torch.Tensor, num: int) -> torch.Tensor:
        """mmseg's resizing of a pretrained table (``resize_rel_pos_embed``), without SciPy's
        removed ``interp2d``: :func:`interpolate_rel_pos_grid`."""
        return interpolate_rel_pos_grid(sequence, src_size, dst_size)

    def _pretrained_skip(self, kind: str, key: str) -> bool:
        """A checkpoint key outside the backbone's own modules and parameters (a
        pretraining head, a final norm, a decoder), ``patch_embed.proj.*`` (which mmseg's
        ``beit2mmseg.py`` keeps beside its renamed ``patch_embed.projection.*``), and
        MiTA-only parameters."""
        if kind == 'unexpected':
            own = {*dict(self.named_children()), *dict(self.named_parameters(recurse=False))}
            return key.split('.')[0] not in own or super()._pretrained_skip(kind, key)
        return super()._pretrained_skip(kind, key)


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
        strict_pretrained (bool): check that ``Pretrained`` weights fit (see
            ``MiTALayersMixin``). False is mmseg's behaviour. Default: True.
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
        strict_pretrained (bool): as :class:`MiTABEiT`'s. An MAE checkpoint may also lack
            the layer scales (``gamma_1``, ``gamma_2``) and the relative position bias
            table, which MAE's pretraining does not have: mmseg keeps their initialisation
            (``init_values``, zeros). Default: True.
        **kwargs: arguments of mmseg's ``MAE``.
    """
    pretrained_may_lack = MiTALayersMixin.pretrained_may_lack + (
        '.gamma_1', '.gamma_2', 'relative_position_bias_table')
    pretrained_resized = MiTALayersMixin.pretrained_resized + ('pos_embed', )
