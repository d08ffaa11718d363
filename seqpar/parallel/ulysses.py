"""Ulysses: all-to-all from sequence shards to head shards around an inner attention.

Head placement: Note [Ulysses head placement] in ``seqpar/placement/heads.py``.

q, k and v travel in one fused all-to-all (:class:`UlyssesSetup`, the one description of an
exchange: who sends which heads and tokens). ``ulysses_ring_forward`` / ``ulysses_ring_backward``
are the plain functions ``seqpar.attention`` runs (through ``seqpar.parallel.hybrid``);
:func:`ulysses_attention` is the same exchange around any differentiable attention.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

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
)
from ..placement.heads import HeadAssignment, all_heads, cached_head_assignments, head_assignments
from ..placement.sizes import offsets, split_sizes
from .merge import accumulator_dtype
from .allgather import AllGatherSetup, kv_backward, kv_forward
from .ring import Extra, RingSetup

# head_assignments / HeadAssignment live in seqpar.placement.heads; re-exported under their old path.
__all__ = [
    "ulysses_attention", "InnerAttention", "UlyssesSetup", "ulysses_ring_forward", "ulysses_ring_backward",
    "HeadAssignment", "head_assignments", "heads_forward", "heads_backward", "Saved", "DoutExchanged",
]


InnerAttention = Callable[[Tensor, Tensor, Tensor, HeadAssignment], Tensor]
"""``inner(q, k, v, heads) -> out`` on ``[B, S, H_u, D]``, ``[B, S, Hkv_u, D]``, ``[B, S, Hkv_u, Dv]``
with ``H_u % Hkv_u == 0`` and this rank's :class:`HeadAssignment`; returns ``[B, S, H_u, Dv]``."""


