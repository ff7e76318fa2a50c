"""Careless input to ``mita_seg.apis`` (export, stand-in, calibration, sweep, configs): an
error that says what to give before anything runs, never a traceback from deep inside or a
setting silently dropped; and the exported pair written whole, with the user's umask.

On a stand-in of the tiny Segmenter of ``configs/baselines`` (ViT 4 x 64, patch 8, 2-layer
mask head): no data, nothing trained.
"""
import os
import os.path as osp
import pathlib
import types

import pytest
import torch
from mmengine.config import Config

from mita_seg.apis import (CalibrationError, SweepPoint, SwapCalibrator, export_swapped,
                           load_config, make_standin_checkpoint, swap_sweep, sweep_points)
from mita_seg.setting import MiTASetting, MiTASettingError

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CFG = osp.join(ROOT, 'configs', 'baselines',
               'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')


@pytest.fixture(scope='module')
def standin(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('standin') / 'segmenter_tiny.pth')
    make_standin_checkpoint(CFG, out)
    return out


# -- export_swapped -------------------------------------------------------------------------
def _broken_save(obj, f, *args, **kwargs):
    """torch.save that dies half-way (a full disk, a kill): some bytes, then an error."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, 'wb') as out:
            out.write(b'PK\x03\x04half')
    else:
        f.write(b'PK\x03\x04half')
    raise OSError(28, 'No space left on device')


def test_export_swapped_never_leaves_half_a_pair(standin, tmp_path, monkeypatch):
    out = str(tmp_path / 'ex')
    out_cfg, out_ckpt = export_swapped(CFG, standin, out, dict(pool_size=2, topk=16))
    before = {p: open(p, 'rb').read() for p in (out_cfg, out_ckpt)}
    # the checkpoint's save fails half-way: the pair exported before is still there, whole
    with monkeypatch.context() as m:
        m.setattr(torch, 'save', _broken_save)
        with pytest.raises(OSError, match='No space left'):
            export_swapped(CFG, standin, out, dict(pool_size=2, topk=16))
    assert {p: open(p, 'rb').read() for p in before} == before
    # the config's text cannot be made: neither file is touched (not an empty config)
    import mita_seg.apis.export as export

    def broken_comment(*args, **kwargs):
        raise RuntimeError('cannot dump')

    with monkeypatch.context() as m:
        m.setattr(export, 'swap_comment', broken_comment)
        with pytest.raises(RuntimeError, match='cannot dump'):
            export_swapped(CFG, standin, out, dict(pool_size=2, topk=16))
    assert {p: open(p, 'rb').read() for p in before} == before
    assert sorted(os.listdir(out)) == sorted(osp.basename(p) for p in before)  # no temp file


def test_export_swapped_files_take_the_umask(standin, tmp_path):
    old = os.umask(0o027)
    try:
        out_cfg, out_ckpt = export_swapped(CFG, standin, str(tmp_path / 'ex'), {})
    finally:
        os.umask(old)
    assert os.stat(out_cfg).st_mode & 0o777 == 0o640
    assert os.stat(out_ckpt).st_mode & 0o777 == 0o640


@pytest.mark.parametrize('spelling', ['2:16', MiTASetting.parse('2:16'), dict(setting='2:16'),
                                      dict(setting=dict(pool_size=2, topk=16))])
def test_export_swapped_takes_a_setting_in_any_spelling(standin, tmp_path, spelling):
    """As init_model's mita_cfg does: a whole setting, its text, or a dict whose setting is
    one of those (an AttributeError from deep inside before)."""
    out_cfg, _ = export_swapped(CFG, standin, str(tmp_path / 'ex'), spelling)
    cfg = Config.fromfile(out_cfg)
    assert cfg.model.backbone.mita_cfg['pool_size'] == 2
    assert cfg.model.backbone.mita_cfg['topk'] == 16


def test_export_swapped_takes_paths(standin, tmp_path):
    out_cfg, out_ckpt = export_swapped(pathlib.Path(CFG), pathlib.Path(standin),
                                       str(tmp_path / 'ex'), {})
    assert out_cfg.endswith('segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128_mita.py')
    assert out_ckpt.endswith('segmenter_tiny_mita.pth')


def test_export_swapped_refuses_what_is_no_setting(standin, tmp_path):
    with pytest.raises(MiTASettingError, match='a setting is'):
        export_swapped(CFG, standin, str(tmp_path / 'ex'), 7)
    assert not osp.exists(tmp_path / 'ex')


def test_load_config_takes_a_path():
    cfg = load_config(pathlib.Path(CFG))
    assert cfg.work_dir.endswith('segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128')


# -- make_standin_checkpoint ----------------------------------------------------------------
def test_standin_of_a_config_object_takes_its_cfg_options(tmp_path):
    """cfg_options were dropped silently when the config was a Config: a stand-in of 150
    classes where 5 were asked."""
    cfg = load_config(CFG)
    heads = cfg.model.decode_head.num_classes
    out = str(tmp_path / 's.pth')
    make_standin_checkpoint(cfg, out, cfg_options={'model.decode_head.num_classes': 5})
    state = torch.load(out, weights_only=True)['state_dict']
    assert state['decode_head.cls_emb'].shape[1] == 5
    assert cfg.model.decode_head.num_classes == heads          # the caller's config untouched


# -- SwapCalibrator -------------------------------------------------------------------------
def test_calibration_with_dense_alone_is_refused(standin):
    """Dense alone: nothing to choose; a numpy traceback ('zero-size array') once the errors
    were measured before."""
    with pytest.raises(CalibrationError, match='nothing to choose'):
        SwapCalibrator(CFG, standin, candidates=['dense'])


def test_calibration_candidates_must_be_a_list(standin):
    """'7:49' was read character by character ('MiTA setting '7': write P:K...')."""
    with pytest.raises(TypeError, match='give a list of settings'):
        SwapCalibrator(CFG, standin, candidates='2:16')


def test_calibration_leaves_the_callers_config_alone(standin):
    cfg = load_config(CFG)
    cal = SwapCalibrator(cfg, standin, candidates=['2:16'],
                         cfg_options={'model.test_cfg.mode': 'slide',
                                      'model.test_cfg.crop_size': (64, 64),
                                      'model.test_cfg.stride': (48, 48)})
    assert cal.cfg.model.test_cfg.mode == 'slide'
    assert cfg.model.test_cfg == dict(mode='whole')
    with pytest.raises(TypeError, match='give a list of settings'):
        cal.plan(reduction=0.1, among='2:16')


# -- the sweep ------------------------------------------------------------------------------
def test_sweep_points_take_a_setting_in_any_spelling():
    point = SweepPoint('swap', '4:16')
    assert point.setting == MiTASetting.parse('4:16') and point.setting.is_mita
    assert point == sweep_points([4], [16])[1]
    with pytest.raises(MiTASettingError):
        SweepPoint('swap', 'four:16')


def test_sweep_point_ratio_checked_when_made():
    with pytest.raises(ValueError, match='outside'):
        SweepPoint('tome', merge_ratio=0.9)
    with pytest.raises(TypeError):
        SweepPoint('tome', merge_ratio='0.3')


@pytest.mark.parametrize('kwargs', [dict(swap_cfg=dict(topk=16)),
                                    dict(merge_cfg=dict(ratio=0.3)),
                                    dict(swap_cfg=dict(layers=0))])
def test_swap_sweep_checks_its_layer_choice_before_anything_runs(kwargs):
    """A setting key in swap_cfg (or a bad merge_cfg) failed only at the first swap or
    merge, once the baseline had been evaluated; a runner that is never touched shows it."""
    untouched = types.SimpleNamespace()
    with pytest.raises(MiTASettingError):
        swap_sweep(untouched, sweep_points([4], [16]), **kwargs)
