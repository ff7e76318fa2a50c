"""mmseg's VisionTransformer with MiTA attention."""
from typing import Dict, Optional, Sequence

import torch
from mmengine.logging import print_log
from mmengine.runner.checkpoint import CheckpointLoader
from mmseg.models.backbones import VisionTransformer
from mmseg.registry import MODELS

from mita_seg.utils.checkpoint import check_state_dict
from ..attention import use_mita_layers

# Model keys a pretrained checkpoint legitimately lacks: MiTA's own optional parameters
# (the DWC branch), which keep their initialisation.
_MITA_ONLY = ('.attn.dwc.', )


@MODELS.register_module()
class MiTAVisionTransformer(VisionTransformer):
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

    def __init__(self,
                 mita_cfg: Optional[dict] = None,
                 mita_layers: Optional[Sequence[int]] = None,
                 mita_layer_cfgs: Optional[Sequence[Optional[dict]]] = None,
                 strict_pretrained: bool = True,
                 **kwargs):
        super().__init__(**kwargs)
        self.strict_pretrained = strict_pretrained
        use_mita_layers(self, mita_cfg, mita_layers, mita_layer_cfgs)

    def init_weights(self):
        """mmseg's initialisation, after checking that pretrained weights fit."""
        if (self.strict_pretrained and isinstance(self.init_cfg, dict)
                and self.init_cfg.get('type') in ('Pretrained', 'Pretrained_Part')):
            checkpoint = CheckpointLoader.load_checkpoint(
                self.init_cfg['checkpoint'], logger=None, map_location='cpu')
            self.check_pretrained(self._pretrained_state_dict(checkpoint),
                                  source=self.init_cfg['checkpoint'])
        super().init_weights()

    def _pretrained_state_dict(self, checkpoint: dict) -> Dict[str, torch.Tensor]:
        """The state dict mmseg's ``init_weights`` loads from ``checkpoint``."""
        if self.init_cfg['type'] == 'Pretrained':
            return checkpoint.get('state_dict', checkpoint)
        prefix = 'image_encoder.'  # Pretrained_Part
        return {k[len(prefix):]: v for k, v in checkpoint.items() if prefix in k}

    def check_pretrained(self, state_dict: Dict[str, torch.Tensor], source: str = '') -> None:
        """Check that ``state_dict`` fits this backbone (``pos_embed`` may differ in
        length: mmseg resizes it).

        Args:
            state_dict (dict): backbone weights with mmseg's key names.
            source (str): where they come from, for messages. Default: ''.

        Raises:
            CheckpointMismatchError: missing, unexpected or mis-shaped keys (a
                ``ValueError``; all of them listed).
        """
        def skip(kind: str, key: str) -> bool:
            if kind == 'unexpected':
                return not self.final_norm and key.startswith('ln1.')
            return any(s in key for s in _MITA_ONLY)

        def same_shape(key: str, want: tuple, got: tuple) -> bool:
            if key == 'pos_embed':  # resized by mmseg: only the channel count must match
                want, got = want[-1:], got[-1:]
            return want == got

        hint = ''
        if any(k.startswith('blocks.') for k in state_dict):
            hint = ('  (timm key names: convert the checkpoint with mmseg\'s '
                    'tools/model_converters/vit2mmseg.py)\n')
        skipped = check_state_dict(
            self.state_dict(), state_dict, source, f'{type(self).__name__} (Pretrained)', skip,
            same_shape, hint + '  Fix the config (embed_dims, num_layers, final_norm, ...) or '
            'the checkpoint, or set strict_pretrained=False to load what fits.')
        if skipped:
            print_log(f'{type(self).__name__}: not loaded from {source}: {", ".join(skipped)}',
                      logger='current')
