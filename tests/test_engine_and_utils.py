"""``mita_seg.utils``, ``mita_seg.engine``, the IoU metric and the dataset generators: checkpoints
named by URL load weights-only, the generators never leave a torn file nor report a failed
write as written, ``--amp`` on CPU turns an AMP config to bfloat16, and the ``mpi`` and
``slurm`` launchers start on CPU as ``pytorch`` does."""
import os
import os.path as osp
import resource
import signal
import socket
import subprocess
import sys

import cv2
import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')


# ---------------------------------------------------------------------------------------
# Checkpoints named by URL (mmseg's configs: pretrained backbones) are loaded weights-only
# ---------------------------------------------------------------------------------------
@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """torch.hub's cache in ``tmp_path/hub``, and no network: a download copies
    ``tmp_path/served.pth`` (and is counted)."""
    monkeypatch.setattr(torch.hub, '_hub_dir', str(tmp_path / 'hub'))
    downloads = []

    def download(url, dst, hash_prefix=None, progress=True):
        downloads.append(url)
        with open(tmp_path / 'served.pth', 'rb') as f, open(dst, 'wb') as out:
            out.write(f.read())

    monkeypatch.setattr(torch.hub, 'download_url_to_file', download)
    cache = tmp_path / 'hub' / 'checkpoints'
    cache.mkdir(parents=True)
    return cache, downloads


def test_url_checkpoints_are_loaded_weights_only(tmp_path, hub, runs_code):
    from mmengine.runner.checkpoint import CheckpointLoader, get_external_models

    from mita_seg.utils.checkpoint import UnsafeCheckpointError, register_safe_globals
    register_safe_globals()
    cache, downloads = hub
    marker = tmp_path / 'PWNED'
    evil = dict(state_dict={'w': torch.zeros(2)}, payload=runs_code(f'touch {marker}'))
    # a download cached by an earlier run (mmengine and torch.hub cache by file name) ...
    torch.save(evil, cache / 'evil.pth')
    # ... and a model-zoo name, which mmengine resolves to a URL
    zoo_url = get_external_models()['vgg16_caffe']
    torch.save(evil, cache / osp.basename(zoo_url))
    for name in ('https://example.invalid/models/evil.pth', 'open-mmlab://vgg16_caffe'):
        with pytest.raises(UnsafeCheckpointError, match='posix.system|os.system'):
            CheckpointLoader.load_checkpoint(name, map_location='cpu')
        assert not marker.exists(), f'{name}: loading ran the checkpoint\'s code'
    assert downloads == []

    # a clean checkpoint is downloaded once, then read from the cache
    torch.save(dict(state_dict={'w': torch.ones(2)}), tmp_path / 'served.pth')
    for _ in range(2):
        ckpt = CheckpointLoader.load_checkpoint('https://example.invalid/a/good.pth?dl=1',
                                                map_location='cpu')
        assert torch.equal(ckpt['state_dict']['w'], torch.ones(2))
    assert downloads == ['https://example.invalid/a/good.pth?dl=1']
    assert sorted(os.listdir(cache)) == ['evil.pth', 'good.pth', osp.basename(zoo_url)]


# ---------------------------------------------------------------------------------------
# The dataset generators: a failed write is an error, and no file is ever torn
# ---------------------------------------------------------------------------------------
def _limit_file_size(limit):
    def preexec():
        # a write past `limit` bytes fails with EFBIG, as on a full disk (not killed)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


@pytest.mark.parametrize('tool', ['make_tiny_ade20k', 'make_longrange_ade20k'])
def test_generator_write_failure_is_an_error_and_leaves_no_torn_file(tmp_path, tool):
    out = tmp_path / 'data'
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', 'dataset', f'{tool}.py'), '--out', str(out),
         '--train', '2', '--val', '1', '--size', '64'],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_file_size(3000))   # the 64x64 JPEGs are larger, the labels not
    assert proc.returncode != 0, 'a failed write was reported as written:\n' + proc.stdout
    found = [osp.join(d, n) for d, _, names in os.walk(out) for n in names]
    for path in found:
        assert path.endswith(('.jpg', '.png')), f'left behind: {path}'
        assert cv2.imread(path, cv2.IMREAD_UNCHANGED) is not None, f'torn: {path}'
        with open(path, 'rb') as f:
            data = f.read()
        end = b'\xff\xd9' if path.endswith('.jpg') else b'IEND\xaeB`\x82'
        assert data.endswith(end), f'torn: {path} ({len(data)} bytes)'