@dataclass(frozen=True, eq=False)
class UlyssesSetup:
    """The Ulysses half of a call: group, every rank's token count and head assignment."""

    group: Group
    token_sizes: tuple[int, ...]
    heads: tuple[HeadAssignment, ...]
    rank: int
    workspace: Workspace | None
    keep_head_shards: bool = False

    @staticmethod
    def build(
        group: Group, token_sizes: Sequence[int], num_heads: int, num_kv_heads: int, workspace: Workspace | None,
        keep_head_shards: bool = False,
    ) -> UlyssesSetup:
        n = group_size(group)
        return UlyssesSetup(
            group, tuple(token_sizes), cached_head_assignments(num_heads, num_kv_heads, n), group_rank(group),
            workspace, keep_head_shards,
        )

    @property
    def mine(self) -> HeadAssignment:
        return self.heads[self.rank]

    def head_ranges(self, kind: str) -> list[tuple[int, int]]:
        """``(start, count)`` of the query (``kind="q"``) or K/V heads every rank receives."""
        if kind == "q":
            return [(a.q_start, a.q_len) for a in self.heads]
        return [(a.kv_start, a.kv_len) for a in self.heads]

    def token_ranges(self) -> list[tuple[int, int]]:
        """``(start, count)`` of every rank's tokens in the gathered sequence."""
        return list(zip(offsets(self.token_sizes)[:-1], self.token_sizes))

    def to_heads(self, xs: list[Tensor], kinds: str, role: str) -> list[Tensor]:
        """Token shards with all heads -> all tokens of this rank's heads (workspace buffers).

        ``xs[t]`` is ``[B, S_local, heads, d_t]`` with the query (``kinds[t] == "q"``) or K/V
        heads (``"k"``); returns ``[B, S_ring_local, heads_mine, d_t]`` each. The head dims
        ``d_t`` may differ (v and out with ``Dv != D``: MLA); the exchange then runs over the
        flattened ``(heads, head_dim)`` axis (:func:`_flat_heads`), one collective as before.
        """
        ranges = [self.head_ranges(kind) for kind in kinds]
        dims = [x.shape[-1] for x in xs]
        if len(set(dims)) == 1:
            return fused_all_to_all(
                xs, self.group, 2, 1, ranges, self.token_sizes, workspace=self.workspace, out_role=role
            )
        flat = _flat_heads(xs)  # copies only of shards whose (heads, head_dim) are not one axis
        outs = fused_all_to_all(
            flat, self.group, 2, 1, _flat_ranges(ranges, dims), self.token_sizes, workspace=self.workspace,
            out_role=role, release_inputs=True,
        )
        return [o.unflatten(2, (-1, d)) for o, d in zip(outs, dims)]

    def to_heads_each(self, xs: list[Tensor], kinds: str, *, kept: bool = False) -> list[Tensor]:
        """:meth:`to_heads` one tensor at a time (Note [Ulysses memory]): each result is a
        contiguous tensor of its own (for ``B == 1``; else a strided one), and only one tensor's
        staging copy is alive at a time. ``xs`` is emptied as it is staged. ``kept``: the
        results outlive the call (saved for the backward), so they are never workspace buffers."""
        outs = []
        for kind in kinds:
            x = xs.pop(0)
            d = x.shape[-1]
            outs.append(fused_all_to_all(
                [x.flatten(2)], self.group, 2, 1, _flat_ranges([self.head_ranges(kind)], [d]), self.token_sizes,
                workspace=self.workspace, out_role=None if kept else f"ulysses.{len(outs)}",
            )[0].unflatten(2, (-1, d)))
            del x
        return outs

    def to_tokens(self, xs: list[Tensor], num_heads: int) -> Tensor:
        """All tokens of this rank's heads -> the token shard with all heads: a fresh,
        contiguous ``[B, S_local, heads, d]`` tensor.

        ``xs`` holds the one input; it is emptied once staged, so the caller's last reference
        can go before the output is allocated. The all-to-all receives head-major (one block per
        source rank's heads); the copy into token-major order is what every caller's next step
        (merging heads for the output projection) needs, and done here it is the only copy: a
        strided result made ``out.reshape(B, S, -1)`` copy it again, and the eager call's saved
        output and that copy were both kept for the backward (one output-sized tensor per layer).
        """
        out = fused_all_to_all(xs, self.group, 1, 2, [self.token_ranges()], split_sizes(num_heads, len(self.heads)),
                               workspace=self.workspace, release_inputs=True)[0]
        return out.contiguous()

    def grads_to_tokens(self, grads: list[Tensor], shapes: list[torch.Size], kinds: str) -> list[Tensor]:
        """Backward of :meth:`to_heads`: gradients of the token shards ``shapes`` (K/V heads sent
        to several ranks get the sum), head dims as in :meth:`to_heads`. ``grads`` is emptied
        once staged."""
        ranges = [self.head_ranges(kind) for kind in kinds]
        dims = [shape[-1] for shape in shapes]
        if len(set(dims)) == 1:
            # The head-sharded inputs are dead by now: their buffer receives the gradients.
            return fused_all_to_all_backward(
                grads, shapes, self.group, 2, 1, ranges, self.token_sizes, workspace=self.workspace,
                release_inputs=True, recv_role="ulysses.0",
            )
        # Head dims differ (MLA): one exchange per head dim, each over the heads dim itself and
        # never the flattened (heads, head_dim) axis (Note [Gather over heads]).
        outs: list[Tensor | None] = [None] * len(grads)
        for d in dict.fromkeys(dims):
            idx = [t for t, dt in enumerate(dims) if dt == d]
            part = [grads[t] for t in idx]
            for t in idx:
                grads[t] = None  # the caller's list held the last reference: freed once staged
            done = fused_all_to_all_backward(
                part, [shapes[t] for t in idx], self.group, 2, 1, [ranges[t] for t in idx], self.token_sizes,
                workspace=self.workspace, release_inputs=True, recv_role="ulysses.0",
            )
            for t, g in zip(idx, done):
                outs[t] = g
        grads.clear()
        return outs


    def grads_to_tokens_each(self, grads: list[Tensor], shapes: list[torch.Size], kinds: str) -> list[Tensor]:
        """:meth:`grads_to_tokens` one tensor at a time: one staging copy alive, for gradients the
        caller cannot release (an autograd node's incoming gradients stay alive until it returns)."""
        # One tensor needs no common head dim: it travels over its heads dim itself, never the
        # flattened (heads, head_dim) axis (Note [Gather over heads]).
        return [
            fused_all_to_all_backward(
                [grad], [shape], self.group, 2, 1, [self.head_ranges(kind)], self.token_sizes,
                workspace=self.workspace,
            )[0]
            for grad, shape, kind in zip(grads, shapes, kinds)
        ]


