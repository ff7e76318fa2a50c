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
custom operator library. The opset is :data:`MIN_OPSET` up to :func:`max_opset`, the highest
that the installed onnx, onnxscript (whose version converter turns the exporter's opset-18
graph into the one asked) and onnxruntime support; every exported file is read back and
must declare the opset asked and pass ``onnx.checker`` (:func:`verify_onnx`), whatever the
check level. The file is written under ``out``'s own name in a temporary folder beside
``out``, checked in ONNX Runtime against the PyTorch model on a seeded input
(:func:`check_onnx`), and moved to ``out`` only when the check passes: nothing is left at
``out`` otherwise. A model whose weights exceed torch's large-model threshold (1.5 GiB) has
them in an external data file, ``<out>.data``, which the ``.onnx`` names: it is moved first,
then the ``.onnx`` (each file ``fsync``-ed, with the user's umask), and the ``.onnx`` is
verified again at ``out``.

MiTA's routing is discontinuous: its top-k and argmax decisions flip at near-ties between two
correct float32 implementations, and a flip grows through the layers, so PyTorch's own
backends differ end to end as much as ONNX Runtime does. The default check
(``check='routing'``) therefore checks MiTA's node and the graph around it apart:

- each MiTA call of the model runs again in ONNX Runtime (the translation of that one node,
  on the call's own ``q, k, v``) and must agree with PyTorch within float32 rounding on
  every query whose routing is decided by more than float32 rounding; the queries at
  near-ties are counted (:func:`mita_seg.ops.onnx.routing_ties`), and those that differ are
  reported as flipped (a call's global tokens are not routed: their rows must always agree);
  a row that is NaN or infinite never passes, near-tie or not;
- end to end, ORT's logits must be finite and are reported beside the model's own noise
  floor (PyTorch's backend against another backend on the same input). Within float32
  rounding, the check passes (the whole graph agrees). Beyond it, a near-tie may explain the
  difference only if the graph around MiTA is right, which is checked without MiTA's
  discontinuity: the model is exported again with MiTA's node translated as a deterministic,
  continuous stand-in (:func:`mita_seg.ops.onnx.stand_in_attention`, which reads ``q``,
  ``k``, ``v`` and the bias table, so every projection feeding the node is in the graph),
  and ONNX Runtime's run of it must agree within float32 rounding (and be finite) with
  PyTorch's model running the same stand-in in place of MiTA's operator (one more export
  and run, only when the end-to-end difference is beyond float32 rounding). A graph wrong
  outside MiTA fails there, whatever the near-ties; one wrong inside MiTA fails the
  per-call comparison on its rows of clear routing. The end-to-end difference itself is not
  bounded by the noise floor: ORT's flips and PyTorch's backends' flips on one input need
  not be alike (docs/deploy.md: Segmenter ViT-S at 1024, 0.1 against a floor of 4e-6).

``check='strict'``: end to end finite and within float32 rounding (the model without
near-ties); ``'none'``: no comparison (the file is still verified by ``onnx.checker``).
"""
import contextlib
import functools
import os
import os.path as osp
import shutil
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from mita_seg.utils.atomic_files import atomic_path
from mita_seg.models import GridMismatchError, swapped_attention_modules
from mita_seg.ops.bias import RelPosBias
from mita_seg.ops.onnx import (OnnxExportError, mita_translation_table, routing_ties,
                               stand_in_attention, stand_in_table)
from mita_seg.utils.stack_noise import quiet_exporter
from .config import load_config
from .model import init_model, physical_memory

__all__ = ['OnnxExportError', 'OnnxReport', 'OnnxCheck', 'LayerCheck', 'StandInCheck',
           'SegLogits', 'export_onnx', 'check_onnx', 'compare_layer', 'write_onnx',
           'export_shape', 'onnx_session', 'run_session', 'export_module', 'verify_onnx',
           'max_opset', 'opset_limits', 'check_opset', 'MIN_OPSET', 'CHECKS']

# The translation of mita_seg::mita_attention uses opset 18 operators (ReduceMax's axes
# input, ScatterElements' reduction).
MIN_OPSET = 18
# Check levels: routing-aware (the default), strict (end to end within float32 rounding),
# none.
CHECKS = ('routing', 'strict', 'none')
# End to end, float32 rounding: |ORT - PyTorch| <= ATOL + RTOL * max|PyTorch|.
ATOL, RTOL = 1e-4, 1e-4
# One MiTA call, per query row: |ORT - PyTorch| <= LAYER_ATOL + LAYER_RTOL * max|PyTorch|.
LAYER_ATOL, LAYER_RTOL = 1e-5, 1e-4


class LayerCheck(NamedTuple):
    """One MiTA call of the model run again in ONNX Runtime on its own ``q, k, v`` (the
    translation of that node alone) against PyTorch's output of the call.

    Attributes:
        name (str): the attention module that made the call.
        rows (int): query rows ``B H N``.
        ties (int): rows whose routing is at a near-tie
            (:func:`mita_seg.ops.onnx.routing_ties`).
        flipped (int): rows at a near-tie whose (finite) outputs differ beyond ``tolerance``.
        mismatched (int): rows of clear routing whose outputs differ beyond ``tolerance``,
            and rows, near-tie or not, with a NaN or infinite value in either output: a
            wrong translation, never a near-tie.
        max_diff (float): largest ``|ORT - PyTorch|`` over the rows of clear routing (NaN
            where one is NaN).
        tolerance (float): ``LAYER_ATOL + LAYER_RTOL * max|PyTorch|`` (its finite values).
        nonfinite (int): rows with a NaN or infinite value in either output (counted in
            ``mismatched``).
    """
    name: str
    rows: int
    ties: int
    flipped: int
    mismatched: int
    max_diff: float
    tolerance: float
    nonfinite: int = 0

    @property
    def ok(self) -> bool:
        return self.mismatched == 0


class StandInCheck(NamedTuple):
    """The model with MiTA's node replaced by the same deterministic stand-in
    (:func:`mita_seg.ops.onnx.stand_in_attention`) in ONNX Runtime and in PyTorch: the graph
    around MiTA, compared end to end with no routing to flip.

    Attributes:
        max_diff (float): largest ``|ORT - PyTorch|`` over the logits (NaN where one is).
        max_ref (float): largest ``|PyTorch|`` (its finite values), the tolerance's scale.
        class_agreement (float): share of pixels whose argmax class agrees.
        nonfinite (tuple[int, int]): NaN or infinite values in ORT's and PyTorch's logits.
    """
    max_diff: float
    max_ref: float
    class_agreement: float
    nonfinite: Tuple[int, int] = (0, 0)

    @property
    def tolerance(self) -> float:
        return ATOL + RTOL * self.max_ref

    @property
    def ok(self) -> bool:
        return self.nonfinite == (0, 0) and self.max_diff <= self.tolerance


class OnnxCheck(NamedTuple):
    """How ONNX Runtime's run of an exported file compares with the PyTorch model.

    Attributes:
        level (str): the check level (:data:`CHECKS`).
        max_diff (float): end to end, largest ``|ORT - PyTorch|`` over the logits (NaN
            where one is NaN).
        max_ref (float): largest ``|PyTorch|`` (its finite values), the scale of the
            tolerance.
        class_agreement (float): share of pixels whose argmax class agrees.
        num_classes (int): channels of the logits.
        layers (tuple[LayerCheck]): each MiTA call (``level='routing'``; else empty).
        noise (tuple | None): ``(backend, other backend, max |diff|, class agreement)``:
            PyTorch's logits with the model's MiTA backend against another backend on the
            same input, the model's own noise floor (``level='routing'`` with MiTA layers).
        nonfinite (tuple[int, int]): NaN or infinite values in ORT's and PyTorch's logits.
        stand_in (StandInCheck | None): the graph around MiTA with MiTA's node replaced by
            a stand-in on both sides (``level='routing'``, run only where the end-to-end
            difference is beyond float32 rounding and near-ties might explain it).
    """
    level: str
    max_diff: float
    max_ref: float
    class_agreement: float
    num_classes: int
    layers: Tuple[LayerCheck, ...] = ()
    noise: Optional[Tuple[str, str, float, float]] = None
    nonfinite: Tuple[int, int] = (0, 0)
    stand_in: Optional[StandInCheck] = None

    @property
    def tolerance(self) -> float:
        return ATOL + RTOL * self.max_ref

    @property
    def ties(self) -> int:
        return sum(layer.ties for layer in self.layers)

    @property
    def flipped(self) -> int:
        return sum(layer.flipped for layer in self.layers)

    @property
    def close(self) -> bool:
        """End to end, both outputs finite and within float32 rounding."""
        return self.nonfinite == (0, 0) and self.max_diff <= self.tolerance

    @property
    def needs_stand_in(self) -> bool:
        """routing: only a near-tie could explain the end-to-end difference, if the graph
        around MiTA is right (the stand-in comparison says whether it is)."""
        return (self.level == 'routing' and self.nonfinite == (0, 0) and not self.close
                and self.ties > 0 and all(layer.ok for layer in self.layers))

    @property
    def ok(self) -> bool:
        """strict: end to end finite and within float32 rounding; routing: every MiTA call
        agrees on its rows of clear routing (and is finite on all), the logits are finite,
        and end to end within float32 rounding, or beyond it with near-ties in MiTA calls
        to explain it and the graph around MiTA within float32 rounding with MiTA's node
        replaced by the stand-in on both sides."""
        if self.close:
            return self.level == 'strict' or all(layer.ok for layer in self.layers)
        return (self.needs_stand_in and self.stand_in is not None and self.stand_in.ok)

    def problem(self) -> Optional[str]:
        """What failed, in one sentence (None if the check passed)."""
        if self.ok:
            return None
        bad = [layer for layer in self.layers if not layer.ok]
        if bad:
            b = bad[0]
            rows = (f'{b.mismatched} query rows differ, {b.nonfinite} of them NaN or '
                    'infinite (near-tie or not), the others of clear routing (no near-tie)'
                    if b.nonfinite else
                    f'{b.mismatched} query rows whose routing is clear (no near-tie) differ')
            return (f'ONNX Runtime\'s translation of MiTA disagrees with PyTorch in {len(bad)} '
                    f'of {len(self.layers)} MiTA calls, first {b.name}: {rows}, max |ORT - '
                    f'PyTorch| = {b.max_diff:.3g} > {b.tolerance:.3g}: a wrong graph, not a '
                    'flipped near-tie')
        ort_bad, ref_bad = self.nonfinite
        if ref_bad:
            return (f'PyTorch\'s own logits hold {ref_bad} NaN or infinite values on the '
                    'check\'s seeded input, so ONNX Runtime\'s cannot be compared with them: '
                    'check the checkpoint (the model gives no finite output)')
        if ort_bad:
            return (f'ONNX Runtime\'s logits hold {ort_bad} NaN or infinite values where '
                    'PyTorch\'s are finite: a wrong graph')
        end = (f'max |ORT - PyTorch| = {self.max_diff:.3g} > {self.tolerance:.3g}, class '
               f'agreement {100 * self.class_agreement:.2f}%')
        si = self.stand_in
        if self.level == 'routing' and si is not None:
            what = (f'{si.nonfinite[0]} NaN or infinite values in ONNX Runtime\'s logits'
                    if si.nonfinite[0] else
                    f'{si.nonfinite[1]} NaN or infinite values in PyTorch\'s logits'
                    if si.nonfinite[1] else
                    f'max |ORT - PyTorch| = {si.max_diff:.3g} > {si.tolerance:.3g}, class '
                    f'agreement {100 * si.class_agreement:.2f}%')
            return (f'ONNX Runtime disagrees with PyTorch outside MiTA: with MiTA\'s node '
                    f'replaced by the same deterministic stand-in in both, {what}; so the '
                    f'end-to-end difference ({end}) is a wrong graph around MiTA, not '
                    f'MiTA\'s {self.ties} near-tied query rows')
        why = ('' if self.level == 'strict' else
               ', and no MiTA call has a near-tie to explain it (a graph outside MiTA '
               'differs)')
        return f'ONNX Runtime disagrees with PyTorch beyond float32 rounding: {end}{why}'

    def summary(self) -> str:
        """The check in one line."""
        end = (f'end to end max |ORT - PyTorch| = {self.max_diff:.2g} (float32 rounding '
               f'{self.tolerance:.2g}), classes agree on {100 * self.class_agreement:.2f}% '
               'of pixels')
        if self.level == 'strict' or not self.layers:
            return end
        rows = sum(layer.rows for layer in self.layers)
        worst = max(layer.max_diff for layer in self.layers)
        tol = min(layer.tolerance for layer in self.layers)
        text = (f'{len(self.layers)} MiTA calls on their own q, k, v: max |ORT - PyTorch| = '
                f'{worst:.2g} where the routing is clear (tolerance {tol:.2g}), '
                f'{self.ties} of {rows} query rows at near-ties ({self.flipped} flipped); '
                + end)
        if self.noise is not None:
            a, b, diff, agree = self.noise
            text += (f'; PyTorch\'s own noise floor ({a} vs {b} backend): {diff:.2g}, '
                     f'{100 * agree:.2f}%')
        if self.stand_in is not None:
            si = self.stand_in
            text += (f'; around MiTA (its node a deterministic stand-in in both): max |ORT - '
                     f'PyTorch| = {si.max_diff:.2g} (float32 rounding {si.tolerance:.2g}), '
                     f'{100 * si.class_agreement:.2f}%')
        return text


class OnnxReport(NamedTuple):
    """What :func:`export_onnx` wrote and how ONNX Runtime's run of it compares.

    Attributes:
        path (str): the ONNX file.
        shape (tuple[int, int]): ``(H, W)`` of the input.
        num_classes (int): channels of ``seg_logits``.
        mita_layers (int): MiTA attention modules in the model (their operators are
            standard ONNX operators in the graph).
        check (OnnxCheck | None): the check (None with ``check='none'``).
        mean (list[float] | None), std (list[float] | None), bgr_to_rgb (bool): the data
            preprocessor's normalization, which the input must have had.
        seconds (float): export time (the check not included).
        data (str | None): the external data file beside ``path`` that holds the weights
            (``path + '.data'``, which the file names: models whose weights exceed torch's
            large-model threshold, 1.5 GiB), or None (the weights are in the file).
    """
    path: str
    shape: Tuple[int, int]
    num_classes: int
    mita_layers: int
    check: Optional[OnnxCheck]
    mean: Optional[List[float]]
    std: Optional[List[float]]
    bgr_to_rgb: bool
    seconds: float
    data: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.check is None or self.check.ok


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


def dense_attention_weights(model: nn.Module, run) -> List[Tuple[str, int]]:
    """The dense attention layers that ``run()`` calls in ``model`` (``nn.MultiheadAttention``
    and its subclasses: mmseg's ViT family, Segmenter's mask head, layers a plan keeps dense)
    and the bytes of the float32 ``[B, H, L, S]`` weights each would hold in ONNX Runtime,
    where attention is MatMul-Softmax-MatMul and the weights are materialised (the scores
    and their softmax: twice that), largest first. A layer is named as its mmcv
    ``MultiheadAttention`` (``decode_head.layers.0.attn``)."""
    sizes: Dict[str, int] = {}

    def hook(name):
        def record(module, args, kwargs):
            q = kwargs.get('query', args[0] if args else None)
            k = kwargs.get('key', args[1] if len(args) > 1 else q)
            if q is None or k is None or q.dim() != 3:
                return
            seq = 1 if module.batch_first else 0
            b = q.shape[1 - seq]
            sizes[name] = max(sizes.get(name, 0),
                              2 * 4 * b * module.num_heads * q.shape[seq] * k.shape[seq])
        return record

    handles = [m.register_forward_pre_hook(hook(n[:-5] if n.endswith('.attn.attn') else n),
                                           with_kwargs=True)
               for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return sorted(sizes.items(), key=lambda item: -item[1])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _ort_max_opset(upper: int) -> int:
    """The highest opset, at most ``upper`` (onnx's own highest: onnx builds the probe), at
    which ONNX Runtime opens a one-node model (``MIN_OPSET - 1`` if none)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper
    so = ort.SessionOptions()
    so.log_severity_level = 4   # a refused opset is the answer, not a warning to print
    for version in range(upper, MIN_OPSET - 1, -1):
        x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in 'xy')
        graph = helper.make_graph([helper.make_node('Identity', ['x'], ['y'])], 'probe',
                                  [x], [y])
        opsets = [helper.make_opsetid('', version)]
        model = helper.make_model(graph, opset_imports=opsets)
        try:
            model.ir_version = helper.find_min_ir_version_for(opsets)
            ort.InferenceSession(model.SerializeToString(), so,
                                 providers=['CPUExecutionProvider'])
        except Exception:   # onnx or ORT does not know this opset: try the one below
            continue
        return version
    return MIN_OPSET - 1


@functools.lru_cache(maxsize=None)
def opset_limits() -> Tuple[Tuple[str, int], ...]:
    """The highest opset each installed package supports for the export: onnx's operator
    schemas (``onnx.defs.onnx_opset_version()``), onnxscript's version converter (the
    exporter builds its graph at opset 18 and converts it with this converter; above its
    range it falls back on onnx's C converter, which fails on these graphs and leaves a file
    that declares opset 18 and holds newer operators) where onnxscript says its range, and
    ONNX Runtime's (the highest opset at which it opens a one-node model).

    Returns:
        tuple: ``(package, highest opset)`` pairs.

    Raises:
        OnnxExportError: onnx, onnxruntime or onnxscript is not installed.
    """
    _require_onnx()
    import onnx
    import onnxruntime
    import onnxscript
    limits = [(f'onnx {onnx.__version__}', int(onnx.defs.onnx_opset_version()))]
    try:
        from onnxscript.version_converter import _version_converter
        top = int(_version_converter.SUPPORTED_MAX_ONNX_OPSET)
    except (ImportError, AttributeError, TypeError, ValueError):
        top = None  # a release that no longer says: the file's opset is verified after saving
    if top is not None:
        limits.append((f'onnxscript {onnxscript.__version__}\'s version converter', top))
    limits.append((f'onnxruntime {onnxruntime.__version__}', _ort_max_opset(limits[0][1])))
    return tuple(limits)


def max_opset() -> int:
    """The highest opset the export writes with the installed onnx, onnxscript and
    onnxruntime (:func:`opset_limits`)."""
    return min(v for _, v in opset_limits())


def check_opset(opset: int) -> None:
    """Refuse an opset the export cannot write: below :data:`MIN_OPSET` or above
    :func:`max_opset`.

    Raises:
        OnnxExportError: the opset is out of range (the message names the range and the
            package that bounds it).
    """
    if isinstance(opset, bool) or not isinstance(opset, int):
        raise OnnxExportError(f'--opset {opset!r}: give an integer opset')
    if opset < MIN_OPSET:
        raise OnnxExportError(f'--opset {opset}: MiTA\'s translation needs opset {MIN_OPSET} '
                              'or later')
    top = max_opset()
    if opset > top:
        bound = [f'{name} goes up to opset {v}' for name, v in opset_limits() if v == top]
        raise OnnxExportError(f'--opset {opset}: {" and ".join(bound)} here; give --opset '
                              f'{MIN_OPSET} to {top}, or upgrade '
                              f'{"that package" if len(bound) == 1 else "those packages"}')


def onnx_session(path: str, threads: Optional[int] = None, arena: bool = True,
                 profile_prefix: Optional[str] = None):
    """An ONNX Runtime CPU session of ``path`` (``threads`` intra-op threads; None: ORT's
    default, the physical cores; ``arena=False``: buffers are given back after each run,
    as a peak memory measurement needs; ``profile_prefix``: ORT's profiler on, its JSON
    file named from this prefix, written by ``end_profiling()``).

    Raises:
        OnnxExportError: ONNX Runtime cannot load the file (its first line of the cause).
    """
    import onnxruntime as ort
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.enable_cpu_mem_arena = arena
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    try:
        return ort.InferenceSession(path, so, providers=['CPUExecutionProvider'])
    except Exception as e:  # ORT's own error classes (Fail, InvalidGraph, ...)
        raise OnnxExportError(f'ONNX Runtime {ort.__version__} cannot load {path}: '
                              f'{type(e).__name__}: {_first_line(e)}') from None


def run_session(sess, feed: Dict, path: str) -> List:
    """``sess.run(None, feed)``; an ONNX Runtime failure as :class:`OnnxExportError`."""
    import onnxruntime as ort
    try:
        return sess.run(None, feed)
    except Exception as e:  # ORT's own error classes
        raise OnnxExportError(f'ONNX Runtime {ort.__version__} fails to run {path}: '
                              f'{type(e).__name__}: {_first_line(e)}') from None


def verify_onnx(path: str, opset: int) -> None:
    """Read ``path`` back: its default-domain opset must be ``opset`` and it must pass
    ``onnx.checker.check_model`` (given the path: a file over 2 GiB is checked, and the
    external data file it names must be there).

    Raises:
        OnnxExportError: another opset (the exporter's conversion failed) or a file the
            checker refuses.
    """
    import onnx
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf's DecodeError, OSError
        raise OnnxExportError(f'the exported file {path} cannot be read back: '
                              f'{_first_line(e)}') from None
    declared = [o.version for o in model.opset_import if o.domain in ('', 'ai.onnx')]
    del model   # the checker reads the file itself
    if declared != [opset]:
        raise OnnxExportError(
            f'the exporter wrote opset {declared[0] if declared else "none"}, not the opset '
            f'{opset} asked (its conversion to opset {opset} failed): give another --opset '
            f'({MIN_OPSET}, the exporter\'s own, needs no conversion)')
    try:
        onnx.checker.check_model(path)
    except Exception as e:  # onnx.checker.ValidationError, the C checker's errors
        raise OnnxExportError(f'the exported file is not valid ONNX (onnx {onnx.__version__}\'s '
                              f'checker): {_first_line(e)}') from None


def export_module(module: nn.Module, inputs: tuple, path: str, opset: int, table: dict,
                  input_names: List[str], output_names: List[str], what: str) -> None:
    """``torch.onnx.export(..., dynamo=True)`` of ``module`` to ``path``, read back by
    :func:`verify_onnx`; an exporter failure as :class:`OnnxExportError` (its first line of
    the cause). Weights over torch's large-model threshold (1.5 GiB) go to
    ``path + '.data'``, which the file names by its base name: keep the two together, under
    these names.

    Raises:
        OnnxExportError: the exporter failed, or wrote a file :func:`verify_onnx` refuses.
    """
    try:    # the exporter's notes a user can do nothing about silenced, not its errors
        with torch.no_grad(), quiet_exporter():
            program = torch.onnx.export(
                module, inputs, dynamo=True, opset_version=opset, verbose=False,
                input_names=input_names, output_names=output_names,
                custom_translation_table=table)
    except OnnxExportError:
        raise
    except Exception as e:  # the exporter wraps every failure in its own errors
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, OnnxExportError):
            raise cause from None
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ''
        raise OnnxExportError(f'torch.onnx.export failed {what}: '
                              f'{type(cause).__name__}: {first}') from None
    program.save(path)
    del program
    verify_onnx(path, opset)


def write_onnx(module: nn.Module, shape: Tuple[int, int], path: str, opset: int = MIN_OPSET,
               table: Optional[dict] = None) -> None:
    """``torch.onnx.export(..., dynamo=True)`` of ``module`` (``img`` ``[1, 3, H, W]`` ->
    ``seg_logits``) to ``path`` (weights over 1.5 GiB to ``path + '.data'``), read back by
    :func:`verify_onnx` (:func:`export_module`).

    Args:
        table (dict, optional): the exporter's ``custom_translation_table`` (MiTA's node
            returns ``[B, N, H, d]``); None: MiTA's,
            :func:`mita_seg.ops.onnx.mita_translation_table`. Default: None.

    Raises:
        OnnxExportError: the exporter failed (its first line of the cause), or wrote
            another opset than ``opset`` or a file ``onnx.checker`` refuses.
    """
    export_module(module, (torch.zeros(1, 3, *shape), ), path, opset,
                  table or mita_translation_table(), ['img'], ['seg_logits'],
                  f'at shape {shape[0]}x{shape[1]}')


# ------------------------------------------------------------------------------- the check
_MITA_OP = 'mita_seg::mita_attention'


class _MiTACalls(TorchDispatchMode):
    """Hands every call of ``torch.ops.mita_seg.mita_attention`` made under it to
    ``on_call(name, arguments, output)``: ``name`` the MiTA module that made it (set by
    forward pre-hooks on the model's MiTA modules), ``arguments`` the operator's arguments
    by name."""

    def __init__(self, model: nn.Module, on_call):
        super().__init__()
        self.on_call = on_call
        self.current = ['?']
        self.hooks = [m.register_forward_pre_hook(
            lambda mod, inp, name=name: self.current.__setitem__(0, name))
            for name, m in swapped_attention_modules(model)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.name == _MITA_OP:
            schema = func._schema.arguments
            named = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                     for i, a in enumerate(schema)}
            self.on_call(self.current[0], named, out)
        return out

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)


class _MiTANode(nn.Module):
    """One MiTA operator call with the settings of a recorded call (``q, k, v`` and the
    bias table are the graph's inputs)."""

    def __init__(self, settings: Dict):
        super().__init__()
        self.settings = settings

    def forward(self, q, k, v, table=None):
        return torch.ops.mita_seg.mita_attention.default(q, k, v, bias_table=table,
                                                         **self.settings)


_TENSORS = ('q', 'k', 'v', 'bias_table')


def _signature(args: Dict) -> tuple:
    table = args['bias_table']
    return (tuple(args['q'].shape), None if table is None else tuple(table.shape)) + tuple(
        (k, v) for k, v in args.items() if k not in _TENSORS)


def compare_layer(name: str, out: torch.Tensor, ref: torch.Tensor, ties: torch.Tensor
                  ) -> LayerCheck:
    """ONNX Runtime's output ``out`` of one MiTA call against PyTorch's ``ref`` (both
    ``[B, H, N, d]``), query row by query row: rows at near-ties (``ties``, ``[B, H, N]``
    bool) may differ (they are counted as flipped), every other row must agree within
    ``LAYER_ATOL + LAYER_RTOL * max|ref|``; a row with a NaN or infinite value in either
    output never agrees, near-tie or not.

    Raises:
        OnnxExportError: ``out`` has another shape than ``ref``.
    """
    if out.shape != ref.shape:
        raise OnnxExportError(f'ONNX Runtime\'s translation of MiTA gives {tuple(out.shape)} '
                              f'in {name}, PyTorch {tuple(ref.shape)}: a wrong graph')
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs().amax(-1)                                   # [B, H, N]
    finite = torch.isfinite(ref)
    tol = LAYER_ATOL + LAYER_RTOL * (ref.abs()[finite].max().item() if finite.any() else 0.0)
    nonfinite = ~(torch.isfinite(out).all(-1) & finite.all(-1))
    differ = ~(diff <= tol)                                             # NaN differs
    clear = ~ties
    return LayerCheck(name, ties.numel(), int(ties.sum()),
                      int((differ & ties & ~nonfinite).sum()),
                      int(((differ & clear) | nonfinite).sum()),
                      diff[clear].max().item() if clear.any() else 0.0, tol,
                      int(nonfinite.sum()))


def _check_layers(module: nn.Module, img: torch.Tensor, table: dict, opset: int,
                  workdir: str) -> Tuple[torch.Tensor, List[LayerCheck], set]:
    """Each MiTA call of ``module(img)`` run again in ONNX Runtime: the translation of that
    one node, exported once per distinct settings, on the call's own inputs.

    Returns:
        tuple: PyTorch's output, a :class:`LayerCheck` per call, the backends that ran.
    """
    calls: Dict[tuple, Dict] = {}

    def record(name, args, out):
        calls.setdefault(_signature(args), args)

    with torch.no_grad(), _MiTACalls(module, record):
        module(img)
    sessions = {}
    for i, (key, args) in enumerate(calls.items()):
        settings = {k: v for k, v in args.items() if k not in _TENSORS}
        inputs = tuple(torch.zeros_like(args[n]) for n in ('q', 'k', 'v'))
        names = ['q', 'k', 'v']
        if args['bias_table'] is not None:
            inputs += (torch.zeros_like(args['bias_table']), )
            names.append('table')
        path = osp.join(workdir, f'mita_call_{i}.onnx')
        export_module(_MiTANode(settings).eval(), inputs, path, opset, table, names,
                      ['out'], f'on a MiTA call of q {tuple(args["q"].shape)}')
        sessions[key] = (onnx_session(path), names)

    checks, backends = [], set()

    def check(name, args, ref):
        sess, names = sessions[_signature(args)]
        feed = {n: args[t].detach().float().numpy() for n, t in zip(names, _TENSORS)}
        out = torch.from_numpy(run_session(sess, feed, f'the MiTA call of {name}')[0])
        bias = None if args['bias_table'] is None else RelPosBias(
            args['bias_table'], (args['window_h'], args['window_w']))
        ties = routing_ties(args['q'], args['k'], (args['h'], args['w']),
                            (args['ph'], args['pw']), args['topk'], args['router_topk'],
                            args['num_prefix_tokens'], args['shared_scale'], bias,
                            global_tokens=(args['global_prefix'], args['global_suffix']))
        # the op's output (PyTorch's and the node's) is [B, N, H, d]: compared as [B, H, N, d]
        checks.append(compare_layer(name, out.transpose(1, 2), ref.transpose(1, 2), ties))
        backends.add(args['backend'])

    with torch.no_grad(), _MiTACalls(module, check):
        ref = module(img)
    return ref, checks, backends


@contextlib.contextmanager
def _backend(name: str):
    """Every MiTA call on backend ``name`` (``$MITA_BACKEND``) inside."""
    old = os.environ.get('MITA_BACKEND')
    os.environ['MITA_BACKEND'] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ['MITA_BACKEND']
        else:
            os.environ['MITA_BACKEND'] = old


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(1) == b.argmax(1)).float().mean().item()


def _compare(out: torch.Tensor, ref: torch.Tensor
             ) -> Tuple[float, float, float, Tuple[int, int]]:
    """``(max |out - ref|, max |ref| over its finite values, class agreement, (non-finite
    values of out, of ref))``; the first is NaN where either holds a NaN."""
    finite = torch.isfinite(ref)
    max_ref = ref.abs()[finite].max().item() if finite.any() else 0.0
    return ((out - ref).abs().max().item(), max_ref, _agreement(out, ref),
            (int((~torch.isfinite(out)).sum()), int((~finite).sum())))


class _StandIn(TorchDispatchMode):
    """Every call of ``torch.ops.mita_seg.mita_attention`` made under it answers
    :func:`mita_seg.ops.onnx.stand_in_attention` of its ``q, k, v`` and bias table, as the
    stand-in table's export (:func:`mita_seg.ops.onnx.stand_in_table`) computes it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name != _MITA_OP:
            return func(*args, **kwargs)
        named = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                 for i, a in enumerate(func._schema.arguments)}
        return stand_in_attention(named['q'], named['k'], named['v'], named['bias_table'])


def _ort_logits(path: str, img: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """ONNX Runtime's output of ``path`` on ``img``, which must have ``ref``'s shape."""
    sess = onnx_session(path)
    out = torch.from_numpy(run_session(sess, {sess.get_inputs()[0].name: img.numpy()},
                                       path)[0])
    if out.shape != ref.shape:
        raise OnnxExportError(f'the ONNX graph gives {tuple(out.shape)}, PyTorch '
                              f'{tuple(ref.shape)}')
    return out


def _check_stand_in(module: nn.Module, img: torch.Tensor, table: dict, opset: int,
                    workdir: str) -> StandInCheck:
    """``module`` with MiTA's node replaced by the stand-in, exported (the other entries of
    ``table`` kept) and run in ONNX Runtime, against PyTorch's run under :class:`_StandIn`."""
    path = osp.join(workdir, 'stand_in.onnx')
    export_module(module, (torch.zeros_like(img), ), path, opset, stand_in_table(table),
                  ['img'], ['seg_logits'], 'with MiTA\'s node as the check\'s stand-in')
    with torch.no_grad(), _StandIn():
        ref = module(img)
    return StandInCheck(*_compare(_ort_logits(path, img, ref), ref))


