"""What the ONNX translation's two parts share (:mod:`mita_seg.ops.onnx`, the entry point,
and :mod:`.graph`, which builds the graph): the formulations, the tie tolerance, the error, the
landmarks' averaging matrices, the tile size and why a call cannot be translated. Torch and
numpy only; both parts import it, it imports neither."""
from typing import List, Tuple

import numpy as np
import torch

from ..blocked import default_block_size

__all__ = ['OnnxExportError', 'FORMULATIONS', 'TIE_RTOL', 'pool_matrix', 'onnx_unsupported',
           'onnx_block_size']

FORMULATIONS = ('tiles', 'gather')
# A routing decision is a near-tie when its margin is at most this share of the largest
# |score| (|router logit|) of its batch item and head: float32 rounding of the scores is
# about 1e-7 of them, so two correct implementations may decide such a row either way.
TIE_RTOL = 1e-5


class OnnxExportError(ValueError):
    """A MiTA call (or an environment) the ONNX translation cannot export; the message says
    what to change."""


def pool_matrix(hw_shape: Tuple[int, int], pool_size: Tuple[int, int]) -> np.ndarray:
    """``[Ph*Pw, h*w]`` float32: row ``m`` averages landmark ``m``'s region of the row-major
    grid, the regions of ``adaptive_avg_pool2d`` (``[floor(i h / P), ceil((i + 1) h / P))``)."""
    (h, w), (ph, pw) = hw_shape, pool_size
    P = np.zeros((ph, pw, h, w), np.float32)
    for i in range(ph):
        r0, r1 = (i * h) // ph, -(-((i + 1) * h) // ph)
        for j in range(pw):
            c0, c1 = (j * w) // pw, -(-((j + 1) * w) // pw)
            P[i, j, r0:r1, c0:c1] = 1.0 / ((r1 - r0) * (c1 - c0))
    return P.reshape(ph * pw, h * w)


def onnx_block_size(num_tokens: int, router_topk: int, num_experts: int) -> int:
    """Tile size ``T`` of the ONNX graph: four times the blocked backend's choice
    (:func:`~mita_seg.ops.blocked.default_block_size`), in ``[8, 64]`` (16 at N = 1025, 64 at
    N = 4097 with 49 experts): ONNX Runtime runs a batched MatMul as one small GEMM per tile,
    whose call costs more than padding slots."""
    return int(min(64, max(8, 4 * default_block_size(num_tokens * router_topk, num_experts))))


def onnx_unsupported(dtype: torch.dtype, shape: Tuple[int, ...]) -> List[str]:
    """Why a MiTA call of these inputs cannot be translated (empty when it can)."""
    why = []
    if dtype != torch.float32:
        why.append(f'the ONNX translation runs float32 inputs, got {dtype}: export the '
                   'model in float32')
    if len(shape) != 4 or not all(isinstance(s, int) for s in shape):
        why.append(f'the ONNX translation needs static shapes [B, H, N, d], got {shape}: '
                   'export with a fixed input shape (no dynamic_shapes)')
    return why
