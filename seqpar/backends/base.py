"""The attention-backend protocol and the helpers every backend shares.

A backend computes attention of one block of queries against one block of keys and returns the
output with its log-sum-exp (LSE), so that blocks can be merged (``seqpar.merge``). Its backward
takes ``out`` and ``lse`` from the caller, which may be the *merged* (global) results of many
blocks, and must use them as given.

Layouts (fixed for all backends):

- dense: q ``[B, Sq, H, D]``, k/v ``[B, Sk, Hkv, D]`` ("bshd"), ``H % Hkv == 0``;
  out ``[B, Sq, H, D]`` in q's dtype, lse ``[B, H, Sq]``.
- varlen: q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]``, ``cu_seqlens_*`` int32 ``[nseq + 1]``;
  out ``[Tq, H, D]``, lse ``[H, Tq]``. Sequence ``i`` of q attends only to sequence ``i`` of k.

lse is float32, or float64 when q is float64 (``seqpar.merge.accumulator_dtype``). A query row
with no key at all gets ``out = 0`` and ``lse = -inf``, whatever the kernel itself reports.
``causal=True`` is only used with square blocks (``Sq == Sk``, or equal lengths per sequence),
diagonal aligned:

    causal, Sq = Sk = 4     (x = attended)
        k0 k1 k2 k3
    q0   x  .  .  .
    q1   x  x  .  .
    q2   x  x  x  .
    q3   x  x  x  x

Every backend class derives from :class:`KernelBackend`, which does the input checks and answers
blocks without queries or keys once, then calls the backend's kernel part (``_forward`` etc.).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..merge import accumulator_dtype

__all__ = [
    "AttentionBackend",
    "KernelBackend",
    "Packing",
    "check_dense",
    "check_varlen",
    "lse_dtype",
    "empty_forward",
    "varlen_lengths",
    "lse_for_backward",
    "last_dim_contiguous",
    "pad_head_dim",
    "unpad_head_dim",
    "normalise_lse_",
    "token_sequence_ids",
    "packed_lse_from_padded",
    "padded_lse_from_packed",
    "tokens_of_empty_partner",
]


@runtime_checkable
class AttentionBackend(Protocol):
    """One attention kernel family behind a fixed interface (see the module docstring)."""

    name: str

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """Dense attention of one block.

        Args:
            q: ``(batch, seqlen_q, nheads, headdim)``.
            k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; ``nheads % nheads_kv == 0``.
            causal: diagonal-aligned causal mask; requires ``seqlen_q == seqlen_k``.
            scale: softmax scale applied to ``q @ k^T``.

        Returns:
            ``out`` ``(batch, seqlen_q, nheads, headdim)`` in q's dtype and
            ``lse`` ``(batch, nheads, seqlen_q)`` float32 (float64 for float64 q).
        """
        ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one dense block given the (possibly global) ``out`` and ``lse``.

        Args:
            dout, out: ``(batch, seqlen_q, nheads, headdim)``.
            q, k, v: as in :meth:`forward`.
            lse: ``(batch, nheads, seqlen_q)``.

        Returns:
            ``dq, dk, dv`` shaped and typed like ``q, k, v``.
        """
        ...

    def varlen_forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        """Block-diagonal attention over packed sequences.

        Args:
            q: ``(total_q, nheads, headdim)``.
            k, v: ``(total_k, nheads_kv, headdim)``.
            cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)``, cumulative lengths from 0.
            max_seqlen_q, max_seqlen_k: the longest sequence on each side.

        Returns:
            ``out`` ``(total_q, nheads, headdim)`` and ``lse`` ``(nheads, total_q)``.
        """
        ...

    def varlen_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of :meth:`varlen_forward` given the (possibly global) ``out`` and ``lse``.

        Returns:
            ``dq, dk, dv`` shaped and typed like ``q, k, v``.
        """
        ...


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSE dtype for inputs of ``dtype``: float64 for float64, float32 otherwise."""
    return accumulator_dtype(dtype)


