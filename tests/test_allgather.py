"""The all-gather K/V transport (``ParallelState(..., ring_comm="allgather")``, Note [All-gather K/V]).

The layout is checked as pure maths against every ring plan; attention is float64 against
``seqpar.backends.reference_attention``, forward and backward, on worlds 1-4 (8: one slow case),
with ring and hybrid ring x Ulysses splits, odd lengths, heads that do not divide ``U``, GQA with
``Hkv < U``, MLA ``Dv != D`` and every mask (causal, windows, chunks, softcap, sinks, joint tokens,
packed sequences) -- the matrices of ``tests/test_mla.py`` run on an all-gather state -- plus
agreement with the p2p ring, the schedule, ``torch.compile`` and the planner.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _common import quick_up_to
import seqpar
from seqpar import ParallelState
from seqpar.backends import reference_attention
from seqpar.placement import Mask, Placement, ring_plan
from seqpar.placement.gather import gather_plan
from test_mla import _WORLDS, _dense_case, _dense_cases, _packed_case, _packed_cases, _rel_err

TOL = 1e-10


# ---------------------------------------------------------------------------------------------
# The layout: pure maths on the ring plans


_LAYOUTS = [
    (Placement.dense(37, 3, 1), Mask(True, (-1, -1))),
    (Placement.dense(61, 4, 1), Mask(True, (3, 0)).normalised(61)),
    (Placement.dense(61, 4, 2), Mask(False, (4, 2)).normalised(61)),
    (Placement.dense(40, 5, 1), Mask(True, (-1, -1), 6).normalised(40)),
    (Placement.dense(29, 2, 1), Mask(False, (-1, -1))),
    (Placement.packed((7, 0, 1, 13, 3), 3, 1), Mask(True, (2, 0)).normalised(13)),
    (Placement.packed((2, 9, 1, 1, 5, 0, 4, 2), 4, 1), Mask(True, (-1, -1))),
    (Placement.dense(5, 4, 1), Mask(True, (-1, -1))),
]


@pytest.mark.parametrize("case", range(len(_LAYOUTS)))
def test_gather_plan_puts_every_step_on_its_rows(case):
    """Simulated all-gather of row ids: every step's compact buffer, cut from its slot, is exactly
    the rows its plan receives; contributions are what some rank reads and nothing else."""
    placement, mask = _LAYOUTS[case]
    R = placement.ring_size
    varlen = case >= 5
    plans = [ring_plan(placement, r, mask, varlen=varlen) for r in range(R)]
    layouts = [gather_plan(plans, r) for r in range(R)]
    assert all(g.rows == layouts[0].rows and g.width == layouts[0].width for g in layouts)
    width = layouts[0].width
    slots = torch.full((R, width), -1, dtype=torch.long)
    for j, g in enumerate(layouts):
        ids = torch.cat([torch.arange(a, b) for a, b in g.rows[j]] or [torch.zeros(0, dtype=torch.long)])
        slots[j, :ids.numel()] = ids
        assert g.lengths[j] == ids.numel() <= width
    read = [set() for _ in range(R)]
    for r, (plan, g) in enumerate(zip(plans, layouts)):
        for i, step in enumerate(plan.steps):
            if i == 0 or not step.recv_rows:
                assert g.steps[i] == ()
                continue
            got = torch.cat([slots[step.src, a:b] for a, b in g.steps[i]])
            want = torch.cat([torch.arange(a, b) for a, b in step.recv_rows])
            assert torch.equal(got, want), (case, r, i)
            assert got.numel() == step.kv_len
            read[step.src].update(want.tolist())
    for j in range(R):
        assert sorted(read[j]) == slots[j, :layouts[0].lengths[j]].tolist()
    assert layouts[0].received_rows() == (R - 1) * width and layouts[0].sent_rows() == width


def test_gather_plan_follows_the_mask():
    """Causal: every row is read by some other rank except the last zig-zag chunk (rank 0's second
    chunk: no later query elsewhere); a window shorter than a chunk: only the rows next to chunk
    edges travel, as in the p2p ring."""
    S, R = 400, 4
    placement = Placement.dense(S, R, 1)
    causal = [ring_plan(placement, r, Mask(True, (-1, -1)), varlen=False) for r in range(R)]
    g = gather_plan(causal, 0)
    assert g.lengths == (50, 100, 100, 100) and g.rows[0] == ((0, 50),) and g.width == 100
    mask = Mask(True, (8, 0)).normalised(S)
    windowed = [ring_plan(placement, r, mask, varlen=False) for r in range(R)]
    g = gather_plan(windowed, 0)
    assert 0 < g.width <= 2 * 8 and g.width < max(placement.ring_lengths) / 5
    # Free lengths (no positions): every row of every rank, padded to the longest.
    free = Placement.free((4, 6, 3), 3, 1)
    g = gather_plan([ring_plan(free, r, Mask(False, (-1, -1)), varlen=False) for r in range(3)], 1)
    assert g.lengths == (4, 6, 3) and g.width == 6 and g.steps[0] == ()
    # Nothing remote (each token sees itself only): nothing to gather.
    diagonal = Mask(False, (0, 0)).normalised(12)
    g = gather_plan([ring_plan(placement := Placement.dense(12, 3, 1), r, diagonal, varlen=False) for r in range(3)], 2)
    assert g.width == 0 and g.rows == ((), (), ()) and placement.ring_size == 3


# ---------------------------------------------------------------------------------------------
# The state option


def test_ring_comm_option():
    assert ParallelState().ring_comm == "p2p"
    state = ParallelState(ring_comm="allgather")
    assert state.ring_comm == "allgather" and "ring_comm 'allgather'" in repr(state)
    for bad in ("ring", "all_gather", None, 1):
        with pytest.raises(ValueError, match=r"ring_comm must be one of \['p2p', 'p2p_serial', 'allgather'\], got"):
            ParallelState(ring_comm=bad)
    # A one-rank all-gather state runs the plain kernel.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, h, 4, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out = seqpar.attention(q, k, v, state, causal=True, backend="reference")
    assert _rel_err(out, reference_attention(q, k, v, causal=True)) < TOL


# ---------------------------------------------------------------------------------------------
# Attention over CP worlds 1-4: the MLA matrices (every mask, heads, lengths, layouts) on all-gather states


def _rank_cases(kind: str, cases: list[dict]) -> list[tuple[str, float]]:
    states: dict[tuple[int, int], ParallelState] = {}
    run = _dense_case if kind == "dense" else _packed_case
    results = []
    for c in cases:
        if c["RU"] not in states:
            states[c["RU"]] = ParallelState(*c["RU"], ring_comm="allgather")
        results.append(run(states[c["RU"]], c))
    return results


@pytest.mark.parametrize("world", quick_up_to(3, sorted(_WORLDS)))
def test_dense_allgather(pools, world):
    cases = _dense_cases(_WORLDS[world])
    for rank, results in enumerate(pools(world).run(_rank_cases, "dense", cases)):
        assert len(results) == len(cases)
        for name, err in results:
            assert err <= TOL, f"rank {rank}: allgather {name}: error {err:.3g}"


@pytest.mark.parametrize("world", quick_up_to(3, sorted(_WORLDS)))
def test_packed_allgather(pools, world):
    cases = _packed_cases(_WORLDS[world])
    for rank, results in enumerate(pools(world).run(_rank_cases, "packed", cases)):
        assert len(results) == len(cases)
        for name, err in results:
            assert err <= TOL, f"rank {rank}: allgather {name}: error {err:.3g}"


@pytest.mark.slow
def test_world_8_allgather(pools):
    """Ring 8 and ring 4 x Ulysses 2: causal GQA with Hkv < U, a window, packed sequences."""
    cases = [c for c in _dense_cases([(8, 1), (4, 2)]) if "causal" in c["name"] or "window" in c["name"]][:4]
    for rank, results in enumerate(pools(8).run(_rank_cases, "dense", cases)):
        for name, err in results:
            assert err <= TOL, f"rank {rank}: allgather {name}: error {err:.3g}"
    cases = _packed_cases([(8, 1)])[:3]
    for rank, results in enumerate(pools(8).run(_rank_cases, "packed", cases)):
        for name, err in results:
            assert err <= TOL, f"rank {rank}: allgather {name}: error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# The transport itself: the collectives it uses, its schedule, agreement with p2p, bf16, compile


def _rank_transport(S: int, causal: bool, window: tuple[int, int]) -> dict:
    """One call on a p2p and an all-gather ring state of the whole world: the collectives each
    issues, their difference, and the all-gather's error against the reference."""
    from unittest import mock

    R = dist.get_world_size()
    gen = torch.Generator().manual_seed(S)
    q, k, v, dout = (torch.randn(2, S, h, 6, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, causal=causal, window=window)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    results = {}
    for comm in ("p2p", "allgather"):
        state = ParallelState(R, ring_comm=comm)
        mine = [seqpar.shard(t, state).requires_grad_() for t in (q, k, v)]
        counts = {"p2p": 0, "all_gather": 0, "reduce_scatter": 0}

        def counting(name, fn):
            def wrapped(*args, **kwargs):
                counts[name] += 1
                return fn(*args, **kwargs)
            return wrapped

        with mock.patch.object(dist, "batch_isend_irecv", counting("p2p", dist.batch_isend_irecv)), \
             mock.patch.object(dist, "all_gather_single", counting("all_gather", dist.all_gather_single)), \
             mock.patch.object(dist, "reduce_scatter_single", counting("reduce_scatter", dist.reduce_scatter_single)):
            out = seqpar.attention(*mine, state, causal=causal, window=window, seq_len=S, backend="cpu")
            grads = torch.autograd.grad(out, mine, seqpar.shard(dout, state))
        results[comm] = dict(counts=counts, values=[out.detach(), *grads])
        err = [_rel_err(out, seqpar.shard(ref, state))]
        err += [_rel_err(g, seqpar.shard(r, state)) for g, r in zip(grads, ref_grads)]
        results[comm]["err"] = max(err)
        state.close()
    results["diff"] = max(
        (a - b).abs().max().item() for a, b in zip(results["p2p"]["values"], results["allgather"]["values"])
    )
    for comm in ("p2p", "allgather"):
        del results[comm]["values"]
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_transport_uses_one_gather_and_agrees_with_p2p(pools, world):
    for S, causal, window in [(37, True, (-1, -1)), (61, True, (3, 0)), (23, False, (-1, -1))]:
        for rank, res in enumerate(pools(world).run(_rank_transport, S, causal, window)):
            assert res["p2p"]["err"] <= TOL and res["allgather"]["err"] <= TOL, (rank, S, res)
            assert res["diff"] < 1e-12, (rank, S, res["diff"])
            # Forward one all-gather, backward one all-gather and one reduce-scatter, no p2p (both
            # also run the call check's small all-gather of Note [Global length]).
            checks = res["p2p"]["counts"]["all_gather"]
            assert res["allgather"]["counts"] == {"p2p": 0, "all_gather": checks + 2, "reduce_scatter": 1}, res
            assert res["p2p"]["counts"]["p2p"] > 0 and res["p2p"]["counts"]["reduce_scatter"] == 0


def _rank_schedule(S: int) -> tuple[list, float]:
    """Forward and backward of the all-gather driver with a trace, on the whole world's ring."""
    from seqpar.backends import get_backend
    from seqpar.parallel.allgather import AllGatherSetup, kv_backward, kv_forward
    from seqpar.parallel.ring import RingSetup

    state = ParallelState(dist.get_world_size())
    R, r = state.ring_size, state.ring_rank
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, S, h, 8, generator=gen, dtype=torch.float64) for h in (2, 1, 1, 2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    placement = Placement.dense(S, R, 1)
    plans = [ring_plan(placement, j, Mask(True), varlen=False) for j in range(R)]
    trace: list = []
    ring = RingSetup(state.ring_group, plans[r], get_backend("cpu", "cpu", torch.float64), 8**-0.5, 0.0, trace=trace)
    run = AllGatherSetup(ring, gather_plan(plans, r))
    local = [seqpar.shard(t, state) for t in (q, k, v)]
    out, lse = kv_forward(*local, None, None, run)
    grads = kv_backward(seqpar.shard(dout, state), local[0], [local[1], local[2]], None, None, out, lse, run)[:3]
    errs = [_rel_err(out, seqpar.shard(ref, state))]
    errs += [_rel_err(g, seqpar.shard(x, state)) for g, x in zip(grads, ref_grads)]
    state.close()
    return trace, max(errs)


def test_schedule_overlaps_the_gather_with_step_0(pools):
    R = 3
    for trace, err in pools(R).run(_rank_schedule, 37):
        assert err <= TOL
        want = [("gather", 0), ("compute", 0), ("wait", 0)] + [("compute", i) for i in range(1, R)]
        fwd, bwd = trace[:len(want)], trace[len(want):]
        assert fwd == want, trace
        assert bwd == want + [("reduce_scatter", R - 1), ("wait_grad", R - 1)], trace


def _rank_bf16() -> list[tuple[str, float, float]]:
    """bf16 through the all-gather (hybrid 2 x 2 when the world has 4 ranks): error against
    float64, and that of the same maths in bf16 on one device."""
    world = dist.get_world_size()
    state = ParallelState(world // 2, 2, ring_comm="allgather")
    S, H, Hkv, D = 45, 6, 2, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, S, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
    exact = [t.to(torch.bfloat16).double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*exact, causal=True)
    want = [ref, *torch.autograd.grad(ref, exact, dout)]
    same = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    base_out = reference_attention(*same, causal=True)
    base = [base_out, *torch.autograd.grad(base_out, same, dout.to(torch.bfloat16))]
    mine = [seqpar.shard(t.to(torch.bfloat16), state).requires_grad_() for t in (q, k, v)]
    out = seqpar.attention(*mine, state, causal=True, backend="cpu")
    got = [out, *torch.autograd.grad(out, mine, seqpar.shard(dout, state).to(torch.bfloat16))]
    results = []
    for name, g, w, b in zip(("out", "dq", "dk", "dv"), got, want, base):
        results.append((name, _rel_err(g, seqpar.shard(w, state)), _rel_err(seqpar.shard(b, state).double(), seqpar.shard(w, state))))
    state.close()
    return results


def test_bfloat16_by_flash_attn_rule(pools):
    for rank, results in enumerate(pools(4).run(_rank_bf16)):
        for name, err, base in results:
            assert err <= 2 * base + 1e-3, (rank, name, err, base)


def _rank_compiled() -> list[tuple[str, float]]:
    state = ParallelState(dist.get_world_size(), ring_comm="allgather")
    gen = torch.Generator().manual_seed(5)
    S, lens = 29, [7, 1, 13, 10]
    dense = [torch.randn(2, S, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]
    packed = [torch.randn(sum(lens), h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]

    def f(q, k, v, qp, kp, vp):
        o = seqpar.attention(q, k, v, state, causal=True, backend="cpu")
        op = seqpar.varlen_attention(qp, kp, vp, state, lens, window=(3, 2), backend="cpu")
        return o.square().sum() + op.square().sum(), o, op

    leaves = [t.clone().requires_grad_() for t in (*dense, *packed)]
    from seqpar.backends import reference_varlen_attention

    loss = (reference_attention(*leaves[:3], causal=True).square().sum()
            + reference_varlen_attention(*leaves[3:], lens, window=(3, 2)).square().sum())
    want = torch.autograd.grad(loss, leaves)
    mine = [seqpar.shard(t, state) for t in dense] + [seqpar.shard_packed(t, state, lens) for t in packed]
    mine = [t.detach().clone().requires_grad_() for t in mine]
    torch._dynamo.reset()
    share, o, op = torch.compile(f, fullgraph=True, backend="aot_eager")(*mine)
    grads = torch.autograd.grad(share, mine)
    local_want = [seqpar.shard(g, state) for g in want[:3]] + [seqpar.shard_packed(g, state, lens) for g in want[3:]]
    results = [(name, _rel_err(g, w)) for name, g, w in zip(["dq", "dk", "dv", "dqp", "dkp", "dvp"], grads, local_want)]
    state.close()
    return results


@pytest.mark.slow
def test_compiled_allgather(pools):
    for rank, results in enumerate(pools(2).run(_rank_compiled)):
        for name, err in results:
            assert err <= TOL, f"rank {rank}: {name}: error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# The planner


def test_planner_considers_the_all_gather():
    from dataclasses import replace

    from seqpar.placement import head_assignments
    from seqpar.placement.cost import kv_bytes
    from seqpar.planner import CostModel, Link, plan

    cpu = CostModel.preset("cpu")
    shape = dict(seq_len=4096, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32, ranks_per_node=4, cost=cpu)
    p = plan(4, **shape)
    assert [(c.ring_size, c.ulysses_size, c.ring_comm) for c in p.candidates] == [
        (1, 4, "p2p"), (2, 2, "p2p"), (2, 2, "allgather"), (4, 1, "p2p"), (4, 1, "allgather")]
    for c in p.candidates:
        if c.ring_comm != "allgather":
            continue
        R, U = c.ring_size, c.ulysses_size
        placement = Placement.dense(4096, R, U)
        width = gather_plan([ring_plan(placement, r, Mask(True), varlen=False) for r in range(R)], 0).width
        kv = head_assignments(8, 2, U)[0].kernel_kv_heads
        # Forward gather, backward gather and reduce-scatter: R - 1 parts of the widest contribution each.
        assert c.ring_bytes == 3 * (R - 1) * kv_bytes(width, kv, 64, 1, 4), c.label()
        # All of the ring group's needed K/V at once: more than the ring's two steps.
        assert c.memory_bytes > p.candidate(R, U, "p2p").memory_bytes
        assert "(all-gather)" in c.label()
    # A costly ring step (latency, waiting for peers) favours one collective over R - 1 steps ...
    slow_a2a = Link(1e-2, 1e6)
    p = plan(4, **{**shape, "cost": replace(cpu, ring_step_s=0.05, ulysses_intra=slow_a2a)})
    assert (p.ring_size, p.ring_comm) == (4, "allgather") and "ring_comm='allgather'" in p.explanation
    # ... a thin link with a short window favours p2p, which sends only the window's rows to a neighbour.
    p = plan(4, **{**shape, "window": (63, 0), "cost": replace(cpu, ring_intra=Link(1e-4, 1e7), ulysses_intra=slow_a2a)})
    assert (p.ring_size, p.ring_comm) == (4, "p2p")
    assert p.candidate(4, 1, "allgather").ring_bytes > 2 * p.candidate(4, 1, "p2p").ring_bytes
    only = plan(4, ring_comm="allgather", **shape)
    assert {c.ring_comm for c in only.candidates} == {"p2p", "allgather"}  # R = 1 has no ring to gather
    assert {c.ring_comm for c in only.candidates if c.ring_size > 1} == {"allgather"}
    with pytest.raises(ValueError, match=r"ring_comm must be one of \['auto', 'p2p', 'p2p_serial', 'allgather'\], got 'ring'"):
        plan(4, ring_comm="ring", **shape)
    with pytest.raises(ValueError, match=r"\(4, 1, 'nccl'\) is not one of"):
        p.candidate(4, 1, "nccl")
    single = plan(1, seq_len=100, num_heads=4, num_kv_heads=2, head_dim=8)
    assert single.ring_comm == "p2p" and single.state().ring_comm == "p2p"
