"""``ParallelState(keep_head_shards=True)``: the Ulysses forward keeps the head shards for the
backward (Note [Ulysses memory] in ``seqpar/parallel/ulysses.py``).

The same float64 matrix as ``test_mla.py`` (every mask, softcap, sinks, joint tokens, layouts,
packed sequences, ``Dv != D``, uneven heads and ``Hkv < U``) on every split with ``U > 1`` of
worlds 2-4, each case against the single-device reference; then what the option promises and
nothing else: the backward sends only dout and the gradients (bytes counted at the collective),
the forward saves the head shards instead of the token shards (bytes counted by a saved-tensor
hook), torch.compile keeps the same trade, and bad values are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from _common import quick_up_to, saved_bytes
from seqpar import ParallelState
from seqpar.backends import reference_attention

from test_mla import TOL, _dense_case, _dense_cases, _packed_case, _packed_cases, _rel_err

_SPLITS = {2: [(1, 2)], 3: [(1, 3)], 4: [(2, 2), (1, 4)]}


def _assert_within_tol(per_rank: list[list[tuple[str, float]]], count: int | None = None) -> None:
    """Every rank's ``(name, error)`` results at most ``TOL`` (and ``count`` of them, if given)."""
    for rank, results in enumerate(per_rank):
        if count is not None:
            assert len(results) == count, (rank, results)
        for name, err in results:
            assert err <= TOL, f"rank {rank}: {name}: error {err:.3g}"


def _rank_matrix(world: int) -> list[tuple[str, float]]:
    results = []
    for RU in _SPLITS[world]:
        state = ParallelState(*RU, keep_head_shards=True)
        assert state.keep_head_shards
        for c in _dense_cases([RU]):
            results.append(_dense_case(state, c))
        for c in _packed_cases([RU]):
            results.append(_packed_case(state, c))
        state.close()
    return results


@pytest.mark.parametrize("world", quick_up_to(3, sorted(_SPLITS)))
def test_keep_head_shards_matches_reference(pools, world):
    expected = sum(len(_dense_cases([RU])) + len(_packed_cases([RU])) for RU in _SPLITS[world])
    _assert_within_tol(pools(world).run(_rank_matrix, world), expected)


