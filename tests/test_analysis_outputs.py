"""The outputs of ``mita_seg/analysis`` and the numbers ``mita_seg/cli`` parses (and the
tools that use them): what each analysis says matches what ran, careless numbers are
refused while parsing, and every output file is written whole.

- token selection records only the layers on MiTA (a swapped layer of another kind has no
  routed experts), and its tool draws each image to a file of its own;
- ``float_range`` refuses infinity (``--min-run-time inf`` never ended);
- the FLOP sweep's plot names the second model as it is (``window``, ``ToMe r=0.3``), the swap
  sweep's plot draws MiTA's variants (route-only...) as lines of their own;
- tables, JSON, figures and drawings go through :mod:`mita_seg.utils.atomic_files`: the file is
  one rename of a finished temporary file, with the umask's mode.
"""
import argparse
import csv
import os
import os.path as osp
import subprocess
import sys
import warnings

import cv2
import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from mmengine.config import Config
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from mita_seg import swap_attention
from mita_seg.analysis import flop_report, sweep_report
from mita_seg.analysis.token_selection import (LayerSelection, TokenSelectionRecorder,
                                               plot_selection_overlay)
from mita_seg.cli import float_range
from mita_seg.setting import MiTASetting
from mita_seg.utils.errors import InputError

matplotlib.use('Agg')
register_all_modules()
ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY = osp.join(ROOT, 'configs', 'mita_vit-tiny_upernet_1xb4-600_tiny-ade20k-128x128.py')
SEGMENTER = osp.join(ROOT, 'configs', 'baselines',
                     'segmenter_vit-tiny_mask_1xb4-600_tiny-ade20k-128x128.py')


def tiny_model(setting='4:32'):
    torch.manual_seed(0)
    model = MODELS.build(Config.fromfile(TINY).model).eval()
    swap_attention(model, setting, verbose=False)
    return model


def run_backbone(model, recorder):
    with recorder, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model.backbone(torch.randn(1, 3, 128, 128))
    return recorder


@pytest.fixture
def replaced(monkeypatch):
    """The paths ``os.replace`` put a file at (how atomic_io makes a file appear whole)."""
    done = []
    real = os.replace

    def spy(src, dst, *args, **kwargs):
        done.append(osp.abspath(os.fspath(dst)))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, 'replace', spy)
    return done


@pytest.fixture
def legends(monkeypatch):
    """Each saved figure's axes: ``[(labels of its lines and collections, {label: points})]``."""
    seen = []
    real = Figure.savefig

    def spy(fig, *args, **kwargs):
        axes = []
        for ax in fig.axes:
            points = {line.get_label(): len(line.get_xdata()) for line in ax.get_lines()}
            legend = ax.get_legend()
            axes.append(([t.get_text() for t in legend.get_texts()] if legend else [], points))
        seen.append(axes)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, 'savefig', spy)
    return seen


def written_whole(path, replaced):
    """``path`` appeared by one rename of a finished temporary file, with the mode ``open``
    gives a new file (``0666 & ~umask``; the temporary file's own is 0600), none left."""
    path = osp.abspath(os.fspath(path))
    assert path in replaced, f'{path} was not written by one rename of a finished file'
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    assert not [f for f in os.listdir(osp.dirname(path)) if f.startswith('.')], \
        'a temporary file was left'


# ----------------------------------------------------------------- token selection
def test_recorder_leaves_out_layers_of_other_kinds():
    """A swapped layer of another kind has no routed experts: it was recorded as if MiTA had
    routed with the pool and k its setting carries unused (silently wrong fractions)."""
    model = tiny_model('4:32')
    model.backbone.layers[2].attn.configure('agent:4')
    model.backbone.layers[3].attn.configure('window:3')
    rec = run_backbone(model, TokenSelectionRecorder(model))
    assert [r.name for r in rec.records] == ['backbone.layers.0.attn', 'backbone.layers.1.attn']
    # a layer configured to another kind after the recorder was made is left out too
    model = tiny_model('4:32')
    recorder = TokenSelectionRecorder(model)
    model.backbone.layers[1].attn.configure('block:4:2')
    rec = run_backbone(model, recorder)
    assert [r.name for r in rec.records] == ['backbone.layers.0.attn', 'backbone.layers.2.attn',
                                             'backbone.layers.3.attn']


def test_recorder_of_a_model_with_no_layer_on_mita_says_so():
    model = tiny_model('agent:4')
    with pytest.raises(InputError, match=r'its swapped attention is agent, which has no '
                       r'routed experts.*swap its attention to MiTA'):
        TokenSelectionRecorder(model)


