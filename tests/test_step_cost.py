"""``seqpar.tools.longest.build_stack`` (the stack both benchmarks step) and the command line of
``scripts/bench_step_cost.py`` (its full run is the GPU check's ``step_cost`` step, run on the CPU
by ``tests/test_one_rank.py::test_gpu_check_cpu_smoke``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqpar.tools.longest import StackConfig, build_stack
from seqpar.tools.one_rank import fake_world

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=50, dtype="float32")


def test_build_stack_steps_and_accumulates():
    # One rank of one: over the fake process group a ring's received blocks are whatever its
    # buffers held, so only a world of one steps deterministically.
    config = StackConfig(ring=1, ulysses=1, mlp_chunks=3, train_embeddings=True, **TINY)
    with fake_world(1, 0, torch.device("cpu")):
        run = build_stack(config, 21)
        try:
            assert (run.local_tokens, run.seq_len) == (21, 21)
            params = run.parameters()
            assert all(p.grad is not None and not p.grad.any() for p in params)  # allocated before any step
            assert run.before_bytes == 2 * run.param_bytes + 2 * 21 * 8
            run.step()
            first = [p.grad.clone() for p in params]
            run.step()  # the same inputs again: every gradient doubles
            for p, g in zip(params, first):
                torch.testing.assert_close(p.grad, 2 * g)
            assert all(g.any() for g in first)
        finally:
            run.close()
    with fake_world(4, 1, torch.device("cpu")):
        run = build_stack(StackConfig(ring=2, ulysses=2, cp_rank=1, ring_comm="p2p_serial", **TINY), 21)
        assert run._state.ring_comm == "p2p_serial"
        run.close()
        assert (run.local_tokens, run.seq_len) == (21, 84)  # S = 84: rank 1 holds 21
    with pytest.raises(ValueError, match="local_tokens must be a positive int, got 0"):
        build_stack(config, 0)
    with pytest.raises(ValueError, match="ring_comm='allgather'; valid: 'p2p', 'p2p_serial'"):
        StackConfig(ring_comm="allgather", **TINY)


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "scripts/bench_step_cost.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.tools
@pytest.mark.parametrize("args, words", [
    (["--offload", "on"], "on the CPU the host is the device"),
    (["--mlp-chunks", "0,8"], "--mlp-chunks needs positive integers"),
    (["--rounds", "0"], "--rounds and --tokens must be positive, got 0 and 4096"),
])
def test_bench_step_cost_refuses_bad_options(args, words):
    done = _script(*args)
    assert done.returncode == 2 and words in done.stderr, done.stderr[-2000:]
