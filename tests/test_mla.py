"""MLA value heads: v with its own head dim ``Dv != D`` (DeepSeek-V2/V3, Kimi) through every path.

Every case is float64 against ``seqpar.backends.reference_attention`` (itself checked against an
explicit formula here), forward and backward: ring, Ulysses and hybrid splits of worlds 1-4, odd
lengths, heads that do not divide ``U`` and ``Hkv < U``, ``Dv < D`` and ``Dv > D``, every mask,
softcap, sinks, replicated (joint) tokens, the three layouts, packed sequences, both CPU backends
and ``torch.compile``. Gradients follow the partial convention (``docs/api.md``): summed over the
CP group they are the true ones. The CUDA backends' padding logic runs on CPU through fake
kernels that, like the real ones, require one head dim for q, k and v.
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
import torch.distributed as dist

from _common import quick_up_to
import seqpar
from seqpar import ParallelState
from seqpar.backends import flash_attn as flash_attn_module
from seqpar.backends import reference_attention, reference_varlen_attention
from seqpar.backends.base import Packing, pad_head_dim, padded_head_dim
from seqpar.backends.cpu import CpuFlashBackend
from seqpar.backends.reference import ReferenceBackend
from seqpar.backends.torch_cuda import TorchEfficientBackend, TorchFlashBackend
from seqpar.prepare import to_bshd

TOL = 1e-10  # float64: max abs error relative to max(1, max |reference|)
_SEQ_DIM = {"bshd": 1, "sbhd": 0, "bhsd": 2}
# (D, Dv): values narrower, wider, and a single value column.
_DIMS = [(8, 4), (6, 11), (7, 1)]
# (H, Hkv): GQA with Hkv < U, H not divisible by U = 2, 3, 4, MHA, H < U (ranks without a head).
_HEADS = [(6, 2), (3, 1), (5, 5), (4, 4), (2, 1)]
_WORLDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1), (1, 4)]}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    return (got.double() - want).abs().max().item() / max(1.0, want.abs().max().item())


def _grads(out, leaves, dout):
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


# ---------------------------------------------------------------------------------------------
# The ground truth itself: reference_attention with Dv != D against an explicit formula


def test_reference_attention_handles_value_head_dim():
    gen = torch.Generator().manual_seed(0)
    for D, Dv in _DIMS:
        q = torch.randn(2, 9, 4, D, generator=gen, dtype=torch.float64)
        k = torch.randn(2, 11, 2, D, generator=gen, dtype=torch.float64)
        v = torch.randn(2, 11, 2, Dv, generator=gen, dtype=torch.float64)
        out, lse = reference_attention(q, k, v, causal=True, scale=0.3, return_lse=True)
        kx, vx = (t.repeat_interleave(2, 2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * 0.3
        i, j = torch.arange(9)[:, None] + 2, torch.arange(11)[None]
        scores = scores.masked_fill(j > i, float("-inf"))
        want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vx)
        assert out.shape == (2, 9, 4, Dv)
        assert _rel_err(out, want) < TOL and _rel_err(lse, torch.logsumexp(scores, -1)) < TOL
        packed = reference_varlen_attention(q[0], k[0, :9], v[0, :9], [4, 0, 5], causal=True)
        assert packed.shape == (9, 4, Dv)
        assert reference_varlen_attention(q[0, :0], k[0, :0], v[0, :0], []).shape == (0, 4, Dv)


# ---------------------------------------------------------------------------------------------
# Kernel backends on one block: CPU kernels, and the CUDA backends' padding through fake kernels


def _block_inputs(b, sq, sk, h, hkv, d, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, h, dv)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _block_reference(q, k, v, dout, **options):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, return_lse=True, **options)
    return [out.detach(), lse, *torch.autograd.grad(out, leaves, dout)]


def _check_block(backend, q, k, v, dout, causal, window, scale, softcap=0.0) -> float:
    """Max error of ``backend``'s forward (out, lse) and backward (dq, dk, dv) on one block."""
    opts = dict(causal=causal, window=window, scale=scale, softcap=softcap)
    want = _block_reference(q, k, v, dout, **opts)
    out, lse = backend.forward(q, k, v, **opts)
    grads = backend.backward(dout, q, k, v, out, lse, **opts)
    got = [out, lse, *grads]
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    finite = torch.isfinite(want[1])
    errs = [_rel_err(g, w) for i, (g, w) in enumerate(zip(got, want)) if i != 1]
    return max(errs + [_rel_err(got[1][finite], want[1][finite])])


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_cpu_backends_value_head_dim(name):
    """Dense blocks (square, rectangular, windows, negative and zero scale) and packed batches
    (direct calls and padded buckets) with Dv < D and Dv > D."""
    backend = seqpar.backends.get_backend(name, "cpu", torch.float64)
    for n, (D, Dv) in enumerate(_DIMS):
        for sq, sk, causal, window in [(13, 13, True, (-1, -1)), (5, 17, False, (-1, -1)),
                                       (17, 17, True, (4, 0)), (9, 14, False, (2, 3))]:
            for scale in (D**-0.5, -0.4, 0.0):
                inputs = _block_inputs(2, sq, sk, 6, 2, D, Dv, seed=n + sq)
                err = _check_block(backend, *inputs, causal, window, scale)
                assert err < TOL, (name, D, Dv, sq, sk, causal, window, scale, err)
        # Packed: one long sequence (its own kernel call), short ones (buckets), empty ones.
        lens_q, lens_k = [140, 3, 0, 3, 2, 5, 1], [140, 3, 2, 3, 0, 5, 1]
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(sum(lens_q), 4, D, generator=gen, dtype=torch.float64)
        k = torch.randn(sum(lens_k), 2, D, generator=gen, dtype=torch.float64)
        v = torch.randn(sum(lens_k), 2, Dv, generator=gen, dtype=torch.float64)
        dout = torch.randn(sum(lens_q), 4, Dv, generator=gen, dtype=torch.float64)
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32)
                      for x in (lens_q, lens_k))
        for causal, window in [(True, (-1, -1)), (False, (-1, -1)), (True, (2, 0))]:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = reference_varlen_attention(*leaves, lens_q, seq_lens_k=lens_k, causal=causal,
                                             window=window, scale=0.3)
            ref_grads = torch.autograd.grad(ref, leaves, dout)
            args = (cu_q, cu_k, max(lens_q), max(lens_k))
            out, lse = backend.varlen_forward(q, k, v, *args, causal=causal, scale=0.3, window=window)
            grads = backend.varlen_backward(dout, q, k, v, out, lse, *args, causal=causal, scale=0.3,
                                            window=window)
            assert out.shape == (sum(lens_q), 4, Dv)
            errs = [_rel_err(out, ref)] + [_rel_err(g, r) for g, r in zip(grads, ref_grads)]
            assert max(errs) < TOL, (name, D, Dv, causal, window, errs)


