"""``tools/dataset/make_longrange_ade20k.py`` (:mod:`mita_seg.datasets.longrange_scenes`):
scenes whose labels need long-range evidence (issue 43). Seeded determinism (arrays and the
CLI's files, byte for byte), ADE20K's layout and label range, and that labels truly depend
on distant evidence: re-drawing a scene with the other cue changes the labels far from the
cue and no pixel there; changing the texture of a plain object's distant partner changes the
plain object's label and none of its pixels.
"""
import os
import os.path as osp
import subprocess
import sys
from dataclasses import replace

import cv2
import numpy as np
import pytest

import mita_seg.datasets.longrange_scenes as gen

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SCRIPT = osp.join(ROOT, 'tools', 'dataset', 'make_longrange_ade20k.py')

SIZE = 256            # the study's input: a 32 x 32 grid of 8-pixel patches
CELL = SIZE // gen.GRID


def scenes(n, seed=0, split='validation', **kw):
    return [gen.sample_scene(gen.scene_rng(seed, split, i), SIZE, **kw) for i in range(n)]


def cells_from(mask):
    """Distance of every pixel to ``mask``, in cells."""
    return cv2.distanceTransform((~mask).astype(np.uint8), cv2.DIST_L2, 5) / CELL


def test_seeded_arrays():
    a = gen.make_scene(gen.scene_rng(3, 'training', 5), SIZE)
    b = gen.make_scene(gen.scene_rng(3, 'training', 5), SIZE)
    assert a[0].dtype == np.uint8 and a[0].shape == (SIZE, SIZE, 3)
    assert a[1].dtype == np.uint8 and a[1].shape == (SIZE, SIZE)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    for other in (gen.scene_rng(4, 'training', 5), gen.scene_rng(3, 'validation', 5),
                  gen.scene_rng(3, 'training', 6)):
        c = gen.make_scene(other, SIZE)
        assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[1], c[1])


def _run(*args):
    proc = subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _files(root):
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            with open(osp.join(folder, name), 'rb') as f:
                out[osp.relpath(osp.join(folder, name), root)] = f.read()
    return out


def test_cli_layout_and_bytes(tmp_path):
    for out, seed in (('a', 0), ('b', 0), ('c', 1)):
        _run('--out', tmp_path / out, '--train', 3, '--val', 2, '--seed', seed)
    a, b, c = (_files(tmp_path / d) for d in 'abc')
    expect = {osp.join('images', 'training', f'ADE_train_{i:08d}.jpg') for i in (1, 2, 3)} | \
        {osp.join('annotations', 'training', f'ADE_train_{i:08d}.png') for i in (1, 2, 3)} | \
        {osp.join('images', 'validation', f'ADE_val_{i:08d}.jpg') for i in (1, 2)} | \
        {osp.join('annotations', 'validation', f'ADE_val_{i:08d}.png') for i in (1, 2)}
    assert set(a) == expect | {'scenes.json'}    # ADE20K's layout, its arguments, no .tmp
    assert gen.scenes_layout(str(tmp_path / 'a')) == gen.DEFAULT_LAYOUT
    assert gen.scenes_layout(str(tmp_path)) is None      # no file: written before it existed
    assert a == b                                # same arguments, same bytes
    assert set(c) == set(a) and all(a[k] != c[k] for k in expect)   # another seed
    allowed = {0, *gen.classes()}
    for split, tag, n in (('training', 'train', 3), ('validation', 'val', 2)):
        for i in range(n):
            name = f'ADE_{tag}_{i + 1:08d}'
            img = cv2.imread(str(tmp_path / 'a' / 'images' / split / (name + '.jpg')))
            lab = cv2.imread(str(tmp_path / 'a' / 'annotations' / split / (name + '.png')),
                             cv2.IMREAD_UNCHANGED)
            assert img.shape == (SIZE, SIZE, 3) and lab.shape == (SIZE, SIZE)
            assert lab.dtype == np.uint8 and set(np.unique(lab)) <= allowed
            # the files are the arrays (the PNG exactly, the JPEG up to its compression)
            ref_img, ref_lab = gen.make_scene(gen.scene_rng(0, split, i), SIZE)
            assert np.array_equal(lab, ref_lab)
            assert np.abs(img[..., ::-1].astype(int) - ref_img).mean() < 10   # others: ~40
    # a longer run starts with the same images
    _run('--out', tmp_path / 'd', '--train', 4, '--val', 1)
    d = _files(tmp_path / 'd')
    assert all(d[k] == a[k] for k in expect if 'ADE_val_00000002' not in k)


