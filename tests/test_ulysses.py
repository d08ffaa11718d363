"""Ulysses head placement and the all-to-all (seqpar.placement.heads, seqpar.parallel.ulysses).

Every case runs twice: through ``seqpar.attention`` on a Ulysses-only state (the path users take:
the fused exchange of ``UlyssesSetup`` around the ring's kernels, the eager autograd function of
``seqpar.attention``) and through the ``ulysses_attention`` building block around plain float64
math (which shows the shapes the inner attention receives). Both against single-device float64:
uneven heads, GQA with Hkv < U, groups straddling ranks, the non-uniform local mapping that needs
a local K/V expansion, ranks with no head, and a v head dim that differs from q's (MLA).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import seqpar
from _common import quick_up_to, saved_bytes
from seqpar import ParallelState, shard
from seqpar.placement import offsets, split_sizes
from seqpar.parallel.ulysses import ulysses_attention
from seqpar.placement import head_assignments


def _math_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Softmax attention in the inputs' dtype, ``[B, S, H, D]``, kv head ``h // (H / Hkv)``."""
    heads = q.shape[2]
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        n = q.shape[1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)


# ---------------------------------------------------------------------------------------------
# Head placement maths (no communication)


def _check_assignment_maths(H: int, Hkv: int, U: int) -> None:
    G = H // Hkv
    plan = head_assignments(H, Hkv, U)
    assert [a.q_len for a in plan] == split_sizes(H, U), (H, Hkv, U)
    assert [a.q_start for a in plan] == offsets(split_sizes(H, U))[:-1], (H, Hkv, U)
    for u, a in enumerate(plan):
        desc = f"H={H} Hkv={Hkv} U={U} rank {u}: {a}"
        if a.q_len == 0:
            assert a.kv_len == 0 and a.kv_index is None, desc
            continue
        needed = sorted({(a.q_start + i) // G for i in range(a.q_len)})
        # Exactly the K/V heads its queries read, as one contiguous range.
        assert list(range(a.kv_start, a.kv_start + a.kv_len)) == needed, desc
        kernel = list(range(a.kv_len)) if a.kv_index is None else list(a.kv_index)
        assert a.kernel_kv_heads == len(kernel), desc
        assert a.q_len % len(kernel) == 0, desc  # a uniform GQA ratio for the kernel
        ratio = a.q_len // len(kernel)
        for i in range(a.q_len):
            # The kernel's mapping (local query i -> kernel kv i // ratio) is the global one.
            assert a.kv_start + kernel[i // ratio] == (a.q_start + i) // G, f"{desc}, head {i}"
        if a.kv_index is not None:
            assert len(a.kv_index) > a.kv_len, desc  # expands only when it must
    starts_cut = any(a.q_len and (a.q_start % G or (a.q_start + a.q_len) % G) for a in plan)
    sent = sum(a.kv_len for a in plan)
    if G == 1 or Hkv % U == 0:
        assert sent == Hkv and not starts_cut, f"H={H} Hkv={Hkv} U={U}: no replication expected"
    if Hkv < U and G > 1 and H >= U:
        assert sent > Hkv, f"H={H} Hkv={Hkv} U={U}: Hkv < U must replicate"


def test_head_assignments_cover_every_case():
    n = 0
    for H in range(1, 17):
        for Hkv in (d for d in range(1, H + 1) if H % d == 0):
            for U in range(1, 10):
                _check_assignment_maths(H, Hkv, U)
                n += 1
    assert n > 400


def test_head_assignments_examples():
    # The docstring example: rank 1 reads K/V heads 0, 1, 1 and is expanded to a 1:1 ratio.
    plan = head_assignments(8, 2, 3)
    assert [(a.q_start, a.q_len, a.kv_start, a.kv_len, a.kv_index) for a in plan] == [
        (0, 3, 0, 1, None),
        (3, 3, 0, 2, (0, 1, 1)),
        (6, 2, 1, 1, None),
    ]
    # Blocks larger than one head when possible: H=12, Hkv=3 (G=4), U=2; rank 0's heads 0..5
    # read K/V 0 0 0 0 1 1, so pairs of query heads share one: K/V [0, 0, 1] at ratio 2.
    plan = head_assignments(12, 3, 2)
    assert [(a.kv_start, a.kv_len, a.kv_index) for a in plan] == [(0, 2, (0, 0, 1)), (1, 2, (0, 1, 1))]
    assert plan[0].kernel_kv_heads == 3
    # MQA over 4 ranks: every rank gets the single K/V head.
    assert [(a.kv_start, a.kv_len) for a in head_assignments(4, 1, 4)] == [(0, 1)] * 4
    # H < U: the last ranks have no head.
    assert [a.q_len for a in head_assignments(2, 2, 4)] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="H % Hkv"):
        head_assignments(6, 4, 2)


# ---------------------------------------------------------------------------------------------
# Multi-rank: output and gradients against single-device float64 attention


def _ulysses_cases(world: int) -> list[dict]:
    """A spread of (B, S, H, Hkv, D, Dv, causal, layout) cases for one world size."""
    cases = []
    heads = [(1, 1), (3, 1), (3, 3), (4, 2), (6, 2), (6, 3), (8, 2), (8, 1), (8, 8), (5, 5), (12, 3)]
    lengths = [5, 37, 64, 2] if world > 2 else [5, 37, 64]
    for i, ((H, Hkv), S) in enumerate(itertools.product(heads, lengths)):
        cases.append(
            dict(B=1 + i % 2, S=S, H=H, Hkv=Hkv, D=8, Dv=8 if i % 5 else 4, causal=bool(i % 3 == 1),
                 layout=("bshd", "sbhd", "bhsd")[i % 3])
        )
    return cases


def _rank_ulysses(cases: list[dict]) -> list[tuple[str, float, list[tuple]]]:
    """Runs on every rank; returns per case (description, max error, inner shapes seen)."""
    U = dist.get_world_size()
    state = ParallelState(ring_size=1, ulysses_size=U)
    results = []
    for n, c in enumerate(cases):
        B, S, H, Hkv, D, Dv = (c[x] for x in ("B", "S", "H", "Hkv", "D", "Dv"))
        gen = torch.Generator().manual_seed(1000 + n)
        q = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(B, S, Hkv, D, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(B, S, Hkv, Dv, generator=gen, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(B, S, H, Dv, generator=gen, dtype=torch.float64)

        ref = _math_attention(q, k, v, c["causal"])
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)

        seen = []

        def inner(qu, ku, vu, heads):
            seen.append((tuple(qu.shape), tuple(ku.shape), tuple(vu.shape)))
            return _math_attention(qu, ku, vu, c["causal"])

        # Non-contiguous shards: the layouts' views, as the public API makes them.
        ql, kl, vl = (shard(t, state, dim=1) for t in (q, k, v))
        if c["layout"] == "sbhd":
            ql, kl, vl = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (ql, kl, vl))
        elif c["layout"] == "bhsd":
            ql, kl, vl = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (ql, kl, vl))
        gather_size = S if n % 2 else None
        out = ulysses_attention(ql, kl, vl, state.ulysses_group, inner, gather_size=gather_size)
        grads = torch.autograd.grad((out * shard(dout, state, dim=1)).sum(), (q, k, v))
        err = (out - shard(ref, state, dim=1)).abs().max().item() if out.numel() else 0.0
        for g, rg in zip(grads, ref_grads):
            g = g.clone()
            dist.all_reduce(g)  # partial gradients sum to the exact one
            err = max(err, (g - rg).abs().max().item())
        err = max(err, _user_path_error(c, state, (q, k, v), dout, ref, ref_grads, gather_size))  # the users' path
        results.append((f"U={U} {c} gather_size={gather_size}", err, seen))
    return results


def _user_path_error(c, state, full, dout, ref, ref_grads, seq_len) -> float:
    """Max error of ``seqpar.attention`` (output and summed gradients) on the case's layout."""
    perm = {"bshd": (0, 1, 2, 3), "sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3)}[c["layout"]]
    local = [shard(t.detach(), state, dim=1).permute(perm).requires_grad_() for t in full]
    out = seqpar.attention(*local, state, causal=c["causal"], layout=c["layout"], seq_len=seq_len)
    out_b = out.permute(perm)  # each permutation is its own inverse
    err = (out_b - shard(ref, state, dim=1)).abs().max().item() if out.numel() else 0.0
    grads = torch.autograd.grad(out_b, local, shard(dout, state, dim=1))
    for g, rg in zip(grads, ref_grads):
        g = g.permute(perm).contiguous()
        full_g = seqpar.unshard(g, state, dim=1, size=c["S"])  # token shards: gather, no sum
        err = max(err, (full_g - rg).abs().max().item())
    return err


@pytest.mark.parametrize("world", quick_up_to(3, [1, 2, 3, 4]))
def test_ulysses_matches_reference(pools, world):
    cases = _ulysses_cases(world)
    per_rank = pools(world).run(_rank_ulysses, cases)
    for rank, results in enumerate(per_rank):
        for c, (desc, err, seen) in zip(cases, results):
            assert err < 1e-10, f"rank {rank}: {desc}: max error {err:.3g}"
            a = head_assignments(c["H"], c["Hkv"], world)[rank]
            if a.q_len == 0:
                assert seen == [], f"rank {rank}: {desc}: inner called with no heads"
                continue
            # The inner kernel saw all S tokens of its heads and a uniform GQA ratio.
            (qs, ks, vs), = seen
            assert qs == (c["B"], c["S"], a.q_len, c["D"]), f"rank {rank}: {desc}: q {qs}"
            assert ks[:2] == qs[:2] and ks[2] == a.kernel_kv_heads, f"rank {rank}: {desc}: k {ks}"
            assert qs[2] % ks[2] == 0 and vs[3] == c["Dv"], f"rank {rank}: {desc}: {seen}"


def _rank_nonuniform(_: None) -> list[tuple]:
    """H=8, Hkv=2, U=3: rank 1 needs K/V heads 0, 1, 1 (expanded locally)."""
    state = ParallelState(ring_size=1, ulysses_size=3)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 29, 8, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 29, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 29, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = _math_attention(q, k, v, causal=True)
    seen = []

    def inner(qu, ku, vu, heads):
        seen.append((qu.shape[2], ku.shape[2]))
        return _math_attention(qu, ku, vu, causal=True)

    out = ulysses_attention(*(shard(t, state) for t in (q, k, v)), state.ulysses_group, inner)
    (out * out).sum().backward()
    dk = k.grad.clone()
    dist.all_reduce(dk)
    ref_dk = torch.autograd.grad((shard(ref, state) ** 2).sum(), k)[0]
    dist.all_reduce(ref_dk)  # the loss is the sum over ranks of each rank's share
    return [seen, (out - shard(ref, state)).abs().max().item(), (dk - ref_dk).abs().max().item()]


def test_ulysses_nonuniform_local_mapping(pools):
    results = pools(3).run(_rank_nonuniform, None)
    assert [r[0] for r in results] == [[(3, 1)], [(3, 3)], [(2, 1)]], results
    for rank, (_, err_out, err_dk) in enumerate(results):
        assert err_out < 1e-10 and err_dk < 1e-10, f"rank {rank}: out {err_out:.3g}, dk {err_dk:.3g}"


def _rank_errors(_: None) -> list[str]:
    state = ParallelState(ring_size=1, ulysses_size=2)
    q = torch.zeros(1, 3, 4, 8)
    messages = []
    bad = [
        ((q, torch.zeros(1, 3, 3, 8), torch.zeros(1, 3, 3, 8)), r"H=4 query heads must be a positive multiple of the Hkv=3"),
        ((q, torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4)), r"\[B, S, Hkv, D\]"),
        ((q, torch.zeros(1, 3, 2, 8), "v"), "v must be a torch.Tensor"),
        ((q[0], q[0], q[0]), r"must be 4-dim \[B, S_local, heads, head_dim\]"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            ulysses_attention(*args, state.ulysses_group, _math_attention)
        messages.append(match)
    # Local lengths that disagree with gather_size.
    with pytest.raises(ValueError, match="gather_size=9"):
        x = torch.zeros(1, 3, 2, 8)  # both ranks disagree with split_sizes(9, 2) == [5, 4]
        ulysses_attention(x, x, x, state.ulysses_group, _math_attention, gather_size=9)
    return messages


def test_ulysses_errors(pools):
    assert all(len(r) == 4 for r in pools(2).run(_rank_errors, None))


# ---------------------------------------------------------------------------------------------
# The output is a contiguous token shard: merging heads for the output projection is a view, and
# a layer keeps one output-sized tensor for its backward, not the call's and a copy of it.


def _rank_output_saved_once(keep: bool) -> list[tuple]:
    """Per case: the output's contiguity and the bytes ``out_proj(attention(...).reshape(...))``
    saves for backward (each storage once) minus what the attention call alone saves."""
    world = dist.get_world_size()
    results = []
    for R, B, varlen in ((1, 1, False), (1, 2, False), (1, 1, True), (2, 1, False)):
        if world % R or world // R < 2:
            continue
        state = ParallelState(R, world // R, keep_head_shards=keep)
        gen = torch.Generator().manual_seed(0)
        S, H, Hkv, D = 24 * world, 6, 2, 8
        full = [torch.randn(B, S, h, D, generator=gen) for h in (H, Hkv, Hkv)]
        weight = torch.randn(H * D, 16, generator=gen)
        if varlen:
            lens = [S // 3, S - S // 3]
            q, k, v = (seqpar.shard_packed(t[0], state, lens).clone().requires_grad_() for t in full)
            call = lambda: seqpar.varlen_attention(q, k, v, state, lens, causal=True)  # noqa: E731
        else:
            q, k, v = (seqpar.shard(t, state).clone().requires_grad_() for t in full)
            call = lambda: seqpar.attention(q, k, v, state, causal=True, seq_len=S)  # noqa: E731

        out = call()
        merged = out.flatten(-2)  # [..., H * D]: a view when out is contiguous
        layer = saved_bytes(lambda: call().flatten(-2) @ weight.requires_grad_())
        alone = saved_bytes(call)
        results.append(((R, B, varlen), out.is_contiguous(), merged.data_ptr() == out.data_ptr(),
                        layer - alone, out.nbytes))
        state.close()
    return results


@pytest.mark.parametrize("keep", [False, True])
def test_ulysses_output_is_contiguous_and_saved_once(pools, keep):
    for world in (2, 4):
        for rank, cases in enumerate(pools(world).run(_rank_output_saved_once, keep)):
            assert cases, (world, rank)
            for case, contiguous, view, extra, out_bytes in cases:
                assert contiguous and view, (world, rank, case)
                # The projection saves the merged output (and its weight, not a saved storage of the
                # call): with the default mode that is the call's own saved output, so nothing more.
                assert extra == (out_bytes if keep else 0) + 16 * 6 * 8 * 4, (world, rank, case, extra, out_bytes)


def _peak_cases(cases: list[tuple[int, str, bool]], S: int, H: int, Hkv: int) -> list[tuple[str, int, int]]:
    """``(case, the planner's predicted peak, this rank's measured peak)`` of one non-causal
    float32 call per ``(ring size, ring_comm, keep_head_shards)`` case on this pool's ranks, the
    layer's tensors counted as the planner counts them (the head shards replace q, k, v when kept)."""
    from seqpar.planner import CostModel, plan
    from seqpar.tools.profiling import StorageTracker

    n, D = dist.get_world_size(), 32
    results = []
    for ring, comm, keep in cases:
        p = plan(n, seq_len=S, num_heads=H, num_kv_heads=Hkv, head_dim=D, causal=False, dtype=torch.float32,
                 ranks_per_node=n, cost=CostModel.preset("cpu"), ring_comm=comm, keep_head_shards=keep)
        (c,) = [c for c in p.candidates if (c.ring_size, c.keep_head_shards) == (ring, keep)]
        state = ParallelState(ring, n // ring, ring_comm=comm, keep_head_shards=keep)
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (shard(torch.randn(1, S, h, D, generator=gen), state).contiguous() for h in (H, Hkv, Hkv, H))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with StorageTracker() as mem:
            seqpar.attention(q, k, v, state, seq_len=S).backward(dout)
        held = (dout,) if keep else (q, k, v, dout)
        results.append((f"{c.label()} {comm}", c.memory_bytes, mem.peak + sum(t.numel() * t.element_size() for t in held)))
        state.close()
    return results


@pytest.mark.parametrize("world, H, Hkv", [(3, 8, 2), (4, 9, 3)])
def test_ulysses_peak_is_the_planners_prediction(pools, world, H, Hkv):
    # What a Ulysses rank holds, followed moment by moment by the planner (Note [Planner
    # prediction]), with heads some rank's query heads do not map uniformly onto its K/V heads:
    # the received K/V heads die once expanded for the kernels (Note [Ulysses memory]), and a
    # ring's own K/V head shards, or their expanded copies, once sent for the last time (Note
    # [Own K/V released]); the kept head shards stay. Tried: received K/V kept where expanded,
    # or own K/V kept to the end, predict 0.88-0.95 of the measured peak.
    cases = [(1, "p2p", False), (1, "p2p", True)]
    if world == 4:
        cases += [(2, comm, keep) for comm in ("p2p", "p2p_serial") for keep in (False, True)]
    per_rank = pools(world).run(_peak_cases, cases, 1501, H, Hkv)
    for rows in zip(*per_rank):  # one case on every rank
        label, predicted = rows[0][:2]
        measured = max(m for _, _, m in rows)  # the prediction is the busiest rank's
        assert 0.99 <= predicted / measured <= 1.01, (label, predicted, measured, rows)