def test_padding_helpers():
    assert padded_head_dim(192, 128) == 192 and padded_head_dim(12, 20) == 24
    assert padded_head_dim(5, 3, multiple=1) == 5
    x = torch.randn(2, 3, 4, 5).transpose(1, 2)  # a strided head dim is made contiguous
    y = pad_head_dim(x, width=12)
    assert y.shape == (2, 4, 3, 16) and y.stride(-1) == 1
    assert torch.equal(y[..., :5], x) and not y[..., 5:].any()
    assert pad_head_dim(x, 1, width=3).shape == x.shape


def _one_head_dim(*xs: torch.Tensor) -> None:
    """What FlashAttention-2 requires: q, k, v (and dout, out) of one head dim, a multiple of 8."""
    dims = {x.shape[-1] for x in xs}
    if len(dims) != 1 or next(iter(dims)) % 8:
        raise RuntimeError(f"fake kernel: head dims {[x.shape[-1] for x in xs]} (must be one multiple of 8)")


def _fake_aten_flash():
    """Fake ``aten._flash_attention_forward/_backward`` (dense and varlen) on the reference maths."""
    ref = ReferenceBackend()

    def window_of(is_causal, left, right):
        return (-1, 0) if is_causal else (-1 if left is None else left, -1 if right is None else right)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale,
                window_size_left=None, window_size_right=None):
        _one_head_dim(q, k, v)
        window = window_of(is_causal, window_size_left, window_size_right)
        if cu_q is None:
            out, lse = ref.forward(q, k, v, causal=False, scale=scale, window=window)
        else:
            out, lse = ref.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=scale,
                                          window=window)
        return out, lse.float().masked_fill(lse == float("-inf"), float("inf")), None, None, None

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                 scale, window_size_left=None, window_size_right=None):
        _one_head_dim(dout, q, k, v, out)
        window = window_of(is_causal, window_size_left, window_size_right)
        if cu_q is None:
            return ref.backward(dout, q, k, v, out, lse, causal=False, scale=scale, window=window)
        return ref.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=False,
                                   scale=scale, window=window)

    return forward, backward


