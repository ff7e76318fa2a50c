"""Scenes in ADE20K's exact layout whose labels need long-range evidence (written by
``tools/dataset/make_longrange_ade20k.py``).

::

    OUT/images/{training,validation}/ADE_{train,val}_%08d.jpg   RGB, SIZE x SIZE
    OUT/annotations/{training,validation}/ADE_{train,val}_%08d.png   uint8 labels

Labels follow ADEChallengeData2016, as ``make_tiny_ade20k.py``: 0 is "other" (ignored through
``reduce_zero_label``; here only the cue), 1..150 are the ADE20K classes. Same arguments,
same files, byte for byte (each image is drawn from its own seed ``(seed, split, index)``, so
the first images of a longer run are the images of a shorter one); files are written whole
(:mod:`mita_seg.utils.atomic_files`: a temporary file, then renamed).

Why (issue 43): in ``make_tiny_ade20k.py`` every class has its own colour and texture, so a
token's own pixels decide its label and any swap of attention, even one with no token mixing
at all, looks free. Here the local appearance of most pixels is ambiguous: the same pixels
take two (or three) classes depending on evidence elsewhere in the image.

Distances are given in *cells* of a 32 x 32 grid laid over the image (``size / 32`` pixels):
at the default ``--size 256`` a cell is one 8 x 8 patch of the swap study's Segmenter ViT-T
(``configs/baselines/segmenter_vit-tiny_mask_1xb4_tiny-ade20k-256x256.py``: 256 x 256 input,
patch 8, N = 32 * 32 + 1 = 1025 tokens, the token count of ViT-T at 512 x 512 with patch 16).

A scene (:func:`sample_scene` draws a :class:`Scene`, an explicit description;
:func:`render_scene` draws it; :func:`make_scene` does both) mixes these kinds
(``--kinds``, default all three):

``global`` -- global context. The background (about 85 % of the pixels) is a patchwork of 4-7
    large regions (a warped Voronoi partition), each a grey-ish tone (random, carrying no class
    information) times one of three textures: horizontal stripes, vertical stripes, checker
    (period 6 or 8 px, so an 8 x 8 patch shows it). One small *cue*, 6 x 6 cells (48 x 48 px;
    3 x 3 in layout ``v1``) anywhere in the image (clear of the objects), decides what every
    texture means:

    ==========  ======================  ======================  =====================
    texture     cue 0: cyan square      cue 1: magenta disc     cue 2: black diamond
    ==========  ======================  ======================  =====================
    hstripes    road (7)                floor (4)               sand (47)
    vstripes    building (2)            wall (1)                sea (27)
    checker     tree (5)                curtain (19)            rock (35)
    ==========  ======================  ======================  =====================

    (``--cues 2``, the default, uses the first two cues; ``--cues 3`` all three.) A region's
    label depends on its own texture *and* on 36 tokens somewhere else: a labelled pixel is on
    average 14 cells (110 px at 256 x 256) from the cue, 75 % of them more than 8 cells and
    57 % more than 12 (``v1``: 9 tokens; 15 cells, 80 %, 64 %). The cue itself is labelled 0
    (ignored). Nothing else in the scene depends on the cue: re-drawing a scene with another
    cue changes the cue's pixels and the label of every background pixel, and nothing else.
    Without ``global`` there is no cue and each texture has its cue-0 class.

``retrieval`` -- query-specific retrieval. Pairs of objects (irregular polygons; layout
    ``v4``, the default, and ``v3``: radius 4-5.5 cells textured, 3.5-5 plain, 2 pairs in 9
    scenes of 10, 3 where they fit; ``v2``: 2.5-4 textured, 3.5-5.5 plain, 3 pairs, 2 where a
    third does not fit; ``v1``: 2-3 pairs, radius 3-5) in saturated hues (red, yellow, green,
    blue; each hue for one pair at most): a *textured* object, whose texture gives its class
    (hstripes car (21), vstripes person (13), checker bed (8), whatever the cue), and a
    *plain* object, a flat patch of the same hue, which takes the class of the textured object
    of its hue. A plain object is at least 8 cells (64 px) from its partner, edge to edge (14
    cells on average, 20 centre to centre), and half of the scenes add a textured object of a
    hue no plain object has (a distractor). Hues are given to objects at random in every
    scene, so a plain object's own pixels say nothing about its class (any of the 3), and each
    plain object needs a different distant key: the textured object of *its* hue. Without
    ``retrieval``, 1-3 textured objects and no plain ones.

``detail`` -- fine detail. 1-3 thin *poles* (pole, 94): near-white straight bars, 10-28 cells
    long, at any angle, under the objects, 2-3 px wide in ``v4`` (a quarter to under half a
    cell; ``v3`` 2-4 px; ``v1``, ``v2`` 4-7 px); region boundaries are warped (``v4``:
    fingers, waves 2-3 cells high and 1.5-2.5 cells long, finer than a patch-8 model's output
    resolves; earlier layouts: smooth waves of 1-1.5 cells, 6-12 long) and objects are
    irregular, so a model that only sees coarse pooled tokens loses boundary and pole pixels.
    The poles' class is decidable locally. Without ``detail``: no poles, straight Voronoi
    boundaries.

With all kinds and ``--cues 2`` the labels are 1, 2, 4, 5, 7, 19 (background, 13-16 % of the
labelled pixels each), 8, 13, 21 (objects, 4-5 % each in ``v3``/``v4``, 3.5-4.5 % in ``v2``)
and 94 (poles, 1.6 % in ``v3``, 2.5 % in ``v2``). A model that recognises every texture but
cannot see the cue gets a background pixel far from the cue right one time in two, and a plain
object one time in three; ideal predictors score (:mod:`mita_seg.analysis.longrange_ceiling`;
mIoU over the 10 classes, 200 validation scenes, fixed and random guesses; ``v2``): perfect
100, cue but no retrieval 82.5-82.7 (``v3``: 87.1-87.2), no token mixing (a token sees its own
patch) 37.0-43.1, 3 x 3-patch attention windows in 4 (6) layers, which reach the cue from 4
(6) cells away, 42.6-47.1 (45.7-49.4).

Layouts (``--layout``, :data:`LAYOUTS`): ``v4``, the default, as above; ``v3``, ``v2``,
``v1`` (the first scenes), each byte for byte as first written (docs/longrange_data.md: what
a Segmenter ViT-T learns on each, and when).

Training-time note: mmseg's ``RandomResize`` + ``RandomCrop`` (the 256 x 256 configs resize by
0.75-1.5 and crop 256) crops the cue wholly out of about 1 training crop in 7 (and more than
half of it out of 1 in 5), and a plain object's partner out of about 1 in 12: those crops'
labels are then noise. Validation and test images are whole.

Usage::

    python tools/dataset/make_longrange_ade20k.py --out data/ade/longrange_ade20k \\
        --train 2400 --val 200 --size 256
    python tools/dataset/make_longrange_ade20k.py --kinds global,detail   # cue only
    python tools/dataset/make_longrange_ade20k.py --layout v1   # the first scenes
    python tools/dataset/make_longrange_ade20k.py --preview docs/figures/longrange_scenes.png
"""
import json
import os
import os.path as osp
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

