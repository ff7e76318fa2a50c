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
