"""Hybrid context-parallel attention (USP): Ulysses inside, zig-zag ring across.

``attention`` is the public entry point on local shards; ``SequenceParallelAttention`` is its
``nn.Module`` form. The composition order is written once, in :func:`_attention_bshd`:

    this rank's shard [B, S_local, H, D]                      (layout converted by views)
      -> Ulysses all-to-all over state.ulysses_group          [B, S_ring_local, H_u, D]
      -> ring attention over state.ring_group                 (exact over all S tokens)
      -> Ulysses all-to-all back                              [B, S_local, H, D]

With ``R == 1`` the ring is plain local attention; with ``U == 1`` there is no all-to-all.

Note [Global length]
~~~~~~~~~~~~~~~~~~~~
The ring needs the global length ``S`` (its zig-zag chunk sizes) and the Ulysses all-to-all the
ring-local length. A shard's own length does not determine ``S``: Ulysses rank 0 holds
``ceil(len / U)`` tokens, so ``U`` different lengths give the same shard (``R=1, U=2``: a 3-token
shard comes from ``S = 5`` or ``S = 6``), and the ring-local length ``2*base + {0, 1, 2}`` is
ambiguous the same way. A rule that answered locally only when the answer is unique would call a
collective on some ranks and not others. So:

- ``seq_len=S`` given: checked against this rank's placement, no communication;
- ``seq_len=None`` and ``cp_size > 1``: one all-gather of five ints (the local length, B, H, Hkv,
  D) over the CP group. ``S`` is the sum of the lengths, and every rank checks that the lengths
  are exactly the placement of ``S`` and that all ranks agree on the other dims, so a mistake
  raises the same ``ValueError`` on every rank instead of hanging a later collective. On CUDA
  this reads the result on the host (one synchronisation per call); pass ``seq_len`` in a
  training loop to avoid it.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from .backends import AttentionBackend, get_backend
from .checks import check_gqa, check_qkv
from .layout import ring_local_length, shard_lengths
from .ring import ring_attention
from .sharding import exchange_seq_len
from .state import ParallelState
from .ulysses import ulysses_attention

__all__ = ["attention", "SequenceParallelAttention", "Layout"]

Layout = Literal["bshd", "sbhd", "bhsd"]
_LAYOUTS: tuple[str, ...] = get_args(Layout)


def _to_bshd(x: Tensor, layout: str) -> Tensor:
    """View ``x`` in ``layout`` as ``[B, S, H, D]`` (no copy)."""
    if layout == "sbhd":
        return x.transpose(0, 1)
    if layout == "bhsd":
        return x.transpose(1, 2)
    return x


def _from_bshd(x: Tensor, layout: str) -> Tensor:
    """Inverse of :func:`_to_bshd` (both transposes are involutions)."""
    return _to_bshd(x, layout)


def _check_options(
    state: object, causal: object, softmax_scale: object, layout: object, backend: object, where: str
) -> None:
    if not isinstance(state, ParallelState):
        raise ValueError(
            f"{where}: state must be a seqpar.ParallelState, got {type(state).__name__}; build one "
            "with seqpar.ParallelState(ring_size=..., ulysses_size=...)"
        )
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal must be True or False, got {causal!r}")
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
        or not math.isfinite(softmax_scale)
    ):
        raise ValueError(f"{where}: softmax_scale must be a finite float or None (D ** -0.5), got {softmax_scale!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f"{where}: unknown layout {layout!r}; valid layouts: {list(_LAYOUTS)}")
    if not isinstance(backend, (str, AttentionBackend)):
        raise ValueError(
            f"{where}: backend must be a backend name (e.g. 'auto') or an AttentionBackend, got "
            f"{type(backend).__name__}"
        )


def _check_tensors(q: object, k: object, v: object, layout: str, where: str) -> None:
    """Local checks of q, k, v in ``layout`` (before conversion)."""
    check_qkv(q, k, v, ndim=4, shape_doc=f"in layout {layout!r} ({', '.join(layout)})", where=where)
    qb, kb, vb = (_to_bshd(t, layout) for t in (q, k, v))
    (B, S, H, D), (Bk, Sk, Hkv, Dk) = qb.shape, kb.shape
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (layout {layout!r})"
    if (Bk, Sk) != (B, S) or Dk != D or vb.shape != kb.shape:
        raise ValueError(
            f"{where}: {shapes}: k and v must have q's batch size B={B}, local length S={S} and "
            f"head dim D={D}, and the same shape as each other"
        )
    if D < 1:
        raise ValueError(f"{where}: {shapes}: the head dim must be positive, got D={D}")
    check_gqa(H, Hkv, where, context=f"{shapes}: ")


def _global_length(q: Tensor, k: Tensor, state: ParallelState, seq_len: int | None, where: str) -> int:
    """The global sequence length per Note [Global length]; ``q``, ``k`` are bshd."""
    R, U, me = state.ring_size, state.ulysses_size, state.cp_rank
    local = q.shape[1]
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise ValueError(f"{where}: seq_len must be a non-negative int or None, got {seq_len!r}")
        want = shard_lengths(seq_len, R, U)
        if local != want[me]:
            raise ValueError(
                f"{where}: cp rank {me} holds {local} tokens, but seq_len={seq_len} over ring {R} x "
                f"ulysses {U} places {want[me]} there (all ranks: {want}); shard inputs with "
                "seqpar.shard(x, state, dim=<sequence dim>) or pass the right seq_len"
            )
        return seq_len
    if state.cp_size == 1:
        return local
    B, _, H, D = q.shape
    return exchange_seq_len(local, state, q.device, where, agree=("(B, H, Hkv, D)", [B, H, k.shape[2], D]))


def _attention_bshd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    *,
    seq_len: int,
    causal: bool,
    scale: float,
    backend: AttentionBackend,
) -> Tensor:
    """Ulysses over ``state.ulysses_group`` around a ring over ``state.ring_group`` (bshd)."""

    def ring(q_u: Tensor, k_u: Tensor, v_u: Tensor) -> Tensor:
        return ring_attention(
            q_u, k_u, v_u, state.ring_group, seq_len=seq_len, causal=causal, scale=scale, backend=backend
        )

    ring_len = ring_local_length(seq_len, state.ring_size, state.ring_rank)
    return ulysses_attention(q, k, v, state.ulysses_group, ring, gather_size=ring_len)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: Layout = "bshd",
    backend: str | AttentionBackend = "auto",
    seq_len: int | None = None,
) -> Tensor:
    """Exact attention over the whole sequence, computed from and returned as local shards.

    Every CP rank passes its shard of q, k, v as placed by Note [Sharding placement]
    (``seqpar.shard``): zig-zag chunks across the ring, contiguous pieces across Ulysses. The
    result is this rank's shard of full-sequence attention. Ulysses runs inside (one fused
    all-to-all for q, k, v; Note [Ulysses head placement]) and the ring across; see the module
    docstring. Differentiable; gradients follow DESIGN.md's partial-gradient convention.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)`` in ``"bshd"``, ``(seqlen_local, batch,
            nheads, headdim)`` in ``"sbhd"``, ``(batch, nheads, seqlen_local, headdim)`` in
            ``"bhsd"``; any strides.
        k, v: the same with ``nheads_kv`` heads, ``nheads % nheads_kv == 0`` (GQA/MQA).
        state: the ``ParallelState`` whose ``ulysses_group`` and ``ring_group`` are used.
        causal: causal attention in global token positions.
        softmax_scale: default ``headdim ** -0.5``.
        layout: ``"bshd"`` (flash-attn), ``"sbhd"`` (Megatron) or ``"bhsd"`` (SDPA).
        backend: a name for ``seqpar.backends.get_backend`` (``"auto"``, ``"reference"``,
            ``"cpu"``, ``"torch_flash"``, ``"flash_attn"``, ...) or an ``AttentionBackend``.
        seq_len: the global length ``S`` if known; ``None`` derives it with one small collective
            (Note [Global length]). Must be the same on every rank.

    Returns:
        This rank's output shard in ``layout``, with q's shape and dtype. With ``ulysses_size >
        1`` it is a strided view of the all-to-all's buffer (Note [All-to-all layout]): use
        ``reshape`` (or ``.contiguous()``) before merging heads with ``view``.

    Raises:
        ValueError: a non-tensor input or a non-``ParallelState`` state; q, k, v of different
            dtypes or devices, not 4-dim, or with mismatched batch/length/head dim; ``H`` not a
            multiple of ``Hkv``; an unknown layout, or a backend that is unknown or cannot run on
            these inputs; a bad ``causal``/``softmax_scale``/``seq_len``; a local length that is
            not this rank's share of the global length (``layout.shard_lengths(S, R, U)[cp_rank]``);
            ranks that disagree on the shapes (only detected when ``seq_len`` is ``None``). Checks
            on local inputs raise on the offending rank only.
    """
    where = "seqpar.attention"
    _check_options(state, causal, softmax_scale, layout, backend, where)
    _check_tensors(q, k, v, layout, where)
    if isinstance(backend, str):
        try:
            backend = get_backend(backend, q.device, q.dtype)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    qb, kb, vb = (_to_bshd(t, layout) for t in (q, k, v))
    total = _global_length(qb, kb, state, seq_len, where)
    scale = qb.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out = _attention_bshd(qb, kb, vb, state, seq_len=total, causal=causal, scale=scale, backend=backend)
    return _from_bshd(out, layout)


class SequenceParallelAttention(nn.Module):
    """``nn.Module`` form of :func:`attention` with fixed options (it has no parameters).

    Args:
        state, causal, softmax_scale, layout, backend: as in :func:`attention`.

    Raises:
        ValueError: for a non-``ParallelState`` state, an unknown layout, or bad options; backend
            names are resolved (and an unknown one rejected) on the first call, when the device
            and dtype are known.
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        causal: bool = False,
        softmax_scale: float | None = None,
        layout: Layout = "bshd",
        backend: str | AttentionBackend = "auto",
    ) -> None:
        super().__init__()
        _check_options(state, causal, softmax_scale, layout, backend, "SequenceParallelAttention")
        self.state, self.causal, self.softmax_scale = state, causal, softmax_scale
        self.layout, self.backend = layout, backend

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, seq_len: int | None = None) -> Tensor:
        """:func:`attention` of the local shards ``q, k, v`` (shapes per ``layout``)."""
        return attention(
            q,
            k,
            v,
            self.state,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            layout=self.layout,
            backend=self.backend,
            seq_len=seq_len,
        )

    def extra_repr(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else type(self.backend).__name__
        return (
            f"{self.state!r}, causal={self.causal}, softmax_scale={self.softmax_scale}, "
            f"layout={self.layout!r}, backend={backend!r}"
        )
