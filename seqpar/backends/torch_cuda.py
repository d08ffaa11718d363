"""CUDA kernels bundled with PyTorch: ``"torch_flash"`` (FlashAttention-2), ``"torch_efficient"``.

``torch_flash`` calls ``aten._flash_attention_forward/_backward``, with windows through their
``window_size_left/right`` arguments where the installed torch has them (2.5 and later; checked
on the op schema). Dense inputs are bshd 4-D with
``cum_seq_q = cum_seq_k = None`` (lse ``[B, H, Sq]``); varlen inputs are ``[T, H, D]`` 3-D with
int32 ``cum_seq_*`` (lse ``[H, T]``; ROCm builds may return ``[nseq, H, max_q]``, converted here).
GQA is native. fp16/bf16 only, head dim <= 256 (padded here to a multiple of 8). FlashAttention-2
needs one head dim for q, k and v: a value head dim ``Dv != D`` (MLA) runs with all three
zero-padded to ``max(D, Dv)`` (rounded up to 8) and the results sliced back, exact (Note [Value
head dim] in ``base.py``); ``max(D, Dv) <= 256``. Rows with no keys
come back with ``lse = +inf``; they are reported as ``-inf`` and passed back as ``+inf``.
Without dropout the RNG arguments of the backward are unused: a zero ``(2,)`` uint64 state and an
empty tensor are passed, as ``torch.nn.attention.varlen`` does.

``torch_efficient`` calls ``aten._efficient_attention_forward/_backward`` (the CUTLASS
memory-efficient kernel), which also runs fp32. Its quirks, from the PyTorch source:

- q, k, v must have the same number of heads: kv heads are repeated for GQA and their gradients
  summed back;
- varlen needs a batch dim of 1 (``[1, T, H, D]``) plus int32 ``cu_seqlens``;
- lse is ``[B or nseq, H, ceil(S / 32) * 32]`` padded; the backward reads the padding, which must
  be ``+inf``;
- ``custom_mask_type``: 0 none, 1 causal aligned top-left, 2 causal aligned bottom-right (used
  for causal blocks); other windows are not offered (``"auto"`` then picks ``reference``);
- a value head dim ``Dv != D`` (MLA): the kernel itself accepts one (its output has ``Dv``), but
  that path could not be tested here, so q, k and v are zero-padded to one head dim exactly as for
  ``torch_flash`` (exact; it costs the padded columns' FLOPs). Using the native path is an
  optimisation to make once it is checked on a GPU.

- blocks with more query rows than keys under a causal mask come back wrong (Note [Keyless
  rows] in ``base.py``): a dense block runs without its keyless leading rows, and a packed call
  gives every sequence's keyless head a sequence of its own with no keys.

Neither kernel has a softcap: ``"auto"`` picks ``flash_attn`` (when installed) or ``reference``.

``tests/test_backends.py`` checks both against the float64 reference when CUDA is present; they
passed on an H200 with torch 2.11 (``scripts/gpu_check``, docs/performance.md "On a GPU").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import (
    KernelBackend,
    Packing,
    Window,
    backward_skipping_keyless,
    forward_skipping_keyless,
    keyless_prefix,
    lse_for_backward,
    normalise_lse_,
    packed_lse_from_padded,
    pad_head_dim,
    padded_head_dim,
    padded_lse_from_packed,
    split_keyless_sequences,
    tokens_of_empty_partner,
    unpad_head_dim,
)

__all__ = ["TorchFlashBackend", "TorchEfficientBackend"]

_MAX_HEAD_DIM = 256
_EFFICIENT_LSE_ALIGN = 32


def _check_head_dim(head_dim: int, backend: str) -> None:
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(
            f"backend {backend!r} supports head dims up to {_MAX_HEAD_DIM}, got {head_dim}; "
            f"use backend='reference'"
        )


def _flash_width(q: Tensor, v: Tensor, backend: str) -> int:
    """The one head dim q, k and v are padded to (Note [Value head dim]), after checking that
    FlashAttention-2 takes ``max(D, Dv)``."""
    _check_head_dim(max(q.shape[-1], v.shape[-1]), backend)
    return padded_head_dim(q.shape[-1], v.shape[-1])


def _cu(cu_seqlens: Tensor) -> Tensor:
    return cu_seqlens.to(torch.int32).contiguous()


def _flash_has_window() -> bool:
    """Whether this torch's ``_flash_attention_forward`` takes ``window_size_left/right``."""
    return "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


