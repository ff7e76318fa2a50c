"""What an ideal predictor that sees only so far scores on the long-range scenes
(:mod:`mita_seg.datasets.longrange_scenes`): the ceiling of a model by the evidence it can
reach, docs/longrange_data.md's "What a local model can reach".

The predictor recognises every texture, object and pole perfectly. A token (a cell of the
32 x 32 grid) *reaches* the cells within ``reach`` cells of it (Chebyshev distance: a 3 x 3
attention window in L layers reaches L cells; 0 is a token alone; None is everything). A
background pixel is right when its cell reaches the cue, a plain object's pixel when its cell
reaches the partner (and ``retrieval`` is allowed); otherwise the predictor guesses among the
classes the pixel's appearance allows: ``'fixed'`` always the first (cue 0's class, car),
``'random'`` uniformly per pixel (``rng``).
"""
from typing import Iterable, Optional

import cv2
import numpy as np

from mita_seg.datasets.longrange_scenes import (CLASS_TABLE, GRID, OBJECT_CLASSES, Scene,
                                                classes, cue_mask, object_masks, partner,
                                                render_scene)

__all__ = ['reach_cells', 'ideal_prediction', 'ideal_miou']


def reach_cells(mask: np.ndarray, size: int) -> np.ndarray:
    """``[size, size]`` float: for every pixel, the Chebyshev distance in cells from its cell
    to the nearest cell holding a pixel of ``mask`` (inf when ``mask`` is empty)."""
    cell = size // GRID
    cells = mask.reshape(GRID, cell, GRID, cell).any(axis=(1, 3))
    if not cells.any():
        return np.full((size, size), np.inf)
    dist = cv2.distanceTransform((~cells).astype(np.uint8), cv2.DIST_C, 3)
    return np.kron(dist, np.ones((cell, cell), np.float32))


def ideal_prediction(scene: Scene, reach: Optional[int] = None, retrieval: bool = True,
                     guess: str = 'fixed',
                     rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """``[size, size]`` uint8 labels the ideal predictor gives ``scene`` (module docstring)."""
    if guess not in ('fixed', 'random'):
        raise ValueError(f"guess must be 'fixed' or 'random', got {guess!r}")
    rng = rng or np.random.default_rng(0)
    _, label = render_scene(scene)
    pred = label.copy()
    far = np.inf if reach is None else reach
    # background: right within reach of the cue, else a guess among its texture's classes
    if scene.cue is not None:
        blind = reach_cells(cue_mask(scene), scene.size) > far
        for row in CLASS_TABLE.values():
            options = np.array(row[:scene.cues])
            m = blind & (label == row[scene.cue])
            pick = 0 if guess == 'fixed' else rng.integers(len(options), size=int(m.sum()))
            pred[m] = options[pick]
    # plain objects: right within reach of the partner (with retrieval), else a guess
    options = np.array(list(OBJECT_CLASSES.values()))
    masks = object_masks(scene)
    for obj, mask in zip(scene.objects, masks):
        if obj.texture is not None:
            continue
        key = masks[scene.objects.index(partner(scene, obj))]
        blind = mask & (reach_cells(key, scene.size) > far) if retrieval else mask
        pick = 0 if guess == 'fixed' else rng.integers(len(options), size=int(blind.sum()))
        pred[blind] = options[pick]
    return pred


def ideal_miou(scenes: Iterable[Scene], reach: Optional[int] = None, retrieval: bool = True,
               guess: str = 'fixed', seed: int = 0) -> float:
    """mIoU (percent, over the classes the scenes can hold; label 0 ignored) of
    :func:`ideal_prediction` over ``scenes``, accumulated as mmseg's IoUMetric does."""
    rng = np.random.default_rng(seed)
    scenes = list(scenes)
    names = classes(scenes[0].kinds, scenes[0].cues)
    inter, union = np.zeros(len(names)), np.zeros(len(names))
    for scene in scenes:
        label = render_scene(scene)[1]
        pred = ideal_prediction(scene, reach, retrieval, guess, rng)
        valid = label > 0
        for i, c in enumerate(names):
            a, b = (label == c) & valid, (pred == c) & valid
            inter[i] += (a & b).sum()
            union[i] += (a | b).sum()
    present = union > 0
    return float(100 * np.mean(inter[present] / union[present]))
