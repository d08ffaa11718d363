"""ParallelState: rank layout, groups and validation."""

import pytest
import torch
import torch.distributed as dist

from seqpar import ParallelState


def test_size_one_state_without_process_group():
    assert not dist.is_initialized()
    s = ParallelState()
    assert (s.ring_size, s.ulysses_size, s.cp_size, s.dp_size) == (1, 1, 1, 1)
    assert (s.ring_rank, s.ulysses_rank, s.cp_rank, s.dp_rank) == (0, 0, 0, 0)
    assert s.cp_group is None and s.ring_group is None
    with pytest.raises(ValueError, match=r"ring_size=2 x ulysses_size=1 needs 2 ranks, but torch.distributed is not initialised"):
        ParallelState(ring_size=2)
    with pytest.raises(ValueError, match=r"ulysses_size must be a positive int, got 0"):
        ParallelState(ulysses_size=0)


def _layout(R, U):
    s = ParallelState(ring_size=R, ulysses_size=U)
    g = dist.get_rank()
    cp = R * U
    assert (s.dp_rank, s.cp_rank) == (g // cp, g % cp)
    assert (s.ring_rank, s.ulysses_rank) == (s.cp_rank // U, s.cp_rank % U)
    assert s.dp_size == dist.get_world_size() // cp and s.cp_size == cp
    # Each group's members, in group-rank order, follow the layout.
    def members(pg):
        return dist.get_process_group_ranks(pg)

    base = s.dp_rank * cp
    assert members(s.cp_group) == list(range(base, base + cp))
    assert members(s.ring_group) == [base + r * U + s.ulysses_rank for r in range(R)]
    assert members(s.ulysses_group) == [base + s.ring_rank * U + u for u in range(U)]
    assert members(s.dp_group) == [d * cp + s.cp_rank for d in range(s.dp_size)]
    assert dist.get_rank(s.ring_group) == s.ring_rank and dist.get_rank(s.ulysses_group) == s.ulysses_rank
    assert dist.get_rank(s.cp_group) == s.cp_rank and dist.get_rank(s.dp_group) == s.dp_rank
    # The groups work: a sum over each axis sees exactly its members.
    for pg, size in [(s.ring_group, R), (s.ulysses_group, U), (s.cp_group, cp), (s.dp_group, s.dp_size)]:
        t = torch.tensor([float(g)])
        dist.all_reduce(t, group=pg)
        assert t.item() == sum(members(pg)) and len(members(pg)) == size
    return repr(s)


@pytest.mark.parametrize(
    "world,R,U",
    [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2), (4, 1, 2), (3, 3, 1), (3, 1, 1)]
    + [pytest.param(*w, marks=pytest.mark.slow) for w in [(8, 2, 2), (8, 2, 4), (8, 4, 2), (8, 1, 1)]],  # 8 ranks: full suite
)
def test_rank_layout(pools, world, R, U):
    reprs = pools(world).run(_layout, R, U)
    assert "ring" in reprs[0]


def _errors():
    n = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"ring_size=3 x ulysses_size=3 = 9 does not divide the {n} ranks"):
        ParallelState(ring_size=3, ulysses_size=3)
    with pytest.raises(ValueError, match=r"group must be a ProcessGroup or None, got int"):
        ParallelState(group=3)
    with pytest.raises(ValueError, match=r"ring_size must be a positive int, got 1.5"):
        ParallelState(ring_size=1.5)
    return True


def test_errors(pools):
    assert all(pools(4).run(_errors))


def _subgroup_parent():
    # Ranks 0-3 and 4-7 each build a state on their own half, independently.
    half = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    mine = half[dist.get_rank() // 4]
    s = ParallelState(ring_size=2, ulysses_size=2, group=mine)
    local = dist.get_rank() % 4
    assert (s.cp_size, s.dp_size, s.cp_rank, s.ring_rank, s.ulysses_rank) == (4, 1, local, local // 2, local % 2)
    assert dist.get_process_group_ranks(s.ring_group) == [dist.get_rank() - local + r * 2 + local % 2 for r in range(2)]
    t = torch.ones(1)
    dist.all_reduce(t, group=s.ulysses_group)
    return t.item()


@pytest.mark.slow
def test_subgroup_parent():
    # Its own pool: sub-group states change the process-group history of only some ranks.
    from seqpar.tools.testing import DistPool

    with DistPool(8) as pool:
        assert pool.run(_subgroup_parent) == [2.0] * 8


def _recreate_over_subgroups(rounds):
    """States over sub-groups built, used and closed again and again, with timeouts that differ
    from the sub-group's (so the state creates its own groups), the halves building different
    numbers of states, and the parent group itself destroyed and made again in between."""
    from datetime import timedelta

    rank = dist.get_rank()
    sums = []
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for i in range(rounds):
        parent = halves[rank // 2]
        extra = 1 + (rank // 2) * (i % 2)  # the second half builds one more state every other round
        for j in range(extra):
            R, U = ((2, 1), (1, 2))[(i + j) % 2]
            with ParallelState(R, U, group=parent, timeout=timedelta(seconds=20 + i)) as s:
                t = torch.ones(1)
                for pg in (s.cp_group, s.ring_group, s.ulysses_group, s.dp_group):
                    dist.all_reduce(t, group=pg)
                sums.append(t.item())
        with ParallelState(2, 1, group=parent) as s:  # the sub-group's own timeout: cp group is the parent
            t = torch.ones(1)
            dist.all_reduce(t, group=s.ring_group)
            sums.append(t.item())
        if i == rounds // 2:  # a new parent over the same ranks
            dist.destroy_process_group(halves[rank // 2])
            halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    with ParallelState(2, 2) as s:  # the default group still makes states alongside
        t = torch.ones(1)
        dist.all_reduce(t, group=s.cp_group)
        sums.append(t.item())
    return sums


@pytest.mark.slow
def test_states_recreated_over_subgroups_after_close():
    # Its own pool and a short timeout: a reused group name made a rank wait for a dead peer.
    from seqpar.tools.testing import DistPool

    with DistPool(4, timeout_s=60) as pool:
        per_rank = pool.run(_recreate_over_subgroups, 4)
    for rank, sums in enumerate(per_rank):
        # Each own-timeout state: 1 -> 2 over cp, x2 over its size-2 ring or Ulysses group = 4;
        # each parent-timeout state: 2 over its ring; the default-group state: 4 over cp.
        want = []
        for i in range(4):
            want += [4.0] * (1 + (rank // 2) * (i % 2)) + [2.0]
        assert sums == [*want, 4.0], (rank, sums)
