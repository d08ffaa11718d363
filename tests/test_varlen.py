"""Packed variable-length attention across hybrid CP (``seqpar.varlen``, ``seqpar.varlen_layout``).

Correctness: every CP configuration against a float64 per-sequence reference, forward and the
gradients of global leaf tensors (summed over the CP group, DESIGN.md's gradient convention).
Balance: the attention work per CP rank, with an exact per-sequence deviation bound (see
``test_causal_work_deviation_bound``) from which the 1.05 balance condition follows.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpar
from seqpar import layout
from seqpar.backends import get_backend, reference_varlen_attention
from seqpar.merge import merge
from seqpar.varlen_layout import (
    local_cu_seqlens,
    local_positions,
    local_seq_ids,
    local_seq_lens,
    ring_local_lengths,
    ring_varlen_blocks,
    shard_token_counts,
    varlen_work,
    zigzag_pieces,
)

CONFIGS = [(1, 1), (2, 1), (1, 2), (3, 1), (1, 3), (2, 2), (4, 1), (1, 4), (2, 4)]
TOL = 1e-4


def _mixes(R: int, seed: int) -> list[list[int]]:
    """Length mixes for ring size ``R``: 1s, zeros, lengths < 2R, one longer than all others."""
    rng = random.Random(seed)
    short = [1, 0, 2 * R - 1, 1, 3, max(2 * R - 3, 1), 2]
    medium = [rng.randint(2 * R, 6 * R + 5) for _ in range(2)]
    long_one = sum(short) + sum(medium) + rng.randint(1, 2 * R + 3)
    mixes = [
        short[:3] + [long_one] + short[3:] + medium,  # long one in the middle
        [rng.choice([0, 1, 2, 5, rng.randint(1, 4 * R + 9)]) for _ in range(12)] + [1],
    ]
    return mixes


# --- placement helpers (pure) -------------------------------------------------------------------


def _owner_tables(lens: list[int]) -> tuple[list[int], list[int]]:
    starts = layout.offsets(lens)
    seq_of = [s for s, n in enumerate(lens) for _ in range(n)]
    return starts, seq_of


@pytest.mark.parametrize("R,U", CONFIGS + [(8, 1), (3, 2)])
def test_local_helpers_match_shard_packed(R, U):
    rng = random.Random(R * 10 + U)
    for _ in range(20):
        lens = [rng.choice([0, 1, 2, 3, rng.randint(1, 8 * R + 7)]) for _ in range(rng.randint(0, 9))]
        starts, seq_of = _owner_tables(lens)
        for cp in range(R * U):
            r, u = divmod(cp, U)
            glob = layout.packed_positions(lens, R, r, U, u).tolist()
            ids = local_seq_ids(lens, (R, U, cp)).tolist()
            assert ids == [seq_of[p] for p in glob]
            assert local_positions(lens, (R, U, cp)).tolist() == [p - starts[seq_of[p]] for p in glob]
            counts = local_seq_lens(lens, (R, U, cp)).tolist()
            assert counts == [ids.count(s) for s in range(len(lens))]
            cu, max_len = local_cu_seqlens(lens, (R, U, cp))
            assert cu.dtype == torch.int32 and cu.tolist() == layout.offsets(counts)
            assert max_len == max(counts, default=0)
        per_ring = layout.packed_shard_lengths(lens, R, U)
        assert shard_token_counts(lens, (R, U)) == per_ring
        assert ring_local_lengths(lens, R) == [sum(per_ring[r * U:(r + 1) * U]) for r in range(R)]


def test_local_helpers_accept_state_and_tensor_lengths():
    lens = [5, 0, 3]
    state = seqpar.ParallelState()
    assert local_positions(torch.tensor(lens), state).tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert local_seq_ids(lens, (1, 1, 0)).tolist() == [0] * 5 + [2] * 3
    cu, max_len = local_cu_seqlens(lens, state)
    assert cu.tolist() == [0, 5, 5, 8] and max_len == 5
    first, second = zigzag_pieces([10, 3], 2)  # chunks [3,3,2,2] and [1,1,1,0]
    assert first.tolist() == [[3, 1], [3, 1]] and second.tolist() == [[2, 0], [2, 1]]


def test_helpers_reject_bad_input():
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = -2"):
        local_positions([3, -2], (2, 1, 0))
    with pytest.raises(ValueError, match=r"cp_rank must be an int in 0\.\.3"):
        local_cu_seqlens([3, 4], (2, 2, 4))
    with pytest.raises(ValueError, match=r"ring_size must be a positive int, got 0"):
        varlen_work([3], (0, 1), True)
    with pytest.raises(ValueError, match=r"num_heads must be a positive int"):
        varlen_work([3], (1, 2), True, num_heads=0)
    with pytest.raises(ValueError, match=r"ring_rank must be in 0\.\.1, got 2"):
        ring_varlen_blocks([3], 2, 2, True)


def _brute_work(lens: list[int], R: int, U: int, causal: bool) -> list[int]:
    """Pairs computed per CP rank, counted token by token from the placement."""
    starts, seq_of = _owner_tables(lens)
    out = []
    for cp in range(R * U):
        r = cp // U
        ring = torch.cat([layout.packed_positions(lens, R, r, U, u) for u in range(U)]).tolist()
        out.append(sum(p - starts[seq_of[p]] + 1 if causal else lens[seq_of[p]] for p in ring))
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_work_counts_pairs(causal):
    rng = random.Random(int(causal))
    for R, U in CONFIGS + [(8, 1)]:
        for _ in range(6):
            lens = [rng.choice([0, 1, 3, rng.randint(1, 50)]) for _ in range(rng.randint(1, 8))]
            work = varlen_work(lens, (R, U), causal)
            assert work == _brute_work(lens, R, U, causal)
            total = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
            assert sum(work) == U * total
            # The ring blocks compute exactly these pairs, each once.
            for r in range(R):
                blocks = ring_varlen_blocks(lens, R, r, causal)
                assert sum(b.pairs for b in blocks if b is not None) == work[r * U]
            heads = varlen_work(lens, (R, U), causal, num_heads=5)
            sizes = layout.split_sizes(5, U)
            assert heads == [work[c] * sizes[c % U] for c in range(R * U)]


# --- the ring blocks, simulated in one process --------------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_blocks_simulated(R, causal):
    """All ring steps of every ring rank in one process (no transport) vs the reference."""
    backend = get_backend("reference", "cpu", torch.float64)
    gen = torch.Generator().manual_seed(R)
    for lens in _mixes(R, seed=R):
        T, H, Hkv, D = sum(lens), 4, 2, 8
        q, k, v = (torch.randn(T, h, D, dtype=torch.float64, generator=gen) for h in (H, Hkv, Hkv))
        ref, ref_lse = reference_varlen_attention(q, k, v, lens, causal=causal, return_lse=True)
        rows = [layout.packed_positions(lens, R, r, 1, 0) for r in range(R)]
        for r in range(R):
            out = torch.zeros(len(rows[r]), H, D, dtype=torch.float64)
            lse = torch.full((H, len(rows[r])), -math.inf, dtype=torch.float64)
            for j, blk in enumerate(ring_varlen_blocks(lens, R, r, causal)):
                if blk is None:
                    continue
                assert int(blk.seg_q.sum()) == len(rows[r]) and int(blk.seg_k.sum()) == len(rows[j])
                cu_q = torch.cat([torch.zeros(1, dtype=torch.long), blk.seg_q.cumsum(0)]).int()
                cu_k = torch.cat([torch.zeros(1, dtype=torch.long), blk.seg_k.cumsum(0)]).int()
                o, l = backend.varlen_forward(
                    q[rows[r]], k[rows[j]], v[rows[j]], cu_q, cu_k, blk.max_seqlen_q,
                    blk.max_seqlen_k, causal=blk.causal, scale=D ** -0.5,
                )
                out, lse = merge(out, lse, o, l)
            assert torch.allclose(out, ref[rows[r]], atol=1e-12)
            assert torch.allclose(lse, ref_lse[:, rows[r]], atol=1e-12)


# --- balance ------------------------------------------------------------------------------------


def _ratio(work: list[int]) -> float:
    return max(work) * len(work) / sum(work) if sum(work) else 1.0


def _deviation_bound(lens: list[int], R: int) -> int:
    """Upper bound on ``|W_r - mean|`` summed over sequences (see the test below)."""
    if R == 1:
        return 0
    return sum((2 * R - 2) * (n // (2 * R) + 1) for n in lens if n % (2 * R))


def _balanced_by_theorem(lens: list[int], R: int) -> bool:
    """``sum n(n+1) >= 40 (R-1) (T + 2R S)``: then max/mean <= 1.05 (see below)."""
    return sum(n * (n + 1) for n in lens) >= 40 * (R - 1) * (sum(lens) + 2 * R * len(lens))


lengths = st.lists(
    st.one_of(st.integers(0, 40), st.integers(41, 2000), st.integers(2000, 20000)),
    min_size=1, max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(lens=lengths, R=st.sampled_from([2, 3, 4, 8, 16]))
def test_causal_work_deviation_bound(lens, R):
    """Exact per-sequence work and a deviation bound valid for every mix.

    For a sequence of length ``n = 2Rc + e`` (``0 <= e < 2R``), ring rank ``r`` attends
    ``W_r = 2Rc^2 + c + c G_r(e) + K_r(e)`` causal pairs, with ``g_i = 2i+1 if i < e else e``,
    ``G_r = g_r + g_{2R-1-r}``, ``h_i = i+1 if i < e else 0``, ``K_r = h_r + h_{2R-1-r}``. The mean
    over ranks is ``n(n+1)/2R`` and ``|G_r - 2e|, |K_r - e(e+1)/2R| <= 2R-2``, so
    ``|W_r - n(n+1)/2R| <= (2R-2)(c+1)`` (and 0 when ``2R | n``). Summing over sequences:
    ``max/mean - 1 <= 2R * sum_s (2R-2)(c_s+1) / sum_s n_s(n_s+1)``; with ``c + 1 <= (n + 2R)/2R``
    this is ``<= 0.05`` whenever ``sum n(n+1) >= 40 (R-1) (T + 2R S)``.
    """
    for n in set(lens):
        c, e = divmod(n, 2 * R)
        g = [2 * i + 1 if i < e else e for i in range(2 * R)]
        h = [i + 1 if i < e else 0 for i in range(2 * R)]
        expect = [2 * R * c * c + c + c * (g[r] + g[-1 - r]) + h[r] + h[-1 - r] for r in range(R)]
        assert varlen_work([n], (R, 1), True) == expect
    work = varlen_work(lens, (R, 1), True)
    mean = sum(n * (n + 1) for n in lens) / (2 * R)
    assert max(abs(w - mean) for w in work) <= _deviation_bound(lens, R) + 1e-6 * mean
    if _balanced_by_theorem(lens, R):
        assert _ratio(work) <= 1.05


@settings(max_examples=300, deadline=None)
@given(
    lens=lengths,
    RU=st.sampled_from(CONFIGS[1:] + [(8, 1), (4, 2), (8, 2), (2, 8)]),
    seed=st.integers(0, 2**16),
)
def test_causal_balance_random_mixes(lens, RU, seed):
    """max/mean <= 1.05 over the CP group for random mixes with total >= 64x CP that meet the
    condition of ``test_causal_work_deviation_bound`` -- made to hold by adding long documents,
    as a packer filling a context would."""
    R, U = RU
    rng = random.Random(seed)
    lens = list(lens)
    while sum(lens) < 64 * R * U or not _balanced_by_theorem(lens, R):
        lens.insert(rng.randrange(len(lens) + 1), rng.randint(64 * R, 400 * R))
    assert _ratio(varlen_work(lens, (R, U), True)) <= 1.05
    assert _ratio(varlen_work(lens, (R, U), True, num_heads=8 * U)) <= 1.05  # heads divide U


def _lognormal_mix(rng: random.Random, total: int, median: int, sigma: float) -> list[int]:
    lens = []
    while sum(lens) < total:
        lens.append(max(1, int(rng.lognormvariate(math.log(median), sigma))))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n]


def test_causal_balance_realistic_mixes():
    """Log-normal document lengths packed into 32k..128k contexts: well inside 1.05."""
    rng = random.Random(0)
    for total in (32768, 131072):
        for R, U in [(2, 1), (4, 1), (8, 1), (2, 4), (4, 2), (8, 2)]:
            for median in (64, 600, 4000):
                lens = _lognormal_mix(rng, total, median, 1.2)
                assert _ratio(varlen_work(lens, (R, U), True)) <= 1.05, (total, R, U, median)


def test_causal_balance_fails_for_short_documents():
    """Why the bound needs more than ``total >= 64 x CP``: it is about lengths, not the total.

    The placement puts the extra tokens of ``split_sizes(n, 2R)`` on the first chunks, so for
    documents shorter than ``2R`` low ring ranks get all tokens; no total fixes that.
    """
    R, U = 4, 2
    ones = [1] * (64 * R * U)
    assert varlen_work(ones, (R, U), True)[::U] == [64 * R * U, 0, 0, 0]
    assert _ratio(varlen_work(ones, (R, U), True)) == R
    # A 64 x CP mix of moderate lengths that misses the condition, and 1.05 with it.
    mix = [61, 62, 61, 62, 62, 61, 62, 61]  # total 492 >= 64 * 4 * 1 = 256
    assert not _balanced_by_theorem(mix, 4)
    assert _ratio(varlen_work(mix, (4, 1), True)) > 1.05


# --- distributed correctness --------------------------------------------------------------------


def _run_cases(R: int, U: int, cases: list[dict]) -> list[tuple]:
    """On every rank: varlen_attention vs the float64 reference; returns max errors per case."""
    state = seqpar.ParallelState(ring_size=R, ulysses_size=U)
    results = []
    for case in cases:
        lens, causal = case["lens"], case["causal"]
        H, Hkv, D, dtype = case["H"], case["Hkv"], case["D"], case.get("dtype", torch.float32)
        gen = torch.Generator().manual_seed(case["seed"])
        T = sum(lens)
        full = [torch.randn(T, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
        q, k, v, dout = (t.to(dtype).requires_grad_(i < 3) for i, t in enumerate(full))
        ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = reference_varlen_attention(*ref_inputs, lens, causal=causal)
        if ref.requires_grad:
            ref_grads = torch.autograd.grad((ref * dout.double()).sum(), ref_inputs)
        else:  # no tokens at all
            ref_grads = [torch.zeros_like(t) for t in ref_inputs]

        ql, kl, vl = (seqpar.shard_packed(t, state, lens) for t in (q, k, v))
        out = seqpar.varlen_attention(ql, kl, vl, state, lens, causal=causal, backend=case["backend"])
        (out * seqpar.shard_packed(dout, state, lens)).sum().backward()
        grads = []
        for t in (q, k, v):
            g = t.grad.clone()
            if state.cp_size > 1:
                dist.all_reduce(g, group=state.cp_group)
            grads.append(g)
        err_out = (out.double() - seqpar.shard_packed(ref, state, lens)).abs().max().item() if out.numel() else 0.0
        errs = [(g.double() - r).abs().max().item() if g.numel() else 0.0 for g, r in zip(grads, ref_grads)]
        results.append((case["name"], out.dtype == dtype, tuple(out.shape), err_out, *errs))
    return results


def _cases(R: int, U: int, heads: list[tuple[int, int]], backends=("cpu",)) -> list[dict]:
    cases = []
    for m, lens in enumerate(_mixes(R, seed=R * 7 + U)):
        for causal in (False, True):
            for hi, (H, Hkv) in enumerate(heads):
                backend = backends[(m + hi) % len(backends)]
                cases.append(dict(
                    name=f"R{R}U{U} mix{m} causal={causal} H={H} Hkv={Hkv} {backend} lens={lens}",
                    lens=lens, causal=causal, H=H, Hkv=Hkv, D=8, seed=100 * m + 10 * hi + causal,
                    backend=backend,
                ))
    return cases


def _check(pools, world: int, R: int, U: int, cases: list[dict], tol: float = TOL) -> None:
    per_rank = pools(world).run(_run_cases, R, U, cases)
    shard_lens = {c["name"]: layout.packed_shard_lengths(c["lens"], R, U) for c in cases}
    for rank, results in enumerate(per_rank):
        cp = rank % (R * U)
        for name, dtype_ok, shape, *errs in results:
            assert dtype_ok, name
            assert shape[0] == shard_lens[name][cp], (name, shape)
            assert max(errs) < tol, (name, rank, errs)


# Head configurations: plain MHA, GQA, heads not dividing U, Hkv < U, and H < U (a rank idle).
HEADS = [(4, 4), (6, 2), (3, 1)]


@pytest.mark.parametrize("R,U", [(1, 1), (2, 1), (1, 2)])
def test_matches_reference_small(pools, R, U):
    _check(pools, R * U, R, U, _cases(R, U, HEADS, backends=("cpu", "reference")))


@pytest.mark.parametrize("R,U", [(3, 1), (1, 3)])
def test_matches_reference_world3(pools, R, U):
    _check(pools, 3, R, U, _cases(R, U, HEADS))


@pytest.mark.parametrize("R,U", [(2, 2), (4, 1), (1, 4), (2, 1)])
def test_matches_reference_world4(pools, R, U):
    # (2, 1) on 4 ranks: two data-parallel replicas of a 2-rank ring.
    _check(pools, 4, R, U, _cases(R, U, HEADS))


def test_matches_reference_world8(pools):
    # (3, 1): H < U, so Ulysses rank 3 has no head and sits out with its ring partner.
    _check(pools, 8, 2, 4, _cases(2, 4, [(4, 4), (6, 2), (3, 1)]))


def test_tiny_and_empty_batches(pools):
    """Ranks without a token, and no token at all: outputs [0, H, D], zero gradients."""
    for R, U in [(2, 2), (1, 4)]:
        cases = [
            dict(name=f"{lens} causal={causal}", lens=lens, causal=causal, H=3, Hkv=1, D=4,
                 seed=len(lens), backend="cpu")
            for lens in ([1], [2], [], [0, 0], [3, 0, 1])
            for causal in (False, True)
        ]
        _check(pools, 4, R, U, cases)


def test_bf16_keeps_dtype(pools):
    """bf16 in, bf16 out; error within bf16 resolution of the float64 reference."""
    cases = _cases(2, 2, [(4, 2)])
    for c in cases:
        c["dtype"] = torch.bfloat16
    _check(pools, 4, 2, 2, cases, tol=0.1)


# --- bad input ----------------------------------------------------------------------------------


def test_errors_single_process():
    state = seqpar.ParallelState()
    q = torch.randn(10, 4, 8)
    k = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = -1"):
        seqpar.varlen_attention(q, k, k, state, [11, -1])
    with pytest.raises(ValueError, match=r"seq_lens \(sum 9, 2 sequences\) place 9 tokens .* holds q/k/v with \[10, 10, 10\]"):
        seqpar.varlen_attention(q, k, k, state, [4, 5])
    with pytest.raises(ValueError, match=r"must be 3-dim \[T_local, heads, head_dim\]"):
        seqpar.varlen_attention(q[None], k[None], k[None], state, [10])
    with pytest.raises(ValueError, match=r"H=4 query heads must be a positive multiple of the Hkv=3"):
        seqpar.varlen_attention(q, torch.randn(10, 3, 8), torch.randn(10, 3, 8), state, [10])
    with pytest.raises(ValueError, match=r"softmax_scale must be a float or None"):
        seqpar.varlen_attention(q, k, k, state, [10], softmax_scale="x")
    with pytest.raises(ValueError, match=r"causal must be True or False, got 1"):
        seqpar.varlen_attention(q, k, k, state, [10], causal=1)


def _bad_input_cases(R: int, U: int) -> list[str]:
    """On every rank: wrong total, negative length, one rank's tensors too short."""
    state = seqpar.ParallelState(ring_size=R, ulysses_size=U)
    lens = [7, 1, 12]
    x = torch.randn(sum(lens), 2, 4)
    local = seqpar.shard_packed(x, state, lens)
    msgs = []
    with pytest.raises(ValueError, match=r"seq_lens \(sum 19, 3 sequences\) place .* global total 20") as e:
        seqpar.varlen_attention(local, local, local, state, [7, 1, 11])
    msgs.append(str(e.value))
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = -12"):
        seqpar.varlen_attention(local, local, local, state, [7, 1, -12])
    short = local[:-1] if state.cp_rank == R * U - 1 else local
    with pytest.raises(ValueError, match=rf"cp rank {R * U - 1} of ring {R} x ulysses {U}"):
        seqpar.varlen_attention(short, short, short, state, lens)
    wide = torch.randn(local.shape[0], 2, 8) if state.cp_rank == 0 else local
    with pytest.raises(ValueError, match=r"disagree on \(H, Hkv, D\): \[\[2, 2, 8\], \[2, 2, 4\]\]"):
        seqpar.varlen_attention(wide, wide, wide, state, lens)
    return msgs


@pytest.mark.parametrize("R,U", [(1, 2), (2, 1)])
def test_errors_on_every_rank(pools, R, U):
    msgs = pools(2).run(_bad_input_cases, R, U)
    assert msgs[0] == msgs[1]  # the same message on every rank
