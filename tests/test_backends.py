"""Attention backends (seqpar.backends) against the float64 reference.

Accuracy rules: float64 within 1e-10, float32 within 1e-4 of the float64 reference; bf16/fp16 by
flash-attn's rule: error at most 2x that of ``reference_attention`` run in the same dtype (both
measured against float64), plus a small eps. CPU tests cover ``reference`` and ``cpu``; tests
marked ``cuda`` cover the CUDA backends wherever CUDA exists. ``flash_attn`` is also exercised on
CPU through fake ``flash_attn`` modules that mimic the packages' signatures across versions.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from _common import DTYPES, TOL
from seqpar.backends import AttentionBackend, available_backends, get_backend
from seqpar.backends import flash_attn as flash_attn_module
from seqpar.backends.base import (
    KernelBackend,
    packed_lse_from_padded,
    padded_lse_from_packed,
    tokens_of_empty_partner,
)
from seqpar.backends.cpu import CpuFlashBackend, _plan
from seqpar.backends.reference import (
    ReferenceBackend,
    reference_attention,
    reference_varlen_attention,
)
from seqpar.backends.torch_cuda import TorchEfficientBackend, TorchFlashBackend
from seqpar.parallel.merge import merge_, new_accumulators

NEG_INF = float("-inf")
CPU_BACKENDS = ["reference", "cpu"]
# (H, Hkv): every Hkv in {1, 2, H} that divides H.
_HEADS = [(h, hkv) for h in (1, 3, 4, 6, 8) for hkv in sorted({1, 2, h}) if h % hkv == 0]
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------------------------------------
# Helpers


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _dense_inputs(b, sq, sk, h, hkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return (_randn(b, sq, h, d, gen=gen), _randn(b, sk, hkv, d, gen=gen),
            _randn(b, sk, hkv, d, gen=gen), _randn(b, sq, h, d, gen=gen))


def _reference_dense(q, k, v, dout, causal, dtype, **options):
    """``out, lse, dq, dk, dv`` of ``reference_attention`` run in ``dtype`` (as float64)."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(q, k, v, causal=causal, return_lse=True, **options)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]
    return [t.detach().double() for t in (out, lse, *grads)]


def _reference_varlen(q, k, v, dout, lens_q, lens_k, causal, dtype, **options):
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = reference_varlen_attention(
        q, k, v, lens_q, seq_lens_k=lens_k, causal=causal, return_lse=True, **options
    )
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]
    return [t.detach().double() for t in (out, lse, *grads)]


def _assert_accurate(name, actual, ref64, same_dtype, dtype_name):
    """Check ``actual`` against the float64 reference by the rule for its dtype."""
    assert actual.shape == ref64.shape, (name, actual.shape, ref64.shape)
    actual = actual.detach().double().cpu()
    ref64, same_dtype = ref64.cpu(), same_dtype.cpu()
    inf = torch.isinf(ref64)
    assert torch.equal(torch.isinf(actual), inf), f"{name}: -inf pattern differs"
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    actual, ref64, same_dtype = (t.masked_fill(inf, 0.0) for t in (actual, ref64, same_dtype))
    if actual.numel() == 0:
        return
    err = (actual - ref64).abs().max().item()
    scale = max(1.0, ref64.abs().max().item())
    if dtype_name in TOL:
        tol = TOL[dtype_name] * scale
    else:
        base = (same_dtype - ref64).abs().max().item()
        tol = 2 * base + 1e-2 * scale
    assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


def _cu(lens, device="cpu"):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def _check_dense(name, device, dtype_name, b, sq, sk, h, hkv, d, causal, seed=0, window=(-1, -1),
                 softcap=0.0, scale=None):
    dtype = DTYPES[dtype_name]
    scale = d**-0.5 if scale is None else scale
    options = dict(window=window, softcap=softcap, scale=scale)
    backend = get_backend(name, device, dtype, window=window != (-1, -1), softcap=softcap > 0)
    q, k, v, dout = _dense_inputs(b, sq, sk, h, hkv, d, seed)
    ref = _reference_dense(q, k, v, dout, causal, torch.float64, **options)
    same = (_reference_dense(*(t.to(device) for t in (q, k, v, dout)), causal, dtype, **options)
            if dtype_name not in TOL else ref)
    args = [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]
    out, lse = backend.forward(*args[:3], causal=causal, **options)
    assert out.dtype == dtype and out.device.type == torch.device(device).type
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grads = backend.backward(args[3], *args[:3], out, lse, causal=causal, **options)
    for x, g in zip(args[:3], grads):
        assert g.dtype == dtype and g.shape == x.shape
    for what, actual, r, s in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref, same):
        _assert_accurate(what, actual, r, s, dtype_name)


def _check_varlen(name, device, dtype_name, lens_q, lens_k, h, hkv, d, causal, seed=0,
                  window=(-1, -1), softcap=0.0, scale=None):
    dtype = DTYPES[dtype_name]
    options = dict(window=window, softcap=softcap, scale=d**-0.5 if scale is None else scale)
    backend = get_backend(name, device, dtype, window=window != (-1, -1), softcap=softcap > 0)
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = _randn(tq, h, d, gen=gen), _randn(tk, hkv, d, gen=gen), _randn(tk, hkv, d, gen=gen)
    dout = _randn(tq, h, d, gen=gen)
    ref = _reference_varlen(q, k, v, dout, lens_q, lens_k, causal, torch.float64, **options)
    same = (_reference_varlen(*(t.to(device) for t in (q, k, v, dout)), lens_q, lens_k, causal,
                              dtype, **options)
            if dtype_name not in TOL else ref)
    args = [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]
    cu = (_cu(lens_q, device), _cu(lens_k, device), max(lens_q, default=0),
          max(lens_k, default=0))
    out, lse = backend.varlen_forward(*args[:3], *cu, causal=causal, **options)
    grads = backend.varlen_backward(args[3], *args[:3], out, lse, *cu, causal=causal, **options)
    for what, actual, r, s in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref, same):
        _assert_accurate(what, actual, r, s, dtype_name)


