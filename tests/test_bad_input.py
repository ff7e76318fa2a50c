"""Bad input to every tool, given as a careless user would: each one ends with a message that
says what to change, and nothing runs with random weights.

- a checkpoint that does not fit the model: exit 1, missing/unexpected/mis-shaped keys listed;
- a file that is no checkpoint (random bytes, text, truncated): "not a readable checkpoint";
- a bad ``--mita-cfg`` (unknown key, non-integer, ``pool_size`` < 1, ``topk`` < 1): exit 2 at
  argument parsing, naming the key and what it accepts, nothing written;
- ``--swap-attn`` on a model with nothing to swap (Swin): exit 1 listing its attention;
- a BEiT evaluated at a patch grid its bias tables were not built for: exit 1 saying to
  evaluate at the training crop (``mode='slide'``) or to interpolate the table.

The tools run as subprocesses, two at a time.
"""
import os.path as osp
import subprocess
import sys

import pytest
import torch

from mita_seg.utils import (CheckpointMismatchError, UnreadableCheckpointError,
                            UnsafeCheckpointError, load_checkpoint, load_local_checkpoint,
                            register_safe_globals)

SWIN = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'


def run_all(tools, commands):
    """Run ``{name: [script, args...]}`` two at a time; ``{name: (returncode, output)}``."""
    results, names = {}, list(commands)
    for i in range(0, len(names), 2):
        procs = {n: subprocess.Popen([sys.executable, *map(str, commands[n])], cwd=tools.root,
                                     env=tools.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                 for n in names[i:i + 2]}
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=900)
            results[name] = (proc.returncode, out)
    return results


def every_tool(config, ckpt, image, out):
    """The command of each tool that loads ``ckpt`` into the model of ``config``."""
    return {
        'test': ['tools/test.py', config, ckpt, '--work-dir', out / 'test'],
        'swap_sweep': ['tools/swap_sweep.py', config, ckpt, '--pool-sizes', 2, '--topks', 8,
                       '--work-dir', out / 'sweep'],
        'export_swapped': ['tools/export_swapped.py', config, ckpt, '--out-dir', out / 'ex'],
        'analyze_token_selection': ['tools/analyze_token_selection.py', config, ckpt, image,
                                    '--out-dir', out / 'an'],
        'image_demo': ['tools/image_demo.py', image, config, ckpt, '--out-file',
                       out / 'demo.png'],
    }


@pytest.fixture(scope='module')
def mismatched(segmenter_ckpt, tmp_path_factory):
    """The tiny Segmenter's weights with one key renamed and one tensor of another shape."""
    config, ckpt = segmenter_ckpt
    register_safe_globals()
    state = load_local_checkpoint(ckpt)['state_dict']
    state['backbone.layers.99.ffn.weight'] = state.pop('backbone.layers.0.ln1.bias')
    state['decode_head.cls_emb'] = torch.zeros(1, 3, 64)
    path = tmp_path_factory.mktemp('bad') / 'mismatch.pth'
    torch.save(dict(meta={}, state_dict=state), path)
    return path


@pytest.mark.slow
def test_every_tool_refuses_a_checkpoint_that_does_not_fit(segmenter_ckpt, mismatched, tools,
                                                           tiny_data, tmp_path):
    config, _ = segmenter_ckpt
    image = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000001.jpg')
    results = run_all(tools, every_tool(config, mismatched, image, tmp_path))
    for name, (code, out) in results.items():
        assert code == 1, f'{name}: {code}\n{out[-3000:]}'
        assert 'missing keys (1): backbone.layers.0.ln1.bias' in out, f'{name}\n{out[-3000:]}'
        assert 'unexpected keys (1): backbone.layers.99.ffn.weight' in out, name
        assert 'decode_head.cls_emb: checkpoint (1, 3, 64) vs model (1, 150, 64)' in out, name
        assert 'Traceback' not in out, f'{name}\n{out[-3000:]}'
        assert 'mIoU' not in out, name                          # nothing evaluated
    assert not (tmp_path / 'demo.png').exists() and not (tmp_path / 'ex').exists()


@pytest.mark.parametrize('content', [
    b'\x8e\x1f\x03' + bytes(range(256)) * 4,                    # random bytes
    b'hello, this is not a checkpoint\n',                       # a text file
    'truncated',                                                # a torch.save file, cut short
    b'',                                                        # empty
], ids=['random-bytes', 'text', 'truncated', 'empty'])
def test_not_a_checkpoint(content, tmp_path):
    path = tmp_path / 'x.pth'
    if content == 'truncated':
        torch.save(dict(state_dict=dict(w=torch.zeros(1000))), path)
        content = path.read_bytes()[:2000]
    path.write_bytes(content)
    # "not a readable checkpoint", not the message for a pickle with disallowed globals
    with pytest.raises(UnreadableCheckpointError, match='is not a readable checkpoint') as e:
        load_local_checkpoint(str(path))
    assert 'allow-list' not in str(e.value) and 'safe_globals' not in str(e.value)
    with pytest.raises(UnreadableCheckpointError):
        load_checkpoint(torch.nn.Linear(2, 2), str(path))


def test_tensor_file_holds_no_state_dict(tmp_path):
    torch.save(torch.zeros(3), tmp_path / 't.pth')
    with pytest.raises(CheckpointMismatchError, match='holds no state_dict'):
        load_checkpoint(torch.nn.Linear(2, 2), str(tmp_path / 't.pth'))


def test_unsafe_and_unreadable_are_told_apart(tmp_path):
    class RunsCode:
        def __reduce__(self):
            return (print, ('pwned', ))

    torch.save(dict(state_dict={}, x=RunsCode()), tmp_path / 'evil.pth')
    with pytest.raises(UnsafeCheckpointError, match=r'allow-list: builtins.print'):
        load_local_checkpoint(str(tmp_path / 'evil.pth'))


