"""The package's layout: the library is ``seqpar``, the tools around it ``seqpar.tools``.

``import seqpar`` (and every library module) loads no ``seqpar.tools`` module and no
``torch.testing`` or ``torch.utils._python_dispatch`` module that ``import torch`` did not load
already; each is checked in a fresh process (forked right after ``import torch``). The tools' old
paths (``seqpar.testing``, ``seqpar.one_rank``, ``seqpar.models``, ``seqpar.profiling``) are gone,
not kept as re-exporting aliases; the scripts import their helpers from ``seqpar.tools`` and edit
no ``sys.path``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Old paths, removed: import from seqpar.tools (the calibration moved into seqpar.planner).
OLD_PATHS = ("seqpar.testing", "seqpar.one_rank", "seqpar.profiling", "seqpar.models", "seqpar.tools.calibration")

# The library's entry points: none may pull in a tool.
LIBRARY = [
    "seqpar",
    "seqpar.planner",
    "seqpar.planner.calibration",  # the planner's measurements: timed by the library, not a tool
    "seqpar.placement.cost",
    "seqpar.training",
    "seqpar.sdpa",
    "seqpar.compiled",
    "seqpar.integrations",
    "seqpar.integrations.transformers",
    "seqpar.integrations.diffusers",
    "seqpar.integrations.timm",
]

# Prints, one JSON line per module of argv[1:], the modules that importing it loads beyond those of
# `import torch`: each import runs in a child forked right after `import torch` (a fresh interpreter
# as far as seqpar is concerned, without importing torch once per module).
_NEW_MODULES = r"""
import importlib, json, os, sys, traceback
import torch
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        before = set(sys.modules)
        try:
            importlib.import_module(name)
            out = {"module": name, "new": sorted(set(sys.modules) - before)}
        except BaseException:
            out = {"module": name, "error": traceback.format_exc()}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
"""


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _forbidden(module: str) -> bool:
    """A module no library import may load: a tool, torch's testing or dispatch code."""
    return (
        module == "seqpar.tools" or module.startswith("seqpar.tools.")
        or module == "torch.testing" or module.startswith("torch.testing.")
        or module == "torch.utils._python_dispatch"
    )


@cache
def _new_modules() -> dict[str, dict]:
    proc = _python("-c", _NEW_MODULES, *LIBRARY)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"module"')]
    return {r["module"]: r for r in rows}


@pytest.mark.slow  # a fresh interpreter imports the library: not in the quick subset
@pytest.mark.parametrize("module", LIBRARY)
def test_library_imports_no_tools(module):
    r = _new_modules().get(module)
    assert r is not None and "error" not in r, r
    new = r["new"]
    assert module in new, new
    assert not [m for m in new if _forbidden(m)], f"import {module} loaded {[m for m in new if _forbidden(m)]}"


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_tool_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_planner_calibrate_is_the_planners_own():
    import seqpar
    from seqpar.planner.calibration import calibrate

    with pytest.raises(ValueError, match="calibrate"):
        seqpar.planner.calibrate(object())  # not a ParallelState: refused by the measurement itself
    with pytest.raises(ValueError, match="calibrate"):
        calibrate(object())


def test_scripts_edit_no_sys_path_and_import_helpers_from_tools():
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    assert scripts and not [p.name for p in scripts if p.name.startswith("_")], "helpers belong in seqpar.tools"
    for path in [*scripts, ROOT / "scripts" / "gpu_check"]:
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        assert "_bench_common" not in text and "_train_harness" not in text, path.name


def _module_imports(path: Path, package_root: Path) -> set[str]:
    """The seqpar modules ``path`` imports at module level (imports inside functions are lazy and
    do not make a cycle at import time; neither do ``TYPE_CHECKING`` blocks)."""
    import ast

    name = ".".join(path.relative_to(package_root.parent).with_suffix("").parts)
    if name.endswith(".__init__"):
        name = name[: -len(".__init__")]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("seqpar"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("seqpar"))
    return out


def test_no_import_cycle_in_the_library():
    root = Path(__file__).resolve().parents[1] / "seqpar"
    files = {p for p in root.rglob("*.py") if "tools" not in p.relative_to(root).parts}
    names = {}
    for p in files:
        mod = ".".join(p.relative_to(root.parent).with_suffix("").parts)
        names[mod[: -len(".__init__")] if mod.endswith(".__init__") else mod] = p
    graph = {m: {d for d in _module_imports(p, root) if d in names and d != m} for m, p in names.items()}
    # A package's __init__ importing its own submodules is not a cycle through them.
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if m.startswith(d + "."):  # a submodule importing a name from its own package
                continue
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [m, d])}")
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert {"seqpar.attention", "seqpar.compiled", "seqpar.prepare", "seqpar.parallel.hybrid"} <= set(graph)
    assert "seqpar.attention" not in graph["seqpar.compiled"]