def _fake_aten_efficient():
    """Fake ``aten._efficient_attention_forward/_backward`` (dense) on the reference maths, with
    the kernel's padded lse (``[B, H, ceil(S / 32) * 32]``)."""
    ref = ReferenceBackend()

    def forward(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, compute_lse, *, scale):
        _one_head_dim(q, k, v)
        out, lse = ref.forward(q, k, v, causal=mask_type == 2, scale=scale)
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("inf"), dtype=torch.float32)
        padded[..., :lse.shape[2]] = lse
        return out, padded, None, None, None, None

    def backward(dout, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p, seed, offset, mask_type,
                 bias_grad, *, scale):
        _one_head_dim(dout, q, k, v, out)
        grads = ref.backward(dout, q, k, v, out, lse[..., :q.shape[1]], causal=mask_type == 2, scale=scale)
        return (*grads, None)

    return forward, backward


def test_cuda_backends_pad_value_head_dim_exactly(monkeypatch):
    """torch_flash / torch_efficient kernel methods on CPU tensors, their ops replaced by fakes
    that refuse unequal head dims: the padding to one head dim and the slicing back are exact."""
    fwd, bwd = _fake_aten_flash()
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fwd)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", bwd)
    fwd, bwd = _fake_aten_efficient()
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_forward", fwd)
    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_backward", bwd)
    for cls, windows in [(TorchFlashBackend, [(-1, -1), (-1, 0), (3, 0), (2, 2)]),
                         (TorchEfficientBackend, [(-1, -1), (-1, 0)])]:
        backend = cls()
        for n, (D, Dv) in enumerate(_DIMS):
            for window in windows:
                q, k, v, dout = _block_inputs(2, 11, 11, 6, 2, D, Dv, seed=n)
                opts = dict(scale=0.35, window=window, softcap=0.0)
                want = _block_reference(q, k, v, dout, causal=False, **opts)
                out, lse = backend.kernel_forward(q, k, v, **opts)
                grads = backend.kernel_backward(dout, q, k, v, out, lse, **opts)
                got = [out, lse, *grads]
                assert [t.shape for t in got] == [t.shape for t in want], cls.name
                errs = [_rel_err(g, w) for g, w in zip(got, want)]
                assert max(errs) < 1e-5, (cls.name, D, Dv, window, errs)  # the lse passes through float32
    # torch_flash varlen
    backend = TorchFlashBackend()
    lens = [5, 0, 9, 1]
    cu = torch.tensor([0, 5, 5, 14, 15], dtype=torch.int32)
    packing = Packing(cu, cu, 9, 9)
    for D, Dv in _DIMS:
        q, k, v, dout = (t[0] for t in _block_inputs(1, 15, 15, 4, 2, D, Dv, seed=D))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_varlen_attention(*leaves, lens, causal=True, scale=0.35)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        opts = dict(scale=0.35, window=(-1, 0), softcap=0.0)
        out, lse = backend.kernel_varlen_forward(q, k, v, packing, **opts)
        grads = backend.kernel_varlen_backward(dout, q, k, v, out, lse, packing, **opts)
        errs = [_rel_err(out, ref)] + [_rel_err(g, r) for g, r in zip(grads, ref_grads)]
        assert out.shape == (15, 4, Dv) and max(errs) < 1e-5, (D, Dv, errs)
    # The head-dim limit counts the wider of D and Dv.
    with pytest.raises(ValueError, match="head dims up to 256, got 264"):
        backend.kernel_forward(*_block_inputs(1, 3, 3, 1, 1, 64, 264, seed=0)[:3], **opts)