@pytest.mark.parametrize('layout', sorted(gen.LAYOUTS))
def test_cue_decides_far_labels(layout):
    """The same pixels, the other cue: every textured region changes class, far from the cue
    too, while no pixel outside the cue changes."""
    far_changed = 0
    side = gen.LAYOUTS[layout].cue_cells
    for scene in scenes(6, layout=layout):
        assert scene.cue is not None
        img, lab = gen.render_scene(scene)
        other = replace(scene, cue=1 - scene.cue)
        img2, lab2 = gen.render_scene(other)
        cue = gen.cue_mask(scene) | gen.cue_mask(other)
        # a few patches: the square side x side cells, the disc and the diamond less
        assert 0.5 * (side * CELL) ** 2 <= gen.cue_mask(scene).sum() <= (side * CELL) ** 2
        assert np.array_equal(img[~cue], img2[~cue])
        background = ~cue & np.isin(lab, gen.background_classes())
        assert background.sum() > 0.6 * SIZE ** 2
        assert (lab[background] != lab2[background]).all()
        # objects and poles: the same labels
        assert (lab[~background & ~cue] == lab2[~background & ~cue]).all()
        for t in gen.TEXTURES:   # the class pairs of the table
            m = background & (lab == gen.class_of(t, scene.cue))
            assert (lab2[m] == gen.class_of(t, 1 - scene.cue)).all()
        far = background & (cells_from(gen.cue_mask(scene)) > 8)
        assert far.sum() > 0.3 * (lab > 0).sum()     # most labelled pixels are far from it
        far_changed += far.sum()
    assert far_changed > 0.5 * 6 * SIZE ** 2


def _a_plain(scene):
    for j, obj in enumerate(scene.objects):
        if obj.texture is None:
            return j, obj
    return None, None


def test_plain_object_takes_its_distant_partners_class():
    masks_checked = 0
    for scene in scenes(8, seed=1):
        j, plain = _a_plain(scene)
        if plain is None:
            continue
        img, lab = gen.render_scene(scene)
        masks = gen.object_masks(scene)
        src = gen.partner(scene, plain)
        i = scene.objects.index(src)
        # the partner is far: at least MIN_PAIR_GAP cells from the plain object, edge to edge
        assert cells_from(masks[j])[masks[i]].min() >= gen.MIN_PAIR_GAP - 0.5
        assert (lab[masks[j]] == gen.OBJECT_CLASSES[src.texture]).all()
        assert (lab[masks[j]] == lab[masks[i]][0]).all()
        # another texture on the partner: the plain object's pixels stay, its label follows
        new = next(t for t in gen.TEXTURES if t != src.texture)
        objects = list(scene.objects)
        objects[i] = replace(src, texture=new)
        img2, lab2 = gen.render_scene(replace(scene, objects=objects))
        assert np.array_equal(img[masks[j]], img2[masks[j]])
        assert (lab2[masks[j]] == gen.OBJECT_CLASSES[new]).all()
        assert (lab2[masks[j]] != lab[masks[j]]).all()
        assert not np.array_equal(img[masks[i]], img2[masks[i]])
        # nothing else changed: the rest of the image, pixels and labels
        rest = ~(masks[i] | masks[j])
        assert np.array_equal(img[rest], img2[rest]) and np.array_equal(lab[rest], lab2[rest])
        masks_checked += 1
    assert masks_checked >= 4


