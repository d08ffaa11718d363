"""Zig-zag ring attention (seqpar.ring) and its step engine (seqpar.ring_engine).

Multi-rank cases run on the shared gloo pools (``pools(R).run``); each rank function loops over
many cases so that one spawn serves a whole test. Ring size 1 runs in the test process itself
(``group=None`` without ``torch.distributed`` is a one-process ring).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from seqpar.backends import get_backend
from seqpar.backends.reference import reference_attention
from seqpar.comm import group_rank, group_size
from seqpar.layout import dense_positions, ring_local_length, split_sizes
from seqpar.ring import _backward, _forward, ring_attention, zigzag_work
from seqpar.ring_engine import ring_backward, ring_forward

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Max abs error allowed, relative to max(1, max |reference|).
_TOL = {"float64": 1e-10, "float32": 1e-4}
# bf16 (flash-attn's rule): error <= 2 x that of single-device bf16 PyTorch attention + eps.
_BF16_FACTOR, _BF16_EPS = 2.0, 2e-3
# (H, Hkv) pairs: every Hkv in {1, 2, H} that divides H.
_HEADS = [(h, hkv) for h in (1, 3, 4, 6, 8) for hkv in sorted({1, 2, h}) if h % hkv == 0]


# ---------------------------------------------------------------------------------------------
# Rank functions (module level: the pool imports them by name)


def _full_inputs(seq_len, b, h, hkv, d, seed):
    """Global float64 q, k, v, dout (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, seq_len, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, seq_len, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, seq_len, hkv, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, seq_len, h, d, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _reference_grads(q, k, v, dout, causal, dtype=torch.float64):
    """``out, dq, dk, dv`` of single-device reference attention computed in ``dtype``."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal=causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return [t.detach().double() for t in (out, dq, dk, dv)]


def _local(x, seq_len, ring_size, ring_rank):
    """This ring rank's zig-zag rows of a full ``[B, S, ...]`` tensor."""
    return x[:, dense_positions(seq_len, ring_size, ring_rank, 1, 0)]


def _leaf(x, as_view):
    """A tensor requiring grad with ``x``'s values: ``x`` itself, or a non-contiguous bshd view
    of a bhsd leaf."""
    if not as_view:
        return x.requires_grad_()
    return x.transpose(1, 2).contiguous().requires_grad_().transpose(1, 2)


def _check_cases(cases):
    """Run ``ring_attention`` forward+backward on every case; return ``(case, name, err, tol)``."""
    size, rank = group_size(None), group_rank(None)
    results = []
    for case in cases:
        seq_len, b, h, hkv, d, causal, dtype_name, backend, as_view, seed = case
        dtype = _DTYPES[dtype_name]
        full = _full_inputs(seq_len, b, h, hkv, d, seed)
        ref = _reference_grads(*full, causal)
        q, k, v, dout = (_local(t, seq_len, size, rank) for t in full)
        q, k, v = (_leaf(t.to(dtype), as_view) for t in (q, k, v))
        out = ring_attention(q, k, v, None, seq_len=seq_len, causal=causal, backend=backend)
        assert out.dtype == dtype and out.shape == q.shape, (out.dtype, out.shape)
        got = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout.to(dtype))]
        assert all(g.dtype == dtype for g in got), [g.dtype for g in got]
        if dtype_name == "bfloat16":
            base = _reference_grads(*full, causal, dtype=torch.bfloat16)
            tols = [_BF16_FACTOR * (x - y).abs().max().item() + _BF16_EPS
                    for x, y in zip(base, ref)]
        else:
            tols = [_TOL[dtype_name] * max(1.0, y.abs().max().item()) for y in ref]
        for name, x, y, tol in zip(("out", "dq", "dk", "dv"), got, ref, tols):
            y = _local(y, seq_len, size, rank)
            err = (x.double() - y).abs().max().item() if y.numel() else 0.0
            results.append((case, name, err, tol))
    return results


def _trace_case(seq_len, causal):
    """Run ``_forward``/``_backward`` with a trace; return the traces and the max errors."""
    size, rank = group_size(None), group_rank(None)
    full = _full_inputs(seq_len, 1, 2, 1, 8, seed=7)
    ref = _reference_grads(*full, causal)
    q, k, v, dout = (_local(t, seq_len, size, rank) for t in full)
    backend = get_backend("cpu", q.device, q.dtype)
    fwd_trace, bwd_trace = [], []
    kw = dict(seq_len=seq_len, causal=causal, scale=8**-0.5, backend=backend)
    out, lse = _forward(q, k, v, None, trace=fwd_trace, **kw)
    grads = _backward(dout, q, k, v, out, lse, None, trace=bwd_trace, **kw)
    errs = [
        (x - _local(y, seq_len, size, rank)).abs().max().item()
        for x, y in zip([out, *grads], ref)
    ]
    return fwd_trace, bwd_trace, errs


