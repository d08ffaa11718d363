"""The attention-backend protocol and the helpers every backend shares.

A backend computes attention of one block of queries against one block of keys and returns the
output with its log-sum-exp (LSE), so that blocks can be merged (``seqpar.parallel.merge``). Its backward
takes ``out`` and ``lse`` from the caller, which may be the *merged* (global) results of many
blocks, and must use them as given.

Layouts (fixed for all backends):

- dense: q ``[B, Sq, H, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` ("bshd"),
  ``H % Hkv == 0``; out ``[B, Sq, H, Dv]`` in q's dtype, lse ``[B, H, Sq]``.
- varlen: q ``[Tq, H, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]``, ``cu_seqlens_*`` int32
  ``[nseq + 1]``; out ``[Tq, H, Dv]``, lse ``[H, Tq]``. Sequence ``i`` of q attends only to
  sequence ``i`` of k.

The value head dim ``Dv`` may differ from the query/key head dim ``D`` (MLA: DeepSeek-V2/V3,
Kimi); the gradients keep their inputs' shapes (``dv`` has ``Dv``). A kernel that needs one head
dim for q, k and v zero-pads the narrower side (Note [Value head dim]).

lse is float32, or float64 when q is float64 (:func:`lse_dtype`). A
query row with no key at all gets ``out = 0`` and ``lse = -inf``, whatever the kernel reports.

Masks follow flash-attn: ``window = (left, right)`` with ``-1`` unbounded, aligned to the
bottom-right corner of the block (per sequence in varlen), and ``causal=True`` sets ``right = 0``.
Query row ``i`` of ``Sq`` sees key ``j`` of ``Sk`` iff ``i + Sk - Sq - left <= j <= i + Sk - Sq +
right``::

    causal, Sq = Sk = 4    window (1, 0), Sq = 3, Sk = 5     (x = attended)
        k0 k1 k2 k3            k0 k1 k2 k3 k4
    q0   x  .  .  .       q0    .  x  x  .  .
    q1   x  x  .  .       q1    .  .  x  x  .
    q2   x  x  x  .       q2    .  .  .  x  x
    q3   x  x  x  x

``softcap = c > 0`` replaces every (scaled) score ``s`` by ``c * tanh(s / c)`` (0: off). A backend
declares what it can run through ``unsupported_reason(device, dtype, window=, softcap=)``.

Every backend class derives from :class:`KernelBackend`. Its public methods (``forward``, ...)
check their inputs, answer blocks without queries or keys, fold ``causal`` into the window and
then call the *kernel methods* (``kernel_forward``, ...), which trust their inputs: seqpar's own
layers, having validated once at the public entry, call those directly.

Note [Value head dim]
~~~~~~~~~~~~~~~~~~~~~
Padding is exact. Zero columns appended to q and k leave every score ``q . k`` unchanged (the
scale is always passed explicitly, never derived from the padded width); zero columns appended
to v give output columns that are exactly zero and are dropped; in the backward, zero columns of
``dout`` and ``out`` leave ``delta = rowsum(dout * out)`` and ``dP = dout . v`` unchanged, so dq,
dk and dv are exact in their real columns and the padded columns of the gradients are dropped.
Which side is padded, per backend: ``reference`` none (plain math takes any ``Dv``); ``cpu`` the
narrower of (q, k) and v to the wider one (PyTorch's CPU flash kernel refuses ``Dv != D``);
``torch_flash``, ``torch_efficient`` and ``flash_attn`` all three to ``max(D, Dv)`` rounded up to
a multiple of 8 (:func:`pad_head_dim`), one code path with the equal-dim case.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "AttentionBackend",
    "KernelBackend",
    "Packing",
    "Window",
    "kernel_window",
    "row_key_bounds",
    "keyless_prefix",
    "forward_skipping_keyless",
    "backward_skipping_keyless",
    "split_keyless_sequences",
    "check_dense",
    "check_varlen",
    "lse_dtype",
    "empty_forward",
    "varlen_lengths",
    "lse_for_backward",
    "last_dim_contiguous",
    "padded_head_dim",
    "pad_head_dim",
    "unpad_head_dim",
    "normalise_lse_",
    "token_sequence_ids",
    "packed_lse_from_padded",
    "padded_lse_from_packed",
    "tokens_of_empty_partner",
    "Alibi",
    "alibi_bias",
]

Window = tuple[int, int]


def kernel_window(causal: bool, window: Window) -> Window:
    """``(left, right)`` with ``causal`` folded in (right side 0), ``-1`` for unbounded sides."""
    left, right = window
    return (left if left >= 0 else -1, 0 if causal else (right if right >= 0 else -1))


def row_key_bounds(sq: int, sk: int, window: Window, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Inclusive key range ``[lower[i], upper[i]]`` of every query row of a ``sq x sk`` block.

    Bottom-right aligned (see the module docstring); a row with ``lower > upper`` sees no key.
    Returns int64 ``[sq]`` tensors on ``device``.
    """
    left, right = window
    i = torch.arange(sq, device=device) + (sk - sq)
    lower = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    upper = (i + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(i, sk - 1)
    return lower, upper


def keyless_prefix(sq: int, sk: int, window: Window) -> int:
    """How many leading query rows of a ``sq x sk`` dense block see no key (Note [Keyless rows]).

    ``window`` is a kernel window (:func:`kernel_window`); the rows without keys are always a
    prefix: ``sq - sk - right`` of them when the right side is bounded and ``sq > sk + right``
    (all of them when ``sk == 0``).
    """
    if sk == 0:
        return sq
    right = window[1]
    return 0 if right < 0 else min(sq, max(0, sq - sk - right))


# Note [Keyless rows]
# ~~~~~~~~~~~~~~~~~~~
# Under a bottom-right aligned mask with a bounded right side (causal included), a block with
# more query rows than ``Sk + right`` has leading rows that see no key; the contract gives them
# ``out = 0, lse = -inf``. PyTorch's memory-efficient kernel (``custom_mask_type = 2``) gets such
# blocks wrong (measured on an H200, torch 2.11, ``scripts/gpu_check``): a 129 x 3 causal block
# came back with output errors of 4.45 in bf16, fp16 and fp32, and in a packed call with a
# 20-query / 5-key causal sequence rows 0-18 were wrong, rows 15-18 included, which do see keys.
# Blocks with ``Sq <= Sk`` are right, and so is the bundled FlashAttention kernel in every case.
# Dropping the leading keyless rows keeps the mask of every other row (row ``i``'s offset
# ``Sk - Sq`` is its distance to the last row, which trimming the front leaves alone) and leaves
# ``Sq <= Sk + right``. So ``torch_efficient`` runs a dense block on ``q[:, n:]`` only and fills
# the rest itself (:func:`forward_skipping_keyless`), and splits every packed sequence into its
# keyless head, given no keys, and the rest (:func:`split_keyless_sequences`): device arithmetic
# on ``cu_seqlens``, so no host synchronisation. A row that sees no key gets no gradient and
# gives none to k or v.


def forward_skipping_keyless(kernel, q: Tensor, k: Tensor, v: Tensor, skip: int, **options):
    """``kernel(q[:, skip:], k, v, **options)`` with the ``skip`` keyless leading rows filled
    with ``out = 0, lse = -inf`` (Note [Keyless rows]).

    Args:
        kernel: a dense kernel forward (``KernelBackend.kernel_forward``).
        q: ``(batch, Sq, nheads, headdim)``; k, v: ``(batch, Sk, nheads_kv, headdim / headdim_v)``.
        skip: :func:`keyless_prefix` of the block, ``0 <= skip <= Sq``.

    Returns:
        ``out`` ``(batch, Sq, nheads, headdim_v)`` and ``lse`` ``(batch, nheads, Sq)`` of all rows.
    """
    b, sq, h, _ = q.shape
    if skip >= sq:
        return empty_forward(q, (b, h, sq), v.shape[-1])
    out_rows, lse_rows = kernel(q[:, skip:], k, v, **options)
    out = out_rows.new_zeros(b, sq, h, out_rows.shape[-1])
    out[:, skip:] = out_rows
    lse = lse_rows.new_full((b, h, sq), float("-inf"))
    lse[..., skip:] = lse_rows
    return out, lse


def backward_skipping_keyless(
    kernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, skip: int, **options,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`forward_skipping_keyless`: the kernel sees the rows with keys, the
    ``skip`` leading rows get ``dq = 0`` and add nothing to ``dk``/``dv``.

    Shapes as in :func:`forward_skipping_keyless` (``dout``, ``out`` like the output, ``lse``
    ``(batch, nheads, Sq)``, possibly the merged results of many blocks). Returns ``dq, dk, dv``
    shaped like ``q, k, v``.
    """
    if skip >= q.shape[1]:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows = slice(skip, None)
    dq_rows, dk, dv = kernel(dout[:, rows], q[:, rows], k, v, out[:, rows], lse[..., rows], **options)
    dq = torch.zeros_like(q)
    dq[:, rows] = dq_rows
    return dq, dk, dv


Alibi = tuple[Tensor, int]
"""``(slopes, offset)``: ALiBi on one dense block (Note [ALiBi blocks])."""


def alibi_bias(alibi: Alibi, rows: slice, cols: slice, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The ALiBi bias ``[1, H, rows, cols]`` of rows ``rows`` and keys ``cols`` of one block.

    Note [ALiBi blocks]
    ~~~~~~~~~~~~~~~~~~~
    ALiBi adds ``-slope_h * |p_i - p_j|`` to the scaled (and softcapped) score of query position
    ``p_i`` and key position ``p_j`` (flash-attn's ``alibi_slopes``, on global positions). Every
    block of an ALiBi plan holds consecutive positions on both sides, so with ``offset`` the
    position of query row 0 minus that of key row 0, ``p_i - p_j = i - j + offset``. Backends
    whose ``unsupported_reason(alibi=True)`` is None accept ``alibi=(slopes, offset)`` in their
    dense ``kernel_forward`` / ``kernel_backward``; the bias is a constant (no slope gradient).
    """
    slopes, offset = alibi
    i = torch.arange(rows.start, rows.stop, device=device)
    j = torch.arange(cols.start, cols.stop, device=device)
    dist = (i[:, None] - j[None, :] + offset).abs().to(dtype)
    return -(slopes.to(device=device, dtype=dtype).view(1, -1, 1, 1) * dist)


@runtime_checkable
class AttentionBackend(Protocol):
    """One attention kernel family behind a fixed interface (see the module docstring)."""

    name: str

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
        window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """Dense attention of one block.

        Args:
            q: ``(batch, seqlen_q, nheads, headdim)``.
            k: ``(batch, seqlen_k, nheads_kv, headdim)``; ``nheads % nheads_kv == 0``.
            v: ``(batch, seqlen_k, nheads_kv, headdim_v)``, any ``headdim_v >= 1``.
            causal: bottom-right aligned causal mask (sets the window's right side to 0).
            scale: softmax scale applied to ``q @ k^T``.
            window: ``(left, right)``, ``-1`` unbounded (flash-attn's ``window_size``).
            softcap: ``c > 0`` caps scores to ``c * tanh(s / c)``; 0 disables.

        Returns:
            ``out`` ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype and
            ``lse`` ``(batch, nheads, seqlen_q)`` float32 (float64 for float64 q).
        """
        ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        causal: bool, scale: float, window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one dense block given the (possibly global) ``out`` and ``lse``.

        Args:
            dout, out: ``(batch, seqlen_q, nheads, headdim_v)``.
            q, k, v, causal, scale, window, softcap: as in :meth:`forward`.
            lse: ``(batch, nheads, seqlen_q)``.

        Returns:
            ``dq, dk, dv`` shaped and typed like ``q, k, v``.
        """
        ...

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float,
        window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """Block-diagonal attention over packed sequences (masks aligned per sequence).

        Args:
            q: ``(total_q, nheads, headdim)``.
            k: ``(total_k, nheads_kv, headdim)``; v: ``(total_k, nheads_kv, headdim_v)``.
            cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)``, cumulative lengths from 0.
            max_seqlen_q, max_seqlen_k: the longest sequence on each side.

        Returns:
            ``out`` ``(total_q, nheads, headdim_v)`` and ``lse`` ``(nheads, total_q)``.
        """
        ...

    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
        causal: bool, scale: float, window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of :meth:`varlen_forward` given the (possibly global) ``out`` and ``lse``.

        Returns:
            ``dq, dk, dv`` shaped and typed like ``q, k, v``.
        """
        ...


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSE (and accumulator) dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_common(q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:-1] != v.shape[:-1] or v.shape[-1] < 1:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on every dim but the last (v's "
            "head dim Dv >= 1 may differ from k's)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has {q.shape[-1]}, k has {k.shape[-1]}; they must be equal")
    h, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(
            f"{layout}: the {h} query heads must be a multiple of the {hkv} key/value heads"
        )


def check_dense(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Validate dense bshd inputs.

    Raises:
        ValueError: on wrong ranks, mismatched batch/heads/head dim, dtype or device.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"dense attention expects [B, S, H, D] tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    _check_common(q, k, v, "bshd")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")


def check_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor
) -> None:
    """Validate packed ``[T, H, D]`` inputs and their ``cu_seqlens``.

    Raises:
        ValueError: on wrong ranks, mismatched heads, or cu_seqlens of different lengths.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen attention expects [T, H, D] tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    _check_common(q, k, v, "varlen")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must be 1-D of equal length nseq+1, got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )


def varlen_lengths(
    q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor
) -> tuple[list[int], list[int]]:
    """Per-sequence lengths ``(lens_q, lens_k)`` read on the host from ``cu_seqlens``.

    Raises:
        ValueError: if the offsets do not start at 0, decrease, or do not end at the token counts.
    """
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    lens_q = [b - a for a, b in zip(cq[:-1], cq[1:])]
    lens_k = [b - a for a, b in zip(ck[:-1], ck[1:])]
    for name, cu, lens, total in (("q", cq, lens_q, q.shape[0]), ("k", ck, lens_k, k.shape[0])):
        if not cu or cu[0] != 0 or cu[-1] != total or min(lens, default=0) < 0:
            raise ValueError(
                f"cu_seqlens_{name} must rise from 0 to the {total} {name} tokens, got {cu}"
            )
    return lens_q, lens_k


def empty_forward(q: Tensor, lse_shape: tuple[int, ...], head_dim_v: int | None = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` for rows that see no key: zeros shaped like ``q`` with the last dim
    ``head_dim_v`` (default: q's), contiguous, and ``-inf`` of ``lse_shape``."""
    shape = q.shape if head_dim_v is None else (*q.shape[:-1], head_dim_v)
    out = torch.zeros(shape, dtype=q.dtype, device=q.device)
    lse = torch.full(lse_shape, float("-inf"), device=q.device, dtype=lse_dtype(q.dtype))
    return out, lse