@pytest.mark.slow
def test_tools_say_not_a_readable_checkpoint(segmenter_ckpt, tiny_data, tools, tmp_path):
    config, _ = segmenter_ckpt
    junk = tmp_path / 'junk.pth'
    junk.write_bytes(bytes(range(256)) * 8)
    image = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000001.jpg')
    commands = every_tool(config, junk, image, tmp_path)
    results = run_all(tools, {k: commands[k] for k in ('test', 'image_demo')})
    for name, (code, out) in results.items():
        assert code == 1 and f'error: {junk} is not a readable checkpoint' in out, \
            f'{name}: {code}\n{out[-3000:]}'


BAD_MITA_CFG = [
    (['foo=1'], "unknown MiTA setting 'foo'; allowed: pool_size"),
    (['pool_size=abc'], "pool_size='abc': pool_size must be an int >= 1 or a pair"),
    (['pool_size=0'], 'pool_size=0: pool_size must be an int >= 1'),
    (['topk=-3'], 'topk=-3: topk must be an int >= 1'),
    (['topk=2.5'], 'topk=2.5: topk must be an int >= 1'),
    (['layers=3'], 'layers=3: layers must be None or a list of backbone layer indices'),
]


@pytest.mark.slow
def test_every_tool_checks_mita_cfg_at_argument_parsing(segmenter_ckpt, tiny_data, tools,
                                                        tmp_path):
    config, ckpt = segmenter_ckpt
    image = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000001.jpg')
    commands = dict(every_tool(config, ckpt, image, tmp_path),
                    get_flops=['tools/get_flops.py', config, '--json', tmp_path / 'f.json'])
    commands['swap_sweep'] += ['--flops-images', 1]
    # a different error per tool (swap_sweep sets pool_size and topk itself)
    bad = dict(zip(['test', 'export_swapped', 'analyze_token_selection', 'image_demo',
                    'get_flops', 'swap_sweep'], BAD_MITA_CFG))
    runs = {name: commands[name] + ['--mita-cfg', *bad[name][0]] for name in bad}
    runs['sweep-owns-topk'] = commands['swap_sweep'] + ['--mita-cfg', 'topk=3']
    results = run_all(tools, runs)
    for name, (code, out) in results.items():
        want = bad[name][1] if name in bad else \
            "unknown MiTA setting 'topk'; allowed: router_topk"
        assert code == 2, f'{name}: {code}\n{out[-3000:]}'
        assert f'--mita-cfg: {want}' in out, f'{name}\n{out[-3000:]}'
        assert 'Traceback' not in out
    assert list(tmp_path.iterdir()) == []                       # nothing written


@pytest.mark.slow
def test_every_tool_says_nothing_to_swap(tools, tmp_path):
    ckpt = tmp_path / 'any.pth'
    torch.save(dict(state_dict={}), ckpt)
    image = osp.join(tools.root, 'docs', 'swap', 'token_selection_ADE_val_00000001.png')
    commands = every_tool(SWIN, ckpt, image, tmp_path)
    for name in ('test', 'image_demo'):
        commands[name] += ['--swap-attn', 'mita']
    commands['get_flops'] = ['tools/get_flops.py', SWIN, '--swap-attn', 'mita', '--device',
                             'meta', '--shape', 64]
    results = run_all(tools, commands)
    for name, (code, out) in results.items():
        assert code == 1, f'{name}: {code}\n{out[-3000:]}'
        assert 'Traceback' not in out, f'{name}\n{out[-3000:]}'
        if name == 'export_swapped':     # export reads the config, the others build the model
            assert "error: export_swapped needs a VisionTransformer backbone" in out
            assert "this config has 'SwinTransformer'" in out
        else:
            assert 'error: swap_attention found no global attention' in out, name
            assert 'backbone.stages.0.blocks.0.attn (ShiftWindowMSA: windowed attention' \
                   in out, f'{name}\n{out[-3000:]}'


@pytest.mark.slow
def test_beit_at_another_grid_says_how_to_evaluate(tiny_data, tools, tmp_path):
    # a BEiT of 256x256 crops (a 32x32 grid) evaluated whole on images resized to 320x320:
    # a 40x40 grid its bias tables do not fit
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    from mita_seg.apis import load_config
    config = osp.join(tools.root, 'configs', 'baselines',
                      'beit-tiny_upernet_1xb4_tiny-ade20k-256x256.py')
    init_default_scope('mmseg')
    torch.manual_seed(0)
    ckpt = tmp_path / 'beit.pth'
    torch.save({'meta': {}, 'state_dict': MODELS.build(load_config(config).model).state_dict()},
               ckpt)
    options = ['--cfg-options', *tools.data_options(tiny_data), 'model.test_cfg.mode=whole',
               'test_dataloader.dataset.pipeline.1.scale=(1280,320)']
    results = run_all(tools, {   # as configured (mmseg's BEiT) and swapped to MiTA
        swap: ['tools/test.py', config, ckpt, '--work-dir', tmp_path / swap, *options,
               *(['--swap-attn', 'mita'] if swap == 'mita' else [])]
        for swap in ('none', 'mita')})
    for code, out in results.values():
        assert code == 1 and 'Traceback' not in out, out[-3000:]
        assert ('error: this BEiT/MAE backbone (its relative position bias tables) was built '
                'for a 32x32 patch grid') in out, out[-3000:]
        assert 'this input has a 40x40 grid' in out
        assert "test_cfg=dict(mode='slide', crop_size=<img_size>" in out
