"""``python -m seqpar demo`` runs, verifies and reports."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import seqpar

ROOT = Path(__file__).resolve().parents[1]


def _seqpar(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "seqpar", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # a fresh interpreter per command: not in the quick subset
def test_help_lists_commands():
    proc = _seqpar("--help")
    assert proc.returncode == 0
    assert "demo" in proc.stdout and "info" in proc.stdout


@pytest.mark.slow
def test_demo_default_passes():
    proc = _seqpar("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("demo: OK — max |out err|"), proc.stdout
    assert "ring 2 x ulysses 2" in lines[0] and "S=3001" in lines[0]
    assert sum(line.strip().split()[0] in "0123" for line in lines if line[:4].strip().isdigit()) == 4
    # Every figure is explained where it is printed: x ideal, and why uneven heads cost more.
    assert any(line.startswith("x ideal: this rank's memory x 4 / one device's") for line in lines), proc.stdout
    assert any(line.startswith("uneven heads: H=9 query heads over ulysses 2 are split [5, 4]") for line in lines)
    # Progress and which seqpar ran go to stderr, stdout keeps the report.
    err = proc.stderr.splitlines()
    assert err[0].startswith(f"seqpar demo: seqpar {seqpar.__version__} from {Path(seqpar.__file__).parent}"), err
    assert any("starting 4 rank processes" in line for line in err) and any("ranks done in" in line for line in err)


@pytest.mark.slow  # a fresh interpreter per command: not in the quick subset
def test_demo_rejects_bad_degrees():
    proc = _seqpar("demo", "--ring", "3", "--ulysses", "1")
    assert proc.returncode != 0
    assert "must divide --world-size 4" in proc.stderr


@pytest.mark.slow
def test_demo_causal_ring_only_bf16_json_report():
    import json

    proc = _seqpar("demo", "--ring", "4", "--ulysses", "1", "--seq-len", "777", "--heads", "5", "--kv-heads", "1",
                   "--causal", "--dtype", "bfloat16", "--iters", "2", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and len(report["ranks"]) == 4
    config = report["config"]
    assert (config["ring"], config["ulysses"], config["causal"], config["dtype"]) == (4, 1, True, "bfloat16"), config
    for r in report["ranks"]:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["peak_bytes"] > 0 and r["memory_vs_ideal"] > 0
    assert report["single_device"]["peak_bytes"] > 0 and report["fwd_vs_single"] > 0
    assert "4 ranks up" in proc.stderr and "demo: OK" not in proc.stdout  # progress on stderr, JSON intact
