"""Bad input to every tool, given as a careless user would: each one ends with a message that
says what to change, and nothing runs with random weights.

- a checkpoint that does not fit the model: exit 1, missing/unexpected/mis-shaped keys listed;
- a file that is no checkpoint (random bytes, text, truncated): "not a readable checkpoint";
- a bad ``--mita-cfg`` (unknown key, non-integer, ``pool_size`` < 1, ``topk`` < 1): exit 2 at
  argument parsing, naming the key and what it accepts, nothing written;
- ``--swap-attn`` on a model with nothing to swap (Swin): exit 1 listing its attention;
- a BEiT evaluated at a patch grid its bias tables were not built for: exit 1 saying to
  evaluate at the training crop (``mode='slide'``) or to interpolate the table;
- careless input to every argument of every tool (:func:`careless_cases`: a missing file, a
  directory, an empty, truncated or wrong kind of file, an output path under a file or ending
  in ``/``, an out-of-range number, ``KEY`` without ``=VALUE``, ``router_topk`` above ``M``, a
  launcher outside its starter, a flag that does not exist): one ``error: ...`` line naming
  the input, no usage block, exit 2 (refused while parsing) or 1 (found once a file is read
  or the model built), no traceback, nothing written; run in one interpreter through
  ``runpy`` (fast) and a few as separate processes; and, with a trained model,
  ``layers=[9]``, ``--title``, ``--json`` into a new folder and a sweep whose pools clamp to
  the grid.

The tools run as subprocesses, two at a time.
"""
import csv
import json
import os
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


# ---------------------------------------------------------------- careless input, per tool
# Every argument of every tool given a missing file, a directory, an empty file, a file of the
# wrong kind, a truncated file or an out-of-range number: one ``error: ...`` line naming the
# input and what to give instead (exit status 2 where the argument alone is wrong, refused
# while parsing; 1 where the file's content is), no usage block, never a traceback, nothing
# written.

CFG = 'configs/baselines/segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py'

# Runs each ``(tool, argv)`` as ``python tools/<tool>.py argv`` would (``runpy`` with
# ``__name__ == '__main__'``) in ONE interpreter, so the imports are paid once; prints a JSON
# list of (exit status, output) per case.
DRIVER = r'''
import contextlib, io, json, runpy, sys, traceback
cases = json.loads(sys.argv[1])
results = []
for script, argv in cases:
    out = io.StringIO()
    code = 0
    sys.argv = [script] + argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name='__main__')
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 'traceback'
    results.append((code, out.getvalue()))
print('\nRESULTS ' + json.dumps(results))
'''


def run_cases(tools, cases, timeout=600):
    """``{name: (tool, argv, ...)}`` -> ``{name: (exit status, output)}``, one interpreter."""
    import json
    names = list(cases)
    payload = json.dumps([(f'tools/{cases[n][0]}.py', [str(a) for a in cases[n][1]])
                          for n in names])
    env = dict(tools.env, MALLOC_MMAP_THRESHOLD_='65536', COLUMNS='200')  # benchmark: no re-exec
    proc = subprocess.run([sys.executable, '-c', DRIVER, payload], cwd=tools.root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert 'RESULTS ' in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout.split('RESULTS ', 1)[1])
    return dict(zip(names, results))


