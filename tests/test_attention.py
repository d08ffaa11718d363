"""Public hybrid attention (seqpar.attention, SequenceParallelAttention) against the single-device
float64 reference, for ring x Ulysses factorizations of 1, 2, 3, 4 and 8 ranks.

Each case builds global q, k, v, dout from a seeded generator (identical on every rank), makes the
global tensors leaves, shards them with ``seqpar.shard`` in the case's layout, runs the attention,
and backpropagates ``(out * shard(dout)).sum()``. By the partial-gradient convention (docs/api.md) the per-rank
gradients of the global leaves sum over the CP group to the exact gradient, which is compared with
the reference's. One pool run per world size serves all its cases.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist

from _common import DTYPES, TOL
import seqpar
from seqpar import ParallelState, SequenceParallelAttention, shard
from seqpar.prepare import to_bshd  # a bshd view in a layout; its own inverse
from seqpar.backends.reference import reference_attention

# Max abs error relative to max(1, max |reference|).
# bf16, flash-attn's rule: error <= 2 x that of a single-device bf16 computation + eps.
_BF16_FACTOR, _BF16_EPS = 2.0, 2e-3
_SEQ_DIM = {"bshd": 1, "sbhd": 0, "bhsd": 2}


def _global_inputs(c: dict) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(c["seed"])
    B, S, H, Hkv, D = (c[x] for x in ("B", "S", "H", "Hkv", "D"))
    shapes = [(B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, H, D)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _reference(q, k, v, dout, causal: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """Single-device ``out, dq, dk, dv`` computed in ``dtype``, returned as float64."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return [t.detach().double() for t in (out, *grads)]


def _rank_attention(factorizations: list[tuple[int, int]], cases: list[dict]) -> list[tuple]:
    """On every rank: run each case on each state; return ``(desc, name, err, tol)`` tuples."""
    results = []
    for R, U in factorizations:
        state = ParallelState(ring_size=R, ulysses_size=U)
        for c in cases:
            results.extend(_run_case(state, c))
    return results


def _run_case(state: ParallelState, c: dict) -> list[tuple]:
    dtype, layout, seq_dim = DTYPES[c["dtype"]], c["layout"], _SEQ_DIM[c["layout"]]
    desc = (
        f"R={state.ring_size} U={state.ulysses_size} dp={state.dp_size} cp_rank={state.cp_rank} "
        f"{c}"
    )
    full = _global_inputs(c)
    # Cast first so that the float64 reference sees exactly the inputs seqpar sees.
    full[:3] = [t.to(dtype).double() for t in full[:3]]
    ref = _reference(*full, c["causal"], torch.float64)
    leaves = [to_bshd(t.to(dtype), layout).requires_grad_() for t in full[:3]]
    q, k, v = (shard(t, state, dim=seq_dim) for t in leaves)
    kwargs = dict(causal=c["causal"], layout=layout, backend=c["backend"])
    seq_len = c["S"] if c["seq_len_kw"] else None
    if c["api"] == "module":
        out = SequenceParallelAttention(state, **kwargs)(q, k, v, seq_len=seq_len)
    else:
        out = seqpar.attention(q, k, v, state, seq_len=seq_len, **kwargs)
    if out.dtype != dtype or out.shape != q.shape:
        return [(desc, f"output {out.dtype} {tuple(out.shape)} vs q {tuple(q.shape)}", 1.0, 0.0)]
    dout = shard(to_bshd(full[3], layout), state, dim=seq_dim).to(dtype)
    grads = torch.autograd.grad((out * dout).sum(), leaves)
    got = [to_bshd(out.detach(), layout).double()]
    for g in grads:
        g = g.clone()
        dist.all_reduce(g, group=state.cp_group)
        got.append(to_bshd(g, layout).double())
    want = [shard(ref[0], state, dim=1), *ref[1:]]
    if dtype == torch.bfloat16:
        same_dtype = _reference(*full, c["causal"], torch.bfloat16)
        base = [shard(same_dtype[0], state, dim=1), *same_dtype[1:]]
    out = []
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        scale = max(1.0, want[i].abs().max().item()) if want[i].numel() else 1.0
        err = (got[i] - want[i]).abs().max().item() / scale if want[i].numel() else 0.0
        if dtype == torch.bfloat16:
            base_err = (base[i] - want[i]).abs().max().item() / scale if want[i].numel() else 0.0
            tol = _BF16_FACTOR * base_err + _BF16_EPS
        else:
            tol = TOL[c["dtype"]]
        out.append((desc, name, err, tol))
    return out


