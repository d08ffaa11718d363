"""seqpar.comm: bit-exact forward and backward against single-process references."""

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _common import quick_up_to
from seqpar.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_many,
    copy_to,
    gather,
    reduce_scatter,
    split,
    split_sizes,
)

WORLD_SIZES = [1, 2, 3, 4, 8]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _part(full: torch.Tensor, dim: int, sizes: list[int], i: int) -> torch.Tensor:
    return full.narrow(dim, sum(sizes[:i]), sizes[i])


def _global(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _size_variants(n: int) -> list[tuple[str, int, int]]:
    """(label, scatter size, gather size): aligned, unaligned on one side, both, < world."""
    return [
        ("aligned", 2 * n, 3 * n),
        ("scatter-unaligned", 2 * n + 1, n),
        ("gather-unaligned", n, 2 * n + 1),
        ("both-unaligned", 3 * n - 1 if n > 1 else 2, n + 1 if n > 1 else 3),
        ("smaller-than-world", max(n - 1, 1), max(n - 2, 1)),
    ]


def _check_a2a_case(ndim, sd, gd, dtype, s_size, g_size, with_gather_size, seed):
    n, r = dist.get_world_size(), dist.get_rank()
    shape = [2 if d % 2 else 3 for d in range(ndim)]
    shape[sd], shape[gd] = s_size, g_size
    full = _global(shape, dtype, seed)
    w = _global(shape, dtype, seed + 1)
    gs, ss = split_sizes(g_size, n), split_sizes(s_size, n)
    x = _part(full, gd, gs, r).clone().requires_grad_()
    y = all_to_all(x, None, sd, gd, gather_size=g_size if with_gather_size else None)
    want = _part(full, sd, ss, r)
    assert y.shape == want.shape and torch.equal(y, want), "forward"
    (y * _part(w, sd, ss, r)).sum().backward()
    assert torch.equal(x.grad, _part(w, gd, gs, r)), "backward"
    # Round trip back to the original layout.
    z = all_to_all(y.detach(), None, gd, sd, gather_size=s_size)
    assert torch.equal(z, x.detach()), "round trip"


def _all_to_all_cases(dtypes):
    """Every pair of dims of 2- to 5-dim tensors; 4-dim tensors (the attention layouts) in every
    dtype, the others in one dtype each, in turn."""
    n = dist.get_world_size()
    count = 0
    for ndim in range(2, 6):
        for p, (sd, gd) in enumerate(itertools.permutations(range(ndim), 2)):
            for dtype in dtypes if ndim == 4 else [dtypes[(p + ndim) % len(dtypes)]]:
                for label, s_size, g_size in _size_variants(n):
                    for with_gs in (True, False) if label == "both-unaligned" else (True,):
                        try:
                            _check_a2a_case(ndim, sd, gd, dtype, s_size, g_size, with_gs, count)
                        except AssertionError as e:
                            raise AssertionError(
                                f"all_to_all ndim={ndim} scatter={sd} gather={gd} {dtype} {label} "
                                f"({s_size}, {g_size}) gather_size={with_gs}: {e}"
                            ) from None
                        count += 1
    return count


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_to_all_bit_exact(pools, world):
    dtypes = DTYPES if world <= 4 else [torch.float32, torch.bfloat16]
    counts = pools(world).run(_all_to_all_cases, dtypes)
    assert counts[0] > 100


def _fused_cases():
    """all_to_all_many with GQA-style overlapping head ranges vs separate references."""
    n, r = dist.get_world_size(), dist.get_rank()
    for H, Hkv, S in [(6, 2, 7), (8, 2, 5), (3, 1, 4), (4, 4, 9), (5, 1, 2)]:
        q_full = _global((2, S, H, 3), torch.float64, H)
        k_full = _global((2, S, Hkv, 3), torch.float64, H + 1)
        wq = _global((2, S, H, 3), torch.float64, H + 2)
        wk = _global((2, S, Hkv, 3), torch.float64, H + 3)
        ss = split_sizes(S, n)
        hs = split_sizes(H, n)
        group = H // Hkv
        q_ranges, k_ranges = [], []
        for j in range(n):
            a = sum(hs[:j])
            q_ranges.append((a, hs[j]))
            if hs[j] == 0:
                k_ranges.append((0, 0))
            else:
                lo, hi = a // group, (a + hs[j] - 1) // group + 1
                k_ranges.append((lo, hi - lo))
        q = _part(q_full, 1, ss, r).clone().requires_grad_()
        k = _part(k_full, 1, ss, r).clone().requires_grad_()
        qo, ko = all_to_all_many([q, k], None, 2, 1, gather_size=S, scatter_ranges=[q_ranges, k_ranges])
        qa, qn = q_ranges[r]
        ka, kn = k_ranges[r]
        assert torch.equal(qo, q_full[:, :, qa : qa + qn]), (H, Hkv, S, "q")
        assert torch.equal(ko, k_full[:, :, ka : ka + kn]), (H, Hkv, S, "k")
        ((qo * wq[:, :, qa : qa + qn]).sum() + (ko * wk[:, :, ka : ka + kn]).sum()).backward()
        # Gradient of k: each rank that received kv head h contributes wk at h (summed over ranks).
        assert torch.equal(q.grad, _part(wq, 1, ss, r)), (H, Hkv, S, "dq")
        mult = torch.zeros(Hkv, dtype=torch.float64)
        for a, m in k_ranges:
            mult[a : a + m] += 1
        want_dk = _part(wk, 1, ss, r) * mult.view(1, 1, Hkv, 1)
        assert torch.allclose(k.grad, want_dk, rtol=0, atol=1e-12), (H, Hkv, S, "dk")
    return True


@pytest.mark.parametrize("world", quick_up_to(3, [1, 2, 3, 4]))
def test_all_to_all_many_overlapping_ranges(pools, world):
    assert all(pools(world).run(_fused_cases))


def _split_gather_cases():
    n, r = dist.get_world_size(), dist.get_rank()
    for dtype in DTYPES:
        for length in [1, n - 1, n, 2 * n + 1, 5 * n + 3]:
            if length < 1:
                continue
            for dim, shape in [(0, (length, 3)), (1, (2, length, 3)), (2, (2, 3, length)), (-1, (3, length))]:
                full = _global(shape, dtype, length)
                w = _global(shape, dtype, length + 7)
                d = dim % len(shape)
                sizes = split_sizes(length, n)
                mine = _part(full, d, sizes, r)
                for scale, scaled in [(None, lambda t: t), ("up", lambda t: t * n), ("down", lambda t: t / n)]:
                    # split: forward keeps own part, backward gathers.
                    x = full.clone().requires_grad_()
                    y = split(x, None, dim, grad_scale=scale)
                    assert torch.equal(y, mine), ("split", dtype, length, dim)
                    (y * _part(w, d, sizes, r)).sum().backward()
                    assert torch.equal(x.grad, scaled(w)), ("split bwd", dtype, length, dim, scale)
                    # gather: forward all-gathers, backward keeps own part.
                    x = mine.clone().requires_grad_()
                    y = gather(x, None, dim, sizes=sizes if scale else None, grad_scale=scale)
                    assert torch.equal(y, full), ("gather", dtype, length, dim)
                    (y * w).sum().backward()
                    assert torch.equal(x.grad, scaled(_part(w, d, sizes, r))), ("gather bwd", scale)
                # all_gather: backward reduce-scatters per-rank partial gradients.
                x = mine.clone().requires_grad_()
                y = all_gather(x, None, dim)
                assert torch.equal(y, full)
                # Small integers: sums are exact in every dtype and any reduction order.
                def partial(i):
                    return torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(100 + i)).to(dtype)

                (y * partial(r)).sum().backward()
                total = sum(partial(i) for i in range(n))
                assert torch.equal(x.grad, _part(total, d, sizes, r)), ("all_gather bwd", dtype, length, dim)
    # reduce_scatter / all_reduce / copy_to in float64 (sums are exact for small integers).
    for length in [1, n + 1, 3 * n]:
        sizes = split_sizes(length, n)
        xr = torch.arange(length * 2, dtype=torch.float64).view(length, 2) * (r + 1)
        x = xr.clone().requires_grad_()
        y = reduce_scatter(x, None, 0)
        total = torch.arange(length * 2, dtype=torch.float64).view(length, 2) * (n * (n + 1) / 2)
        assert torch.equal(y, _part(total, 0, sizes, r)), ("reduce_scatter", length)
        w = torch.full((length, 2), 3.0, dtype=torch.float64)
        (y * _part(w, 0, sizes, r)).sum().backward()
        assert torch.equal(x.grad, w), "reduce_scatter bwd"
        x = xr.clone().requires_grad_()
        y = all_reduce(x, None)
        assert torch.equal(y, total)
        y.sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x)), "all_reduce bwd is identity"
        x = xr.clone().requires_grad_()
        y = copy_to(x, None)
        assert torch.equal(y, xr)
        (y * (r + 1)).sum().backward()
        assert torch.equal(x.grad, torch.full_like(xr, n * (n + 1) / 2)), "copy_to bwd all-reduces"
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_split_gather_reduce(pools, world):
    assert all(pools(world).run(_split_gather_cases))


