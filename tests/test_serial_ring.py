"""The serial ring (``ParallelState(..., ring_comm="p2p_serial")``, Note [Serial ring]).

Attention is float64 against ``seqpar.backends.reference_attention``, forward and backward, on
ring and hybrid splits of worlds 2-4 -- the matrices of ``tests/test_mla.py`` (every mask, odd
lengths, heads that do not divide ``U``, GQA, ``Dv != D``, packed sequences) on serial states --
plus bitwise agreement with the overlapped ring, the schedule (the peak it holds: tests/test_ring.py),
``torch.compile`` and the planner's estimate. A mix of transports across ranks is refused
(``tests/test_mask_slices.py``).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from _common import quick_up_to
import seqpar
from seqpar import ParallelState
from seqpar.backends import get_backend, reference_attention
from seqpar.placement import Mask, Placement, ring_plan
from test_mla import _dense_case, _dense_cases, _packed_case, _packed_cases, _rel_err

TOL = 1e-10
# The splits with a ring (U-only states have no ring: the transport changes nothing there).
_RING_WORLDS = {2: [(2, 1)], 3: [(3, 1)], 4: [(4, 1), (2, 2)]}


def test_option_is_named_in_the_state_and_its_errors():
    state = ParallelState(ring_comm="p2p_serial")
    assert state.ring_comm == "p2p_serial" and "ring_comm 'p2p_serial'" in repr(state)
    with pytest.raises(ValueError, match=r"\['p2p', 'p2p_serial', 'allgather'\], got 'serial'"):
        ParallelState(ring_comm="serial")


# ---------------------------------------------------------------------------------------------
# Attention over ring and hybrid splits: the MLA matrices on serial states


def _rank_cases(kind: str, cases: list[dict]) -> list[tuple[str, float]]:
    states: dict[tuple[int, int], ParallelState] = {}
    run = _dense_case if kind == "dense" else _packed_case
    results = [run(states.setdefault(c["RU"], ParallelState(*c["RU"], ring_comm="p2p_serial")), c) for c in cases]
    for state in states.values():
        state.close()
    return results


@pytest.mark.parametrize("world", quick_up_to(3, sorted(_RING_WORLDS)))
@pytest.mark.parametrize("kind", ["dense", "packed"])
def test_serial_ring_matches_the_reference(pools, world, kind):
    cases = (_dense_cases if kind == "dense" else _packed_cases)(_RING_WORLDS[world])
    for rank, results in enumerate(pools(world).run(_rank_cases, kind, cases)):
        assert len(results) == len(cases)
        for name, err in results:
            assert err <= TOL, f"rank {rank}: p2p_serial {name}: error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# Agreement with the overlapped ring, bit for bit: the same kernels, summed in the same order


def _rank_agreement(S: int, window: tuple[int, int], ulysses: int) -> float:
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(S)
    q, k, v, dout = (torch.randn(2, S, h, 8, generator=gen, dtype=torch.float32) for h in (6, 2, 2, 6))
    values = {}
    # The serial ring also with a kept arena, whose one slot per role every step reuses.
    for comm, keep in (("p2p", False), ("p2p_serial", False), ("p2p_serial", True)):
        state = ParallelState(world // ulysses, ulysses, ring_comm=comm)
        if keep:
            state.workspace = seqpar.comm.Workspace(keep=True)
        mine = [seqpar.shard(t, state).requires_grad_() for t in (q, k, v)]
        for _ in range(2 if keep else 1):  # the second call on buffers the first left behind
            out = seqpar.attention(*mine, state, causal=True, window=window, seq_len=S, backend="cpu")
            values[comm, keep] = [out.detach(), *torch.autograd.grad(out, mine, seqpar.shard(dout, state))]
        state.close()
    base = values["p2p", False]
    return max((a - b).abs().max().item() for other in list(values.values())[1:] for a, b in zip(base, other))


@pytest.mark.parametrize("world,ulysses", [(3, 1), (4, 2)])
def test_same_results_as_the_overlapped_ring(pools, world, ulysses):
    for S, window in [(61, (-1, -1)), (50, (6, 0))]:
        for rank, diff in enumerate(pools(world).run(_rank_agreement, S, window, ulysses)):
            assert diff == 0.0, (rank, S, window, diff)


# ---------------------------------------------------------------------------------------------
# The schedule and the buffers alive at each kernel


def _rank_schedule(S: int, mask: Mask, packed: bool) -> dict:
    """Forward and backward of the serial ring driver with a trace and a spy on its transfer
    buffers: which are alive whenever a kernel runs."""
    from seqpar.parallel.ring import RingSetup, ring_backward, ring_forward

    state = ParallelState(dist.get_world_size())
    R, r = state.ring_size, state.ring_rank
    gen = torch.Generator().manual_seed(3)
    lens = (S // 3, S - S // 3) if packed else (S,)
    q, k, v, dout = (torch.randn(1, S, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if packed:
        from seqpar.backends import reference_varlen_attention
        ref = reference_varlen_attention(*(t[0] for t in leaves), list(lens), causal=mask.causal, window=mask.window)[None]
        placement = Placement.packed(lens, R, 1)
    else:
        ref = reference_attention(*leaves, causal=mask.causal, window=mask.window)
        placement = Placement.dense(S, R, 1)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    plan = ring_plan(placement, r, mask.normalised(max(lens)), varlen=packed)
    trace: list = []
    run = RingSetup(state.ring_group, plan, get_backend("cpu", "cpu", torch.float64), 8**-0.5, 0.0,
                    trace=trace, overlap=False)
    mine = lambda t: seqpar.shard_packed(t[0], state, list(lens))[None] if packed else seqpar.shard(t, state)

    local = [mine(t) for t in (q, k, v)]
    out, lse = ring_forward(*local, None, None, run)
    n_fwd = len(trace)
    grads = ring_backward(mine(dout), local[0], [local[1], local[2]], None, None, out, lse, run)[:3]
    errs = [_rel_err(out, mine(ref))] + [_rel_err(g, mine(x)) for g, x in zip(grads, ref_grads)]
    state.close()
    return dict(fwd=trace[:n_fwd], bwd=trace[n_fwd:], err=max(errs))


@pytest.mark.parametrize("world", [2, 3])
def test_each_step_waits_for_its_transfers(pools, world):
    for S, mask, packed in [(37, Mask(True), False), (40, Mask(True, (4, 0)), False), (29, Mask(False), True)]:
        for rank, res in enumerate(pools(world).run(_rank_schedule, S, mask, packed)):
            assert res["err"] <= TOL, (rank, S, res["err"])
            fwd, bwd = res["fwd"], res["bwd"]
            # Forward: step i's K/V are posted and have arrived before its kernels, and only after
            # step i - 1's kernels. A step the plan leaves empty moves nothing but keeps its place.
            assert fwd[0] == ("compute", 0), fwd
            for i in range(1, world):
                assert fwd.index(("compute", i - 1)) < fwd.index(("post", i)) < fwd.index(("wait", i)), fwd
                assert fwd.index(("wait", i)) < fwd.index(("compute", i)), fwd
            # Backward: besides, step i's gradients are home before step i + 1's K/V are posted.
            for i in range(1, world):
                assert bwd.index(("wait", i)) < bwd.index(("compute", i)) < bwd.index(("post_grad", i)), bwd
                assert bwd.index(("post_grad", i)) < bwd.index(("wait_grad", i)), bwd
                if i + 1 < world:
                    assert bwd.index(("wait_grad", i)) < bwd.index(("post", i + 1)), bwd
            # What each kernel has beside it (one step's K/V, no dK/dV in flight) is the peak
            # the planner predicts: tests/test_ring.py::test_ring_peak_is_the_planners_prediction.


# ---------------------------------------------------------------------------------------------
# torch.compile


def _rank_compiled() -> float:
    state = ParallelState(dist.get_world_size(), ring_comm="p2p_serial")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 29, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference_attention(*leaves, causal=True).square().sum(), leaves)
    mine = [seqpar.shard(t, state).requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    f = torch.compile(lambda *t: seqpar.attention(*t, state, causal=True, backend="cpu").square().sum(),
                      fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(f(*mine), mine)
    err = max(_rel_err(g, seqpar.shard(w, state)) for g, w in zip(grads, want))
    state.close()
    return err


def test_compiled_serial_ring(pools):
    for rank, err in enumerate(pools(2).run(_rank_compiled)):
        assert err <= TOL, (rank, err)


# ---------------------------------------------------------------------------------------------
# The planner


def _rank_memory(S: int, H: int, Hkv: int, D: int) -> list[tuple[str, int, int, int]]:
    """Each ring split's tracked peak on both p2p transports, with the planner's estimates."""
    from seqpar.planner import CostModel, plan
    from seqpar.tools.profiling import StorageTracker

    results = []
    world = dist.get_world_size()
    for R in (world, world // 2):
        row = []
        for comm in ("p2p", "p2p_serial"):
            p = plan(world, seq_len=S, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=torch.float32,
                     ranks_per_node=world, cost=CostModel.preset("cpu"), ring_comm=comm)
            c = p.candidate(R, world // R, comm)
            state = ParallelState(R, world // R, ring_comm=comm)
            g = torch.Generator().manual_seed(0)
            q, k, v, dout = (seqpar.shard(torch.randn(1, S, h, D, generator=g), state).contiguous() for h in (H, Hkv, Hkv, H))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            with StorageTracker() as mem:
                seqpar.attention(q, k, v, state, causal=True, seq_len=S).backward(dout)
            held = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
            row += [c.memory_bytes, mem.peak + held, c.time_s]
            state.close()
        results.append((f"{R}x{world // R}", *row))
    return results


def test_planner_prices_the_serial_ring(pools):
    for rank_rows in zip(*pools(4).run(_rank_memory, 2048, 8, 8, 32)):
        label, est, peak, time, est_serial, peak_serial, time_serial = max(rank_rows, key=lambda r: r[2])
        measured = max(r[2] for r in rank_rows), max(r[5] for r in rank_rows)
        for estimate, peak in zip((est, est_serial), measured):
            assert 0.95 <= estimate / peak <= 1.1, (label, estimate, peak)
        if label == "4x1":  # the serial ring holds less, and the estimate knows it
            assert measured[1] < 0.9 * measured[0] and est_serial < 0.9 * est, (label, measured, est, est_serial)
        else:  # a ring of 2: no other step's buffers next to its one remote step either way
            assert measured[1] <= measured[0] and est_serial <= est, (label, measured, est, est_serial)
        assert time_serial > time, (label, time, time_serial)


def test_plan_considers_the_serial_ring_only_when_asked():
    from seqpar.planner import CostModel, plan
    from seqpar.planner.choose import _mib

    shape = dict(seq_len=4096, num_heads=8, num_kv_heads=8, head_dim=64, dtype=torch.float32, cost=CostModel.preset("cpu"))
    auto = plan(4, **shape)
    assert {c.ring_comm for c in auto.candidates} == {"p2p", "allgather"}
    serial = plan(4, ring_comm="p2p_serial", **shape)
    assert [(c.ring_size, c.ring_comm) for c in serial.candidates] == [(1, "p2p"), (2, "p2p_serial"), (4, "p2p_serial")]
    for R in (2, 4):
        overlapped, waited = auto.candidate(R, 4 // R, "p2p"), serial.candidate(R, 4 // R)
        assert waited.label() == f"ring {R} x ulysses {4 // R} (serial)"
        # The same bytes, every one exposed; fewer buffers alive (ring 2: one remote step, nothing
        # else in flight next to its kernel either way).
        assert waited.ring_bytes == overlapped.ring_bytes and waited.time_s > overlapped.time_s
        assert waited.memory_bytes < overlapped.memory_bytes if R == 4 else waited.memory_bytes <= overlapped.memory_bytes
    # Ulysses wins this one by the ring's transfers, which the explanation says none hides.
    explained = plan(4, ring_comm="p2p_serial", ranks_per_node=4, **{**shape, "seq_len": 8192}).explanation
    assert "over 1 step, each waited for" in explained and "none without (p2p_serial)" in explained, explained
    # A plan that chooses the overlapped ring names what the same split holds without overlap.
    chosen = plan(8, seq_len=262144, num_heads=32, num_kv_heads=32, head_dim=128, ranks_per_node=1)
    serial_twin = plan(8, seq_len=262144, num_heads=32, num_kv_heads=32, head_dim=128, ranks_per_node=1,
                       ring_comm="p2p_serial").candidate(chosen.ring_size, chosen.ulysses_size)
    assert chosen.ring_comm == "p2p" and chosen.ring_size > 1, chosen
    assert (f"Without overlap (ring_comm='p2p_serial') {chosen.chosen.label()} would hold "
            f"{_mib(serial_twin.memory_bytes)} per rank instead of {_mib(chosen.chosen.memory_bytes)}") in chosen.explanation