# ---------------------------------------------------------------------------------------------
# Dense, CPU backends


@pytest.mark.parametrize("d", [8, 64])
@pytest.mark.parametrize("b, s", [(1, 1), (2, 5), (1, 37), (2, 129)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_dense_matches_reference(name, dtype_name, causal, b, s, d):
    _check_dense(name, "cpu", dtype_name, b, s, s, 4, 2, d, causal, seed=s + 7 * d + b)


@pytest.mark.parametrize("heads", _HEADS, ids=lambda p: f"H{p[0]}kv{p[1]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name", ["float64", "bfloat16"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_dense_heads_gqa(name, dtype_name, causal, heads):
    _check_dense(name, "cpu", dtype_name, 2, 37, 37, *heads, 16, causal, seed=heads[0])


@pytest.mark.parametrize("sq, sk", [(5, 37), (37, 5), (1, 129), (129, 1), (64, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 1), (3, 3)], ids=lambda p: f"H{p[0]}kv{p[1]}")
@pytest.mark.parametrize("dtype_name", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_dense_rectangular(name, dtype_name, heads, causal, sq, sk):
    # causal blocks that are not square are aligned bottom-right (flash-attn); with sq > sk the
    # first rows see no key at all (out 0, lse -inf).
    _check_dense(name, "cpu", dtype_name, 2, sq, sk, *heads, 16, causal, seed=sq * sk)


# Windows (left, right) in flash-attn's convention, incl. ones that cut every row, leave rows
# without keys, or are wider than the block.
_WINDOWS = [(0, 0), (3, -1), (-1, 2), (2, 5), (10, 1), (0, -1), (200, 200)]


@pytest.mark.parametrize("window", _WINDOWS, ids=str)
@pytest.mark.parametrize("sq, sk", [(37, 37), (5, 37), (37, 5), (64, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_dense_windows(name, causal, sq, sk, window):
    if causal and window[1] > 0:
        window = (window[0], 0)
    for dtype_name in ("float64", "float32", "bfloat16"):
        _check_dense(name, "cpu", dtype_name, 2, sq, sk, 4, 2, 16, causal, seed=sq + sk,
                     window=window)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 0), (3, 7)])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_non_positive_scale(name, window, scale):
    # The CPU kernel scales after its causal -inf: a scale <= 0 once gave all-NaN rows.
    causal = window[1] == 0
    _check_dense(name, "cpu", "float64", 2, 37, 37, 4, 2, 16, causal, window=window, scale=scale)
    _check_dense(name, "cpu", "float32", 1, 29, 41, 3, 1, 16, causal, window=window, scale=scale)
    _check_varlen(name, "cpu", "float64", [9, 1, 20], [9, 1, 20], 4, 2, 16, causal, window=window,
                  scale=scale)


def test_cpu_windows_tile_large_blocks(monkeypatch):
    # Small tiles force several row tiles per block (Note [CPU windows]); results are unchanged.
    from seqpar.backends import cpu
    monkeypatch.setattr(cpu, "_MASK_ELEMENTS", 64)
    for window in ((7, 0), (2, 9), (-1, 3)):
        _check_dense("cpu", "cpu", "float64", 1, 150, 150, 2, 1, 8, False, window=window)
        _check_varlen("cpu", "cpu", "float64", [150, 3, 40], [150, 3, 40], 2, 1, 8, True,
                      window=window)



def test_cpu_windowed_segments_add_into_the_call_gradients():
    # A windowed segment of a varlen backward adds its tiles straight into the gradients it is
    # given (Note [CPU windows]): no segment-sized dq, dk, dv of its own. Two long sequences,
    # window 63: the tracked peak stays below one set of the call's gradients (the old code held
    # a zero-filled set per segment, and the previous segment's results next to the next one's).
    from seqpar.tools.profiling import StorageTracker

    backend = CpuFlashBackend()
    lens, h, d = [1500, 1300], 4, 32
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(sum(lens), h, d, generator=gen) for _ in range(4))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    options = dict(causal=True, scale=d**-0.5, window=(63, 0))
    out, lse = backend.varlen_forward(q, k, v, cu, cu, max(lens), max(lens), **options)
    packing = backend._packing(q, k, v, cu, cu, max(lens), max(lens))
    grads = tuple(torch.zeros_like(t) for t in (q, k, v))
    with StorageTracker() as mem:
        backend.kernel_varlen_backward_into(grads, dout, q, k, v, out, lse, packing, scale=d**-0.5,
                                            window=(63, 0), softcap=0.0)
    one_set = sum(t.numel() * t.element_size() for t in grads)
    assert 0 < mem.peak < one_set / 4, (mem.peak, one_set)
    want = backend.varlen_backward(dout, q, k, v, out, lse, cu, cu, max(lens), max(lens), **options)
    ref = _reference_varlen(q, k, v, dout, lens, lens, True, torch.float64, scale=d**-0.5, window=(63, 0),
                            softcap=0.0)
    for name, got, w, r in zip("qkv", grads, want, ref[2:]):
        torch.testing.assert_close(got, w, msg=f"d{name}")
        assert (got.double() - r).abs().max() < 1e-4, name

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name", ["float64", "float32", "bfloat16"])
def test_reference_backend_softcap(dtype_name, causal):
    for window in ((-1, -1), (4, 0)):
        _check_dense("reference", "cpu", dtype_name, 2, 37, 37, 4, 2, 16, causal, window=window,
                     softcap=3.0)
        _check_varlen("reference", "cpu", dtype_name, [9, 0, 30, 2], [9, 0, 30, 2], 4, 2, 16,
                      causal, window=window, softcap=3.0)


def test_cpu_backend_refuses_softcap_and_auto_picks_reference():
    with pytest.raises(ValueError, match="'cpu' cannot run.*has no softcap"):
        get_backend("cpu", "cpu", torch.float32, softcap=True)
    assert get_backend("auto", "cpu", torch.float32, softcap=True).name == "reference"
    assert get_backend("auto", "cpu", torch.float32, window=True).name == "cpu"
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="attention backend 'cpu': the CPU flash kernel has no softcap"):
        CpuFlashBackend().forward(q, q, q, causal=False, scale=1.0, softcap=2.0)


@pytest.mark.parametrize("dtype_name", ["float64", "float16"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_dense_other_dtypes(name, dtype_name):
    _check_dense(name, "cpu", dtype_name, 2, 33, 33, 4, 2, 32, True)


@pytest.mark.parametrize("sq, sk", [(0, 5), (7, 0), (0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_dense_empty_sides(name, dtype, sq, sk):
    backend = get_backend(name, "cpu", dtype)
    q = torch.randn(2, sq, 4, 8, dtype=dtype)
    k, v = torch.randn(2, sk, 2, 8, dtype=dtype), torch.randn(2, sk, 2, 8, dtype=dtype)
    out, lse = backend.forward(q, k, v, causal=False, scale=0.3)
    assert out.shape == (2, sq, 4, 8) and out.dtype == dtype and (out == 0).all()
    assert lse.shape == (2, 4, sq) and (lse == NEG_INF).all()
    dq, dk, dv = backend.backward(torch.randn_like(q), q, k, v, out, lse, causal=False, scale=0.3)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
    if sq == sk == 0:
        out, lse = backend.forward(q, k, v, causal=True, scale=0.3)
        assert out.shape == q.shape and lse.shape == (2, 4, 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_dense_non_contiguous_inputs(name, dtype, causal):
    backend = get_backend(name, "cpu", dtype)
    gen = torch.Generator().manual_seed(5)
    big_q = torch.randn(2, 30, 4, 16, generator=gen).to(dtype)
    q = big_q[:, 3:24]  # a slice along S
    k = torch.randn(2, 4, 21, 16, generator=gen).to(dtype).transpose(1, 2)[:, :, ::2]  # bhsd view
    v = torch.randn(2, 21, 2, 32, generator=gen).to(dtype)[..., ::2]  # strided head dim
    dout = torch.randn(2, 4, 21, 16, generator=gen).to(dtype).transpose(1, 2)
    assert not any(t.is_contiguous() for t in (q, k, v, dout))
    out, lse = backend.forward(q, k, v, causal=causal, scale=0.25)
    grads = backend.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25)
    contiguous = [t.contiguous() for t in (q, k, v, dout)]
    out_c, lse_c = backend.forward(*contiguous[:3], causal=causal, scale=0.25)
    grads_c = backend.backward(contiguous[3], *contiguous[:3], out_c, lse_c, causal=causal,
                               scale=0.25)
    for a, b in zip((out, lse, *grads), (out_c, lse_c, *grads_c)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=lambda p: f"H{p[0]}kv{p[1]}")
@pytest.mark.parametrize("dtype_name", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backward_uses_external_global_out_and_lse(name, dtype_name, heads):
    # Keys split in two blocks, forward results merged with merge_, then each block's backward
    # run with the merged (global) out/lse: the summed gradients are the full gradients.
    _external_lse_case(name, "cpu", dtype_name, heads)


def _external_lse_case(name, device, dtype_name, heads):
    dtype = DTYPES[dtype_name]
    backend = get_backend(name, device, dtype)
    h, hkv = heads
    b, s, d = 2, 29, 16
    split = 11
    q, k, v, dout = _dense_inputs(b, s, s, h, hkv, d, seed=11)
    # Causal: row chunk 0 sees key chunk 0 (causal); row chunk 1 sees key chunks 0 (full) and 1
    # (causal). Non-causal: all rows see both key chunks.
    ref = _reference_dense(q, k, v, dout, True, torch.float64)
    same = (_reference_dense(*(t.to(device) for t in (q, k, v, dout)), True, dtype)
            if dtype_name not in TOL else ref)
    qd, kd, vd, doutd = (t.to(device=device, dtype=dtype) for t in (q, k, v, dout))
    r0, r1 = slice(0, split), slice(split, s)
    blocks = [(r0, r0, True), (r1, r0, False), (r1, r1, True)]  # (rows, cols, causal)
    out_acc, lse_acc = new_accumulators(qd.shape, device=device, dtype=dtype)
    for rows, cols, causal in blocks:
        o, l = backend.forward(qd[:, rows], kd[:, cols], vd[:, cols], causal=causal, scale=d**-0.5)
        merge_(out_acc[:, rows], lse_acc[:, :, rows], o, l)
    out = out_acc.to(dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64, device=device) for t in (qd, kd, vd))
    for rows, cols, causal in blocks:
        gq, gk, gv = backend.backward(
            doutd[:, rows], qd[:, rows], kd[:, cols], vd[:, cols], out[:, rows],
            lse_acc[:, :, rows], causal=causal, scale=d**-0.5,
        )
        dq[:, rows] += gq.double()
        dk[:, cols] += gk.double()
        dv[:, cols] += gv.double()
    for what, actual, r, sm in zip(("out", "lse", "dq", "dk", "dv"),
                                   (out, lse_acc, dq, dk, dv), ref, same):
        _assert_accurate(what, actual, r, sm, dtype_name)


_ALL_BACKEND_CLASSES = [ReferenceBackend, CpuFlashBackend, TorchFlashBackend,
                        TorchEfficientBackend, flash_attn_module.FlashAttnBackend]


def test_backends_satisfy_protocol():
    for name in available_backends("cpu"):
        backend = get_backend(name, "cpu", torch.float32)
        assert isinstance(backend, AttentionBackend)
        assert backend.name == name
    for cls in _ALL_BACKEND_CLASSES:
        assert issubclass(cls, KernelBackend) and isinstance(cls(), AttentionBackend)
    with pytest.raises(TypeError, match="abstract"):
        KernelBackend()


@pytest.mark.parametrize("cls", _ALL_BACKEND_CLASSES, ids=lambda c: c.name)
def test_empty_blocks_never_reach_a_kernel(cls):
    # KernelBackend answers blocks without queries or keys itself, so even the CUDA backends
    # (and flash_attn without its package) give out = 0, lse = -inf and zero gradients on CPU.
    backend = cls()
    for sq, sk in ((0, 5), (7, 0), (0, 0)):
        q, k = torch.randn(2, sq, 4, 8), torch.randn(2, sk, 2, 8)
        out, lse = backend.forward(q, k, k, causal=False, scale=0.3)
        assert out.shape == q.shape and (out == 0).all()
        assert lse.shape == (2, 4, sq) and lse.dtype == torch.float32 and (lse == NEG_INF).all()
        grads = backend.backward(torch.randn_like(q), q, k, k, out, lse, causal=False, scale=0.3)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
        assert all((g == 0).all() for g in grads)
    for lens_q, lens_k in (([0, 0], [3, 2]), ([4, 1], [0, 0]), ([0, 0], [0, 0])):
        q, k = torch.randn(sum(lens_q), 4, 8), torch.randn(sum(lens_k), 2, 8)
        cu = (_cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
        out, lse = backend.varlen_forward(q, k, k, *cu, causal=False, scale=0.3)
        assert out.shape == q.shape and (out == 0).all()
        assert lse.shape == (4, sum(lens_q)) and (lse == NEG_INF).all()
        grads = backend.varlen_backward(torch.randn_like(q), q, k, k, out, lse, *cu,
                                        causal=False, scale=0.3)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
        assert all((g == 0).all() for g in grads)


# ---------------------------------------------------------------------------------------------
# Varlen, CPU backends

# name: (sequence lengths, (H, Hkv))
_VARLEN_CASES = {
    "mixed": ([0, 1, 5, 37, 3, 130, 2, 2, 2, 9, 0, 1, 200, 17, 17, 16], (4, 2)),
    "uniform": ([16] * 12, (6, 1)),
    "tiny": ([1, 2, 1, 3, 1, 1, 2, 4, 1], (3, 3)),
    "one": ([57], (2, 1)),
    "empty": ([0, 0], (4, 4)),
}


def _key_lengths(lens, causal, seed):
    if causal:
        return list(lens)
    gen = torch.Generator().manual_seed(seed)
    shifts = torch.randint(-3, 4, (len(lens),), generator=gen).tolist()
    lens_k = [max(0, n + s) for n, s in zip(lens, shifts)]
    if len(lens_k) > 4:
        lens_k[3] = 0  # a query sequence with no keys
        lens_k[0] = 6  # keys with no queries
    return lens_k


@pytest.mark.parametrize("case", list(_VARLEN_CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_varlen_matches_reference(name, dtype_name, causal, case):
    lens_q, heads = _VARLEN_CASES[case]
    lens_k = _key_lengths(lens_q, causal, seed=len(lens_q))
    _check_varlen(name, "cpu", dtype_name, lens_q, lens_k, *heads, 16, causal)


@pytest.mark.parametrize("window", [(0, 0), (3, -1), (2, 5), (30, 1)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_varlen_windows(name, causal, window):
    # Per-sequence bottom-right windows, with sequences of different q and k lengths (direct
    # calls for long ones, padded buckets with window masks for short ones).
    if causal and window[1] > 0:
        window = (window[0], 0)
    lens_q, heads = _VARLEN_CASES["mixed"]
    lens_k = _key_lengths(lens_q, False, seed=3)
    for dtype_name in ("float64", "float32"):
        _check_varlen(name, "cpu", dtype_name, lens_q, lens_k, *heads, 16, causal, window=window)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_varlen_random_lengths(name, seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 20, (1,), generator=gen))
    pool = torch.tensor([0, 1, 1, 2, 3, 5, 8, 9, 12, 17, 31, 33, 40, 64, 129])
    lens = pool[torch.randint(0, len(pool), (n,), generator=gen)].tolist()
    causal = seed % 2 == 0
    _check_varlen(name, "cpu", "float64", lens, _key_lengths(lens, causal, seed), 4, 2, 8, causal,
                  seed=seed)


@pytest.mark.parametrize("split_from", [2, None])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_cpu_varlen_causal_halves(monkeypatch, dtype_name, split_from):
    # A long causal sequence's backward runs as three calls on its halves (Note [CPU varlen]):
    # an odd length above the shipped threshold (the halves differ by one) next to short ones;
    # from 2 tokens every direct sequence of the mixed case takes that path.
    import seqpar.backends.cpu as cpu_mod

    if split_from is None:
        lens = [5, cpu_mod._SPLIT_CAUSAL_FROM + 53, 40, 3]
    else:
        monkeypatch.setattr(cpu_mod, "_SPLIT_CAUSAL_FROM", split_from)
        lens = _VARLEN_CASES["mixed"][0]
    _check_varlen("cpu", "cpu", dtype_name, lens, lens, 4, 2, 16, True)


def test_cpu_varlen_plan_covers_every_path():
    lens = _VARLEN_CASES["mixed"][0] + [16] * 5 + [9, 10]
    plan = _plan(lens, _key_lengths(lens, False, 0), 64)
    assert plan.direct, "no sequence took a direct kernel call"
    assert any(b.q.start is None for b in plan.buckets), "no gathered (padded) bucket"
    assert any(b.mask((-1, -1), torch.float32, "cpu")[1] is not None for b in plan.buckets), (
        "no bucket with padded keys"
    )
    plan = _plan([16] * 12, [16] * 12, 64)
    assert len(plan.buckets) == 1 and plan.buckets[0].q.start == 0, "uniform run is not a view"
    assert plan.buckets[0].mask((-1, 0), torch.float32, "cpu") == (True, None, None)
    assert _plan([57], [40], 64).covers_all(57, 40)
    assert not _plan([0, 57], [3, 40], 64).covers_all(57, 43)
    # Each packed token is covered exactly once.
    covered = torch.zeros(sum(lens), dtype=torch.int64)
    plan = _plan(lens, lens, 64)
    for s_q, l_q, _, _ in plan.direct:
        covered[s_q:s_q + l_q] += 1
    for bucket in plan.buckets:
        covered.index_add_(0, bucket.q.index[bucket.q.valid],
                           torch.ones(int(bucket.q.valid.sum()), dtype=torch.int64))
    assert covered.tolist() == [1] * sum(lens)


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_varlen_backward_uses_external_global_out_and_lse(name, dtype_name):
    # Every sequence's keys split in two parts, each part a varlen call; merged with merge_; each
    # call's backward with the merged out/lse; gradients summed = full gradients.
    dtype = DTYPES[dtype_name]
    backend = get_backend(name, "cpu", dtype)
    lens = [7, 0, 1, 40, 3, 3, 150, 12, 12, 5]
    part_a = [n // 3 for n in lens]
    part_b = [n - a for n, a in zip(lens, part_a)]
    h, hkv, d = 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    t = sum(lens)
    q, k, v, dout = (_randn(t, hh, d, gen=gen) for hh in (h, hkv, hkv, h))
    ref = _reference_varlen(q, k, v, dout, lens, lens, False, torch.float64)
    # Key token indices of each part, in packed order.
    starts = [0, *itertools.accumulate(lens)]
    idx_a = torch.tensor([i for s, a in zip(starts, part_a) for i in range(s, s + a)])
    idx_b = torch.tensor([i for s, a, n in zip(starts, part_a, lens) for i in range(s + a, s + n)])
    qd, kd, vd, doutd = (x.to(dtype) for x in (q, k, v, dout))
    out_acc, lse_acc = new_accumulators(qd.shape, device="cpu", dtype=dtype)
    parts = [(idx_a, part_a), (idx_b, part_b)]
    for idx, part in parts:
        o, l = backend.varlen_forward(qd, kd[idx], vd[idx], _cu(lens), _cu(part), max(lens),
                                      max(part), causal=False, scale=d**-0.5)
        merge_(out_acc, lse_acc, o, l)
    out = out_acc.to(dtype)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for idx, part in parts:
        gq, gk, gv = backend.varlen_backward(
            doutd, qd, kd[idx], vd[idx], out, lse_acc, _cu(lens), _cu(part), max(lens),
            max(part), causal=False, scale=d**-0.5,
        )
        dq += gq.double()
        dk[idx] += gk.double()
        dv[idx] += gv.double()
    for what, actual, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse_acc, dq, dk, dv), ref):
        _assert_accurate(what, actual, r, r, dtype_name)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_varlen_non_contiguous_inputs(name):
    backend = get_backend(name, "cpu", torch.float32)
    lens = [5, 16, 16, 16, 3, 140, 0, 7]
    gen = torch.Generator().manual_seed(9)
    t = sum(lens)
    q = torch.randn(t, 8, 16, generator=gen)[:, 2:6]  # head slice
    k = torch.randn(t, 2, 32, generator=gen)[..., ::2]  # strided head dim
    v = torch.randn(2 * t, 2, 16, generator=gen)[::2]  # strided tokens
    dout = torch.randn(4, t, 16, generator=gen).transpose(0, 1)
    cu = (_cu(lens), _cu(lens), max(lens), max(lens))
    out, lse = backend.varlen_forward(q, k, v, *cu, causal=True, scale=0.25)
    lse_view = lse.t().contiguous().t()  # same values, transposed strides
    assert not lse_view.is_contiguous()
    grads = backend.varlen_backward(dout, q, k, v, out, lse_view, *cu, causal=True, scale=0.25)
    contiguous = [x.contiguous() for x in (q, k, v, dout)]
    out_c, lse_c = backend.varlen_forward(*contiguous[:3], *cu, causal=True, scale=0.25)
    grads_c = backend.varlen_backward(contiguous[3], *contiguous[:3], out_c, lse_c, *cu,
                                      causal=True, scale=0.25)
    for a, b in zip((out, lse, *grads), (out_c, lse_c, *grads_c)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_varlen_queries_without_keys(name):
    backend = get_backend(name, "cpu", torch.float32)
    q = torch.randn(9, 2, 8)
    k = torch.randn(4, 1, 8)
    lens_q, lens_k = [5, 4], [0, 4]
    out, lse = backend.varlen_forward(q, k, k, _cu(lens_q), _cu(lens_k), 5, 4, causal=False,
                                      scale=0.3)
    assert (out[:5] == 0).all() and (lse[:, :5] == NEG_INF).all()
    assert torch.isfinite(lse[:, 5:]).all()
    dq, dk, dv = backend.varlen_backward(torch.randn_like(q), q, k, k, out, lse, _cu(lens_q),
                                         _cu(lens_k), 5, 4, causal=False, scale=0.3)
    assert (dq[:5] == 0).all() and not torch.isnan(dq).any()
    # No keys at all.
    out, lse = backend.varlen_forward(q, k[:0], k[:0], _cu(lens_q), _cu([0, 0]), 5, 0,
                                      causal=False, scale=0.3)
    assert (out == 0).all() and (lse == NEG_INF).all()
    dq, dk, dv = backend.varlen_backward(torch.randn_like(q), q, k[:0], k[:0], out, lse,
                                         _cu(lens_q), _cu([0, 0]), 5, 0, causal=False, scale=0.3)
    assert (dq == 0).all() and dk.shape == (0, 1, 8)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_varlen_input_errors(name):
    backend = get_backend(name, "cpu", torch.float32)
    q = torch.randn(9, 2, 8)
    with pytest.raises(ValueError, match="must rise from 0 to the 9 q tokens"):
        backend.varlen_forward(q, q, q, _cu([5, 3]), _cu([5, 4]), 5, 5, causal=False, scale=1.0)
    with pytest.raises(ValueError, match="multiple of the 3 key/value heads"):
        k = torch.randn(9, 3, 8)
        backend.varlen_forward(q[:, :2], k, k, _cu([9]), _cu([9]), 9, 9, causal=False, scale=1.0)
    # cu_seqlens are checked on the host before an empty block is answered.
    with pytest.raises(ValueError, match="must rise from 0 to the 9 k tokens"):
        backend.varlen_forward(q[:0], q, q, _cu([0, 0]), _cu([5, 3]), 0, 5, causal=False,
                               scale=1.0)


# ---------------------------------------------------------------------------------------------
# Reference functions


def test_reference_attention_matches_sdpa():
    q, k, v, _ = _dense_inputs(2, 13, 13, 4, 4, 16, seed=1)
    for causal in (False, True):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)
        torch.testing.assert_close(reference_attention(q, k, v, causal=causal), expected)


def test_reference_attention_gqa_and_lse():
    q, k, v, _ = _dense_inputs(1, 6, 9, 6, 2, 8, seed=2)
    out, lse = reference_attention(q, k, v, scale=0.5, return_lse=True)
    k_full, v_full = k.repeat_interleave(3, dim=2), v.repeat_interleave(3, dim=2)
    torch.testing.assert_close(out, reference_attention(q, k_full, v_full, scale=0.5))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_full) * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))


def test_reference_attention_masks_sinks_and_softcap():
    # Every option against an explicit masked softmax written out here.
    q, k, v, _ = _dense_inputs(1, 9, 11, 2, 1, 4, seed=5)
    sinks = torch.tensor([0.3, -1.0], dtype=torch.float64)
    out, lse = reference_attention(q, k, v, causal=True, window=(3, -1), chunk_size=5,
                                   softcap=2.0, sinks=sinks, scale=0.7, return_lse=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 0.7
    scores = 2.0 * torch.tanh(scores / 2.0)
    i = torch.arange(9)[:, None] + 2  # bottom-right: query row i has position i + Sk - Sq
    j = torch.arange(11)[None, :]
    allowed = (j <= i) & (j >= i - 3) & (i // 5 == j // 5)
    scores = scores.masked_fill(~allowed, float("-inf"))
    full = torch.cat([scores, sinks.view(1, 2, 1, 1).expand(1, 2, 9, 1)], -1)
    probs = torch.softmax(full, -1)[..., :-1]
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(2, 2)))
    torch.testing.assert_close(lse, torch.logsumexp(full, -1))
    # A row that sees no key: out 0, lse -inf (with sinks: lse = the sink).
    out, lse = reference_attention(q[:, :3], k[:, :1], v[:, :1], causal=True, return_lse=True)
    assert (out[:, :2] == 0).all() and (lse[..., :2] == float("-inf")).all()


def test_reference_varlen_is_per_sequence():
    gen = torch.Generator().manual_seed(0)
    lens = [3, 0, 5]
    q, k, v = (_randn(8, 2, 4, gen=gen) for _ in range(3))
    out = reference_varlen_attention(q, k, v, lens, causal=True)
    expected = torch.cat([reference_attention(q[None, :3], k[None, :3], v[None, :3],
                                              causal=True)[0],
                          reference_attention(q[None, 3:], k[None, 3:], v[None, 3:],
                                              causal=True)[0]])
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="seq_lens sum to 7"):
        reference_varlen_attention(q, k, v, [3, 4])


# ---------------------------------------------------------------------------------------------
# get_backend


def test_get_backend_auto_on_cpu():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert get_backend("auto", "cpu", dtype).name == "cpu"
    assert get_backend("auto", torch.device("cpu"), torch.float32).name == "cpu"
    assert {"reference", "cpu"} <= set(available_backends())
    assert available_backends("cpu", torch.float32) == ["reference", "cpu"]


def test_get_backend_errors():
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope' \(device=cpu, "
                                         r"dtype=torch.float32\); valid choices: \['auto', "
                                         r"'reference', 'cpu'"):
        get_backend("nope", "cpu", torch.float32)
    with pytest.raises(ValueError, match="'torch_flash' cannot run on device=cpu with "
                                         "dtype=torch.bfloat16: it runs on CUDA only"):
        get_backend("torch_flash", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="'flash_attn' cannot run on device=cpu"):
        get_backend("flash_attn", "cpu", torch.float16)
    with pytest.raises(ValueError, match=r"'cpu' cannot run on device=cpu with "
                                         r"dtype=torch.int32.*valid choices here: \['auto'\]"):
        get_backend("cpu", "cpu", torch.int32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'torch_efficient' cannot run on device=cuda"):
            get_backend("torch_efficient", "cuda", torch.float32)


def test_importing_backends_does_not_import_flash_attn():
    code = ("import sys, seqpar.backends; "
            "assert 'flash_attn' not in sys.modules and 'flash_attn_interface' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# ---------------------------------------------------------------------------------------------
# Device-side layout helpers (used by the CUDA backends)


def test_packed_and_padded_lse_round_trip():
    lens = [3, 0, 5, 1]
    cu = _cu(lens)
    packed = torch.randn(2, 9)
    padded = padded_lse_from_packed(packed, cu, 6)
    assert padded.shape == (4, 2, 6)
    assert torch.equal(padded[0, :, :3], packed[:, :3]) and torch.isinf(padded[0, :, 3:]).all()
    assert torch.isinf(padded[1]).all()
    assert torch.equal(padded[2, :, :5], packed[:, 3:8])
    torch.testing.assert_close(packed_lse_from_padded(padded, cu, 9), packed, atol=0, rtol=0)
    assert tokens_of_empty_partner(cu, _cu([1, 2, 0, 1]), 9).tolist() == (
        [False] * 3 + [True] * 5 + [False]
    )


# ---------------------------------------------------------------------------------------------
# flash_attn backend logic on CPU, through fake packages with the real signatures


def _fake_dense_forward(q, k, v, scale, causal, window=(-1, -1), softcap=0.0):
    out, lse = ReferenceBackend().forward(q, k, v, causal=causal, scale=scale, window=window,
                                          softcap=softcap)
    return out, lse.masked_fill(lse == NEG_INF, float("inf"))  # FA2 marks no-key rows +inf


def _fake_varlen_forward(q, k, v, cu_q, cu_k, scale, causal, window=(-1, -1), softcap=0.0):
    out, lse = ReferenceBackend().varlen_forward(q, k, v, cu_q, cu_k, 0, 0, causal=causal,
                                                 scale=scale, window=window, softcap=softcap)
    return out, lse.masked_fill(lse == NEG_INF, float("inf"))


def _fake_fa2(version):
    """Fake ``flash_attn`` and ``flash_attn.flash_attn_interface`` modules as of ``version``."""
    ref = ReferenceBackend()
    old = version < (2, 6, 2)
    packed = version >= (2, 6)

    def fill(dq, dk, dv, grads):
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)

    if old:
        def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                return_softmax):
            assert dropout_p == 0.0 and not return_softmax
            out, lse = _fake_dense_forward(q, k, v, softmax_scale, causal, window_size, softcap)
            return out, q, k, v, out, lse, None, None

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, rng_state=None):
            fill(dq, dk, dv, ref.backward(dout, q, k, v, out, softmax_lse, causal=causal,
                                          scale=softmax_scale, window=window_size,
                                          softcap=softcap))
    else:
        def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                softcap, alibi_slopes, return_softmax):
            window = (window_size_left, window_size_right)
            out, lse = _fake_dense_forward(q, k, v, softmax_scale, causal, window, softcap)
            return out, lse, None, None

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                rng_state=None):
            fill(dq, dk, dv, ref.backward(dout, q, k, v, out, softmax_lse, causal=causal,
                                          scale=softmax_scale,
                                          window=(window_size_left, window_size_right),
                                          softcap=softcap))

    def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                   alibi_slopes=None, return_softmax=False, block_table=None):
        out, lse = _fake_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                        causal, (window_size_left, window_size_right), softcap)
        if not packed:
            lse = padded_lse_from_packed(lse, cu_seqlens_q, max_seqlen_q)
        return (out, q, k, v, out, lse, None, None) if old else (out, lse, None, None)

    def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                   rng_state=None):
        if not packed:
            assert softmax_lse.shape == (len(cu_seqlens_q) - 1, q.shape[1], max_seqlen_q)
            softmax_lse = packed_lse_from_padded(softmax_lse, cu_seqlens_q, q.shape[0])
        fill(dq, dk, dv, ref.varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q,
                                             cu_seqlens_k, 0, 0, causal=causal,
                                             scale=softmax_scale,
                                             window=(window_size_left, window_size_right),
                                             softcap=softcap))

    package = types.ModuleType("flash_attn")
    package.__version__ = ".".join(map(str, version))
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward = fwd
    interface._flash_attn_backward = bwd
    interface._flash_attn_varlen_forward = varlen_fwd
    interface._flash_attn_varlen_backward = varlen_bwd
    package.flash_attn_interface = interface
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