def _check_common(q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has {q.shape[-1]}, k/v have {k.shape[-1]}")
    h, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(
            f"{layout}: the {h} query heads must be a multiple of the {hkv} key/value heads"
        )


def check_dense(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
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
    # Internal invariant: the ring only asks for causal attention on square diagonal blocks.
    assert not causal or q.shape[1] == k.shape[1], (q.shape, k.shape)


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
    q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool
) -> tuple[list[int], list[int]]:
    """Per-sequence lengths ``(lens_q, lens_k)`` read on the host from ``cu_seqlens``.

    Raises:
        ValueError: if the offsets do not start at 0, decrease, do not end at the token counts,
            or (causal) a sequence has different q and k lengths.
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
    if causal and lens_q != lens_k:
        bad = next(i for i, (a, b) in enumerate(zip(lens_q, lens_k)) if a != b)
        raise ValueError(
            f"causal varlen attention needs equal q and k lengths per sequence; sequence {bad} "
            f"has {lens_q[bad]} queries and {lens_k[bad]} keys"
        )
    return lens_q, lens_k


def empty_forward(q: Tensor, lse_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` for rows that see no key: zeros like ``q`` and ``-inf`` of ``lse_shape``."""
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
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
    """The sequence packing of one varlen call, as given to :meth:`AttentionBackend.varlen_forward`.

    Attributes:
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)``, cumulative lengths from 0.
        max_seqlen_q, max_seqlen_k: the longest sequence on each side.
        lens: ``(lens_q, lens_k)`` from :func:`varlen_lengths`, read on the host only for a
            backend with ``host_lengths = True``; None otherwise (the CUDA kernels take
            ``cu_seqlens`` on the device and must not synchronise).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    lens: tuple[list[int], list[int]] | None = None

    def host_lens(self) -> tuple[list[int], list[int]]:
        """``(lens_q, lens_k)``: per-sequence lengths, for ``host_lengths`` backends only."""
        assert self.lens is not None, "per-sequence lengths are read for host_lengths backends"
        return self.lens


class KernelBackend(AttentionBackend):
    """The shared half of every backend: input checks and empty blocks, then the kernel part.

    The public methods validate their inputs (:func:`check_dense`; :func:`check_varlen` and, with
    ``host_lengths``, :func:`varlen_lengths`) and answer a block with no query or no key token
    (``Sq == 0 or Sk == 0``; ``total_q == 0 or total_k == 0``) without a kernel: ``out = 0``,
    ``lse = -inf`` (:func:`empty_forward`) and zero gradients. A subclass implements the kernel
    part only: ``_forward``, ``_backward``, ``_varlen_forward`` and ``_varlen_backward``, which
    get checked inputs with at least one query and one key token (varlen: single sequences may
    still be empty on either side).
    """

    #: Whether varlen calls read the per-sequence lengths on the host (``Packing.lens``); they are
    #: then validated before an empty block is answered.
    host_lengths: ClassVar[bool] = False

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """See :meth:`AttentionBackend.forward`."""
        check_dense(q, k, v, causal)
        b, sq, h, _ = q.shape
        if sq == 0 or k.shape[1] == 0:
            return empty_forward(q, (b, h, sq))
        return self._forward(q, k, v, causal=causal, scale=scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """See :meth:`AttentionBackend.backward`."""
        check_dense(q, k, v, causal)
        if q.shape[1] == 0 or k.shape[1] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return self._backward(dout, q, k, v, out, lse, causal=causal, scale=scale)

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor]:
        """See :meth:`AttentionBackend.varlen_forward`."""
        packing = self._packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal)
        total_q, h, _ = q.shape
        if total_q == 0 or k.shape[0] == 0:
            return empty_forward(q, (h, total_q))
        return self._varlen_forward(q, k, v, packing, causal=causal, scale=scale)

    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """See :meth:`AttentionBackend.varlen_backward`."""
        packing = self._packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return self._varlen_backward(dout, q, k, v, out, lse, packing, causal=causal, scale=scale)

    def _packing(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    ) -> Packing:
        """Check varlen inputs and bundle the packing (with host lengths if ``host_lengths``)."""
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        lens = None
        if self.host_lengths:
            lens = varlen_lengths(q, k, cu_seqlens_q, cu_seqlens_k, causal)
        return Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, lens)

    @abstractmethod
    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward` on checked inputs with ``Sq > 0`` and ``Sk > 0``."""

    @abstractmethod
    def _backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`backward` on checked inputs with ``Sq > 0`` and ``Sk > 0``."""

    @abstractmethod
    def _varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """:meth:`varlen_forward` on checked inputs with ``total_q > 0`` and ``total_k > 0``."""

    @abstractmethod
    def _varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`varlen_backward` on checked inputs with ``total_q > 0`` and ``total_k > 0``."""


# ---------------------------------------------------------------------------------------------
# Helpers for the CUDA kernel families (torch_cuda.py, flash_attn.py). All device-side: they never
# read cu_seqlens on the host, so they add no synchronisation.


def pad_head_dim(x: Tensor, multiple: int = 8) -> Tensor:
    """Zero-pad the last dim of ``x`` to a multiple of ``multiple`` (FlashAttention requires 8).

    Padding q, k and v with zeros leaves the scores unchanged (the scale is passed explicitly)
    and gives zero output columns, which :func:`unpad_head_dim` drops.
    """
    pad = (-x.shape[-1]) % multiple
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
