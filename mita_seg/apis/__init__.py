"""The one place tools and users call (as mmseg's ``mmseg.apis`` keeps its tools thin).

- configs: :func:`load_config` (files and ``mmseg::`` configs, ``--cfg-options``,
  ``work_dir``), :func:`use_slim_inference` (mmseg's results, lighter slide inference; the
  dense attention path ``dense_attn``, :func:`dense_attn_setting`), :func:`use_dense_attn`;
- models: :func:`init_model` (strict weights-only checkpoint loading, optional swap to
  MiTA), :func:`swap_model`, :func:`inference_model`, :class:`MiTASegInferencer`;
- a swap's single keys (``--mita-cfg``): :func:`check_mita_cfg`;
- runs: :func:`prepare_config`, :func:`check_schedule`, :func:`build_runner` (train/test);
- token merging (ToMe): :func:`merge_model`;
- swap workflows: :func:`swap_sweep` (of :func:`sweep_points`, :class:`SweepPoint`, one
  :class:`SweepRow` each), :func:`export_swapped`, :func:`calibrate_swap`
  (:class:`SwapCalibrator`: per-layer settings for a FLOP budget, a
  :class:`~mita_seg.models.SwapPlan`);
- deployment: :func:`export_onnx` (ONNX, MiTA as standard operators, checked in ORT);
- offline: :func:`make_standin_checkpoint` (a config's model, seeded random weights, in the
  model zoo's format: a stand-in for a released checkpoint).

The tools' command line (argument types, ``--swap-attn``/``--mita-cfg``/``--merge-ratio``,
the ``error:`` line) is not API: the ``cli`` package, which no library module imports. Names
load on first use (``from mita_seg.apis import X`` imports X's module), so the command line
checks ``--mita-cfg`` (:mod:`mita_seg.apis.mita_cfg`) without importing the mm stack.
"""
import importlib

_SOURCES = {
    'mita_seg.utils.checkpoint': ('load_checkpoint', ),
    'calibrate': ('CalibrationError', 'SwapCalibrator', 'calibrate_swap'),
    'config': ('config_name', 'dense_attn_setting', 'keep_predictions', 'load_config',
               'use_dense_attn', 'use_slim_inference'),
    'export': ('export_swapped', 'mita_config'),
    'inference': ('MiTASegInferencer', 'inference_model', 'show_result_pyplot'),
    'mita_cfg': ('check_mita_cfg', ),
    'model': ('init_model', 'swap_model'),
    'onnx_export': ('MIN_OPSET', 'OnnxExportError', 'OnnxReport', 'check_onnx', 'export_onnx'),
    'runner': ('CheckedRunner', 'QuietRunner', 'build_runner', 'check_schedule',
               'prepare_config'),
    'standin': ('make_standin_checkpoint', ),
    'sweep': ('SweepPoint', 'SweepRow', 'swap_sweep', 'sweep_points'),
    'token_merge': ('merge_model', ),
}
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        module = _WHERE[name]
        module = module if '.' in module else f'{__name__}.{module}'
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(list(globals()) + __all__)