def _cuda_reason(device: torch.device, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...],
                 min_capability: tuple[int, int]) -> str | None:
    if device.type != "cuda":
        return f"it runs on CUDA only, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if dtype not in dtypes:
        return f"it supports {[str(d) for d in dtypes]}, not {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability:
        return f"it needs compute capability >= {min_capability}, the device has {capability}"
    return None


class TorchFlashBackend(KernelBackend):
    """FlashAttention-2 as bundled with PyTorch (``aten._flash_attention_*``); fp16/bf16."""

    name = "torch_flash"

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, *, window: bool = False, softcap: bool = False,
        alibi: bool = False,
    ) -> str | None:
        """``None`` if this backend runs on ``device``/``dtype``, else why not."""
        if alibi:
            return (
                "its kernel takes no per-block ALiBi bias on global positions; 'auto' picks 'reference' "
                "for alibi_slopes on CUDA (docs/masks.md)"
            )
        if softcap:
            return "PyTorch's bundled FlashAttention has no softcap (install flash-attn, or use 'reference')"
        if window and not _flash_has_window():
            return f"this torch ({torch.__version__}) has no window arguments on its FlashAttention op"
        return _cuda_reason(device, dtype, (torch.float16, torch.bfloat16), (8, 0))

    def kernel_forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: Window, softcap: float
    ) -> tuple[Tensor, Tensor]:
        sq, sk = q.shape[1], k.shape[1]
        w = _flash_width(q, v, self.name)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            pad_head_dim(q, width=w), pad_head_dim(k, width=w), pad_head_dim(v, width=w),
            None, None, sq, sk, 0.0, window == (-1, 0), False, scale=scale, **_window_kwargs(window),
        )
        return unpad_head_dim(out, v.shape[-1]), normalise_lse_(lse)

    def kernel_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
        w = _flash_width(q, v, self.name)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            pad_head_dim(dout.to(q.dtype), width=w), pad_head_dim(q, width=w), pad_head_dim(k, width=w),
            pad_head_dim(v, width=w), pad_head_dim(out.to(q.dtype), width=w), lse_for_backward(lse, torch.float32),
            None, None, sq, sk, 0.0, window == (-1, 0),
            *_unused_rng(q.device), scale=scale, **_window_kwargs(window),
        )
        return unpad_head_dim(dq, d), unpad_head_dim(dk, d), unpad_head_dim(dv, v.shape[-1])

    def kernel_varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, scale: float, window: Window,
        softcap: float,
    ) -> tuple[Tensor, Tensor]:
        total_q = q.shape[0]
        w = _flash_width(q, v, self.name)
        cu_q, cu_k = _cu(packing.cu_seqlens_q), _cu(packing.cu_seqlens_k)
        max_seqlen_q, max_seqlen_k = packing.max_seqlen_q, packing.max_seqlen_k
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            pad_head_dim(q, width=w), pad_head_dim(k, width=w), pad_head_dim(v, width=w),
            cu_q, cu_k, max_seqlen_q, max_seqlen_k, 0.0, window == (-1, 0), False, scale=scale,
            **_window_kwargs(window),
        )
        if lse.dim() == 3:  # ROCm: per-sequence padded layout
            lse = packed_lse_from_padded(lse, cu_q, total_q)
        return unpad_head_dim(out, v.shape[-1]), normalise_lse_(lse)

    def kernel_varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        d = q.shape[-1]
        w = _flash_width(q, v, self.name)
        cu_q, cu_k = _cu(packing.cu_seqlens_q), _cu(packing.cu_seqlens_k)
        max_seqlen_q, max_seqlen_k = packing.max_seqlen_q, packing.max_seqlen_k
        lse = lse_for_backward(lse, torch.float32)
        if torch.version.hip:  # ROCm kernels read the per-sequence padded layout
            lse = padded_lse_from_packed(lse, cu_q, max_seqlen_q)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            pad_head_dim(dout.to(q.dtype), width=w), pad_head_dim(q, width=w), pad_head_dim(k, width=w),
            pad_head_dim(v, width=w), pad_head_dim(out.to(q.dtype), width=w), lse,
            cu_q, cu_k, max_seqlen_q, max_seqlen_k, 0.0, window == (-1, 0), *_unused_rng(q.device),
            scale=scale, **_window_kwargs(window),
        )
        return unpad_head_dim(dq, d), unpad_head_dim(dk, d), unpad_head_dim(dv, v.shape[-1])


