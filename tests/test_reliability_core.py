"""Never silently wrong, round 3: the core's findings (``docs/troubleshooting.md``).

- packed ``seq_lens`` that differ between ranks but share count, sum and any weighted moment;
- options that eager refuses must not be coerced under ``torch.compile``;
- sinks with fewer query heads than Ulysses ranks: every rank returns a (zero) gradient share;
- compiled code with several ``ParallelState`` objects or ``dynamic=True``;
- messages: ``Hkv = 0``, numpy / tensor sizes, ``cu_seqlens`` passed as ``seq_lens``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar import ParallelState
from seqpar.backends import reference_attention


# ---------------------------------------------------------------------------------------------
# 1. seq_lens that differ between ranks are refused on every rank


def _rank_seq_lens_differ(pairs: list[tuple[list[int], list[int]]], ring: int) -> list[str]:
    """Rank 0 passes ``a``, every other rank ``b``; each holds its own placement's share."""
    state = ParallelState(ring_size=ring, ulysses_size=dist.get_world_size() // ring)
    messages = []
    for a, b in pairs:
        lens = a if dist.get_rank() == 0 else b
        T = seqpar.placement.Placement.packed(lens, state.ring_size, state.ulysses_size).shard_lengths[state.cp_rank]
        q = torch.randn(T, 2, 8, dtype=torch.float64)
        try:
            seqpar.varlen_attention(q, q, q, state, lens, causal=True)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    state.close()
    return messages


def _same_count_and_sum(rng: random.Random) -> tuple[list[int], list[int]]:
    n = rng.randint(2, 7)
    a = [rng.randint(0, 9) for _ in range(n)]
    a[0] += 1  # some mass to move
    b = list(a)
    while b == a:  # move mass between two entries: count and sum unchanged
        i, j = rng.sample(range(n), 2)
        d = rng.randint(1, 3)
        if b[i] >= d:
            b[i] -= d
            b[j] += d
    return a, b


@pytest.mark.parametrize("ring", [1, 2])
def test_seq_lens_that_differ_between_ranks_raise_on_every_rank(pools, ring):
    rng = random.Random(ring)
    # The reported instance (equal count, sum and the old weighted moment) and random ones.
    pairs = [([2, 1, 2], [1, 3, 1])] + [_same_count_and_sum(rng) for _ in range(25)]
    for rank, messages in enumerate(pools(2).run(_rank_seq_lens_differ, pairs, ring)):
        for (a, b), msg in zip(pairs, messages):
            assert "disagree on the call" in msg or "place" in msg, f"rank {rank}: {a} vs {b}: {msg}"


# ---------------------------------------------------------------------------------------------
# 2. Under torch.compile, options are validated before any conversion, as in eager mode


_BAD_OPTIONS = [
    (dict(causal="False"), "causal must be True or False, got 'False'"),
    (dict(causal=np.bool_(True)), "causal must be True or False, got numpy"),
    (dict(causal=1), "causal must be True or False, got 1"),
    (dict(window=(2.7, 0)), r"window must be \(left, right\) with ints"),
    (dict(softcap=True), "softcap must be a finite float"),
    (dict(softcap=float("nan")), "softcap must be a finite float"),
    (dict(chunk_size=2.0), "chunk_size must be a positive int"),
    (dict(softmax_scale=float("inf")), "softmax_scale must be a finite float"),
    (dict(replicated_prefix=1.5), "replicated_prefix must be a non-negative int"),
    (dict(layout="BSHD"), "unknown layout 'BSHD'"),
]


@pytest.mark.parametrize("options, match", _BAD_OPTIONS, ids=[str(o) for o, _ in _BAD_OPTIONS])
def test_compiled_options_refused_as_in_eager(options, match):
    state = ParallelState()
    q = torch.randn(1, 9, 4, 8)
    k = v = torch.randn(1, 9, 2, 8)
    with pytest.raises(ValueError, match=match):
        seqpar.attention(q, k, v, state, **options)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: seqpar.attention(q, k, v, state, **options), backend="aot_eager")
    with pytest.raises(ValueError, match=match):  # the same error, never a coerced run
        compiled(q, k, v)
    # fullgraph=True: dynamo reports the same error as the cause of its own.
    torch._dynamo.reset()
    strict = torch.compile(lambda q, k, v: seqpar.attention(q, k, v, state, **options), backend="aot_eager",
                           fullgraph=True)
    with pytest.raises(Exception) as info:
        strict(q, k, v)
    assert "ValueError" in repr(info.value.__cause__) or isinstance(info.value, ValueError), repr(info.value)


def test_compiled_varlen_options_refused_as_in_eager():
    state = ParallelState()
    q = torch.randn(7, 4, 8)
    for options, match in [(dict(causal="yes"), "causal must be True or False"),
                           (dict(window=(1.5, 1)), r"window must be \(left, right\)")]:
        with pytest.raises(ValueError, match=match):
            seqpar.varlen_attention(q, q, q, state, [3, 4], **options)
        torch._dynamo.reset()
        compiled = torch.compile(lambda q: seqpar.varlen_attention(q, q, q, state, [3, 4], **options),
                                 backend="aot_eager")
        with pytest.raises(ValueError, match=match):
            compiled(q)