@pytest.mark.parametrize("version", [(2, 5, 8), (2, 6, 0), (2, 7, 4)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_backend_logic_with_fake_package(monkeypatch, version, causal):
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    for mod_name, module in _fake_fa2(version).items():
        monkeypatch.setitem(sys.modules, mod_name, module)
    flash_attn_module._load.cache_clear()
    try:
        api = flash_attn_module._load(False)
        assert api is not None and api.kind == "fa2"
        assert api.packed_varlen_lse == (version >= (2, 6))
        backend = flash_attn_module.FlashAttnBackend()
        # Dense, including a head dim that needs padding to a multiple of 8, windows and softcap
        # (passed through by name: window_size before 2.6.2, window_size_left/right after).
        options = [dict(window=(-1, -1), softcap=0.0), dict(window=(3, 0 if causal else 2), softcap=0.0)]
        if version >= (2, 6):
            options.append(dict(window=(2, -1), softcap=1.5))
        for d in (16, 12):
            for opts in options:
                q, k, v, dout = _dense_inputs(2, 9, 11, 4, 2, d, seed=d)
                ref = _reference_dense(q, k, v, dout, causal, torch.float64, **opts)
                out, lse = backend.forward(q, k, v, causal=causal, scale=d**-0.5, **opts)
                grads = backend.backward(dout, q, k, v, out, lse, causal=causal, scale=d**-0.5, **opts)
                for what, actual, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref):
                    _assert_accurate(what, actual, r, r, "float32")
        # Varlen with empty sequences on either side.
        lens_q = [3, 0, 6, 2]
        lens_k = [3, 2, 6, 0] if not causal else [3, 2, 8, 2]
        gen = torch.Generator().manual_seed(1)
        q, k, v = (_randn(sum(n), h, 8, gen=gen) for n, h in ((lens_q, 4), (lens_k, 2),
                                                              (lens_k, 2)))
        dout = _randn(sum(lens_q), 4, 8, gen=gen)
        ref = _reference_varlen(q, k, v, dout, lens_q, lens_k, causal, torch.float64)
        cu = (_cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
        out, lse = backend.varlen_forward(q, k, v, *cu, causal=causal, scale=8**-0.5)
        grads = backend.varlen_backward(dout, q, k, v, out, lse, *cu, causal=causal,
                                        scale=8**-0.5)
        for what, actual, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref):
            _assert_accurate(what, actual, r, r, "float32")  # the backward's lse is float32
    finally:
        flash_attn_module._load.cache_clear()


def test_flash_attn_unknown_signature_is_unavailable(monkeypatch):
    modules = _fake_fa2((2, 7, 4))

    def fwd(q, k, v, some_new_required_argument):  # a signature this module does not know
        raise AssertionError("must not be called")

    modules["flash_attn.flash_attn_interface"]._flash_attn_forward = fwd
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    for mod_name, module in modules.items():
        monkeypatch.setitem(sys.modules, mod_name, module)
    flash_attn_module._load.cache_clear()
    try:
        assert flash_attn_module._load(False) is None
    finally:
        flash_attn_module._load.cache_clear()


def test_flash_attn_fa3_signature_mapping(monkeypatch):
    calls = {}

    def fwd(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
            seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx,
            leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale,
            softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0,
            softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
            pack_gqa=None, sm_margin=0):
        calls["fwd"] = dict(out=out, k_new=k_new, window_size=window_size, cu=cu_seqlens_q)
        res = _fake_dense_forward(q, k, v, softmax_scale, causal)
        return res[0], res[1], None, None

    def bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
            max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
            softcap=0.0, deterministic=False, sm_margin=0):
        calls["bwd"] = dict(out_is_tensor=isinstance(out, torch.Tensor))
        for dst, src in zip((dq, dk, dv), ReferenceBackend().backward(
                dout, q, k, v, out, softmax_lse, causal=causal, scale=softmax_scale)):
            dst.copy_(src)

    fa3 = types.ModuleType("flash_attn_interface")
    fa3._flash_attn_forward, fa3._flash_attn_backward = fwd, bwd
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    flash_attn_module._load.cache_clear()
    try:
        api = flash_attn_module._load(True)
        assert api is not None and api.kind == "fa3"
        q, k, v, dout = _dense_inputs(1, 7, 7, 2, 1, 8, seed=0)
        out, lse = api.call("fwd", q=q, k=k, v=v, softmax_scale=8**-0.5, causal=True,
                            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                            max_seqlen_k=None, dropout_p=0.0, softcap=0.0)[:2]
        assert calls["fwd"] == dict(out=None, k_new=None, window_size=(-1, -1), cu=None)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        api.call("bwd", dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                 softmax_scale=8**-0.5, causal=True, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, deterministic=False, softcap=0.0)
        assert calls["bwd"] == dict(out_is_tensor=True)
        ref = _reference_dense(q, k, v, dout, True, torch.float64)
        for actual, expected in zip((out, dq, dk, dv), (ref[0], *ref[2:])):
            torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)
    finally:
        flash_attn_module._load.cache_clear()