# ---------------------------------------------------------------------------------------------
# Case generation: a seeded spread over every axis, checked for coverage.

_HEADS = [(h, hkv) for h in (1, 3, 4, 6, 8) for hkv in sorted({1, 2, h}) if h % hkv == 0]
_AXES = dict(
    B=[1, 2],
    S=[5, 37, 64, 129],
    heads=_HEADS,
    causal=[False, True],
    layout=["bshd", "sbhd", "bhsd"],
    dtype=["float32", "float64", "float32", "bfloat16"],
    backend=["auto", "auto", "reference"],
    api=["function", "function", "module"],
    seq_len_kw=[False, True],
)


def _cases(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        pick = {name: values[(i + rng.randrange(len(values))) % len(values)] for name, values in _AXES.items()}
        H, Hkv = pick.pop("heads")
        cases.append(dict(pick, H=H, Hkv=Hkv, D=16, seed=seed * 1000 + i))
    return cases


_WORLDS = {
    1: ([(1, 1)], 24),
    2: ([(2, 1), (1, 2)], 16),
    3: ([(3, 1), (1, 3)], 14),
    4: ([(4, 1), (2, 2), (1, 4), (2, 1)], 10),  # (2, 1) on 4 ranks: data parallel 2
    8: ([(8, 1), (1, 8), (2, 4), (4, 2)], 5),
}


def test_case_generation_covers_every_axis():
    every = [c for world, (_, n) in _WORLDS.items() for c in _cases(n, world)]
    for name, values in _AXES.items():
        if name == "heads":
            assert {(c["H"], c["Hkv"]) for c in every} == set(values)
        else:
            assert {c[name] for c in every} == set(values), name


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(_WORLDS))
def test_attention_matches_reference(pools, world):
    factorizations, n = _WORLDS[world]
    cases = _cases(n, world)
    per_rank = pools(world).run(_rank_attention, factorizations, cases)
    checked = 0
    for rank, results in enumerate(per_rank):
        assert len(results) == 4 * len(factorizations) * len(cases), f"rank {rank}: {results[:1]}"
        for desc, name, err, tol in results:
            assert err <= tol, f"rank {rank}: {desc}: {name} error {err:.3g} > {tol:.3g}"
            checked += 1
    assert checked == world * 4 * len(factorizations) * len(cases)


# ---------------------------------------------------------------------------------------------
# Ulysses head edge cases through the public API (uneven heads, Hkv < U, no-head ranks)


def _rank_heads(cases: list[dict]) -> list[tuple]:
    results = []
    for R, U in [(1, 4), (2, 2)]:
        state = ParallelState(ring_size=R, ulysses_size=U)
        for c in cases:
            results.extend(_run_case(state, c))
    return results


def test_attention_head_splits(pools):
    base = dict(B=1, S=37, D=8, layout="bshd", dtype="float64", backend="auto", api="function",
                seq_len_kw=False)
    heads = [(1, 1), (2, 1), (3, 1), (5, 5), (6, 3), (6, 2), (8, 2), (12, 3), (3, 3), (7, 7)]
    cases = [dict(base, H=h, Hkv=hkv, causal=causal, seed=i)
             for i, ((h, hkv), causal) in enumerate(itertools.product(heads, [False, True]))]
    for rank, results in enumerate(pools(4).run(_rank_heads, cases)):
        assert len(results) == 2 * 4 * len(cases)
        for desc, name, err, tol in results:
            assert err <= tol, f"rank {rank}: {desc}: {name} error {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------------------------
# Input validation


