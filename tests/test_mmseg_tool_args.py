"""Our tools take mmseg 1.2.2's arguments with mmseg's meaning and defaults (each checked
against the tool of the mmsegmentation wheel or repository where it differed):
``tools/image_demo.py`` as mmseg's ``demo/image_demo.py``: ``--with-labels`` (class names on
the drawing, off by default, where our tool drew them always and refused the argument),
``--device`` defaulting to ``cuda:0`` where there is CUDA, and ``--out-file`` refused with the
reason when it is left out (mmseg then opens a window)."""
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SEGMENTER = osp.join(ROOT, 'configs', 'baselines',
                     'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')


@pytest.fixture
def image(tmp_path):
    import cv2
    path = tmp_path / 'img.png'
    pixels = np.random.default_rng(0).integers(0, 255, (128, 128, 3), dtype=np.uint8)
    cv2.imwrite(str(path), pixels)
    return str(path)


@pytest.fixture
def standin(tmp_path):
    from mita_seg.apis import make_standin_checkpoint
    ckpt = tmp_path / 'standin.pth'
    make_standin_checkpoint(SEGMENTER, str(ckpt))
    return str(ckpt)


def test_image_demo_parses_mmseg_arguments(tools, image, tmp_path):
    args = tools.module('image_demo').parse_args(
        [image, SEGMENTER, SEGMENTER, '--out-file', str(tmp_path / 'o.png'), '--with-labels',
         '--opacity', '0.7', '--title', 'x'])
    assert args.with_labels and args.opacity == 0.7 and args.title == 'x'
    args = tools.module('image_demo').parse_args(
        [image, SEGMENTER, SEGMENTER, '--out-file', str(tmp_path / 'o.png')])
    assert not args.with_labels
    assert args.device is None      # resolved in main(): mmseg's cuda:0 where CUDA is


def test_image_demo_without_out_file_says_why(image):
    proc = subprocess.run([sys.executable, 'tools/image_demo.py', image, SEGMENTER, SEGMENTER],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith('error: --out-file OUT.png is needed: this tool writes the '
                                  'drawing to a file and opens no window'), proc.stderr


def test_image_demo_device_defaults_to_cuda_as_mmseg(tools, image, tmp_path, monkeypatch):
    import torch

    import mita_seg.apis
    seen = []

    class Stop(Exception):
        pass

    def fake_init_model(config, checkpoint, device, *args, **kwargs):
        seen.append(device)
        raise Stop

    monkeypatch.setattr(mita_seg.apis, 'init_model', fake_init_model)
    tool = tools.module('image_demo')
    argv = [image, SEGMENTER, SEGMENTER, '--out-file', str(tmp_path / 'o.png')]
    # without CUDA first: the stack is imported (and logs) before is_available is faked
    for cuda, device in ((False, 'cpu'), (True, 'cuda:0')):
        monkeypatch.setattr(torch.cuda, 'is_available', lambda: cuda)
        with pytest.raises(Stop):
            tool.main(argv)
        assert seen[-1] == device
    with pytest.raises(Stop):
        tool.main(argv + ['--device', 'cpu'])
    assert seen[-1] == 'cpu'


def test_image_demo_draws_labels_only_with_with_labels(tools, image, standin, tmp_path):
    """mmseg's demo passes ``with_labels=args.with_labels`` (False by default) to
    ``show_result_pyplot``, whose own default is True: ours drew the labels always."""
    import cv2
    from mmseg.apis import show_result_pyplot

    from mita_seg.apis import inference_model, init_model
    tool = tools.module('image_demo')
    model = init_model(SEGMENTER, standin, 'cpu')
    result = inference_model(model, image)
    expected = {labels: show_result_pyplot(model, image, result, opacity=0.5, title='result',
                                           draw_gt=False, show=False, with_labels=labels)
                for labels in (False, True)}
    assert not np.array_equal(expected[False], expected[True])
    for labels in (False, True):
        out = tmp_path / f'labels_{labels}.png'
        tool.main([image, SEGMENTER, standin, '--out-file', str(out), '--device', 'cpu']
                  + (['--with-labels'] if labels else []))
        drawn = cv2.imread(str(out))[..., ::-1]
        assert np.array_equal(drawn, expected[labels]), labels
