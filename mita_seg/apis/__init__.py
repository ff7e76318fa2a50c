"""The one place tools and users call (as mmseg's ``mmseg.apis`` keeps its tools thin).

- configs: :func:`load_config` (files and ``mmseg::`` configs, ``--cfg-options``,
  ``work_dir``), :func:`use_slim_inference` (mmseg's results, lighter slide inference; the
  dense attention path ``dense_attn``, :func:`dense_attn_setting`), :func:`use_dense_attn`;
- models: :func:`init_model` (strict weights-only checkpoint loading, optional swap to
  MiTA), :func:`swap_model`, :func:`inference_model`, :class:`MiTASegInferencer`;
- ``--mita-cfg``: :func:`add_mita_args`, :func:`check_mita_cfg`, :func:`swap_settings`;
  ``--dense-attn {fast,mmseg}``: :func:`add_dense_attn_arg` (in :func:`add_mita_args` too);
- runs: :func:`prepare_config`, :func:`build_runner` (train/test);
- token merging (ToMe): :func:`add_merge_args`, :func:`merge_model`;
- swap workflows: :func:`swap_sweep` (of :func:`sweep_points`, :class:`SweepPoint`, one
  :class:`SweepRow` each), :func:`export_swapped`, :func:`calibrate_swap`
  (:class:`SwapCalibrator`: per-layer settings for a FLOP budget, a
  :class:`~mita_seg.models.SwapPlan`);
- deployment: :func:`export_onnx` (ONNX, MiTA as standard operators, checked in ORT);
- careless input (:mod:`mita_seg.apis.cli`): argument types that refuse a bad path or
  number at parsing (:func:`config_file`, :func:`checkpoint_file`, :func:`image_file`,
  :func:`input_file`, :func:`output_file`, :func:`output_dir`, :func:`int_range`,
  :func:`float_range`, :func:`device_name`, :class:`KeyValueAction`), and :func:`run_tool`: user errors found
  later end a tool with one ``error:`` line, exit status 1.
"""
from mita_seg.utils.checkpoint import load_checkpoint
from .calibrate import CalibrationError, SwapCalibrator, calibrate_swap
from .cli import (USER_ERRORS, InputError, KeyValueAction, checkpoint_file, config_file,
                  device_name, ensure_parent, float_range, image_file, input_file, int_range, output_dir,
                  output_file, python_command, run_tool, wrap_title)
from .config import (config_name, dense_attn_setting, load_config, use_dense_attn,
                     use_slim_inference)
from .export import export_swapped, mita_config
from .inference import MiTASegInferencer, inference_model, show_result_pyplot
from .mita_cfg import add_dense_attn_arg, add_mita_args, check_mita_cfg, swap_settings
from .model import init_model, swap_model
from .onnx_export import MIN_OPSET, OnnxExportError, OnnxReport, check_onnx, export_onnx
from .runner import QuietRunner, build_runner, prepare_config
from .sweep import SweepPoint, SweepRow, swap_sweep, sweep_points
from .token_merge import add_merge_args, merge_model

__all__ = [
    'load_config', 'config_name', 'use_slim_inference', 'init_model', 'swap_model', 'load_checkpoint',
    'inference_model', 'show_result_pyplot', 'MiTASegInferencer', 'add_mita_args',
    'check_mita_cfg', 'swap_settings', 'prepare_config', 'build_runner', 'QuietRunner',
    'swap_sweep', 'export_swapped', 'mita_config', 'run_tool', 'USER_ERRORS',
    'sweep_points', 'SweepPoint', 'SweepRow',
    'add_merge_args', 'merge_model', 'add_dense_attn_arg', 'dense_attn_setting',
    'use_dense_attn',
    'export_onnx', 'check_onnx', 'OnnxReport', 'OnnxExportError', 'MIN_OPSET',
    'calibrate_swap', 'SwapCalibrator', 'CalibrationError',
    'InputError', 'KeyValueAction', 'checkpoint_file', 'config_file', 'device_name',
    'ensure_parent',
    'float_range', 'image_file', 'input_file', 'int_range', 'output_dir', 'output_file',
    'python_command', 'wrap_title'
]
