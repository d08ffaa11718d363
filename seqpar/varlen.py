"""Exact attention over packed variable-length sequences across hybrid (ring x Ulysses) CP.

Input is what ``shard_packed(x, state, seq_lens)`` places on a rank: ``[T_local, H, D]`` tokens of
many sequences (Note [Sharding placement]). The composition, outermost first:

1. Ulysses (``seqpar.ulysses``, Note [Ulysses head placement]): one fused all-to-all scatters the
   heads and gathers the ``U`` contiguous token pieces into the ring-local packed sequence
   ``[L_r, H_u, D]`` (every sequence's zig-zag pieces, in sequence order); the reverse all-to-all
   returns the output. Heads that do not divide ``U`` and GQA (also ``Hkv < U``) are handled there.
2. Ring (``seqpar.ring_engine``, Note [Ring engine]): K/V of the ring-local packed sequences travel
   around the ring; at each step one varlen kernel call computes the block of Note [Varlen ring
   blocks] (``seqpar.varlen_layout``) and the result is merged by its LSE in fp32. With ``R == 1``
   this is one local varlen call.

Layers: ``_forward`` / ``_backward`` (ring maths and transport, on ring-local buffers),
``_VarlenRingAttention`` (autograd), ``varlen_attention`` (public: validation, plan, Ulysses).
All index maths -- the per-step ``cu_seqlens`` -- is computed once per call from ``seq_lens``
(:class:`_RingPlan`) and copied to the device in one transfer.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .backends import AttentionBackend, get_backend
from .checks import check_gqa, check_qkv
from .comm import group_size
from .comm._group import Group, exchange_ints
from .layout import check_seq_lens
from .merge import accumulator_dtype, merge_
from .ring_engine import ring_backward, ring_forward
from .state import ParallelState
from .ulysses import ulysses_attention
from .varlen_layout import (
    local_cu_seqlens,
    local_positions,
    local_seq_ids,
    local_seq_lens,
    ring_local_lengths,
    ring_varlen_blocks,
    shard_token_counts,
    varlen_work,
)

__all__ = [
    "varlen_attention",
    "local_cu_seqlens",
    "local_positions",
    "local_seq_ids",
    "local_seq_lens",
    "varlen_work",
]


@dataclass(frozen=True)
class _Block:
    """One ring step's kernel arguments, on the device of the inputs."""

    cu_seqlens_q: Tensor  # int32 [nseg + 1]
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool


@dataclass(frozen=True)
class _RingPlan:
    """Everything ring rank ``r`` needs for every step, built once per call.

    Attributes:
        kv_lengths: ring-local token count of every ring rank (the K/V buffer lengths).
        blocks: per source ring rank, the step's :class:`_Block` or ``None`` (nothing to attend).
    """

    kv_lengths: list[int]
    blocks: list[_Block | None]

    @staticmethod
    def build(
        seq_lens: list[int], ring_size: int, ring_rank: int, causal: bool, device: torch.device
    ) -> _RingPlan:
        blocks = ring_varlen_blocks(seq_lens, ring_size, ring_rank, causal)
        # All cu_seqlens in one host tensor, one copy to the device, then views.
        segs = [s for b in blocks if b is not None for s in (b.seg_q, b.seg_k)]
        flat = None
        if segs:
            host = torch.cat([torch.cat([s.new_zeros(1), s.cumsum(0)]) for s in segs]).int()
            if device.type == "cuda":  # pinned + non_blocking: no wait for the queued kernels
                flat = host.pin_memory().to(device, non_blocking=True)
            else:
                flat = host.to(device)
        views = list(flat.split([s.numel() + 1 for s in segs])) if flat is not None else []
        out: list[_Block | None] = []
        for b in blocks:
            if b is None:
                out.append(None)
                continue
            cu_q, cu_k = views.pop(0), views.pop(0)
            out.append(_Block(cu_q, cu_k, b.max_seqlen_q, b.max_seqlen_k, b.causal))
        return _RingPlan(ring_local_lengths(seq_lens, ring_size), out)

    def kv_shapes(self, src: int, k: Tensor, v: Tensor) -> list[tuple[int, ...]]:
        """Shapes of ring rank ``src``'s ``[k, v]`` (only the token count differs from ours)."""
        return [(self.kv_lengths[src], *k.shape[1:]), (self.kv_lengths[src], *v.shape[1:])]


