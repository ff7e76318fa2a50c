"""``tools/swap_study.py`` end to end at toy scale, through the same code path as
``make swap-study`` (:func:`mita_seg.apis.run_swap_study`): the tiny 128x128 Segmenter of
``configs/baselines`` (a 16x16 grid) on ``conftest.tiny_data`` (8 + 4 images), trained 2
iterations, two sweep points, the route-only check, one exported and fine-tuned setting, the
control, one selection map; then the table, JSON and figures are checked against each other.
"""
import json
import os.path as osp
import re

import pytest

from mita_seg.apis.swap_study import StudySettings, run_swap_study

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY_SEGMENTER = osp.join(ROOT, 'configs', 'baselines',
                          'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')


def test_settings_errors(tmp_path, tiny_data):
    # the data must exist: the message says how to write it
    with pytest.raises(FileNotFoundError, match='make_tiny_ade20k.py --out'):
        StudySettings(data_root=str(tmp_path / 'none')).check()
    # a schedule needs a warm-up iteration and a decay iteration
    with pytest.raises(ValueError, match='train_iters must be >= 2'):
        StudySettings(data_root=tiny_data, train_iters=1).check()
    with pytest.raises(ValueError, match=r"model_train_iters\['b'\] must be >= 2"):
        StudySettings(data_root=tiny_data, model_train_iters=dict(b=0)).check()
    # a model's own iterations replace train_iters for it only
    s = StudySettings(data_root=tiny_data, model_train_iters=dict(b=7))
    assert s.for_model('b').train_iters == 7 and s.for_model('a').train_iters == 120
    assert s.for_model('a').key() == StudySettings(data_root=tiny_data).key()
    # pool sizes and k are >= 1, in the sweep and in the fine-tune settings
    with pytest.raises(ValueError, match='must be >= 1'):
        StudySettings(data_root=tiny_data, finetune=((0, 49), )).check()
    with pytest.raises(ValueError, match='finetune_lr_mult'):
        StudySettings(data_root=tiny_data, finetune_lr_mult=0).check()
    # a model name names files; each name once
    with pytest.raises(ValueError, match='each name once'):
        run_swap_study([('a', TINY_SEGMENTER), ('a', TINY_SEGMENTER)], str(tmp_path),
                       StudySettings(data_root=tiny_data))
    with pytest.raises(FileNotFoundError, match="config of model 'b' not found"):
        run_swap_study([('b', str(tmp_path / 'no.py'))], str(tmp_path),
                       StudySettings(data_root=tiny_data))


def test_cli_bad_arguments(tools):
    # a --finetune setting is POOL,TOPK; a config that does not exist is named
    code, out = tools('tools/swap_study.py', '--finetune', '7', check=False)
    assert code == 2 and "'7': give POOL,TOPK" in out
    code, out = tools('tools/swap_study.py', '--model', 'x=nowhere.py', check=False)
    assert code == 2 and "config(s) not found: ['nowhere.py']" in out