@pytest.mark.parametrize('tool', ['make_tiny_ade20k', 'make_longrange_ade20k'])
def test_generator_refuses_a_folder_holding_more_scenes(tmp_path, tool):
    """Re-run as it was, or after an interruption, a generator writes its files again; into
    a folder holding more scenes (or other data) it would have left the rest for mmseg to
    read with the new ones."""
    out = tmp_path / 'data'

    def generate(train, extra=()):
        return subprocess.run(
            [sys.executable, osp.join(ROOT, 'tools', 'dataset', f'{tool}.py'), '--out',
             str(out), '--train', str(train), '--val', '1', '--size', '64', *extra],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)

    assert generate(3).returncode == 0
    (out / 'images' / 'training' / 'ADE_train_00000003.jpg').unlink()   # interrupted
    assert generate(3).returncode == 0                                    # finished
    before = sorted(p.name for p in (out / 'images' / 'training').iterdir())
    proc = generate(2)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f'error: {out}/images/training holds 1 .jpg file(s) this run would not write '
        '(ADE_train_00000003.jpg): mmseg would read them as part of the dataset. Give --out '
        'a new or empty folder, or remove that one first'), proc.stderr
    assert sorted(p.name for p in (out / 'images' / 'training').iterdir()) == before
    (out / 'images' / 'training' / 'ADE_train_00000003.jpg').unlink()
    (out / 'annotations' / 'training' / 'ADE_train_00000003.png').unlink()
    (out / 'annotations' / 'validation' / 'mine.png').write_bytes(b'')   # not its file
    assert 'annotations/validation holds 1 .png file(s) this run would not write (mine.png)' \
        in generate(2).stderr


def test_generators_write_the_same_bytes_as_before(tmp_path):
    """The atomic writer encodes as ``cv2.imwrite`` did: same seed, same files."""
    import numpy as np

    from mita_seg.utils.atomic_files import atomic_write_image
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)
    label = rng.integers(0, 150, (48, 40), dtype=np.uint8)
    for name, array, params in (('a.jpg', img, [cv2.IMWRITE_JPEG_QUALITY, 95]),
                                ('a.png', label, [])):
        cv2.imwrite(str(tmp_path / f'cv2_{name}'), array, params)
        atomic_write_image(array, tmp_path / name, params)
        assert (tmp_path / name).read_bytes() == (tmp_path / f'cv2_{name}').read_bytes()


# ---------------------------------------------------------------------------------------
# LabelledIoUMetric: mmseg's numbers where every class is labelled
# ---------------------------------------------------------------------------------------
def test_labelled_iou_equals_mmseg_where_every_class_is_labelled():
    """Its docstring: on data whose labels hold every class the two metrics are equal. A
    mean taken in float64 instead of mmseg's float32 rounds to another last digit now and
    then (about 1 evaluation in 600 of random 6-class maps: this one)."""
    import numpy as np
    from mmseg.evaluation import IoUMetric
    from mmseg.registry import METRICS

    import mita_seg.evaluation  # noqa: F401  (registers the metric)
    rng = np.random.default_rng(1991)
    label = rng.integers(0, 6, (16, 16))
    pred = np.where(rng.random(label.shape) < 0.5, label, rng.integers(0, 6, label.shape))
    assert set(np.unique(label)) == set(range(6))
    out = []
    for cls in (METRICS.get('LabelledIoUMetric'), IoUMetric):
        metric = cls(iou_metrics=['mIoU', 'mDice', 'mFscore'])
        metric.dataset_meta = dict(classes=tuple('abcdef'))
        metric.process({}, [dict(pred_sem_seg=dict(data=torch.as_tensor(pred)[None]),
                                 gt_sem_seg=dict(data=torch.as_tensor(label)[None]))])
        out.append(metric.compute_metrics(metric.results))
    assert out[0] == out[1]


# ---------------------------------------------------------------------------------------
# --amp on CPU
# ---------------------------------------------------------------------------------------
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason='checks the CPU path')


def _amp_cfg(**optim_wrapper):
    from mmengine.config import Config
    return Config(dict(optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01),
                                          **optim_wrapper)))