def _block_forward(
    backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, blk: _Block, scale: float
) -> tuple[Tensor, Tensor]:
    return backend.varlen_forward(
        q, k, v, blk.cu_seqlens_q, blk.cu_seqlens_k, blk.max_seqlen_q, blk.max_seqlen_k,
        causal=blk.causal, scale=scale,
    )


def _block_backward(
    backend: AttentionBackend,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    blk: _Block,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return backend.varlen_backward(
        dout, q, k, v, out, lse, blk.cu_seqlens_q, blk.cu_seqlens_k, blk.max_seqlen_q,
        blk.max_seqlen_k, causal=blk.causal, scale=scale,
    )


def _empty_result(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``out = 0``, ``lse = -inf`` for queries that attend nothing."""
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = torch.full(
        (q.shape[1], q.shape[0]), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device
    )
    return out, lse


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    plan: _RingPlan,
    *,
    scale: float,
    backend: AttentionBackend,
) -> tuple[Tensor, Tensor]:
    """Packed ring attention forward on ring-local buffers.

    Args:
        q: ``[L_r, H, D]`` ring-local queries (every sequence's two zig-zag pieces, in order).
        k, v: ``[L_r, Hkv, D]``.
        group: the ring group; ``plan``: from :meth:`_RingPlan.build` for this ring rank.
        scale, backend: softmax scale and kernel.

    Returns:
        ``out`` ``[L_r, H, D]`` in q's dtype and ``lse`` ``[H, L_r]`` in ``accumulator_dtype``.
    """
    if group_size(group) == 1:  # one local varlen call, nothing to merge
        blk = plan.blocks[0]
        return _empty_result(q, v) if blk is None else _block_forward(backend, q, k, v, blk, scale)

    acc_dtype = accumulator_dtype(q.dtype)
    # The first block's result is kept as computed (no zero-filled accumulator, no conversion if
    # it is the only one); the next block converts it to the accumulator dtype and merges.
    out_acc: Tensor | None = None
    lse_acc: Tensor | None = None

    def forward_step(src: int, kv: Sequence[Tensor]) -> None:
        nonlocal out_acc, lse_acc
        blk = plan.blocks[src]
        if blk is None:
            return
        out_b, lse_b = _block_forward(backend, q, kv[0], kv[1], blk, scale)
        if out_acc is None:
            out_acc, lse_acc = out_b, lse_b
            return
        out_acc, lse_acc = out_acc.to(acc_dtype), lse_acc.to(acc_dtype)  # no-ops after the first
        merge_(out_acc, lse_acc, out_b, lse_b)

    ring_forward(group, [k, v], lambda src: plan.kv_shapes(src, k, v), forward_step)
    if out_acc is None:
        return _empty_result(q, v)
    return out_acc.to(q.dtype), lse_acc


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group: Group,
    plan: _RingPlan,
    *,
    scale: float,
    backend: AttentionBackend,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed ring attention backward: the forward's steps in the same order, dK/dV sent home.

    Args:
        dout, out: ``[L_r, H, D]``; ``lse``: ``[H, L_r]`` (the merged forward results).
        q, k, v, group, plan, scale, backend: as in :func:`_forward`.

    Returns:
        ``dq, dk, dv`` shaped and typed like ``q, k, v``; dk/dv of this rank's own K/V summed
        over every ring rank's queries.
    """
    if group_size(group) == 1:
        blk = plan.blocks[0]
        if blk is None:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return _block_backward(backend, dout, q, k, v, out, lse, blk, scale)

    acc_dtype = accumulator_dtype(q.dtype)
    dq_acc: Tensor | None = None  # the first step's dQ, in the accumulator dtype, collects the rest

    def backward_step(src: int, kv: Sequence[Tensor], dkv: Sequence[Tensor]) -> None:
        nonlocal dq_acc
        blk = plan.blocks[src]
        if blk is None:
            return
        dq_b, dk_b, dv_b = _block_backward(backend, dout, q, kv[0], kv[1], out, lse, blk, scale)
        if dq_acc is None:
            dq_acc = dq_b.to(acc_dtype)
        else:
            dq_acc.add_(dq_b)
        dkv[0].add_(dk_b)
        dkv[1].add_(dv_b)

    dk, dv = ring_backward(group, [k, v], lambda src: plan.kv_shapes(src, k, v), backward_step)
    dq = torch.zeros_like(q) if dq_acc is None else dq_acc.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _VarlenRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan, scale, backend):
        out, lse = _forward(q, k, v, group, plan, scale=scale, backend=backend)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.backend = group, plan, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(
            dout, q, k, v, out, lse, ctx.group, ctx.plan, scale=ctx.scale, backend=ctx.backend
        )
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # No gradient for group, plan, scale, backend.
        return (
            dq if need_q else None,
            dk if need_k else None,
            dv if need_v else None,
            None,
            None,
            None,
            None,
        )


def _check_tensors(q: object, k: object, v: object) -> None:
    where = "varlen_attention"
    check_qkv(q, k, v, ndim=3, shape_doc="[T_local, heads, head_dim] as produced by seqpar.shard_packed", where=where)
    if k.shape != v.shape:
        raise ValueError(f"{where}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (_, h, d), (_, hkv, dk) = q.shape, k.shape
    if d != dk:
        raise ValueError(f"{where}: head dims differ: q has D={d}, k/v have D={dk}")
    check_gqa(h, hkv, where)


def _check_lengths(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, seq_lens: list[int]
) -> None:
    """Every CP rank's local token counts against the placement of ``seq_lens``.

    The counts (and ``H, Hkv, D``) are exchanged over the CP group -- one all-gather of six ints;
    on CUDA its result is read on the host, one synchronisation per call -- so that a wrong
    ``seq_lens``, which may agree with the local length of some ranks, raises the same
    ``ValueError`` on every rank instead of leaving the others waiting in a collective.
    """
    R, U = state.ring_size, state.ulysses_size
    want = shard_token_counts(seq_lens, (R, U))
    mine = [q.shape[0], k.shape[0], v.shape[0], q.shape[1], k.shape[1], q.shape[2]]
    rows = [mine] if state.cp_size == 1 else exchange_ints(mine, state.cp_group, q.device)
    dims = [row[3:] for row in rows]
    if any(d != dims[0] for d in dims):
        raise ValueError(
            f"varlen_attention: the CP ranks disagree on (H, Hkv, D): {dims} (cp_rank order); "
            "every rank must pass shards of the same tensors"
        )
    bad = [c for c, (tq, tk, tv, *_) in enumerate(rows) if not tq == tk == tv == want[c]]
    if bad:
        held = [row[0] for row in rows]
        c = bad[0]
        raise ValueError(
            f"varlen_attention: seq_lens (sum {sum(seq_lens)}, {len(seq_lens)} sequences) place "
            f"{want[c]} tokens on cp rank {c} of ring {R} x ulysses {U} (placement {want}), but "
            f"it holds q/k/v with {rows[c][:3]} tokens (q tokens per cp rank: {held}, global "
            f"total {sum(held)}); pass the global seq_lens of the packed batch and shard q, k, v "
            "with seqpar.shard_packed"
        )


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    seq_lens: Sequence[int] | Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    backend: AttentionBackend | str = "auto",
) -> Tensor:
    """Exact attention over packed variable-length sequences sharded with ``shard_packed``.

    Tokens attend only within their own sequence (block-diagonal), causally if asked. Equal to
    ``shard_packed(attention_of_each_sequence(full_q, full_k, full_v), state, seq_lens)``::

        seq_lens = [3, 2]           causal            non-causal
                          k: a a a b b         a a a b b
                      q a    x . . . .         x x x . .
                        a    x x . . .         x x x . .
                        a    x x x . .         x x x . .
                        b    . . . x .         . . . x x
                        b    . . . x x         . . . x x

    Per Note [Sharding placement] each sequence is zig-zagged over the ring on its own (no
    padding; sequences shorter than ``2R`` leave empty chunks) and the ring-local concatenation is
    split contiguously over Ulysses ranks. The Ulysses all-to-all regroups heads (``H``, ``Hkv``
    need not divide ``U``), then K/V travel around the ring with one varlen kernel call per step
    (Note [Varlen ring blocks]). Collective over ``state.cp_group``: every CP rank must call it
    with the same ``seq_lens``, ``causal`` and head counts. Besides the attention's own traffic it
    exchanges six ints over the CP group to validate the shapes on every rank (on CUDA, one host
    synchronisation per call); the per-step ``cu_seqlens`` are built on the host from
    ``seq_lens`` once per call (vectorised over sequences) and copied to the device in one
    transfer.

    Args:
        q: ``(T_local, nheads, headdim)``, this rank's packed tokens (``shard_packed``, dim 0).
        k, v: ``(T_local, nheads_kv, headdim)`` with ``nheads % nheads_kv == 0``.
        state: the parallel state.
        seq_lens: global lengths of the packed sequences (non-negative ints, list or tensor),
            summing to the global token count ``T``; the same on every CP rank.
        causal: causal attention within each sequence.
        softmax_scale: default ``headdim ** -0.5``.
        backend: an ``AttentionBackend`` or a name for ``seqpar.backends.get_backend``.

    Returns:
        ``(T_local, nheads, headdim)`` in q's dtype (with ``U > 1`` a strided view; ``reshape``
        rather than ``view`` to merge heads). Differentiable w.r.t. q, k, v; gradients are
        partial, per DESIGN.md: after backpropagating each rank's own loss share, the gradient of
        a replicated tensor is the sum over the CP group.

    Raises:
        ValueError: non-3-dim tensors, mismatched dtypes/devices/head dims, ``nheads`` not a
            multiple of ``nheads_kv``, negative or non-int lengths, ``seq_lens`` that do not
            place exactly each CP rank's token count there (e.g. a wrong total) or CP ranks
            that disagree on ``(H, Hkv, D)`` (both raised on every CP rank), a non-bool
            ``causal``, a bad scale or backend.
    """
    where = "varlen_attention"
    _check_tensors(q, k, v)
    if not isinstance(state, ParallelState):
        raise ValueError(f"{where}: state must be a seqpar.ParallelState, got {type(state).__name__}")
    try:
        lens = check_seq_lens(seq_lens)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal must be True or False, got {causal!r}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise ValueError(f"{where}: softmax_scale must be a float or None, got {softmax_scale!r}")
    if isinstance(backend, str):
        backend = get_backend(backend, q.device, q.dtype)
    elif not isinstance(backend, AttentionBackend):
        raise ValueError(
            f"{where}: backend must be a name or an AttentionBackend, got {type(backend).__name__}"
        )
    # Host-side planning first, so that it overlaps kernels still queued on an accelerator; the
    # length check's collective then reads its result on the host.
    plan = _RingPlan.build(lens, state.ring_size, state.ring_rank, causal, q.device)
    _check_lengths(q, k, v, state, lens)

    group = state.ring_group
    scale = float(softmax_scale)

    def ring(q_r: Tensor, k_r: Tensor, v_r: Tensor) -> Tensor:
        return _VarlenRingAttention.apply(q_r, k_r, v_r, group, plan, scale, backend)

    if state.ulysses_size == 1:
        return ring(q, k, v)

    # Views in and out of the batch dim of one (squeeze, not indexing: its backward is a view
    # too, where ``x[0]`` would allocate a zero tensor and copy the gradient into it).
    def inner(q_u: Tensor, k_u: Tensor, v_u: Tensor) -> Tensor:  # [1, L_r, H_u, D]
        return ring(q_u.squeeze(0), k_u.squeeze(0), v_u.squeeze(0)).unsqueeze(0)

    out = ulysses_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), state.ulysses_group, inner,
        gather_size=plan.kv_lengths[state.ring_rank],
    )
    return out.squeeze(0)
