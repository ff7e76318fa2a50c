"""Interrupted training, crash-safe checkpoints and untrusted checkpoints, end to end.

The training runs go through ``tools/train.py`` (the real mmengine ``Runner``) on a tiny
synthetic ADE20K (64x64 images) with a tiny MiTA ViT UperNet, on CPU, with a fixed seed and
``deterministic=True``.
"""
import json
import os
import os.path as osp
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip('mmseg')

from mita_seg.engine import AtomicLocalBackend  # noqa: E402
from mita_seg.utils import (CheckpointMismatchError, check_checkpoint_keys,  # noqa: E402
                            load_local_checkpoint, register_safe_globals)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
PY = sys.executable
BASE_CONFIG = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
ENV = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', PYTHONHASHSEED='0')

# A tiny, deterministic version of the project's tiny config: 64x64 crops, 32-dim tokens,
# no worker processes, a checkpoint every 2 iterations, a log line every iteration.
TINY_CONFIG = """
_base_ = [{base!r}]
data_root = {data!r}
crop_size = (64, 64)
model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(img_size=crop_size, embed_dims=32, num_heads=2,
                  mita_cfg=dict(pool_size=2, topk=16)),
    neck=dict(in_channels=[32] * 4, out_channels=32),
    decode_head=dict(in_channels=[32] * 4, channels=32),
    auxiliary_head=dict(in_channels=32, channels=16))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(128, 64), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(128, 64), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=8)]
train_cfg = dict(max_iters={iters}, val_interval=1000)
default_hooks = dict(logger=dict(interval=1),
                     checkpoint=dict(interval=2, max_keep_ckpts={keep}))
randomness = dict(seed=0, deterministic=True)
"""


@pytest.fixture(scope='module')
def tiny(tmp_path_factory, tiny_data):
    """Config writer shared by the tests of this module (the session's tiny dataset)."""
    root = tmp_path_factory.mktemp('reliability')

    def config(name, iters=8, keep=-1, extra=''):
        path = root / f'{name}.py'
        path.write_text(TINY_CONFIG.format(base=BASE_CONFIG, data=tiny_data, iters=iters,
                                           keep=keep) + extra)
        return str(path)

    config.root = root
    return config


def _train(config, work_dir, *args, wait=True, env=ENV):
    cmd = [PY, osp.join(ROOT, 'tools/train.py'), config, '--work-dir', str(work_dir), *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _losses(work_dir):
    """iteration -> logged loss of every run in ``work_dir`` (later runs win)."""
    losses = {}
    for stamp in sorted(os.listdir(work_dir)):
        scalars = osp.join(work_dir, stamp, 'vis_data', 'scalars.json')
        if osp.isfile(scalars):
            with open(scalars) as f:
                for line in f:
                    rec = json.loads(line)
                    if 'loss' in rec:
                        losses[rec['step']] = rec['loss']
    return losses


def _weights(path):
    register_safe_globals()
    return load_local_checkpoint(str(path), map_location='cpu')['state_dict']


# ---------------------------------------------------------------------------------------
# Interrupted training loses nothing
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def uninterrupted(tiny):
    work = tiny.root / 'uninterrupted'
    res = _train(tiny('run'), work)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return work


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tiny, uninterrupted):
    config = tiny('run')
    work = tiny.root / 'killed'
    proc = _train(config, work, wait=False)
    pointer = work / 'last_checkpoint'
    deadline = time.time() + 300
    while not pointer.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, 'training ended before it could be killed:\n' + proc.stdout.read()
    proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
    proc.wait()
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    killed_at = osp.basename(pointer.read_text())
    assert not (work / 'iter_8.pth').exists(), 'the run was not interrupted'

    res = _train(config, work, '--resume')
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = res.stdout + res.stderr
    resumed_iter = int(killed_at[len('iter_'):-len('.pth')])
    assert f'resumed epoch: 0, iter: {resumed_iter}' in log, log[-3000:]

    # the tool used the crash-safe hook (tools/train.py switches mmengine's to it)
    dumped = (work / 'run.py').read_text()
    assert 'SafeCheckpointHook' in dumped

    # same weights and same loss at the final iteration as the uninterrupted run
    register_safe_globals()
    assert 'mita_rng_state' in load_local_checkpoint(str(work / 'iter_8.pth'))
    ref, out = _weights(uninterrupted / 'iter_8.pth'), _weights(work / 'iter_8.pth')
    assert ref.keys() == out.keys()
    for k in ref:
        assert torch.equal(ref[k], out[k]), f'{k} differs after resume (killed at {killed_at})'
    ref_loss, out_loss = _losses(uninterrupted), _losses(work)
    assert 8 in ref_loss and ref_loss[8] == out_loss[8], (ref_loss, out_loss)


