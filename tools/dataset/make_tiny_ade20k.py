"""Write a small synthetic dataset in ADE20K's exact layout.

::

    OUT/images/{training,validation}/ADE_{train,val}_%08d.jpg   RGB, SIZE x SIZE
    OUT/annotations/{training,validation}/ADE_{train,val}_%08d.png   uint8 labels

Labels follow ADEChallengeData2016: 0 is "other" (ignored through ``reduce_zero_label``),
1..150 are the ADE20K classes. Scenes have learnable structure: a sky/floor background
split at a random horizon, and shapes (rectangles, ellipses, triangles; the shape is random)
whose class is tied to their colour and texture. A few grey "clutter" blobs are labelled 0.
Same arguments, same files (seeded); files are written whole (a temporary file, then renamed:
:mod:`mita_seg.utils.atomic_files`), and a failed write is an error.

Usage::

    python tools/dataset/make_tiny_ade20k.py --out data/ade/tiny_ade20k --train 200 --val 40
"""
import os
import os.path as osp
import sys

import cv2
import numpy as np

# ADE20K label (1-based, as in the PNGs) -> (name, RGB colour, texture) of the scene parts.
BACKGROUND = {3: ('sky', (110, 160, 230), 'gradient'), 4: ('floor', (150, 110, 70), 'noise')}
OBJECTS = {
    5: ('tree', (40, 150, 50), 'dots'),
    21: ('car', (210, 40, 40), 'hstripes'),
    13: ('person', (230, 200, 60), 'vstripes'),
    8: ('bed', (150, 60, 180), 'checker'),
}
CLASSES = {**BACKGROUND, **OBJECTS}
ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, ROOT)
from mita_seg.datasets.ade_layout import check_split_folders, scene_name  # noqa: E402
from mita_seg.utils.atomic_files import atomic_write_image  # noqa: E402  (light: no torch)


def _texture(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A ``[size, size]`` multiplicative texture around 1."""
    yy, xx = np.mgrid[:size, :size]
    period = rng.integers(6, 10)
    if kind == 'gradient':
        t = 0.8 + 0.4 * yy / size
    elif kind == 'noise':
        t = 1 + 0.15 * rng.standard_normal((size, size))
    elif kind == 'dots':
        t = np.where(((yy % period) < 3) & ((xx % period) < 3), 0.55, 1.0)
    elif kind == 'hstripes':
        t = np.where((yy % period) < period // 2, 0.6, 1.0)
    elif kind == 'vstripes':
        t = np.where((xx % period) < period // 2, 0.6, 1.0)
    elif kind == 'checker':
        t = np.where(((yy // period) + (xx // period)) % 2 == 0, 0.6, 1.0)
    else:
        raise ValueError(f'unknown texture {kind!r}')
    return t.astype(np.float32)


def _fill(img: np.ndarray, mask: np.ndarray, colour, kind: str, rng: np.random.Generator):
    """Paint ``mask`` with a jittered colour times a texture."""
    size = img.shape[0]
    rgb = np.clip(np.array(colour, np.float32) + rng.normal(0, 12, 3), 0, 255)
    layer = _texture(kind, size, rng)[..., None] * rgb
    img[mask] = layer[mask]


def _shape_mask(size: int, rng: np.random.Generator) -> np.ndarray:
    """A random rectangle, ellipse or triangle, 15-45% of the image side."""
    mask = np.zeros((size, size), np.uint8)
    cx, cy = rng.integers(size // 8, size - size // 8, 2)
    rx, ry = rng.integers(int(size * 0.08), int(size * 0.23), 2)
    kind = rng.integers(3)
    if kind == 0:
        cv2.rectangle(mask, (int(cx - rx), int(cy - ry)), (int(cx + rx), int(cy + ry)), 1, -1)
    elif kind == 1:
        cv2.ellipse(mask, (int(cx), int(cy)), (int(rx), int(ry)), float(rng.uniform(0, 180)),
                    0, 360, 1, -1)
    else:
        angles = rng.uniform(0, 2 * np.pi) + np.array([0, 2.1, 4.2])
        pts = np.stack([cx + rx * np.cos(angles), cy + ry * np.sin(angles)], axis=1)
        cv2.fillPoly(mask, [pts.astype(np.int32)], 1)
    return mask.astype(bool)


def make_scene(size: int, rng: np.random.Generator):
    """One ``(image RGB uint8 [size, size, 3], label uint8 [size, size])`` pair."""
    img = np.zeros((size, size, 3), np.float32)
    label = np.zeros((size, size), np.uint8)
    horizon = int(rng.integers(size // 4, 3 * size // 4))
    rows = np.arange(size)[:, None].repeat(size, 1)
    for cls, part in ((3, rows < horizon), (4, rows >= horizon)):
        _fill(img, part, CLASSES[cls][1], CLASSES[cls][2], rng)
        label[part] = cls
    ids = list(OBJECTS)
    for _ in range(rng.integers(1, 4)):
        cls = ids[rng.integers(len(ids))]
        mask = _shape_mask(size, rng)
        _fill(img, mask, OBJECTS[cls][1], OBJECTS[cls][2], rng)
        label[mask] = cls
    if rng.random() < 0.5:  # unlabelled clutter: ADE's "other" (0)
        mask = _shape_mask(size, rng)
        grey = float(rng.uniform(60, 200))
        img[mask] = grey + rng.normal(0, 20, (int(mask.sum()), 3))
        label[mask] = 0
    img = np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)
    return img, label


def make_split(out: str, split: str, num: int, size: int, seed: int) -> None:
    """Write ``num`` scenes of one split (``training`` or ``validation``)."""
    img_dir = osp.join(out, 'images', split)
    ann_dir = osp.join(out, 'annotations', split)
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(num):
        img, label = make_scene(size, rng)
        name = scene_name(split, i)
        atomic_write_image(img[..., ::-1], osp.join(img_dir, name + '.jpg'),
                           [cv2.IMWRITE_JPEG_QUALITY, 95])
        atomic_write_image(label, osp.join(ann_dir, name + '.png'))


def parse_args(argv=None):
    from mita_seg.cli import ToolParser, output_dir   # a folder that can be written
    parser = ToolParser(description='Write a tiny synthetic ADE20K-layout dataset')
    parser.add_argument('--out', type=output_dir('--out'), default='data/ade/tiny_ade20k',
                        help='output folder')
    parser.add_argument('--train', type=int, default=200, help='training images')
    parser.add_argument('--val', type=int, default=40, help='validation images')
    parser.add_argument('--size', type=int, default=128, help='image side in pixels')
    parser.add_argument('--seed', type=int, default=0, help='random seed')
    args = parser.parse_args(argv)
    if args.train < 1 or args.val < 1:
        parser.error(f'--train and --val must be >= 1, got {args.train} and {args.val}')
    if args.size < 32:
        parser.error(f'--size must be >= 32 pixels, got {args.size}')
    return args


def main(argv=None):
    args = parse_args(argv)
    check_split_folders(args.out, {'training': args.train, 'validation': args.val})
    make_split(args.out, 'training', args.train, args.size, args.seed)
    make_split(args.out, 'validation', args.val, args.size, args.seed + 1)
    names = ', '.join(f'{k}={v[0]}' for k, v in sorted(CLASSES.items()))
    print(f'wrote {args.train} training and {args.val} validation images '
          f'({args.size}x{args.size}) to {args.out}; labels: 0=other, {names}')


if __name__ == '__main__':
    from mita_seg.cli import run_tool
    run_tool(main)