def _fake_flash_attn_package():
    """A fake ``flash_attn`` 2.7 package (the real signatures) that refuses unequal head dims."""
    ref = ReferenceBackend()

    def to_inf(lse):
        return lse.float().masked_fill(lse == float("-inf"), float("inf"))

    def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
            alibi_slopes, return_softmax):
        _one_head_dim(q, k, v)
        out, lse = ref.forward(q, k, v, causal=causal, scale=softmax_scale,
                               window=(window_size_left, window_size_right), softcap=softcap)
        return out, to_inf(lse), None, None

    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
            window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        _one_head_dim(dout, q, k, v, out, dq, dk, dv)
        grads = ref.backward(dout, q, k, v, out, softmax_lse, causal=causal, scale=softmax_scale,
                             window=(window_size_left, window_size_right), softcap=softcap)
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)

    def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                   return_softmax=False, block_table=None):
        _one_head_dim(q, k, v)
        out, lse = ref.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, 0, 0, causal=causal,
                                      scale=softmax_scale, window=(window_size_left, window_size_right),
                                      softcap=softcap)
        return out, to_inf(lse), None, None

    def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                   softcap, alibi_slopes, deterministic, rng_state=None):
        _one_head_dim(dout, q, k, v, out, dq, dk, dv)
        grads = ref.varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, 0, 0,
                                    causal=causal, scale=softmax_scale,
                                    window=(window_size_left, window_size_right), softcap=softcap)
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)

    package = types.ModuleType("flash_attn")
    package.__version__ = "2.7.4"
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward, interface._flash_attn_backward = fwd, bwd
    interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward = varlen_fwd, varlen_bwd
    package.flash_attn_interface = interface
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


def test_flash_attn_backend_pads_value_head_dim_exactly(monkeypatch):
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    for name, module in _fake_flash_attn_package().items():
        monkeypatch.setitem(sys.modules, name, module)
    flash_attn_module._load.cache_clear()
    try:
        backend = flash_attn_module.FlashAttnBackend()
        for n, (D, Dv) in enumerate(_DIMS):
            for causal, window, softcap in [(False, (-1, -1), 0.0), (True, (3, 0), 0.0), (True, (-1, -1), 1.5)]:
                inputs = _block_inputs(2, 9, 12, 4, 2, D, Dv, seed=n)
                err = _check_block(backend, *inputs, causal, window, 0.4, softcap)
                assert err < 1e-5, (D, Dv, causal, window, softcap, err)  # the lse passes through float32
            lens = [4, 0, 7]
            cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
            q, k, v, dout = (t[0] for t in _block_inputs(1, 11, 11, 4, 2, D, Dv, seed=n))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = reference_varlen_attention(*leaves, lens, causal=True, scale=0.4)
            ref_grads = torch.autograd.grad(ref, leaves, dout)
            out, lse = backend.varlen_forward(q, k, v, cu, cu, 7, 7, causal=True, scale=0.4)
            grads = backend.varlen_backward(dout, q, k, v, out, lse, cu, cu, 7, 7, causal=True, scale=0.4)
            errs = [_rel_err(out, ref)] + [_rel_err(g, r) for g, r in zip(grads, ref_grads)]
            assert out.shape == (11, 4, Dv) and max(errs) < 1e-5, (D, Dv, errs)
    finally:
        flash_attn_module._load.cache_clear()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_backends_value_head_dim(dtype):
    """The real CUDA kernels with DeepSeek's 192/128 and a wider v, dense and packed, by
    flash-attn's rule: error at most 2x that of the reference maths in the same dtype."""
    names = [n for n in ("torch_flash", "torch_efficient", "flash_attn")
             if n in seqpar.backends.available_backends("cuda", dtype)]
    if not names:
        pytest.skip(f"no CUDA kernel backend for {dtype} here")
    for name in names:
        backend = seqpar.backends.get_backend(name, "cuda", dtype)
        for D, Dv in [(192, 128), (64, 96), (40, 24)]:
            exact = _block_inputs(2, 77, 77, 4, 2, D, Dv, seed=D)
            for causal in (False, True):
                want = _block_reference(*exact, causal=causal, scale=D**-0.5)
                same = _block_reference(*(t.to(dtype) for t in exact), causal=causal, scale=D**-0.5)
                q, k, v, dout = (t.to("cuda", dtype) for t in exact)
                out, lse = backend.forward(q, k, v, causal=causal, scale=D**-0.5)
                grads = backend.backward(dout, q, k, v, out, lse, causal=causal, scale=D**-0.5)
                for what, g, w, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want, same):
                    err, base = _rel_err(g.cpu(), w), _rel_err(b.double(), w)
                    assert g.shape == w.shape and err <= 2 * base + 1e-3, (name, D, Dv, causal, what, err, base)
            packed = [t[0].to("cuda", dtype) for t in exact]
            cu = torch.tensor([0, 30, 30, 77], dtype=torch.int32, device="cuda")
            ref = reference_varlen_attention(*(t[0] for t in exact[:3]), [30, 0, 47], causal=True, scale=D**-0.5)
            out, _ = backend.varlen_forward(*packed[:3], cu, cu, 47, 47, causal=True, scale=D**-0.5)
            same = reference_varlen_attention(*(t[0].to(dtype) for t in exact[:3]), [30, 0, 47], causal=True,
                                              scale=D**-0.5)
            err, base = _rel_err(out.cpu(), ref), _rel_err(same.double(), ref)
            assert out.shape == ref.shape and err <= 2 * base + 1e-3, (name, D, Dv, "varlen", err, base)