@cpu_only
def test_amp_turns_an_amp_config_to_bfloat16_on_cpu():
    """mmseg's ``-amp-`` configs set ``AmpOptimWrapper`` (fp16), which mmengine refuses
    without a GPU: ``--amp`` on CPU trains them in bfloat16 as any other config."""
    from mmseg.registry import OPTIM_WRAPPERS

    from mita_seg.engine import BF16AmpOptimWrapper, use_amp
    for kw in (dict(type='AmpOptimWrapper', loss_scale=512.),
               dict(type='AmpOptimWrapper', loss_scale='dynamic', dtype='float16'),
               dict(type='OptimWrapper')):
        cfg = _amp_cfg(**kw)
        use_amp(cfg)
        assert cfg.optim_wrapper.type == 'BF16AmpOptimWrapper', kw
        assert 'mita_seg.engine' in cfg.custom_imports.imports
        model = torch.nn.Linear(2, 2)
        args = {k: v for k, v in cfg.optim_wrapper.items() if k != 'optimizer'}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        wrapper = OPTIM_WRAPPERS.build(dict(args, optimizer=optimizer))
        assert isinstance(wrapper, BF16AmpOptimWrapper)


def test_amp_on_a_wrapper_it_cannot_switch_is_an_input_error():
    from mita_seg.engine import use_amp
    from mita_seg.utils.errors import InputError
    with pytest.raises(InputError, match="optim_wrapper.type is 'OptimWrapperDict'.*"
                       'optim_wrapper.type=OptimWrapper'):
        use_amp(_amp_cfg(type='OptimWrapperDict'))


# ---------------------------------------------------------------------------------------
# The tools' config switches import mita_seg.engine in the config they change
# ---------------------------------------------------------------------------------------
def test_switches_import_mita_seg_engine_in_a_config_without_custom_imports():
    """``use_safe_checkpoint``, ``use_amp`` and ``use_plain_param_groups`` add
    ``mita_seg.engine`` to ``custom_imports`` so that the dumped config builds on its own;
    on a config without ``custom_imports`` (every mmseg config) the addition was lost."""
    from mmengine.config import Config

    from mita_seg.engine import use_amp, use_plain_param_groups, use_safe_checkpoint

    def config(**extra):
        return Config(dict(
            optim_wrapper=dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.01)),
            default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=1)),
            compile=True, **extra))

    for switch in (use_safe_checkpoint, use_amp, use_plain_param_groups):
        cfg = config()
        switch(cfg)
        assert cfg.get('custom_imports', {}).get('imports') == ['mita_seg.engine'], \
            switch.__name__
        cfg = config(custom_imports=dict(imports=['x'], allow_failed_imports=False))
        switch(cfg)
        assert cfg.custom_imports == dict(imports=['x', 'mita_seg.engine'],
                                          allow_failed_imports=False), switch.__name__


DUMP_BUILDS_HOOK = """
import sys
from mmengine.config import Config
from mmengine.registry import init_default_scope
cfg = Config.fromfile(sys.argv[1])   # imports its custom_imports
init_default_scope('mmseg')
from mmseg.registry import HOOKS
print(type(HOOKS.build(cfg.default_hooks.checkpoint)).__name__)
"""


