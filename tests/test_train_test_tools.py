"""End to end on the tiny dataset: tools/train.py -> checkpoint -> tools/test.py -> --resume,
the tiny dataset itself, and the checkpoint allow-list (our checkpoints load with
``weights_only=True``, a malicious pickle does not). The tools run as subprocesses, as users
run them (about 1-2 min)."""
import os
import os.path as osp
import pickle

import pytest
import torch

from mita_seg.utils import UnsafeCheckpointError, load_local_checkpoint, register_safe_globals

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')


def test_tiny_dataset_layout(tiny_data):
    import cv2
    import numpy as np
    for split, n in (('training', 8), ('validation', 4)):
        imgs = sorted(os.listdir(osp.join(tiny_data, 'images', split)))
        anns = sorted(os.listdir(osp.join(tiny_data, 'annotations', split)))
        assert len(imgs) == len(anns) == n
        assert [i[:-4] for i in imgs] == [a[:-4] for a in anns]
        assert all(i.endswith('.jpg') for i in imgs) and all(a.endswith('.png') for a in anns)
    label = cv2.imread(osp.join(tiny_data, 'annotations', 'validation', anns[0]),
                       cv2.IMREAD_UNCHANGED)
    assert label.dtype == np.uint8 and label.shape == (128, 128)
    assert set(np.unique(label)) <= {0, 3, 4, 5, 8, 13, 21}  # 0 = other, ADE ids 1..150


@pytest.mark.slow
def test_train_test_resume(tiny_data, tools, tmp_path):
    work = str(tmp_path / 'work')
    opts = tools.data_options(tiny_data) + [
        'train_cfg.val_interval=100', 'default_hooks.checkpoint.interval=2',
        'default_hooks.logger.interval=1'
    ]
    # train 2 iterations, checkpoint
    _, out = tools('tools/train.py', CONFIG, '--work-dir', work, '--cfg-options',
                   'train_cfg.max_iters=2', *opts)
    assert 'Iter(train) [2/2]' in out
    ckpt = osp.join(work, 'iter_2.pth')
    assert f'to iteration 2; last checkpoint: {ckpt}' in out
    assert 'Config:' not in out            # the config dump is in the log file only
    # the checkpoint, with its message hub and numpy values, loads weights-only
    register_safe_globals()
    state = load_local_checkpoint(ckpt, map_location='cpu')
    assert state['meta']['iter'] == 2 and 'message_hub' in state

    # evaluate it
    test_opts = ['--cfg-options', *tools.data_options(tiny_data)]
    preds = tmp_path / 'preds'
    shows = tmp_path / 'shows'
    _, out = tools('tools/test.py', CONFIG, ckpt, '--work-dir', tmp_path / 'test', '--out',
                   preds, '--show-dir', shows, *test_opts)
    base = tools.miou(out)
    assert sorted(os.listdir(preds)) == [f'ADE_val_{i:08d}.png' for i in (1, 2, 3, 4)]
    # each is the model's prediction (ADE20K ids, 1..150) of that image
    import cv2
    from mita_seg.apis import inference_model, init_model
    model = init_model(CONFIG, ckpt, cfg_options=dict(
        test_dataloader=dict(dataset=dict(data_root=tiny_data))))
    img = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000002.jpg')
    expected = inference_model(model, img).pred_sem_seg.data[0].numpy() + 1
    saved = cv2.imread(str(preds / 'ADE_val_00000002.png'), cv2.IMREAD_UNCHANGED)
    assert (saved == expected).all()
    assert f'painted 4 images (every 1) under {shows}' in out
    # swapping the (already MiTA) model's attention with the same settings after the runner
    # is built, before it loads the checkpoint in test(): same weights, same mIoU
    _, out = tools('tools/test.py', CONFIG, ckpt, '--work-dir', tmp_path / 'test2',
                   '--swap-attn', 'mita', '--mita-cfg', 'pool_size=4', 'topk=32', *test_opts)
    assert 'swap_attention: 4 attention modules on MiTA' in out
    assert tools.miou(out) == base
    # other settings at test time; those not given keep the model's (pool_size=4)
    _, out = tools('tools/test.py', CONFIG, ckpt, '--work-dir', tmp_path / 'test3',
                   '--mita-cfg', 'topk=8', 'router_topk=2', *test_opts)
    assert "{'pool_size': 4, 'topk': 8, 'router_topk': 2" in out
    assert 'on 4 images, 4 attention modules on MiTA: aAcc: ' in out

    # resume: continues from iteration 2 to 3
    _, out = tools('tools/train.py', CONFIG, '--work-dir', work, '--resume', '--cfg-options',
                   'train_cfg.max_iters=3', *opts)
    assert 'resumed epoch: 0, iter: 2' in out
    assert 'Iter(train) [3/3]' in out


class _Exploit:
    """A pickle that runs code when loaded without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}', ))


def test_malicious_checkpoint_is_refused(tmp_path):
    marker = tmp_path / 'pwned'
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': {}, 'meta': _Exploit(marker)}, path)
    register_safe_globals()
    with pytest.raises(UnsafeCheckpointError, match=r'outside the weights-only allow-list: '
                       r'(posix|os)\.system'):
        load_local_checkpoint(path)
    # through mmengine's loader too (what --resume, load_from and Pretrained use)
    from mmengine.runner.checkpoint import CheckpointLoader
    with pytest.raises(UnsafeCheckpointError):
        CheckpointLoader.load_checkpoint(path, map_location='cpu')
    assert not marker.exists()


def test_getattr_is_limited_to_history_buffer(tmp_path):
    # checkpoints need getattr(HistoryBuffer, 'min'); any other getattr stays refused

    import numpy as np

    class GetattrExploit:  # getattr on an allowed class, e.g. to reach ndarray.tofile

        def __reduce__(self):
            return (getattr, (np.ndarray, 'tofile'))

    path = str(tmp_path / 'evil.pth')
    torch.save({'x': GetattrExploit()}, path)
    register_safe_globals()
    with pytest.raises(pickle.UnpicklingError, match='refusing getattr'):
        load_local_checkpoint(path)


@pytest.mark.slow
def test_demo_runs_as_the_readme_shows(tools, tmp_path):
    # `make demo` (the main job) short: the dataset written, the schedule fitted to --iters
    # (its warm-up too), trained, evaluated, the summary printed
    work, data = tmp_path / 'demo', tmp_path / 'tiny_ade20k'
    _, out = tools('tools/train_demo.py', '--iters', 6, '--work-dir', work, '--data-root', data)
    assert osp.isfile(data / 'annotations' / 'validation' / 'ADE_val_00000040.png')
    assert osp.isfile(work / 'iter_6.pth')
    assert '6 iterations\n  trained in ' in out and f': {work}/iter_6.pth\n' in out
    miou = float(out.split('\n  mIoU: ')[-1].split()[0])
    assert 0 <= miou <= 100 and '(always the most frequent class: ' in out