# ---------------------------------------------------------------------------------------------
# Input checks: the old refusal is gone; k and v must still agree on everything but Dv


def test_value_head_dim_accepted_and_kv_mismatch_refused():
    state = ParallelState()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 6, h, d, generator=gen, dtype=torch.float64) for h, d in ((4, 8), (2, 8), (2, 3)))
    out = seqpar.attention(q, k, v, state, causal=True)
    assert out.shape == (1, 6, 4, 3)
    assert _rel_err(out, reference_attention(q, k, v, causal=True)) < TOL
    packed = seqpar.varlen_attention(q[0], k[0], v[0], state, [2, 4], causal=True)
    assert packed.shape == (6, 4, 3)
    for bad in [(2, 6, 2, 3), (1, 5, 2, 3), (1, 6, 1, 3)]:
        want = f"k and v must agree on (B, S_local, Hkv) = (1, 6, 2), got v with {bad[:3]}"
        with pytest.raises(ValueError, match=re.escape(want) + ".*only the value head dim"):
            seqpar.attention(q, k, torch.zeros(bad, dtype=torch.float64), state)
    with pytest.raises(ValueError, match=r"value head dim must be positive, got Dv=0"):
        seqpar.attention(q, k, torch.zeros(1, 6, 2, 0, dtype=torch.float64), state)
    with pytest.raises(ValueError, match=r"k must have q's batch size B=1, local length S=6 and head dim D=8"):
        seqpar.attention(q, v, v, state)  # k with v's head dim: q and k must share D
    # In other layouts the message names the bshd dims and shows the caller's shapes.
    with pytest.raises(ValueError, match=r"layout 'bhsd'.*k and v must agree on \(B, S_local, Hkv\)"):
        seqpar.attention(*(t.transpose(1, 2) for t in (q, k, v[:, :, :1])), state, layout="bhsd")
    for bad in [(5, 2, 3), (6, 1, 3)]:
        with pytest.raises(ValueError, match=r"k and v must agree on \(T_local, Hkv\) = \(6, 2\)"):
            seqpar.varlen_attention(q[0], k[0], torch.zeros(bad, dtype=torch.float64), state, [6])
    with pytest.raises(ValueError, match=r"\[T, Hkv, Dv\] with the same T and D"):
        seqpar.varlen_attention(q[0], v[0], v[0], state, [6])
    # The backends' own checks (public methods) say the same.
    with pytest.raises(ValueError, match="must agree on every dim but the last"):
        ReferenceBackend().forward(q, k, v[:, :5], causal=False, scale=1.0)
    out, _ = CpuFlashBackend().forward(q, k, v, causal=False, scale=1.0)
    assert out.shape == (1, 6, 4, 3)