def check_onnx(path: str, module: nn.Module, shape: Tuple[int, int], seed: int = 0,
               level: str = 'routing', table: Optional[dict] = None,
               opset: int = MIN_OPSET) -> OnnxCheck:
    """Run ``path`` in ONNX Runtime and ``module`` in PyTorch on one seeded
    ``[1, 3, H, W]`` standard-normal input (a preprocessed image's range) and compare them
    at ``level`` (:data:`CHECKS`; see the module's docstring).

    Args:
        table (dict, optional): the translation table the file was exported with (the
            routing-aware check exports each MiTA call with it, and the model with MiTA's
            entry replaced by the stand-in where it needs to); None: MiTA's.
        opset (int): opset of those exports. Default: 18.

    Returns:
        OnnxCheck: the comparison (its ``ok``, ``problem()`` and ``summary()``).

    Raises:
        OnnxExportError: a bad level, an export of the check's own that fails, a file that
            ONNX Runtime cannot load or run, or logits of another shape than PyTorch's.
    """
    if level not in CHECKS[:2]:
        raise OnnxExportError(f'check level {level!r}: choose one of {CHECKS[:2]}')
    table = table or mita_translation_table()
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(1, 3, *shape, generator=g)
    layers, noise = [], None
    with tempfile.TemporaryDirectory(prefix='mita-onnx-check-') as workdir:
        if level == 'routing' and swapped_attention_modules(module):
            ref, layers, backends = _check_layers(module, img, table, opset, workdir)
        else:
            with torch.no_grad():
                ref = module(img)
            backends = set()
        if backends:
            used = '/'.join(sorted(backends))
            other = 'blocked' if backends != {'blocked'} else 'reference'
            with torch.no_grad(), _backend(other):
                alt = module(img)
            noise = (used, other, (alt - ref).abs().max().item(), _agreement(alt, ref))
        max_diff, max_ref, agree, nonfinite = _compare(_ort_logits(path, img, ref), ref)
        result = OnnxCheck(level, max_diff, max_ref, agree, ref.shape[1], tuple(layers),
                           noise, nonfinite)
        if result.needs_stand_in:
            result = result._replace(
                stand_in=_check_stand_in(module, img, table, opset, workdir))
    return result