def _window_kwargs(window: Window) -> dict[str, int]:
    """The op's window arguments (omitted for no window or plain causal, as older torch lacks them)."""
    if window in ((-1, -1), (-1, 0)):
        return {}
    return {"window_size_left": window[0], "window_size_right": window[1]}


def _unused_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """``(rng_state, unused)`` for a dropout-free FlashAttention backward."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    """``[..., Hkv, d] -> [..., heads, d]`` (the efficient kernel has no native GQA)."""
    group = heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def _sum_kv_groups(grad: Tensor, kv_heads: int) -> Tensor:
    """``[..., H, d] -> [..., Hkv, d]``: sum the gradients of repeated kv heads."""
    *lead, heads, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(*lead, kv_heads, heads // kv_heads, d).sum(-2)


def _mask_type(window: Window) -> int:
    """``custom_mask_type``: 0 no mask, 2 causal aligned bottom-right (flash-attn's convention)."""
    if window not in ((-1, -1), (-1, 0)):  # unsupported_reason refuses other windows before this
        raise ValueError(f"torch_efficient: window {window} is not supported (only none or causal)")
    return 0 if window == (-1, -1) else 2


def _efficient_packing(packing: Packing, window: Window) -> tuple[Tensor, Tensor]:
    """int32 ``(cu_seqlens_q, cu_seqlens_k)`` for the efficient kernel: under a causal mask each
    sequence's keyless leading rows go to a sequence of their own (Note [Keyless rows])."""
    cu_q, cu_k = _cu(packing.cu_seqlens_q), _cu(packing.cu_seqlens_k)
    if window == (-1, 0):
        return split_keyless_sequences(cu_q, cu_k, 0)
    return cu_q, cu_k


def _aligned(n: int) -> int:
    return -(-n // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN


def _philox_unused() -> tuple[Tensor, Tensor]:
    """``(seed, offset)`` for a dropout-free efficient-attention backward (never read)."""
    return torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


class TorchEfficientBackend(KernelBackend):
    """PyTorch's CUTLASS memory-efficient attention (``aten._efficient_attention_*``).

    Runs fp32 as well as fp16/bf16; used by ``"auto"`` for fp32 on CUDA.
    """

    name = "torch_efficient"

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, *, window: bool = False, softcap: bool = False,
        alibi: bool = False,
    ) -> str | None:
        """``None`` if this backend runs on ``device``/``dtype``, else why not."""
        if alibi:
            return (
                "its kernel takes no per-block ALiBi bias on global positions; 'auto' picks 'reference' "
                "for alibi_slopes on CUDA (docs/masks.md)"
            )
        if softcap:
            return "PyTorch's memory-efficient kernel has no softcap (use 'reference')"
        if window:
            return "PyTorch's memory-efficient kernel has no general window (use 'torch_flash' or 'reference')"
        if dtype == torch.bfloat16:
            return _cuda_reason(device, dtype, (torch.bfloat16,), (8, 0))
        return _cuda_reason(device, dtype, (torch.float32, torch.float16), (5, 0))

    def kernel_forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: Window, softcap: float
    ) -> tuple[Tensor, Tensor]:
        if skip := keyless_prefix(q.shape[1], k.shape[1], window):  # Note [Keyless rows]
            return forward_skipping_keyless(self.kernel_forward, q, k, v, skip, scale=scale, window=window,
                                            softcap=softcap)
        _, sq, h, _ = q.shape
        w = padded_head_dim(q.shape[-1], v.shape[-1])
        out, lse, *_ = torch.ops.aten._efficient_attention_forward(
            pad_head_dim(q, width=w), pad_head_dim(_repeat_kv(k, h), width=w),
            pad_head_dim(_repeat_kv(v, h), width=w),
            None, None, None, None, None, 0.0, _mask_type(window), True, scale=scale,
        )
        return unpad_head_dim(out, v.shape[-1]), normalise_lse_(lse[..., :sq].contiguous())

    def kernel_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if skip := keyless_prefix(q.shape[1], k.shape[1], window):  # Note [Keyless rows]
            return backward_skipping_keyless(self.kernel_backward, dout, q, k, v, out, lse, skip, scale=scale,
                                             window=window, softcap=softcap)
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        w = padded_head_dim(d, v.shape[-1])
        lse_padded = torch.full((b, h, _aligned(sq)), float("inf"), device=q.device)
        lse_padded[..., :sq] = lse_for_backward(lse, torch.float32)
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            pad_head_dim(dout.to(q.dtype), width=w).contiguous(), pad_head_dim(q, width=w),
            pad_head_dim(_repeat_kv(k, h), width=w), pad_head_dim(_repeat_kv(v, h), width=w), None,
            pad_head_dim(out.to(q.dtype), width=w).contiguous(), None, None, sq, sk, lse_padded, 0.0,
            *_philox_unused(), _mask_type(window), False, scale=scale,
        )
        dk = _sum_kv_groups(unpad_head_dim(dk, d), hkv)
        dv = _sum_kv_groups(unpad_head_dim(dv, v.shape[-1]), hkv)
        return unpad_head_dim(dq, d), dk.to(k.dtype), dv.to(v.dtype)

    def kernel_varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, scale: float, window: Window,
        softcap: float,
    ) -> tuple[Tensor, Tensor]:
        total_q, h, _ = q.shape
        w = padded_head_dim(q.shape[-1], v.shape[-1])
        cu_q, cu_k = _efficient_packing(packing, window)
        max_seqlen_q, max_seqlen_k = packing.max_seqlen_q, packing.max_seqlen_k
        out, lse, *_ = torch.ops.aten._efficient_attention_forward(
            pad_head_dim(q, width=w)[None], pad_head_dim(_repeat_kv(k, h), width=w)[None],
            pad_head_dim(_repeat_kv(v, h), width=w)[None], None, cu_q, cu_k,
            max_seqlen_q, max_seqlen_k, 0.0, _mask_type(window), True, scale=scale,
        )
        out = unpad_head_dim(out[0], v.shape[-1])
        lse = normalise_lse_(packed_lse_from_padded(lse, cu_q, total_q))
        # Rows of sequences without keys: the kernel's output there is not specified.
        no_keys = tokens_of_empty_partner(cu_q, cu_k, total_q)
        lse.masked_fill_(no_keys, float("-inf"))
        out.masked_fill_(no_keys[:, None, None], 0.0)
        return out, lse

    def kernel_varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        total_q, h, d = q.shape
        total_k, hkv = k.shape[0], k.shape[1]
        w = padded_head_dim(d, v.shape[-1])
        cu_q, cu_k = _efficient_packing(packing, window)
        max_seqlen_q, max_seqlen_k = packing.max_seqlen_q, packing.max_seqlen_k
        lse_padded = padded_lse_from_packed(
            lse_for_backward(lse, torch.float32), cu_q, _aligned(max_seqlen_q)
        )
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            pad_head_dim(dout.to(q.dtype), width=w).contiguous()[None], pad_head_dim(q, width=w)[None],
            pad_head_dim(_repeat_kv(k, h), width=w)[None], pad_head_dim(_repeat_kv(v, h), width=w)[None], None,
            pad_head_dim(out.to(q.dtype), width=w).contiguous()[None], cu_q, cu_k,
            max_seqlen_q, max_seqlen_k, lse_padded, 0.0, *_philox_unused(), _mask_type(window), False,
            scale=scale,
        )
        dq = unpad_head_dim(dq[0], d)
        dk = _sum_kv_groups(unpad_head_dim(dk[0], d), hkv).to(k.dtype)
        dv = _sum_kv_groups(unpad_head_dim(dv[0], v.shape[-1]), hkv).to(v.dtype)
        # Sequences empty on one side: make their gradients exactly zero whatever the kernel did.
        dq.masked_fill_(tokens_of_empty_partner(cu_q, cu_k, total_q)[:, None, None], 0.0)
        no_queries = tokens_of_empty_partner(cu_k, cu_q, total_k)[:, None, None]
        dk.masked_fill_(no_queries, 0.0)
        dv.masked_fill_(no_queries, 0.0)
        return dq, dk, dv
