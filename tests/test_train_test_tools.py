"""End to end on the tiny dataset: tools/train.py -> checkpoint -> tools/test.py -> --resume.

Also the checkpoint allow-list: our checkpoints load with ``weights_only=True``, a
malicious pickle does not. Runs the tools as subprocesses, as users do (about 1-2 min).
"""
import os
import os.path as osp
import pickle
import re
import subprocess
import sys

import pytest
import torch

from mita_seg.utils import UnsafeCheckpointError, load_local_checkpoint, register_safe_globals

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')


def run_tool(*args, check=True):
    """Run a tool from the repo root with this interpreter; return its output."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={'OMP_NUM_THREADS': '1', **os.environ,
                                                'PYTHONWARNINGS': 'ignore'})
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f'{args} failed ({proc.returncode}):\n{out[-4000:]}')
    return proc.returncode, out


def data_options(data_root):
    """--cfg-options for the tiny dataset at ``data_root``, no worker processes."""
    opts = []
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        opts += [f'{loader}.dataset.data_root={data_root}', f'{loader}.num_workers=0',
                 f'{loader}.persistent_workers=False']
    return opts


def miou(out):
    found = re.findall(r'mIoU: ([0-9.]+)', out)
    assert found, out[-3000:]
    return float(found[-1])


@pytest.fixture(scope='module')
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp('data') / 'tiny_ade20k'
    run_tool('tools/dataset/make_tiny_ade20k.py', '--out', str(root), '--train', '8',
             '--val', '3', '--size', '128')
    return str(root)


def test_tiny_dataset_layout(tiny_data):
    import cv2
    import numpy as np
    for split, n in (('training', 8), ('validation', 3)):
        imgs = sorted(os.listdir(osp.join(tiny_data, 'images', split)))
        anns = sorted(os.listdir(osp.join(tiny_data, 'annotations', split)))
        assert len(imgs) == len(anns) == n
        assert [i[:-4] for i in imgs] == [a[:-4] for a in anns]
        assert all(i.endswith('.jpg') for i in imgs) and all(a.endswith('.png') for a in anns)
    label = cv2.imread(osp.join(tiny_data, 'annotations', 'validation', anns[0]),
                       cv2.IMREAD_UNCHANGED)
    assert label.dtype == np.uint8 and label.shape == (128, 128)
    assert set(np.unique(label)) <= {0, 3, 4, 5, 8, 13, 21}  # 0 = other, ADE ids 1..150


def test_train_test_resume(tiny_data, tmp_path):
    work = str(tmp_path / 'work')
    opts = data_options(tiny_data) + [
        'train_cfg.val_interval=100', 'default_hooks.checkpoint.interval=2',
        'default_hooks.logger.interval=1'
    ]
    # train 2 iterations, checkpoint
    _, out = run_tool('tools/train.py', CONFIG, '--work-dir', work, '--cfg-options',
                      'train_cfg.max_iters=2', *opts)
    assert 'Iter(train) [2/2]' in out
    ckpt = osp.join(work, 'iter_2.pth')
    assert osp.isfile(ckpt)
    # the checkpoint, with its message hub and numpy values, loads weights-only
    register_safe_globals()
    state = load_local_checkpoint(ckpt, map_location='cpu')
    assert state['meta']['iter'] == 2 and 'message_hub' in state

    # evaluate it
    test_opts = ['--cfg-options', *data_options(tiny_data)]
    preds = tmp_path / 'preds'
    _, out = run_tool('tools/test.py', CONFIG, ckpt, '--work-dir', str(tmp_path / 'test'),
                      '--out', str(preds), *test_opts)
    base = miou(out)
    assert sorted(os.listdir(preds)) == [f'ADE_val_{i:08d}.png' for i in (1, 2, 3)]
    assert 'missing keys' not in out and 'unexpected key' not in out
    # swapping the (already MiTA) model's attention with the same settings after the runner
    # is built, before it loads the checkpoint in test(): same weights, same mIoU
    _, out = run_tool('tools/test.py', CONFIG, ckpt, '--work-dir', str(tmp_path / 'test2'),
                      '--swap-attn', 'mita', '--mita-cfg', 'pool_size=4', 'topk=32', *test_opts)
    assert 'swap_attention: 4 attention modules on MiTA' in out
    assert miou(out) == base
    # other settings at test time; those not given keep the model's (pool_size=4)
    _, out = run_tool('tools/test.py', CONFIG, ckpt, '--work-dir', str(tmp_path / 'test3'),
                      '--swap-attn', 'mita', '--mita-cfg', 'topk=8', 'router_topk=2',
                      *test_opts)
    assert "{'pool_size': 4, 'topk': 8, 'router_topk': 2" in out
    assert 0 <= miou(out) <= 100

    # resume: continues from iteration 2 to 3
    _, out = run_tool('tools/train.py', CONFIG, '--work-dir', work, '--resume',
                      '--cfg-options', 'train_cfg.max_iters=3', *opts)
    assert 'resumed epoch: 0, iter: 2' in out
    assert 'Iter(train) [3/3]' in out


def load_tool(name):
    """Import ``tools/<name>.py`` as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f'tool_{name}', osp.join(ROOT, 'tools',
                                                                         f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_test_tool_rejects_bad_mita_cfg(capsys):
    parse_args = load_tool('test').parse_args
    args = parse_args([CONFIG, 'x.pth', '--swap-attn', 'mita', '--mita-cfg', 'topk=16',
                       'pool_size=4', 'layers=[0,1]'])
    assert args.mita_cfg == dict(topk=16, pool_size=4, layers=[0, 1])
    # --mita-cfg keys are MiTA settings: a typo is an error, not silently ignored
    with pytest.raises(SystemExit):
        parse_args([CONFIG, 'x.pth', '--swap-attn', 'mita', '--mita-cfg', 'top_k=3'])
    assert "unknown keys ['top_k']" in capsys.readouterr().err
    # --mita-cfg without --swap-attn mita
    with pytest.raises(SystemExit):
        parse_args([CONFIG, 'x.pth', '--mita-cfg', 'topk=3'])
    assert '--mita-cfg needs --swap-attn mita' in capsys.readouterr().err


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