# Note [Gather over heads]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# An all-to-all stages each piece gather-dim first (Note [All-to-all layout]). Towards the heads
# (gather over tokens) that axis is an outer one and flattening (heads, head_dim) into one is
# free. Back towards the tokens the gather dim is the heads dim: over the heads dim itself every
# staged row is one head's contiguous head_dim values, but over a flattened (heads, head_dim)
# axis the head_dim index becomes the outermost dim of the staging copy -- an element-wise
# transpose of the tensor -- and the result keeps that layout, so the next copy (autograd's, or a
# projection's) is one too. Measured (2 gloo ranks, U = 2, S = 8192, H = 8, D = 64, fp32, the
# gradients of q, k, v going back): staging 4.0 / 3.3 / 12.0 ms and the next copies 9.8 / 6.9 /
# 6.9 ms over the flattened axis, 0.6 / 0.9 / 3.1 and 0.6 / 0.6 / 3.5 ms over the heads dim.
# Gradients of different head dims (MLA's v) therefore travel in one exchange per head dim.


def _flat_heads(xs: list[Tensor]) -> list[Tensor]:
    """``[B, S, heads, d] -> [B, S, heads * d]`` each: views where the two dims are one axis
    (bshd, sbhd), else copies (bhsd), which the exchange frees once staged."""
    return [x.flatten(2) for x in xs]


def _flat_ranges(ranges: list[list[tuple[int, int]]], dims: list[int]) -> list[list[tuple[int, int]]]:
    """Head ranges ``(start, count)`` per tensor and rank as ranges of the flattened
    ``(heads, head_dim)`` axis of head dim ``dims[t]``."""
    return [[(start * d, count * d) for start, count in r] for r, d in zip(ranges, dims)]


def _expand(heads: HeadAssignment, x: Tensor) -> Tensor:
    if heads.kv_index is None:
        return x
    return x.index_select(2, torch.tensor(heads.kv_index, dtype=torch.long, device=x.device))