# ---------------------------------------------------------------------------------------------
# 8. Several states and dynamic=True under torch.compile


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_with_two_states(dynamic):
    torch._dynamo.reset()
    a, b = ParallelState(), ParallelState()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 11, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    fn = torch.compile(lambda q, k, v, s: seqpar.attention(q, k, v, s, causal=True), backend="aot_eager",
                       fullgraph=True, dynamic=dynamic)
    want = reference_attention(q, k, v, causal=True)
    for state in (a, b, a):
        out = fn(q, k, v, state)
        assert (out - want).abs().max().item() < 1e-10
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        ref_grads = torch.autograd.grad(want.sum(), (q, k, v), retain_graph=True)
        assert max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)) < 1e-10


# ---------------------------------------------------------------------------------------------
# 7. Sinks with fewer query heads than Ulysses ranks: a gradient share on every rank


def _rank_sinks_few_heads(H: int, Hkv: int, ring: int, compiled: bool) -> tuple[bool, float]:
    world = dist.get_world_size()
    state = ParallelState(ring_size=ring, ulysses_size=world // ring)
    gen = torch.Generator().manual_seed(11)
    S = 13
    q, k, v = (torch.randn(1, S, n, 8, generator=gen, dtype=torch.float64) for n in (H, Hkv, Hkv))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, S, H, 8, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = reference_attention(*leaves[:3], causal=True, sinks=leaves[3])
    ref_dsinks = torch.autograd.grad(ref, leaves[3], dout)[0]
    local = [seqpar.shard(t, state).requires_grad_() for t in (q, k, v)]
    mine = sinks.clone().requires_grad_()

    def run(q, k, v, s):
        return seqpar.attention(q, k, v, state, causal=True, sinks=s, seq_len=S)

    fn = torch.compile(run, backend="aot_eager", fullgraph=True) if compiled else run
    out = fn(*local, mine)
    (out * seqpar.shard(dout, state)).sum().backward()
    has_grad = mine.grad is not None
    total = mine.grad.clone() if has_grad else torch.zeros_like(sinks)
    dist.all_reduce(total, group=state.cp_group)  # partial shares sum to the true gradient
    err = (total - ref_dsinks).abs().max().item()
    err = max(err, (out - seqpar.shard(ref, state)).abs().max().item())
    state.close()
    return has_grad, err


@pytest.mark.parametrize("H, Hkv, ring, compiled", [(1, 1, 1, False), (2, 1, 1, False), (3, 3, 1, False),
                                                     (2, 2, 2, False), (2, 1, 1, True)])
def test_sinks_with_fewer_heads_than_ulysses_ranks(pools, H, Hkv, ring, compiled):
    for rank, (has_grad, err) in enumerate(pools(4).run(_rank_sinks_few_heads, H, Hkv, ring, compiled)):
        assert has_grad, f"rank {rank}: sinks.grad is None (H={H} < ulysses ranks)"
        assert err < 1e-10, f"rank {rank}: error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# 11. Messages


def test_zero_kv_heads_is_a_value_error():
    state = ParallelState()
    q = torch.randn(1, 5, 4, 8)
    kv = torch.randn(1, 5, 0, 8)
    with pytest.raises(ValueError, match=r"H=4 query heads must be a positive multiple of the Hkv=0"):
        seqpar.attention(q, kv, kv, state)
    with pytest.raises(ValueError, match=r"Hkv=0"):
        seqpar.varlen_attention(q[0], kv[0], kv[0], state, [5])


@pytest.mark.parametrize("gather_size", [np.int64(10), torch.tensor(10), 10, [10]])
def test_all_to_all_accepts_integer_scalars(gather_size):
    x = torch.randn(10, 4)
    assert torch.equal(seqpar.comm.all_to_all(x, None, 1, 0, gather_size=gather_size), x)


@pytest.mark.parametrize("gather_size, match", [(10.0, "must be a non-negative int, got 10.0"),
                                                ("10", "must be an int, a list of ints or None"),
                                                (True, "must be a non-negative int, got True")])
def test_all_to_all_refuses_other_sizes(gather_size, match):
    with pytest.raises(ValueError, match=match):
        seqpar.comm.all_to_all(torch.randn(10, 4), None, 1, 0, gather_size=gather_size)


def test_cu_seqlens_passed_as_seq_lens_is_named():
    state = ParallelState()
    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match=r"look like cumulative offsets \(cu_seqlens\)"):
        seqpar.varlen_attention(q, q, q, state, [0, 3, 8])
    with pytest.raises(ValueError, match=r"look like cumulative offsets"):
        seqpar.varlen_attention(q, q, q, state, torch.tensor([0, 3, 8], dtype=torch.int32))


def _rank_refusal_next_to_varlen(_: None) -> str:
    """Rank 0 refuses (an integration's one-rank check) while rank 1 enters varlen_attention."""
    from seqpar.attention import refuse_collectively

    state = ParallelState(ring_size=1, ulysses_size=2)
    try:
        if dist.get_rank() == 0:
            refuse_collectively(state, torch.device("cpu"), None, ValueError("rank 0: its own reason"))
        q = torch.randn(2, 2, 8)
        seqpar.varlen_attention(q, q, q, state, [4], causal=True)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        state.close()


def test_a_refusal_next_to_a_packed_call_raises_on_every_rank(pools):
    """Every exchange sends rows of one length, so a refusal pairs with a packed call's exchange
    (their lengths once differed: the ranks hung)."""
    own, other = pools(2).run(_rank_refusal_next_to_varlen, None)
    assert own == "rank 0: its own reason"
    assert "cp rank 0 refused this call" in other, other