# ---------------------------------------------------------------------------------------
# A checkpoint is never half-written
# ---------------------------------------------------------------------------------------
FAULT_MODULE = '''
import torch
from mmengine.hooks import Hook
from mmseg.registry import HOOKS


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError('injected failure while pickling the checkpoint')


@HOOKS.register_module()
class FailingSaveHook(Hook):
    """Makes torch.save raise midway through the n-th checkpoint (after the weights)."""

    def __init__(self, fail_at=2):
        self.fail_at, self.saves = fail_at, 0

    def before_save_checkpoint(self, runner, checkpoint):
        self.saves += 1
        if self.saves == self.fail_at:
            checkpoint['zz_fault'] = [torch.zeros(1 << 18), Unpicklable()]
'''


@pytest.mark.slow
def test_failed_save_keeps_previous_checkpoint(tiny):
    (tiny.root / 'fault_injection.py').write_text(FAULT_MODULE)
    config = tiny('fault', iters=4, keep=1, extra=(
        "custom_imports = dict(imports=['mita_seg.models', 'fault_injection'], "
        "allow_failed_imports=False)\n"
        "custom_hooks = [dict(type='FailingSaveHook', fail_at=2)]\n"))
    work = tiny.root / 'fault'
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(tiny.root), ENV.get('PYTHONPATH', '')]))
    res = _train(config, work, env=env)
    assert res.returncode != 0 and 'injected failure' in res.stderr, res.stderr[-3000:]
    # mmengine would have deleted iter_2.pth (max_keep_ckpts=1) before failing on iter_4
    assert (work / 'last_checkpoint').read_text() == str(work / 'iter_2.pth')
    assert _weights(work / 'iter_2.pth')
    assert not (work / 'iter_4.pth').exists()
    assert not [f for f in os.listdir(work) if f.endswith('.tmp')]


def test_safe_hook_writes_through_the_atomic_backend(tiny, tmp_path):
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mita_seg.engine import SafeCheckpointHook, use_safe_checkpoint
    cfg = Config.fromfile(tiny('run'))
    cfg.work_dir = str(tmp_path)
    use_safe_checkpoint(cfg)
    runner = Runner.from_cfg(cfg)
    (hook, ) = [h for h in runner.hooks if isinstance(h, SafeCheckpointHook)]
    hook.before_train(runner)
    assert type(hook.file_backend) is AtomicLocalBackend
    assert hook.backend_args == dict(backend='mita_atomic_local')


def test_atomic_write_keeps_old_file_when_writing_fails(tmp_path, monkeypatch):
    target = tmp_path / 'ckpt.pth'
    target.write_bytes(b'old')

    def fail(fd):
        raise OSError(28, 'No space left on device (injected)')

    monkeypatch.setattr(os, 'fsync', fail)  # the data is written, not yet durable
    with pytest.raises(OSError, match='injected'):
        AtomicLocalBackend().put(b'new' * 1000, target)
    assert target.read_bytes() == b'old'
    assert os.listdir(tmp_path) == ['ckpt.pth']  # no temporary file left behind