import cv2
import numpy as np

from mita_seg.datasets.ade_layout import scene_name
from mita_seg.utils.atomic_files import atomic_write_image, atomic_write_text
from mita_seg.utils.errors import InputError

KINDS = ('global', 'retrieval', 'detail')
GRID = 32                      # cells per image side (the study's 32 x 32 patch grid)
TEXTURES = ('hstripes', 'vstripes', 'checker')
# texture -> ADE20K label (1-based, as in the PNGs) under cue 0, 1, 2
CLASS_TABLE = {
    'hstripes': (7, 4, 47),    # road, floor, sand
    'vstripes': (2, 1, 27),    # building, wall, sea
    'checker': (5, 19, 35),    # tree, curtain, rock
}
# texture -> ADE20K label of an object (saturated hue, textured or plain): no cue needed
OBJECT_CLASSES = {'hstripes': 21, 'vstripes': 13, 'checker': 8}   # car, person, bed
POLE = 94
CLASS_NAMES = {1: 'wall', 2: 'building', 4: 'floor', 5: 'tree', 7: 'road', 8: 'bed',
               13: 'person', 19: 'curtain', 21: 'car', 27: 'sea', 35: 'rock', 47: 'sand',
               94: 'pole'}
# cue: (name, RGB, shape)
CUES = (('cyan square', (0, 225, 225), 'square'), ('magenta disc', (225, 0, 225), 'disc'),
        ('black diamond', (15, 15, 15), 'diamond'))
# saturated object hues (far from the cue colours and from the grey-ish background tones)
HUES = ((210, 45, 45), (215, 195, 40), (45, 165, 70), (50, 90, 215))
HUE_NAMES = ('red', 'yellow', 'green', 'blue')
POLE_RGB = (235, 235, 235)
DARK = 0.55                    # the dark half of a texture, times the tone
MIN_PAIR_GAP = 8.0             # plain object to its textured partner, edge to edge, in cells
NOISE_SD = 4.0