# ---------------------------------------------------------------------------------------------
# Dense attention over CP worlds 1-4


_DENSE_OPTIONS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(5, 0)),
    "bidirectional window": dict(window=(3, 2)),
    "chunked": dict(causal=True, chunk_size=5),
    "softcap": dict(causal=True, softcap=2.5),
    "sinks": dict(causal=True, sinks=True),
    "joint": dict(prefix=3),
    "joint both + sinks": dict(prefix=2, suffix=2, sinks=True),
}


def _dense_cases(configs: list[tuple[int, int]]) -> list[dict]:
    cases = []
    for RU in configs:
        for i, (name, options) in enumerate(_DENSE_OPTIONS.items()):
            backend = "reference" if "softcap" in options else ("cpu", "reference")[(i + sum(RU)) % 2]
            for wider in (False, True):  # every option with a narrower and a wider v
                n = 2 * i + wider + sum(RU)
                D, Dv = _DIMS[1] if wider else _DIMS[0 if n % 3 else 2]
                cases.append(dict(
                    RU=RU, name=f"{RU} {name} D={D} Dv={Dv} {backend}", options=options, D=D, Dv=Dv,
                    B=1 + n % 2, S=(37, 5, 61)[n % 3], heads=_HEADS[n % len(_HEADS)],
                    layout=("bshd", "sbhd", "bhsd")[(i + wider) % 3], backend=backend,
                    seq_len=(i // 2) % 2 == 0, seed=n,
                ))
    return cases


def _dense_case(state: ParallelState, c: dict) -> tuple[str, float]:
    opts = dict(c["options"])
    prefix, suffix = opts.pop("prefix", 0), opts.pop("suffix", 0)
    with_sinks = opts.pop("sinks", False)
    B, S, (H, Hkv), D, Dv, layout = c["B"], c["S"], c["heads"], c["D"], c["Dv"], c["layout"]
    gen = torch.Generator().manual_seed(c["seed"])
    L = prefix + S + suffix
    full = [torch.randn(B, L, h, d, generator=gen, dtype=torch.float64)
            for h, d in ((H, D), (Hkv, D), (Hkv, Dv), (H, Dv))]
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    if with_sinks:
        leaves.append(torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_())
    sinks = leaves[3] if with_sinks else None
    ref = reference_attention(*leaves[:3], sinks=sinks, **opts)
    ref_grads = _grads(ref, leaves, full[3])

    def local(t):  # replicated tokens around this rank's shard of the rest (bshd)
        body = seqpar.shard(t[:, prefix:prefix + S], state, dim=1)
        return torch.cat([t[:, :prefix], body, t[:, prefix + S:]], 1)

    mine = [t.detach().clone().requires_grad_() for t in leaves]
    out = seqpar.attention(
        *(to_bshd(local(t), layout) for t in mine[:3]), state, sinks=mine[3] if with_sinks else None,
        replicated_prefix=prefix, replicated_suffix=suffix, seq_len=S if c["seq_len"] else None,
        layout=layout, backend=c["backend"], **opts,
    )
    want_shape = to_bshd(local(full[3]), layout).shape
    if out.shape != want_shape or out.dtype != torch.float64:
        return c["name"] + f": output {tuple(out.shape)}, want {tuple(want_shape)}", 1.0
    # This rank's loss share: its own rows, plus 1/cp of the replicated rows (counted once).
    rows = out.shape[_SEQ_DIM[layout]]
    weight = torch.ones(rows, dtype=torch.float64)
    weight[:prefix] = weight[rows - suffix:] = 1 / state.cp_size
    dout = local(full[3]) * weight[None, :, None, None]
    grads = _grads(to_bshd(out, layout), mine, dout)
    for g in grads:
        dist.all_reduce(g, group=state.cp_group)
    errs = [_rel_err(to_bshd(out, layout).detach(), local(ref.detach()))]
    errs += [_rel_err(g, r) for g, r in zip(grads, ref_grads)]
    return c["name"], max(errs)


def _rank_dense(cases: list[dict]) -> list[tuple[str, float]]:
    states: dict[tuple[int, int], ParallelState] = {}
    results = []
    for c in cases:
        if c["RU"] not in states:
            states[c["RU"]] = ParallelState(*c["RU"])
        results.append(_dense_case(states[c["RU"]], c))
    return results


def test_dense_cases_cover_the_matrix():
    every = [c for configs in _WORLDS.values() for c in _dense_cases(configs)]
    assert {(c["D"], c["Dv"]) for c in every} == set(_DIMS)
    assert {c["heads"] for c in every} == set(_HEADS)
    assert {c["S"] for c in every} == {5, 37, 61}
    for key in ("layout", "backend", "seq_len"):
        assert len({c[key] for c in every}) > 1, key
    for configs in _WORLDS.values():  # per world: both backends with narrower and wider v
        cases = _dense_cases(configs)
        assert {(c["backend"], c["Dv"] < c["D"]) for c in cases} == {
            (b, w) for b in ("cpu", "reference") for w in (False, True)}


@pytest.mark.parametrize("world", quick_up_to(3, sorted(_WORLDS)))
def test_dense_value_head_dim(pools, world):
    cases = _dense_cases(_WORLDS[world])
    for rank, results in enumerate(pools(world).run(_rank_dense, cases)):
        assert len(results) == len(cases)
        for name, err in results:
            assert err <= TOL, f"rank {rank}: {name}: error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# Packed sequences (varlen_attention) over CP worlds 1-4


_PACKED_OPTIONS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(4, 0)),
    "bidirectional window": dict(window=(3, 2)),
    "chunked": dict(causal=True, chunk_size=5),
    "sinks": dict(causal=True, sinks=True),
    "softcap": dict(causal=True, softcap=2.0),
}
_LENS = [[7, 0, 1, 13, 3], [2, 9, 1, 1, 5, 0, 4, 2], [40, 3]]


