"""Shared fixtures: one tiny ADE20K-format dataset per session, a standard-attention tiny
Segmenter checkpoint trained on it, and running the tools as users do (subprocesses).

``tests/`` stays a plain folder of test files (the mmsegmentation wheel installs its own
``tests`` package); long end-to-end runs are marked ``slow`` (``pytest -m "not slow"`` is
the fast unit subset).
"""
import logging
import os
import os.path as osp
import re
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if ROOT not in sys.path:   # experiments outside the library: `from projects.swap_study import`
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    """Under pytest-xdist (``make test``: a worker per core), one intra-op thread per
    worker: the workers share the cores. A test that needs threads sets them
    (``torch.set_num_threads``)."""
    if os.environ.get('PYTEST_XDIST_WORKER'):
        import torch
        torch.set_num_threads(1)


TINY_UPERNET = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
TINY_SEGMENTER = osp.join(ROOT, 'configs', 'baselines',
                          'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')
# One thread per process: the tests' subprocesses share 2 cores.
ENV = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', PYTHONHASHSEED='0',
           PYTHONWARNINGS='ignore')


# A tiny MiTA UperNet training run on 64x64 crops of data_root (tools/train.py's tests).
TINY_TRAIN_CONFIG = """
_base_ = [{base!r}]
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
    dict(type='RandomCrop', crop_size=crop_size),
    dict(type='PackSegInputs')
]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root={data!r}, pipeline=train_pipeline))
val_dataloader = dict(num_workers=0, persistent_workers=False,
                      dataset=dict(data_root={data!r}))
test_dataloader = val_dataloader
train_cfg = dict(max_iters={iters}, val_interval=1000)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval={checkpoint_interval}))
"""


class RunsCode:
    """Pickles as a call of ``os.system``: loading it unrestricted would run the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command, )


@pytest.fixture()
def runs_code():
    """:class:`RunsCode`: ``runs_code('touch X')`` pickles as ``os.system('touch X')``."""
    return RunsCode


class Tools:
    """Runs ``python tools/<name>.py ...`` (or any script) from the repository root."""

    root = ROOT
    env = ENV

    def __call__(self, script, *args, check=True, env=None, timeout=900):
        """Run a script; returns ``(returncode, stdout + stderr)``. ``check``: a non-zero
        exit fails the test with the end of the output."""
        proc = subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout,
                              env=env or self.env)
        out = proc.stdout + proc.stderr
        if check and proc.returncode != 0:
            raise AssertionError(f'{script} {args} failed ({proc.returncode}):\n{out[-4000:]}')
        return proc.returncode, out

    @staticmethod
    def tiny_train_config(path, data_root, iters: int, checkpoint_interval: int = 1000) -> str:
        """Write :data:`TINY_TRAIN_CONFIG` (over the tiny MiTA UperNet config) to ``path``
        for ``iters`` iterations on ``data_root``; returns ``path``."""
        with open(path, 'w') as f:
            f.write(TINY_TRAIN_CONFIG.format(base=TINY_UPERNET, data=str(data_root), iters=iters,
                                             checkpoint_interval=checkpoint_interval))
        return str(path)

    @staticmethod
    def module(name: str):
        """``tools/<name>.py`` imported as a module (its ``parse_args`` and ``main``), to
        call in the test's process."""
        import importlib.util
        spec = importlib.util.spec_from_file_location(f'_tool_{name}',
                                                      osp.join(ROOT, 'tools', f'{name}.py'))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    @staticmethod
    def miou(out: str) -> float:
        """The last ``mIoU: x`` a tool printed."""
        found = re.findall(r'mIoU: ([0-9.]+)', out)
        assert found, out[-3000:]
        return float(found[-1])

    @staticmethod
    def data_options(data_root) -> list:
        """``--cfg-options`` values that point a tiny config at ``data_root``, without
        dataloader worker processes."""
        opts = []
        for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
            opts += [f'{loader}.dataset.data_root={data_root}', f'{loader}.num_workers=0',
                     f'{loader}.persistent_workers=False']
        return opts


@pytest.fixture(scope='session')
def tools():
    return Tools()


@pytest.fixture(scope='module')
def tiny_cfg():
    """mmseg's Segmenter ViT-T config, narrowed: 64 channels, 2 + 1 layers, patch 8, 10
    classes, 64x64 crops with stride 48 (two by two crops on a 112x112 image)."""
    from mita_seg.apis import load_config
    return load_config('mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py', {
        'model.backbone.embed_dims': 64, 'model.backbone.num_layers': 2,
        'model.backbone.num_heads': 4, 'model.backbone.patch_size': 8,
        'model.backbone.img_size': (64, 64), 'model.decode_head.in_channels': 64,
        'model.decode_head.channels': 64, 'model.decode_head.embed_dims': 64,
        'model.decode_head.num_heads': 4, 'model.decode_head.num_layers': 1,
        'model.decode_head.num_classes': 10, 'model.test_cfg.crop_size': (64, 64),
        'model.test_cfg.stride': (48, 48)
    })


@pytest.fixture(scope='session')
def tiny_data(tmp_path_factory, tools):
    """A tiny ADE20K-format dataset: 8 training and 4 validation images of 128x128."""
    root = tmp_path_factory.mktemp('data') / 'tiny_ade20k'
    tools('tools/dataset/make_tiny_ade20k.py', '--out', root, '--train', 8, '--val', 4,
          '--size', 128)
    return str(root)


@pytest.fixture(scope='session')
def segmenter_ckpt(tmp_path_factory, tiny_data):
    """``(config, checkpoint)``: the standard-attention tiny Segmenter of
    ``configs/baselines`` (ViT 4 x 64, patch 8, 2-layer mask head) on ``tiny_data``,
    trained 4 iterations by mmengine's Runner and saved as a model-zoo checkpoint
    (``meta`` + ``state_dict``)."""
    import torch
    from mmengine.config import Config
    from mmengine.runner import Runner

    tmp = tmp_path_factory.mktemp('segmenter')
    cfg = Config.fromfile(TINY_SEGMENTER)
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = tiny_data
        cfg[loader].num_workers = 0
        cfg[loader].persistent_workers = False
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=4, val_interval=100)
    cfg.default_hooks.checkpoint.interval = 100
    config = str(tmp / 'segmenter_vit-tiny_tiny-ade20k-128x128.py')
    cfg.dump(config)
    cfg.work_dir = str(tmp / 'train')
    runner = Runner.from_cfg(cfg)
    model = runner.train()
    ckpt = str(tmp / 'segmenter_vit-tiny_iter4.pth')
    torch.save({'meta': dict(dataset_meta=runner.train_dataloader.dataset.metainfo),
                'state_dict': model.state_dict()}, ckpt)
    return config, ckpt


class LogRecords(logging.Handler):
    """Collects the messages of mmengine's current logger (``with LogRecords() as r:``,
    then ``r.messages``)."""

    def __enter__(self):
        from mmengine.logging import MMLogger
        self.messages = []
        self.logger = MMLogger.get_current_instance()
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log_records():
    """:class:`LogRecords`, the context manager that collects mmengine's log messages."""
    return LogRecords


@pytest.fixture(scope='module')
def one_thread():
    """Small tensors: one thread (two threads on a loaded host wait on each other); a module
    takes it with ``pytestmark = pytest.mark.usefixtures('one_thread')``."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
