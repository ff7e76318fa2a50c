"""The one place tools and users call (as mmseg's ``mmseg.apis`` keeps its tools thin).

- configs: :func:`load_config` (files and ``mmseg::`` configs, ``--cfg-options``,
  ``work_dir``), :func:`use_slim_inference` (mmseg's results, lighter slide inference);
- models: :func:`init_model` (strict weights-only checkpoint loading, optional swap to
  MiTA), :func:`swap_model`, :func:`inference_model`, :class:`MiTASegInferencer`;
- ``--mita-cfg``: :func:`add_mita_args`, :func:`check_mita_cfg`, :func:`swap_settings`;
- runs: :func:`prepare_config`, :func:`build_runner` (train/test);
- swap workflows: :func:`swap_sweep`, :func:`export_swapped`, :func:`run_swap_study`
  (:class:`StudySettings`);
- :func:`run_tool`: user errors end a tool with a message, exit status 1.
"""
from mita_seg.utils.checkpoint import load_checkpoint
from .cli import USER_ERRORS, run_tool
from .config import config_name, load_config, use_slim_inference
from .export import export_swapped, mita_config
from .inference import MiTASegInferencer, inference_model, show_result_pyplot
from .mita_cfg import add_mita_args, check_mita_cfg, swap_settings
from .model import init_model, swap_model
from .runner import QuietRunner, build_runner, prepare_config
from .sweep import swap_sweep
from .swap_study import StudySettings, run_swap_study

__all__ = [
    'load_config', 'config_name', 'use_slim_inference', 'init_model', 'swap_model', 'load_checkpoint',
    'inference_model', 'show_result_pyplot', 'MiTASegInferencer', 'add_mita_args',
    'check_mita_cfg', 'swap_settings', 'prepare_config', 'build_runner', 'QuietRunner',
    'swap_sweep', 'export_swapped', 'run_swap_study', 'StudySettings', 'mita_config', 'run_tool', 'USER_ERRORS'
]
