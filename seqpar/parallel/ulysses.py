"""Ulysses: all-to-all from sequence shards to head shards around an inner attention.

Head placement: Note [Ulysses head placement] in ``seqpar/placement/heads.py``.

q, k and v travel in one fused all-to-all. When v's head dim differs from q's, the head and
head-dim axes are flattened so the three still share every dim but the scattered one (a copy
only when those two axes are not adjacent in memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_gqa, check_qkv
from ..comm import (
    Group,
    Workspace,
    all_to_all_many,
    check_group,
    exchange_ints,
    fused_all_to_all,
    fused_all_to_all_backward,
    group_rank,
    group_size,
    refuse_double_backward,
)
from ..placement.heads import HeadAssignment, all_heads, cached_head_assignments, head_assignments
from ..placement.sizes import offsets, split_sizes
from .merge import accumulator_dtype
from .ring import RingRun, ring_attention, ring_backward, ring_forward

__all__ = [
    "HeadAssignment", "head_assignments", "ulysses_attention", "InnerAttention", "UlyssesSpec",
    "ulysses_ring_attention", "ulysses_ring_forward", "ulysses_ring_backward",
]


InnerAttention = Callable[[Tensor, Tensor, Tensor, HeadAssignment], Tensor]
"""``inner(q, k, v, heads) -> out`` on ``[B, S, H_u, D]``, ``[B, S, Hkv_u, D]``, ``[B, S, Hkv_u, Dv]``
with ``H_u % Hkv_u == 0`` and this rank's :class:`HeadAssignment`; returns ``[B, S, H_u, Dv]``."""