def lse_for_backward(lse: Tensor, dtype: torch.dtype) -> Tensor:
    """The LSE a kernel's backward should read: ``dtype``, contiguous, ``-inf`` made ``+inf``.

    Rows with ``lse = -inf`` have no keys; kernels compute ``p = exp(s - lse)``, which is NaN or
    inf for ``lse = -inf`` but exactly 0 for ``lse = +inf``, so those rows contribute nothing.
    """
    lse = lse.to(dtype)
    return lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()


def last_dim_contiguous(x: Tensor) -> Tensor:
    """``x`` itself when its last dim has stride 1, else a contiguous copy.

    Kernels take arbitrary strides for the other dims but silently misread a strided head dim
    (measured for the CPU flash kernel, torch 2.13).
    """
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------
# The part of the four protocol methods that every backend shares.


@dataclass(frozen=True)
class Packing:
    """The sequence packing of one varlen call.

    Attributes:
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)``, cumulative lengths from 0, on the
            device of the inputs.
        max_seqlen_q, max_seqlen_k: the longest sequence on each side.
        lens: ``(lens_q, lens_k)`` per-sequence lengths on the host, for a backend with
            ``host_lengths = True`` (None otherwise: the CUDA kernels take ``cu_seqlens`` on the
            device and must not synchronise).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    lens: tuple[list[int], list[int]] | None = None

    def host_lens(self) -> tuple[list[int], list[int]]:
        """``(lens_q, lens_k)``: per-sequence lengths, for ``host_lengths`` backends only."""
        if self.lens is None:
            raise RuntimeError("seqpar internal error: a host_lengths backend got a Packing without host lengths")
        return self.lens


class KernelBackend(AttentionBackend):
    """The shared half of every backend: input checks and empty blocks, then the kernel methods.

    The public methods validate their inputs (:func:`check_dense`; :func:`check_varlen` and, with
    ``host_lengths``, :func:`varlen_lengths`), refuse a window or softcap the backend cannot run
    (``ValueError`` naming the backends that can), answer a block with no query or no key token
    without a kernel (``out = 0``, ``lse = -inf``, zero gradients) and fold ``causal`` into the
    window. A subclass implements the trusted kernel methods, which get non-empty blocks and a
    ``window`` with ``causal`` folded in (:func:`kernel_window`): ``kernel_forward``,
    ``kernel_backward``, ``kernel_varlen_forward`` and ``kernel_varlen_backward`` (varlen: single
    sequences may still be empty on either side, and rows may see no key).
    """

    #: Whether varlen calls read the per-sequence lengths on the host (``Packing.lens``).
    host_lengths: ClassVar[bool] = False
    #: Whether a grouped-query backward (fewer K/V heads than query heads) holds dK/dV expanded
    #: to the query heads while it runs (FlashAttention's GQA path, or K/V repeated before the
    #: kernel): its scratch grows with the key rows times the group, so the ring runs a step's
    #: wide blocks in two key halves (Note [Gradients sent as computed] in
    #: ``seqpar.parallel.ring``). ``True`` unless the kernel accumulates into the K/V heads.
    backward_expands_kv_heads: ClassVar[bool] = True

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, *, window: bool = False, softcap: bool = False,
        alibi: bool = False,
    ) -> str | None:
        """``None`` if this backend runs on ``device``/``dtype`` with the features asked for,
        else why not."""
        raise NotImplementedError

    def _check_features(self, q: Tensor, window: Window, softcap: float) -> None:
        """Refuse a window or softcap this backend cannot run (checked for non-empty blocks)."""
        if window in ((-1, -1), (-1, 0)) and softcap <= 0:
            return
        reason = self.unsupported_reason(
            q.device, q.dtype, window=window not in ((-1, -1), (-1, 0)), softcap=softcap > 0
        )
        # Only the features are judged here (a device/dtype the backend lacks fails in its kernel).
        if reason is not None and self.unsupported_reason(q.device, q.dtype) is None:
            raise ValueError(f"attention backend {self.name!r}: {reason}")

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
        window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """See :meth:`AttentionBackend.forward`."""
        check_dense(q, k, v)
        window = kernel_window(causal, window)
        b, sq, h, _ = q.shape
        if sq == 0 or k.shape[1] == 0:
            return empty_forward(q, (b, h, sq), v.shape[-1])
        self._check_features(q, window, softcap)
        return self.kernel_forward(q, k, v, scale=scale, window=window, softcap=softcap)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        causal: bool, scale: float, window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """See :meth:`AttentionBackend.backward`."""
        check_dense(q, k, v)
        window = kernel_window(causal, window)
        if q.shape[1] == 0 or k.shape[1] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        self._check_features(q, window, softcap)
        return self.kernel_backward(dout, q, k, v, out, lse, scale=scale, window=window, softcap=softcap)

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float,
        window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """See :meth:`AttentionBackend.varlen_forward`."""
        packing = self._packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        window = kernel_window(causal, window)
        total_q, h, _ = q.shape
        if total_q == 0 or k.shape[0] == 0:
            return empty_forward(q, (h, total_q), v.shape[-1])
        self._check_features(q, window, softcap)
        return self.kernel_varlen_forward(q, k, v, packing, scale=scale, window=window, softcap=softcap)

    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
        causal: bool, scale: float, window: Window = (-1, -1), softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """See :meth:`AttentionBackend.varlen_backward`."""
        packing = self._packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        window = kernel_window(causal, window)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        self._check_features(q, window, softcap)
        return self.kernel_varlen_backward(
            dout, q, k, v, out, lse, packing, scale=scale, window=window, softcap=softcap
        )

    def _packing(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int,
    ) -> Packing:
        """Check varlen inputs and bundle the packing (with host lengths if ``host_lengths``)."""
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        lens = varlen_lengths(q, k, cu_seqlens_q, cu_seqlens_k) if self.host_lengths else None
        return Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, lens)

    @abstractmethod
    def kernel_forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: Window, softcap: float
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward` on trusted inputs with ``Sq > 0`` and ``Sk > 0``."""

    @abstractmethod
    def kernel_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`backward` on trusted inputs with ``Sq > 0`` and ``Sk > 0``."""

    @abstractmethod
    def kernel_varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, scale: float, window: Window,
        softcap: float,
    ) -> tuple[Tensor, Tensor]:
        """:meth:`varlen_forward` on trusted inputs with ``total_q > 0`` and ``total_k > 0``."""

    @abstractmethod
    def kernel_varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`varlen_backward` on trusted inputs with ``total_q > 0`` and ``total_k > 0``."""

    def kernel_varlen_backward_into(
        self, grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
        out: Tensor, lse: Tensor, packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> None:
        """Add the gradients of :meth:`kernel_varlen_backward` into ``grads = (dq, dk, dv)``
        (shaped like q, k, v; any floating dtype).

        A backend that computes sequence by sequence overrides this to add each sequence's
        gradients in place, so that no full-size result exists next to the accumulators.
        """
        for acc, g in zip(grads, self.kernel_varlen_backward(
            dout, q, k, v, out, lse, packing, scale=scale, window=window, softcap=softcap
        )):
            acc += g


# ---------------------------------------------------------------------------------------------
# Helpers for the CUDA kernel families (torch_cuda.py, flash_attn.py). All device-side: they never
# read cu_seqlens on the host, so they add no synchronisation.


def padded_head_dim(head_dim: int, head_dim_v: int, multiple: int = 8) -> int:
    """The one head dim a kernel needing equal q/k/v head dims runs: ``max(head_dim, head_dim_v)``
    rounded up to a multiple of ``multiple`` (Note [Value head dim])."""
    width = max(head_dim, head_dim_v)
    return width + (-width) % multiple


def pad_head_dim(x: Tensor, multiple: int = 8, *, width: int = 0) -> Tensor:
    """Zero-pad the last dim of ``x`` to the smallest multiple of ``multiple`` that is at least
    ``max(x.shape[-1], width)`` (FlashAttention requires 8; ``width``: a common head dim for q, k
    and v, :func:`padded_head_dim`). The last dim is made contiguous.

    Padding q, k and v with zeros leaves the scores unchanged (the scale is passed explicitly)
    and gives zero output columns, which :func:`unpad_head_dim` drops (Note [Value head dim]).
    """
    target = max(x.shape[-1], width)
    pad = target + (-target) % multiple - x.shape[-1]
    x = last_dim_contiguous(x)
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def unpad_head_dim(x: Tensor, head_dim: int) -> Tensor:
    """Inverse of :func:`pad_head_dim`: the first ``head_dim`` columns, contiguous if sliced."""
    return x if x.shape[-1] == head_dim else x[..., :head_dim].contiguous()


def normalise_lse_(lse: Tensor) -> Tensor:
    """Map kernels' markers for rows without keys (``+inf`` in FA2, NaN) to ``-inf``, in place."""
    return lse.masked_fill_(torch.isnan(lse) | (lse == float("inf")), float("-inf"))


def token_sequence_ids(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Sequence index and position within it of every packed token.

    Args:
        cu_seqlens: ``(nseq + 1,)`` cumulative lengths starting at 0.
        total: number of packed tokens ``cu_seqlens[-1]``.

    Returns:
        ``(seq, pos)``, both int64 ``(total,)``; empty sequences are skipped correctly.
    """
    cu = cu_seqlens.long()
    token = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], token, right=True)
    return seq, token - cu[seq]


def packed_lse_from_padded(lse: Tensor, cu_seqlens_q: Tensor, total_q: int) -> Tensor:
    """``[nseq, H, max_seqlen_q(+pad)]`` per-sequence padded lse -> packed ``[H, total_q]``."""
    seq, pos = token_sequence_ids(cu_seqlens_q, total_q)
    return lse[seq, :, pos].transpose(0, 1).contiguous()


def padded_lse_from_packed(
    lse: Tensor, cu_seqlens_q: Tensor, width: int, fill: float = float("inf")
) -> Tensor:
    """Packed ``[H, total_q]`` lse -> ``[nseq, H, width]``, unused slots set to ``fill``."""
    heads, total_q = lse.shape
    nseq = cu_seqlens_q.shape[0] - 1
    padded = torch.full((nseq, heads, width), fill, device=lse.device, dtype=lse.dtype)
    seq, pos = token_sequence_ids(cu_seqlens_q, total_q)
    padded[seq, :, pos] = lse.transpose(0, 1)
    return padded


def tokens_of_empty_partner(cu_own: Tensor, cu_other: Tensor, total_own: int) -> Tensor:
    """Bool ``(total_own,)``: tokens whose sequence is empty on the other side.

    With ``cu_own = cu_seqlens_q`` these are query rows without keys; with ``cu_own =
    cu_seqlens_k`` keys that no query sees.
    """
    seq, _ = token_sequence_ids(cu_own, total_own)
    other_lens = cu_other[1:].long() - cu_other[:-1].long()
    return other_lens[seq] == 0


def split_keyless_sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, right: int) -> tuple[Tensor, Tensor]:
    """A packing in which every sequence's keyless leading query rows (Note [Keyless rows]) form
    a sequence of their own with no keys.

    Sequence ``s`` with ``lq`` queries and ``lk`` keys becomes two: ``a = clamp(lq - lk - right,
    0, lq)`` queries with no keys, then ``lq - a`` queries with the ``lk`` keys (so ``lq - a <= lk
    + right``). Tokens stay where they are; device arithmetic only (no synchronisation).

    Args:
        cu_seqlens_q, cu_seqlens_k: ``(nseq + 1,)`` cumulative lengths from 0.
        right: the kernel window's right side, ``>= 0`` (bounded).

    Returns:
        int32 ``(2 * nseq + 1,)`` ``(cu_seqlens_q, cu_seqlens_k)``; ``max_seqlen_q`` and
        ``max_seqlen_k`` of the original packing still bound the new one.
    """
    lens_q = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
    lens_k = cu_seqlens_k[1:].long() - cu_seqlens_k[:-1].long()
    keyless = torch.minimum((lens_q - lens_k - right).clamp(min=0), lens_q)
    split_q = torch.stack([keyless, lens_q - keyless], dim=1).flatten()
    split_k = torch.stack([torch.zeros_like(lens_k), lens_k], dim=1).flatten()
    zero = lens_q.new_zeros(1)
    return (torch.cat([zero, split_q.cumsum(0)]).to(torch.int32),
            torch.cat([zero, split_k.cumsum(0)]).to(torch.int32))
