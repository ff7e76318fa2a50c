"""The layers' rule: the operator (``mita_seg.ops``, pure tensor functions) and the package
root import none of the mm stack (mmseg, mmengine, mmcv), so that the operator runs, and
imports fast, with torch alone. Each import runs in a fresh interpreter (this one has the
stack loaded already). Read from the source (``ast``): library code and ``projects/`` never
import the tools' command line, the modules of ``mita_seg/`` and ``projects/`` import one
another without a cycle, and no file of ``projects/`` is over 400 lines."""
import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the packages whose import graph must have no cycle (docs/architecture.md's layers)
GRAPH_PACKAGES = ('mita_seg', 'projects')

STACK = {'mmseg', 'mmengine', 'mmcv'}
# The light modules; mita_seg.setting (the MiTA setting type) once it exists.
LIGHT = ['mita_seg', 'mita_seg.ops'] + [
    m for m in ['mita_seg.setting'] if importlib.util.find_spec(m) is not None]


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


def _modules(*packages: str, root: Path = ROOT) -> Dict[str, Path]:
    """The Python modules of ``packages`` (folders of ``root``), by dotted name; a package is
    its ``__init__.py``."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob('*.py')):
            parts = path.relative_to(root).with_suffix('').parts
            out['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
    return out


def _imports(path: Path, root: Path = ROOT) -> Iterator[Tuple[int, str, List[str]]]:
    """Every import statement of the module at ``path``, at any depth (an import inside a
    function counts: it runs when the function does), as ``(line, module, names)``:
    ``import a.b`` is ``('a.b', [])``, ``from x import n, m`` is ``(x, ['n', 'm'])`` with a
    relative ``x`` resolved against the module's package."""
    package = '.'.join(path.relative_to(root).with_suffix('').parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:   # relative: resolved against the module's package
                parts = package.split('.')
                base = '.'.join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            yield node.lineno, base, [a.name for a in node.names]


def test_library_imports_no_command_line():
    """Library modules import neither ``argparse`` nor the tools' command line
    (``mita_seg.cli``): argument types, shared arguments and the ``error:`` line are the
    tools'; library code raises ``InputError`` (``mita_seg.utils.errors``) and its own
    error classes. ``projects/`` (experiments on the library) parse their own arguments:
    argparse, never ``mita_seg.cli``."""
    found = []
    for name, path in _modules(*GRAPH_PACKAGES).items():
        if name == 'mita_seg.cli' or name.startswith('mita_seg.cli.'):
            continue
        library = name.split('.')[0] == 'mita_seg'
        for line, base, names in _imports(path):
            bad = [n for n in [base] + [f'{base}.{a}' for a in names]
                   if (library and n.split('.')[0] == 'argparse')
                   or n == 'mita_seg.cli' or n.startswith('mita_seg.cli.')]
            found += [f'{path.relative_to(ROOT)}:{line}: {n}' for n in bad]
    assert not found, '\n'.join(found)
    # the command line itself is light: tools parse before importing the stack
    assert not _top_level_modules_after('mita_seg.cli') & (STACK | {'torch'})


def _import_graph(modules: Dict[str, Path], root: Path = ROOT) -> Dict[str, Dict[str, str]]:
    """``{module: {imported module: 'file:line'}}`` among ``modules``. ``from x import n`` is
    an import of the module ``x.n`` when there is one (a file, a package, or a compiled
    extension that setup.py builds), else of ``x`` (a name of its ``__init__``, for a
    package); ``import a.b`` is an import of ``a.b`` (the packages above it are loaded on
    the way, not imported from)."""
    setup = root / 'setup.py'
    compiled = set(re.findall(r"Extension\(\s*['\"]([\w.]+)['\"]",
                              setup.read_text() if setup.is_file() else ''))
    known = set(modules) | compiled
    graph: Dict[str, Dict[str, str]] = {m: {} for m in known}
    for name, path in modules.items():
        for line, base, names in _imports(path, root):
            targets = [f'{base}.{n}' if f'{base}.{n}' in known else base for n in names] or [base]
            for target in targets:
                if target in known and target != name:
                    graph[name].setdefault(target, f'{path.relative_to(root)}:{line}')
    return graph


def _cycles(graph: Dict[str, Dict[str, str]]) -> List[List[str]]:
    """One cycle of each strongly connected component of ``graph`` that has one (Tarjan's
    algorithm, then the shortest way from one of its modules back to itself)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    components = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in component and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        cycles.append(paths[last] + [start])
    return cycles


def test_no_import_cycle():
    """The modules of ``mita_seg/`` and ``projects/`` import one another without a cycle
    (docs/architecture.md's layers: a lower module never imports a higher one). An import
    inside a function counts (it runs when the function does: a cycle it hides is a layer
    broken), and so does a package's ``__init__`` (a package whose ``__init__`` imports a
    submodule, lazily or not, is above it)."""
    graph = _import_graph(_modules(*GRAPH_PACKAGES))
    assert 'mita_seg.ops.mita' in graph['mita_seg.ops'], 'the graph sees no imports'
    found = ['\n    -> '.join(f'{a} ({graph[a][b]})' for a, b in zip(cycle, cycle[1:]))
             + f'\n    -> {cycle[-1]}' for cycle in _cycles(graph)]
    assert not found, 'import cycles:\n  ' + '\n  '.join(found)


def test_cycle_check_sees_function_level_and_package_imports(tmp_path):
    """The check itself, on a package written here: ``pkg/__init__`` imports ``pkg.b`` inside a
    function and ``pkg.b`` imports a name of ``pkg``: a cycle, found; ``pkg.c`` imports the
    submodule ``b`` and the compiled ``_C`` from ``pkg``: imports of those modules, not of
    ``pkg`` (no cycle)."""
    files = {'setup.py': "ext_modules = [CppExtension('pkg._C', ['pkg/c.cpp'])]\n",
             'pkg/__init__.py': 'def lazy():\n    from . import b\n    return b\n',
             'pkg/b.py': 'from . import lazy\n',
             'pkg/c.py': 'import os\nfrom pkg import _C, b\nfrom .b import lazy\n'}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _import_graph(_modules('pkg', root=tmp_path), tmp_path)
    assert graph['pkg'] == {'pkg.b': 'pkg/__init__.py:2'}
    assert graph['pkg.b'] == {'pkg': 'pkg/b.py:1'}
    assert graph['pkg.c'] == {'pkg._C': 'pkg/c.py:2', 'pkg.b': 'pkg/c.py:2'}
    assert _cycles(graph) == [['pkg', 'pkg.b', 'pkg']]
    del graph['pkg']['pkg.b']
    assert _cycles(graph) == []


def test_projects_files_are_short():
    """No file of ``projects/`` is over 400 lines: an experiment is stages, a module each,
    and an orchestrator that calls them (issue 55)."""
    lines = {p.relative_to(ROOT): len(p.read_bytes().splitlines())
             for p in (ROOT / 'projects').rglob('*')
             if p.is_file() and '__pycache__' not in p.parts}
    assert lines, 'no files seen'
    long = [f'{p}: {n} lines' for p, n in sorted(lines.items()) if n > 400]
    assert not long, '\n'.join(long)


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