def test_retrieval_is_query_specific():
    """Plain objects of different hues in one scene take different partners; a plain object's
    hue says nothing about its class across scenes."""
    by_hue = {}
    multi = 0
    for scene in scenes(40, seed=2):
        plains = [o for o in scene.objects if o.texture is None]
        partners = [gen.partner(scene, o) for o in plains]
        assert len({id(p) for p in partners}) == len(plains)
        multi += len(plains) >= 2
        for o, p in zip(plains, partners):
            by_hue.setdefault(o.hue, set()).add(gen.OBJECT_CLASSES[p.texture])
    assert multi >= 5
    assert all(len(v) >= 3 for v in by_hue.values()) and len(by_hue) == len(gen.HUES)


def test_local_appearance_is_ambiguous_and_classes_balanced():
    """Over a set of scenes every texture takes each of its cue classes, and no class takes
    the lion's share of the labelled pixels."""
    counts = {}
    pairs = set()
    for scene in scenes(24, seed=3):
        _, lab = gen.render_scene(scene)
        for t in gen.TEXTURES:
            if (lab == gen.class_of(t, scene.cue)).any():
                pairs.add((t, scene.cue))
        for cls, n in zip(*np.unique(lab, return_counts=True)):
            counts[int(cls)] = counts.get(int(cls), 0) + int(n)
    assert pairs == {(t, c) for t in gen.TEXTURES for c in (0, 1)}
    labelled = sum(n for c, n in counts.items() if c)
    assert set(counts) - {0} == set(gen.classes())
    shares = {c: n / labelled for c, n in counts.items() if c}
    assert max(shares.values()) < 0.3 and shares[gen.POLE] > 0.01
    assert min(s for c, s in shares.items() if c != gen.POLE) > 0.02


@pytest.mark.parametrize('kinds', [('global', ), ('retrieval', ), ('detail', ),
                                   ('global', 'detail')])
def test_kinds(kinds):
    for scene in scenes(4, seed=4, kinds=kinds):
        _, lab = gen.render_scene(scene)
        assert set(np.unique(lab)) <= {0, *gen.classes(kinds)}
        assert (scene.cue is not None) == ('global' in kinds) and (0 in lab) == (
            'global' in kinds)
        assert any(o.texture is None for o in scene.objects) == ('retrieval' in kinds)
        assert bool(scene.bars) == ('detail' in kinds) and (scene.warp[0] > 0) == (
            'detail' in kinds)


def test_three_cues_and_bad_kinds(tmp_path):
    seen = set()
    for scene in scenes(12, seed=5, cues=3):
        _, lab = gen.render_scene(scene)
        seen.add(scene.cue)
        assert set(np.unique(lab)) <= {0, *gen.classes(cues=3)}
    assert seen == {0, 1, 2} and len(gen.classes(cues=3)) == 13 and len(gen.classes()) == 10
    proc = subprocess.run([sys.executable, SCRIPT, '--out', str(tmp_path), '--kinds', 'local'],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and 'global,retrieval,detail' in proc.stderr
    assert not os.listdir(tmp_path)


def test_ideal_predictors_order_by_what_they_reach():
    """mita_seg.analysis.longrange_ceiling: a predictor that reaches everything is perfect;
    one without retrieval errs exactly on plain objects; a local one also on the background
    far from the cue; a token alone is worst."""
    from mita_seg.analysis.longrange_ceiling import ideal_miou, ideal_prediction
    sc = scenes(6)
    assert ideal_miou(sc) == 100.0
    scene = next(s for s in sc if s.cue == 1)   # a fixed guess (cue 0's class) is wrong
    label = gen.render_scene(scene)[1]
    masks = gen.object_masks(scene)
    plain = np.zeros_like(label, bool)
    for obj, m in zip(scene.objects, masks):
        plain |= m if obj.texture is None else False
    wrong = ideal_prediction(scene, retrieval=False, guess='random') != label
    assert plain.any() and not wrong[~plain].any() and wrong[plain].any()
    far = cells_from(gen.cue_mask(scene)) > 8   # out of a 4-cell reach, whatever the cell
    wrong = ideal_prediction(scene, reach=4) != label
    background = np.isin(label, gen.background_classes())
    assert (far & background).sum() > 1000 and wrong[far & background].all()
    local, alone = ideal_miou(sc, reach=4), ideal_miou(sc, reach=0)
    assert alone < local < ideal_miou(sc, retrieval=False) < 100