def _exchange_qkv(
    q: Tensor, k: Tensor, v: Tensor, group: Group, plan: list[HeadAssignment], gather_sizes: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """One fused all-to-all: heads scattered per ``plan``, tokens gathered."""
    q_ranges = [(a.q_start, a.q_len) for a in plan]
    kv_ranges = [(a.kv_start, a.kv_len) for a in plan]
    if v.shape[-1] == q.shape[-1]:
        q_u, k_u, v_u = all_to_all_many(
            [q, k, v], group, scatter_dim=2, gather_dim=1, gather_size=gather_sizes,
            scatter_ranges=[q_ranges, kv_ranges, kv_ranges],
        )
        return q_u, k_u, v_u
    # v's head dim differs: scatter over the flattened (heads, head_dim) axis instead.
    D, Dv = q.shape[-1], v.shape[-1]

    def scale(ranges: list[tuple[int, int]], d: int) -> list[tuple[int, int]]:
        return [(a * d, n * d) for a, n in ranges]

    q_u, k_u, v_u = all_to_all_many(
        [q.flatten(2), k.flatten(2), v.flatten(2)], group, scatter_dim=2, gather_dim=1,
        gather_size=gather_sizes, scatter_ranges=[scale(q_ranges, D), scale(kv_ranges, D), scale(kv_ranges, Dv)],
    )
    return q_u.unflatten(2, (-1, D)), k_u.unflatten(2, (-1, D)), v_u.unflatten(2, (-1, Dv))


def run_ulysses(
    q: Tensor, k: Tensor, v: Tensor, group: Group, inner: InnerAttention, token_sizes: Sequence[int]
) -> Tensor:
    """Trusted Ulysses (inputs validated by the caller): see :func:`ulysses_attention`.

    Args:
        token_sizes: every rank's local token count, in group rank order.
    """
    n = group_size(group)
    if n == 1:
        return inner(q, k, v, all_heads(q.shape[2], k.shape[2]))
    plan = head_assignments(q.shape[2], k.shape[2], n)
    mine = plan[group_rank(group)]
    token_sizes = list(token_sizes)
    q_u, k_u, v_u = _exchange_qkv(q, k, v, group, plan, token_sizes)
    if mine.q_len == 0:
        # No heads here: keep every received tensor in the graph so this rank's backward joins
        # the reverse all-to-all like the others.
        out = v_u + 0 * (q_u.sum() + k_u.sum())
    else:
        if mine.kv_index is not None:
            index = torch.tensor(mine.kv_index, dtype=torch.long, device=k_u.device)
            k_u, v_u = k_u.index_select(2, index), v_u.index_select(2, index)
        out = inner(q_u, k_u, v_u, mine)
    ranges = list(zip(offsets(token_sizes)[:-1], token_sizes))
    return all_to_all_many([out], group, scatter_dim=1, gather_dim=2, gather_size=q.shape[2], scatter_ranges=[ranges])[0]


def _check_inputs(q: object, k: object, v: object) -> None:
    where = "ulysses_attention"
    check_qkv(q, k, v, ndim=4, shape_doc="[B, S_local, heads, head_dim]", where=where)
    B, S, H, D = q.shape
    if k.shape[:2] != (B, S) or v.shape[:3] != k.shape[:3] or k.shape[3] != D:
        raise ValueError(
            f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
            "[B, S, H, D], [B, S, Hkv, D], [B, S, Hkv, Dv]"
        )
    check_gqa(H, k.shape[2], where)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    inner: InnerAttention,
    *,
    gather_size: int | None = None,
) -> Tensor:
    """Attention over the group's whole sequence, computed per head shard (Ulysses).

    Every rank holds a contiguous piece of one sequence (rank ``i`` holds piece ``i`` of
    ``split_sizes(S, U)``, or any sizes with ``gather_size=None``). The heads are redistributed
    per Note [Ulysses head placement] with one fused all-to-all, ``inner`` runs on all ``S``
    tokens of this rank's heads, and a second all-to-all returns the output to the token shards.
    Differentiable; with ``U == 1`` it is ``inner(q, k, v, all heads)``.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, this rank's tokens of every head.
        k: ``(batch, seqlen_local, nheads_kv, headdim)`` with ``nheads % nheads_kv == 0``.
        v: ``(batch, seqlen_local, nheads_kv, headdim_v)``.
        group: the Ulysses process group (``U`` ranks).
        inner: attention on the gathered sequence, see :data:`InnerAttention`; it is called
            with ``(batch, S, H_u, headdim)`` queries, a uniform GQA ratio and this rank's
            :class:`HeadAssignment`, and not at all on a rank with no query head (``H < U``) --
            all ranks sharing a Ulysses rank index skip it together, so an inner ring over them
            stays in step.
        gather_size: ``S``, the total tokens over the group; rank ``i`` must then hold
            ``split_sizes(S, U)[i]``. ``None`` exchanges the lengths (one small collective).

    Returns:
        ``(batch, seqlen_local, nheads, headdim_v)`` in q's dtype; a strided view of the
        all-to-all's receive buffer (see Note [All-to-all layout]), so use ``reshape`` rather
        than ``view`` to merge its head dims.

    Raises:
        ValueError: non-tensors, shapes that are not ``[B, S, H, D] / [B, S, Hkv, D] /
            [B, S, Hkv, Dv]``, ``H % Hkv != 0``, a bad group, or a local length that disagrees
            with ``gather_size``.
    """
    _check_inputs(q, k, v)
    check_group(group, "ulysses_attention")
    n, me = group_size(group), group_rank(group)
    if gather_size is None:
        sizes = [row[0] for row in exchange_ints([q.shape[1]], group, q.device)] if n > 1 else [q.shape[1]]
    else:
        sizes = split_sizes(gather_size, n)
        if sizes[me] != q.shape[1]:
            raise ValueError(
                f"ulysses_attention: gather_size={gather_size} over {n} ranks gives rank {me} "
                f"{sizes[me]} tokens (split {sizes}), but q has {q.shape[1]}"
            )
    return run_ulysses(q, k, v, group, inner, sizes)


# ---------------------------------------------------------------------------------------------
# Ulysses around the ring as one autograd function (the path seqpar.attention takes).
#
# Note [Ulysses memory]
# ~~~~~~~~~~~~~~~~~~~~~
# Composing the two all-to-alls and the ring with autograd saves the head-sharded q, k, v and
# output of every layer for its backward: 2.5 extra copies of a layer's activations (H == Hkv)
# kept alive until that layer's backward. Here only the token shard's q, k, v (the inputs, alive
# anyway), its output and the ring's LSE are saved; the backward repeats the all-to-all of q, k, v
# together with out and dout (one fused collective) into workspace buffers, runs the ring's
# backward and sends the gradients back. Backward traffic grows from (dout + grads) to (q, k, v,
# out, dout + grads); saved activations shrink to what a single device keeps.