# ---------------------------------------------------------------------------------------------
# A building block: Ulysses around any differentiable attention (autograd through the exchange).


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
    per Note [Ulysses head placement] (``seqpar/placement/heads.py``) with one all-to-all of q, k
    and v, ``inner`` runs on all ``S`` tokens of this rank's heads, and a second all-to-all returns
    the output to the token shards. The exchanges follow the same :class:`UlyssesSetup` as
    ``seqpar.attention``; autograd runs through them and through ``inner``. With ``U == 1`` it is
    ``inner(q, k, v, all heads)``.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, this rank's tokens of every head.
        k: ``(batch, seqlen_local, nheads_kv, headdim)`` with ``nheads % nheads_kv == 0``.
        v: ``(batch, seqlen_local, nheads_kv, headdim_v)``.
        group: the Ulysses process group (``U`` ranks).
        inner: attention on the gathered sequence, see :data:`InnerAttention`; it is called
            with ``(batch, S, H_u, headdim)`` queries, a uniform GQA ratio and this rank's
            :class:`HeadAssignment`, and not at all on a rank with no query head (``H < U``).
        gather_size: ``S``, the total tokens over the group; rank ``i`` must then hold
            ``split_sizes(S, U)[i]``. ``None`` exchanges the lengths (one small collective).

    Returns:
        ``(batch, seqlen_local, nheads, headdim_v)`` in q's dtype; a strided view of the
        all-to-all's receive buffer, so use ``reshape`` rather than ``view`` to merge head dims.

    Raises:
        ValueError: non-tensors, shapes that are not ``[B, S, H, D] / [B, S, Hkv, D] /
            [B, S, Hkv, Dv]``, ``H % Hkv != 0``, a bad group, or a local length that disagrees
            with ``gather_size``.
    """
    where = "ulysses_attention"
    check_qkv(q, k, v, ndim=4, shape_doc="[B, S_local, heads, head_dim]", where=where)
    B, S, H, D = q.shape
    if k.shape[:2] != (B, S) or v.shape[:3] != k.shape[:3] or k.shape[3] != D:
        raise ValueError(
            f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
            "[B, S, H, D], [B, S, Hkv, D], [B, S, Hkv, Dv]"
        )
    check_gqa(H, k.shape[2], where)
    check_group(group, where)
    n, me = group_size(group), group_rank(group)
    if n == 1:
        return inner(q, k, v, all_heads(H, k.shape[2]))
    if gather_size is None:
        sizes = [row[0] for row in exchange_ints([S], group, q.device)]
    else:
        sizes = split_sizes(gather_size, n)
        if sizes[me] != S:
            raise ValueError(
                f"{where}: gather_size={gather_size} over {n} ranks gives rank {me} "
                f"{sizes[me]} tokens (split {sizes}), but q has {S}"
            )
    setup = UlyssesSetup.build(group, sizes, H, k.shape[2], None)
    mine = setup.mine
    # One all-to-all of q, k, v over the heads dim (two when v's head dim differs: its reverse,
    # autograd's backward, must gather over heads, not a flattened axis; Note [Gather over heads]).
    ranges = [setup.head_ranges(kind) for kind in "qkk"]
    if v.shape[-1] == D:
        q_u, k_u, v_u = all_to_all_many([q, k, v], group, scatter_dim=2, gather_dim=1, gather_size=sizes,
                                        scatter_ranges=ranges)
    else:
        q_u, k_u = all_to_all_many([q, k], group, scatter_dim=2, gather_dim=1, gather_size=sizes,
                                   scatter_ranges=ranges[:2])
        (v_u,) = all_to_all_many([v], group, scatter_dim=2, gather_dim=1, gather_size=sizes,
                                 scatter_ranges=ranges[2:])
    if mine.q_len == 0:
        # No heads here: keep every received tensor in the graph so this rank's backward joins
        # the reverse all-to-all like the others.
        out = v_u + 0 * (q_u.sum() + k_u.sum())
    else:
        out = inner(q_u, _expand(mine, k_u), _expand(mine, v_u), mine)
    return all_to_all_many([out], group, scatter_dim=1, gather_dim=2, gather_size=H,
                           scatter_ranges=[setup.token_ranges()])[0]


# ---------------------------------------------------------------------------------------------
# Ulysses around the ring (the path seqpar.attention takes; seqpar.parallel.hybrid composes it).
#
# Note [Ulysses memory]
# ~~~~~~~~~~~~~~~~~~~~~
# Composing the two all-to-alls and the ring with autograd saves the head-sharded q, k, v and
# output of every layer for its backward: 2.5 extra copies of a layer's activations (H == Hkv)
# kept alive until that layer's backward. Here only the token shard's q, k, v (the inputs, alive
# anyway), its output and the ring's LSE are saved; the backward repeats the all-to-all of q, k, v
# with out and dout, runs the ring's backward and sends the gradients back. Backward traffic grows
# from (dout + grads) to (q, k, v, out, dout + grads); saved activations shrink to what a single
# device keeps. The backward exchanges the five tensors one at a time (UlyssesSetup.to_heads_each;
# an eager call exchanges dout first, in an autograd node of its own, Note [Dout exchanged first]
# in seqpar/parallel/hybrid.py):
# one staging copy alive instead of five, and each result a contiguous tensor of its own rather than
# a strided view of one fused buffer (the kernels read them faster). Its peak is then the kernel's
# working set: the head-sharded q, k, v, out, dout and their gradients (bench_memory.py,
# docs/performance.md). The token shards of q, k, v and out are dead once sent; an eager call
# hands them over to its backward, which frees each as it is sent (Note [Saved tensors handed
# over] in seqpar/saved.py), so the kernels' working set is not paid on top of them. Where a
# rank's query heads do not map uniformly onto its K/V heads (``HeadAssignment.kv_index``), the
# backward expands the received k, v to the kernel's heads first and lets the received ones go:
# they are dead from then on (one rank of 2 x 2, S = 3001, H = 9, Hkv = 3, D = 32, non-causal,
# fp32: the call's peak fell 147.5 -> 139.5 head-shards of q, 5%).
#
# ``ParallelState(keep_head_shards=True)`` makes the opposite trade, explicitly: the forward
# receives q, k and v one at a time as tensors of their own (never workspace buffers) and keeps
# them and the head-sharded output for the backward, which then exchanges only dout and the
# gradients: 8 shard transfers per call instead of 12, the traffic of autograd through the two
# all-to-alls. Per layer it keeps the head shards instead of the token shards: the same bytes for
# H == Hkv >= U, more with GQA ``Hkv < U`` (every K/V head received by several ranks: k_u, v_u
# are ``U / Hkv`` times the token shard's k, v). Its backward's working set is smaller (nothing
# re-sent), and eager calls run as three autograd nodes so that each piece is freed as soon as
# it is dead (Note [Head shards as a node] in ``seqpar.parallel.hybrid``). The planner and the
# memory model count it; the measured trade is in ``docs/performance.md``.


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


def _my_slopes(run: RingSetup | AllGatherSetup, mine) -> RingSetup | AllGatherSetup:
    """``run`` with its ALiBi slopes (one per query head of the call) cut to this rank's heads."""
    if isinstance(run, AllGatherSetup):
        return dataclasses.replace(run, ring=_my_slopes(run.ring, mine))
    return run if run.alibi is None else dataclasses.replace(run, alibi=mine.q_heads(run.alibi, 0))