def test_selection_title_gives_each_layers_experts():
    from mita_seg.analysis.token_selection import experts_label

    def rec(m, k):
        none = torch.zeros(1, 1, 5, dtype=torch.bool)
        return LayerSelection('l', (2, 2), 1, m, k, none, none)

    assert experts_label([rec(16, 16), rec(16, 16)]) == 'M=16, k=16'
    # a plan (or a head with fewer keys): not the first layer's values for all
    assert experts_label([rec(16, 16), rec(49, 49)]) == 'M=16/49, k=16/49 (by layer)'


def test_analyze_token_selection_refuses_two_images_of_one_name(tools, tmp_path, capsys):
    """Each image is drawn to ``<name>_<which>.png``: a second image of the same file name
    overwrote the first one's maps while the JSON kept both."""
    tool = tools.module('analyze_token_selection')
    ckpt = tmp_path / 'any.pth'
    ckpt.write_bytes(b'x')
    images = []
    for folder in ('a', 'b'):
        (tmp_path / folder).mkdir()
        images.append(str(tmp_path / folder / 'x.png'))
        cv2.imwrite(images[-1], np.zeros((16, 16, 3), np.uint8))
    with pytest.raises(SystemExit) as e:
        tool.parse_args([TINY, str(ckpt), *images, '--out-dir', str(tmp_path / 'o')])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith('error: images') and 'would both be drawn to' in err
    assert err.count('\n') == 1
    cv2.imwrite(str(tmp_path / 'b' / 'y.png'), np.zeros((16, 16, 3), np.uint8))
    args = tool.parse_args([TINY, str(ckpt), images[0], str(tmp_path / 'b' / 'y.png'),
                            '--out-dir', str(tmp_path / 'o')])
    assert len(args.images) == 2


# ------------------------------------------------------------------------ numbers
def test_float_range_refuses_infinity():
    with pytest.raises(argparse.ArgumentTypeError, match=r"'inf': must be > 0 and finite"):
        float_range(0, low_open=True)('inf')
    with pytest.raises(argparse.ArgumentTypeError, match=r"'1e400': must be >= 0 and finite"):
        float_range(0)('1e400')
    with pytest.raises(argparse.ArgumentTypeError, match=r"'-inf': must be finite"):
        float_range()('-inf')
    with pytest.raises(argparse.ArgumentTypeError, match=r"'inf': must be >= 0 and <= 1$"):
        float_range(0, 1)('inf')
    with pytest.raises(argparse.ArgumentTypeError, match=r"'nan': must be > 0"):
        float_range(0, low_open=True)('nan')
    assert float_range(0, low_open=True)('2.5') == 2.5