@dataclass(frozen=True, eq=False)
class UlyssesSpec:
    """The Ulysses half of a call: group, every rank's token count and head assignment."""

    group: Group
    token_sizes: tuple[int, ...]
    heads: tuple[HeadAssignment, ...]
    rank: int
    workspace: Workspace | None

    @staticmethod
    def build(group: Group, token_sizes, num_heads: int, num_kv_heads: int, workspace) -> UlyssesSpec:
        n = group_size(group)
        return UlyssesSpec(
            group, tuple(token_sizes), cached_head_assignments(num_heads, num_kv_heads, n), group_rank(group),
            workspace,
        )

    @property
    def mine(self) -> HeadAssignment:
        return self.heads[self.rank]

    def head_ranges(self, kind: str) -> list[tuple[int, int]]:
        if kind == "q":
            return [(a.q_start, a.q_len) for a in self.heads]
        return [(a.kv_start, a.kv_len) for a in self.heads]

    def to_heads(self, xs: list[Tensor], kinds: str, role: str) -> list[Tensor]:
        """Token shards with all heads -> all tokens of this rank's heads (workspace buffers)."""
        ranges = [self.head_ranges(kind) for kind in kinds]
        return fused_all_to_all(
            xs, self.group, 2, 1, ranges, self.token_sizes, workspace=self.workspace, out_role=role
        )

    def to_tokens(self, xs: list[Tensor], num_heads: int) -> Tensor:
        """All tokens of this rank's heads -> the token shard with all heads (a fresh tensor).

        ``xs`` holds the one input; it is emptied once staged, so the caller's last reference
        can go before the output is allocated.
        """
        ranges = [list(zip(offsets(self.token_sizes)[:-1], self.token_sizes))]
        return fused_all_to_all(xs, self.group, 1, 2, ranges, split_sizes(num_heads, len(self.heads)),
                                workspace=self.workspace, release_inputs=True)[0]

    def grads_to_tokens(self, grads: list[Tensor], shapes: list[torch.Size], kinds: str) -> list[Tensor]:
        """Backward of :meth:`to_heads`: gradients of the token shards (K/V heads sent to several
        ranks get the sum). ``grads`` is emptied once staged."""
        ranges = [self.head_ranges(kind) for kind in kinds]
        # The head-sharded inputs are dead by now: their buffer receives the gradients.
        return fused_all_to_all_backward(
            grads, shapes, self.group, 2, 1, ranges, self.token_sizes, workspace=self.workspace,
            release_inputs=True, recv_role="ulysses.heads",
        )


def _expand(heads: HeadAssignment, x: Tensor) -> Tensor:
    if heads.kv_index is None:
        return x
    return x.index_select(2, torch.tensor(heads.kv_index, dtype=torch.long, device=x.device))


def _unexpand(heads: HeadAssignment, grad: Tensor) -> Tensor:
    """Gradient of :func:`_expand`: sum the expanded heads back onto the received ones."""
    if heads.kv_index is None:
        return grad
    index = torch.tensor(heads.kv_index, dtype=torch.long, device=grad.device)
    out = grad.new_zeros((*grad.shape[:2], heads.kv_len, *grad.shape[3:]))
    return out.index_add_(2, index, grad)


def _place(heads: HeadAssignment, grad: Tensor | None, like: Tensor | None, kind: str, dim: int) -> Tensor | None:
    """This rank's head slice of a replicated tensor's gradient, in zeros of the full shape."""
    if grad is None or like is None:
        return None
    full = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    if kind == "q":
        full.narrow(dim, heads.q_start, heads.q_len).copy_(grad)
    elif heads.kv_len:
        part = grad.movedim(dim, 2) if dim != 2 else grad
        part = _unexpand(heads, part)
        full.narrow(dim, heads.kv_start, heads.kv_len).copy_(part.movedim(2, dim) if dim != 2 else part)
    return full


