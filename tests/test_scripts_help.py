"""The scripts' command lines: readable ``--help`` and the benchmarks' ``--plot``.

Every ``scripts/bench_*.py``, ``train_*.py``, ``example_*.py`` and ``calibrate.py`` (and
``python -m seqpar demo``) answers ``--help`` with exit status 0, without reStructuredText markup
from its docstring (double backticks), and states the default of every option that has one. The
two quickest benchmarks run with ``--plot`` and write a PNG, the JSON report still on the last
line of their output.

Each script's ``--help`` runs in this interpreter, as ``__main__`` with ``scripts/`` first on
``sys.path`` (what ``python scripts/x.py --help`` does, less a fresh interpreter's torch import:
~2 s of CPU per script), through a probe that records the parsers the script builds, so that the
test knows which options have a default. One script's ``--help`` also runs in its own interpreter
and must print the same text.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import runpy
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
NAMES = sorted(
    p.name
    for p in SCRIPTS.glob("*.py")
    if p.name.startswith(("bench_", "train_", "example_")) or p.name == "calibrate.py"
)

def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


class _Help:
    """What one ``--help`` run printed, its exit code, the optional package it found missing (if
    any), and the options with a default of every parser the script built."""

    def __init__(self, name: str) -> None:
        parsers: list[argparse.ArgumentParser] = []
        parse_args = argparse.ArgumentParser.parse_args

        def recording(parser, *args, **kwargs):
            parsers.append(parser)
            return parse_args(parser, *args, **kwargs)

        out, err = io.StringIO(), io.StringIO()
        self.code, self.missing = None, None
        argv, path = sys.argv, sys.path[:]
        sys.argv = [str(SCRIPTS / name), "--help"]
        sys.path.insert(0, str(SCRIPTS))
        try:
            # COLUMNS: the width a child process with piped output gets, whatever the terminal.
            with mock.patch.object(argparse.ArgumentParser, "parse_args", recording), \
                    mock.patch.dict(os.environ, {"COLUMNS": "80"}), redirect_stdout(out), redirect_stderr(err):
                runpy.run_path(str(SCRIPTS / name), run_name="__main__")
        except SystemExit as e:
            self.code = e.code
        except ModuleNotFoundError as e:
            self.missing = e.name
        finally:
            sys.argv, sys.path[:] = argv, path
        self.stdout, self.stderr = out.getvalue(), err.getvalue()
        flag = lambda a: a.nargs == 0 and not isinstance(a, argparse.BooleanOptionalAction)
        self.defaults = [a.option_strings for p in parsers for a in p._actions
                         if a.option_strings and a.default not in (None, argparse.SUPPRESS) and not flag(a)]


@cache
def _help(name: str) -> _Help:
    return _Help(name)


def _entries(help_text: str) -> dict[str, str]:
    """``--help``'s option entries: first option string -> the entry's text (all its lines)."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        m = re.match(r"  (-{1,2}[\w-]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def _missing_default(help_text: str, options: list[list[str]]) -> list[str]:
    """The options (of those given) whose help entry does not mention a default."""
    entries = _entries(help_text)
    missing = []
    for strings in options:
        entry = next((entries[s] for s in strings if s in entries), "")
        if "default" not in entry.lower():
            missing.append(strings[-1])
    return missing


@pytest.mark.tools
@pytest.mark.parametrize("name", NAMES)
def test_help_is_readable_and_shows_defaults(name):
    h = _help(name)
    if h.missing and not h.missing.startswith("seqpar"):
        pytest.skip(f"{name} --help needs the optional package {h.missing!r}, not installed here")
    assert h.code == 0 and not h.missing, (h.missing, h.stdout + h.stderr)
    assert h.stdout.startswith("usage:"), h.stdout + h.stderr
    assert "``" not in h.stdout, f"{name} --help shows reStructuredText literals:\n{h.stdout}"
    assert ":func:`" not in h.stdout and ":meth:`" not in h.stdout, h.stdout
    assert h.defaults, f"{name}: no option with a default was recorded; is the probe still working?"
    assert not _missing_default(h.stdout, h.defaults), (
        f"{name} --help does not show the default of {_missing_default(h.stdout, h.defaults)}:\n{h.stdout}"
    )


@pytest.mark.tools
def test_help_in_its_own_interpreter_prints_what_the_probe_saw():
    """``python scripts/bench_all_to_all.py --help`` from the shell: the text the in-process probe
    checks is the text a user sees."""
    proc = _run(["scripts/bench_all_to_all.py", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _help("bench_all_to_all.py").stdout


@pytest.mark.slow
def test_demo_help_is_readable_and_shows_defaults():
    proc = _run(["-m", "seqpar", "demo", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "``" not in proc.stdout, proc.stdout
    assert "hybrid attention on local ranks" in proc.stdout  # the description is there, as plain text
    valued = [[opt] for opt, entry in _entries(proc.stdout).items() if re.match(r"\s*--[\w-]+ [A-Z{]", entry)]
    assert len(valued) >= 10, proc.stdout
    assert not _missing_default(proc.stdout, valued), proc.stdout


def _check_plot(proc: subprocess.CompletedProcess, png: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert png.is_file() and png.stat().st_size > 1000, f"no chart at {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = proc.stdout.splitlines()
    assert f"wrote {png}" in lines
    json.loads(lines[-1])  # the report is still the last line


@pytest.mark.slow
def test_bench_overhead_plot(tmp_path):
    png = tmp_path / "overhead.png"
    proc = _run(["scripts/bench_overhead.py", "--seq-len", "16", "--iters", "2", "--rounds", "2", "--plot", str(png)],
                timeout=120)
    _check_plot(proc, png)
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["args"]["plot"] == str(png)
    # Three sides per round: seqpar, the bare autograd function and the direct kernel calls.
    for r in report["rounds"]:
        assert r["seqpar_s"] > 0 and r["autograd_s"] > 0 and r["kernel_s"] > 0, r
        assert r["ratio"] == pytest.approx(r["seqpar_s"] / r["kernel_s"])
        assert r["ratio_vs_autograd"] == pytest.approx(r["seqpar_s"] / r["autograd_s"])
    # stderr: which seqpar runs (this checkout's), then a line per round.
    err = proc.stderr.splitlines()
    assert any(line.startswith("bench_overhead.py: seqpar ") and f"from {ROOT / 'seqpar'} " in line for line in err), err
    assert sum("bench_overhead: round " in line for line in err) == 2, err
    # --only: calls of one side for an instruction counter, no report.
    proc = _run(["scripts/bench_overhead.py", "--seq-len", "4", "--only", "autograd", "--calls", "3"], timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout[-2000:] + proc.stderr[-2000:]


def test_plot_bars_start_at_zero_with_the_ideal_as_a_line():
    """A 1.00 ratio is a full-length bar (not a zero-length one from the reference line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from seqpar.tools.report import Panel, _draw_panel

    fig, ax = plt.subplots()
    _draw_panel(ax, ["a", "b"], Panel("x ideal (lower is better)", {"memory": [1.0, 2.5]}, reference_line=1.0))
    bars = ax.patches
    assert [b.get_x() for b in bars] == [0.0, 0.0] and [b.get_width() for b in bars] == [1.0, 2.5]
    assert [line.get_xdata()[0] for line in ax.lines] == [1.0]  # the ideal, dashed
    plt.close(fig)


def test_bench_attention_plot_has_one_quantity_per_axis():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPTS / "bench_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    problem = dict(batch=1, seq_len=64, heads=2, kv_heads=2, head_dim=8, dtype="float32", device="cpu", iters=1,
                   cpu_cores=2)
    configs = [dict(config="ring", ring=2, ulysses=1, mask="causal", speedup_vs_single=1.5, peak_vs_single=0.6),
               dict(config="ulysses", ring=1, ulysses=2, mask="causal", speedup_vs_single=1.2, peak_vs_single=0.7)]
    title, labels, panels = module._chart({"problem": problem, "configs": configs, "single_device": {}, "world": 2})
    assert labels == ["ring 2 x 1", "ulysses 1 x 2"]
    assert [list(p.series) for p in panels] == [["speedup"], ["memory"]]
    assert "higher is better" in panels[0].value_label and "lower is better" in panels[1].value_label
    assert panels[1].reference_line == 0.5


@pytest.mark.tools
def test_bench_varlen_plot(tmp_path):
    png = tmp_path / "varlen.png"
    proc = _run(
        ["scripts/bench_varlen.py", "--total", "512", "--median", "64", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "8", "--world", "2", "--configs", "2x1,1x2", "--balance-configs", "2x1,1x2",
         "--iters", "1", "--plot", str(png)],
        timeout=180,
    )
    _check_plot(proc, png)
    report = json.loads(proc.stdout.splitlines()[-1])
    assert [r["config"] for r in report["results"]] == ["2x1", "1x2"]


@pytest.mark.slow
def test_plot_without_matplotlib_fails_before_running(tmp_path):
    """``--plot`` without matplotlib stops at parse time, saying how to install it."""
    hide = (
        "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
        "sys.path.insert(0, 'scripts'); runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    png = tmp_path / "overhead.png"
    proc = _run(["-c", hide, "scripts/bench_overhead.py", "--plot", str(png)], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'pip install -e ".[train]"' in proc.stderr
    assert proc.stdout == "" and not png.exists()  # nothing was measured


def test_plain_removes_rst_markup():
    from seqpar.tools.report import plain

    assert plain("``python -m seqpar demo``: see :func:`reference_run`") == "python -m seqpar demo: see reference_run"
    assert plain("the **ideal** of *one device*, ``len**2``, 4 * D * pairs") == (
        "the ideal of one device, len**2, 4 * D * pairs"
    )
    assert plain("Examples::\n\n    python x.py\n") == "Examples:\n\n    python x.py"
