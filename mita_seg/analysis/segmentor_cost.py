"""What a segmentor built from a config costs: baseline and MiTA (and/or token merging,
ToMe) side by side, per crop and
per image under the config's test mode (whole or slide), on CPU or the ``meta`` device."""
import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from mita_seg.ops.routing import pair
from mita_seg.setting import SETTING_KEYS, MiTASetting
from mita_seg.utils.cfg_options import blame_cfg_options
from .flop_count import FlopBreakdown, count_flops
from .flop_handles import CONVENTION

__all__ = [
    'slide_crops', 'inference_crops', 'build_segmentor', 'decode_head_called_as_module',
    'FlopComparison', 'SegmentorFlops', 'crop_size', 'default_shape', 'test_inputs'
]


def slide_crops(image_shape: Sequence[int], crop_size: Sequence[int],
                stride: Sequence[int]) -> Tuple[int, Tuple[int, int]]:
    """Crops of mmseg's ``EncoderDecoder.slide_inference`` for one image.

    Args:
        image_shape (tuple[int, int]): ``(H, W)`` of the (resized) test image.
        crop_size (tuple[int, int]): ``test_cfg.crop_size``.
        stride (tuple[int, int]): ``test_cfg.stride``.

    Returns:
        tuple: ``(number of crops, crop shape)``; every crop has the same shape
        (``crop_size``, clipped to the image).
    """
    (H, W), (hc, wc), (hs, ws) = image_shape, crop_size, stride
    if min(H, W, hc, wc, hs, ws) < 1:
        raise ValueError(f'image_shape, crop_size and stride must be positive, got '
                         f'{image_shape}, {crop_size}, {stride}')
    h_grids = max(H - hc + hs - 1, 0) // hs + 1
    w_grids = max(W - wc + ws - 1, 0) // ws + 1
    return h_grids * w_grids, (min(hc, H), min(wc, W))


def inference_crops(test_cfg: Optional[dict],
                    image_shape: Sequence[int]) -> Tuple[str, int, Tuple[int, int]]:
    """How a segmentor's ``test_cfg`` runs one image of ``image_shape``.

    Returns:
        tuple: ``(mode, number of forwards, shape of each forward)``: ``('whole', 1,
        image_shape)`` or ``('slide', crops, crop shape)``.
    """
    test_cfg = test_cfg or {}
    mode = test_cfg.get('mode', 'whole')
    if mode == 'slide':
        n, crop = slide_crops(image_shape, test_cfg['crop_size'], test_cfg['stride'])
        return mode, n, crop
    if mode != 'whole':
        raise ValueError(f"test_cfg.mode must be 'whole' or 'slide', got {mode!r}")
    return mode, 1, (int(image_shape[0]), int(image_shape[1]))


def _hw(shape, name: str) -> Tuple[int, int]:
    """``shape`` (one int or ``(H, W)``) as a pair of positive ints."""
    h, w = pair(tuple(shape) if isinstance(shape, (list, tuple)) else shape, name)
    if min(h, w) < 1:
        raise ValueError(f'{name} must be one or two positive ints (H W), got {shape}')
    return h, w


def crop_size(cfg):
    """The config's crop size, where it sets one (``crop_size``, else
    ``model.test_cfg.crop_size``); else None."""
    return cfg.get('crop_size') or cfg.model.get('test_cfg', {}).get('crop_size')


def default_shape(cfg) -> Tuple[int, int]:
    """The shape ``tools/get_flops.py`` counts by default: the config's :func:`crop_size`,
    else 512x512."""
    crop = crop_size(cfg)
    return tuple(crop) if crop else (512, 512)


def test_inputs(preprocessor: nn.Module, shape: Sequence[int],
                device: str = 'cpu') -> torch.Tensor:
    """Preprocessed inputs ``[1, 3, H', W']`` of an image of ``shape`` (zeros), as a
    segmentor's data preprocessor pads it in test mode, on ``device``."""
    from mmseg.structures import SegDataSample
    H, W = _hw(shape, 'shape')
    meta = dict(ori_shape=(H, W), img_shape=(H, W), pad_shape=(H, W))
    data = dict(inputs=[torch.zeros(3, H, W, dtype=torch.uint8)],
                data_samples=[SegDataSample(metainfo=meta)])
    return preprocessor(data, training=False)['inputs'].to(device)