def _packed_cases(configs: list[tuple[int, int]]) -> list[dict]:
    cases = []
    for RU in configs:
        for i, (name, options) in enumerate(_PACKED_OPTIONS.items()):
            n = i + sum(RU)
            D, Dv = _DIMS[n % len(_DIMS)]
            backend = "reference" if "softcap" in options else ("cpu", "reference")[i % 2]
            cases.append(dict(
                RU=RU, name=f"{RU} packed {name} D={D} Dv={Dv} {backend}", options=options, D=D, Dv=Dv,
                lens=_LENS[n % len(_LENS)], heads=_HEADS[n % len(_HEADS)], backend=backend, seed=n,
            ))
    return cases


def _packed_case(state: ParallelState, c: dict) -> tuple[str, float]:
    opts = dict(c["options"])
    with_sinks = opts.pop("sinks", False)
    lens, (H, Hkv), D, Dv = c["lens"], c["heads"], c["D"], c["Dv"]
    gen = torch.Generator().manual_seed(c["seed"])
    T = sum(lens)
    full = [torch.randn(T, h, d, generator=gen, dtype=torch.float64)
            for h, d in ((H, D), (Hkv, D), (Hkv, Dv), (H, Dv))]
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    if with_sinks:
        leaves.append(torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_())
    ref = reference_varlen_attention(*leaves[:3], lens, sinks=leaves[3] if with_sinks else None, **opts)
    ref_grads = _grads(ref, leaves, full[3])
    mine = [t.detach().clone().requires_grad_() for t in leaves]
    out = seqpar.varlen_attention(
        *(seqpar.shard_packed(t, state, lens) for t in mine[:3]), state, lens,
        sinks=mine[3] if with_sinks else None, backend=c["backend"], **opts,
    )
    dout = seqpar.shard_packed(full[3], state, lens)
    if out.shape != dout.shape:
        return c["name"] + f": output {tuple(out.shape)}, want {tuple(dout.shape)}", 1.0
    grads = _grads(out, mine, dout)
    for g in grads:
        dist.all_reduce(g, group=state.cp_group)
    errs = [_rel_err(out.detach(), seqpar.shard_packed(ref.detach(), state, lens))]
    errs += [_rel_err(g, r) for g, r in zip(grads, ref_grads)]
    return c["name"], max(errs)