def _engine_uneven():
    """Drive the engine with 1-D buffers of uneven per-rank length (rank j holds j elements)."""
    size, rank = group_size(None), group_rank(None)
    own = torch.arange(rank, dtype=torch.float32) + 100 * rank
    seen = {}

    def shapes(src):
        return [(src,)]

    def forward_step(src, kv):
        seen[src] = kv[0].tolist()

    def backward_step(src, kv, dkv):
        assert dkv[0].shape == (src,) and dkv[0].dtype == torch.float32
        assert torch.equal(kv[0], torch.arange(src, dtype=torch.float32) + 100 * src)
        dkv[0] += rank + 1

    trace = []
    ring_forward(None, [own], shapes, forward_step, trace=trace)
    grads = ring_backward(None, [own], shapes, backward_step)
    return seen, grads[0].tolist(), trace


def _bad_local_length():
    """ValueError messages for local lengths that disagree with this rank's zig-zag share."""
    rank = group_rank(None)
    seq_len = 37
    n = ring_local_length(seq_len, group_size(None), rank)
    q = torch.zeros(1, n + 1, 2, 8)
    msgs = []
    for args in [(q, q, q), (q[:, :n], q, q)]:
        try:
            ring_attention(*args, None, seq_len=seq_len, backend="reference")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


# ---------------------------------------------------------------------------------------------
# Correctness against the float64 single-device reference


def _cases(ring_size, seq_lens, dtypes, seed0):
    """A spread over (S, causal, dtype) with head/batch/backend/view settings cycling."""
    cases = []
    grid = itertools.product(seq_lens, (False, True), dtypes)
    for i, (seq_len, causal, dtype) in enumerate(grid):
        h, hkv = _HEADS[(i * 5 + ring_size) % len(_HEADS)]
        b = 1 + (i % 2)
        d = 16 if i % 3 else 8
        backend = "reference" if i % 4 == 3 else "cpu"
        cases.append((seq_len, b, h, hkv, d, causal, dtype, backend, i % 5 == 1, seed0 + i))
    return cases


def _assert_results(results, n_expected):
    flat = [x for per_rank in results for x in per_rank]
    assert len(flat) == n_expected
    bad = [x for x in flat if not x[2] <= x[3]]  # NaN fails too
    assert not bad, f"{len(bad)} of {len(flat)} checks failed, e.g. {bad[:5]}"


_SEQ_LENS = [1, 5, 37, 64, 129]
_ALL_DTYPES = ["float64", "float32", "bfloat16"]


def test_ring_size_1_matches_reference():
    cases = _cases(1, _SEQ_LENS, _ALL_DTYPES, seed0=100)
    _assert_results([_check_cases(cases)], 4 * len(cases))


@pytest.mark.parametrize("ring_size", [2, 3, 4])
def test_ring_matches_reference(pools, ring_size):
    cases = _cases(ring_size, _SEQ_LENS, _ALL_DTYPES, seed0=1000 * ring_size)
    results = pools(ring_size).run(_check_cases, cases)
    _assert_results(results, 4 * len(cases) * ring_size)


def test_ring_size_8_matches_reference(pools):
    cases = _cases(8, [5, 37, 129], ["float64", "float32"], seed0=8000)[::2]
    cases.append((64, 2, 8, 2, 16, True, "bfloat16", "cpu", True, 8100))
    results = pools(8).run(_check_cases, cases)
    _assert_results(results, 4 * len(cases) * 8)


def test_every_head_layout(pools):
    """All (H, Hkv) pairs, causal, on an uneven split (37 tokens over 3 ranks)."""
    cases = [
        (37, 2, h, hkv, 8, True, "float64", "cpu", False, 50 + i)
        for i, (h, hkv) in enumerate(_HEADS)
    ]
    results = pools(3).run(_check_cases, cases)
    _assert_results(results, 4 * len(cases) * 3)


# ---------------------------------------------------------------------------------------------
# Load balance


def _brute_force_work(seq_len, ring_size, causal):
    mask = torch.ones(seq_len, seq_len, dtype=torch.long)
    if causal:
        mask = mask.tril()
    return [int(mask[dense_positions(seq_len, ring_size, r, 1, 0)].sum()) for r in range(ring_size)]


def test_zigzag_work_matches_brute_force():
    grid = itertools.product([1, 2, 3, 4, 8], range(0, 41), (False, True))
    for ring_size, seq_len, causal in grid:
        expected = _brute_force_work(seq_len, ring_size, causal)
        assert zigzag_work(seq_len, ring_size, causal) == expected