def build_segmentor(cfg, seed: int = 0) -> nn.Module:
    """The segmentor of ``cfg`` as mmseg's ``get_flops.py`` counts it: random weights
    (no checkpoint is loaded), auxiliary head removed, SyncBN reverted, eval mode, CPU."""
    from mmengine.model import revert_sync_batchnorm
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    import mita_seg.models  # noqa: F401  (registers MiTA types for MiTA configs)
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    torch.manual_seed(seed)
    with blame_cfg_options(cfg, 'the model', ('model', )):   # a bad --cfg-options value
        model = MODELS.build(copy.deepcopy(cfg.model))  # building edits the config
    if getattr(model, 'auxiliary_head', None) is not None:
        model.auxiliary_head = None
    return revert_sync_batchnorm(model).eval()


@contextlib.contextmanager
def decode_head_called_as_module(model: nn.Module):
    """Make ``EncoderDecoder``'s ``mode='tensor'`` forward call ``decode_head(x)``.

    mmseg's ``EncoderDecoder._forward`` (like ``predict`` and ``loss``) calls
    ``decode_head.forward(x)`` directly, so the head's forward hooks do not run: the
    analyzer's scope for the head (its own ops would count for the root module only) and
    the hook that gives swapped MiTA head layers their grid. Within this context the same
    computation goes through ``decode_head.__call__``. Other segmentors are left as they are.
    """
    from mmseg.models.segmentors import EncoderDecoder
    if not (isinstance(model, EncoderDecoder)
            and type(model)._forward is EncoderDecoder._forward):
        yield
        return

    def _forward(inputs, data_samples=None):
        return model.decode_head(model.extract_feat(inputs))

    model._forward = _forward
    try:
        yield
    finally:
        del model._forward


@dataclass
class FlopComparison:
    """Baseline and MiTA FLOPs of one segmentor at one input shape.

    Attributes:
        name (str): what was counted (the config's name).
        shape (tuple[int, int]): input shape of the counted forward (one crop).
        baseline (FlopBreakdown): the model as configured.
        mita (FlopBreakdown, optional): after :func:`mita_seg.swap_attention`; None when
            nothing could be swapped.
        mita_cfg (dict): the MiTA settings.
        num_swapped (int): attention modules on MiTA.
        note (str): why there is no MiTA column, or other remarks.
        merge_ratio (float, optional): the ToMe ratio of the second model
            (:func:`mita_seg.merge_tokens`), alone or with MiTA; None for MiTA only.
        num_merged (int): encoder layers with merged tokens.
        image (dict, optional): whole-image cost under the model's ``test_cfg``: ``shape``,
            ``mode``, ``crops``, ``crop_shape``, ``baseline`` and ``mita`` (FLOPs).
    """
    name: str
    shape: Tuple[int, int]
    baseline: FlopBreakdown
    mita: Optional[FlopBreakdown] = None
    mita_cfg: Dict[str, Any] = field(default_factory=dict)
    num_swapped: int = 0
    note: str = ''
    image: Optional[Dict[str, Any]] = None
    merge_ratio: Optional[float] = None
    num_merged: int = 0

    @property
    def label(self) -> str:
        """What the second column ran: ``'MiTA'`` (or the kind of attention swapped in:
        ``'agent'``, ``'block'``...), ``'ToMe r=0.3'`` or both."""
        cfg = self.mita_cfg or {}
        if cfg.get('plan') is not None:
            swap = cfg['plan'].swapped_as()
        else:   # the whole setting, or single keys over the defaults
            swap = (cfg.get('setting') or MiTASetting.from_cfg(
                {k: v for k, v in cfg.items() if k in SETTING_KEYS})).swap_name
        tome = None if self.merge_ratio is None else f'ToMe r={self.merge_ratio:g}'
        if tome is None:
            return swap
        return f'{swap}+{tome}' if self.num_swapped else tome

    def reduction(self, key: str) -> Optional[float]:
        """Percent fewer FLOPs of MiTA in ``key`` (``'total'``, ``'backbone'``...)."""
        if self.mita is None:
            return None
        base, new = getattr(self.baseline, key), getattr(self.mita, key)
        return 100.0 * (1 - new / base) if base else 0.0

    def to_json(self) -> Dict[str, Any]:
        """The figures for scripts: GFLOPs, params in millions; ``image``: the whole-image
        cost under the test mode (GFLOPs). With token merging, ``merge_ratio`` and
        ``label`` too, and the second model (under ``mita``) has ``token_merge``."""
        out = {
            'convention': CONVENTION + '; FLOPs in GFLOPs (1e9), params in M (1e6)',
            'shape': list(self.shape),
            'baseline': self.baseline.summary(),
            'mita': None if self.mita is None else self.mita.summary(),
            'reduction_percent': None if self.mita is None else {
                'total': self.reduction('total'),
                'backbone': self.reduction('backbone')
            },
            'image': None if self.image is None else dict(
                self.image, shape=list(self.image['shape']),
                crop_shape=list(self.image['crop_shape']), baseline=self.image['baseline'] / 1e9,
                mita=None if self.image.get('mita') is None else self.image['mita'] / 1e9),
        }
        if self.merge_ratio is not None:
            out.update(merge_ratio=self.merge_ratio, label=self.label)
        return out