def test_swap_study_end_to_end(tools, tiny_data, tmp_path):
    work = tmp_path / 'study'
    _, out = tools('tools/swap_study.py', '--model', f'tiny={TINY_SEGMENTER}', '--data-root',
                   tiny_data, '--work-dir', work, '--train-iters', 2, '--finetune-iters', 2,
                   '--pool-sizes', 2, 4, '--topks', 8, '--finetune', '4,8', '--selection',
                   '4,8', '--selection-images', 1, '--speed-time', 0.02, '--threads', 1)
    # progress lines, the table printed, the outputs named
    assert '[swap_study +' in out and 'tiny: sweep [3/3] MiTA M=4x4 k=8: mIoU' in out
    assert 'wrote ' + str(work / 'swap_study.json') in out

    with open(work / 'swap_study.json') as f:
        study = json.load(f)
    assert study['errors'] == [] and study['machine']['threads'] == 1
    (res, ) = study['models']
    rows = {r['setting']: r for r in res['rows']}
    assert [r['kind'] for r in res['rows']] == [
        'baseline', 'swap', 'swap', 'check', 'finetune', 'control']
    base, m4, m16 = (rows['unswapped (softmax attention)'], rows['MiTA M=2x2 k=8'],
                     rows['MiTA M=4x4 k=8'])
    ft = rows['MiTA M=4x4 k=8, fine-tuned 2 it']
    ctl = rows['unswapped, trained 2 it more (control)']
    # route-only MiTA with every key is softmax attention: the same mIoU
    assert rows['route-only MiTA, every key (check: = unswapped)']['mIoU'] == base['mIoU']
    # fewer landmarks, fewer FLOPs; every swap below the unswapped model
    assert base['model_GFLOPs'] > m16['model_GFLOPs'] > m4['model_GFLOPs'] > 0
    assert base['attn_GMACs'] > m16['attn_GMACs'] > m4['attn_GMACs'] > 0
    assert m16['model_reduction_%'] == pytest.approx(
        100 * (1 - m16['model_GFLOPs'] / base['model_GFLOPs']))
    # the exported, fine-tuned model is the swapped architecture; the control is the original
    assert ft['model_GFLOPs'] == pytest.approx(m16['model_GFLOPs'])
    assert ft['attn_GMACs'] == pytest.approx(m16['attn_GMACs'])
    assert ctl['model_GFLOPs'] == pytest.approx(base['model_GFLOPs'])
    for r in (base, m4, m16, ft, ctl):
        assert r['img_per_s'] > 0 and 0 <= r['mIoU'] <= 100
        assert r['delta_mIoU'] == pytest.approx(r['mIoU'] - base['mIoU'])
    assert res['train']['iters'] == 2 and res['input'] == [128, 128]

    # the fine-tune trained the exported pair: its config is on MiTA, its run loaded the
    # exported checkpoint
    exp_cfg, exp_ckpt = ft['exported']
    assert osp.isfile(exp_ckpt) and "type='MiTAVisionTransformer'" in open(exp_cfg).read()
    logs = list((work / 'tiny' / 'finetune_p4_k8' / 'train').glob('*/*.log'))
    assert logs and f'Load checkpoint from {exp_ckpt}' in logs[0].read_text()
    assert osp.isfile(ft['checkpoint']) and osp.isfile(ctl['checkpoint'])

    # the markdown table holds the JSON's numbers
    md = (work / 'swap_study.md').read_text()
    for r in res['rows']:
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {r['setting']} |"))
        assert f"| {r['mIoU']:.2f} |" in line
        if r.get('model_GFLOPs'):
            assert f"| {r['model_GFLOPs']:.4f} |" in line
    assert re.search(r'\| backbone\.layers\.0\.attn \| 16x16 \| 257 \| [\d.]+% \| [\d.]+% \|', md)

    # figures: the plot and one selection map, real PNGs
    sel = res['selection']
    assert sel['pool_size'] == 4 and len(sel['figures']) == 1
    assert set(sel['layers']) == {f'backbone.layers.{i}.attn' for i in range(4)} | {
        'decode_head.layers.0.attn', 'decode_head.layers.1.attn'}
    for png in study['figures']:
        with open(png, 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    assert study['figures'][0] == str(work / 'figures' / 'swap_study.png')

    # --reuse: the finished model is not run again
    _, out = tools('tools/swap_study.py', '--model', f'tiny={TINY_SEGMENTER}', '--data-root',
                   tiny_data, '--work-dir', work, '--train-iters', 2, '--finetune-iters', 2,
                   '--pool-sizes', 2, 4, '--topks', 8, '--finetune', '4,8', '--selection',
                   '4,8', '--selection-images', 1, '--speed-time', 0.02, '--threads', 1,
                   '--reuse')
    assert 'tiny: reusing' in out and 'Iter(train)' not in out
    with open(work / 'swap_study.json') as f:
        assert json.load(f)['models'][0]['rows'] == res['rows']