@dataclass(frozen=True)
class Layout:
    """Sizes and counts of a scene's evidence: the cue's side (cells), how many
    plain/textured pairs (``(lo, hi)``, inclusive), and the radii (cells) of textured and plain
    objects (``(lo, hi)``, uniform), the poles' width (cells, ``(lo, hi)``, uniform; at
    least 2 pixels), and the amplitude and wavelength (cells, ``(lo, hi)``, uniform) of the
    waves that warp region boundaries."""
    cue_cells: int
    pairs: Tuple[int, int]
    textured_radius: Tuple[float, float]
    plain_radius: Tuple[float, float]
    pole_width: Tuple[float, float] = (0.5, 0.9)
    warp_amplitude: Tuple[float, float] = (1.0, 1.5)
    warp_wavelength: Tuple[float, float] = (6.0, 12.0)


LAYOUTS = {
    # the first scenes: a 3 x 3 cue (9 of 1024 tokens) is found after a plateau whose length
    # the training seed decides (iteration 460-980), 2-3 pairs of equal objects
    'v1': Layout(3, (2, 3), (3.0, 5.0), (3.0, 5.0)),
    # a 6 x 6 cue (36 tokens, 3.5 % of the image) is found at iteration ~300; 3 pairs, the
    # plain objects larger than their partners; retrieval is learned late, at a time the
    # seed decides (1200 to over 1600)
    'v2': Layout(6, (3, 3), (2.5, 4.0), (3.5, 5.5)),
    # textured partners larger (more keys to find), poles 2-4 px (under half a patch):
    # retrieval is learned at 900-1200 on every seed; the model then saturates (~91 mIoU)
    'v3': Layout(6, (3, 3), (4.0, 5.5), (3.5, 5.0), (0.25, 0.5)),
    # the default: v3 with region boundaries in fingers finer than a patch (waves of 2-3
    # cells, 1.5-2.5 cells long) and poles 2-3 px, which a patch-8 model cannot resolve
    'v4': Layout(6, (3, 3), (4.0, 5.5), (3.5, 5.0), (0.25, 0.4), (2.0, 3.0), (1.5, 2.5)),
}
DEFAULT_LAYOUT = 'v4'   # the generator's default, the one the long-range configs' schedule is for


@dataclass(eq=False)
class Region:
    """A background region: ``rgb`` tone times ``texture`` (period and phase in pixels)."""
    texture: str
    rgb: Tuple[float, float, float]
    period: int
    phase: Tuple[int, int]


@dataclass(eq=False)
class Obj:
    """An object: a polygon (``points``, int pixels) in hue ``hue`` (index into HUES), its
    jittered colour ``rgb``; textured (``texture`` set) or plain (``texture`` None)."""
    points: np.ndarray
    centre: Tuple[float, float]
    radius: float
    hue: int
    rgb: Tuple[float, float, float]
    texture: Optional[str] = None
    period: int = 6
    phase: Tuple[int, int] = (0, 0)


@dataclass(eq=False)
class Bar:
    """A pole from ``p1`` to ``p2`` (pixels), ``width`` pixels wide."""
    p1: Tuple[int, int]
    p2: Tuple[int, int]
    width: int
    rgb: Tuple[float, float, float]


@dataclass(eq=False)
class Scene:
    """Everything :func:`render_scene` needs: a scene is drawn from this alone.

    ``cue`` is the cue's index (None without the ``global`` kind), ``cue_xy`` its top-left
    corner and ``cue_side`` its side in pixels; ``seeds`` the Voronoi seeds of the regions
    (pixels, ``[k, 2]`` as x, y), ``warp`` the boundary waves ``(amplitude, wavelength,
    phase_x, phase_y)`` in pixels/radians; ``noise_seed`` seeds the pixel noise, drawn for the
    whole image whatever the content."""
    size: int
    kinds: Tuple[str, ...]
    cues: int
    cue: Optional[int]
    cue_xy: Tuple[int, int]
    cue_side: int
    seeds: np.ndarray
    warp: Tuple[float, float, float, float]
    regions: List[Region]
    bars: List[Bar] = field(default_factory=list)
    objects: List[Obj] = field(default_factory=list)
    noise_seed: int = 0


def class_of(texture: str, cue: Optional[int]) -> int:
    """The ADE20K label of a background region of ``texture`` under ``cue`` (cue 0 when there
    is no cue)."""
    return CLASS_TABLE[texture][0 if cue is None else cue]