class SegmentorFlops:
    """Counts a config's segmentor, and the same segmentor swapped to MiTA and/or with
    token merging (ToMe), at any shape.

    Args:
        cfg (Config): an mmseg config (:func:`load_config`).
        mita_cfg (dict, optional): arguments of :func:`mita_seg.swap_attention`
            (``pool_size``, ``topk``, ...); None counts the baseline only. Default: None.
        device (str): ``'cpu'`` runs the traced forward for real (as mmseg's tool does);
            ``'meta'`` traces with shape-only tensors, same graph and counts without the
            compute or memory (for large inputs). Default: ``'cpu'``.
        name (str): how the model is named in the output. Default: ``'segmentor'``.
        merge_ratio (float, optional): token merging (:func:`mita_seg.merge_tokens`) at
            this ratio in the second model (after the MiTA swap, if any); None for none.
            Default: None.
    """

    def __init__(self, cfg, mita_cfg: Optional[dict] = None, device: str = 'cpu',
                 name: str = 'segmentor', merge_ratio: Optional[float] = None):
        if device not in ('cpu', 'meta'):
            raise ValueError(f"device must be 'cpu' or 'meta', got {device!r}")
        self.name, self.device = name, device
        self.mita_cfg = dict(mita_cfg or {})
        self.baseline = build_segmentor(cfg)
        self.preprocessor = copy.deepcopy(self.baseline.data_preprocessor)
        self.test_cfg = getattr(self.baseline, 'test_cfg', None)
        self.note = ''
        from mita_seg.models import MiTASettingsMixin
        if any(isinstance(m, MiTASettingsMixin) for m in self.baseline.modules()):
            self.note = 'note: the config already uses MiTA; "baseline" is the model as configured'
        self.baseline.to(device)
        self.mita, self.num_swapped, self.num_merged = None, 0, 0
        self.merge_ratio = merge_ratio
        if mita_cfg is not None or merge_ratio is not None:
            from mita_seg.models import current_plan, merge_tokens, swap_attention
            model = copy.deepcopy(self.baseline)
            if mita_cfg is not None:   # the layers the swap put on (or changed to) MiTA
                before = current_plan(model).layers
                swap_attention(model, verbose=False, **self.mita_cfg)
                self.num_swapped = sum(s is not None and s != before[n]
                                       for n, s in current_plan(model).layers.items())
            if merge_ratio is not None:
                self.num_merged = merge_tokens(model, merge_ratio, verbose=False)
            self.mita = model   # the second model: MiTA and/or ToMe

    def inputs(self, shape: Sequence[int]) -> torch.Tensor:
        """Preprocessed inputs ``[1, 3, H', W']`` for an image of ``shape`` (as mmseg's
        data preprocessor pads it in test mode), on the counting device."""
        return test_inputs(self.preprocessor, shape, self.device)

    def count(self, shape: Sequence[int]) -> Tuple[FlopBreakdown, Optional[FlopBreakdown]]:
        """FLOPs of one ``mode='tensor'`` forward of an input of ``shape``, baseline and
        MiTA (None if not swapped)."""
        x = self.inputs(shape)
        out = []
        for model in (self.baseline, self.mita):
            if model is not None:
                with torch.no_grad(), decode_head_called_as_module(model):
                    model = count_flops(model, (x, ))
            out.append(model)
        return out[0], out[1]

    def compare(self, shape: Sequence[int],
                image_shape: Optional[Sequence[int]] = None) -> FlopComparison:
        """Side-by-side counts at ``shape``, and the whole-image cost of an image of
        ``image_shape`` (default: ``shape``) under the config's ``test_cfg``."""
        shape = _hw(shape, 'shape')
        image_shape = shape if image_shape is None else _hw(image_shape, 'image_shape')
        base, mita = self.count(shape)
        padded = tuple(self.inputs(image_shape).shape[-2:])  # test-time padding, if any
        mode, crops, crop = inference_crops(self.test_cfg, padded)
        cbase, cmita = (base, mita) if tuple(crop) == shape else self.count(crop)
        image = dict(shape=image_shape, mode=mode, crops=crops, crop_shape=crop,
                     baseline=crops * cbase.total,
                     mita=None if cmita is None else crops * cmita.total)
        return FlopComparison(self.name, shape, base, mita, self.mita_cfg, self.num_swapped,
                              self.note, image, self.merge_ratio, self.num_merged)