def _my_extra(mine: HeadAssignment, extra: Extra) -> Extra:
    """This rank's K/V heads of the replicated keys and values (``[B, P, Hkv, D | Dv]`` each)."""
    return None if extra is None else (mine.kv_heads(extra[0], 2), mine.kv_heads(extra[1], 2))


def heads_forward(
    q_u: Tensor, k_u: Tensor, v_u: Tensor, sinks: Tensor | None, extra: Extra, spec: UlyssesSetup,
    run: RingSetup | AllGatherSetup,
) -> tuple[Tensor, Tensor]:
    """The ring over this rank's heads (no communication of its own besides the ring's).

    Args:
        q_u, k_u, v_u: ``(batch, L, H_mine | Hkv_mine, headdim | headdim_v)``, all ``L``
            ring-local tokens of this rank's heads (``UlyssesSetup.to_heads``).
        sinks: ``(nheads,)`` or None; extra: the replicated ``(extra_k, extra_v)`` of every head
            (``(batch, P, nheads_kv, headdim)`` / ``(..., headdim_v)``) or None; spec, run: as in
            :func:`ulysses_ring_forward`.

    Returns:
        ``out_u`` ``(batch, L, H_mine, headdim_v)`` and ``lse_u`` ``(batch, H_mine, L)``.
    """
    mine = spec.mine
    if not mine.q_len:  # no head here: nothing to attend, but the all-to-alls still need this rank
        out_u = q_u.new_zeros((*q_u.shape[:3], v_u.shape[-1]))
        return out_u, q_u.new_zeros((q_u.shape[0], 0, q_u.shape[1]), dtype=accumulator_dtype(q_u.dtype))
    return kv_forward(
        q_u, _expand(mine, k_u), _expand(mine, v_u), None if sinks is None else mine.q_heads(sinks, 0),
        _my_extra(mine, extra), _my_slopes(run, mine),
    )