def _rank_packed(cases: list[dict]) -> list[tuple[str, float]]:
    states: dict[tuple[int, int], ParallelState] = {}
    results = []
    for c in cases:
        if c["RU"] not in states:
            states[c["RU"]] = ParallelState(*c["RU"])
        results.append(_packed_case(states[c["RU"]], c))
    return results


@pytest.mark.parametrize("world", quick_up_to(3, sorted(_WORLDS)))
def test_packed_value_head_dim(pools, world):
    cases = _packed_cases(_WORLDS[world])
    assert {c["Dv"] < c["D"] for c in cases} == {False, True}
    for rank, results in enumerate(pools(world).run(_rank_packed, cases)):
        assert len(results) == len(cases)
        for name, err in results:
            assert err <= TOL, f"rank {rank}: {name}: error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# torch.compile: the operators' fake implementations give the output v's head dim


def _rank_compiled(R: int, U: int) -> list[tuple[str, float]]:
    state = ParallelState(R, U)
    gen = torch.Generator().manual_seed(5)
    S, lens, (H, Hkv), (D, Dv) = 29, [7, 1, 13, 10], (6, 2), (8, 4)
    dense = [torch.randn(2, S, h, d, generator=gen, dtype=torch.float64) for h, d in ((H, D), (Hkv, D), (Hkv, Dv))]
    packed = [torch.randn(sum(lens), h, d, generator=gen, dtype=torch.float64)
              for h, d in ((H, D), (Hkv, D), (Hkv, Dv))]
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)

    def f(q, k, v, qp, kp, vp, s):
        o = seqpar.attention(q, k, v, state, causal=True, sinks=s, layout="bhsd", backend="cpu")
        op = seqpar.varlen_attention(qp, kp, vp, state, lens, window=(3, 2), backend="cpu")
        return (o.square().sum() + op.square().sum()), o, op

    leaves = [t.clone().requires_grad_() for t in (*dense, *packed, sinks)]
    loss = (reference_attention(*leaves[:3], causal=True, sinks=leaves[6]).square().sum()
            + reference_varlen_attention(*leaves[3:6], lens, window=(3, 2)).square().sum())
    want = torch.autograd.grad(loss, leaves)
    mine = [seqpar.shard(t, state).transpose(1, 2) for t in dense]
    mine += [seqpar.shard_packed(t, state, lens) for t in packed] + [sinks]
    mine = [t.detach().clone().requires_grad_() for t in mine]
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    share, o, op = compiled(*mine)
    results = [("dense output shape", float(o.shape != (2, H, mine[0].shape[2], Dv))),
               ("packed output shape", float(op.shape != (mine[3].shape[0], H, Dv)))]
    grads = [g.clone() for g in torch.autograd.grad(share, mine)]
    # Sharded leaves get their full gradient on their own rank; the sinks' shares sum over CP.
    dist.all_reduce(grads[6], group=state.cp_group)
    local_want = [seqpar.shard(g, state).transpose(1, 2) for g in want[:3]]
    local_want += [seqpar.shard_packed(g, state, lens) for g in want[3:6]] + [want[6]]
    for name, g, w in zip(["dq", "dk", "dv", "dq packed", "dk packed", "dv packed", "dsinks"], grads, local_want):
        results.append((name, _rel_err(g, w)))
    state.close()
    return results


def test_compiled_value_head_dim(pools):
    for rank, results in enumerate(pools(2).run(_rank_compiled, 1, 2)):
        for name, err in results:
            assert err <= TOL, f"rank {rank}: {name}: error {err:.3g}"
