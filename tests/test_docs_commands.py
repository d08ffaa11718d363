"""The shell commands of README.md and docs/*.md: the cheap ones run as written, the rest are named.

Every command line of a ```bash / ```sh / ```shell block (comments stripped, ``\\`` continuations
joined) must be in :data:`RUN` -- run here exactly as written, from a scratch folder that sees the
repository's ``scripts/`` -- or in :data:`NOT_RUN` with the reason it is not (eight ranks, a GPU, an
install that would change this environment, minutes of CPU). A new command in the docs fails
:func:`test_every_command_is_run_or_named` until it is put in one of the two, so nothing the docs
tell a newcomer to type is left unchecked by accident.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_FENCE = re.compile(r"^```(bash|sh|shell)\s*$")

# Commands run as written (cheap on 2 CPU cores), in the order a reader meets them; a command that
# needs an earlier one's output follows it.
RUN = [
    "python -m seqpar info",
    "python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/train_lm.py --ring 2 --ulysses 1 --steps 2",
    "python scripts/example_pipeline.py --model wan2.2 --world 3 --ring 3",
    "python scripts/calibrate.py --local 4 --out cost.json",
    "python -m seqpar info --cost cost.json --cp-size 16 --seq-len 262144 --heads 32 --kv-heads 8",
    "python -m seqpar check --world-size 4",
]

# Commands not run here, each with the reason.
_INSTALL = "installs packages: CI's .ci/run installs from the project's files instead"
_GPU = "needs a GPU (the device check, scripts/gpu_check)"
_EIGHT = "needs 8 ranks (minutes on 2 CPU cores); its script's --help runs in tests/test_scripts_help.py"
NOT_RUN = {
    'python -c "import torch" 2>/dev/null || pip install torch==2.13.0': _INSTALL,
    'pip install -e ".[dev]"': _INSTALL,
    "pip install -e .": _INSTALL,
    'pip install -e ".[hf]"': _INSTALL,
    'pip install -e ".[diffusers]"': _INSTALL,
    'pip install -e ".[train]"': _INSTALL,
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": _INSTALL,
    "pip install --no-deps timm==1.0.31": _INSTALL,
    "pip install flash-attn --no-build-isolation": _INSTALL + "; needs nvcc and a CUDA torch",
    "MAX_JOBS=4 pip install flash-attn --no-build-isolation": _INSTALL + "; needs nvcc and a CUDA torch",
    "python -m seqpar demo": "the default demo runs in tests/test_demo.py::test_demo_default_passes",
    'python -m pytest -q -m "not slow and not tools"': "the test suite itself",
    "python -m pytest -q": "the test suite itself",
    "python -m seqpar demo --ring 2 --ulysses 2 --seq-len 8191 --causal": "minutes on 2 CPU cores; the "
    "demo's options run at small sizes in tests/test_demo.py",
    "python -m torch.distributed.run --nproc-per-node 8 scripts/calibrate.py --out cost.json": _EIGHT,
    "python -m seqpar info --cost cost.json --cp-size 8 --seq-len 131072": "reads the cost.json of the 8-rank "
    "calibration above; the same command with the local calibration's cost.json runs",
    "python -m torch.distributed.run --nproc-per-node 8 scripts/bench_attention.py": _EIGHT,
    "python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 ... scripts/calibrate.py --out cost.json":
        "two nodes (the '...' stands for the rendezvous arguments of a cluster)",
    "python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 ... -m seqpar check --json check.json":
        "two nodes (the '...' stands for the rendezvous arguments of a cluster); the same check on local ranks "
        "runs, and under torchrun in tests/test_check_command.py",
    "bash scripts/gpu_check --out gpu_check_out": _GPU,
    "bash scripts/gpu_check --quick --budget 7 --python python3 --out /tmp/gc": _GPU,
    "bash scripts/gpu_check --cpu-smoke --out /tmp/smoke": "runs in tests/test_one_rank.py::test_gpu_check_cpu_smoke",
    "python -m torch.distributed.run --standalone --nproc_per_node 4 scripts/train_lm.py --ring 2 --ulysses 2 "
    "--seq-len 1023 --steps 40 --check --plot lm_loss.png": "40 steps on 4 ranks (minutes); --check runs at small "
    "sizes in tests/test_training.py::test_train_lm_check",
    "python -m torch.distributed.run --standalone --nproc_per_node 4 scripts/train_dit.py --ring 2 --ulysses 1 "
    "--steps 30 --check --plot dit_loss.png": "30 steps on 4 ranks (minutes); --check runs at small sizes in "
    "tests/test_training.py::test_train_dit_check_with_data_parallel",
}


def _commands() -> list[tuple[str, str]]:
    """``(page:line, command)`` of every command line in the shell blocks."""
    out = []
    for path in PAGES:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if _FENCE.match(lines[i].strip()):
                j, pending, start = i + 1, "", 0
                while lines[j].strip() != "```":
                    text = lines[j].split(" #")[0].rstrip() if not lines[j].lstrip().startswith("#") else ""
                    if text:
                        if not pending:
                            start = j + 1
                        if text.endswith("\\"):
                            pending += text[:-1].strip() + " "
                        else:
                            out.append((f"{path.relative_to(ROOT)}:{start}", (pending + text.strip()).strip()))
                            pending = ""
                    j += 1
                i = j
            i += 1
    return out


def test_every_command_is_run_or_named():
    found = _commands()
    assert found, "no shell commands found in the docs"
    unnamed = [(where, cmd) for where, cmd in found if cmd not in RUN and cmd not in NOT_RUN]
    assert not unnamed, f"add these to RUN or NOT_RUN in {Path(__file__).name}: {unnamed}"
    stale = [cmd for cmd in [*RUN, *NOT_RUN] if cmd not in {c for _, c in found}]
    assert not stale, f"no longer in the docs: {stale}"


@pytest.mark.tools
def test_cheap_commands_run_as_written(tmp_path):
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for cmd in RUN:
        argv = shlex.split(cmd)
        if argv[0] == "python":
            argv[0] = sys.executable
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{cmd!r} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_multi_rank_commands_use_this_python_launcher():
    """Every launch in the docs is ``python -m torch.distributed.run``, never a bare ``torchrun``
    (which can resolve to another interpreter's seqpar; getting-started.md says why), in shell
    blocks and in code spans alike; the prose that explains the reason names ``torchrun`` alone."""
    bare = [(where, cmd) for where, cmd in _commands() if shlex.split(cmd)[0] == "torchrun"]
    assert not bare, bare
    spans = [(path.name, span) for path in PAGES for span in re.findall(r"`(torchrun [^`]*)`", path.read_text())]
    assert not spans, spans