def _bad_input_cases():
    n = dist.get_world_size()
    x = torch.zeros(2, 3, 4)
    checks = [
        (lambda: all_to_all(x, None, 1, 1), r"scatter_dim=1 and gather_dim=1 are the same dim"),
        (lambda: all_to_all(x, None, 3, 1), r"scatter_dim=3 is out of range for a 3-dim tensor"),
        (lambda: all_to_all(x, None, 1, -4), r"gather_dim=-4 is out of range"),
        (lambda: all_to_all(x, "world", 1, 2), r"group must be a torch.distributed ProcessGroup or None, got str"),
        (lambda: all_to_all(x, None, 1, 2, gather_size=5 * n), rf"gather_size={5 * n} over {n} ranks gives rank \d+ 5 elements"),
        (lambda: split(x, None, 1, sizes=[1] * n if n != 3 else [2] * n), r"sum to"),
        (lambda: split(x, None, 1, sizes=[3] + [0] * n), rf"has {n + 1} entries"),
        (lambda: split(x, None, 1, grad_scale="sideways"), r"grad_scale must be None, 'up' or 'down'"),
        (lambda: gather(x, None, 0, sizes=[3] * n), r"sizes \[3.*\] give rank \d+ 3 elements but its tensor has 2"),
        (lambda: reduce_scatter(x, None, 2, sizes=[-1] + [5] + [0] * (n - 2) if n > 1 else [-1]), r"negative"),
        (lambda: split(3.0, None, 0), r"expected a tensor, got float"),
    ]
    for fn, pattern in checks:
        with pytest.raises(ValueError, match=pattern):
            fn()
    # gather_size=None exchanges shapes and rejects disagreement outside the gather dim.
    r = dist.get_rank()
    if n > 1:
        bad = torch.zeros(2, 3 + (r == 1), 4)
        with pytest.raises(ValueError, match=r"rank 1 has shape \[2, 4, 4\]"):
            all_to_all(bad, None, 1, 2)
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_bad_input(pools, world):
    assert all(pools(world).run(_bad_input_cases))