def ulysses_ring_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None, extra_v: Tensor | None,
    spec: UlyssesSpec, run: RingRun,
) -> tuple[Tensor, Tensor]:
    """``(out, lse_u)`` of :func:`ulysses_ring_attention` (no autograd): ``out`` the token shard,
    ``lse_u`` ``[B, H_mine, L]`` over this rank's heads and the ring-local tokens."""
    mine = spec.mine
    q_u, k_u, v_u = spec.to_heads([q, k, v], "qkk", "ulysses.heads")
    if mine.q_len:
        out_u, lse_u = ring_forward(
            q_u, _expand(mine, k_u), _expand(mine, v_u),
            None if sinks is None else mine.q_heads(sinks, 0),
            None if extra_k is None else mine.kv_heads(extra_k, 2),
            None if extra_v is None else mine.kv_heads(extra_v, 2), run,
        )
    else:  # no head here: nothing to attend, but the all-to-alls still need this rank
        out_u = q_u.new_zeros(q_u.shape)
        lse_u = q_u.new_zeros((q_u.shape[0], 0, q_u.shape[1]), dtype=accumulator_dtype(q.dtype))
    del q_u, k_u, v_u
    staged = [out_u]
    del out_u
    return spec.to_tokens(staged, q.shape[2]), lse_u


def ulysses_ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, out: Tensor, lse_u: Tensor, spec: UlyssesSpec, run: RingRun,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``(dq, dk, dv, dsinks, dextra_k, dextra_v)`` from :func:`ulysses_ring_forward`'s
    ``out`` and ``lse_u``."""
    mine = spec.mine
    q_u, k_u, v_u, out_u, dout_u = spec.to_heads([q, k, v, out, dout], "qkkqq", "ulysses.heads")
    dsinks = dek = dev = None
    if mine.q_len:
        s = None if sinks is None else mine.q_heads(sinks, 0)
        ek = None if extra_k is None else mine.kv_heads(extra_k, 2)
        ev = None if extra_v is None else mine.kv_heads(extra_v, 2)
        dq_u, dk_u, dv_u, ds, d_ek, d_ev = ring_backward(
            dout_u, q_u, _expand(mine, k_u), _expand(mine, v_u), s, ek, ev, out_u, lse_u, run
        )
        dk_u, dv_u = _unexpand(mine, dk_u), _unexpand(mine, dv_u)
        dsinks = _place(mine, ds, sinks, "q", 0)
        dek, dev = _place(mine, d_ek, extra_k, "kv", 2), _place(mine, d_ev, extra_v, "kv", 2)
    else:
        dq_u, dk_u, dv_u = torch.zeros_like(q_u), torch.zeros_like(k_u), torch.zeros_like(v_u)
    staged = [dq_u, dk_u, dv_u]
    del dq_u, dk_u, dv_u, q_u, k_u, v_u, out_u, dout_u
    dq, dk, dv = spec.grads_to_tokens(staged, [q.shape, k.shape, v.shape], "qkk")
    return dq, dk, dv, dsinks, dek, dev


class _UlyssesRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, extra_k, extra_v, spec, run):
        out, lse_u = ulysses_ring_forward(q, k, v, sinks, extra_k, extra_v, spec, run)
        ctx.save_for_backward(q, k, v, out, lse_u, sinks, extra_k, extra_v)
        ctx.spec, ctx.run = spec, run
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward("seqpar attention")
        q, k, v, out, lse_u, sinks, extra_k, extra_v = ctx.saved_tensors
        grads = ulysses_ring_backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse_u, ctx.spec, ctx.run)
        # No gradient for spec, run.
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None)


def ulysses_ring_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: UlyssesSpec, run: RingRun, *, sinks: Tensor | None = None,
    extra_k: Tensor | None = None, extra_v: Tensor | None = None,
) -> Tensor:
    """Ulysses around the ring (Note [Ulysses memory]); trusted entry, validated by the caller.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, this rank's token shard.
        k, v: ``(batch, seqlen_local, nheads_kv, headdim)``.
        spec: the Ulysses group and layout; run: the ring of this rank's heads.
        sinks: ``(nheads,)``; extra_k, extra_v: ``(batch, P, nheads_kv, headdim)`` replicated keys.

    Returns:
        ``(batch, seqlen_local, nheads, headdim)`` in q's dtype.
    """
    if group_size(spec.group) == 1:
        return ring_attention(q, k, v, run, sinks=sinks, extra_k=extra_k, extra_v=extra_v)
    return _UlyssesRing.apply(q, k, v, sinks, extra_k, extra_v, spec, run)