# ---------------------------------------------------------------------------------------------
# CUDA backends (run wherever CUDA exists)


def _cuda_backends(dtype):
    if not torch.cuda.is_available():
        return []
    return [n for n in ("torch_flash", "torch_efficient", "flash_attn")
            if n in available_backends("cuda", dtype)]


_CUDA_CASES = [
    # b, sq, sk, h, hkv, d
    (1, 1, 1, 1, 1, 64),
    (2, 37, 37, 6, 2, 64),
    (2, 129, 129, 8, 1, 128),
    (1, 200, 200, 4, 4, 20),  # head dim padded to 24
    (2, 5, 37, 4, 2, 32),
    (1, 129, 3, 3, 3, 64),
]


@pytest.mark.cuda
@_CUDA
@pytest.mark.parametrize("case", _CUDA_CASES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_cuda_dense_matches_reference(dtype_name, causal, case):
    b, sq, sk, h, hkv, d = case
    names = _cuda_backends(DTYPES[dtype_name])
    if not names:
        pytest.skip(f"no CUDA kernel backend for {dtype_name} on this GPU")
    for name in names:
        _check_dense(name, "cuda", dtype_name, b, sq, sk, h, hkv, d, causal, seed=sq + d)


@pytest.mark.cuda
@_CUDA
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_cuda_edge_cases(dtype_name):
    dtype = DTYPES[dtype_name]
    for name in _cuda_backends(dtype):
        backend = get_backend(name, "cuda", dtype)
        for sq, sk in ((0, 5), (7, 0), (0, 0)):
            q = torch.randn(2, sq, 4, 64, device="cuda", dtype=dtype)
            k = torch.randn(2, sk, 2, 64, device="cuda", dtype=dtype)
            out, lse = backend.forward(q, k, k, causal=False, scale=0.1)
            assert (out == 0).all() and (lse == NEG_INF).all() and lse.shape == (2, 4, sq)
            grads = backend.backward(torch.randn_like(q), q, k, k, out, lse, causal=False,
                                     scale=0.1)
            assert all((g == 0).all() for g in grads)
        # Non-contiguous inputs give the results of contiguous ones.
        big = torch.randn(2, 40, 4, 64, device="cuda", dtype=dtype)
        q, k = big[:, 5:30], big[:, 10:35, :2]
        v = torch.randn(2, 25, 2, 128, device="cuda", dtype=dtype)[..., ::2]
        out, lse = backend.forward(q, k, v, causal=True, scale=0.1)
        out_c, lse_c = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                       causal=True, scale=0.1)
        torch.testing.assert_close(out, out_c)
        torch.testing.assert_close(lse, lse_c)


