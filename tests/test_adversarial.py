"""Regression tests for the paths an adversarial sweep found silent, stuck or leaky.

Each finding is either exact or a clear error on every rank. Multi-rank cases run under a
collective timeout, so a hang fails the test instead of stalling the suite. Findings tested
elsewhere: ``parallel_sdpa``'s reach (nn.MultiheadAttention, fast paths, reentrant checkpoint,
threads, exit order, cross-attention) in ``tests/test_sdpa.py``; transformers positions and
one-rank refusals in ``tests/test_transformers.py``; ``seq_lens`` that differ between ranks in
``tests/test_robustness.py::test_mismatches_raise_on_every_rank``.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import seqpar
from seqpar import ParallelState
from seqpar.backends.reference import reference_attention
from seqpar.comm import group_timeout
from seqpar.tools.testing import DistPool
from seqpar.training import sharded_cross_entropy

pytestmark = pytest.mark.slow  # long multi-rank runs: not in the quick subset

DOUBLE_BACKWARD = "does not support double backward"


# ---------------------------------------------------------------------------------------------
# 1. Double backward: the same clear error with ring, Ulysses, both, packed and joint tokens


def _double_backward(R: int, U: int) -> dict[str, str]:
    state = ParallelState(R, U)
    g = torch.Generator().manual_seed(1)
    S, T = 23, 3
    q, k, v = (torch.randn(1, S, h, 8, generator=g, dtype=torch.float64) for h in (6, 3, 3))
    text = [torch.randn(1, T, h, 8, generator=g, dtype=torch.float64) for h in (6, 3, 3)]
    calls = {
        "dense": lambda a, b, c: seqpar.attention(a, b, c, state, causal=True, seq_len=S),
        "window": lambda a, b, c: seqpar.attention(a, b, c, state, window=(4, 4), seq_len=S),
        "packed": lambda a, b, c: seqpar.varlen_attention(a[0], b[0], c[0], state, [9, 14], causal=True),
        "joint": lambda a, b, c: seqpar.attention(a, b, c, state, replicated_prefix=T),
    }
    out = {}
    for name, call in calls.items():
        if name == "packed":
            leaves = [seqpar.shard_packed(t[0], state, [9, 14])[None] for t in (q, k, v)]
        elif name == "joint":
            leaves = [torch.cat([x, seqpar.shard(t, state)], 1) for x, t in zip(text, (q, k, v))]
        else:
            leaves = [seqpar.shard(t, state) for t in (q, k, v)]
        leaves = [t.requires_grad_() for t in leaves]
        o = call(*leaves)
        try:
            grads = torch.autograd.grad(o.square().sum(), leaves, create_graph=True)
            out[name] = f"no error (grads require grad: {[x.requires_grad for x in grads]})"
        except RuntimeError as e:
            out[name] = str(e)
        # First-order gradients still work afterwards: the refusal left the group consistent.
        torch.autograd.grad(call(*leaves).sum(), leaves)
    state.close()
    return out


@pytest.mark.parametrize("R,U", [(4, 1), (1, 4), (2, 2)])
def test_double_backward_refused_on_every_rank(pools, R, U):
    for rank, results in enumerate(pools(4).run(_double_backward, R, U)):
        for name, msg in results.items():
            assert DOUBLE_BACKWARD in msg, (rank, name, msg)


def test_double_backward_refused_on_one_process():
    results = _double_backward(1, 1)
    for name, msg in results.items():
        assert DOUBLE_BACKWARD in msg, (name, msg)


# ---------------------------------------------------------------------------------------------
# 6. Subgroups honour the user's timeout


def _timeouts() -> dict:
    inherited = ParallelState(2, 2)
    explicit = ParallelState(2, 2, timeout=timedelta(seconds=3))
    out = {
        "inherited": [group_timeout(g) for g in (inherited.cp_group, inherited.ring_group, inherited.ulysses_group)],
        "explicit": [group_timeout(g) for g in (explicit.cp_group, explicit.ring_group, explicit.ulysses_group)],
    }
    inherited.close()
    # Ring rank 0 waits for a partner that never comes: the state's 3 s, not torch's 30 minutes.
    if explicit.ring_rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=explicit.ring_group)
            out["waited"] = None
        except RuntimeError:
            out["waited"] = time.monotonic() - start
    # The partners keep their groups alive until rank 0 gave up (the pool destroys a function's
    # groups when it returns, which would end rank 0's wait at once).
    dist.barrier()
    return out


def test_subgroups_take_the_parent_timeout():
    with DistPool(4, timeout_s=7) as pool:
        results = pool.run(_timeouts)
    for rank, r in enumerate(results):
        assert r["inherited"] == [timedelta(seconds=7)] * 3, (rank, r)
        assert r["explicit"] == [timedelta(seconds=3)] * 3, (rank, r)
        if "waited" in r:
            assert r["waited"] is not None and 2.5 <= r["waited"] < 30, (rank, r)


# ---------------------------------------------------------------------------------------------
# 7. close() frees what a ParallelState takes


def _resources() -> tuple[int, int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), threading.active_count()


def _many_states(n: int) -> dict:
    q = seqpar.shard(torch.randn(1, 19, 4, 8, generator=torch.Generator().manual_seed(0)), ParallelState(1, 1))
    for _ in range(3):  # warm-up: torch's own lazily created threads and files
        with ParallelState(2, 2) as s:
            seqpar.attention(seqpar.shard(q, s), seqpar.shard(q, s), seqpar.shard(q, s), s, causal=True)
    before = _resources()
    kept = [ParallelState(2, 2) for _ in range(3)]  # the measure sees unclosed states
    leaked = _resources()
    for s in kept:
        s.close()
    for _ in range(n):
        with ParallelState(2, 2) as s:
            x = seqpar.shard(q, s)
            seqpar.attention(x, x, x, s, causal=True)
    after = _resources()
    closed = ParallelState(2, 2)
    closed.close()
    try:
        seqpar.attention(x, x, x, closed)
        use_after_close = None
    except ValueError as e:
        use_after_close = str(e)
    return {"before": before, "leaked": leaked, "after": after, "use_after_close": use_after_close}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc")
def test_closed_states_do_not_grow_fds_or_threads(pools):
    results = pools(4).run(_many_states, 40)  # counts before and after, within the one call
    for rank, r in enumerate(results):
        (fd0, task0, py0), (fd1, task1, _), (fd2, task2, py2) = r["before"], r["leaked"], r["after"]
        assert fd1 > fd0 and task1 > task0, (rank, r)  # three open states do show up
        assert fd2 <= fd0 + 2 and task2 <= task0 + 2 and py2 <= py0, (rank, r)
        assert "was closed" in r["use_after_close"], (rank, r)


# ---------------------------------------------------------------------------------------------
# 8. softmax_scale <= 0


def _non_positive_scale(R: int, U: int) -> list[float]:
    state = ParallelState(R, U)
    g = torch.Generator().manual_seed(5)
    S = 29
    q, k, v = (torch.randn(2, S, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(2, S, 4, 8, generator=g, dtype=torch.float64)
    errors = []
    for scale in (-0.4, 0.0):
        for options in (dict(causal=True), dict(window=(5, 0)), dict(window=(3, 6))):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            want = reference_attention(*leaves, scale=scale, **options)
            want_grads = torch.autograd.grad(want, leaves, dout)
            for dtype in (torch.float64, torch.float32):
                local = [seqpar.shard(t.to(dtype), state).requires_grad_() for t in (q, k, v)]
                out = seqpar.attention(*local, state, softmax_scale=scale, seq_len=S, **options)
                grads = torch.autograd.grad(out, local, seqpar.shard(dout, state).to(dtype))
                pairs = [(out, seqpar.shard(want, state))] + [
                    (a, seqpar.shard(b, state)) for a, b in zip(grads, want_grads)
                ]
                errors.append(max((a.double() - b).abs().max().item() for a, b in pairs))
    state.close()
    return errors


@pytest.mark.parametrize("R,U", [(1, 1), (3, 1), (1, 3)])
def test_non_positive_scale_is_exact(pools, R, U):
    per_rank = [_non_positive_scale(1, 1)] if R * U == 1 else pools(3).run(_non_positive_scale, R, U)
    for rank, errors in enumerate(per_rank):
        assert all(e < 1e-4 for e in errors), (rank, errors)  # NaN fails too


# ---------------------------------------------------------------------------------------------
# 10. Messages that used to mislead; one rank's bad labels


def _messages() -> dict:
    out = {}
    s = ParallelState(np.int64(2), np.int64(2))
    out["numpy"] = (s.ring_size, s.ulysses_size, type(s.ring_size).__name__)
    s.close()
    outside = dist.new_group([0, 1])
    try:
        ParallelState(2, 1, group=outside)
        out["outside"] = None
    except ValueError as e:
        out["outside"] = str(e)
    # In-place on the Ulysses output: fine without grad; with grad, autograd's usual error
    # (the output is saved for backward, as with torch's own SDPA), not a view error.
    state = ParallelState(1, 4)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 22, 6, 8, generator=g, dtype=torch.float64)
    x = seqpar.shard(q, state)
    with torch.no_grad():
        o = seqpar.attention(x, x, x, state, causal=True)
        o.mul_(2)
    out["inplace_err"] = (o - 2 * seqpar.shard(reference_attention(q, q, q, causal=True), state)).abs().max().item()
    leaf = x.clone().requires_grad_()
    o = seqpar.attention(leaf, leaf, leaf, state, causal=True)
    o.mul_(2)
    try:
        o.sum().backward()
        out["inplace_grad"] = None
    except RuntimeError as e:
        out["inplace_grad"] = str(e)
    state.close()
    return out


def test_messages(pools):
    for rank, r in enumerate(pools(4).run(_messages)):
        assert r["numpy"] == (2, 2, "int"), (rank, r)
        if rank >= 2:
            assert "not a member of the group it was given" in r["outside"], (rank, r)
        assert r["inplace_err"] < 1e-12, (rank, r)
        assert "modified by an inplace operation" in r["inplace_grad"], (rank, r)
        assert "is a view" not in r["inplace_grad"], (rank, r)


def _early_state(rank: int, world: int, store: str, results: str) -> None:
    state = ParallelState()  # before init_process_group: a one-process state without groups
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    x = torch.randn(1, 10, 2, 8)
    msgs = []
    for call in (lambda: seqpar.attention(x, x, x, state), lambda: seqpar.unshard(x, state),
                 lambda: seqpar.varlen_attention(x[0], x[0], x[0], state, [10])):
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    with open(f"{results}.{rank}", "w") as f:
        f.write("\n".join(msgs))
    dist.destroy_process_group()


def test_state_built_before_init_process_group(tmp_path):
    mp.spawn(_early_state, args=(2, str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        msgs = (tmp_path / f"out.{rank}").read_text().split("\n")
        assert len(msgs) == 3 and all("built before torch.distributed was initialised" in m for m in msgs), msgs


def _bad_labels(bad: int) -> list[str]:
    state = ParallelState(3, 1)
    logits = torch.randn(2, 7, 11)
    labels = torch.randint(0, 11, (2, 6 if state.cp_rank == bad else 7))
    try:
        sharded_cross_entropy(logits, labels, state)
        return ["no error"]
    except ValueError as e:
        msgs = [str(e)]
    # The group is still usable: a good call right after agrees on every rank.
    good = sharded_cross_entropy(logits, torch.randint(0, 11, (2, 7)), state)
    msgs.append(f"{good.item():.3f}" if torch.isfinite(good) else "bad")
    state.close()
    return msgs


def test_bad_labels_on_one_rank_raise_on_every_rank(pools):
    for rank, msgs in enumerate(pools(3).run(_bad_labels, 1)):
        assert len(msgs) == 2, (rank, msgs)
        want = "must be labels" if rank == 1 else "cp rank 1 refused"
        assert want in msgs[0], (rank, msgs)


def _live_groups(leave_a_state: bool) -> int:
    from seqpar.tools.testing import _groups

    n = len(_groups())
    if leave_a_state:
        ParallelState(2, 2)  # dropped without close(): its groups stay alive until the pool cleans up
        # Every rank's groups connected before any rank's pool destroys its own: a rank that
        # leaves first closes sockets a slower rank's gloo may still be connecting (seen once in
        # a full run: "Connection closed by peer" in connectFullMesh).
        dist.barrier()
    return n


def test_pool_destroys_the_groups_a_function_left(pools):
    """Leaked gloo groups each keep a polling thread (docs/troubleshooting.md, "Slow"): the pool
    must not let one test's unclosed state slow down every later one."""
    pool = pools(4)
    before = pool.run(_live_groups, True)
    after = pool.run(_live_groups, False)
    assert after == before, (before, after)