def test_dump_of_a_prepared_mmseg_config_builds_its_checkpoint_hook(tmp_path):
    """``tools/train.py mmseg::...`` switches the config's hook to ``SafeCheckpointHook``:
    the config the Runner dumps in the work dir must import it (mmseg's own tools, a
    ``--resume`` from the dump)."""
    from mita_seg.apis import load_config, prepare_config
    cfg = load_config('mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py',
                      None, str(tmp_path / 'work'))
    prepare_config(cfg, 'none')
    assert cfg.default_hooks.checkpoint.type == 'SafeCheckpointHook'
    dump = tmp_path / 'dumped.py'
    cfg.dump(str(dump))
    proc = subprocess.run([sys.executable, '-c', DUMP_BUILDS_HOOK, str(dump)], cwd=str(tmp_path),
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == 'SafeCheckpointHook'


# ---------------------------------------------------------------------------------------
# --launcher mpi / slurm on CPU
# ---------------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


LAUNCH_ENV = {
    'mpi': dict(OMPI_COMM_WORLD_RANK='0', OMPI_COMM_WORLD_SIZE='1',
                OMPI_COMM_WORLD_LOCAL_RANK='0', MASTER_ADDR='127.0.0.1'),
    'slurm': dict(SLURM_PROCID='0', SLURM_NTASKS='1', SLURM_LOCALID='0',
                  SLURM_NODELIST='node[1-2]'),
}


@pytest.fixture()
def fake_scontrol(tmp_path):
    """A ``scontrol`` on PATH that names this machine as the first host of the job."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    script = bin_dir / 'scontrol'
    script.write_text('#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n')
    script.chmod(0o755)
    return str(bin_dir)


@cpu_only
@pytest.mark.parametrize('launcher', ['mpi', 'slurm'])
def test_mpi_and_slurm_launchers_start_on_cpu(launcher, monkeypatch, fake_scontrol):
    import torch.distributed as dist
    from mmengine.config import Config

    from mita_seg.utils.dist import setup_cpu_distributed
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'):
        # set, then deleted: monkeypatch then restores what was there (or its absence) after
        # setup_cpu_distributed sets them, and they do not leak into the worker's next tests
        monkeypatch.setenv(name, '')
        monkeypatch.delenv(name)
    for name, value in LAUNCH_ENV[launcher].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv('PATH', fake_scontrol + os.pathsep + os.environ['PATH'])
    port = _free_port()
    cfg = Config(dict(env_cfg=dict(dist_cfg=dict(backend='nccl', port=port)) if
                      launcher == 'slurm' else dict(dist_cfg=dict(backend='nccl')),
                      model_wrapper_cfg=None))
    if launcher == 'mpi':
        monkeypatch.setenv('MASTER_PORT', str(port))
    assert not dist.is_initialized()
    try:
        setup_cpu_distributed(cfg, launcher)
        assert dist.is_initialized(), f'--launcher {launcher}: no process group on CPU'
        assert dist.get_backend() == 'gloo' and dist.get_world_size() == 1
        assert (os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK']) == \
            ('0', '1', '0')
        assert os.environ['MASTER_ADDR'] == '127.0.0.1'
        assert os.environ['MASTER_PORT'] == str(port)
        assert cfg.model_wrapper_cfg['device_ids'] is None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize('launcher,own', [('mpi', 'OMPI_COMM_WORLD_LOCAL_RANK'),
                                          ('slurm', 'SLURM_LOCALID')])
def test_prepare_config_takes_the_launchers_local_rank(launcher, own, monkeypatch):
    """The Runner wraps DDP with ``device_ids=[LOCAL_RANK]``; MMEngine's mpi launcher leaves
    it unset, so every process of a node wrapped GPU 0. As on a CUDA machine (where MMEngine
    starts the process group itself: no gloo set-up here, nothing started)."""
    import torch.distributed as dist
    from mmengine.config import Config

    from mita_seg.apis.runner import prepare_config
    monkeypatch.setenv('LOCAL_RANK', '')
    monkeypatch.delenv('LOCAL_RANK')          # restored (absent) after the test
    for name, value in LAUNCH_ENV[launcher].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(own, '3')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    prepare_config(Config(dict(model=dict(type='EncoderDecoder'), work_dir='w',
                               default_hooks=dict())), launcher)
    assert not dist.is_initialized()
    assert os.environ['LOCAL_RANK'] == '3'


@cpu_only
@pytest.mark.slow
def test_train_tool_with_mpi_launcher_on_cpu(tools, tmp_path):
    """``tools/train.py --launcher mpi`` as ``mpirun -n 1`` starts it, on CPU (~30 s)."""
    data = tmp_path / 'data'
    subprocess.run([sys.executable, osp.join(ROOT, 'tools/dataset/make_tiny_ade20k.py'),
                    '--out', str(data), '--train', '4', '--val', '1', '--size', '64'],
                   check=True, env=ENV, capture_output=True)
    config = tools.tiny_train_config(tmp_path / 'mpi.py', data, iters=2, checkpoint_interval=2)
    env = {k: v for k, v in ENV.items() if k not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')}
    env.update(LAUNCH_ENV['mpi'], MASTER_PORT=str(_free_port()))
    res = subprocess.run([sys.executable, osp.join(ROOT, 'tools/train.py'), str(config),
                          '--work-dir', str(tmp_path / 'work'), '--launcher', 'mpi'],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert osp.isfile(tmp_path / 'work' / 'iter_2.pth')
