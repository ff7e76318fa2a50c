"""Strict ``Pretrained`` initialisation for mmseg's backbones.

mmseg's ``VisionTransformer``, ``BEiT`` and ``MAE`` load ``init_cfg=dict(type='Pretrained')``
weights with ``strict=False``: a checkpoint that does not fit leaves weights silently random.
:class:`StrictPretrainedMixin` checks the weights mmseg is about to load first, and raises a
:class:`~mita_seg.utils.checkpoint.CheckpointMismatchError` listing what does not fit.
"""
from typing import Dict, Tuple

import torch
from mmengine.logging import print_log
from mmengine.runner.checkpoint import CheckpointLoader

from mita_seg.utils.checkpoint import check_state_dict


class StrictPretrainedMixin:
    """Checks ``Pretrained`` weights before the backbone's own ``init_weights`` loads them.

    A backbone class says what may legitimately differ, in class attributes: model keys a
    pretrained checkpoint may lack (kept at their initialisation, logged), checkpoint keys
    the backbone may not have (not loaded, logged), and keys the backbone's loader resizes
    (only their last dimension, channels or heads, must match). The backbone's
    ``strict_pretrained`` (default True) turns the check off: mmseg's behaviour.
    """
    #: init_cfg types whose weights are checked (those the backbone's loader handles)
    pretrained_types: Tuple[str, ...] = ('Pretrained', )
    #: substrings of model keys a pretrained checkpoint may lack (MiTA's DWC branch)
    pretrained_may_lack: Tuple[str, ...] = ('.attn.dwc.', )
    #: prefixes of checkpoint keys the backbone may not have ('' for any)
    pretrained_may_carry: Tuple[str, ...] = ()
    #: model keys resized by the loader, by their last name
    pretrained_resized: Tuple[str, ...] = ()
    #: keys the loader drops from the checkpoint and rebuilds, by their last name
    pretrained_rebuilt: Tuple[str, ...] = ()
    #: mmseg's converter for the original (timm-style ``blocks.*``) key names
    pretrained_converter: str = ''

    strict_pretrained: bool = True

    def init_weights(self):
        """The backbone's initialisation, after checking that pretrained weights fit."""
        if (self.strict_pretrained and isinstance(self.init_cfg, dict)
                and self.init_cfg.get('type') in self.pretrained_types):
            checkpoint = CheckpointLoader.load_checkpoint(
                self.init_cfg['checkpoint'], logger=None, map_location='cpu')
            self.check_pretrained(self._pretrained_state_dict(checkpoint),
                                  source=self.init_cfg['checkpoint'])
        super().init_weights()

    def _pretrained_state_dict(self, checkpoint: dict) -> Dict[str, torch.Tensor]:
        """The state dict the backbone's ``init_weights`` loads from ``checkpoint``."""
        return checkpoint.get('state_dict', checkpoint)

    def _pretrained_skip(self, kind: str, key: str) -> bool:
        """True for a key that may differ: ``kind`` is 'missing' or 'unexpected'."""
        if kind == 'missing':
            return any(s in key for s in self.pretrained_may_lack)
        return any(key.startswith(p) for p in self.pretrained_may_carry)

    def check_pretrained(self, state_dict: Dict[str, torch.Tensor], source: str = '') -> None:
        """Check that ``state_dict`` fits this backbone.

        Args:
            state_dict (dict): backbone weights with mmseg's key names.
            source (str): where they come from, for messages. Default: ''.

        Raises:
            CheckpointMismatchError: missing, unexpected or mis-shaped keys (a
                ``ValueError``; all of them listed).
        """
        def same_shape(key: str, want: tuple, got: tuple) -> bool:
            if key.split('.')[-1] in self.pretrained_resized:
                want, got = want[-1:], got[-1:]
            return want == got

        hint = ''
        if self.pretrained_converter and any(k.startswith('blocks.') for k in state_dict):
            hint = ('  (timm key names: convert the checkpoint with mmseg\'s '
                    f'tools/model_converters/{self.pretrained_converter})\n')

        def kept(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            return {k: v for k, v in sd.items()
                    if k.split('.')[-1] not in self.pretrained_rebuilt}

        name = type(self).__name__
        model = kept(self.state_dict())
        skipped = check_state_dict(
            model, kept(state_dict), source, f'{name} (Pretrained)', self._pretrained_skip,
            same_shape, hint + '  Fix the config (embed_dims, num_layers, final_norm, ...) or '
            'the checkpoint, or set strict_pretrained=False to load what fits.')
        lacked = [k for k in skipped if k in model]
        unused = [k for k in skipped if k not in model]
        if lacked:
            print_log(f'{name}: kept at their initialisation, not in {source}: '
                      f'{", ".join(lacked)}', logger='current')
        if unused:
            print_log(f'{name}: not loaded from {source} (not in the backbone): '
                      f'{", ".join(unused)}', logger='current')