@pytest.mark.parametrize('umask', [0o022, 0o077, 0o002])
def test_atomic_writes_follow_the_umask_and_keep_a_replaced_files_mode(tmp_path, umask):
    """A new file gets ``0666 & ~umask``, as ``open`` gives it (mkstemp's temporary file is
    0600); a replaced file keeps its mode; both through the bytes writer (checkpoints,
    plans, last_checkpoint) and the path one (ONNX export)."""
    from mita_seg.engine.atomic_io import atomic_path, atomic_write_bytes
    old = os.umask(umask)
    try:
        new = tmp_path / 'new.pth'
        atomic_write_bytes(b'x', new)
        with atomic_path(tmp_path / 'new.onnx', suffix='.onnx.part') as tmp:
            Path(tmp).write_bytes(b'onnx')
        plain = tmp_path / 'plain'
        plain.write_bytes(b'x')  # what open() gives, for comparison
        kept = tmp_path / 'kept.pth'
        kept.write_bytes(b'old')
        os.chmod(kept, 0o640)
        atomic_write_bytes(b'new', kept)
    finally:
        os.umask(old)
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    assert mode(new) == mode(tmp_path / 'new.onnx') == mode(plain) == 0o666 & ~umask
    assert mode(kept) == 0o640 and kept.read_bytes() == b'new'
    assert sorted(os.listdir(tmp_path)) == ['kept.pth', 'new.onnx', 'new.pth', 'plain']


WRITER = '''
import sys, torch, io
from mita_seg.engine import atomic_write_bytes, atomic_write_text
path, n = sys.argv[1], 0
while True:
    n += 1
    buf = io.BytesIO()
    torch.save(dict(version=n, weights=torch.full((1 << 22, ), float(n))), buf)
    atomic_write_bytes(buf.getvalue(), path)
    atomic_write_text(str(n), path + '.pointer')
    print(n, flush=True)
'''


def test_sigkill_during_writes_never_leaves_a_torn_file(tmp_path):
    """SIGKILL at random moments while 16 MB checkpoints are rewritten in a loop: the file
    on disk always loads, whole, as one of the versions written."""
    path = str(tmp_path / 'ckpt.pth')
    rng = random.Random(0)
    for trial in range(3):
        proc = subprocess.Popen([PY, '-c', WRITER, path], env=ENV, cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip()  # at least one version is on disk
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        ckpt = torch.load(path, weights_only=True)
        n = ckpt['version']
        assert torch.equal(ckpt['weights'], torch.full((1 << 22, ), float(n))), trial
        pointer = int(open(path + '.pointer').read())
        assert pointer in (n - 1, n), (pointer, n)


def test_check_checkpoint_keys_lists_missing_and_unexpected():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    state = dict(model.state_dict())
    check_checkpoint_keys(model, dict(state_dict=state))  # fits: no error
    check_checkpoint_keys(model, dict(state_dict={f'module.{k}': v for k, v in state.items()}))
    state['extra.weight'] = state.pop('1.bias')
    state['0.weight'] = torch.zeros(5, 2)
    with pytest.raises(CheckpointMismatchError) as e:
        check_checkpoint_keys(model, dict(state_dict=state), source='x.pth')
    msg = str(e.value)
    assert 'missing keys (1): 1.bias' in msg and 'unexpected keys (1): extra.weight' in msg
    assert '0.weight: checkpoint (5, 2) vs model (3, 2)' in msg


# ---------------------------------------------------------------------------------------
# Untrusted checkpoints are not executed
# ---------------------------------------------------------------------------------------
@pytest.fixture()
def evil(tmp_path, uninterrupted, runs_code):
    """A checkpoint with real weights of the tiny model plus a code-running payload."""
    marker = tmp_path / 'PWNED'
    ckpt = dict(meta=dict(iter=8), state_dict=_weights(uninterrupted / 'iter_8.pth'),
                payload=runs_code(f'touch {marker}'))
    path = tmp_path / 'evil.pth'
    torch.save(ckpt, path)
    # the payload is really in there (checked without unpickling it)
    assert any('system' in g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path))
    return path, marker


