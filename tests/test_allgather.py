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
        with pytest.raises(ValueError, match=r"ring_comm must be one of \['p2p', 'allgather'\], got"):
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


@pytest.mark.parametrize("world", sorted(_WORLDS))
def test_dense_allgather(pools, world):
    cases = _dense_cases(_WORLDS[world])
    for rank, results in enumerate(pools(world).run(_rank_cases, "dense", cases)):
        assert len(results) == len(cases)
        for name, err in results:
            assert err <= TOL, f"rank {rank}: allgather {name}: error {err:.3g}"


@pytest.mark.parametrize("world", sorted(_WORLDS))
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