@pytest.fixture(scope='module')
def careless(tmp_path_factory, tools):
    """Files a careless hand gives: each name -> a path; ``work``: a folder outside them for
    the work dirs of runs that start, ``data``: a tiny dataset (2 + 2 images of 32x32)."""
    import cv2
    import numpy as np
    work = tmp_path_factory.mktemp('careless_work')
    tools('tools/dataset/make_tiny_ade20k.py', '--out', work / 'data', '--train', 2, '--val', 2,
          '--size', 32)
    d = tmp_path_factory.mktemp('careless')
    (d / 'folder').mkdir()
    (d / 'afile').write_text('not a folder\n')
    (d / 'empty.pth').write_bytes(b'')
    (d / 'empty.py').write_text('')
    (d / 'text.jpg').write_text('hello, this is not an image\n')
    png = cv2.imencode('.png', np.random.default_rng(0).integers(0, 255, (64, 64, 3),
                                                                 dtype=np.uint8))[1].tobytes()
    (d / 'truncated.png').write_bytes(png[:len(png) // 3])
    (d / 'good.png').write_bytes(png)
    (d / 'broken.py').write_text('model = dict(type="EncoderDecoder"\n')     # cut short
    (d / 'nomodel.py').write_text('x = 1\n')
    (d / 'fake.pth').write_bytes(b'\x00' * 64)      # exists: its content is read later
    (d / 'agent_topk_plan.json').write_text(json.dumps(dict(        # a key agent does not read
        format='mita_seg.swap_plan/1', layers=[
            dict(name='backbone.layers.0.attn', setting=dict(kind='agent', pool_size=7,
                                                             topk=16))])))
    return {p.name: str(p) for p in d.iterdir()} | {'missing': str(d / 'nope.pth'),
                                                    'dir': str(d / 'folder'),
                                                    'root': str(d), 'work': str(work),
                                                    'data': str(work / 'data')}


def careless_cases(f):
    """``name -> (tool, argv, exit status, what the message must say)``."""
    ck, img = f['fake.pth'], f['good.png']
    miss, dirp, afile = f['missing'], f['dir'], f['afile']
    c = {
        # --- tools/test.py
        'test/config-missing': ('test', ['configs/nope.py', ck], 2,
                                "error: config 'configs/nope.py' does not exist"),
        'test/config-dir': ('test', ['configs', ck], 2,
                            "config 'configs' is a directory: give a config file"),
        'test/config-wrong-kind': ('test', ['README.md', ck], 2,
                                   "config 'README.md' is not a config file"),
        'test/config-empty': ('test', [f['empty.py'], ck], 2, f"config '{f['empty.py']}' is empty"),
        'test/config-truncated': ('test', [f['broken.py'], ck], 1,
                                  f"error: config {f['broken.py']} cannot be read as an "
                                  'mmengine config'),
        'test/config-no-model': ('test', [f['nomodel.py'], ck], 1,
                                 f"error: config {f['nomodel.py']} defines no model"),
        'test/mmseg-name-missing': ('test', ['mmseg::segmenter/nope.py', ck], 1,
                                    "error: config 'mmseg::segmenter/nope.py' does not exist"),
        'test/ckpt-missing': ('test', [CFG, miss], 2, f"checkpoint '{miss}' does not exist"),
        'test/ckpt-dir': ('test', [CFG, dirp], 2, f"checkpoint '{dirp}' is a directory"),
        'test/ckpt-empty': ('test', [CFG, f['empty.pth']], 2,
                            f"checkpoint '{f['empty.pth']}' is empty"),
        'test/work-dir-file': ('test', [CFG, ck, '--work-dir', afile], 2,
                               f"--work-dir '{afile}' is a file, not a folder"),
        'test/out-under-file': ('test', [CFG, ck, '--out', afile + '/preds'], 2,
                                f'{afile} is a file, not a folder'),
        'test/show-interval-0': ('test', [CFG, ck, '--show-interval', 0], 2,
                                 "argument --show-interval: '0': must be >= 1"),
        'test/wait-time-negative': ('test', [CFG, ck, '--wait-time', -1], 2,
                                    "argument --wait-time: '-1': must be >= 0"),
        'test/mita-cfg-no-equals': ('test', [CFG, ck, '--mita-cfg', 'topk'], 2,
                                    "--mita-cfg: 'topk' is not KEY=VALUE"),
        'test/router-topk-above-M': ('test', [CFG, ck, '--mita-cfg', 'router_topk=100'], 2,
                                     'router_topk=100 is more than the M=49 landmarks'),
        'test/router-topk-above-pool': ('test', [CFG, ck, '--mita-cfg', 'pool_size=2',
                                                 'router_topk=5'], 2,
                                        'router_topk=5 is more than the M=4 landmarks'),
        # a key the setting's kind does not read (issue 55): one line naming key and kind
        'test/agent-with-topk': ('test', [CFG, ck, '--swap-attn', 'agent:7', '--mita-cfg',
                                          'topk=16'], 2,
                                 'error: --swap-attn agent:7 with --mita-cfg: topk is not a '
                                 'setting of agent attention'),
        'get_flops/agent-with-topk': ('get_flops', [CFG, '--swap-attn', 'agent:7',
                                                    '--mita-cfg', 'topk=16'], 2,
                                      'topk is not a setting of agent attention'),
        'get_flops/window-with-pool': ('get_flops', [CFG, '--swap-attn', 'window:7',
                                                     '--mita-cfg', 'pool_size=4'], 2,
                                       'pool_size is not a setting of window attention'),
        'get_flops/kind-key-in-mita-cfg': ('get_flops', [CFG, '--mita-cfg', 'kind=agent',
                                                         'topk=16'], 2,
                                           'topk is not a setting of agent attention'),
        'get_flops/plan-agent-with-topk': ('get_flops', [CFG, '--mita-plan',
                                                         f['agent_topk_plan.json']], 2,
                                           'layer backbone.layers.0.attn: topk is not a '
                                           'setting of agent attention'),
        'test/plan-agent-with-topk': ('test', [CFG, ck, '--mita-plan',
                                               f['agent_topk_plan.json']], 2,
                                      'topk is not a setting of agent attention'),
        'test/cfg-options-no-equals': ('test', [CFG, ck, '--cfg-options', 'model'], 2,
                                       "--cfg-options: 'model' is not KEY=VALUE"),
        'test/unknown-flag': ('test', [CFG, ck, '--no-such-flag'], 2,
                              'error: unrecognized arguments: --no-such-flag'),
        'test/checkpoint-not-given': ('test', [CFG], 2,
                                      'error: the following arguments are required: checkpoint'),
        'test/launcher-without-torchrun': ('test', [CFG, ck, '--launcher', 'pytorch'], 1,
                                           'error: --launcher pytorch: RANK, WORLD_SIZE, '
                                           'MASTER_ADDR, MASTER_PORT not set; start the tool '
                                           'through torchrun'),
        # --- tools/train.py
        'train/launcher-without-srun': ('train', [CFG, '--launcher', 'slurm'], 1,
                                        'error: --launcher slurm: SLURM_PROCID'),
        'train/config-dir': ('train', ['configs'], 2, "config 'configs' is a directory"),
        'train/config-wrong-kind': ('train', ['README.md'], 2, 'is not a config file'),
        'train/work-dir-file': ('train', [CFG, '--work-dir', afile], 2, 'is a file, not a folder'),
        # --- tools/image_demo.py
        'image_demo/image-text': ('image_demo', ['README.md', CFG, ck, '--out-file', 'x.png'], 2,
                                  "image 'README.md' is not an image OpenCV can read"),
        'image_demo/image-text-jpg': ('image_demo', [f['text.jpg'], CFG, ck, '--out-file',
                                                     'x.png'], 2, 'is not an image OpenCV'),
        'image_demo/image-truncated': ('image_demo', [f['truncated.png'], CFG, ck, '--out-file',
                                                      'x.png'], 2, 'is not an image OpenCV'),
        'image_demo/image-dir': ('image_demo', [dirp, CFG, ck, '--out-file', 'x.png'], 2,
                                 f"image '{dirp}' is a directory"),
        'image_demo/image-missing': ('image_demo', [miss, CFG, ck, '--out-file', 'x.png'], 2,
                                     f"image '{miss}' does not exist"),
        'image_demo/ckpt-dir': ('image_demo', [img, CFG, dirp, '--out-file', 'x.png'], 2,
                                f"checkpoint '{dirp}' is a directory"),
        'image_demo/out-file-slash': ('image_demo', [img, CFG, ck, '--out-file',
                                                     f['root'] + '/new/'], 2,
                                      '--out-file', ),
        'image_demo/out-file-dir': ('image_demo', [img, CFG, ck, '--out-file', dirp], 2,
                                    f"--out-file '{dirp}' is a directory: give a file name"),
        'image_demo/out-file-kind': ('image_demo', [img, CFG, ck, '--out-file', 'x.txt'], 2,
                                     "--out-file 'x.txt' must end with .png or .jpg"),
        'image_demo/out-under-file': ('image_demo', [img, CFG, ck, '--out-file',
                                                     afile + '/x.png'], 2,
                                      f'{afile} is a file, not a folder'),
        'image_demo/opacity-0': ('image_demo', [img, CFG, ck, '--out-file', 'x.png',
                                                '--opacity', 0], 2, "'0': must be > 0 and <= 1"),
        'image_demo/opacity-nan': ('image_demo', [img, CFG, ck, '--out-file', 'x.png',
                                                  '--opacity', 'nan'], 2, 'must be > 0'),
        'image_demo/opacity-word': ('image_demo', [img, CFG, ck, '--out-file', 'x.png',
                                                   '--opacity', 'half'], 2,
                                    "'half' is not a number"),
        'image_demo/device': ('image_demo', [img, CFG, ck, '--out-file', 'x.png', '--device',
                                             'gpu0'], 2, "argument --device: 'gpu0'"),
        # --- tools/analyze_token_selection.py
        'analyze/image-text': ('analyze_token_selection', [CFG, ck, img, 'README.md',
                                                           '--out-dir', 'o'], 2,
                               "image 'README.md' is not an image OpenCV can read"),
        'analyze/out-dir-file': ('analyze_token_selection', [CFG, ck, img, '--out-dir', afile], 2,
                                 f"--out-dir '{afile}' is a file"),
        'analyze/config-dir': ('analyze_token_selection', ['configs', ck, img, '--out-dir', 'o'],
                               2, 'is a directory'),
        # --- tools/export_swapped.py
        'export/out-dir-file': ('export_swapped', [CFG, ck, '--out-dir', afile], 2,
                                f"--out-dir '{afile}' is a file, not a folder"),
        'export/ckpt-missing': ('export_swapped', [CFG, miss, '--out-dir', 'o'], 2,
                                'does not exist'),
        'export/mita-cfg-layers': ('export_swapped', [CFG, ck, '--out-dir', 'o', '--mita-cfg',
                                                      'layers=3'], 2, 'layers must be None'),
        # --- tools/get_flops.py
        'get_flops/json-dir': ('get_flops', [CFG, '--json', f['root'] + '/'], 2,
                               '--json'),
        'get_flops/json-kind': ('get_flops', [CFG, '--json', 'f.txt'], 2,
                                "--json 'f.txt' must end with .json"),
        'get_flops/shape-0': ('get_flops', [CFG, '--shape', 0], 2, "argument --shape: '0'"),
        'get_flops/shape-3': ('get_flops', [CFG, '--shape', 1, 2, 3], 2,
                              '--shape takes one or two positive ints (H [W]), got 3'),
        'get_flops/sweep-negative': ('get_flops', [CFG, '--sweep', -512], 2, "'-512': must be"),
        'get_flops/plot-needs-sweep': ('get_flops', [CFG, '--plot', 'p.png'], 2,
                                       '--plot needs --sweep'),
        'get_flops/config-missing': ('get_flops', ['nope.py'], 2, "config 'nope.py' does not"),
        # --- tools/swap_sweep.py
        'swap_sweep/pool-0': ('swap_sweep', [CFG, ck, '--pool-sizes', 0], 2,
                              "argument --pool-sizes: '0': must be >= 1"),
        'swap_sweep/topk-negative': ('swap_sweep', [CFG, ck, '--topks', -1], 2,
                                     "argument --topks: '-1': must be >= 1"),
        'swap_sweep/flops-images-0': ('swap_sweep', [CFG, ck, '--flops-images', 0], 2,
                                      "'0': must be >= 1"),
        'swap_sweep/owns-pool': ('swap_sweep', [CFG, ck, '--mita-cfg', 'pool_size=4'], 2,
                                 "unknown MiTA setting 'pool_size'"),
        'swap_sweep/router-topk': ('swap_sweep', [CFG, ck, '--pool-sizes', 5, 7, '--mita-cfg',
                                                  'router_topk=30'], 2,
                                   'router_topk=30 is more than the M=25 landmarks'),
        # --swap-attn read as every tool reads it: --mita-cfg's keys over the setting
        'swap_sweep/swap-attn-router-topk': ('swap_sweep', [CFG, ck, '--swap-attn', '4:16',
                                                            '--mita-cfg', 'router_topk=20'], 2,
                                             'router_topk=20 is more than the M=16 landmarks'),
        'swap_sweep/swap-attn-none': ('swap_sweep', [CFG, ck, '--swap-attn', 'none'], 2,
                                      'this tool always swaps'),
        'swap_sweep/out-dir': ('swap_sweep', [CFG, ck, '--out', dirp], 2, 'is a directory'),
        'swap_sweep/plot-kind': ('swap_sweep', [CFG, ck, '--plot', 'p.md'], 2,
                                 "--plot 'p.md' must end with .png"),
        'swap_sweep/ckpt-empty': ('swap_sweep', [CFG, f['empty.pth']], 2, 'is empty'),
        # --- tools/benchmark.py
        # a setting is --settings, spelt as every tool spells one; the old flags are gone
        'benchmark/topk-0': ('benchmark', ['--settings', '7:0'], 2,
                             "argument --settings: MiTA setting '7:0': write P:K"),
        'benchmark/pool-size-gone': ('benchmark', ['--pool-size', 7], 2,
                                     'error: unrecognized arguments: --pool-size 7'),
        'benchmark/topk-gone': ('benchmark', ['--topk', 49], 2,
                                'error: unrecognized arguments: --topk 49'),
        'benchmark/onnx-settings-gone': ('benchmark', ['--level', 'onnx', '--onnx-settings',
                                                       '7:49'], 2,
                                         'error: unrecognized arguments: --onnx-settings 7:49'),
        'benchmark/pool-above-grid': ('benchmark', ['--tokens', 17, '--settings', '20:49'], 2,
                                      'error: --settings 20:49: pool size 20 is larger than the '
                                      'grid of --tokens [17] (4x4): give a pool <= 4'),
        'benchmark/pool-above-default-grid': ('benchmark', ['--settings', '40:49'], 2,
                                              'is larger than the grid'),
        'benchmark/two-settings-at-op': ('benchmark', ['--settings', '7:49', '4:16'], 2,
                                         '--level op times one setting'),
        'benchmark/kind-at-op': ('benchmark', ['--settings', 'agent:7'], 2,
                                 '--settings agent:7: --level op times MiTA'),
        'benchmark/kinds-pool-above-grid': ('benchmark', ['--level', 'kinds', '--tokens', 17,
                                                          '--settings', 'agent:5'], 2,
                                            'pool size 5 is larger than the grid'),
        'benchmark/tokens-not-square': ('benchmark', ['--tokens', 18], 2,
                                        "'18': give 1 + s*s tokens"),
        'benchmark/heads-0': ('benchmark', ['--heads', 0], 2, "'0': must be >= 1"),
        'benchmark/min-run-time-0': ('benchmark', ['--min-run-time', 0], 2, "'0': must be > 0"),
        'benchmark/profile-bias': ('benchmark', ['--profile', '--bias'], 2,
                                   '--profile measures the fused CPU kernel without a bias'),
        'benchmark/profile-onnx': ('benchmark', ['--level', 'onnx', '--profile'], 2,
                                   'use it with --device cpu, --level op/model/all/onnx-op'),
        'benchmark/compile-op-level': ('benchmark', ['--compile'], 2,
                                       '--compile adds compiled columns to the model level'),
        'benchmark/onnx-setting-dense': ('benchmark', ['--level', 'onnx', '--settings', 'dense'],
                                         2, "argument --settings: MiTA setting 'dense'"),
        'benchmark/onnx-pool-above-grid': ('benchmark', ['--level', 'onnx', '--onnx-sizes', 100],
                                           2, 'pool size 7 is larger than the 6x6 patch grid'),
        # --- tools/calibrate_swap.py
        'calibrate/config-dir': ('calibrate_swap', ['configs', ck, '--reduction', 0.4, '--out',
                                                    'p.json'], 2,
                                 "config 'configs' is a directory"),
        'calibrate/ckpt-missing': ('calibrate_swap', [CFG, miss, '--reduction', 0.4, '--out',
                                                      'p.json'], 2,
                                   f"checkpoint '{miss}' does not exist"),
        'calibrate/no-budget': ('calibrate_swap', [CFG, ck, '--out', 'p.json'], 2,
                                'one of the arguments --reduction --budget-gflops'),
        'calibrate/reduction-1': ('calibrate_swap', [CFG, ck, '--reduction', 1.5, '--out',
                                                     'p.json'], 2, "argument --reduction: '1.5'"),
        'calibrate/budget-0': ('calibrate_swap', [CFG, ck, '--budget-gflops', 0, '--out',
                                                  'p.json'], 2, "argument --budget-gflops: '0'"),
        'calibrate/images-0': ('calibrate_swap', [CFG, ck, '--reduction', 0.4, '--images', 0,
                                                  '--out', 'p.json'], 2, "'0': must be >= 1"),
        'calibrate/out-dir': ('calibrate_swap', [CFG, ck, '--reduction', 0.4, '--out', dirp],
                              2, 'is a directory'),
        'calibrate/out-kind': ('calibrate_swap', [CFG, ck, '--reduction', 0.4, '--out',
                                                  'p.txt'], 2, "--out 'p.txt' must end with .json"),
        'calibrate/candidate': ('calibrate_swap', [CFG, ck, '--reduction', 0.4, '--out',
                                                   'p.json', '--candidates', '7'], 2,
                                'argument --candidates'),
        # candidates of every kind, mixed, pass the parser (the fake checkpoint does not)
        'calibrate/candidates-any-kind': ('calibrate_swap', [CFG, ck, '--reduction', 0.4,
                                                             '--out', 'p.json', '--candidates',
                                                             'dense', 'agent:7', 'block:8:4',
                                                             'topk:49', 'window:7', '7:49'], 1,
                                          f'error: {ck} is not a readable checkpoint'),
        # --- tools/export_onnx.py
        'export_onnx/config-missing': ('export_onnx', ['nope.py', ck, '--out', 'm.onnx'], 2,
                                       "config 'nope.py' does not exist"),
        'export_onnx/ckpt-empty': ('export_onnx', [CFG, f['empty.pth'], '--out', 'm.onnx'], 2,
                                   'is empty'),
        'export_onnx/out-dir': ('export_onnx', [CFG, ck, '--out', dirp], 2, 'is a directory'),
        'export_onnx/out-under-file': ('export_onnx', [CFG, ck, '--out', afile + '/m.onnx'], 2,
                                       f'{afile} is a file, not a folder'),
        'export_onnx/out-kind': ('export_onnx', [CFG, ck, '--out', 'm.pth'], 2,
                                 "--out 'm.pth' must end with .onnx"),
        'export_onnx/shape-0': ('export_onnx', [CFG, ck, '--out', 'm.onnx', '--shape', 0, 64], 2,
                                "argument --shape: '0': must be >= 1"),
        'export_onnx/opset-old': ('export_onnx', [CFG, ck, '--out', 'm.onnx', '--opset', 13], 2,
                                  'needs opset 18 or later'),
        'export_onnx/mita-cfg-no-equals': ('export_onnx', [CFG, ck, '--out', 'm.onnx',
                                                           '--mita-cfg', 'topk'], 2, 'topk'),
        # --- tools/swap_study.py, tools/train_demo.py
        'swap_study/iters-0': ('swap_study', ['--train-iters', 0], 2, "'0': must be >= 1"),
        'swap_study/finetune-0': ('swap_study', ['--finetune', '0:49'], 2,
                                  "MiTA setting '0:49': write P:K"),
        # the old spelling of a setting is refused, showing the new one
        'swap_study/finetune-old-spelling': ('swap_study', ['--finetune', '7,49'], 2,
                                             "'7,49' is the old spelling: write 7:49"),
        'swap_study/work-dir-file': ('swap_study', ['--work-dir', afile], 2, 'is a file'),
        'train_demo/iters-1': ('train_demo', ['--iters', 1], 2, "'1': must be >= 2"),
        'train_demo/data-root-file': ('train_demo', ['--data-root', afile], 2, 'is a file'),
        # --- tools/make_standin_checkpoint.py
        'standin/config-missing': ('make_standin_checkpoint', ['nope.py', '--out', 's.pth'], 2,
                                   "config 'nope.py' does not exist"),
        'standin/out-kind': ('make_standin_checkpoint', [CFG, '--out', 's.txt'], 2,
                             "--out 's.txt' must end with .pth"),
        'standin/out-not-a-standin': ('make_standin_checkpoint', [CFG, '--out', ck], 1,
                                      f'error: {ck} exists (64 bytes) and is not a stand-in '
                                      'made by this command'),
    }
    c.update(cfg_options_cases(f))
    c.update(unwritable_output_cases(f))
    return c


def cfg_options_cases(f):
    """A ``--cfg-options`` value the model, or the test loop, cannot be built with: one
    ``error:`` line naming the option (and the value the config had), exit status 1, in
    every tool that takes ``--cfg-options`` (the model is built before the checkpoint is
    read: the fake one does)."""
    ck, img, work = f['fake.pth'], f['good.png'], f['work']
    word = "error: --cfg-options model.backbone.embed_dims='abc': the model cannot be built " \
        'with it (TypeError: '
    had = 'the config has model.backbone.embed_dims=64'
    data = [f'test_dataloader.{k}' for k in (f"dataset.data_root={f['data']}", 'num_workers=0',
                                             'persistent_workers=False')]
    return {
        'test/cfg-options-word': ('test', [CFG, ck, '--work-dir', work + '/t1', '--cfg-options',
                                           'model.backbone.embed_dims=abc'], 1, had),
        'test/cfg-options-misspelt': (
            'test', [CFG, ck, '--work-dir', work + '/t2', '--cfg-options',
                     'model.backbone.embed_dim=64'], 1,
            "error: --cfg-options model.backbone.embed_dim=64: the model cannot be built with "
            "it (TypeError: VisionTransformer.__init__() got an unexpected keyword argument "
            "'embed_dim'); the config has no model.backbone.embed_dim: did you mean "
            'model.backbone.embed_dims?'),
        'test/cfg-options-batch-size': (
            'test', [CFG, ck, '--work-dir', work + '/t3', '--cfg-options', *data,
                     'test_dataloader.batch_size=-1'], 1,
            'error: --cfg-options test_dataloader.batch_size=-1: the test loop cannot be built '
            'with it (ValueError: batch_size should be a positive integer value, but got '
            'batch_size=-1); the config has test_dataloader.batch_size=1'),
        'image_demo/cfg-options-word': (
            'image_demo', [img, CFG, ck, '--out-file', 'x.png', '--cfg-options',
                           'model.backbone.num_layers=four'], 1,
            "error: --cfg-options model.backbone.num_layers='four': the model cannot be built "
            'with it (TypeError: '),
        'image_demo/cfg-options-misspelt': (
            'image_demo', [img, CFG, ck, '--out-file', 'x.png', '--cfg-options',
                           'model.backbone.embed_dim=64'], 1, 'did you mean '
            'model.backbone.embed_dims?'),
        'get_flops/cfg-options-word': ('get_flops', [CFG, '--cfg-options',
                                                     'model.backbone.embed_dims=abc'], 1, word),
        'get_flops/cfg-options-type': (
            'get_flops', [CFG, '--cfg-options', 'model.backbone.type=VisionTransformr'], 1,
            "error: --cfg-options model.backbone.type='VisionTransformr': the model cannot be "
            'built with it (KeyError: VisionTransformr is not in the mmseg::model registry'),
        'train/cfg-options-word': ('train', [CFG, '--work-dir', work + '/tr', '--cfg-options',
                                             'model.backbone.embed_dims=abc'], 1, word),
        'swap_sweep/cfg-options-word': ('swap_sweep', [CFG, ck, '--work-dir', work + '/sw',
                                                       '--cfg-options',
                                                       'model.backbone.embed_dims=abc'], 1, word),
        'export/cfg-options-word': ('export_swapped', [CFG, ck, '--out-dir', 'o', '--cfg-options',
                                                       'model.backbone.embed_dims=abc'], 1, word),
        'analyze/cfg-options-word': ('analyze_token_selection', [CFG, ck, img, '--out-dir', 'o',
                                                                 '--cfg-options',
                                                                 'model.backbone.embed_dims=abc'],
                                     1, word),
        'calibrate/cfg-options-word': ('calibrate_swap', [CFG, ck, '--reduction', 0.4, '--out',
                                                          'p.json', '--cfg-options',
                                                          'model.backbone.embed_dims=abc'],
                                       1, word),
        'standin/cfg-options-word': ('make_standin_checkpoint',
                                     [CFG, '--out', work + '/s.pth', '--cfg-options',
                                      'model.backbone.embed_dims=abc'],
                                     1, word),
        'export_onnx/cfg-options-word': ('export_onnx', [CFG, ck, '--out', 'm.onnx',
                                                         '--cfg-options',
                                                         'model.backbone.embed_dims=abc'], 1,
                                         word),
    }


def unwritable_output_cases(f):
    """Every output path of every tool where no file can be made (``/proc``, even for root):
    refused while parsing, naming the user's path, before anything is built."""
    ck, img = f['fake.pth'], f['good.png']
    no = 'cannot create a file in /proc'
    return {
        'image_demo/out-file-proc': ('image_demo', [img, CFG, ck, '--out-file', '/proc/seg.png'],
                                     2, f"--out-file '/proc/seg.png': {no}"),
        'export_onnx/out-proc': ('export_onnx', [CFG, ck, '--out', '/proc/m.onnx'], 2,
                                 f"--out '/proc/m.onnx': {no}"),
        'test/work-dir-proc': ('test', [CFG, ck, '--work-dir', '/proc/w'], 2,
                               f"--work-dir '/proc/w': {no}"),
        'test/out-proc': ('test', [CFG, ck, '--out', '/proc/new/p'], 2,
                          f"--out '/proc/new/p': {no}"),
        'test/show-dir-proc': ('test', [CFG, ck, '--show-dir', '/proc/s'], 2,
                               f"--show-dir '/proc/s': {no}"),
        'train/work-dir-proc': ('train', [CFG, '--work-dir', '/proc/w'], 2,
                                f"--work-dir '/proc/w': {no}"),
        'get_flops/json-proc': ('get_flops', [CFG, '--json', '/proc/f.json'], 2,
                                f"--json '/proc/f.json': {no}"),
        'get_flops/plot-proc': ('get_flops', [CFG, '--sweep', 64, '--plot', '/proc/f.png'], 2,
                                f"--plot '/proc/f.png': {no}"),
        'swap_sweep/work-dir-proc': ('swap_sweep', [CFG, ck, '--work-dir', '/proc/w'], 2,
                                     f"--work-dir '/proc/w': {no}"),
        'swap_sweep/out-proc': ('swap_sweep', [CFG, ck, '--out', '/proc/t.md'], 2,
                                f"--out '/proc/t.md': {no}"),
        'swap_sweep/plot-proc': ('swap_sweep', [CFG, ck, '--plot', '/proc/t.png'], 2,
                                 f"--plot '/proc/t.png': {no}"),
        'export/out-dir-proc': ('export_swapped', [CFG, ck, '--out-dir', '/proc/x'], 2,
                                f"--out-dir '/proc/x': {no}"),
        'analyze/out-dir-proc': ('analyze_token_selection', [CFG, ck, img, '--out-dir', '/proc/x'],
                                 2, f"--out-dir '/proc/x': {no}"),
        'calibrate/out-proc': ('calibrate_swap', [CFG, ck, '--reduction', 0.4, '--out',
                                                  '/proc/p.json'], 2,
                               f"--out '/proc/p.json': {no}"),
        'swap_study/work-dir-proc': ('swap_study', ['--work-dir', '/proc/w'], 2,
                                     f"--work-dir '/proc/w': {no}"),
        'swap_study/fig-dir-proc': ('swap_study', ['--fig-dir', '/proc/f'], 2,
                                    f"--fig-dir '/proc/f': {no}"),
        'swap_study/data-root-proc': ('swap_study', ['--data-root', '/proc/d'], 2,
                                      f"--data-root '/proc/d': {no}"),
        'train_demo/work-dir-proc': ('train_demo', ['--work-dir', '/proc/w'], 2,
                                     f"--work-dir '/proc/w': {no}"),
        'standin/out-proc': ('make_standin_checkpoint', [CFG, '--out', '/proc/s.pth'], 2,
                             f"--out '/proc/s.pth': {no}"),
        'make_tiny_ade20k/out-proc': ('dataset/make_tiny_ade20k', ['--out', '/proc/d'], 2,
                                      f"--out '/proc/d': {no}"),
        'make_longrange_ade20k/preview-proc': ('dataset/make_longrange_ade20k',
                                               ['--preview', '/proc/p.png'], 2,
                                               f"--preview '/proc/p.png': {no}"),
    }


def one_error_line(out):
    """Whether ``out`` ends with the one shape of a tool error: a single ``error: ...``
    line, the last, and no usage block."""
    lines = out.strip().splitlines()
    return (bool(lines) and lines[-1].startswith('error: ') and 'usage:' not in out
            and sum(line.startswith('error:') for line in lines) == 1)


def test_careless_input_every_tool(tools, careless):
    cases = careless_cases(careless)
    before = set(os.listdir(careless['root']))
    results = run_cases(tools, cases)
    failed = []
    for name, (code, out) in results.items():
        tool, _, want_code, want = cases[name]
        ok = (code == want_code and want in out and 'Traceback' not in out
              and one_error_line(out))
        if not ok:
            failed.append(f'{name}: exit {code}, wanted {want_code} and {want!r}:\n'
                          f'{out[-1500:]}')
    assert not failed, '\n\n'.join(failed)
    assert set(os.listdir(careless['root'])) == before          # nothing written
    assert not os.path.exists(osp.join(tools.root, 'x.png'))
    assert not os.path.exists(osp.join(tools.root, 'o'))


def test_careless_input_as_users_run_it(tools, careless):
    # the same checks, each tool in its own process as a user runs it: the one line the
    # README promises, and nothing else (no usage block)
    code, out = tools('tools/image_demo.py', 'README.md', CFG, careless['fake.pth'],
                      '--out-file', 'x.png', check=False)
    assert code == 2, out
    assert out.strip() == ("error: argument img: image 'README.md' is not an image OpenCV can "
                           'read (%d bytes): give a .jpg/.jpeg/.png/.bmp/.tif... file'
                           % os.path.getsize(osp.join(tools.root, 'README.md'))), out
    # an output that cannot be written: the argument named once
    code, out = tools('tools/image_demo.py', careless['good.png'], CFG, careless['fake.pth'],
                      '--out-file', '/proc/seg.png', check=False)
    assert code == 2, out
    assert out.strip().startswith("error: --out-file '/proc/seg.png': cannot create a file in "
                                  '/proc'), out
    assert len(out.strip().splitlines()) == 1, out
    # the benchmark (its own re-executed process) and a removed flag
    code, out = tools('tools/benchmark.py', '--settings', '7:0', check=False)
    assert code == 2 and out.strip().startswith(
        "error: argument --settings: MiTA setting '7:0': write P:K"), out
    code, out = tools('tools/benchmark.py', '--pool-size', 7, check=False)
    assert code == 2 and out.strip() == 'error: unrecognized arguments: --pool-size 7', out


def test_tool_parser_prints_one_line(capsys):
    # the parser every tool builds: a usage error is one line on stderr, exit status 2; an
    # argument named twice by argparse ("argument --out: --out 'x' ...") is named once
    import argparse

    from mita_seg.cli.core import ToolParser

    def refuse(text):
        raise argparse.ArgumentTypeError(f'--out {text!r}: cannot create a file in /proc')

    parser = ToolParser(prog='tool.py')
    parser.add_argument('config')
    parser.add_argument('--out', type=refuse)
    parser.add_argument('--n', type=int, default=1)
    for argv, want in [
            (['c', '--out', '/proc/x'], "error: --out '/proc/x': cannot create a file in /proc"),
            (['c', '--n', 'x'], "error: argument --n: invalid int value: 'x'"),
            ([], 'error: the following arguments are required: config'),
            (['c', '--m'], 'error: unrecognized arguments: --m')]:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2, argv
        captured = capsys.readouterr()
        assert captured.out == '' and captured.err == want + '\n', (argv, captured.err)
    # parser.error of a tool's own check: the same shape
    with pytest.raises(SystemExit) as e:
        parser.error('--plot needs --sweep SIZES')
    assert e.value.code == 2 and capsys.readouterr().err == 'error: --plot needs --sweep SIZES\n'


def test_swap_sweep_help_shows_defaults(tools):
    _, out = tools('tools/swap_sweep.py', '--help')
    flat = ' '.join(out.split())
    assert '(default: [5, 7])' in flat and '(default: [25, 49])' in flat, out


@pytest.mark.slow
def test_careless_input_found_with_the_model(segmenter_ckpt, tiny_data, tools, tmp_path):
    """What shows only once the model is built or the data read: one error line, exit 1,
    nothing written; and what was wrong before: --title visible, --json into a new folder,
    the sweep's rows say what ran."""
    import cv2
    config, ckpt = segmenter_ckpt
    image = osp.join(tiny_data, 'images', 'validation', 'ADE_val_00000001.jpg')
    opts = tools.data_options(tiny_data)
    results = run_all(tools, {
        'test-layers': ['tools/test.py', config, ckpt, '--work-dir', tmp_path / 't',
                        '--mita-cfg', 'layers=[9]', '--cfg-options', *opts],
        'export-layers': ['tools/export_swapped.py', config, ckpt, '--out-dir',
                          tmp_path / 'ex', '--mita-cfg', 'layers=[9]'],
        'demo-title': ['tools/image_demo.py', image, config, ckpt, '--out-file',
                       tmp_path / 'new' / 'folder' / 'titled.png', '--title',
                       'a long title that has to wrap over more than one line of a 128 pixel '
                       'image, and is drawn whole'],
        'demo-plain': ['tools/image_demo.py', image, config, ckpt, '--out-file',
                       tmp_path / 'plain.png'],
        'flops-json': ['tools/get_flops.py', config, '--device', 'meta', '--swap-attn', 'mita',
                       '--json', tmp_path / 'a' / 'b' / 'f.json'],
        # a 16x16 patch grid: pool 16 and 20 both run on 16x16 landmarks
        'sweep-clamped': ['tools/swap_sweep.py', config, ckpt, '--pool-sizes', 16, 20,
                          '--topks', 8, '--work-dir', tmp_path / 'sw', '--cfg-options', *opts],
    })
    for name in ('test-layers', 'export-layers'):
        code, out = results[name]
        assert code == 1 and 'Traceback' not in out, f'{name}\n{out[-3000:]}'
        assert ('error: ' in out and 'layers [9] out of range: there are 4 encoder layers '
                '(indices 0..3, or -4..-1 from the end)' in out), f'{name}\n{out[-3000:]}'
        assert 'mIoU' not in out
    assert not (tmp_path / 'ex').exists()
    for name in ('demo-title', 'demo-plain', 'flops-json', 'sweep-clamped'):
        assert results[name][0] == 0, f'{name}\n{results[name][1][-3000:]}'
    titled = cv2.imread(str(tmp_path / 'new' / 'folder' / 'titled.png'))
    plain = cv2.imread(str(tmp_path / 'plain.png'))
    assert plain.shape[:2] == (128, 128)
    # the title is a band above the very drawing, with dark text on it
    assert titled.shape[1] == 128 and titled.shape[0] > 128 + 20
    assert (titled[-128:] == plain).all()
    assert (titled[:-128] < 128).any()
    assert (tmp_path / 'a' / 'b' / 'f.json').stat().st_size > 0
    code, out = results['sweep-clamped']
    with open(tmp_path / 'sw' / 'swap_sweep.csv') as f:
        rows = list(csv.DictReader(f))
    assert [(r['setting'], r['M']) for r in rows] == [('baseline', ''),
                                                      ('MiTA M=16x16 k=8', '256')]
    assert "MiTA M=20x20 k=8 runs exactly as 'MiTA M=16x16 k=8' on these inputs: not " \
           'evaluated again, no row' in out


# --------------------------------------------------------------------------------------
# Arguments before the stack: each tool parses its arguments, and refuses a bad one, before
# it imports mmseg/mmengine/mmcv (or torch): a missing config costs the parsing, not the
# seconds those imports take.

STACK = ('torch', 'mmcv', 'mmengine', 'mmseg')

# Imports a tool as a module and calls its parse_args; prints which of STACK got imported.
PARSE_ONLY = r'''
import importlib.util, json, sys
script, argv = sys.argv[1], sys.argv[2:]
spec = importlib.util.spec_from_file_location('tool', script)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
try:
    tool.parse_args(argv)
    code = 0
except SystemExit as e:
    code = e.code
stack = %r
print('IMPORTED ' + json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(stack))))
sys.exit(code)
''' % (STACK, )

MISSING_CONFIG = {
    'test': ['nope.py', 'x.pth'],
    'train': ['nope.py', '--cfg-options', 'train_cfg.max_iters=10'],
    'get_flops': ['nope.py', '--swap-attn', 'mita', '--mita-cfg', 'topk=16'],
    'export_swapped': ['nope.py', 'x.pth', '--out-dir', 'o'],
    'export_onnx': ['nope.py', 'x.pth', '--out', 'm.onnx'],
    'analyze_token_selection': ['nope.py', 'x.pth', 'README.md', '--out-dir', 'o'],
    'image_demo': ['nope.png', 'nope.py', 'x.pth', '--out-file', 'o.png'],
    'swap_sweep': ['nope.py', 'x.pth', '--merge-ratios', '0.3'],
    'calibrate_swap': ['nope.py', 'x.pth', '--reduction', '0.3', '--out', 'p.json'],
}


@pytest.mark.parametrize('tool', sorted(MISSING_CONFIG))
def test_missing_config_refused_before_the_stack(tools, tool):
    argv = MISSING_CONFIG[tool]
    what = 'image' if tool == 'image_demo' else 'config'
    # as a user runs it: one error line naming the file (no usage block), exit status 2
    code, out = tools(f'tools/{tool}.py', *argv, check=False)
    lines = out.strip().splitlines()
    assert code == 2 and 'Traceback' not in out, out[-2000:]
    named = 'argument img: ' if what == 'image' else ''    # config: named once
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {named}{what} '{argv[0]}' does not exist"), out[-2000:]
    # and the stack was not imported to say so
    proc = subprocess.run([sys.executable, '-c', PARSE_ONLY, f'tools/{tool}.py', *argv],
                          cwd=tools.root, env=tools.env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'IMPORTED []' in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_help_and_a_good_parse_need_no_stack(tools, careless):
    # --help quotes the MiTA and ToMe defaults (they are read when help is printed)
    code, out = tools('tools/test.py', '--help')
    flat = ' '.join(out.split())
    assert 'Defaults for a model swapped now: pool_size=7 topk=49' in flat, out
    assert 'in [0, 0.5]' in flat and 'include_head' in flat
    # a command that parses imports nothing of the stack until main() runs
    argv = [CFG, careless['fake.pth'], '--work-dir', 'w', '--show-interval', '3']
    proc = subprocess.run([sys.executable, '-c', PARSE_ONLY, 'tools/test.py', *argv],
                          cwd=tools.root, env=tools.env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and 'IMPORTED []' in proc.stdout, proc.stdout + proc.stderr
    # the swap study too (its candidates default to the study's, named in --help)
    proc = subprocess.run([sys.executable, '-c', PARSE_ONLY, 'tools/swap_study.py', '--seeds',
                           '1', '--candidates', 'dense', '7:49'], cwd=tools.root,
                          env=tools.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and 'IMPORTED []' in proc.stdout, proc.stdout + proc.stderr


def test_get_flops_takes_no_checkpoint(tools):
    code, out = tools('tools/get_flops.py', CFG, 'work_dirs/x/iter_600.pth', check=False)
    assert code == 2 and 'Traceback' not in out
    assert out.strip() == (
        "error: 'work_dirs/x/iter_600.pth': get_flops.py takes no checkpoint "
        '(FLOPs depend on the config alone, as counted on random weights): give only the '
        'config')


def test_get_flops_prints_no_stack_warnings(tools):
    # the stack's deprecation, registry and vis-backend noise silenced; what the tool
    # prints is its table and its progress lines (Python's default warning filters: no
    # PYTHONWARNINGS=ignore as the other tests run with)
    env = {k: v for k, v in tools.env.items() if k != 'PYTHONWARNINGS'}
    proc = subprocess.run([sys.executable, 'tools/get_flops.py', CFG, '--shape', '64'],
                          cwd=tools.root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    noisy = [line for line in proc.stderr.splitlines() if 'warn' in line.lower()]
    assert not noisy, proc.stderr
    assert 'GFLOPs' in proc.stdout


def test_key_report_groups_exactly():
    from mita_seg.utils.checkpoint import expand_group, group_keys
    keys = ([f'backbone.layers.{i}.attn.attn.{n}' for i in range(12)
             for n in ('in_proj_weight', 'in_proj_bias')]
            + ['decode_head.conv_seg.weight', 'decode_head.conv_seg.bias', 'x.0', 'x.2', 'x',
               'backbone.layers.0.attn.dwc.bias', 'backbone.layers.1.attn.dwc.bias',
               'backbone.layers.0.attn.dwc.weight']
            + [f'a.{i}.b.{j}.c' for i in range(3) for j in range(2) if (i, j) != (2, 1)])
    groups = group_keys(keys)
    assert 'backbone.layers.{0..11}.attn.attn.{in_proj_bias,in_proj_weight}' in groups
    assert 'decode_head.conv_seg.{bias,weight}' in groups
    # not every combination: no group claims a key that is not there
    assert 'backbone.layers.{0..1}.attn.dwc.bias' in groups
    assert 'backbone.layers.0.attn.dwc.weight' in groups
    assert 'x.{0,2}' in groups and 'x' in groups
    assert 'a.{0..1}.b.{0..1}.c' in groups and 'a.2.b.0.c' in groups
    expanded = [k for g in groups for k in expand_group(g)]
    assert sorted(expanded) == sorted(keys)        # every key once, nothing more

    # a report of a checkpoint for another model: counts, groups, short lines
    from mita_seg.utils import check_state_dict
    model = {k: torch.zeros(2) for k in keys}
    ckpt = {k.replace('attn.attn', 'attention'): v for k, v in model.items()}
    ckpt['decode_head.conv_seg.weight'] = torch.zeros(3)
    with pytest.raises(CheckpointMismatchError) as e:
        check_state_dict(model, ckpt, 'ckpt.pth')
    msg = str(e.value)
    assert 'missing keys (24): backbone.layers.{0..11}.attn.attn.{in_proj_bias,' in msg
    assert 'unexpected keys (24): backbone.layers.{0..11}.attention.{in_proj_bias,' in msg
    assert ('shape mismatch (1): decode_head.conv_seg.weight: checkpoint (3,) vs model (2,)'
            in msg)
    assert max(map(len, msg.splitlines())) <= 100, msg


TRAIN_CFG = 'configs/mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py'


@pytest.mark.parametrize('option, want', [
    ('train_cfg.max_iters=abc', "error: train_cfg.max_iters='abc' is not a positive int: "
     'give e.g. --cfg-options train_cfg.max_iters=600'),
    ('train_cfg.max_iters=0', 'error: train_cfg.max_iters=0 is not a positive int'),
    ('param_scheduler.1.end=40', 'error: param_scheduler.1 (PolyLR) ends at 40, not after it '
     'begins at 50 (it begins where param_scheduler.0.end=50 ends): give '
     'param_scheduler.1.end > 50, or shorten what comes before it (param_scheduler.0.end)'),
    ('param_scheduler.0.end=x', "error: param_scheduler.0.end='x' (LinearLR) is not an int"),
], ids=['max-iters-text', 'max-iters-0', 'schedule-shorter-than-warm-up', 'end-text'])
def test_train_refuses_a_careless_schedule(tools, tmp_path, option, want):
    work = tmp_path / 'work'
    code, out = tools('tools/train.py', TRAIN_CFG, '--work-dir', work, '--cfg-options',
                      option, check=False)
    lines = out.strip().splitlines()
    assert code == 1 and 'Traceback' not in out, out[-3000:]
    assert lines[-1].startswith(want), out[-3000:]
    assert sum(line.startswith('error:') for line in lines) == 1, out[-3000:]
    assert not work.exists()          # nothing started: no work dir left behind


def test_dense_attn_choices_are_the_models():
    # spelt out in the parser (built without the stack): the modes the models have
    import argparse
    from mita_seg.cli import add_dense_attn_arg
    from mita_seg.models import DENSE_ATTN_MODES
    parser = argparse.ArgumentParser()
    add_dense_attn_arg(parser)
    assert tuple(parser._option_string_actions['--dense-attn'].choices) == DENSE_ATTN_MODES


def test_onnx_check_choices_are_the_exporters(tmp_path):
    # spelt out in tools/export_onnx.py's parser (built without the stack): the exporter's
    import importlib.util
    from mita_seg.apis.onnx_export import CHECKS
    spec = importlib.util.spec_from_file_location(
        'export_onnx_tool', osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'tools',
                                     'export_onnx.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg, ckpt = tmp_path / 'cfg.py', tmp_path / 'x.pth'
    cfg.write_text('x = 1\n')
    ckpt.write_bytes(b'x')
    argv = [str(cfg), str(ckpt), '--out', str(tmp_path / 'x.onnx'), '--check']
    assert [tool.parse_args(argv + [c]).check for c in CHECKS] == list(CHECKS)
    with pytest.raises(SystemExit):   # a check the exporter does not have
        tool.parse_args(argv + ['loose'])