def heads_backward(
    dout_u: Tensor, q_u: Tensor, kv_u: list[Tensor], out_u: Tensor, lse_u: Tensor, sinks: Tensor | None,
    extra: Extra, spec: UlyssesSetup, run: RingSetup | AllGatherSetup,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of :func:`heads_forward`: ``(dq_u, dk_u, dv_u)`` shaped like the received
    ``q_u, k_u, v_u`` (expanded K/V heads summed back), and this rank's partial ``(dsinks,
    dextra_k, dextra_v)`` in the full shapes of ``sinks`` and ``extra`` (None where those are
    None). ``kv_u``: the received ``[k_u, v_u]``, a list this call empties: it expands them to
    the kernel's heads in place and the ring lets them go once sent, so a caller that holds no
    other reference frees the received heads before the kernels and the expanded ones before the
    last steps (Note [Ulysses memory], Note [Own K/V released] in ``seqpar.parallel.ring``)."""
    mine = spec.mine
    extra_k, extra_v = extra or (None, None)
    if not mine.q_len:  # no head here: zero shares, so every rank returns the same gradients (sum over CP)
        k_u, v_u = kv_u
        kv_u.clear()
        zeros = [None if x is None else torch.zeros_like(x) for x in (sinks, extra_k, extra_v)]
        return (torch.zeros_like(q_u), torch.zeros_like(k_u), torch.zeros_like(v_u), *zeros)
    kv_u[:] = [_expand(mine, x) for x in kv_u]
    dq_u, dk_u, dv_u, ds, d_ek, d_ev = kv_backward(
        dout_u, q_u, kv_u, None if sinks is None else mine.q_heads(sinks, 0), _my_extra(mine, extra), out_u, lse_u,
        _my_slopes(run, mine),
    )
    return (
        dq_u, _unexpand(mine, dk_u), _unexpand(mine, dv_u), _place(mine, ds, sinks, "q", 0),
        _place(mine, d_ek, extra_k, "kv", 2), _place(mine, d_ev, extra_v, "kv", 2),
    )


@dataclass(eq=False)
class Saved:
    """What a call's forward leaves its backward besides dout (:func:`ulysses_ring_backward`,
    ``seqpar.parallel.hybrid.hybrid_backward``).

    Attributes:
        tokens: the token shards ``[q, k, v, out]``, a list the Ulysses backward empties as it
            sends each one: a caller that holds no other reference hands them over, and each is
            freed once sent (Note [Saved tensors handed over] in ``seqpar.saved``). Empty where the
            forward kept the head shards instead and the caller did not keep them.
        shapes: q's, k's and v's shapes (the gradients' shapes).
        lse: the LSE of the shard's rows: ``(batch, H_mine, L)`` under Ulysses, ``(batch, nheads,
            S_local)`` without.
        lse_replicated: the replicated rows' LSE ``(batch, nheads, prefix + suffix)``.
        heads: the head shards ``(q_u, k_u, v_u, out_u)`` the forward kept (``keep_head_shards``,
            Note [Ulysses memory]), else ``()``; given them, the backward sends only dout.
    """

    tokens: list[Tensor]
    shapes: tuple[torch.Size, torch.Size, torch.Size]
    lse: Tensor
    lse_replicated: Tensor | None = None
    heads: tuple[Tensor, ...] = ()

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_replicated: Tensor | None = None,
           heads: Sequence[Tensor] = ()) -> Saved:
        """The forward's tensors as saved (the list holds the caller's references)."""
        return cls([q, k, v, out], (q.shape, k.shape, v.shape), lse, lse_replicated, tuple(heads))


class DoutExchanged(NamedTuple):
    """dout as an eager Ulysses backward receives it (Note [Dout exchanged first] in
    ``seqpar.parallel.hybrid``): the shard's rows already on this rank's heads, ``heads``
    ``[B, L, H_mine, Dv]``, and the replicated rows ``[B, prefix + suffix, H, Dv]``."""

    heads: Tensor
    replicated: Tensor


def ulysses_ring_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra: Extra, spec: UlyssesSetup,
    run: RingSetup | AllGatherSetup,
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """Ulysses around the ring (no autograd; Note [Ulysses memory]).

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, this rank's token shard.
        k, v: ``(batch, seqlen_local, nheads_kv, headdim)`` / ``(..., headdim_v)``.
        sinks: ``(nheads,)`` or None; extra: ``(extra_k, extra_v)``, ``(batch, P, nheads_kv,
            headdim)`` / ``(..., headdim_v)`` replicated keys every query also attends, or None.
        spec: the Ulysses group and layout; run: the ring over this rank's heads.

    Returns:
        ``out`` ``(batch, seqlen_local, nheads, headdim_v)``, the token shard; ``lse_u``
        ``(batch, H_mine, L)`` over this rank's heads and the ring-local tokens; and with
        ``spec.keep_head_shards`` the head shards ``(q_u, k_u, v_u, out_u)`` for the backward
        (``[B, L, H_mine | Hkv_mine, D | Dv]``), else ``()``.
    """
    if spec.keep_head_shards:
        q_u, k_u, v_u = spec.to_heads_each([q, k, v], "qkk", kept=True)
    else:
        q_u, k_u, v_u = spec.to_heads([q, k, v], "qkk", "ulysses.heads")
    out_u, lse_u = heads_forward(q_u, k_u, v_u, sinks, extra, spec, run)
    heads = (q_u, k_u, v_u, out_u) if spec.keep_head_shards else ()
    del q_u, k_u, v_u
    staged = [out_u]
    del out_u
    return spec.to_tokens(staged, q.shape[2]), lse_u, heads


def ulysses_ring_backward(
    dout: Tensor | DoutExchanged, saved: Saved, sinks: Tensor | None, extra: Extra, spec: UlyssesSetup,
    run: RingSetup | AllGatherSetup,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``(dq, dk, dv, dsinks, dextra_k, dextra_v)`` from :func:`ulysses_ring_forward`'s
    results. ``dout``: the token shard's, or already exchanged to this rank's heads (Note [Dout
    exchanged first] in ``seqpar.parallel.hybrid``). Given the forward's head shards
    (``saved.heads``) only dout travels; else the token shards of ``saved.tokens`` do, one at a
    time, the list emptied as each is sent."""
    exchanged = isinstance(dout, DoutExchanged)
    dout_u = dout.heads if exchanged else None
    if saved.heads:
        q_u, k_u, v_u, out_u = saved.heads
        if not exchanged:
            (dout_u,) = spec.to_heads_each([dout], "q")
    else:
        tokens = saved.tokens
        if not exchanged:
            tokens.append(dout)
        del dout  # the list holds this function's last reference: dropped once sent
        q_u, k_u, v_u, out_u, *rest = spec.to_heads_each(tokens, "qkkqq"[:len(tokens)])
        dout_u = dout_u if exchanged else rest[0]
        del rest
    dout = None
    kv_u = [k_u, v_u]  # emptied by heads_backward: the received K/V go before the kernels
    del k_u, v_u
    dq_u, dk_u, dv_u, dsinks, dek, dev = heads_backward(dout_u, q_u, kv_u, out_u, saved.lse, sinks, extra, spec, run)
    staged = [dq_u, dk_u, dv_u]
    del dq_u, dk_u, dv_u, q_u, out_u, dout_u
    dq, dk, dv = spec.grads_to_tokens(staged, list(saved.shapes), "qkk")
    return dq, dk, dv, dsinks, dek, dev
