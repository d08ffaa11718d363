"""``python -m seqpar check``: every mode on local ranks, judged against one device, with a report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqpar.tools import check

ROOT = Path(__file__).resolve().parents[1]
# Tiny sizes: the check's cost on 2 loaded cores is the rank start-up and a few ms per mode.
_TINY = ("--seq-len", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--iters", "1",
         "--message-kib", "4,64", "--timeout", "120")


def _seqpar(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "seqpar", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_check_four_ranks_every_mode_exact(tmp_path):
    out = tmp_path / "check.json"
    proc = _seqpar("check", "--world-size", "4", *_TINY, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    names = [m["mode"] for m in report["modes"]]
    # Every transport, Ulysses, the hybrid factorisation, and the features on it.
    for want in ("ring p2p", "ring p2p_serial", "ring allgather", "ulysses", "hybrid 2x2", "packed 2x2",
                 "window 2x2", "sinks 2x2", "head_groups=2 2x2", "gated delta, head-parallel 2x2",
                 "gated delta, state passing 2x2", "causal conv, head-parallel 2x2", "causal conv, halo 2x2"):
        assert want in names, names
    assert report["ok"] and report["world"] == 4 and report["backend"] == "gloo"
    for m in report["modes"]:
        assert m["ok"] and m["worst"] <= 1 and m["ms"] > 0, m
        grads = {"out", "dx"} if m["kind"].startswith("conv") else {"out", "dq", "dk", "dv"}
        assert grads <= set(m["errors"]), m  # out and every gradient compared
        assert max(m["errors"].values()) < 1e-4, m  # float32 against float64
    for link in ("all_to_all", "p2p"):
        sizes = [row["bytes"] for row in report["bandwidth"][link]]
        assert sizes == [4096, 65536], report["bandwidth"]
        assert all(row["bytes_per_s"] > 0 for row in report["bandwidth"][link])
    rec = report["recommendation"]
    fastest = min((m for m in report["modes"] if m["state_mode"]), key=lambda m: m["ms"])
    assert rec["measured"]["constructor"] == fastest["state"] and rec["measured"]["constructor"].startswith(
        "ParallelState(ring_size=")
    assert rec["planner"]["constructor"].startswith("ParallelState(ring_size=")
    # The table on stdout: one line per mode, the recommendation, the verdict last before the JSON note.
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("seqpar check: 4 ranks (gloo, cpu), CP 4 (DP 1), S=48"), lines[0]
    assert sum(line.rstrip().endswith(" exact") for line in lines) == len(names)
    assert any(line.startswith("recommended: seqpar.ParallelState(") for line in lines)
    assert any(line.startswith("all-to-all over the group: ") for line in lines)
    assert lines[-2].startswith(f"check: OK -- {len(names)} of {len(names)} modes exact"), lines[-2]


@pytest.mark.slow
def test_check_three_ranks_ring_and_ulysses():
    proc = _seqpar("check", "--world-size", "3", *_TINY, "--only", "ring,ulysses")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line.split() for line in lines if line.rstrip().endswith(("exact", "FAILED"))]
    assert [r[:2] for r in rows] == [["ring", "p2p"], ["ring", "p2p_serial"], ["ring", "allgather"],
                                     ["ulysses", "1"]], lines
    assert all(r[-1] == "exact" for r in rows)
    assert lines[-1].startswith("check: OK -- 4 of 4 modes exact"), lines[-1]


@pytest.mark.slow
def test_check_rejects_bad_cp():
    proc = _seqpar("check", "--world-size", "4", "--cp", "3")
    assert proc.returncode != 0
    assert "--cp 3 must be a positive divisor of the 4 ranks" in proc.stderr


def test_wrong_output_is_not_exact():
    """The verdict on a wrong result: a non-causal output (a mask bug) against the causal reference
    is not exact, the same computation in float32 is; and the table says so."""
    mode = next(m for m in check.modes(2, 4) if m.name == "ring p2p")
    cfg = check.Config(2, 40, 4, 2, 16, "float32", "cpu", 0, 1, None, 60.0)
    ref = check._reference(mode, cfg, torch.device("cpu"))  # float64, causal
    q, k, v = (check._inputs(mode, cfg, torch.float32, torch.device("cpu"))["x"][n] for n in ("q", "k", "v"))
    right = check._reference_attention(q, k, v, causal=True)
    wrong = check._reference_attention(q, k, v, causal=False)
    ok, worst = check.judge(*check.compare({"out": right}, {"out": ref["out"]}), torch.float32)
    assert ok and worst < 0.1
    ok, worst = check.judge(*check.compare({"out": wrong}, {"out": ref["out"]}), torch.float32)
    assert not ok and worst > 100
    nan = right.clone()
    nan[0, 3, 1, 2] = float("nan")
    assert not check.judge(*check.compare({"out": nan}, {"out": ref["out"]}), torch.float32)[0]

    errors, scales = check.compare({"out": wrong}, {"out": ref["out"]})
    row = {"mode": "ring p2p", "state": mode.constructor(), "ring": 2, "ulysses": 1, "kind": "dense",
           "state_mode": True, "errors": errors, "scales": scales, "ms": 1.0}
    row["ok"], row["worst"] = check.judge(errors, scales, torch.float32)
    result = {"rows": [row], "bandwidth": {"all_to_all": [], "p2p": []}, "plan": None, "device": "cpu",
              "backend": "gloo", "world": 2}
    report = check._report(result, cfg, 1.0)
    assert not report["ok"] and report["recommendation"]["measured"] is None
    text = check.format_report(report)
    assert "NOT EXACT" in text and text.splitlines()[-1].startswith("check: FAILED -- 0 of 1 modes exact")


@pytest.mark.slow
def test_check_under_torchrun():
    """The launch a cluster uses: ``python -m torch.distributed.run ... -m seqpar check`` (gloo here),
    every rank exiting 0 and rank 0 alone printing the table."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "seqpar",
         "check", *_TINY, "--only", "ulysses,gated delta"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("seqpar check: 2 ranks (gloo, cpu), CP 2"), lines
    assert sum(line.startswith("check: OK -- 3 of 3 modes exact") for line in lines) == 1, lines
