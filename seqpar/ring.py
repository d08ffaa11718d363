"""Load-balanced zig-zag ring attention over dense ``[B, S, H, D]`` sequences.

Each ring rank keeps its queries; K/V travel around the ring (``seqpar.ring_engine``, Note [Ring
engine]) and the partial results are merged by their log-sum-exp in fp32. Layers: ``_forward`` /
``_backward`` (maths and communication), ``_RingAttention`` (autograd), ``ring_attention`` (public,
validates its inputs).

Note [Zig-zag causal blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Ring rank ``r`` holds chunks ``r`` and ``2R-1-r`` of ``split_sizes(S, 2R)`` (Note [Sharding
placement]); its local positions increase, so the causal mask restricted to its own K/V is the
ordinary causal mask of the local sequence. With K/V from ring rank ``j``, the chunk order decides
everything (``r < j`` implies ``r < j < 2R-1-j < 2R-1-r``)::

    R = 2, chunks c0..c3        rank 0 holds c0|c3, rank 1 holds c1|c2
                                (\\ = causal diagonal block, x = full block, . = nothing)
              k: c0 c1 c2 c3
        q c0     \\  .  .  .      rank 0, own K/V (c0|c3): causal over [c0; c3]
          c1     x  \\  .  .      rank 0, K/V of rank 1 (j > r): only c3 attends, to all of c1|c2
          c2     x  x  \\  .      rank 1, own K/V (c1|c2): causal over [c1; c2]
          c3     x  x  x  \\      rank 1, K/V of rank 0 (j < r): c1|c2 attend the first chunk c0

- ``j == r``: causal, all local queries against all local keys;
- ``j < r``: all local queries against the *first* chunk of ``j``, no mask;
- ``j > r``: the *second* local query chunk against all of ``j``'s K/V, no mask.

Every rank then attends about the same number of (query, key) pairs (``zigzag_work``). Without a
causal mask every step is one full block. Blocks with no query or no key row are skipped.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .backends import AttentionBackend, get_backend
from .checks import check_gqa, check_qkv
from .comm import group_rank, group_size
from .comm._group import Group, check_group
from .layout import ring_local_length, split_sizes, zigzag_chunk_ranges
from .merge import accumulator_dtype, merge_, new_accumulators
from .ring_engine import ring_backward, ring_forward

__all__ = ["ring_attention", "zigzag_work"]


def zigzag_work(seq_len: int, ring_size: int, causal: bool) -> list[int]:
    """Attended (query, key) pairs of each ring rank under the zig-zag placement (no communication).

    Args:
        seq_len: global sequence length ``S``.
        ring_size: ``R``.
        causal: count only keys at or before their query.

    Returns:
        ``R`` ints; entry ``r`` counts the pairs of ring rank ``r``'s queries. They sum to
        ``S * (S + 1) // 2`` (causal) or ``S * S``.

    Raises:
        ValueError: if ``seq_len < 0`` or ``ring_size < 1``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"zigzag_work: seq_len must be a non-negative int, got {seq_len!r}")
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"zigzag_work: ring_size must be a positive int, got {ring_size!r}")
    work = []
    for r in range(ring_size):
        total = 0
        for a, b in zigzag_chunk_ranges(seq_len, ring_size, r):
            # a query at position p sees p + 1 keys: sum_{p=a}^{b-1} (p + 1)
            total += (b * (b + 1) - a * (a + 1)) // 2 if causal else (b - a) * seq_len
        work.append(total)
    return work


