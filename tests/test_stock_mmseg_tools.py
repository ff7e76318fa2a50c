"""mmseg's own ``tools/train.py`` and ``tools/test.py`` (shipped in the mmsegmentation wheel
under ``mmseg/.mim/tools``) train and evaluate our configs: the crash-safe, strict,
weights-only checkpoint hook and bf16 AMP on CPU come from the configs (registered hooks and
optim wrappers), not from our copies of the tools. A swap config (``_base_`` = a
standard-attention Segmenter config, its backbone switched to MiTA as the paper does)
evaluates the standard-attention checkpoint with mmseg's ``tools/test.py`` as our swap does."""
import os.path as osp
import re

import mmseg
import pytest

from mita_seg.utils import load_local_checkpoint, register_safe_globals

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
MMSEG_TOOLS = osp.join(osp.dirname(mmseg.__file__), '.mim', 'tools')

SWAP_CONFIG = """
_base_ = [{base!r}]
mita_cfg = dict(pool_size=4, topk=32)
model = dict(backbone=dict(type='MiTAVisionTransformer', mita_cfg=mita_cfg))  # the paper's
"""


@pytest.mark.slow
def test_mmseg_train_and_test_run_our_configs(tiny_data, tools, tmp_path):
    work = tmp_path / 'work'
    opts = tools.data_options(tiny_data) + [
        'train_cfg.max_iters=2', 'train_cfg.val_interval=100',
        'default_hooks.checkpoint.interval=2', 'default_hooks.logger.interval=1',
        'optim_wrapper.type=BF16AmpOptimWrapper'     # CPU AMP, registered by mita_seg.engine
    ]
    _, out = tools(osp.join(MMSEG_TOOLS, 'train.py'), CONFIG, '--work-dir', work,
                   '--cfg-options', *opts)
    assert 'Iter(train) [2/2]' in out
    dumped = (work / osp.basename(CONFIG)).read_text()
    assert "type='SafeCheckpointHook'" in dumped and "type='BF16AmpOptimWrapper'" in dumped
    register_safe_globals()
    ckpt = load_local_checkpoint(str(work / 'iter_2.pth'))
    assert 'mita_rng_state' in ckpt              # saved by the config's SafeCheckpointHook

    test_opts = ['--cfg-options', *tools.data_options(tiny_data)]
    _, out = tools(osp.join(MMSEG_TOOLS, 'test.py'), CONFIG, work / 'iter_2.pth',
                   '--work-dir', tmp_path / 'test', *test_opts)
    stock = float(re.findall(r'mIoU: ([0-9.]+)', out)[-1])
    _, out = tools('tools/test.py', CONFIG, work / 'iter_2.pth', '--work-dir',
                   tmp_path / 'ours', *test_opts)
    assert tools.miou(out) == pytest.approx(stock, abs=0.01)   # theirs prints 4 decimals

    # strict loading comes from the config too: a checkpoint that does not fit is an error
    state = ckpt['state_dict']
    state.pop('backbone.layers.0.ln1.bias')
    import torch
    torch.save(dict(state_dict=state), tmp_path / 'partial.pth')
    code, out = tools(osp.join(MMSEG_TOOLS, 'test.py'), CONFIG, tmp_path / 'partial.pth',
                      '--work-dir', tmp_path / 'partial', *test_opts, check=False)
    assert code != 0 and 'missing keys (1): backbone.layers.0.ln1.bias' in out


@pytest.mark.slow
def test_mmseg_test_evaluates_a_swap_config(segmenter_ckpt, tools, tmp_path):
    config, ckpt = segmenter_ckpt
    swap = tmp_path / 'mita_swap.py'
    swap.write_text(SWAP_CONFIG.format(base=config) + "custom_imports = dict(imports=["
                    "'mita_seg.models', 'mita_seg.engine'], allow_failed_imports=False)\n"
                    "default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))\n")
    _, out = tools(osp.join(MMSEG_TOOLS, 'test.py'), swap, ckpt, '--work-dir',
                   tmp_path / 'stock')
    stock = float(re.findall(r'mIoU: ([0-9.]+)', out)[-1])
    _, out = tools('tools/test.py', config, ckpt, '--work-dir', tmp_path / 'ours',
                   '--mita-cfg', 'pool_size=4', 'topk=32')
    assert tools.miou(out) == pytest.approx(stock, abs=0.01)