def test_zigzag_balances_causal_work():
    """Per-rank causal work (attended pairs) under zig-zag placement: the spread max - min is

    - 0 when ``2R`` divides ``S`` (equal chunks);
    - always below ``2 * S``, i.e. less than two query rows' worth of keys (uneven chunks differ
      by one row), whatever ``S`` and ``R`` (checked exhaustively for S < 2500, R <= 32 offline);
    - hence within one chunk's worth, ``ceil(S / 2R)`` rows x ``S`` keys, once every chunk is
      non-empty (``S >= 2R``), and within 1% once ``S >= 400 R``.
    """
    for ring_size in [2, 3, 4, 8, 16]:
        for seq_len in [*range(1, 400), 1000, 1001, 4095, 4096, 131071, 131072]:
            work = zigzag_work(seq_len, ring_size, causal=True)
            assert sum(work) == seq_len * (seq_len + 1) // 2
            chunk = math.ceil(seq_len / (2 * ring_size))
            spread = max(work) - min(work)
            assert spread < 2 * seq_len, (ring_size, seq_len, work)
            if seq_len >= 2 * ring_size:
                assert spread <= 0.01 * max(work) + chunk * seq_len, (ring_size, seq_len, work)
            if seq_len % (2 * ring_size) == 0:
                assert spread == 0, (ring_size, seq_len, work)
            if seq_len >= 400 * ring_size:
                assert spread <= 0.01 * max(work), (ring_size, seq_len, work)