def _rank_more_options(RU: tuple[int, int]) -> list[tuple[str, float]]:
    """ALiBi, mask slices (block-causal frames) and the all-gather K/V transport with the option,
    float64 against the reference."""
    from seqpar import MaskSlices

    results = []
    S, H, Hkv, D = 41, 6, 2, 8
    frames = MaskSlices([(0, 9), (9, 30), (30, 41)], [(0, 9), (0, 30), (0, 41)], ["full", "full", "full"])
    cases = {
        "alibi causal": (dict(causal=True), True, "p2p"),
        "frames": (dict(mask=frames), False, "p2p"),
        "allgather causal": (dict(causal=True), False, "allgather"),
        "allgather window + alibi": (dict(causal=True, window=(7, 0)), True, "allgather"),
    }
    for name, (opts, alibi, comm) in cases.items():
        state = ParallelState(*RU, ring_comm=comm, keep_head_shards=True)
        gen = torch.Generator().manual_seed(len(name))
        full = [torch.randn(1, S, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
        slopes = torch.rand(H, generator=gen, dtype=torch.float64) if alibi else None
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        ref = reference_attention(*leaves, alibi_slopes=slopes, **opts)
        want = torch.autograd.grad(ref, leaves, full[3])
        mine = [seqpar.shard(t, state).requires_grad_() for t in full[:3]]
        out = seqpar.attention(*mine, state, alibi_slopes=slopes, seq_len=S, **opts)
        grads = torch.autograd.grad(out, mine, seqpar.shard(full[3], state))
        errs = [_rel_err(out.detach(), seqpar.shard(ref.detach(), state))]
        errs += [_rel_err(g, seqpar.shard(w, state)) for g, w in zip(grads, want)]
        results.append((f"{RU} {name}", max(errs)))
        state.close()
    return results


def _rank_kept_arena() -> list[tuple[str, float]]:
    """The option with a kept workspace arena (Note [Workspace]): the head shards outlive their
    scope, so they must never be arena slices; two layers and two steps reuse the arena."""
    from seqpar.comm import Workspace

    state = ParallelState(2, 2, keep_head_shards=True)
    state.workspace = Workspace(keep=True)
    S, H, Hkv, D = 37, 6, 2, 8
    results = []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        full = [torch.randn(1, S, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        # Two layers: the second's inputs are the first's output (values and keys alike).
        ref = reference_attention(leaves[0], leaves[1], leaves[2], causal=True)
        ref = reference_attention(ref, leaves[1], leaves[2], causal=True)
        want = torch.autograd.grad(ref, leaves, full[3])
        mine = [seqpar.shard(t, state).requires_grad_() for t in full[:3]]
        out = seqpar.attention(mine[0], mine[1], mine[2], state, causal=True, seq_len=S)
        out = seqpar.attention(out, mine[1], mine[2], state, causal=True, seq_len=S)
        grads = torch.autograd.grad(out, mine, seqpar.shard(full[3], state))  # sharded leaves: full gradients
        errs = [_rel_err(out.detach(), seqpar.shard(ref.detach(), state))]
        errs += [_rel_err(g, seqpar.shard(w, state)) for g, w in zip(grads, want)]
        results.append((f"step {step}", max(errs)))
    results.append(("arena kept", float(state.workspace.nbytes == 0)))
    state.close()
    return results


def test_keep_head_shards_with_a_kept_arena(pools):
    _assert_within_tol(pools(4).run(_rank_kept_arena), 3)


@pytest.mark.parametrize("world, RU", [(3, (1, 3)), (4, (2, 2))])
def test_keep_head_shards_alibi_mask_slices_allgather(pools, world, RU):
    _assert_within_tol(pools(world).run(_rank_more_options, RU), 4)


# ---------------------------------------------------------------------------------------------
# What the option changes: traffic and saved bytes


def _one_call(state: ParallelState, S: int, H: int, Hkv: int, D: int):
    """Sharded q, k, v leaves, the output and dout of one causal float32 call (seeded, same on
    every rank)."""
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, S, h, D, generator=gen) for h in (H, Hkv, Hkv, H)]
    q, k, v = (seqpar.shard(t, state).clone().requires_grad_() for t in full[:3])
    return q, k, v, seqpar.shard(full[3], state)


def _rank_traffic(keep: bool) -> dict[str, int]:
    """Elements this rank hands to all_to_all_single in the forward and in the backward."""
    state = ParallelState(1, dist.get_world_size(), keep_head_shards=keep)
    sent = {"forward": 0, "backward": 0}
    phase = ["forward"]
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent[phase[0]] += input.numel()
        return original(output, input, *args, **kwargs)

    q, k, v, dout = _one_call(state, S=64, H=4, Hkv=4, D=8)
    dist.all_to_all_single = counting
    try:
        out = seqpar.attention(q, k, v, state, causal=True, seq_len=64)
        phase[0] = "backward"
        out.backward(dout)
    finally:
        dist.all_to_all_single = original
    state.close()
    return sent


def test_keep_head_shards_sends_only_dout_and_gradients(pools):
    # S = 64 tokens of H = Hkv = 4 heads, D = 8, on 4 ranks: one shard is 16 * 4 * 8 elements.
    shard = 16 * 4 * 8
    for rank, (default, kept) in enumerate(zip(pools(4).run(_rank_traffic, False), pools(4).run(_rank_traffic, True))):
        # Forward: q, k, v to heads, out back, in both modes.
        assert default["forward"] == kept["forward"] == 4 * shard, (rank, default, kept)
        # Backward: q, k, v, out, dout to heads and dq, dk, dv back -- or only dout and the gradients.
        assert default["backward"] == 8 * shard, (rank, default)
        assert kept["backward"] == 4 * shard, (rank, kept)


def _rank_saved(keep: bool, H: int, Hkv: int) -> int:
    """Bytes one call saves for its backward (each storage counted once)."""
    state = ParallelState(1, dist.get_world_size(), keep_head_shards=keep)
    q, k, v, _ = _one_call(state, S=64, H=H, Hkv=Hkv, D=8)
    saved = saved_bytes(lambda: seqpar.attention(q, k, v, state, causal=True, seq_len=64))
    state.close()
    return saved


@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 1)])
def test_keep_head_shards_saves_the_head_shards_instead(pools, H, Hkv):
    U, S, D, f32 = 4, 64, 8, 4
    lse = H // U * S * f32  # the ring's log-sum-exp over this rank's heads, both modes
    tokens = (2 * H + 2 * Hkv) * S // U * D * f32  # q, k, v, out of this rank's tokens
    # Every rank receives all S tokens of its H / U query heads and of the K/V heads they use:
    # one K/V head here when Hkv = 1 (sent to every rank), H / U when Hkv = H.
    kv = max(Hkv // U, 1)
    heads = (2 * H // U + 2 * kv) * S * D * f32
    for rank, (default, kept) in enumerate(zip(pools(4).run(_rank_saved, False, H, Hkv),
                                              pools(4).run(_rank_saved, True, H, Hkv))):
        assert default == tokens + lse, (rank, default)
        assert kept == heads + lse, (rank, kept)


# ---------------------------------------------------------------------------------------------
# torch.compile keeps the trade; bad values


def _rank_compiled() -> list[tuple[str, float]]:
    state = ParallelState(1, dist.get_world_size(), keep_head_shards=True)
    gen = torch.Generator().manual_seed(3)
    S, lens, (H, Hkv), (D, Dv) = 29, [7, 1, 13, 10], (6, 2), (8, 4)
    dense = [torch.randn(2, S, h, d, generator=gen, dtype=torch.float64) for h, d in ((H, D), (Hkv, D), (Hkv, Dv))]
    packed = [torch.randn(sum(lens), h, d, generator=gen, dtype=torch.float64)
              for h, d in ((H, D), (Hkv, D), (Hkv, Dv))]

    def f(q, k, v, qp, kp, vp):
        o = seqpar.attention(q, k, v, state, causal=True, layout="bhsd", backend="cpu")
        op = seqpar.varlen_attention(qp, kp, vp, state, lens, causal=True, backend="cpu")
        return o.square().sum() + op.square().sum()

    leaves = [t.clone().requires_grad_() for t in (*dense, *packed)]
    loss = (reference_attention(*leaves[:3], causal=True).square().sum()
            + seqpar.backends.reference_varlen_attention(*leaves[3:], lens, causal=True).square().sum())
    want = torch.autograd.grad(loss, leaves)
    mine = [seqpar.shard(t, state).transpose(1, 2) for t in dense] + [seqpar.shard_packed(t, state, lens) for t in packed]
    mine = [t.detach().clone().requires_grad_() for t in mine]
    torch._dynamo.reset()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        share = torch.compile(f, fullgraph=True, backend="aot_eager")(*mine)
    grads = torch.autograd.grad(share, mine)
    local_want = [seqpar.shard(g, state).transpose(1, 2) for g in want[:3]]
    local_want += [seqpar.shard_packed(g, state, lens) for g in want[3:]]
    results = [(name, _rel_err(g, w)) for name, g, w in zip(["dq", "dk", "dv", "dq packed", "dk packed", "dv packed"],
                                                             grads, local_want)]
    # The head shards were saved (all S tokens of a few heads), the token shards not.
    results.append(("saved head shards", float((2, S, H // 2, D) not in saved)))
    results.append(("saved no token shard", float((2, H, mine[0].shape[2], D) in saved)))
    state.close()
    return results


@pytest.mark.slow
def test_keep_head_shards_compiled(pools):
    _assert_within_tol(pools(2).run(_rank_compiled), 8)


def test_keep_head_shards_must_be_a_bool():
    with pytest.raises(ValueError, match="keep_head_shards must be True or False, got 'yes'"):
        ParallelState(keep_head_shards="yes")
    assert ParallelState(keep_head_shards=True).keep_head_shards is True


def _rank_peaks(S: int, H: int, Hkv: int, D: int) -> dict[str, int]:
    """Peak bytes of one forward+backward created inside it: seqpar's default state, its
    ``keep_head_shards`` state, and autograd through the two all-to-alls around the same CPU
    kernel (``ulysses_attention``: DeepSpeed's and yunchang's form)."""
    from seqpar.backends.cpu import CpuFlashBackend
    from seqpar.parallel.ulysses import ulysses_attention
    from seqpar.tools.profiling import StorageTracker

    U = dist.get_world_size()
    kernel = CpuFlashBackend()

    def inner(q_u, k_u, v_u, heads):
        return kernel_attention(q_u, k_u, v_u)

    def kernel_attention(q, k, v):
        # torch's CPU flash kernel through SDPA, bshd in and out, as DeepSpeed's local attention runs it.
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    peaks = {}
    for name in ("default", "keep", "autograd"):
        state = ParallelState(1, U, keep_head_shards=name == "keep")
        q, k, v, dout = _one_call(state, S, H, Hkv, D)
        with StorageTracker() as mem:
            if name == "autograd":
                out = ulysses_attention(q, k, v, state.ulysses_group, inner, gather_size=S)
            else:
                out = seqpar.attention(q, k, v, state, causal=True, seq_len=S, backend=kernel)
            out.backward(dout)
            del out
        peaks[name] = mem.peak
        state.close()
    return peaks


def test_keep_head_shards_holds_no_more_than_autograd_through_the_exchanges(pools):
    # Three nodes (Note [Head shards as a node]): the head shards and dout are freed as autograd
    # would free them, so the peak is that of the peers' form; one node would hold the head
    # shards through the gradients' exchange (about 4 shards more here).
    S, H, Hkv, D = 512, 8, 8, 16
    shard = S // 4 * H * D * 4
    for rank, peaks in enumerate(pools(4).run(_rank_peaks, S, H, Hkv, D)):
        assert peaks["keep"] <= peaks["autograd"] + shard // 2, (rank, peaks, shard)


def _rank_gradient_layout() -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """The gradients going back to the token shards keep each head's head_dim values contiguous
    (Note [Gather over heads]), in both modes and with ``Dv != D``: a transfer over a flattened
    ``(heads, head_dim)`` axis had returned them with the head_dim index outermost."""
    found = []
    for keep in (False, True):
        state = ParallelState(1, dist.get_world_size(), keep_head_shards=keep)
        g = torch.Generator().manual_seed(0)
        S = 4 * state.cp_size + 1
        full = [torch.randn(1, S, h, d, generator=g) for h, d in ((6, 8), (2, 8), (2, 4))]
        q, k, v = (seqpar.shard(t, state).requires_grad_() for t in full)
        out = seqpar.attention(q, k, v, state, causal=True, seq_len=S)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        found += [(f"keep={keep} d{name}", tuple(t.shape), t.stride()) for name, t in zip("qkv", grads)]
        state.close()
    return found


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_keep_head_dim_contiguous(pools, world):
    for rank, found in enumerate(pools(world).run(_rank_gradient_layout)):
        for name, shape, stride in found:
            assert stride[-1] == 1 and stride[-2] >= shape[-1], (rank, name, shape, stride)
