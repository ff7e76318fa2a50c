"""The layers' rule: the operator (``mita_seg.ops``, pure tensor functions) and the package
root import none of the mm stack (mmseg, mmengine, mmcv), so that the operator runs, and
imports fast, with torch alone. Each import runs in a fresh interpreter (this one has the
stack loaded already)."""
import importlib.util
import json
import subprocess
import sys

import pytest

STACK = {'mmseg', 'mmengine', 'mmcv'}
# The light modules; mita_seg.setting (the MiTA setting type) once it exists.
LIGHT = ['mita_seg', 'mita_seg.ops'] + [m for m in ['mita_seg.setting']
                                         if importlib.util.find_spec(m) is not None]


def _top_level_modules_after(module: str) -> set:
    """The top-level packages in ``sys.modules`` after ``import module`` in a fresh
    interpreter."""
    code = (f'import json, sys, {module}\n'
            'print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.parametrize('module', LIGHT)
def test_light_modules_import_no_mm_stack(module):
    loaded = _top_level_modules_after(module)
    # the probe sees the modules: torch, except where nothing needs it
    assert 'torch' in loaded or module in ('mita_seg', 'mita_seg.setting'), 'no modules seen'
    if module == 'mita_seg.setting':   # tools parse settings before importing torch
        assert 'mita_seg' in loaded and 'torch' not in loaded
    assert not loaded & STACK, (f'import {module} loads {sorted(loaded & STACK)}: the '
                                'operator layer must not depend on the mm stack')


def test_library_imports_no_command_line():
    """Library modules import neither ``argparse`` nor the tools' command line
    (``mita_seg.cli``): argument types, shared arguments and the ``error:`` line are the
    tools'; library code raises ``InputError`` (``mita_seg.utils.errors``) and its own
    error classes."""
    import ast
    import os.path as osp
    from pathlib import Path
    root = Path(osp.dirname(osp.dirname(osp.abspath(__file__)))) / 'mita_seg'
    found = []
    for path in sorted(root.rglob('*.py')):
        if (root / 'cli') in path.parents:
            continue
        package = '.'.join(path.relative_to(root.parent).with_suffix('').parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ''
                if node.level:   # relative: resolved against the module's package
                    parts = package.split('.')
                    base = '.'.join(parts[:len(parts) - node.level + 1] + ([base] if base
                                                                            else []))
                names = [base] + [f'{base}.{a.name}' for a in node.names]
            else:
                continue
            bad = [n for n in names if n.split('.')[0] == 'argparse'
                   or n == 'mita_seg.cli' or n.startswith('mita_seg.cli.')]
            found += [f'{path.relative_to(root.parent)}:{node.lineno}: {n}' for n in bad]
    assert not found, '\n'.join(found)
    # the command line itself is light: tools parse before importing the stack
    assert not _top_level_modules_after('mita_seg.cli') & (STACK | {'torch'})


def test_lazy_names_resolve_and_the_api_has_no_command_line():
    """Every name of the lazy tables of ``mita_seg.apis`` and ``mita_seg.utils`` loads; the
    command line's names are ``mita_seg.cli``'s, not the API's."""
    import mita_seg.apis
    import mita_seg.cli
    import mita_seg.utils
    for module in (mita_seg.apis, mita_seg.utils, mita_seg.cli):
        for name in module.__all__:
            assert getattr(module, name) is not None, f'{module.__name__}.{name}'
    plumbing = {'add_mita_args', 'swap_settings', 'add_dense_attn_arg', 'add_merge_args',
                'merge_ratio', 'setting_arg', 'setting_or_dense_arg', 'run_tool'}
    assert plumbing <= set(mita_seg.cli.__all__)
    assert not plumbing & set(mita_seg.apis.__all__)
    # InputError: one class, raised by library code, reported by the command line
    from mita_seg.utils.errors import InputError
    assert mita_seg.cli.InputError is mita_seg.utils.InputError is InputError
