"""seqpar.rng: random numbers identical on a CP group, different across DP replicas, and a global
random tensor sharded equal to the single-device one."""

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.rng import cp_generator, synchronize, synchronized


def _draws():
    """4 ranks as ring 2 x dp 2: rank g holds dp_rank g // 2, cp_rank g % 2."""
    state = seqpar.ParallelState(ring_size=2)
    rank = dist.get_rank()
    out = {}
    # cp_generator: no communication.
    out["cp_generator"] = torch.rand(3, generator=cp_generator(state, seed=7)).tolist()
    # synchronize: every rank starts from its own seed, then takes CP rank 0's state.
    torch.manual_seed(100 + rank)
    synchronize(state)
    out["synchronize"] = torch.rand(3).tolist()
    g = torch.Generator().manual_seed(200 + rank)
    assert synchronize(state, g, src=1) is g
    out["generator src 1"] = torch.rand(3, generator=g).tolist()
    out["src 1 own"] = torch.rand(3, generator=torch.Generator().manual_seed(200 + 2 * state.dp_rank + 1)).tolist()
    # synchronized: shared inside, each rank's own stream afterwards.
    torch.manual_seed(300 + rank)
    expected_after = torch.rand(3).tolist()
    torch.manual_seed(300 + rank)
    with synchronized(state, cuda=False):
        out["inside"] = torch.rand(3).tolist()
    out["after"] = torch.rand(3).tolist() == expected_after
    # A dropout mask over the global sequence, then sharded: the single-device mask's shard.
    S = 23
    mask = torch.rand(2, S, generator=cp_generator(state, seed=3)) > 0.5
    want = torch.rand(2, S, generator=torch.Generator().manual_seed(3 * 1_000_003 + state.dp_rank)) > 0.5
    out["dropout shard"] = torch.equal(seqpar.shard(mask, state), seqpar.shard(want, state))
    out["dp_rank"], out["cp_rank"] = state.dp_rank, state.cp_rank
    return out


def test_same_on_cp_ranks_different_across_dp(pools):
    ranks = pools(4).run(_draws)
    for key in ("cp_generator", "synchronize", "generator src 1", "inside"):
        by_dp = {}
        for r in ranks:
            by_dp.setdefault(r["dp_rank"], []).append(r[key])
        for dp, draws in by_dp.items():
            assert all(d == draws[0] for d in draws), (key, dp, draws)
        assert by_dp[0][0] != by_dp[1][0], key  # replicas draw differently
    for r in ranks:
        assert r["generator src 1"] == r["src 1 own"]  # CP rank 1's own stream
        assert r["after"] and r["dropout shard"]


def test_single_process_and_bad_arguments():
    state = seqpar.ParallelState()
    g = torch.Generator().manual_seed(5)
    before = g.get_state()
    assert synchronize(state, g) is g and torch.equal(g.get_state(), before)
    a = torch.rand(2, generator=cp_generator(state, 11))
    assert torch.equal(a, torch.rand(2, generator=cp_generator(state, 11)))
    with synchronized(state, cuda=False):
        torch.rand(1)
    with pytest.raises(ValueError, match="src=3 is not a CP rank"):
        synchronize(state, src=3)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        cp_generator(state, -1)
    with pytest.raises(ValueError, match="ParallelState"):
        cp_generator(object(), 1)