def test_benchmark_refuses_an_endless_min_run_time():
    """``--min-run-time inf`` was taken, and the timing loop never ended."""
    out = subprocess.run([sys.executable, osp.join(ROOT, 'tools', 'benchmark.py'),
                          '--min-run-time', 'inf'], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "error: argument --min-run-time: 'inf': must be > 0 and finite\n" in out.stderr
    assert 'Traceback' not in out.stderr


# ------------------------------------------------------------------------- figures
SIZES = [dict(size=64, baseline=2.0, mita=1.5, baseline_attention=0.8, mita_attention=0.3),
         dict(size=128, baseline=9.0, mita=5.0, baseline_attention=5.0, mita_attention=1.2)]


def test_flop_sweep_plot_names_the_second_model(tmp_path, legends, replaced):
    """The plot said "MiTA total" whatever ran: a window swap, agent, ToMe alone."""
    out = tmp_path / 'sweep.png'
    flop_report.plot_sweep(SIZES, str(out), 'title', 'window')
    labels = legends[0][0][0]
    assert labels == ['baseline total', 'baseline attention', 'window total',
                      'window attention']
    written_whole(out, replaced)


def sweep_rows():
    from mita_seg.apis.sweep import SweepPoint, SweepRow

    def row(text, miou, gflops, M):
        setting = None if text is None else MiTASetting.parse(text)
        point = SweepPoint('baseline') if setting is None else SweepPoint('swap', setting)
        label = 'baseline' if setting is None else f'MiTA {setting.label}'
        return SweepRow(point, label, None, M, miou, 50.0, 80.0, gflops / 10, gflops)

    return [row(None, 40.0, 10.0, None), row('4:16', 38.0, 6.0, 16), row('4:32', 39.0, 7.0, 16),
            row('4:16:route', 30.0, 5.5, 16), row('4:32:route', 33.0, 6.5, 16),
            row('2:16', 35.0, 5.0, 4)]


def test_swap_sweep_plot_draws_each_mita_variant_as_its_own_line(tmp_path, legends, replaced):
    """Route-only MiTA at the same M was joined to the shared-expert line, under its label."""
    out = tmp_path / 'sweep.png'
    sweep_report.plot_sweep(sweep_rows(), str(out), 'title')
    for labels, points in legends[0]:
        assert points['MiTA M=16'] == 2 and points['MiTA M=16 route-only'] == 2
        assert points['MiTA M=4'] == 1
    assert 'MiTA M=16 route-only' in legends[0][1][0]
    written_whole(out, replaced)


def test_selection_overlay_is_written_whole_and_keeps_the_titles_lines(tmp_path, replaced):
    model = tiny_model('4:32')
    rec = run_backbone(model, TokenSelectionRecorder(model))
    image = np.zeros((128, 128, 3), np.uint8)
    out = tmp_path / 'sub' / 'sel.png'
    captured = {}
    real = Figure.suptitle

    def suptitle(fig, text, **kwargs):
        captured['title'] = text
        return real(fig, text, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, 'suptitle', suptitle)
        plot_selection_overlay(image, rec.records, str(out), cell_size=(8, 8),
                               title='first line\nsecond line')
    # the figures' one title wrapper (plotting.wrap_title): a line break is kept
    assert captured['title'].split('\n')[:2] == ['first line', 'second line']
    written_whole(out, replaced)


# -------------------------------------------------------------------------- tables
def test_swap_sweep_tables_keep_the_old_files_when_writing_fails(tmp_path, monkeypatch):
    """The CSV was opened (emptied) and then written row by row: a failure half-way left
    a truncated table in place of the old one."""
    md, table = tmp_path / 'sweep.md', tmp_path / 'sweep.csv'
    md.write_text('old md\n')
    table.write_text('old csv\n')

    def fail(self, rows):
        raise OSError(28, 'No space left on device (injected)')

    monkeypatch.setattr(csv.DictWriter, 'writerows', fail)
    with pytest.raises(OSError, match='injected'):
        sweep_report.write_tables(sweep_rows(), str(md), 'note')
    assert md.read_text() == 'old md\n' and table.read_text() == 'old csv\n'
    assert sorted(os.listdir(tmp_path)) == ['sweep.csv', 'sweep.md']


def test_swap_sweep_tables_are_written_whole(tmp_path, replaced):
    md, table = sweep_report.write_tables(sweep_rows(), str(tmp_path / 'sweep.md'), 'note')
    written_whole(md, replaced)
    written_whole(table, replaced)
    with open(table, newline='') as f:
        rows = list(csv.DictReader(f))
    assert [r['setting'] for r in rows][:2] == ['baseline', 'MiTA M=4x4 k=16']


# --------------------------------------------------------------------------- tools
def test_get_flops_json_and_plot_are_written_whole_and_name_the_swap(tools, tmp_path, replaced,
                                                                     legends):
    tool = tools.module('get_flops')
    out, png = tmp_path / 'f.json', tmp_path / 'f.png'
    tool.main([SEGMENTER, '--swap-attn', 'window:3', '--device', 'meta', '--shape', '64',
               '--sweep', '64', '128', '--plot', str(png), '--json', str(out)])
    written_whole(out, replaced)
    written_whole(png, replaced)
    assert legends[0][0][0][2:] == ['window total', 'window attention']


def test_token_selection_and_image_demo_write_whole_files(tools, tmp_path, replaced):
    from mita_seg.apis import make_standin_checkpoint
    ckpt = tmp_path / 'ckpt' / 'standin.pth'
    make_standin_checkpoint(SEGMENTER, str(ckpt))
    image = tmp_path / 'img.png'
    pixels = np.random.default_rng(0).integers(0, 255, (128, 128, 3), dtype=np.uint8)
    cv2.imwrite(str(image), pixels)
    out = tmp_path / 'out'
    tools.module('analyze_token_selection').main(
        [SEGMENTER, str(ckpt), str(image), '--out-dir', str(out), '--mita-cfg',
         'pool_size=4', 'topk=16'])
    written_whole(out / 'token_selection.json', replaced)
    written_whole(out / 'img_selected.png', replaced)
    drawn = tmp_path / 'demo' / 'seg.png'
    tools.module('image_demo').main([str(image), SEGMENTER, str(ckpt), '--out-file', str(drawn)])
    written_whole(drawn, replaced)
    assert cv2.imread(str(drawn)) is not None