REFUSED = ('weights-only', 'Weights only load failed', 'UnsafeCheckpointError')


@pytest.mark.slow
def test_every_loading_path_refuses_code_in_checkpoints(tiny, tiny_data, evil, tmp_path):
    path, marker = evil
    config = tiny('run')
    resume_dir = tmp_path / 'resume'
    resume_dir.mkdir()
    (resume_dir / 'last_checkpoint').write_text(str(path))
    image = sorted(Path(tiny_data, 'images', 'validation').iterdir())[0]
    tools = {
        'train load_from': [osp.join(ROOT, 'tools/train.py'), config, '--work-dir',
                            str(tmp_path / 'lf'), '--cfg-options', f'load_from={path}'],
        'train --resume': [osp.join(ROOT, 'tools/train.py'), config, '--work-dir',
                           str(resume_dir), '--resume'],
        'test': [osp.join(ROOT, 'tools/test.py'), config, str(path), '--work-dir',
                 str(tmp_path / 'test')],
        'swap_sweep': [osp.join(ROOT, 'tools/swap_sweep.py'), config, str(path),
                       '--pool-sizes', '2', '--topks', '8', '--work-dir', str(tmp_path / 'sw')],
        'export_swapped': [osp.join(ROOT, 'tools/export_swapped.py'), config, str(path),
                           '--out-dir', str(tmp_path / 'ex')],
        'analyze_token_selection': [osp.join(ROOT, 'tools/analyze_token_selection.py'), config,
                                    str(path), str(image), '--out-dir', str(tmp_path / 'an')],
        'image_demo': [osp.join(ROOT, 'tools/image_demo.py'), str(image), config, str(path),
                       '--out-file', str(tmp_path / 'demo.png')],
    }
    failures = []
    # two at a time (2 cores); each fails at load time
    names = list(tools)
    for i in range(0, len(names), 2):
        procs = {n: subprocess.Popen([PY, *tools[n]], env=ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                 for n in names[i:i + 2]}
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=600)
            if proc.returncode == 0 or not any(r in out for r in REFUSED):
                failures.append(f'{name}: rc={proc.returncode}\n{out[-2000:]}')
    assert not marker.exists(), 'a loading path executed the checkpoint payload'
    assert not failures, '\n\n'.join(failures)


@pytest.mark.slow
def test_pretrained_init_refuses_code_in_checkpoints(evil):
    from mita_seg.models import MiTAVisionTransformer
    path, marker = evil
    register_safe_globals()
    model = MiTAVisionTransformer(
        img_size=(64, 64), patch_size=8, embed_dims=32, num_layers=2, num_heads=2,
        mita_cfg=dict(pool_size=2, topk=8), init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(Exception, match='|'.join(REFUSED)):
        model.init_weights()
    assert not marker.exists()


def test_pretrained_init_with_mismatched_keys_is_an_error(tmp_path):
    from mita_seg.models import MiTAVisionTransformer
    register_safe_globals()
    kw = dict(img_size=(64, 64), patch_size=8, embed_dims=32, num_layers=2, num_heads=2,
              mita_cfg=dict(pool_size=2, topk=8))
    state = MiTAVisionTransformer(**kw).state_dict()
    state['bogus.weight'] = state.pop('layers.0.ln1.weight')
    path = tmp_path / 'pretrained.pth'
    torch.save(dict(state_dict=state), path)
    model = MiTAVisionTransformer(init_cfg=dict(type='Pretrained', checkpoint=str(path)), **kw)
    with pytest.raises(ValueError) as e:
        model.init_weights()
    assert 'missing keys (1): layers.0.ln1.weight' in str(e.value)
    assert 'unexpected keys (1): bogus.weight' in str(e.value)