@contextlib.contextmanager
def _staged(out: str):
    """A path to write the ONNX file to: ``out``'s own base name in a new temporary folder
    beside ``out``, so that the external data file the exporter may write beside it
    (``<name>.data``) has the name the file refers to at ``out`` too. When the block ends
    without an exception, the data file (if any) replaces ``out + '.data'``, then the file
    replaces ``out`` (each ``fsync``-ed, with :func:`~mita_seg.engine.atomic_io.atomic_path`'s
    mode and directory ``fsync``); the folder is removed in any case.

    Yields:
        str: the path to write.
    """
    out = osp.abspath(out)
    dirname, name = osp.split(out)
    os.makedirs(dirname, exist_ok=True)
    stage = tempfile.mkdtemp(dir=dirname, prefix=f'.{name}.', suffix='.part')
    tmp = osp.join(stage, name)
    try:
        yield tmp
        moves = [(tmp + '.data', out + '.data')] if osp.exists(tmp + '.data') else []
        for src, dst in moves + [(tmp, out)]:    # the data first: the file then names it
            with atomic_path(dst, suffix='.part') as part:
                os.replace(src, part)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def export_onnx(config: str, checkpoint: str, out: str,
                shape: Optional[Sequence[int]] = None,
                mita_cfg: Optional[dict] = None,
                opset: int = MIN_OPSET,
                cfg_options: Optional[dict] = None,
                formulation: str = 'tiles',
                seed: int = 0,
                check: str = 'routing',
                table: Optional[dict] = None) -> OnnxReport:
    """Export a segmentor (optionally swapped to MiTA) to ONNX and check it in ONNX Runtime.

    Args:
        config (str): a config file or ``'mmseg::...'``.
        checkpoint (str): its checkpoint (loaded strictly, weights only).
        out (str): the ONNX file to write.
        shape (Sequence[int], optional): input ``(H, W)``; None: the config's crop.
        mita_cfg (dict, optional): swap to MiTA with these ``--mita-cfg`` settings (or
            ``{'plan': SwapPlan}``); None: the model as its config builds it (a
            ``configs/mita_*.py`` model is on MiTA).
        opset (int): ONNX opset, :data:`MIN_OPSET` to :func:`max_opset`. Default: 18.
        cfg_options (dict, optional): ``--cfg-options``.
        formulation (str): MiTA's routed part in ONNX (:data:`mita_seg.ops.onnx.FORMULATIONS`).
        seed (int): seed of the check's input. Default: 0.
        check (str): ``'routing'`` (each MiTA call against PyTorch with near-ties told apart;
            end to end within float32 rounding, or beyond it with near-ties and the graph
            around MiTA within float32 rounding with MiTA's node replaced by a stand-in on
            both sides), ``'strict'`` (end to end within float32 rounding) or ``'none'``
            (``onnx.checker`` only). Default: 'routing'.
        table (dict, optional): the exporter's ``custom_translation_table`` (MiTA's node
            returns ``[B, N, H, d]``); None: MiTA's translation
            (:func:`mita_seg.ops.onnx.mita_translation_table` of ``formulation``).
            Default: None.

    Returns:
        OnnxReport: what was written and how ORT's output compares.

    Raises:
        OnnxExportError: onnx/onnxruntime/onnxscript missing, a bad shape, opset (outside
            :data:`MIN_OPSET` to :func:`max_opset`) or check level, a model that does not
            run or export at this shape, a file that declares another opset or that
            ``onnx.checker`` or ONNX Runtime refuses, or a check that fails (nothing is left
            at ``out`` then);
            NothingToSwapError, checkpoint errors: see :func:`init_model`.
    """
    _require_onnx()
    check_opset(opset)
    if check not in CHECKS:
        raise OnnxExportError(f'check level {check!r}: choose one of {", ".join(CHECKS)}')
    if osp.isdir(out):
        raise OnnxExportError(f'--out {out} is a directory: give the .onnx file to write')
    cfg = load_config(config, cfg_options)
    h, w = export_shape(cfg, shape)
    model = init_model(cfg, checkpoint, mita_cfg=mita_cfg, img_size=(h, w))
    module = SegLogits(model, (h, w)).eval()
    run = {}
    try:
        with torch.no_grad():
            dense = dense_attention_weights(
                model, lambda: run.setdefault('logits', module(torch.zeros(1, 3, h, w))))
    except GridMismatchError:
        raise
    except (RuntimeError, ValueError, AssertionError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxExportError(f'the model does not run at --shape {h} {w}: {first}') from None
    logits, memory = run['logits'], physical_memory()
    if dense and memory and check != 'none' and dense[0][1] > memory / 2:
        names = [n for n, _ in dense]
        raise OnnxExportError(
            f'--shape {h} {w}: the dense attention of {names[0]}'
            f'{f" (and {len(names) - 1} more)" if len(names) > 1 else ""} would hold '
            f'{dense[0][1] / 2**30:.1f} GiB of attention weights in ONNX Runtime '
            '(MatMul-Softmax-MatMul: the scores and their softmax, float32), over half of '
            f'this machine\'s {memory / 2**30:.0f} GiB, so the check could not run it. Put '
            'those layers on MiTA too (--mita-cfg include_head=True for a Segmenter\'s '
            'mask head, or a plan without them dense), export a smaller --shape, or '
            '--check none to write the file unchecked for a larger machine')
    table = table or mita_translation_table(formulation)
    pre = cfg.model.get('data_preprocessor') or {}
    mean, std = pre.get('mean'), pre.get('std')
    t0 = time.perf_counter()
    with _staged(out) as tmp:   # the user's umask, whole or not at all, data and file
        write_onnx(module, (h, w), tmp, opset, table)
        seconds = time.perf_counter() - t0
        result = None
        if check != 'none':
            result = check_onnx(tmp, module, (h, w), seed, check, table, opset)
            if not result.ok:
                raise OnnxExportError(f'{result.problem()}; nothing written to {out}')
        data = osp.exists(tmp + '.data')
    if data:    # the file at out names its weights' file: read back from there
        try:
            verify_onnx(out, opset)
        except OnnxExportError as e:
            for f in (out, out + '.data'):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f)
            raise OnnxExportError(f'{e} (at {out}: removed with its data)') from None
    return OnnxReport(out, (h, w), logits.shape[1], len(swapped_attention_modules(model)), result,
                      list(mean) if mean else None, list(std) if std else None,
                      bool(pre.get('bgr_to_rgb', False)), seconds,
                      out + '.data' if data else None)
