"""Segmentors to ONNX (``tools/export_onnx.py``), MiTA included, checked in ONNX Runtime.

The graph takes the preprocessed image batch ``[1, 3, H, W]`` float32 (the image normalized as
the config's data preprocessor does: ``(img - mean) / std``, in the channel order it gives)
and gives ``seg_logits`` ``[1, C, H, W]``: the decode head's logits resized to the input, as
mmseg's whole-image inference (``EncoderDecoder.encode_decode``) gives them before its
argmax; the class map is ``ArgMax(seg_logits, axis=1)``. The shape is fixed at export
(``--shape``, default the config's crop), as in mmdeploy's static configs: MiTA's landmark
pooling and tile counts are constants of the grid.

MiTA's operator leaves PyTorch as default-domain ONNX operators
(:mod:`mita_seg.ops.onnx`), so ONNX Runtime, OpenVINO or TensorRT run the file with no
custom operator library. The file is written to a temporary name beside ``out``, checked in
ONNX Runtime against the PyTorch model on a seeded input, and renamed to ``out`` only when
they agree within float32 rounding: nothing is left at ``out`` otherwise.
"""
import logging
import os
import os.path as osp
import tempfile
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from mita_seg.models import GridMismatchError
from mita_seg.ops.onnx import OnnxExportError, mita_translation_table
from .config import load_config
from .model import init_model

__all__ = ['OnnxExportError', 'OnnxReport', 'SegLogits', 'export_onnx', 'check_onnx',
           'write_onnx', 'export_shape', 'onnx_session', 'MIN_OPSET']

# The translation of mita_seg::mita_attention uses opset 18 operators (ReduceMax's axes
# input, ScatterElements' reduction).
MIN_OPSET = 18
# Beyond float32 rounding: |ORT - PyTorch| <= ATOL + RTOL * max|PyTorch|.
ATOL, RTOL = 1e-4, 1e-4


class OnnxReport(NamedTuple):
    """What :func:`export_onnx` wrote and how ONNX Runtime's run of it compares.

    Attributes:
        path (str): the ONNX file.
        shape (tuple[int, int]): ``(H, W)`` of the input.
        num_classes (int): channels of ``seg_logits``.
        mita_layers (int): MiTA operators in the graph (as standard ONNX operators).
        max_diff (float): largest ``|ORT - PyTorch|`` over the logits.
        max_ref (float): largest ``|PyTorch|``, the scale of the tolerance.
        class_agreement (float): share of pixels whose argmax class agrees.
        mean (list[float] | None), std (list[float] | None), bgr_to_rgb (bool): the data
            preprocessor's normalization, which the input must have had.
        seconds (float): export time.
    """
    path: str
    shape: Tuple[int, int]
    num_classes: int
    mita_layers: int
    max_diff: float
    max_ref: float
    class_agreement: float
    mean: Optional[List[float]]
    std: Optional[List[float]]
    bgr_to_rgb: bool
    seconds: float

    @property
    def tolerance(self) -> float:
        return ATOL + RTOL * self.max_ref

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance


class SegLogits(nn.Module):
    """A segmentor as the exported graph runs it: ``img`` ``[1, 3, H, W]`` (preprocessed)
    -> ``seg_logits`` ``[1, C, H, W]`` (mmseg's ``encode_decode``: the decode head's logits
    resized to the input)."""

    def __init__(self, segmentor: nn.Module, shape: Tuple[int, int]):
        super().__init__()
        self.segmentor = segmentor
        h, w = shape
        self.metas = [dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w))]

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.segmentor.encode_decode(img, self.metas)


def _require_onnx():
    """onnx, onnxruntime and onnxscript, or an error naming the missing ones."""
    missing = []
    for name in ('onnx', 'onnxruntime', 'onnxscript'):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise OnnxExportError(
            f'exporting to ONNX needs {", ".join(missing)}, which is not installed: pip '
            'install the versions pinned in requirements.txt (onnx, onnxruntime, onnxscript)')


def export_shape(cfg, shape: Optional[Sequence[int]]) -> Tuple[int, int]:
    """``shape`` or the config's crop (``data_preprocessor.size`` or ``crop_size``)."""
    if shape is not None:
        h, w = (int(s) for s in shape)
    else:
        size = (cfg.model.get('data_preprocessor') or {}).get('size') or cfg.get('crop_size')
        if not size:
            raise OnnxExportError('the config names no crop size (data_preprocessor.size or '
                                  'crop_size): give the input shape with --shape H W')
        h, w = (int(s) for s in size)
    if h < 1 or w < 1:
        raise OnnxExportError(f'--shape {h} {w}: height and width must be positive')
    return h, w


def _mita_layers(model: nn.Module) -> int:
    from mita_seg.models import MiTASettingsMixin
    return sum(isinstance(m, MiTASettingsMixin) for m in model.modules())


