"""A closed ParallelState refuses every later call through it, also the backward of a call made
before ``close`` (Note [Closed states] in ``seqpar.state``), with seqpar's closed-state error on
every rank -- whether the call's groups were destroyed (sub-groups) or are the parent itself (a
4 x 1 ring over the whole world) -- while a new state over the same ranks stays exact."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar import ParallelState
from seqpar.backends.reference import reference_attention

S, H, D = 19, 4, 8
# (ring, ulysses, options) on 4 ranks: sub-groups of a hybrid, a ring over the whole world, a
# Ulysses group over it, the head-shard nodes, the all-gather ring, and CP 2 x DP 2
CASES = [
    (2, 2, {}), (4, 1, {}), (1, 4, {}), (2, 2, {"keep_head_shards": True}), (4, 1, {"ring_comm": "allgather"}),
    (2, 1, {}),
]


def _outcome(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _rank_closed(ring: int, ulysses: int, options: dict) -> dict:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    out = {}

    state = ParallelState(ring, ulysses, **options)
    leaves = [seqpar.shard(t, state).requires_grad_() for t in (q, k, v)]
    o = seqpar.attention(*leaves, state, causal=True)
    state.close()
    out["backward"] = _outcome(lambda: o.sum().backward())
    out["forward"] = _outcome(lambda: seqpar.attention(*leaves, state, causal=True))

    if state.dp_size > 1:  # the CP group is a sub-group: the gather's backward meets a destroyed group
        state = ParallelState(ring, ulysses, **options)
        full = seqpar.unshard(seqpar.shard(q.clone().requires_grad_(), state), state)
        state.close()
        out["unshard_backward"] = _outcome(lambda: full.sum().backward())

    # a new state over the same ranks, and one sharing a closed state's workspace, stay exact
    first, state = ParallelState(ring, ulysses, **options), ParallelState(ring, ulysses, **options)
    state.workspace = first.workspace
    first.close()
    leaves = [seqpar.shard(t, state).requires_grad_() for t in (q, k, v)]
    o = seqpar.attention(*leaves, state, causal=True)
    grads = torch.autograd.grad(o.sum(), leaves)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*ref, causal=True)
    want_grads = torch.autograd.grad(want.sum(), ref)
    pairs = [(o, seqpar.shard(want, state))] + [(a, seqpar.shard(b, state)) for a, b in zip(grads, want_grads)]
    out["new_state_error"] = max((a - b).abs().max().item() for a, b in pairs)
    state.close()
    return out


@pytest.fixture(scope="module")
def pool(pools):
    return pools(4)  # a rank left waiting fails the test within the pools' minute


@pytest.mark.parametrize("ring,ulysses,options", CASES)
def test_calls_after_close_raise_seqpar_error_on_every_rank(pool, ring, ulysses, options):
    for rank, r in enumerate(pool.run(_rank_closed, ring, ulysses, options)):
        for call in ("backward", "forward", "unshard_backward"):
            if call in r:
                assert "ParallelState was closed" in r[call], f"rank {rank} {call}: {r[call]}"
                assert "new_group" not in r[call]
        assert r["new_state_error"] < 1e-12, f"rank {rank}"


def test_closed_single_process_state_refuses_backward():
    import os
    import tempfile

    import torch.distributed as dist

    assert not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            state = ParallelState()
            q = torch.randn(1, S, H, D, dtype=torch.float64, requires_grad=True)
            o = seqpar.attention(q, q, q, state, causal=True)
            state.close()
            with pytest.raises(ValueError, match="ParallelState was closed"):
                o.sum().backward()
        finally:
            dist.destroy_process_group()