def _valid():
    return torch.zeros(1, 6, 4, 8), torch.zeros(1, 6, 2, 8), torch.zeros(1, 6, 2, 8)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda q, k, v, s: seqpar.attention("q", k, v, s), "q must be a torch.Tensor"),
        (lambda q, k, v, s: seqpar.attention(q, k, None, s), "v must be a torch.Tensor"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, object()), "state must be a seqpar.ParallelState"),
        (lambda q, k, v, s: seqpar.attention(q, k.double(), v, s), "share one floating dtype"),
        (lambda q, k, v, s: seqpar.attention(q.long(), k.long(), v.long(), s), "floating dtype"),
        (lambda q, k, v, s: seqpar.attention(q, k.to("meta"), v, s), "on one device"),
        (lambda q, k, v, s: seqpar.attention(q[0], k, v, s), r"q, k, v must be 4-dim .*got q \(6, 4, 8\)"),
        (lambda q, k, v, s: seqpar.attention(q, k[:, :5], v[:, :5], s), r"local length S=6"),
        (lambda q, k, v, s: seqpar.attention(q, torch.zeros(2, 6, 2, 8), v, s), r"batch size B=1"),
        (lambda q, k, v, s: seqpar.attention(q, torch.zeros(1, 6, 2, 4), v, s), r"head dim D=8"),
        (lambda q, k, v, s: seqpar.attention(q, k, torch.zeros(1, 6, 1, 8), s),
         r"k and v must agree on \(B, S_local, Hkv\) = \(1, 6, 2\), got v with \(1, 6, 1\)"),
        (lambda q, k, v, s: seqpar.attention(q, torch.zeros(1, 6, 3, 8), torch.zeros(1, 6, 3, 8), s),
         r"H=4 query heads must be a positive multiple of the Hkv=3.*\[1, 2, 4\]"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, layout="bsh"), r"unknown layout 'bsh'.*bshd"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, backend="nope"), "unknown attention backend 'nope'"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, backend=3), "backend must be a backend name"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, window=(2,)), r"window must be \(left, right\)"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, window=(-2, 1)), r"ints >= -1"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, causal=True, window=(4, 2)), "contradicts causal=True"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, chunk_size=0), "chunk_size must be a positive int"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, softcap=-1.0), "softcap must be a finite float >= 0"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, softcap=float("nan")), "softcap must be"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, sinks=torch.zeros(3)), r"one logit per query head, shape \(4,\)"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, sinks=[0.0] * 4), "sinks must be a floating tensor"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, replicated_prefix=4, replicated_suffix=3),
         "exceed the 6 local tokens"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, replicated_prefix=2, causal=True),
         "need non-causal attention without window, chunks or mask slices, got causal"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, replicated_suffix=-1), "replicated_suffix must be"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, softcap=1.0, backend="cpu"), "has no softcap"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, causal=1), "causal must be True or False"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, softmax_scale="x"), "softmax_scale must be"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, seq_len=7), r"holds 6 tokens, but seq_len=7"),
        (lambda q, k, v, s: seqpar.attention(q, k, v, s, seq_len=-1), "seq_len must be"),
        (lambda q, k, v, s: SequenceParallelAttention(s, layout="BSHD"), "unknown layout"),
        (lambda q, k, v, s: SequenceParallelAttention(None), "state must be a seqpar.ParallelState"),
        (lambda q, k, v, s: SequenceParallelAttention(s, backend="nope")(q, k, v), "unknown attention backend"),
    ],
)
def test_attention_rejects_bad_input(make, match):
    state = ParallelState()  # no process group in the test process
    with pytest.raises(ValueError, match=match):
        make(*_valid(), state)


def _rank_placement_errors(_: None) -> list[str]:
    """Errors that need the other ranks' shapes; every rank must raise the same error."""
    matched = []
    for R, U in [(1, 2), (2, 1)]:
        state = ParallelState(ring_size=R, ulysses_size=U)
        rank = state.cp_rank
        # 2 + 4 = 6 tokens, but the placement of 6 is [3, 3] (either factorization): causal
        # attention depends on positions, so it is refused on every rank.
        x = torch.zeros(1, 2 + 2 * rank, 2, 8)
        with pytest.raises(ValueError, match=r"hold \[2, 4\] tokens.*placement of their 6 tokens.*causal"):
            seqpar.attention(x, x, x, state, causal=True)
        matched.append("placement")
        # Ranks disagree on the number of heads.
        x = torch.zeros(1, 4, 2 + 2 * rank, 8)
        with pytest.raises(ValueError, match=r"disagree on the call: cp rank 0 has \(B, H, Hkv.*= \[1, 2, 2"):
            seqpar.attention(x, x, x, state)
        matched.append("disagree")
        # ... or on an option.
        x = torch.zeros(1, 4, 2, 8)
        with pytest.raises(ValueError, match=r"disagree on the call"):
            seqpar.attention(x, x, x, state, causal=rank == 0)
        matched.append("options")
        # With seq_len given, the wrong local length raises without communication.
        x = torch.zeros(1, 4, 2, 8)
        with pytest.raises(ValueError, match=r"cp rank 0 holds 4 tokens, but seq_len=10 .* places \[5, 5\]"):
            seqpar.attention(x, x, x, state, seq_len=10, causal=True)
        matched.append("seq_len")
    return matched