class _ZigzagPlan:
    """Which rows meet in each ring step (Note [Zig-zag causal blocks]).

    Args:
        seq_len: global length ``S``.
        ring_size, ring_rank: ``R`` and this rank's ``r``.
        causal: causal attention.
        kv_shape: this rank's K/V shape ``[B, S_r, Hkv, D]`` (other ranks differ only in ``S_j``).
    """

    def __init__(
        self, seq_len: int, ring_size: int, ring_rank: int, causal: bool, kv_shape: torch.Size
    ) -> None:
        self.ring_size, self.ring_rank, self.causal = ring_size, ring_rank, causal
        self.kv_shape = tuple(kv_shape)
        if ring_size == 1:
            self.chunks = [(seq_len, 0)]
        else:
            sizes = split_sizes(seq_len, 2 * ring_size)
            self.chunks = [(sizes[j], sizes[2 * ring_size - 1 - j]) for j in range(ring_size)]

    def kv_shapes(self, src: int) -> list[tuple[int, ...]]:
        """Shapes of ring rank ``src``'s ``[k, v]``."""
        b, _, hkv, d = self.kv_shape
        shape = (b, sum(self.chunks[src]), hkv, d)
        return [shape, shape]

    def block(self, src: int) -> tuple[slice, slice, bool] | None:
        """``(query rows, key rows of src, causal)`` of the step with ``src``'s K/V, or ``None``."""
        first, second = self.chunks[self.ring_rank]
        n_q = first + second
        n_k = sum(self.chunks[src])
        if not self.causal:
            rows, cols, causal = slice(0, n_q), slice(0, n_k), False
        elif src == self.ring_rank:
            rows, cols, causal = slice(0, n_q), slice(0, n_k), True
        elif src < self.ring_rank:
            rows, cols, causal = slice(0, n_q), slice(0, self.chunks[src][0]), False
        else:
            rows, cols, causal = slice(first, n_q), slice(0, n_k), False
        if rows.stop == rows.start or cols.stop == cols.start:
            return None
        return rows, cols, causal


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    *,
    seq_len: int,
    causal: bool,
    scale: float,
    backend: AttentionBackend,
    trace: list | None = None,
) -> tuple[Tensor, Tensor]:
    """Zig-zag ring attention forward.

    Args:
        q: ``[B, S_r, H, D]`` ring-local queries.
        k, v: ``[B, S_r, Hkv, D]`` ring-local keys/values.
        group: the ring group; seq_len, causal, scale, backend: as in :func:`ring_attention`.
        trace: event list for tests (Note [Ring engine]).

    Returns:
        ``out`` ``[B, S_r, H, D]`` in q's dtype and the merged ``lse`` ``[B, H, S_r]`` in
        ``accumulator_dtype(q.dtype)``.
    """
    size, rank = group_size(group), group_rank(group)
    acc = accumulator_dtype(q.dtype)
    if size == 1:  # plain local attention: one block, nothing to merge
        if q.shape[1] == 0:
            lse = torch.empty((q.shape[0], q.shape[2], 0), dtype=acc, device=q.device)
            return torch.zeros_like(q, memory_format=torch.contiguous_format), lse
        out, lse = backend.forward(q, k, v, causal=causal, scale=scale)
        return out, lse.to(acc)

    plan = _ZigzagPlan(seq_len, size, rank, causal, k.shape)
    out_acc, lse_acc = new_accumulators(q.shape, device=q.device, dtype=q.dtype)

    def forward_step(src: int, kv: list[Tensor]) -> None:
        block = plan.block(src)
        if block is None:
            return
        rows, cols, block_causal = block
        k_src, v_src = kv
        out_blk, lse_blk = backend.forward(
            q[:, rows], k_src[:, cols], v_src[:, cols], causal=block_causal, scale=scale
        )
        merge_(out_acc[:, rows], lse_acc[:, :, rows], out_blk, lse_blk)

    ring_forward(group, [k, v], plan.kv_shapes, forward_step, trace=trace)
    return out_acc.to(q.dtype), lse_acc


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group: Group,
    *,
    seq_len: int,
    causal: bool,
    scale: float,
    backend: AttentionBackend,
    trace: list | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Zig-zag ring attention backward: the forward's ring in reverse, dK/dV travelling home.

    Args:
        dout: ``[B, S_r, H, D]`` gradient of ``out``.
        q, k, v: the forward's inputs.
        out, lse: the forward's (global, merged) ``out`` ``[B, S_r, H, D]`` and ``lse``
            ``[B, H, S_r]``.
        group, seq_len, causal, scale, backend, trace: as in :func:`_forward`.

    Returns:
        ``dq, dk, dv`` shaped and typed like ``q, k, v``; ``dk``/``dv`` are the gradients of this
        rank's own K/V summed over every rank's queries.
    """
    size, rank = group_size(group), group_rank(group)
    if size == 1:
        if q.shape[1] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return backend.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)

    plan = _ZigzagPlan(seq_len, size, rank, causal, k.shape)
    dq_acc = torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)

    def backward_step(src: int, kv: list[Tensor], dkv: list[Tensor]) -> None:
        block = plan.block(src)
        if block is None:
            return
        rows, cols, block_causal = block
        k_src, v_src = kv
        dq_blk, dk_blk, dv_blk = backend.backward(
            dout[:, rows],
            q[:, rows],
            k_src[:, cols],
            v_src[:, cols],
            out[:, rows],
            lse[:, :, rows],
            causal=block_causal,
            scale=scale,
        )
        dq_acc[:, rows] += dq_blk
        dkv[0][:, cols] += dk_blk
        dkv[1][:, cols] += dv_blk

    dk_acc, dv_acc = ring_backward(group, [k, v], plan.kv_shapes, backward_step, trace=trace)
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, seq_len, causal, scale, backend):
        out, lse = _forward(
            q, k, v, group, seq_len=seq_len, causal=causal, scale=scale, backend=backend
        )
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.seq_len, ctx.causal = group, seq_len, causal
        ctx.scale, ctx.backend = scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            ctx.group,
            seq_len=ctx.seq_len,
            causal=ctx.causal,
            scale=ctx.scale,
            backend=ctx.backend,
        )
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # No gradient for group, seq_len, causal, scale, backend.
        return (
            dq if need_q else None,
            dk if need_k else None,
            dv if need_v else None,
            None,
            None,
            None,
            None,
            None,
        )


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, seq_len: object, ring_size: int, ring_rank: int
) -> None:
    """Raise ``ValueError`` for inputs ``ring_attention`` cannot take (see its docstring)."""
    where = "ring_attention"
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(
            f"{where}: seq_len must be the global sequence length as a non-negative int, got "
            f"{seq_len!r}"
        )
    check_qkv(
        q,
        k,
        v,
        ndim=4,
        shape_doc="[B, S, H, D] (bshd; convert other layouts first, e.g. q.transpose(1, 2) for bhsd)",
        where=where,
    )
    if k.shape != v.shape:
        raise ValueError(f"{where}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (b, s, h, d), (bk, sk, hkv, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"{where}: batch sizes differ: q has B={b}, k/v have B={bk}")
    if d != dk:
        raise ValueError(f"{where}: head dims differ: q has D={d}, k/v have D={dk}")
    check_gqa(h, hkv, where)
    expected = ring_local_length(seq_len, ring_size, ring_rank)
    if s != expected or sk != expected:
        raise ValueError(
            f"{where}: ring rank {ring_rank} of {ring_size} holds {expected} of the seq_len="
            f"{seq_len} tokens (chunks {zigzag_chunk_ranges(seq_len, ring_size, ring_rank)} of "
            f"the zig-zag split), but q has S={s} and k/v have S={sk}; shard with "
            "seqpar.shard or pass the global seq_len"
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    *,
    seq_len: int,
    causal: bool = False,
    scale: float | None = None,
    backend: AttentionBackend | str = "auto",
) -> Tensor:
    """Exact attention of ring-local queries over the whole zig-zag-sharded sequence.

    Ring rank ``r`` (its rank in ``group``) holds chunks ``r`` and ``2R-1-r`` of
    ``split_sizes(seq_len, 2R)``, concatenated (Note [Sharding placement]); with ``R == 1`` the
    whole sequence and no communication. K/V travel around the ring, each transfer overlapping
    the previous block's compute (Note [Ring engine], Note [Zig-zag causal blocks]).

    Args:
        q: ``(batch, seqlen_r, nheads, headdim)``, this ring rank's queries (views allowed).
        k, v: ``(batch, seqlen_r, nheads_kv, headdim)``; ``nheads % nheads_kv == 0``.
        group: the ring process group (rank order = ring order); ``None``: the default group, or
            one process without ``torch.distributed``. Every rank of it must call this.
        seq_len: the global sequence length ``S``; ``seqlen_r == ring_local_length(S, R, r)``.
        causal: causal attention in global positions.
        scale: softmax scale, default ``headdim ** -0.5``.
        backend: an ``AttentionBackend`` or a name for ``seqpar.backends.get_backend``.

    Returns:
        ``(batch, seqlen_r, nheads, headdim)`` in q's dtype. Differentiable w.r.t. q, k, v; the
        gradients of k/v are those of this rank's own K/V over all ranks' queries.

    Raises:
        ValueError: if a tensor is not 4-dim, dtypes/devices/batch/head dims differ, ``nheads``
            is not a multiple of ``nheads_kv``, ``seq_len`` is not a non-negative int, the local
            length is not this rank's zig-zag length, or the group/backend is not valid.
    """
    check_group(group, "ring_attention")
    size, rank = group_size(group), group_rank(group)
    _check_inputs(q, k, v, seq_len, size, rank)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"ring_attention: scale must be a float or None, got {scale!r}")
    if isinstance(backend, str):
        backend = get_backend(backend, q.device, q.dtype)
    elif not isinstance(backend, AttentionBackend):
        raise ValueError(
            f"ring_attention: backend must be a name or an AttentionBackend, got "
            f"{type(backend).__name__}"
        )
    return _RingAttention.apply(q, k, v, group, seq_len, causal, float(scale), backend)
