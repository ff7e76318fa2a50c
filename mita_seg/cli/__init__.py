"""The tools' command line: argument types, shared arguments and the one ``error:`` line.

Not part of the library: tools (``tools/*.py``) import it, library modules never do (they
raise :class:`~mita_seg.utils.errors.InputError` and their own error classes, which
:func:`run_tool` reports). It imports no torch and no mm stack, so a tool parses its
arguments, and refuses a bad one, before it imports what it runs (mmseg/mmengine/mmcv take
seconds to import).

- :mod:`.core`: the argument types of paths and numbers (:func:`config_file`,
  :func:`checkpoint_file`, :func:`image_file`, :func:`input_file`, :func:`output_file`,
  :func:`output_dir`, :func:`int_range`, :func:`float_range`, :func:`device_name`),
  ``key=value`` options (:class:`KeyValueAction`, ``--cfg-options``), help made when printed
  (:class:`DeferredHelp`), :class:`ToolParser` (argparse's parser whose usage errors are
  the same one line), :func:`run_tool` and :func:`user_errors` (the ``error:`` line),
  :func:`ensure_parent`, :func:`python_command`; :class:`InputError`, :func:`quiet_stack`
  and :func:`is_stack_noise` re-exported from the library (:mod:`mita_seg.utils`).
- :mod:`.swap_args`: ``--swap-attn``, ``--mita-cfg``, ``--mita-plan`` (:func:`add_mita_args`,
  :func:`swap_settings`), ``--dense-attn`` (:func:`add_dense_attn_arg`), the types of a
  setting (:func:`setting_arg`, :func:`setting_or_dense_arg`), a sweep's settings
  (:func:`sweep_swaps`).
- :mod:`.merge_args`: ``--merge-ratio`` / ``--merge-ratios`` (:func:`add_merge_args`,
  :func:`merge_ratio`).
- :mod:`.doc_tool`: the ``main()`` of the tools that rewrite generated doc blocks
  (:func:`doc_tool`: ``tools/study_docs.py``, ``tools/bench_docs.py``).
"""
from .core import (DeferredHelp, InputError, KeyValueAction, ToolParser, checkpoint_file,
                   config_file, device_name, ensure_parent, float_range, image_file,
                   input_file, int_range, is_stack_noise, output_dir, output_file,
                   print_error, python_command, quiet_stack, run_tool, user_errors)
from .merge_args import add_merge_args, merge_ratio
from .swap_args import (DenseAttnAction, MiTACfgAction, SweepSwaps, add_dense_attn_arg,
                        add_mita_args, read_plan_arg, setting_arg, setting_or_dense_arg,
                        swap_attn_arg, swap_settings, sweep_swaps)

__all__ = [
    'InputError', 'user_errors', 'run_tool', 'input_file', 'config_file', 'checkpoint_file',
    'image_file', 'output_file', 'output_dir', 'int_range', 'float_range', 'device_name',
    'KeyValueAction', 'DeferredHelp', 'quiet_stack', 'is_stack_noise', 'ensure_parent',
    'python_command', 'add_merge_args', 'merge_ratio', 'DenseAttnAction', 'MiTACfgAction',
    'add_dense_attn_arg', 'add_mita_args', 'read_plan_arg', 'setting_arg',
    'setting_or_dense_arg', 'swap_attn_arg', 'swap_settings', 'ToolParser', 'print_error',
    'SweepSwaps', 'sweep_swaps'
]
