"""scripts/bench_peers.py: runs on a tiny shape with whichever peers are installed, skips the rest
with the reason, checks every side against float64 and reports seqpar / peer ratios.

The peers are optional: here only DeepSpeed and diffusers may be installed (CI has both); a missing
one must appear under ``not_run`` with "not installed", never fail the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_peers.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_peers", module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["bench_peers"])
    return sys.modules["bench_peers"]


@pytest.mark.tools  # two pools of 2 ranks and DeepSpeed's import: ~25 s on 2 shared cores
def test_bench_peers_tiny_run_with_the_installed_peers():
    bench = _module()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--world", "2", "--cases", "u2,u2-full", "--peers", "deepspeed,diffusers",
         "--seq-len", "64", "--heads", "2", "--kv-heads", "2", "--head-dim", "8", "--rounds", "1",
         "--check-seq-len", "16", "--even-check-only"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    by_case = {e["case"]: e for e in report["results"]}
    assert set(by_case) == {"u2", "u2-full"}
    installed = {p for p in ("deepspeed", "diffusers") if bench.missing_reason(p) is None}
    not_run = {(s["case"], s["peer"]): s["reason"] for s in report["not_run"]}
    for case, peer in (("u2", "deepspeed"), ("u2-full", "diffusers")):
        entry = by_case[case]
        assert list(entry["exactness"]) == ["even"]  # --even-check-only
        for shape, verdicts in entry["exactness"].items():
            assert verdicts["seqpar"]["verdict"] == "ok", (case, shape, verdicts["seqpar"])
            assert verdicts["seqpar"]["max_abs_err"] < 1e-4
            assert verdicts["seqpar"]["tokens_held"] == verdicts["shape"]["seq_len"]  # one CP group of 2 ranks
        if peer in installed:
            assert entry["exactness"]["even"][peer]["verdict"] == "ok", entry["exactness"]["even"][peer]
            side = entry["sides"][peer]
            assert side["time_seqpar_over_peer"] > 0 and side["memory_seqpar_over_peer"] > 0
            assert entry["sides"]["seqpar"]["peak_bytes_max_rank"] > 0
            # every odd shape has a verdict: exact, WRONG, or refused with its reason
            for verdicts in entry["exactness"].values():
                v = verdicts[peer]
                assert v["verdict"] in ("ok", "WRONG", "refused", "crashed")
                assert v["verdict"] in ("ok", "WRONG") or v["reason"]
        else:
            assert "not installed" in not_run[(case, peer)]
            assert peer not in entry["exactness"]["even"] and entry["sides"] == {}
    # yunchang / ring-flash-attn / torch-cp were not asked for: neither run nor listed.
    assert all(s["peer"] in ("deepspeed", "diffusers") for s in report["not_run"])


def test_verdicts_name_refusals_and_wrong_numbers():
    bench = _module()
    ok = [{"p": {"err": 1e-7, "tokens": 8}}, {"p": {"err": 2e-7, "tokens": 8}}]
    assert bench.combine_check(ok, "p", 1e-4) == {"verdict": "ok", "max_abs_err": 2e-7, "tokens_held": 16}
    wrong = [{"p": {"err": 1e-7, "tokens": 8}}, {"p": {"err": 0.3, "tokens": 8}}]
    assert bench.combine_check(wrong, "p", 1e-4)["verdict"] == "WRONG"
    # the rank that refused on its own is the reason, not its peer's timeout
    refused = [{"p": {"error": "RuntimeError: Timed out waiting 30000ms"}},
               {"p": {"error": "AssertionError: Number of heads (5) must be divisible by 2"}}]
    assert bench.combine_check(refused, "p", 1e-4) == {
        "verdict": "refused", "reason": "AssertionError: Number of heads (5) must be divisible by 2"}


def test_missing_peer_is_named_with_its_install_command():
    bench = _module()
    assert bench.missing_reason("torch-cp") is None  # part of torch
    reason = bench.missing_reason("ring-flash-attn")
    assert reason is None or reason.startswith("not installed (pip install")
