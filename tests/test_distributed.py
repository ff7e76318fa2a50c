"""Distributed training on CPU: two gloo processes through torchrun (tools/dist_train.sh)
train the tiny MiTA UperNet for a few iterations and end with the same weights, and a resumed
run gives each process back its own RNG state (~60 s)."""
import os
import os.path as osp
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')

# A hook, imported by the run's config, that saves every rank's weights and CPU RNG state
# before and after training (before: after SafeCheckpointHook restored a resumed run's RNG).
HOOK = '''
import os.path as osp

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmseg.registry import HOOKS


@HOOKS.register_module()
class SaveRankWeightsHook(Hook):
    priority = 'LOWEST'

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def before_train(self, runner):
        self._save(runner, 'before')

    def after_train(self, runner):
        self._save(runner, 'after')

    def _save(self, runner, when):
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        torch.save(dict(world_size=dist.get_world_size(), backend=dist.get_backend(),
                        wrapper=type(runner.model).__name__, state_dict=model.state_dict(),
                        rng=torch.get_rng_state()),
                   osp.join(self.out_dir, f'{when}{runner.iter}_rank{dist.get_rank()}.pth'))
'''


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_cpu_processes_agree(tmp_path):
    data = tmp_path / 'tiny_ade20k'
    subprocess.run([sys.executable, 'tools/dataset/make_tiny_ade20k.py', '--out', str(data),
                    '--train', '8', '--val', '2'], cwd=ROOT, check=True, capture_output=True)
    (tmp_path / 'rank_weights_hook.py').write_text(HOOK)
    cfg = tmp_path / 'dist_cfg.py'
    cfg.write_text(textwrap.dedent(f'''
        _base_ = [{CONFIG!r}]
        custom_imports = dict(imports=['mita_seg.models', 'rank_weights_hook'],
                              allow_failed_imports=False)
        custom_hooks = [dict(type='SaveRankWeightsHook', out_dir={str(tmp_path)!r})]
        '''))
    opts = []
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        opts += [f'{loader}.dataset.data_root={data}', f'{loader}.num_workers=0',
                 f'{loader}.persistent_workers=False']
    env = {**os.environ, 'PYTHON': sys.executable, 'PORT': str(free_port()),
           'PYTHONPATH': str(tmp_path), 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}

    def train(iters, *extra):
        proc = subprocess.run(
            ['bash', 'tools/dist_train.sh', str(cfg), '2', '--work-dir', str(tmp_path / 'work'),
             *extra, '--cfg-options', f'train_cfg.max_iters={iters}',
             'train_cfg.val_interval=100', 'default_hooks.checkpoint.interval=3',
             'default_hooks.logger.interval=1', 'randomness.diff_rank_seed=True', *opts],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        return proc.stdout + proc.stderr

    train(3)
    assert osp.isfile(tmp_path / 'work' / 'iter_3.pth')
    saved = {(when, r): torch.load(tmp_path / f'{when}{it}_rank{r}.pth', weights_only=True)
             for when, it in (('before', 0), ('after', 3)) for r in (0, 1)}
    assert saved['after', 0]['world_size'] == 2 and saved['after', 0]['backend'] == 'gloo'
    assert saved['after', 0]['wrapper'] == 'MMDistributedDataParallel'
    before, after0, after1 = (saved[k]['state_dict']
                              for k in (('before', 0), ('after', 0), ('after', 1)))
    # training changed the weights, identically on both ranks
    name = 'backbone.layers.0.attn.attn.in_proj_weight'
    assert not torch.equal(before[name], after0[name])
    for k, v in after0.items():
        if k.endswith(('running_mean', 'running_var', 'num_batches_tracked')):
            continue  # BN statistics are per rank (broadcast_buffers=False, as mmengine's)
        assert torch.equal(v, after1[k]), k

    # the checkpoint holds each rank's RNG state (their own streams: diff_rank_seed), and a
    # resumed run gives each rank its own back, not rank 0's (which saved the file)
    from mita_seg.utils.checkpoint import load_local_checkpoint, register_safe_globals
    register_safe_globals()   # mmengine's HistoryBuffer in the message hub
    rng = load_local_checkpoint(str(tmp_path / 'work' / 'iter_3.pth'))['mita_rng_state']
    assert len(rng['ranks']) == 2
    assert not torch.equal(rng['ranks'][0]['cpu'], rng['ranks'][1]['cpu'])
    log = train(4, '--resume')
    assert 'resumed epoch: 0, iter: 3' in log, log[-3000:]
    for r in (0, 1):
        resumed = torch.load(tmp_path / f'before3_rank{r}.pth', weights_only=True)
        assert torch.equal(resumed['rng'], rng['ranks'][r]['cpu']), f'rank {r}'