def test_contiguous_split_is_unbalanced():
    """The measure's sanity: a contiguous causal split loads the last rank ~2R-1x the first."""
    seq_len, ring_size = 4096, 4
    sizes = split_sizes(seq_len, ring_size)
    starts = [sum(sizes[:r]) for r in range(ring_size)]
    contiguous = [((a + n) * (a + n + 1) - a * (a + 1)) // 2 for a, n in zip(starts, sizes)]
    assert max(contiguous) > 6 * min(contiguous)
    zigzag = zigzag_work(seq_len, ring_size, causal=True)
    assert max(zigzag) == min(zigzag)


def test_non_causal_work_is_proportional_to_local_length():
    for ring_size, seq_len in itertools.product([1, 2, 3, 8], [0, 1, 7, 37, 129]):
        work = zigzag_work(seq_len, ring_size, causal=False)
        local = [ring_local_length(seq_len, ring_size, r) for r in range(ring_size)]
        assert work == [n * seq_len for n in local]


# ---------------------------------------------------------------------------------------------
# Overlap and the engine contract


def _index(trace, event):
    return trace.index(event)


@pytest.mark.parametrize("ring_size", [2, 3])
def test_transfer_posted_before_compute(pools, ring_size):
    for seq_len, causal in [(37, True), (5, False)]:
        for fwd, bwd, errs in pools(ring_size).run(_trace_case, seq_len, causal):
            assert max(errs) < 1e-10, errs
            for i in range(ring_size - 1):
                # forward: the K/V of step i+1 are in flight while step i computes
                for trace in (fwd, bwd):
                    posted = _index(trace, ("post_recv", i + 1))
                    assert posted < _index(trace, ("compute", i)) < _index(trace, ("wait", i + 1))
                # backward: step i's dK/dV travel while step i+1 computes
                assert _index(bwd, ("post_grad", i)) < _index(bwd, ("compute", i + 1))
                assert _index(bwd, ("compute", i + 1)) < _index(bwd, ("wait_grad", i + 1))
            computes = [e for e in fwd if e[0] == "compute"]
            assert computes == [("compute", i) for i in range(ring_size)]
            assert bwd[-1] == ("wait_grad", ring_size)


def test_engine_with_uneven_opaque_buffers(pools):
    ring_size = 4
    for rank, (seen, grads, trace) in enumerate(pools(ring_size).run(_engine_uneven)):
        # every rank saw every rank's buffer exactly once, with the right contents
        assert seen == {j: [100.0 * j + t for t in range(j)] for j in range(ring_size)}
        # the gradient of its own buffer came home with every rank's contribution (1 + ... + R)
        assert grads == [float(sum(range(1, ring_size + 1)))] * rank
        assert trace.count(("compute", 0)) == 1 and len(trace) == 3 * ring_size - 2


def test_engine_single_rank_runs_one_step_without_communication():
    calls = []
    kv = [torch.ones(3, 2)]
    ring_forward(
        None, kv, lambda src: [(3, 2)], lambda src, t: calls.append((src, t[0] is kv[0]))
    )
    grads = ring_backward(None, kv, lambda src: [(3, 2)], lambda src, t, g: g[0].add_(2.0))
    assert calls == [(0, True)]
    assert len(grads) == 1 and torch.equal(grads[0], torch.full((3, 2), 2.0))


def test_gradient_only_for_q_and_no_grad_forward():
    seq_len = 9
    q, k, v, dout = _full_inputs(seq_len, 1, 4, 2, 8, seed=3)
    out_ref, dq_ref, _, _ = _reference_grads(q, k, v, dout, True)
    with torch.no_grad():
        out = ring_attention(q, k, v, None, seq_len=seq_len, causal=True, backend="cpu")
    assert (out - out_ref).abs().max() < 1e-10
    q = q.clone().requires_grad_()
    out = ring_attention(q, k, v, None, seq_len=seq_len, causal=True, backend="cpu")
    (dq,) = torch.autograd.grad(out, q, dout)
    assert (dq - dq_ref).abs().max() < 1e-10
    assert k.grad is None and v.grad is None


def test_empty_sequence():
    q = torch.zeros(2, 0, 4, 8, requires_grad=True)
    k = torch.zeros(2, 0, 2, 8, requires_grad=True)
    out = ring_attention(q, k, k, None, seq_len=0, causal=True, backend="cpu")
    assert out.shape == (2, 0, 4, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


# ---------------------------------------------------------------------------------------------
# Input validation


def test_bad_inputs_raise_value_error():
    q = torch.zeros(1, 5, 4, 8)
    kv = torch.zeros(1, 5, 2, 8)

    def call(q=q, k=kv, v=kv, seq_len=5, **kw):
        return ring_attention(q, k, v, None, seq_len=seq_len, **kw)

    with pytest.raises(ValueError, match=r"q, k, v must be 4-dim \[B, S, H, D\].*q \(5, 4, 8\)"):
        call(q=q[0])
    with pytest.raises(ValueError, match=r"4-dim.*k \(1, 5, 2, 8, 1\)"):
        call(k=kv[..., None])
    with pytest.raises(ValueError, match=r"one floating dtype.*torch.float32, torch.float64"):
        call(k=kv.double())
    with pytest.raises(ValueError, match=r"one floating dtype.*torch.int64"):
        call(q=q.long(), k=kv.long(), v=kv.long())
    with pytest.raises(ValueError, match=r"one device.*meta"):
        call(v=kv.to("meta"))
    with pytest.raises(ValueError, match=r"batch sizes differ: q has B=1, k/v have B=2"):
        call(k=kv.expand(2, -1, -1, -1), v=kv.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match=r"head dims differ: q has D=8, k/v have D=4"):
        call(k=kv[..., :4], v=kv[..., :4])
    with pytest.raises(ValueError, match=r"k and v shapes differ"):
        call(v=kv[:, :, :1])
    with pytest.raises(ValueError, match=r"H=4 query heads .* of the Hkv=3.*\[1, 2, 4\]"):
        call(k=torch.zeros(1, 5, 3, 8), v=torch.zeros(1, 5, 3, 8))
    for bad in (5.0, "5", True, -1, None):
        with pytest.raises(ValueError, match=r"seq_len must be the global sequence length"):
            call(seq_len=bad)
    with pytest.raises(ValueError, match=r"holds 6 of the seq_len=6 tokens.*q has S=5"):
        call(seq_len=6)
    with pytest.raises(ValueError, match=r"group must be"):
        ring_attention(q, kv, kv, "ring", seq_len=5)
    with pytest.raises(ValueError, match=r"backend must be a name or an AttentionBackend"):
        call(backend=3)
    with pytest.raises(ValueError, match=r"scale must be a float"):
        call(scale="large")
    with pytest.raises(ValueError, match=r"zigzag_work: ring_size must be a positive int, got 0"):
        zigzag_work(5, 0, True)
    with pytest.raises(ValueError, match=r"zigzag_work: seq_len"):
        zigzag_work(-1, 2, True)


def test_bad_local_length_names_the_ring_rank(pools):
    msgs = pools(2).run(_bad_local_length)
    # split_sizes(37, 4) = [10, 9, 9, 9]: rank 0 holds chunks 0 and 3 (19), rank 1 chunks 1, 2 (18)
    assert "ring rank 0 of 2 holds 19 of the seq_len=37" in msgs[0][0]
    assert "[(0, 10), (28, 37)]" in msgs[0][0] and "q has S=20" in msgs[0][0]
    assert "ring rank 1 of 2 holds 18" in msgs[1][0] and "k/v have S=19" in msgs[1][1]