def _round_trip(shape, sd, gd, dtype_name):
    n, r = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    full = _global(shape, dtype, sum(shape))
    gs = split_sizes(shape[gd], n)
    x = _part(full, gd, gs, r).clone().requires_grad_()
    y = all_to_all(x, None, sd, gd)
    assert torch.equal(y, _part(full, sd, split_sizes(shape[sd], n), r))
    back = all_to_all(y, None, gd, sd, gather_size=shape[sd])
    assert torch.equal(back, x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    return True


@st.composite
def _a2a_problem(draw):
    ndim = draw(st.integers(2, 5))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    sd, gd = draw(st.permutations(range(ndim)))[:2]
    return shape, sd, gd, draw(st.sampled_from(["float32", "float64", "bfloat16"]))


@pytest.mark.parametrize("world", [2, 3])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=_a2a_problem())
def test_all_to_all_round_trip_property(pools, world, problem):
    shape, sd, gd, dtype = problem
    assert all(pools(world).run(_round_trip, shape, sd, gd, dtype))


def _memory_cases():
    """Bytes allocated by one all_to_all: staging copy + output, i.e. 2x an aligned input."""
    from seqpar.tools.profiling import StorageTracker

    n, r = dist.get_world_size(), dist.get_rank()
    H, D = 4 * n, 8
    for B in (1, 3):
        S = 16 * n
        for sd, gd, local in [(2, 1, [B, S // n, H, D]), (1, 2, [B, S, H // n, D])]:
            x = torch.randn(local, dtype=torch.float32, requires_grad=True)
            with StorageTracker() as mem:
                y = all_to_all(x, None, sd, gd, gather_size=S if gd == 1 else H)
            assert mem.allocated <= 2 * x.nbytes, (B, sd, gd, mem.allocated, x.nbytes)
            # Backward (the reverse all-to-all) is bounded the same way. (autograd.grad, since
            # accumulating a strided gradient into x.grad would add autograd's own layout copy.)
            g = torch.randn_like(y)
            with StorageTracker() as mem:
                (dx,) = torch.autograd.grad(y, x, g)
            assert mem.allocated <= 2 * x.nbytes, ("backward", B, sd, gd, mem.allocated, x.nbytes)
    # Fused q, k, v: 2x forward; backward stages the output gradients directly (no combined
    # buffer), so staging + receive + one copy out per input = 3x.
    S = 8 * n
    xs = [torch.randn(2, S // n, h, D, requires_grad=True) for h in (2 * n, n, n)]
    total = sum(x.nbytes for x in xs)
    with StorageTracker() as mem:
        ys = all_to_all_many(xs, None, 2, 1, gather_size=S)
    assert mem.allocated <= 2 * total, ("fused", mem.allocated, total)
    gs = [torch.randn_like(y) for y in ys]
    with StorageTracker() as mem:
        torch.autograd.grad(ys, xs, gs)
    assert mem.allocated <= 3 * total, ("fused backward", mem.allocated, total)
    # Unaligned: the output may be larger than the input; still exactly staging + output.
    x = torch.randn(1, split_sizes(5 * n + 1, n)[r], 2 * n + 1, 8)
    with StorageTracker() as mem:
        y = all_to_all(x, None, 2, 1, gather_size=5 * n + 1)
    assert mem.allocated == x.nbytes + y.numel() * y.element_size()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_memory_bound(pools, world):
    assert all(pools(world).run(_memory_cases))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8])
def test_staging_copy_is_bitwise_in_words_or_elements(dtype):
    """The staging copy moves 8-byte words where the layouts allow and elements elsewhere; both
    keep every bit (NaN payloads included): compared as raw bytes."""
    from seqpar.comm.all_to_all import _copy, _words_fit

    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 10, 6, 16 * 8), generator=g, dtype=torch.uint8)
    src_all = raw.view(dtype)  # arbitrary bit patterns, NaNs and infs among them for floats
    k = 8 // src_all.element_size() if src_all.element_size() < 8 else 1
    cases = [
        (slice(None), slice(None), slice(None)),  # whole: words where k > 1
        (slice(1, 3), slice(2, 7), slice(None)),  # strided outer dims, contiguous last
        (slice(None), slice(None), slice(1, 2 * k + 1 if k > 1 else 3)),  # last dim offset: elements
        (slice(None), slice(None), slice(0, 3)),  # last dim not whole words (for k > 1)
    ]
    for i, (a, b, c) in enumerate(cases):
        src = src_all[:, a, b, c].movedim(1, 0)
        dst_all = torch.zeros((src.shape[0], src.shape[1] + 1, *src.shape[2:]), dtype=dtype)
        dst = dst_all[:, 1:]
        _copy(dst, src)
        assert torch.equal(dst.contiguous().view(torch.uint8), src.contiguous().view(torch.uint8)), (dtype, i)
        assert torch.equal(dst_all[:, :1].view(torch.uint8), torch.zeros_like(dst_all[:, :1]).view(torch.uint8))
    # Which path each layout takes.
    assert _words_fit(src_all, 2) and not _words_fit(src_all[..., 1:], 2)
    assert not _words_fit(src_all.transpose(-1, -2), 2)


def _released_input_cases():
    """With release_inputs, an input whose last reference the list held is freed once staged,
    before the output is allocated (no view of it left behind by the staging loop)."""
    import importlib
    import weakref

    a2a = importlib.import_module("seqpar.comm.all_to_all")  # the module (the package exports a function of that name)

    n = dist.get_world_size()
    S, H, D = 8 * n, 4 * n, 16
    seen = []
    allocate = a2a._empty_moved

    for release in (False, True):
        xs = [torch.randn(1, S // n, H, D)]
        alive = weakref.ref(xs[0])

        def spy(*args, **kwargs):
            seen.append((release, alive() is not None))
            return allocate(*args, **kwargs)

        a2a._empty_moved = spy
        try:
            out = a2a.fused_all_to_all(xs, None, 2, 1, [[(4 * j, 4) for j in range(n)]], [S // n] * n,
                                       release_inputs=release)
        finally:
            a2a._empty_moved = allocate
        assert out[0].shape == (1, S, 4, D)
    # Without release the caller's list still holds the input; with it, nothing does.
    assert seen == [(False, True), (True, False)], seen
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_releases_its_inputs_before_the_output(pools, world):
    assert all(pools(world).run(_released_input_cases))


def _staging_release_cases():
    """A fresh staging buffer is freed once the collective has completed, even while someone else
    (gloo's worker thread, here a spy) still holds the tensor; a kept arena's slice is not."""
    import importlib

    from seqpar.comm import Workspace

    a2a = importlib.import_module("seqpar.comm.all_to_all")
    n = dist.get_world_size()
    held = []
    collective = a2a.dist.all_to_all_single

    def spy(out, inp, *args, **kwargs):
        held.append(inp)  # as gloo's work object does until its thread lets go
        return collective(out, inp, *args, **kwargs)

    x = torch.randn(1, 3 * n + 1, 2 * n + 1, 8)
    want = all_to_all(x, None, 2, 1)
    kept = Workspace(keep=True)
    a2a.dist.all_to_all_single = spy
    try:
        fresh_out = all_to_all(x, None, 2, 1)
        for _ in range(2):  # the first scope sizes the arena, the second stages in it
            with kept.scope():
                kept_out = all_to_all(x, None, 2, 1, workspace=kept)
    finally:
        a2a.dist.all_to_all_single = collective
    assert torch.equal(fresh_out, want) and torch.equal(kept_out, want)
    assert held[0].untyped_storage().nbytes() == 0  # fresh: freed at once
    assert kept.holds(held[2]) and held[2].untyped_storage().nbytes() == kept.nbytes  # arena: untouched
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_frees_fresh_staging_after_the_collective(pools, world):
    assert all(pools(world).run(_staging_release_cases))


def test_storage_tracker_counts_storage_resized_in_place():
    """A storage resized to nothing (a buffer released early) stops counting at once."""
    from seqpar.tools.profiling import StorageTracker

    with StorageTracker() as mem:
        a = torch.empty(1000)
        keep = a  # a second reference: the storage itself stays alive
        a.untyped_storage().resize_(0)
        b = torch.empty(10)
    assert mem.peak == 4000 and mem.current == 40
    del keep, b


def _last_dim_cases():
    """Gathering over the last dim (Note [Gather over the last dim]): blocks staged in the input's
    own order (none at all when the input already lies in send order), a contiguous output,
    bit-exact both ways; fused tensors whose backward gathers over the last dim; a kept workspace."""
    from seqpar.comm import Workspace
    from seqpar.tools.profiling import StorageTracker

    n, r = dist.get_world_size(), dist.get_rank()
    for lead, S, F in [((1,), 2 * n + 1, 3 * n), ((2,), n + 2, 2 * n - 1), ((1, 1), 3 * n, n + 1), ((1, 2), n, 5),
                       ((1,), max(n - 1, 1), n + 2)]:  # the last: ranks with no piece
        full = _global((*lead, S, F), torch.float32, S + F)
        w = _global((*lead, S, F), torch.float32, S + F + 1)
        sd, gd = len(lead), len(lead) + 1
        ss, fs = split_sizes(S, n), split_sizes(F, n)
        x = _part(full, gd, fs, r).clone().requires_grad_()
        for workspace in (None, Workspace(keep=True)):
            with StorageTracker() as mem:
                y = all_to_all(x, None, sd, gd, gather_size=F, workspace=workspace)
            assert torch.equal(y, _part(full, sd, ss, r)) and y.is_contiguous(), (lead, S, F)
            in_order = all(s == 1 for s in lead)
            if workspace is None and n > 1:  # no staging copy when x already lies in send order
                assert mem.allocated == (0 if in_order else x.nbytes) + 2 * y.nbytes, (lead, mem.allocated)
        x.grad = None
        (y * _part(w, sd, ss, r)).sum().backward()
        assert torch.equal(x.grad, _part(w, gd, fs, r)), (lead, S, F, "backward")
    # Fused, scattering the last dim: the backward stacks both gradients over the last dim.
    S, Fa, Fb = 2 * n + 1, 2 * n, n
    a_full, b_full = _global((2, S, Fa), torch.float64, 1), _global((2, S, Fb), torch.float64, 2)
    wa, wb = _global((2, S, Fa), torch.float64, 3), _global((2, S, Fb), torch.float64, 4)
    ss = split_sizes(S, n)
    ra = [(2 * j, 2) for j in range(n)]
    rb = [(j // 2, 1) for j in range(n)]  # overlapping: ranks 2i and 2i + 1 share a column
    a = _part(a_full, 1, ss, r).clone().requires_grad_()
    b = _part(b_full, 1, ss, r).clone().requires_grad_()
    ao, bo = all_to_all_many([a, b], None, 2, 1, gather_size=S, scatter_ranges=[ra, rb])
    assert torch.equal(ao, a_full[:, :, 2 * r:2 * r + 2]) and torch.equal(bo, b_full[:, :, r // 2:r // 2 + 1])
    ((ao * wa[:, :, 2 * r:2 * r + 2]).sum() + (bo * wb[:, :, r // 2:r // 2 + 1]).sum()).backward()
    assert torch.equal(a.grad, _part(wa, 1, ss, r))
    mult = torch.zeros(Fb, dtype=torch.float64)
    for start, m in rb:
        mult[start:start + m] += 1
    assert torch.allclose(b.grad, _part(wb, 1, ss, r) * mult, rtol=0, atol=1e-12)
    return True


@pytest.mark.parametrize("world", quick_up_to(3, [1, 2, 3, 4]))
def test_all_to_all_over_the_last_dim(pools, world):
    assert all(pools(world).run(_last_dim_cases))