def test_attention_placement_errors(pools):
    for rank, matched in enumerate(pools(2).run(_rank_placement_errors, None)):
        assert len(matched) == 8, f"rank {rank}: {matched}"


def _rank_any_lengths(_: None) -> list[float]:
    """Non-causal attention without window or chunks accepts any local lengths (e.g. image tokens
    split contiguously by a diffusers plan): exact against one device."""
    errors = []
    for R, U in [(1, 3), (3, 1)]:
        state = ParallelState(ring_size=R, ulysses_size=U)
        q, k, v, _ = _global_inputs(dict(B=2, S=31, H=6, Hkv=2, D=8, seed=7))
        cuts = [0, 4, 22, 31]  # 4, 18 and 9 tokens: no placement of 31
        rows = slice(cuts[state.cp_rank], cuts[state.cp_rank + 1])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = seqpar.attention(*(t[:, rows] for t in leaves), state, backend="reference")
        want = reference_attention(q, k, v)[:, rows]
        errors.append((out - want).abs().max().item())
        grads = [g.clone() for g in torch.autograd.grad(out.sum(), leaves)]
        ref = torch.autograd.grad(reference_attention(*leaves).sum(), leaves)
        for g, r in zip(grads, ref):
            dist.all_reduce(g, group=state.cp_group)
            errors.append((g - r).abs().max().item())
    return errors


def test_non_causal_attention_accepts_any_shard_lengths(pools):
    for rank, errors in enumerate(pools(3).run(_rank_any_lengths, None)):
        assert max(errors) < 1e-10, f"rank {rank}: {errors}"


def test_single_process_without_process_group():
    """``ParallelState()`` with no process group: exact local attention, any layout."""
    q, k, v, _ = _global_inputs(dict(B=2, S=11, H=6, Hkv=2, D=8, seed=3))
    want = reference_attention(q, k, v, causal=True)
    for layout in ("bshd", "sbhd", "bhsd"):
        out = seqpar.attention(*(to_bshd(t, layout) for t in (q, k, v)), ParallelState(), causal=True, layout=layout)
        assert out.shape == to_bshd(q, layout).shape, layout
        assert (to_bshd(out, layout) - want).abs().max().item() < 1e-10, layout
    module = SequenceParallelAttention(ParallelState(), causal=True, softmax_scale=0.3)
    assert "causal=True" in repr(module)
    want = reference_attention(q, k, v, causal=True, scale=0.3)
    assert (module(q, k, v) - want).abs().max().item() < 1e-10


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cuda_world_size_one(dtype, causal, layout):
    """seqpar.attention on one GPU (auto backend) vs float64: out and grads, flash-attn's 2x rule."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, Hkv, D = 2, 1029, 6, 2, 64
    full = [torch.randn(B, S, h, D, device="cuda", generator=g) for h in (H, Hkv, Hkv)]
    dout = torch.randn(B, S, H, D, device="cuda", generator=g)

    def run(ts, dt, fn):
        leaves = [t.detach().to(dt, copy=True).requires_grad_() for t in ts]  # fresh leaves every run
        out = fn(*leaves)
        out.backward(dout.to(dt))
        return [out.double()] + [t.grad.double() for t in leaves]

    def ours(q, k, v):
        if layout == "bhsd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return seqpar.attention(q, k, v, ParallelState(), causal=causal, layout="bhsd").transpose(1, 2)
        return seqpar.attention(q, k, v, ParallelState(), causal=causal)

    def ref(q, k, v):
        return reference_attention(q, k, v, causal=causal)

    exact = run(full, torch.float64, ref)
    same_dtype = run(full, dtype, ref)
    got = run(full, dtype, ours)
    for name, e, s, o in zip(["out", "dq", "dk", "dv"], exact, same_dtype, got):
        err, base = (o - e).abs().max().item(), (s - e).abs().max().item()
        assert err <= 2 * base + 1e-5, f"{name}: error {err:.3g} vs same-dtype reference {base:.3g}"
