"""Packed variable-length attention across hybrid CP (``seqpar.varlen_attention``).

Correctness: every CP configuration against a float64 per-sequence reference, forward and the
gradients of global leaf tensors (summed over the CP group, the partial-gradient convention).
The plan behind it is checked pair by pair in ``test_ring.py``; masks in ``test_masks.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.backends import reference_varlen_attention
from seqpar.placement import Mask, Placement, attention_work, imbalance

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


def test_balance_over_heads_and_ranks():
    """Work per CP rank (heads split by Ulysses): max/mean <= 1.05 for many short documents, which
    the rotated remainders spread over all ring ranks (``docs/sharding.md``)."""
    rng = random.Random(1)
    lens = [rng.randint(1, 64) for _ in range(1000)]
    for R, U in [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4)]:
        work = attention_work(Placement.packed(lens, R, U), Mask(True), num_heads=8 * U)
        assert imbalance(work) <= 1.05, (R, U, imbalance(work))
    # 512 one-token documents: every ring rank gets 1/R of them (the old rule gave ring rank 0 all).
    work = attention_work(Placement.packed([1] * 512, 4, 1), Mask(True))
    assert work == [128, 128, 128, 128]


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
    shard_lens = {c["name"]: Placement.packed(c["lens"], R, U).shard_lengths for c in cases}
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


@pytest.mark.slow
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
    with pytest.raises(ValueError, match=r"seq_lens \(sum 9, 2 sequences\) place 9 tokens .* but it holds 10"):
        seqpar.varlen_attention(q, k, k, state, [4, 5])
    with pytest.raises(ValueError, match=r"must be 3-dim \[T_local, heads, head_dim\]"):
        seqpar.varlen_attention(q[None], k[None], k[None], state, [10])
    with pytest.raises(ValueError, match=r"H=4 query heads must be a positive multiple of the Hkv=3"):
        seqpar.varlen_attention(q, torch.randn(10, 3, 8), torch.randn(10, 3, 8), state, [10])
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite float or None"):
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
    with pytest.raises(ValueError, match=r"seq_lens \(sum 19, 3 sequences\) place .*tokens per cp rank") as e:
        seqpar.varlen_attention(local, local, local, state, [7, 1, 11])
    msgs.append(str(e.value))
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = -12"):
        seqpar.varlen_attention(local, local, local, state, [7, 1, -12])
    short = local[:-1] if state.cp_rank == R * U - 1 else local
    with pytest.raises(ValueError, match=rf"cp rank {R * U - 1} of ring {R} x ulysses {U}"):
        seqpar.varlen_attention(short, short, short, state, lens)
    wide = torch.randn(local.shape[0], 2, 8) if state.cp_rank == 0 else local
    with pytest.raises(ValueError, match=r"disagree on the call: cp rank 0 has \(seq_lens fingerprint"):
        seqpar.varlen_attention(wide, wide, wide, state, lens)
    # Different seq_lens on different ranks that give the same local counts: refused everywhere.
    other = [7, 1, 12] if state.cp_rank == 0 else [1, 7, 12]
    if Placement.packed(other, R, U).shard_lengths == Placement.packed(lens, R, U).shard_lengths:
        with pytest.raises(ValueError, match=r"disagree on the call"):
            seqpar.varlen_attention(local, local, local, state, other)
        msgs.append("same counts, other seq_lens")
    return msgs


@pytest.mark.parametrize("R,U", [(1, 2), (2, 1)])
def test_errors_on_every_rank(pools, R, U):
    msgs = pools(2).run(_bad_input_cases, R, U)
    assert msgs[0] == msgs[1]  # the same message on every rank
