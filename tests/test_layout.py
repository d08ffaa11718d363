"""The package's layout: the library is ``seqpar``, the tools around it ``seqpar.tools``.

``import seqpar`` (and every library module) loads no ``seqpar.tools`` module, none of the aliases
kept at the tools' old paths, and no ``torch.testing`` or ``torch.utils._python_dispatch`` module
that ``import torch`` did not load already; each is checked in a fresh interpreter. The old paths
(``seqpar.testing``, ``seqpar.one_rank``, ``seqpar.models``, ``seqpar.profiling``) still import
and name the same objects; the scripts import their helpers from ``seqpar.tools`` and edit no
``sys.path``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Old path -> new path of every alias module.
ALIASES = {
    "seqpar.testing": "seqpar.tools.testing",
    "seqpar.one_rank": "seqpar.tools.one_rank",
    "seqpar.profiling": "seqpar.tools.profiling",
    "seqpar.models": "seqpar.tools.models",
    "seqpar.models.dit": "seqpar.tools.models.dit",
    "seqpar.models.llama": "seqpar.tools.models.llama",
    "seqpar.models.hf_configs": "seqpar.tools.models.hf_configs",
}

# The library's entry points: none may pull in a tool.
LIBRARY = [
    "seqpar",
    "seqpar.planner",
    "seqpar.placement.cost",
    "seqpar.training",
    "seqpar.sdpa",
    "seqpar.compiled",
    "seqpar.integrations",
    "seqpar.integrations.transformers",
    "seqpar.integrations.diffusers",
    "seqpar.integrations.timm",
]

# Prints, as JSON, the modules that importing argv[1] loads beyond those of `import torch`.
_NEW_MODULES = r"""
import importlib, json, sys
import torch
before = set(sys.modules)
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _forbidden(module: str) -> bool:
    """A module no library import may load: a tool, an alias of one, torch's testing or dispatch code."""
    return (
        module == "seqpar.tools" or module.startswith("seqpar.tools.")
        or any(module == old or module.startswith(old + ".") for old in ALIASES)
        or module == "torch.testing" or module.startswith("torch.testing.")
        or module == "torch.utils._python_dispatch"
    )


@pytest.mark.parametrize("module", LIBRARY)
def test_library_imports_no_tools(module):
    proc = _python("-c", _NEW_MODULES, module)
    assert proc.returncode == 0, proc.stderr
    new = json.loads(proc.stdout.splitlines()[-1])
    assert module in new, new
    assert not [m for m in new if _forbidden(m)], f"import {module} loaded {[m for m in new if _forbidden(m)]}"


@pytest.mark.parametrize("old", ALIASES)
def test_old_paths_name_the_moved_objects(old):
    alias, moved = importlib.import_module(old), importlib.import_module(ALIASES[old])
    assert alias.__doc__.startswith(f"Moved to {ALIASES[old]}; this alias is kept for existing imports."), old
    assert alias.__all__ == moved.__all__, old
    for name in moved.__all__:
        assert getattr(alias, name) is getattr(moved, name), (old, name)


def test_old_one_rank_command_line_still_runs():
    proc = _python("-m", "seqpar.one_rank", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m seqpar.tools.one_rank"), proc.stdout


def test_planner_calibrate_imports_the_tool_when_called():
    import seqpar

    with pytest.raises(ValueError, match="calibrate"):
        seqpar.planner.calibrate(object())  # not a ParallelState: refused by the tool itself


def test_scripts_edit_no_sys_path_and_import_helpers_from_tools():
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    assert scripts and not [p.name for p in scripts if p.name.startswith("_")], "helpers belong in seqpar.tools"
    for path in [*scripts, ROOT / "scripts" / "gpu_check"]:
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        assert "_bench_common" not in text and "_train_harness" not in text, path.name