def onnx_session(path: str, threads: Optional[int] = None):
    """An ONNX Runtime CPU session of ``path`` (``threads`` intra-op threads; None: ORT's
    default, the physical cores)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(path, so, providers=['CPUExecutionProvider'])


def check_onnx(path: str, module: nn.Module, shape: Tuple[int, int], seed: int = 0
               ) -> Tuple[float, float, float, int]:
    """Run ``path`` in ONNX Runtime and ``module`` in PyTorch on one seeded
    ``[1, 3, H, W]`` standard-normal input (a preprocessed image's range).

    Returns:
        tuple: ``(max |ORT - PyTorch|, max |PyTorch|, share of pixels whose argmax class
        agrees, number of classes)``.
    """
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(1, 3, *shape, generator=g)
    with torch.no_grad():
        ref = module(img)
    sess = onnx_session(path)
    out = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: img.numpy()})[0])
    if out.shape != ref.shape:
        raise OnnxExportError(f'the ONNX graph gives {tuple(out.shape)}, PyTorch '
                              f'{tuple(ref.shape)}')
    agree = (out.argmax(1) == ref.argmax(1)).float().mean().item()
    return ((out - ref).abs().max().item(), ref.abs().max().item(), agree, ref.shape[1])


def write_onnx(module: nn.Module, shape: Tuple[int, int], path: str, opset: int = MIN_OPSET,
               table: Optional[dict] = None) -> None:
    """``torch.onnx.export(..., dynamo=True)`` of ``module`` (``img`` ``[1, 3, H, W]`` ->
    ``seg_logits``) to ``path``.

    Args:
        table (dict, optional): the exporter's ``custom_translation_table``; None: MiTA's,
            :func:`mita_seg.ops.onnx.mita_translation_table`. Default: None.

    Raises:
        OnnxExportError: the exporter failed (its first line of the cause).
    """
    img = torch.zeros(1, 3, *shape)
    # the exporter's registry lists every torchvision op it skips: not ours to report
    logging.getLogger('torch.onnx._internal.exporter._registration').setLevel(logging.ERROR)
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                module, (img, ), dynamo=True, opset_version=opset, verbose=False,
                input_names=['img'], output_names=['seg_logits'],
                custom_translation_table=table or mita_translation_table())
    except OnnxExportError:
        raise
    except Exception as e:  # the exporter wraps every failure in its own errors
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, OnnxExportError):
            raise cause from None
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ''
        raise OnnxExportError(f'torch.onnx.export failed at shape {shape[0]}x{shape[1]}: '
                              f'{type(cause).__name__}: {first}') from None
    program.save(path)


def export_onnx(config: str, checkpoint: str, out: str,
                shape: Optional[Sequence[int]] = None,
                mita_cfg: Optional[dict] = None,
                opset: int = MIN_OPSET,
                cfg_options: Optional[dict] = None,
                formulation: str = 'tiles',
                seed: int = 0) -> OnnxReport:
    """Export a segmentor (optionally swapped to MiTA) to ONNX and check it in ONNX Runtime.

    Args:
        config (str): a config file or ``'mmseg::...'``.
        checkpoint (str): its checkpoint (loaded strictly, weights only).
        out (str): the ONNX file to write.
        shape (Sequence[int], optional): input ``(H, W)``; None: the config's crop.
        mita_cfg (dict, optional): swap to MiTA with these ``--mita-cfg`` settings; None:
            the model as its config builds it (a ``configs/mita_*.py`` model is on MiTA).
        opset (int): ONNX opset, at least :data:`MIN_OPSET`. Default: 18.
        cfg_options (dict, optional): ``--cfg-options``.
        formulation (str): MiTA's routed part in ONNX (:data:`mita_seg.ops.onnx.FORMULATIONS`).
        seed (int): seed of the check's input. Default: 0.

    Returns:
        OnnxReport: what was written and how ORT's output compares.

    Raises:
        OnnxExportError: onnx/onnxruntime/onnxscript missing, a bad shape or opset, a model
            that does not run or export at this shape, or ORT disagreeing with PyTorch
            beyond float32 rounding (nothing is left at ``out`` then);
            NothingToSwapError, checkpoint errors: see :func:`init_model`.
    """
    _require_onnx()
    if opset < MIN_OPSET:
        raise OnnxExportError(f'--opset {opset}: the export needs opset {MIN_OPSET} or later')
    if osp.isdir(out):
        raise OnnxExportError(f'--out {out} is a directory: give the .onnx file to write')
    cfg = load_config(config, cfg_options)
    h, w = export_shape(cfg, shape)
    model = init_model(cfg, checkpoint, mita_cfg=mita_cfg)
    module = SegLogits(model, (h, w)).eval()
    img = torch.zeros(1, 3, h, w)
    try:
        with torch.no_grad():
            module(img)
    except GridMismatchError:
        raise
    except (RuntimeError, ValueError, AssertionError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxExportError(f'the model does not run at --shape {h} {w}: {first}') from None
    mean = (cfg.model.get('data_preprocessor') or {}).get('mean')
    std = (cfg.model.get('data_preprocessor') or {}).get('std')
    bgr_to_rgb = bool((cfg.model.get('data_preprocessor') or {}).get('bgr_to_rgb', False))
    out_dir = osp.dirname(osp.abspath(out))
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix='.onnx.part', dir=out_dir)
    os.close(fd)
    try:
        write_onnx(module, (h, w), tmp, opset, mita_translation_table(formulation))
        seconds = time.perf_counter() - t0
        max_diff, max_ref, agree, classes = check_onnx(tmp, module, (h, w), seed)
        report = OnnxReport(out, (h, w), classes, _mita_layers(model), max_diff, max_ref,
                            agree, list(mean) if mean else None, list(std) if std else None,
                            bgr_to_rgb, seconds)
        if not report.ok:
            raise OnnxExportError(
                f'ONNX Runtime disagrees with PyTorch beyond float32 rounding: max |ORT - '
                f'PyTorch| = {max_diff:.3g} > {report.tolerance:.3g}, class agreement '
                f'{100 * agree:.2f}%; nothing written to {out}')
        os.replace(tmp, out)
        return report
    finally:
        for leftover in (tmp, tmp + '.data'):
            if osp.exists(leftover):
                os.remove(leftover)