def background_classes(kinds: Sequence[str] = KINDS, cues: int = 2) -> List[int]:
    """The labels of background regions (the ones the cue decides)."""
    cols = range(cues) if 'global' in kinds else range(1)
    return sorted({CLASS_TABLE[t][c] for t in TEXTURES for c in cols})


def classes(kinds: Sequence[str] = KINDS, cues: int = 2) -> List[int]:
    """The labels scenes of these kinds can hold (besides 0)."""
    out = set(background_classes(kinds, cues)) | set(OBJECT_CLASSES.values())
    if 'detail' in kinds:
        out.add(POLE)
    return sorted(out)


def _texture(kind: str, size: int, period: int, phase: Tuple[int, int]) -> np.ndarray:
    """A ``[size, size]`` multiplicative texture: 1 or ``DARK``."""
    yy, xx = np.mgrid[:size, :size]
    yy, xx = yy + phase[0], xx + phase[1]
    if kind == 'hstripes':
        dark = (yy % period) < period // 2
    elif kind == 'vstripes':
        dark = (xx % period) < period // 2
    elif kind == 'checker':
        dark = ((yy // (period // 2)) + (xx // (period // 2))) % 2 == 0
    else:
        raise ValueError(f'unknown texture {kind!r}')
    return np.where(dark, DARK, 1.0).astype(np.float32)


def region_map(scene: Scene) -> np.ndarray:
    """``[size, size]`` int: the background region of every pixel (warped Voronoi cells)."""
    s = scene.size
    yy, xx = np.mgrid[:s, :s].astype(np.float32)
    amp, wave, px, py = scene.warp
    if amp > 0:
        k = np.float32(2 * np.pi / wave)
        xx, yy = xx + amp * np.sin(k * yy + px), yy + amp * np.sin(k * xx + py)
    d = [(xx - x) ** 2 + (yy - y) ** 2 for x, y in scene.seeds]
    return np.argmin(np.stack(d), axis=0)


def _poly_mask(size: int, points: np.ndarray) -> np.ndarray:
    mask = np.zeros((size, size), np.uint8)
    cv2.fillPoly(mask, [points.astype(np.int32)], 1)
    return mask.astype(bool)


def _bar_mask(size: int, bar: Bar) -> np.ndarray:
    mask = np.zeros((size, size), np.uint8)
    cv2.line(mask, tuple(map(int, bar.p1)), tuple(map(int, bar.p2)), 1, int(bar.width),
             cv2.LINE_8)
    return mask.astype(bool)


def cue_mask(scene: Scene) -> np.ndarray:
    """``[size, size]`` bool: the cue's pixels (none without a cue)."""
    s = scene.size
    mask = np.zeros((s, s), np.uint8)
    if scene.cue is None:
        return mask.astype(bool)
    x, y, side = *scene.cue_xy, scene.cue_side
    shape = CUES[scene.cue][2]
    if shape == 'square':
        cv2.rectangle(mask, (x, y), (x + side - 1, y + side - 1), 1, -1)
    elif shape == 'disc':
        cv2.circle(mask, (x + side // 2, y + side // 2), side // 2, 1, -1)
    else:
        h = side // 2
        pts = np.array([[x + h, y], [x + side - 1, y + h], [x + h, y + side - 1], [x, y + h]])
        cv2.fillPoly(mask, [pts.astype(np.int32)], 1)
    return mask.astype(bool)


def object_masks(scene: Scene) -> List[np.ndarray]:
    """One ``[size, size]`` bool mask per object of ``scene.objects`` (objects never overlap
    each other or the cue)."""
    return [_poly_mask(scene.size, o.points) for o in scene.objects]


def partner(scene: Scene, obj: Obj) -> Obj:
    """The textured object whose class a plain object takes: the one of its hue."""
    found = [o for o in scene.objects if o.texture is not None and o.hue == obj.hue]
    if len(found) != 1:
        raise ValueError(f'a plain {HUE_NAMES[obj.hue]} object needs exactly one textured '
                         f'object of its hue, found {len(found)}')
    return found[0]


# what decides a labelled pixel's class (:func:`evidence_map`; 0: the cue, unlabelled)
EVIDENCE = {1: 'context', 2: 'object', 3: 'retrieval', 4: 'detail'}


def evidence_map(scene: Scene) -> np.ndarray:
    """``[size, size]`` uint8: for every pixel, the evidence its label needs, a key of
    :data:`EVIDENCE`: 1 ``context`` (a background region: its texture and the cue), 2
    ``object`` (a textured object: its own texture), 3 ``retrieval`` (a plain object: its
    distant partner's texture), 4 ``detail`` (a pole: local); 0 the cue (label 0). Drawn in
    :func:`render_scene`'s order, so it covers what the label shows."""
    evidence = np.ones((scene.size, scene.size), np.uint8)
    for bar in scene.bars:
        evidence[_bar_mask(scene.size, bar)] = 4
    for obj, m in zip(scene.objects, object_masks(scene)):
        evidence[m] = 3 if obj.texture is None else 2
    evidence[cue_mask(scene)] = 0
    return evidence


def render_scene(scene: Scene) -> Tuple[np.ndarray, np.ndarray]:
    """``(image RGB uint8 [size, size, 3], label uint8 [size, size])`` of a description."""
    s = scene.size
    img = np.zeros((s, s, 3), np.float32)
    label = np.zeros((s, s), np.uint8)
    regions = region_map(scene)
    for k, reg in enumerate(scene.regions):
        m = regions == k
        tex = _texture(reg.texture, s, reg.period, reg.phase)
        img[m] = tex[m][:, None] * np.asarray(reg.rgb, np.float32)
        label[m] = class_of(reg.texture, scene.cue)
    for bar in scene.bars:
        m = _bar_mask(s, bar)
        img[m] = np.asarray(bar.rgb, np.float32)
        label[m] = POLE
    for obj, m in zip(scene.objects, object_masks(scene)):
        if obj.texture is None:
            img[m] = np.asarray(obj.rgb, np.float32)
            label[m] = OBJECT_CLASSES[partner(scene, obj).texture]
        else:
            tex = _texture(obj.texture, s, obj.period, obj.phase)
            img[m] = tex[m][:, None] * np.asarray(obj.rgb, np.float32)
            label[m] = OBJECT_CLASSES[obj.texture]
    if scene.cue is not None:
        m = cue_mask(scene)
        img[m] = np.asarray(CUES[scene.cue][1], np.float32)
        label[m] = 0
    noise = np.random.default_rng(scene.noise_seed).normal(0, NOISE_SD, img.shape)
    img = np.clip(img + noise.astype(np.float32), 0, 255).astype(np.uint8)
    return img, label


def _tone(rng: np.random.Generator) -> Tuple[float, float, float]:
    """A grey-ish background tone: no hue to speak of, no class information."""
    grey = rng.uniform(95, 175)
    return tuple(float(v) for v in np.clip(grey + rng.uniform(-12, 12, 3), 0, 255))


def _jitter(rgb, rng: np.random.Generator) -> Tuple[float, float, float]:
    return tuple(float(v) for v in np.clip(np.asarray(rgb, float) + rng.normal(0, 8, 3), 0, 255))


def _polygon(rng: np.random.Generator, centre, radius: float) -> np.ndarray:
    """An irregular star-convex polygon inside the circle ``(centre, radius)``."""
    n = int(rng.integers(7, 12))
    angles = np.sort(rng.uniform(0, 2 * np.pi, n))
    radii = radius * rng.uniform(0.6, 1.0, n)
    pts = np.stack([centre[0] + radii * np.cos(angles), centre[1] + radii * np.sin(angles)], 1)
    return np.round(pts).astype(np.int32)


def _place_objects(rng: np.random.Generator, size: int, kinds,
                   layout: Layout) -> List[Tuple[int, bool, tuple, float]]:
    """``(hue, textured, centre, radius)`` of every object: pairs far apart (retrieval) or
    textured objects alone; no two objects closer than a cell."""
    cell = size / GRID
    placed = []  # (centre, radius)

    def free(c, r):
        inside = r + 0.5 * cell <= c[0] <= size - r - 0.5 * cell and \
            r + 0.5 * cell <= c[1] <= size - r - 0.5 * cell
        return inside and all(np.hypot(c[0] - q[0], c[1] - q[1]) >= r + rq + cell
                              for q, rq in placed)

    def sample(r):
        lo, hi = r + 0.5 * cell, size - r - 0.5 * cell
        return tuple(float(v) for v in rng.uniform(lo, hi, 2))

    hues = [int(h) for h in rng.permutation(len(HUES))]
    out = []
    if 'retrieval' in kinds:
        pairs = int(rng.integers(layout.pairs[0], layout.pairs[1] + 1))
        for hue in hues[:pairs]:
            r1 = rng.uniform(*layout.textured_radius) * cell
            r2 = rng.uniform(*layout.plain_radius) * cell
            for _ in range(300):
                c1, c2 = sample(r1), sample(r2)
                gap = np.hypot(c1[0] - c2[0], c1[1] - c2[1]) - r1 - r2
                if gap >= MIN_PAIR_GAP * cell and free(c1, r1) and free(c2, r2) and \
                        np.hypot(c1[0] - c2[0], c1[1] - c2[1]) >= r1 + r2 + cell:
                    placed += [(c1, r1), (c2, r2)]
                    out += [(hue, True, c1, r1), (hue, False, c2, r2)]
                    break
        spare = hues[pairs:]
        extra = spare[:1] if rng.random() < 0.5 else []
    else:
        extra = hues[:int(rng.integers(1, 4))]
    for hue in extra:   # textured objects without a plain partner
        r = rng.uniform(3, 5) * cell
        for _ in range(300):
            c = sample(r)
            if free(c, r):
                placed.append((c, r))
                out.append((hue, True, c, r))
                break
    # textured objects first, then the plain ones (drawing order; they never overlap)
    return [o for o in out if o[1]] + [o for o in out if not o[1]]


def sample_scene(rng: np.random.Generator, size: int = 256, kinds: Sequence[str] = KINDS,
                 cues: int = 2, layout: str = DEFAULT_LAYOUT) -> Scene:
    """Draw the description of one scene (see the module docstring for the kinds)."""
    kinds = tuple(k for k in KINDS if k in kinds)
    if not 1 <= cues <= len(CUES):
        raise ValueError(f'cues must be in 1..{len(CUES)}, got {cues}')
    layout = LAYOUTS[layout]
    cell = size / GRID
    # background: 4-7 warped Voronoi regions, every texture at least once
    k = int(rng.integers(4, 8))
    seeds = rng.uniform(0, size, (k, 2))
    textures = list(TEXTURES) + [TEXTURES[i] for i in rng.integers(0, 3, k - 3)]
    textures = [textures[i] for i in rng.permutation(k)]
    regions = [Region(t, _tone(rng), int(rng.choice((6, 8))),
                      tuple(int(v) for v in rng.integers(0, 8, 2)))
               for t in textures]
    warp = (float(rng.uniform(*layout.warp_amplitude) * cell),
            float(rng.uniform(*layout.warp_wavelength) * cell),
            float(rng.uniform(0, 2 * np.pi)), float(rng.uniform(0, 2 * np.pi)))
    if 'detail' not in kinds:
        warp = (0.0, ) + warp[1:]
    bars = []
    if 'detail' in kinds:
        for _ in range(int(rng.integers(1, 4))):
            length = rng.uniform(10, 28) * cell
            angle = rng.uniform(0, np.pi)
            cx, cy = rng.uniform(0.1 * size, 0.9 * size, 2)
            dx, dy = 0.5 * length * np.cos(angle), 0.5 * length * np.sin(angle)
            width = max(2, int(round(rng.uniform(*layout.pole_width) * cell)))
            bars.append(Bar((int(round(cx - dx)), int(round(cy - dy))),
                            (int(round(cx + dx)), int(round(cy + dy))), width,
                            _jitter(POLE_RGB, rng)))
    objects = []
    for hue, textured, c, r in _place_objects(rng, size, kinds, layout):
        points = _polygon(rng, c, r)
        rgb = _jitter(HUES[hue], rng)
        if textured:
            objects.append(Obj(points, c, r, hue, rgb, TEXTURES[int(rng.integers(3))],
                               int(rng.choice((6, 8))),
                               tuple(int(v) for v in rng.integers(0, 8, 2))))
        else:
            objects.append(Obj(points, c, r, hue, rgb))
    # the cue: anywhere, a cell clear of every object
    cue = int(rng.integers(cues)) if 'global' in kinds else None
    side = max(4, int(round(layout.cue_cells * cell)))
    cue_xy = (0, 0)
    for _ in range(500):
        x, y = (int(v) for v in rng.integers(0, size - side + 1, 2))
        cx, cy = x + side / 2, y + side / 2
        if all(np.hypot(cx - o.centre[0], cy - o.centre[1]) >= o.radius + side / 2 * 1.42 + cell
               for o in objects):
            cue_xy = (x, y)
            break
    else:   # no free spot (never seen at 256 x 256): drop the objects that are in the way
        x, y = cue_xy = tuple(int(v) for v in rng.integers(0, size - side + 1, 2))
        objects = [o for o in objects
                   if np.hypot(x + side / 2 - o.centre[0], y + side / 2 - o.centre[1]) >=
                   o.radius + side / 2 * 1.42 + cell]
        hues_textured = {o.hue for o in objects if o.texture is not None}
        objects = [o for o in objects if o.texture is not None or o.hue in hues_textured]
    return Scene(size, kinds, cues, cue, tuple(cue_xy), side, seeds, warp, regions, bars,
                 objects, int(rng.integers(2**63)))


def make_scene(rng: np.random.Generator, size: int = 256, kinds: Sequence[str] = KINDS,
               cues: int = 2, layout: str = DEFAULT_LAYOUT) -> Tuple[np.ndarray, np.ndarray]:
    """One ``(image RGB uint8 [size, size, 3], label uint8 [size, size])`` pair."""
    return render_scene(sample_scene(rng, size, kinds, cues, layout))


def scene_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of image ``index`` (0-based) of ``split``: its own stream."""
    return np.random.default_rng([seed, 0 if split == 'training' else 1, index])


def _write(path: str, ext: str, array: np.ndarray, params=()) -> None:
    """Encode an image and write it whole (:func:`~mita_seg.utils.atomic_files.atomic_write_image`:
    a temporary file, fsync-ed, then renamed; nothing left behind if writing fails)."""
    atomic_write_image(array, path, params, ext=ext)


def make_split(out: str, split: str, num: int, size: int, seed: int,
               kinds: Sequence[str] = KINDS, cues: int = 2, layout: str = DEFAULT_LAYOUT) -> None:
    """Write ``num`` scenes of one split (``training`` or ``validation``)."""
    img_dir = osp.join(out, 'images', split)
    ann_dir = osp.join(out, 'annotations', split)
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    for i in range(num):
        img, label = make_scene(scene_rng(seed, split, i), size, kinds, cues, layout)
        name = scene_name(split, i)
        _write(osp.join(img_dir, name + '.jpg'), '.jpg', img[..., ::-1],
               (cv2.IMWRITE_JPEG_QUALITY, 95))
        _write(osp.join(ann_dir, name + '.png'), '.png', label)


SCENES_FILE = 'scenes.json'   # beside images/ and annotations/: the arguments they came from


def write_scenes_file(out: str, **arguments) -> None:
    """Record the generator's arguments in ``OUT/scenes.json`` (written whole), so that a
    reader can tell which scenes a folder holds."""
    atomic_write_text(json.dumps(arguments, indent=1), osp.join(out, SCENES_FILE))


def read_scenes_file(out: str) -> Optional[dict]:
    """The generator's arguments a folder's scenes were written with (``OUT/scenes.json``);
    None when the folder has no such file (written before the file existed: layout ``v1``).

    Raises:
        InputError: the file is not a JSON object (say which file, and what to do).
    """
    path = osp.join(out, SCENES_FILE)
    if not osp.isfile(path):
        return None
    try:
        with open(path) as f:
            arguments = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f'{path}: unreadable ({e}); delete {out} to have the scenes '
                         'written again') from None
    if not isinstance(arguments, dict):
        raise InputError(f'{path}: not the generator\'s arguments (a JSON object); delete '
                         f'{out} to have the scenes written again')
    return arguments


def scenes_layout(out: str) -> Optional[str]:
    """The layout of a folder's scenes (:func:`read_scenes_file`); None without the file."""
    arguments = read_scenes_file(out)
    return None if arguments is None else arguments.get('layout')


def scene_of_file(out: str, split: str, index: int) -> Scene:
    """The description of image ``index`` (0-based) of ``split`` in the folder ``out``,
    drawn again from the arguments of its ``scenes.json``.

    Raises:
        InputError: the folder has no ``scenes.json`` (its scenes cannot be drawn again).
    """
    arguments = read_scenes_file(out)
    if arguments is None:
        raise InputError(f'{out} has no {SCENES_FILE}: its scenes cannot be drawn again; '
                         'write them with tools/dataset/make_longrange_ade20k.py')
    return sample_scene(scene_rng(arguments['seed'], split, index), arguments['size'],
                        arguments['kinds'], arguments['cues'], arguments.get('layout', 'v1'))


# ----------------------------------------------------------------------------- preview figure
def _class_colour(cls: int) -> Tuple[int, int, int]:
    """A fixed RGB colour per label for the figure (0 black)."""
    table = {1: (200, 170, 120), 2: (150, 75, 40), 4: (120, 100, 220), 5: (30, 140, 40),
             7: (90, 90, 90), 8: (255, 130, 0), 13: (200, 25, 25), 21: (0, 185, 185),
             19: (230, 120, 190), 27: (40, 120, 230), 35: (150, 150, 110),
             47: (240, 220, 130), 94: (255, 255, 255)}
    return table.get(int(cls), (0, 0, 0))


def colour_labels(label: np.ndarray) -> np.ndarray:
    """``[S, S, 3]`` uint8 RGB: each label in its figure colour."""
    out = np.zeros(label.shape + (3, ), np.uint8)
    for cls in np.unique(label):
        out[label == cls] = _class_colour(cls)
    return out


def preview(path: str, num: int = 4, size: int = 256, seed: int = 0,
            kinds: Sequence[str] = KINDS, cues: int = 2, layout: str = DEFAULT_LAYOUT) -> None:
    """Write a PNG grid: for the first ``num`` validation scenes of ``seed`` (the first one
    also re-drawn with the next cue: the same pixels but the cue's, other labels), the image,
    the labels, and the labels with the evidence marked on the 32 x 32 grid (the cue boxed, an
    arrow from each plain object to its textured partner); a legend below."""
    pad, text_h = 8, 22
    rows = []
    font = cv2.FONT_HERSHEY_SIMPLEX
    shown = []
    for i in range(num):
        scene = sample_scene(scene_rng(seed, 'validation', i), size, kinds, cues, layout)
        cue = 'no cue' if scene.cue is None else f'cue {scene.cue}: {CUES[scene.cue][0]}'
        shown.append((f'val {i + 1}, {cue}', scene))
        if i == 0 and scene.cue is not None:
            other = replace(scene, cue=(scene.cue + 1) % scene.cues)
            shown.append((f'val 1 with cue {other.cue}: {CUES[other.cue][0]}', other))
    step = size / GRID
    for title, scene in shown:
        img, label = render_scene(scene)
        lab = colour_labels(label)
        ev = (lab.astype(np.float32) * 0.45).astype(np.uint8)
        for g in range(1, GRID):
            p = int(round(g * step))
            ev[p, :] = np.maximum(ev[p, :], 70)
            ev[:, p] = np.maximum(ev[:, p], 70)
        if scene.cue is not None:
            x, y, s = *scene.cue_xy, scene.cue_side
            cv2.rectangle(ev, (x - 3, y - 3), (x + s + 2, y + s + 2), (255, 255, 0), 2)
            ev[cue_mask(scene)] = CUES[scene.cue][1]
        for obj in scene.objects:
            if obj.texture is None:
                src = partner(scene, obj)
                a = tuple(int(round(v)) for v in obj.centre)
                b = tuple(int(round(v)) for v in src.centre)
                cv2.arrowedLine(ev, a, b, HUES[obj.hue], 2, cv2.LINE_AA, tipLength=0.06)
                cv2.circle(ev, a, 4, HUES[obj.hue], -1)
        row = np.full((size + text_h, 3 * size + 2 * pad, 3), 255, np.uint8)
        titles = (title, 'labels', '32x32 grid; cue; plain -> partner')
        for j, (panel, what) in enumerate(zip((img, lab, ev), titles)):
            x0 = j * (size + pad)
            row[text_h:, x0:x0 + size] = panel
            cv2.putText(row, what, (x0 + 2, text_h - 7), font, 0.42, (0, 0, 0), 1, cv2.LINE_AA)
        rows.append(row)
        rows.append(np.full((pad, row.shape[1], 3), 255, np.uint8))
    # legend: one swatch per class
    width = rows[0].shape[1]
    legend = np.full((3 * text_h + 6, width, 3), 255, np.uint8)
    x, y = 4, 4
    for cls in classes(kinds, cues):
        name = f'{cls} {CLASS_NAMES[cls]}'
        w = 26 + 9 * len(name)
        if x + w > width:
            x, y = 4, y + text_h
        legend[y:y + 14, x:x + 18] = _class_colour(cls)
        cv2.rectangle(legend, (x, y), (x + 17, y + 13), (0, 0, 0), 1)
        cv2.putText(legend, name, (x + 22, y + 12), font, 0.42, (0, 0, 0), 1, cv2.LINE_AA)
        x += w
    legend[y + text_h - 4:y + text_h + 10, 4:22] = 0
    cv2.putText(legend, '0 other (cue, ignored)', (26, y + text_h + 8), font, 0.42, (0, 0, 0),
                1, cv2.LINE_AA)
    fig = np.concatenate(rows + [legend], 0)
    folder = osp.dirname(osp.abspath(path))
    os.makedirs(folder, exist_ok=True)
    _write(path, '.png', fig[..., ::-1])
