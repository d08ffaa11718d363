"""Token placement (Placement, shard, unshard, packed) against the contract, forward and backward.

The oracles below transcribe the rule of ``docs/sharding.md`` (Note [Sharding placement]) token by
token; the library computes it vectorised over sequences.
"""

import pytest
import torch
import torch.distributed as dist

from _common import quick_up_to
import seqpar
from seqpar.placement import Placement, split_sizes

CONFIGS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (4, 1), (1, 4), (2, 4), (4, 2)]
LENGTHS = [1, 2, 3, 5, 7, 37]
PACKED = [[5], [1, 1, 1], [37, 1, 5], [3, 0, 2, 1], [1], [2, 9, 1, 1, 4]]


def _chunk_sizes(n, R, origin):
    """Chunk sizes of an ``n``-token sequence at packed offset ``origin`` (docs/sharding.md)."""
    P = 2 * R
    return [n // P + ((c - origin) % P < n % P) for c in range(P)]


def contract_positions(seq_len, R, r, U, u, origin=0):
    """Straight transcription of the placement (dense: ``origin = 0``), as the test's oracle."""
    if R > 1:
        chunks = _chunk_sizes(seq_len, R, origin)
        starts = [sum(chunks[:i]) for i in range(2 * R)]
        ring_local = list(range(starts[r], starts[r] + chunks[r]))
        c = 2 * R - 1 - r
        ring_local += list(range(starts[c], starts[c] + chunks[c]))
    else:
        ring_local = list(range(seq_len))
    parts = split_sizes(len(ring_local), U)
    a = sum(parts[:u])
    return ring_local[a : a + parts[u]]


def contract_packed_positions(seq_lens, R, r, U, u):
    ring_local, off = [], 0
    for n in seq_lens:
        ring_local += [off + p for p in contract_positions(n, R, r, 1, 0, origin=off)]
        off += n
    parts = split_sizes(len(ring_local), U)
    a = sum(parts[:u])
    return ring_local[a : a + parts[u]]


def test_split_sizes():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(3, 4) == [1, 1, 1, 0]
    assert split_sizes(0, 3) == [0, 0, 0]
    assert _chunk_sizes(10, 2, 0) == split_sizes(10, 4)  # the dense contract
    assert _chunk_sizes(3, 2, 3) == [1, 1, 0, 1] and _chunk_sizes(6, 2, 1) == [1, 2, 2, 1]
    with pytest.raises(ValueError, match=r"parts must be a positive int, got 0"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match=r"n must be a non-negative int, got -1"):
        split_sizes(-1, 2)


@pytest.mark.parametrize("R,U", CONFIGS)
@pytest.mark.parametrize("seq_len", LENGTHS + [64, 129])
def test_layout_matches_contract(R, U, seq_len):
    all_pos = []
    placement = Placement.dense(seq_len, R, U)
    for r in range(R):
        for u in range(U):
            pos = placement.global_index(r * U + u).tolist()
            assert pos == contract_positions(seq_len, R, r, U, u)
            all_pos += pos
    assert list(placement.shard_lengths) == [
        len(contract_positions(seq_len, R, r, U, u)) for r in range(R) for u in range(U)
    ]
    assert placement.permutation().tolist() == all_pos
    assert sorted(all_pos) == list(range(seq_len))


@pytest.mark.parametrize("R,U", CONFIGS)
@pytest.mark.parametrize("seq_lens", PACKED)
def test_packed_layout_matches_contract(R, U, seq_lens):
    all_pos = []
    placement = Placement.packed(seq_lens, R, U)
    starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
    for r in range(R):
        for u in range(U):
            pos = placement.global_index(r * U + u).tolist()
            assert pos == contract_packed_positions(seq_lens, R, r, U, u)
            ids, within = placement.local_tokens(r * U + u)
            assert [starts[i] + p for i, p in zip(ids.tolist(), within.tolist())] == pos
            counts = placement.local_seq_lens(r * U + u).tolist()
            assert counts == [ids.tolist().count(i) for i in range(len(seq_lens))]
            all_pos += pos
    assert placement.permutation().tolist() == all_pos
    assert sorted(all_pos) == list(range(sum(seq_lens)))


def _shard_cases(R, U):
    state = seqpar.ParallelState(ring_size=R, ulysses_size=U)
    cp, r, u = state.cp_rank, state.ring_rank, state.ulysses_rank
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for seq_len in LENGTHS:
            g = torch.Generator().manual_seed(seq_len)
            x = torch.randn(2, seq_len, 3, generator=g).to(dtype)
            pos = contract_positions(seq_len, R, r, U, u)
            assert seqpar.shard_positions(seq_len, state).tolist() == pos
            # shard: forward picks the contract's tokens; backward scatters into zeros.
            leaf = x.clone().requires_grad_()
            local = seqpar.shard(leaf, state, dim=1)
            assert torch.equal(local, x[:, pos]), (dtype, seq_len, "shard")
            w = torch.randn(local.shape, generator=torch.Generator().manual_seed(cp)).to(dtype)
            (local * w).sum().backward()
            want = torch.zeros_like(x)
            want[:, pos] = w
            assert torch.equal(leaf.grad, want), (dtype, seq_len, "shard bwd")
            # unshard: exact inverse, with and without the global size.
            for size in (seq_len, None):
                loc = x[:, pos].clone().requires_grad_()
                full = seqpar.unshard(loc, state, dim=1, size=size)
                assert torch.equal(full, x), (dtype, seq_len, size, "unshard")
            # unshard backward reduce-scatters per-rank partial gradients (integers: exact sums).
            part = torch.randint(-4, 4, x.shape, generator=torch.Generator().manual_seed(10 + cp)).to(dtype)
            (full * part).sum().backward()
            total = sum(
                torch.randint(-4, 4, x.shape, generator=torch.Generator().manual_seed(10 + c)).to(dtype)
                for c in range(state.cp_size)
            )
            assert torch.equal(loc.grad, total[:, pos]), (dtype, seq_len, "unshard bwd")
            # Other dims: sequence along dim 0 and along a negative dim.
            y = x.transpose(0, 1)
            assert torch.equal(seqpar.shard(y, state, dim=0), y[pos])
            assert torch.equal(seqpar.unshard(seqpar.shard(y, state, dim=-3), state, dim=-3), y)
    for seq_lens in PACKED:
        T = sum(seq_lens)
        x = torch.randn(T, 2, 3, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
        pos = contract_packed_positions(seq_lens, R, r, U, u)
        leaf = x.clone().requires_grad_()
        local = seqpar.shard_packed(leaf, state, seq_lens)
        assert torch.equal(local, x[pos]), (seq_lens, "shard_packed")
        local.sum().backward()
        want = torch.zeros_like(x)
        want[pos] = 1
        assert torch.equal(leaf.grad, want), (seq_lens, "shard_packed bwd")
        starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
        within = [p - max(s for s in starts if s <= p and s < T) for p in pos]
        assert seqpar.shard_packed_positions(seq_lens, state).tolist() == within, seq_lens
        loc = x[pos].clone().requires_grad_()
        full = seqpar.unshard_packed(loc, state, seq_lens)
        assert torch.equal(full, x), (seq_lens, "unshard_packed")
        (full * (cp + 1)).sum().backward()
        cp_sum = state.cp_size * (state.cp_size + 1) / 2
        assert torch.equal(loc.grad, torch.full_like(loc, cp_sum)), (seq_lens, "unshard_packed bwd")
    return True


@pytest.mark.parametrize("R,U", quick_up_to(4, CONFIGS))
def test_shard_unshard(pools, R, U):
    assert all(pools(R * U).run(_shard_cases, R, U))


def _bad_sharding_cases():
    n = dist.get_world_size()
    state = seqpar.ParallelState(ring_size=n)
    x = torch.zeros(2, 7, 3)
    cases = [
        (lambda: seqpar.shard(x, state, dim=3), r"dim=3 is out of range for a 3-dim tensor"),
        (lambda: seqpar.shard([1, 2], state), r"expected a tensor, got list"),
        (lambda: seqpar.shard(x, "state"), r"state must be a seqpar.ParallelState"),
        (lambda: seqpar.unshard(x, state, dim=1, size=100 * n), r"holds 7 tokens along dim 1, but size="),
        (lambda: seqpar.shard_positions(-2, state), r"seq_len must be a non-negative int, got -2"),
        (lambda: seqpar.shard_packed(x, state, [3, 3], dim=1), r"seq_lens sum to 6 but x has 7 tokens"),
        (lambda: seqpar.shard_packed(x, state, [8, -1], dim=1), r"seq_lens\[1\] = -1"),
        (lambda: seqpar.unshard_packed(x, state, [100 * n], dim=1), r"holds 7 tokens along dim 1"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()
    if n > 1:
        # Local lengths that are no placement of any length: every rank raises the same error.
        bad = torch.zeros(1, 2 if dist.get_rank() == 0 else 0)
        with pytest.raises(ValueError, match=r"the CP ranks hold \[2, 0"):
            seqpar.unshard(bad, state, dim=1)
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_bad_input(pools, world):
    assert all(pools(world).run(_bad_sharding_cases))