@pytest.mark.cuda
@_CUDA
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_cuda_backward_uses_external_global_out_and_lse(dtype_name):
    for name in _cuda_backends(DTYPES[dtype_name]):
        _external_lse_case(name, "cuda", dtype_name, (4, 2))


@pytest.mark.cuda
@_CUDA
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_cuda_varlen_matches_reference(dtype_name, causal):
    lens_q = _VARLEN_CASES["mixed"][0]
    lens_k = _key_lengths(lens_q, causal, seed=1)
    for name in _cuda_backends(DTYPES[dtype_name]):
        for heads in ((4, 2), (3, 3)):
            _check_varlen(name, "cuda", dtype_name, lens_q, lens_k, *heads, 64, causal)


@pytest.mark.cuda
@_CUDA
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_cuda_windows_and_softcap(dtype_name):
    # Windows run on the FlashAttention kernels that have them; softcap on flash-attn, else the
    # reference math (what "auto" picks).
    dtype = DTYPES[dtype_name]
    for window in ((0, 0), (7, 0), (5, 3), (-1, 4)):
        names = [n for n in ("torch_flash", "flash_attn")
                 if n in _cuda_backends(dtype) and get_backend("auto", "cuda", dtype, window=True)]
        for name in names:
            try:
                get_backend(name, "cuda", dtype, window=True)
            except ValueError:
                continue
            for causal in (False, True):
                w = (window[0], 0) if causal else window
                _check_dense(name, "cuda", dtype_name, 2, 37, 45, 4, 2, 64, causal, window=w)
                _check_varlen(name, "cuda", dtype_name, [9, 40, 0, 3], [12, 40, 2, 3], 4, 2, 64,
                              causal, window=w)
    auto = get_backend("auto", "cuda", dtype, softcap=True).name
    _check_dense(auto, "cuda", dtype_name, 2, 37, 37, 4, 2, 64, True, softcap=2.0)


@pytest.mark.cuda
@_CUDA
def test_cuda_auto_choice():
    half = get_backend("auto", "cuda", torch.bfloat16).name
    assert half == ("flash_attn" if "flash_attn" in available_backends("cuda") else "torch_flash")
    assert get_backend("auto", "cuda", torch.float32).name == "torch_efficient"
    assert get_backend("auto", "cuda", torch.float64).name == "reference"
