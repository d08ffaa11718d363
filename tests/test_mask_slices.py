"""Mask slices (block-causal, prefix-LM, random unions of rectangles) and ALiBi against a float64
single-device reference, forward and backward.

Ring, Ulysses and hybrid states on 1-4 ranks (3 included; 8 in a slow test), odd lengths, H not
divisible by U, GQA with Hkv < U, MLA value heads (Dv < D and Dv > D), eager and backends
"auto"/"reference". The plan itself is checked pair by pair (every attended pair computed once,
nothing else) for every mask on many placements, and the block-causal plan's work is balanced.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _common import quick_up_to
import seqpar
from seqpar import MaskSlices, ParallelState
from seqpar.backends.reference import reference_attention
from seqpar.placement import Mask, Placement, ring_plan
from seqpar.placement.ring import tile_pairs

sys.path.insert(0, str(Path(__file__).parent))
from test_ring import _check_plan  # noqa: E402  (the pair-by-pair plan check)

_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _random_slices(S: int, n: int, seed: int) -> MaskSlices:
    rng = random.Random(seed)
    q, k, kinds = [], [], []
    for _ in range(n):
        a = rng.randrange(S)
        c = rng.randrange(S)
        q.append((a, rng.randrange(a + 1, S + 1)))
        k.append((c, rng.randrange(c + 1, S + 1)))
        kinds.append(rng.choice(["full", "causal"]))
    return MaskSlices(q, k, kinds)


def _frames(S: int, seed: int) -> list[int]:
    """Uneven frame sizes summing to ``S``."""
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < S:
        sizes.append(min(rng.randrange(1, 12), S - sum(sizes)))
    return sizes


# ---------------------------------------------------------------------------------------------
# Construction and the mask itself


def test_constructors_match_their_definitions():
    S = 23
    i, j = torch.arange(S), torch.arange(S)
    pre = MaskSlices.prefix_lm(S, 5).allows(i, j)
    assert torch.equal(pre, (j[None, :] < 5) | (j[None, :] <= i[:, None]))
    sizes = [4, 1, 7, 11]
    frame = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    bc = MaskSlices.block_causal(sizes).allows(i, j)
    assert torch.equal(bc, frame[None, :] <= frame[:, None])
    assert torch.equal(MaskSlices.prefix_lm(S, 0).allows(i, j), j[None, :] <= i[:, None])
    assert bool(MaskSlices.prefix_lm(S, S).allows(i, j).all())
    # A causal slice is aligned bottom-right, like flash-attn's causal mask.
    m = MaskSlices([(10, 13)], [(2, 8)], ["causal"]).allows(i, j)
    want = torch.zeros(S, S, dtype=torch.bool)
    for a in range(10, 13):
        for b in range(2, 8):
            want[a, b] = b - 2 <= a - 10 + (8 - 2) - (13 - 10)
    assert torch.equal(m, want)


@pytest.mark.parametrize("seed", range(12))
def test_cells_are_a_disjoint_cover(seed):
    S = 29
    m = _random_slices(S, 1 + seed % 6, seed)
    i, j = torch.arange(S), torch.arange(S)
    count = torch.zeros(S, S, dtype=torch.long)
    for q0, q1, k0, k1, hi in m.cells():
        block = torch.zeros(S, S, dtype=torch.bool)
        block[q0:q1, k0:k1] = True
        if hi is not None:
            block &= (j[None, :] - i[:, None]) <= hi
        assert bool(block.any()), "a cell with no attended pair"
        count += block
    assert int(count.max()) <= 1, "overlapping slices counted twice"
    assert torch.equal(count.bool(), m.allows(i, j))


@pytest.mark.parametrize(
    "args, match",
    [
        (([(0, 4)], [(0, 4)], ["diag"]), "kinds must be 'full' or 'causal'"),
        (([(3, 3)], [(0, 4)], ["full"]), r"q_ranges\[0\] = \(3, 3\)"),
        (([(0, 4)], [(-1, 4)], ["full"]), r"k_ranges\[0\]"),
        (([(0, 4), (1, 2)], [(0, 4)], ["full", "full"]), "one entry per slice"),
        (([], [], []), "at least one slice"),
        (([(0, 4.5)], [(0, 4)], ["full"]), "must hold ints"),
    ],
)
def test_bad_slices_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        MaskSlices(*args)


def test_bad_calls_are_refused():
    state = ParallelState()
    q = torch.randn(1, 10, 2, 4)
    with pytest.raises(ValueError, match="mask= replaces causal"):
        seqpar.attention(q, q, q, state, causal=True, mask=MaskSlices.prefix_lm(10, 2))
    with pytest.raises(ValueError, match="must be a seqpar.MaskSlices"):
        seqpar.attention(q, q, q, state, mask=torch.ones(10, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="reach query position 11 .* has 10 tokens"):
        seqpar.attention(q, q, q, state, mask=MaskSlices.block_causal([4, 8]))
    with pytest.raises(ValueError, match=r"one slope per query head, shape \(2,\)"):
        seqpar.attention(q, q, q, state, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="replicated tokens have no global position"):
        seqpar.attention(q, q, q, state, alibi_slopes=torch.ones(2), replicated_prefix=2)
    with pytest.raises(ValueError, match="without window, chunks or mask slices"):
        seqpar.attention(q, q, q, state, mask=MaskSlices.prefix_lm(8, 2), replicated_prefix=2)


# ---------------------------------------------------------------------------------------------
# The plan


@pytest.mark.slow  # host maths over 280 plans (3.6 s); the masks' exactness on ranks stays quick
def test_plans_compute_exactly_the_mask():
    n = 0
    for S in (13, 37):
        for R, U in [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (1, 3), (3, 2)]:
            placement = Placement.dense(S, R, U)
            masks = [
                MaskSlices.block_causal(_frames(S, S + R)), MaskSlices.prefix_lm(S, S // 3),
                MaskSlices.block_causal([1, S - 4, 3]), _random_slices(S, 1, S * R), _random_slices(S, 5, S + U),
            ]
            for m in masks:
                for alibi in (False, True):
                    for varlen in (False, True):
                        _check_plan(placement, Mask(slices=m, alibi=alibi), varlen)
                        n += 1
            for band in (Mask(True), Mask(True, (3, -1)), Mask(False, (2, 5)), Mask(True, (-1, -1), 4)):
                _check_plan(placement, Mask(band.causal, band.window, band.chunk_size, alibi=True), False)
    assert n == 280


def test_block_causal_work_is_balanced():
    """16 frames over a ring of 4: every rank computes the same attended pairs within 5%."""
    S, R = 16 * 255, 4
    placement = Placement.dense(S, R, 1)
    mask = Mask(slices=MaskSlices.block_causal([255] * 16))
    pairs = [sum(tile_pairs(s.tiles) for s in ring_plan(placement, r, mask, varlen=False).steps) for r in range(R)]
    assert max(pairs) / min(pairs) <= 1.05, pairs
    # Exactly the attended pairs: frame f's 255 queries see 255 * (f + 1) keys each.
    assert sum(pairs) == sum(255 * 255 * (f + 1) for f in range(16))


# ---------------------------------------------------------------------------------------------
# Distributed, forward and backward


def _case(state: ParallelState, c: dict) -> tuple[str, float, float]:
    B, S, (H, Hkv), D, Dv, dtype = c["B"], c["S"], c["heads"], 8, c["Dv"], c["dtype"]
    gen = torch.Generator().manual_seed(c["seed"])
    full = [torch.randn(B, S, h, d, generator=gen, dtype=torch.float64) for h, d in ((H, D), (Hkv, D), (Hkv, Dv), (H, Dv))]
    slopes = torch.rand(H, generator=gen, dtype=torch.float64) if c["alibi"] else None
    opts = dict(c["options"])
    if c["mask"] is not None:
        opts["mask"] = c["mask"]
    leaves = [t.to(dtype).double().requires_grad_() for t in full[:3]]
    ref = reference_attention(*leaves, alibi_slopes=None if slopes is None else slopes.float().double(), **opts)
    ref_grads = torch.autograd.grad(ref, leaves, full[3])
    mine = [t.detach().to(dtype).requires_grad_() for t in full[:3]]
    out = seqpar.attention(
        *(seqpar.shard(t, state, dim=1) for t in mine), state, backend=c["backend"],
        alibi_slopes=None if slopes is None else slopes.float(), seq_len=S if c["seq_len"] else None, **opts,
    )
    assert out.dtype == dtype and out.shape[-1] == Dv
    grads = torch.autograd.grad(out, mine, seqpar.shard(full[3], state, dim=1).to(dtype))
    grads = [g.clone() for g in grads]
    for g in grads:
        dist.all_reduce(g, group=state.cp_group)
    err = (out.double() - seqpar.shard(ref.detach(), state, dim=1)).abs().max().item()
    err = max([err] + [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)])
    scale = max(1.0, max(r.abs().max().item() for r in (ref, *ref_grads)))
    return c["name"], err / scale, _TOL[dtype]


def _rank(cases):
    states, out = {}, []
    for c in cases:
        key = (c["RU"], c.get("ring_comm", "p2p"))
        if key not in states:
            states[key] = ParallelState(*c["RU"], ring_comm=key[1])
        out.append(_case(states[key], c))
    return out


# name: (mask builder of S, options, alibi, Dv)
_OPTIONS = {
    "block-causal uneven frames": (lambda S, s: MaskSlices.block_causal(_frames(S, s)), {}, False, 8),
    "prefix-LM": (lambda S, s: MaskSlices.prefix_lm(S, S // 3), {}, False, 8),
    "random slices": (lambda S, s: _random_slices(S, 4, s), {}, False, 8),
    "one random slice": (lambda S, s: _random_slices(S, 1, s), {}, False, 8),
    "alibi causal": (None, dict(causal=True), True, 8),
    "alibi window": (None, dict(causal=True, window=(6, 0)), True, 8),
    "alibi bidirectional window": (None, dict(window=(4, 3)), True, 8),
    "alibi full": (None, {}, True, 8),
    "alibi + block-causal": (lambda S, s: MaskSlices.block_causal(_frames(S, s)), {}, True, 8),
    "alibi + softcap + sinks-free chunked": (None, dict(causal=True, chunk_size=9, softcap=3.0), True, 8),
    "MLA Dv < D block-causal": (lambda S, s: MaskSlices.block_causal(_frames(S, s)), {}, False, 5),
    "MLA Dv > D prefix-LM + alibi": (lambda S, s: MaskSlices.prefix_lm(S, 7), {}, True, 12),
}
# Heads chosen so that H is not divisible by U and Hkv < U appear with U = 2, 3, 4.
_HEADS = [(6, 2), (3, 1), (5, 5), (8, 2), (7, 1)]
_WORLDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1), (1, 4)], 8: [(2, 4), (4, 2), (8, 1)]}


def _cases(world: int) -> list[dict]:
    cases = []
    for i, (name, (build, options, alibi, Dv)) in enumerate(_OPTIONS.items()):
        for j, RU in enumerate(_WORLDS[world]):
            k = i + j + world
            S = (61, 37, 53)[k % 3]
            cases.append(dict(
                RU=RU, name=f"{RU} {name}", mask=None if build is None else build(S, k), options=options,
                alibi=alibi, Dv=Dv, B=1 + k % 2, S=S, heads=_HEADS[k % len(_HEADS)],
                dtype=torch.float64 if k % 3 else torch.float32, backend="reference" if k % 4 == 0 else "auto",
                seq_len=k % 2 == 0, seed=k,
            ))
    return cases


def _check(results, n):
    for rank, res in enumerate(results):
        assert len(res) == n
        for name, err, tol in res:
            assert err <= tol, f"rank {rank}: {name}: error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("world", quick_up_to(3, [1, 2, 3, 4]))
def test_masks_and_alibi_match_reference(pools, world):
    cases = _cases(world)
    _check(pools(world).run(_rank, cases), len(cases))


@pytest.mark.parametrize("world", quick_up_to(3, [2, 3, 4]))
def test_masks_and_alibi_under_allgather(pools, world):
    """Every mask, ALiBi and MLA case again with the ring group all-gathering K/V."""
    cases = [dict(c, ring_comm="allgather", name=f"allgather {c['name']}") for c in _cases(world) if c["RU"][0] > 1]
    _check(pools(world).run(_rank, cases), len(cases))


def _rank_disagree(rank_comm):
    state = ParallelState(2, 1, ring_comm=rank_comm[dist.get_rank()])
    q = seqpar.shard(torch.randn(1, 11, 2, 4, generator=torch.Generator().manual_seed(0)), state, dim=1)
    try:
        seqpar.attention(q, q, q, state, causal=True)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("other", ["allgather", "p2p_serial"])
def test_ranks_with_different_ring_comm_raise_on_every_rank(pools, other):
    # The transports order their messages differently: a mix would pair the wrong ones.
    for msg in pools(2).run(_rank_disagree, ["p2p", other]):
        assert "ring_comm [0 p2p / 1 p2p_serial / 2 allgather])" in msg and "disagree" in msg, msg


@pytest.mark.slow
def test_masks_and_alibi_on_eight_ranks(pools):
    """Every case once on 8 ranks, each on one of the three splits in turn, and once more under
    all-gather on another split (4 ranks run the whole matrix of cases and splits)."""
    cases, n = _cases(8), len(_WORLDS[8])
    p2p = [c for i, c in enumerate(cases) if (i // n + i % n) % n == 0]
    gathered = [dict(c, ring_comm="allgather", name=f"allgather {c['name']}")
                for i, c in enumerate(cases) if (i // n + i % n) % n == 1]
    _check(pools(8).run(_rank, p2p + gathered), len(p2p) + len(gathered))


def test_compiled_matches_eager():
    """torch.compile runs mask slices and ALiBi through the custom operator, same numbers."""
    state = ParallelState()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 29, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    slopes = torch.rand(4, generator=gen)
    mask = MaskSlices.block_causal([5, 9, 15])

    def f(q, k, v):
        return seqpar.attention(q, k, v, state, mask=mask, alibi_slopes=slopes)

    want = f(q, k, v)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    assert torch.allclose(got, want, atol=1e-12)
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g_got, g_want))
