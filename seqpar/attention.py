"""The public attention entry points: ``attention``, ``varlen_attention``, ``SequenceParallelAttention``.

Each public call is validated once, at the door (``seqpar.prepare``: options, tensors, the
placement of its tokens, Note [Global length]), then runs the one composition of
``seqpar.parallel.hybrid`` (Note [Hybrid composition])::

    this rank's shard [B, S_local, H, D]                      (layout converted by views)
      -> Ulysses all-to-all over state.ulysses_group          [B, S_ring_local, H_u, D]
      -> ring over state.ring_group (seqpar.parallel.ring)    exact over all tokens, any mask
      -> Ulysses all-to-all back                              [B, S_local, H, Dv]

(``Dv``: v's head dim, ``D`` unless the model's values have their own, as in MLA.)

through one autograd function here (eager) or the custom operators of ``seqpar.compiled`` (under
``torch.compile``); both call the same ``hybrid_forward`` / ``hybrid_backward``. Packed sequences
are the same composition on a batch of one; replicated text tokens of joint attention add local
keys to the ring and a small merge over the CP group (Note [Replicated tokens]). With ``R == 1``
the ring is one local step; with ``U == 1`` there is no all-to-all.
"""

from __future__ import annotations

import contextlib
import dataclasses

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .backends import AttentionBackend
from .placement.masks import MaskSlices
from .comm import refuse_double_backward, split_sizes
from .parallel.allgather import AllGatherSetup
from .parallel.hybrid import (
    HybridSetup,
    dout_first,
    dout_first_shapes,
    dout_to_heads,
    exchanges_dout_first,
    hands_over,
    head_grads_to_tokens,
    head_shards_backward,
    head_shards_forward,
    hybrid_backward,
    hybrid_forward,
    out_to_tokens,
    splits_at_heads,
    to_head_shards,
)
from .parallel.ulysses import DoutExchanged, Saved, UlyssesSetup
from .prepare import (
    Layout,
    PreparedCall,
    check_dense_options,
    check_head_groups,
    collective_checks,
    prepare_dense,
    prepare_varlen,
    refuse_collectively,
    to_bshd,
)
from .saved import HandOver
from .state import ParallelState, require_state

# collective_checks and refuse_collectively live in seqpar.prepare; importable from here as before.
__all__ = [
    "attention", "varlen_attention", "SequenceParallelAttention", "Layout", "refuse_collectively",
    "collective_checks",
]


class _Attention(torch.autograd.Function):
    """The eager autograd function of a call without a Ulysses group (:func:`_apply`):
    :func:`hybrid_forward` forward, its backward backward. Saves the shard's q, k, v, sinks, out
    and the LSEs, all of which the ring's backward reads in every step."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, call: PreparedCall) -> Tensor:
        out, lse_body, lse_replicated, _ = hybrid_forward(call.setup, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, out, sinks, lse_body, lse_replicated)
        ctx.setup = call.setup  # not the call: it holds q, k, v (Note [Head shards as a node])
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        refuse_double_backward("seqpar attention")
        q, k, v, out, sinks, lse_body, lse_replicated = ctx.saved_tensors
        grads = hybrid_backward(ctx.setup, dout, Saved.of(q, k, v, out, lse_body, lse_replicated), sinks)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None)  # none for call


class _AttentionDoutFirst(torch.autograd.Function):
    """:class:`_Attention` for a Ulysses call whose dout reaches it already exchanged (Note [Dout
    exchanged first] in ``seqpar.parallel.hybrid``): besides ``out`` it returns two storage-less
    handles, ``[B, L, H_mine, Dv]`` and ``[B, prefix + suffix, H, Dv]``, through which
    :class:`_DoutToHeads` passes ``dout_u`` and the replicated rows' dout back; ``out`` itself
    receives no gradient. ``hand_over`` (calls that hand over, or None): Note [Saved tensors
    handed over]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, call: PreparedCall,
                hand_over: HandOver | None) -> tuple[Tensor, Tensor, Tensor]:
        out, lse_body, lse_replicated, heads = hybrid_forward(call.setup, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, out, sinks, lse_body, lse_replicated, *heads)
        ctx.setup, ctx.hand_over = call.setup, hand_over
        ctx.set_materialize_grads(False)  # out's gradient stays None, never a zero token shard
        shape_u, shape_r = dout_first_shapes(call.setup, out)
        one = out.new_zeros(())
        return out, one.expand(shape_u), one.expand(shape_r)

    @staticmethod
    def backward(ctx, _: None, dout_u: Tensor | None, dout_r: Tensor | None):
        refuse_double_backward("seqpar attention")
        if dout_u is None:  # the output took no part in what was differentiated
            return None, None, None, None, None, None
        q, k, v, out, sinks, lse_body, lse_replicated, *heads = ctx.saved_tensors
        saved = Saved.of(q, k, v, out, lse_body, lse_replicated, heads)
        if ctx.hand_over is not None and ctx.hand_over.take():  # Note [Saved tensors handed over]
            del q, k, v, out  # the list holds the last references: each is freed once sent
        grads = hybrid_backward(ctx.setup, DoutExchanged(dout_u, dout_r), saved, sinks)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None)


class _DoutToHeads(torch.autograd.Function):
    """The node after :class:`_AttentionDoutFirst`: passes ``out`` on (an alias) and in the
    backward splits dout into the shard's rows exchanged to head shards and the replicated rows
    (:func:`~seqpar.parallel.hybrid.dout_first`), returned through the handles, so that autograd
    frees the token-sharded dout before the attention backward runs; saves nothing."""

    @staticmethod
    def forward(ctx, out: Tensor, handle_u: Tensor, handle_r: Tensor, call: PreparedCall) -> Tensor:
        ctx.setup = call.setup
        return out.detach()  # an alias sharing out's version counter: in-place changes are caught

    @staticmethod
    def backward(ctx, dout: Tensor):
        refuse_double_backward("seqpar attention")
        return None, *dout_first(ctx.setup, dout), None


class _ToHeadShards(torch.autograd.Function):
    """Token shards to head shards (Note [Head shards as a node] in ``seqpar.parallel.hybrid``);
    saves nothing. The first of the three nodes of a call that keeps the head shards."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: PreparedCall) -> tuple[Tensor, Tensor, Tensor]:
        ctx.setup, ctx.shapes = call.setup, (q.shape, k.shape, v.shape)
        return to_head_shards(call.setup, q, k, v)

    @staticmethod
    def backward(ctx, dq_u: Tensor, dk_u: Tensor, dv_u: Tensor):
        refuse_double_backward("seqpar attention")
        return (*head_grads_to_tokens(ctx.setup, dq_u, dk_u, dv_u, ctx.shapes), None)


class _HeadShardsAttention(torch.autograd.Function):
    """The ring over this rank's heads; saves the head shards, their output and the LSE."""

    @staticmethod
    def forward(ctx, q_u: Tensor, k_u: Tensor, v_u: Tensor, sinks: Tensor | None, call: PreparedCall) -> Tensor:
        out_u, lse_u = head_shards_forward(call.setup, q_u, k_u, v_u, sinks)
        ctx.save_for_backward(q_u, k_u, v_u, out_u, lse_u, sinks)
        ctx.setup = call.setup
        return out_u

    @staticmethod
    def backward(ctx, dout_u: Tensor):
        refuse_double_backward("seqpar attention")
        grads = head_shards_backward(ctx.setup, dout_u, *ctx.saved_tensors)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None)


class _ToTokenShard(torch.autograd.Function):
    """The output's head shard back to the token shard; saves nothing."""

    @staticmethod
    def forward(ctx, out_u: Tensor, call: PreparedCall) -> Tensor:
        ctx.setup = call.setup
        return out_to_tokens(call.setup, out_u, call.qb.shape[2])

    @staticmethod
    def backward(ctx, dout: Tensor):
        refuse_double_backward("seqpar attention")
        return dout_to_heads(ctx.setup, dout), None


def _apply(call: PreparedCall, sinks: Tensor | None) -> Tensor:
    """The eager autograd graph of a prepared call: one node without Ulysses, three around the
    head shards with ``keep_head_shards`` (and no replicated rows), else two (Note [Dout
    exchanged first])."""
    if splits_at_heads(call.setup):
        q_u, k_u, v_u = _ToHeadShards.apply(call.qb, call.kb, call.vb, call)
        return _ToTokenShard.apply(_HeadShardsAttention.apply(q_u, k_u, v_u, sinks, call), call)
    if not exchanges_dout_first(call.setup):
        return _Attention.apply(call.qb, call.kb, call.vb, sinks, call)
    with HandOver() if hands_over(call.setup) else contextlib.nullcontext() as hand_over:
        out, *handles = _AttentionDoutFirst.apply(call.qb, call.kb, call.vb, sinks, call, hand_over)
    return _DoutToHeads.apply(out, *handles, call)  # Note [Dout exchanged first]


# Note [Head groups]
# ~~~~~~~~~~~~~~~~~~
# ``head_groups=G`` runs a call as G calls over contiguous groups of query heads, one after the
# other (UPipe's "untied Ulysses"): each group is exchanged to head shards, computed by the ring
# and exchanged back before the next group starts, so the all-to-all buffers and the kernels'
# working set are a group's, not all heads'. The query heads split by ``split_sizes(H, G)``
# (6 heads in 4 groups: 2, 2, 1, 1); a group carries the K/V heads its query heads read (a K/V
# head read by two groups goes to both and their gradients add) and its slice of the sinks and
# ALiBi slopes. Attention is independent per head, so the result is the one-call result.
#
# An eager call is one autograd node (:class:`_HeadGroups`): the forward writes each group's
# output into one output tensor, so what outlives a group is only what the caller gets anyway
# (the output) and what each group's backward needs (its LSEs; its head shards with
# ``keep_head_shards``). The backward keeps each group's token-shard gradients (a 1/G share each)
# and joins them after the last group, freeing each group's as it goes: the call's dq, dk, dv
# allocated up front would sit next to every group's working set (measured: 1 x 4, 8 heads, 2
# groups, 2.0 instead of 1.6 x the ideal). Pieces per group joined by ``torch.cat`` in the
# forward would hold every group's output next to the joined one, and slices of q, k, v as graph
# inputs would give each group's gradient a full-size zero-padded tensor. A group's K/V heads
# that its query heads read unevenly (6 heads, 2 K/V heads, groups of 4 and 2: the first group
# reads K/V head 0 three times and head 1 once) are expanded to one K/V head per query head for
# that group. Under ``torch.compile`` the groups are G operators
# joined by a cat (exact; the one-node memory is the eager call's). Groups smaller than the
# Ulysses size leave ranks without a head in that group: choose ``G <= H / ulysses_size`` for
# balanced work. ``head_groups="auto"`` is the planner's count for the call's shapes (Note [Planner
# head groups] in ``seqpar/planner/predict.py``), resolved once the call's checks have made the
# ranks agree on those shapes: host maths, the same on every rank, no collective of its own.


@dataclasses.dataclass(frozen=True, eq=False)
class _Group:
    """One head group of a call: query heads ``q_start:q_stop``; its K/V heads either the
    contiguous range ``kv_start:kv_stop`` (each read by the same number of the group's query
    heads) or, with ``kv_index``, one K/V head per query head; the group's own setup."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    kv_index: Tensor | None
    setup: HybridSetup

    def kv(self, x: Tensor) -> Tensor:
        """The group's K/V heads of a bshd ``k`` or ``v`` (a view, or a copy when expanded)."""
        if self.kv_index is None:
            return x[:, :, self.kv_start:self.kv_stop]
        return x.index_select(2, self.kv_index)

    def add_kv_grad(self, dx: Tensor, dx_g: Tensor) -> None:
        """Add the group's K/V gradient into the call's ``dx`` (K/V heads shared by groups add)."""
        if self.kv_index is None:
            dx[:, :, self.kv_start:self.kv_stop] += dx_g
        else:
            dx.index_add_(2, self.kv_index, dx_g)


def _group_setup(setup: HybridSetup, q_start: int, q_stop: int, num_kv_heads: int) -> HybridSetup:
    """``setup`` for the query heads ``q_start:q_stop`` reading ``num_kv_heads`` K/V heads: the
    Ulysses head assignment of the group's heads and its ALiBi slopes; the rest is shared."""
    ring = setup.ring.ring if isinstance(setup.ring, AllGatherSetup) else setup.ring
    if ring.alibi is not None:
        ring = dataclasses.replace(ring, alibi=ring.alibi[q_start:q_stop])
    if isinstance(setup.ring, AllGatherSetup):
        ring = dataclasses.replace(setup.ring, ring=ring)
    u = setup.ulysses
    if u is not None:
        u = UlyssesSetup.build(u.group, u.token_sizes, q_stop - q_start, num_kv_heads, u.workspace, u.keep_head_shards)
    return dataclasses.replace(setup, ring=ring, ulysses=u)


def _head_groups(call: PreparedCall, head_groups: int, where: str) -> list[_Group]:
    """The groups of Note [Head groups] for a prepared call (the ranks agree on its shapes).

    Raises:
        ValueError: more groups than query heads.
    """
    H, Hkv = call.qb.shape[2], call.kb.shape[2]
    _check_group_count(H, head_groups, where)
    rep = H // Hkv
    groups, start = [], 0
    for size in split_sizes(H, head_groups):
        stop = start + size
        kv = [h // rep for h in range(start, stop)]
        kv_start, kv_stop = kv[0], kv[-1] + 1
        # GQA within the group: every K/V head read by the same number of its query heads
        even = len({kv.count(j) for j in range(kv_start, kv_stop)}) == 1
        index = None if even else torch.tensor(kv, device=call.kb.device)
        n_kv = kv_stop - kv_start if even else size
        groups.append(_Group(start, stop, kv_start, kv_stop, index, _group_setup(call.setup, start, stop, n_kv)))
        start = stop
    return groups


class _HeadGroups(torch.autograd.Function):
    """The eager autograd function of a call with head groups (Note [Head groups]): each group's
    :func:`hybrid_forward` then, in the backward, each group's :func:`hybrid_backward`, in group
    order. Saves q, k, v, sinks, the output and every group's LSEs (and head shards with
    ``keep_head_shards``)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, groups: list[_Group]) -> Tensor:
        B, S, H, _ = q.shape
        out = q.new_empty((B, S, H, v.shape[-1]))
        lses, heads, counts = [], [], []
        for g in groups:
            sinks_g = None if sinks is None else sinks[g.q_start:g.q_stop]
            out_g, lse_body, lse_replicated, heads_g = hybrid_forward(
                g.setup, q[:, :, g.q_start:g.q_stop], g.kv(k), g.kv(v), sinks_g
            )
            out[:, :, g.q_start:g.q_stop] = out_g
            del out_g  # dead once copied: the next group's buffers may take its place
            lses += [lse_body, lse_replicated]
            heads += heads_g
            counts.append(len(heads_g))
        ctx.save_for_backward(q, k, v, out, sinks, *lses, *heads)
        ctx.groups, ctx.head_counts = groups, counts
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        refuse_double_backward("seqpar attention")
        q, k, v, out, sinks, *rest = ctx.saved_tensors
        groups = ctx.groups
        lses, heads = rest[:2 * len(groups)], rest[2 * len(groups):]
        # Each group's gradients stay tensors of their own until the last group is done: the
        # call's dq, dk, dv allocated up front would sit next to every group's working set.
        dqs, dks, dvs, dss = [], [], [], []
        at = 0
        for i, g in enumerate(groups):
            rows = slice(g.q_start, g.q_stop)
            n = ctx.head_counts[i]
            saved = Saved.of(q[:, :, rows], g.kv(k), g.kv(v), out[:, :, rows], lses[2 * i], lses[2 * i + 1],
                             heads[at:at + n])
            dq_g, dk_g, dv_g, ds_g = hybrid_backward(
                g.setup, dout[:, :, rows], saved, None if sinks is None else sinks[rows]
            )
            at += n
            dqs.append(dq_g), dks.append(dk_g), dvs.append(dv_g), dss.append(ds_g)
            del dq_g, dk_g, dv_g, ds_g, saved
        dq = torch.cat(dqs, 2)  # every query head belongs to one group
        dsinks = None if sinks is None else torch.cat(dss)
        del dqs, dss
        grads_kv = []
        for x, parts in ((k, dks), (v, dvs)):
            dx = torch.zeros_like(x)  # a K/V head may be read by two groups
            for g in groups:
                g.add_kv_grad(dx, parts.pop(0))  # each group's goes once added
            grads_kv.append(dx)
        dk, dv = grads_kv
        grads = (dq, dk, dv, dsinks)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None)  # none for groups


def _apply_groups(call: PreparedCall, sinks: Tensor | None, head_groups: int, where: str) -> Tensor:
    """:func:`_apply` with ``head_groups`` (Note [Head groups]); one group is :func:`_apply` itself."""
    groups = _head_groups(call, head_groups, where)
    if len(groups) == 1:
        return _apply(call, sinks)
    return _HeadGroups.apply(call.qb, call.kb, call.vb, sinks, groups)


def _compiled_groups(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, alibi_slopes: Tensor | None,
                     head_groups: int, run, where: str) -> Tensor:
    """Under ``torch.compile``: ``run(q_g, k_g, v_g, sinks_g, slopes_g)`` on bshd head groups (one
    operator each; K/V heads picked per query head), joined along the heads (Note [Head groups])."""
    H, Hkv = q.shape[2], k.shape[2]
    _check_group_count(H, head_groups, where)
    rep, outs, start = H // max(Hkv, 1), [], 0
    for size in split_sizes(H, head_groups):
        stop = start + size
        kv = torch.tensor([h // rep for h in range(start, stop)], device=k.device)
        outs.append(run(
            q[:, :, start:stop], k.index_select(2, kv), v.index_select(2, kv),
            None if sinks is None else sinks[start:stop], None if alibi_slopes is None else alibi_slopes[start:stop],
        ))
        start = stop
    return torch.cat(outs, 2)


def _resolved_groups(
    head_groups: int | str, state: ParallelState, q: Tensor, k: Tensor, seq_len: int | None, causal: bool,
    window: tuple[int, int], where: str,
) -> int:
    """``head_groups`` with ``"auto"`` resolved (Note [Head groups]) from the call's bshd ``q``, ``k``,
    its global length and mask and ``state``'s sizes: ``seqpar.planner.auto_head_groups``, host
    maths of what every rank has agreed on (the call's checks exchange the shapes), so no
    collective. ``seq_len``: the call's global token count (a packed call's total).

    Raises:
        ValueError: ``"auto"`` under ``torch.compile`` (the planner's host maths is not traced).
    """
    if head_groups != "auto":
        return head_groups
    if torch.compiler.is_compiling() or seq_len is None:
        raise ValueError(
            f"{where}: head_groups='auto' is resolved by the planner's host maths, which torch.compile does "
            "not trace; pass the count it gives, computed outside the compiled function: "
            "seqpar.planner.auto_head_groups(seq_len, H, Hkv, D, ring_size, ulysses_size, batch=..., causal=..., "
            "window=..., dtype=..., device_type=...)"
        )
    from .planner import auto_head_groups

    return auto_head_groups(
        seq_len, q.shape[2], k.shape[2], q.shape[3], state.ring_size, state.ulysses_size, batch=q.shape[0],
        causal=causal, window=tuple(window), dtype=q.dtype, device_type=q.device.type, ring_comm=state.ring_comm,
        keep_head_shards=state.keep_head_shards,
    )


def _check_group_count(H: int, head_groups: int, where: str) -> None:
    """Raise unless ``head_groups`` groups of the ``H`` query heads each get at least one."""
    if head_groups > H:
        raise ValueError(
            f"{where}: head_groups={head_groups} is more than the {H} query heads (each group runs at "
            f"least one head); use head_groups <= {H}"
        )


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
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk_size: int | None = None,
    replicated_prefix: int = 0,
    replicated_suffix: int = 0,
    mask: MaskSlices | None = None,
    alibi_slopes: Tensor | None = None,
    head_groups: int = 1,
) -> Tensor:
    """Exact attention over the whole sequence, computed from and returned as local shards.

    Every CP rank passes its shard of q, k, v as placed by Note [Sharding placement]
    (``seqpar.shard``): zig-zag chunks across the ring, contiguous pieces across Ulysses. The
    result is this rank's shard of full-sequence attention (module docstring; masks per Note
    [Masks], see the ``docs/masks.md`` page). Differentiable; gradients are partial: sharded
    inputs get their full gradient on their own rank, replicated ones (sinks, replicated tokens)
    a share per rank that sums over the CP group to the true gradient.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)`` in ``"bshd"``, ``(seqlen_local, batch,
            nheads, headdim)`` in ``"sbhd"``, ``(batch, nheads, seqlen_local, headdim)`` in
            ``"bhsd"``; any strides.
        k: the same with ``nheads_kv`` heads, ``nheads % nheads_kv == 0`` (GQA/MQA).
        v: like k, with its own head dim ``headdim_v >= 1`` (MLA: DeepSeek-V2/V3, Kimi have
            ``headdim_v != headdim``); k and v agree on batch, length and heads.
        state: the ``ParallelState`` whose ``ulysses_group`` and ``ring_group`` are used.
        causal: causal attention in global token positions.
        softmax_scale: default ``headdim ** -0.5``.
        layout: ``"bshd"`` (flash-attn), ``"sbhd"`` (Megatron) or ``"bhsd"`` (SDPA).
        backend: a name for ``seqpar.backends.get_backend`` (``"auto"``, ``"reference"``,
            ``"cpu"``, ``"torch_flash"``, ``"flash_attn"``, ...) or a backend object.
        seq_len: the global length ``S`` of the sharded tokens if known; ``None`` derives it
            with one small collective (Note [Global length]). The same on every rank.
        window: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right`` (global
            positions; ``-1`` unbounded; with ``causal`` the right side is 0).
        softcap: ``c > 0`` turns scores (after scaling) into ``c * tanh(scores / c)``.
        sinks: ``(nheads,)`` logits added to every row's softmax denominator (no value).
        chunk_size: ``C``: query ``i`` sees only keys ``j`` with ``i // C == j // C``.
        replicated_prefix, replicated_suffix: the first / last ``T`` tokens of q, k, v are the
            same on every CP rank (text of joint attention; non-causal only); the rest is this
            rank's shard. The output keeps that layout, the replicated rows identical on every rank.
        mask: a :class:`~seqpar.MaskSlices` (block-causal frames, prefix-LM, any union of
            full/causal query x key rectangles, in global positions) instead of ``causal``,
            ``window`` and ``chunk_size``; rows no slice covers give zeros.
        alibi_slopes: ``(nheads,)`` slopes: ``-slope * |i - j|`` (global positions) is added to
            the scaled, softcapped scores (flash-attn's semantics), with every mask. Constants: no
            gradient flows to them.
        head_groups: ``G >= 1``: run the call over ``G`` contiguous groups of query heads one
            after the other (``split_sizes(nheads, G)`` heads each), so that the all-to-all
            buffers and the kernels' working set are one group's (Note [Head groups]); the
            result is the same. ``1`` (default): all heads at once. ``"auto"``: the planner's
            count for the call's shapes (``seqpar.planner.auto_head_groups``; eager calls only).
            The same on every rank.

    Returns:
        This rank's output shard in ``layout``, with q's shape and dtype except for the last dim,
        v's head dim (``(batch, seqlen_local, nheads, headdim_v)`` in ``"bshd"``), contiguous
        in ``"bshd"`` order (a transposed view of it in the other layouts), so merging the heads
        for an output projection is a view, not a copy.

    Raises:
        ValueError: non-tensor inputs or state; q, k, v of different dtypes or devices, not
            4-dim, k with another batch/length/head dim than q, v with another
            batch/length/head count than k; ``H`` not a multiple of ``Hkv``; an
            unknown layout; a backend that is unknown or cannot run these options; bad option
            values (a window contradicting ``causal``, replicated tokens with a causal, windowed
            or chunked mask, more replicated tokens than local ones); a local length that is not
            this rank's share of ``seq_len``; CP ranks that disagree on shapes or options, or hold
            lengths that are not the placement of a position-dependent mask (raised on every rank
            whenever the call checks collectively, Note [Global length]); ``head_groups`` not an
            int >= 1 or more than ``nheads``.
    """
    if torch.compiler.is_compiling() and head_groups != 1:
        qb, kb, vb = (to_bshd(t, layout) for t in (q, k, v))

        def run(q_g, k_g, v_g, sinks_g, slopes_g):
            return attention(
                q_g, k_g, v_g, state, causal=causal, softmax_scale=softmax_scale, layout="bshd", backend=backend,
                seq_len=seq_len, window=window, softcap=softcap, sinks=sinks_g, chunk_size=chunk_size,
                replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix, mask=mask,
                alibi_slopes=slopes_g,
            )

        where = "seqpar.attention"
        groups = _resolved_groups(check_head_groups(head_groups, where), state, qb, kb, None, causal, window, where)
        return to_bshd(_compiled_groups(qb, kb, vb, sinks, alibi_slopes, groups, run, where), layout)
    if torch.compiler.is_compiling():  # one opaque custom op (Note [torch.compile] in seqpar.compiled)
        from .compiled import compiled_attention

        return compiled_attention(
            q, k, v, state, causal=causal, softmax_scale=softmax_scale, layout=layout, backend=backend,
            seq_len=seq_len, window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
            replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix, mask=mask,
            alibi_slopes=alibi_slopes,
        )
    options = check_dense_options(
        causal=causal, softmax_scale=softmax_scale, layout=layout, seq_len=seq_len, window=window, softcap=softcap,
        chunk_size=chunk_size, replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix, mask=mask,
        head_groups=head_groups,
    )
    call = prepare_dense(q, k, v, state, options, backend, sinks, alibi_slopes=alibi_slopes)
    groups = _resolved_groups(options.head_groups, state, call.qb, call.kb, call.seq_lens[0], options.causal,
                              options.window, "seqpar.attention")
    return to_bshd(_apply_groups(call, sinks, groups, "seqpar.attention"), layout)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    seq_lens: Sequence[int] | Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk_size: int | None = None,
    head_groups: int = 1,
) -> Tensor:
    """Exact attention over packed variable-length sequences sharded with ``shard_packed``.

    Tokens attend only within their own sequence (block-diagonal), with the mask of Note [Masks]
    on positions counted within each sequence::

        seq_lens = [3, 2]           causal            non-causal
                          k: a a a b b         a a a b b
                      q a    x . . . .         x x x . .
                        a    x x . . .         x x x . .
                        a    x x x . .         x x x . .
                        b    . . . x .         . . . x x
                        b    . . . x x         . . . x x

    Equal to ``shard_packed(attention_of_each_sequence(full_q, full_k, full_v), state,
    seq_lens)``. The placement is Note [Sharding placement]: each sequence zig-zagged over the
    ring on its own, the remainders rotated so that many short sequences spread evenly; the
    ring-local concatenation split contiguously over Ulysses. The Ulysses all-to-all regroups
    heads, then the ring runs a few varlen kernel calls per step (Note [Ring blocks]).
    Collective over ``state.cp_group``: every CP rank must call it with the same ``seq_lens``
    and options. Whether that is checked with an exchange of a few ints over the CP group (which
    makes every rank raise the same error) follows ``state.checks`` as in Note [Global length]
    (``seq_lens`` play the role of ``seq_len``: on an accelerator with ``"auto"``, only this rank's
    count is checked). The plan is built on the host from ``seq_lens`` once per distinct batch and
    reused.

    Args:
        q: ``(T_local, nheads, headdim)``, this rank's packed tokens (``shard_packed``, dim 0).
        k: ``(T_local, nheads_kv, headdim)`` with ``nheads % nheads_kv == 0``.
        v: ``(T_local, nheads_kv, headdim_v)``, any value head dim ``headdim_v >= 1`` (MLA).
        state: the parallel state.
        seq_lens: global lengths of the packed sequences (non-negative ints, list or tensor),
            summing to the global token count ``T``; the same on every CP rank.
        causal, window, chunk_size: the mask within each sequence (Note [Masks]).
        softmax_scale: default ``headdim ** -0.5``.
        backend: a backend name or object.
        softcap: ``c > 0`` caps scores to ``c * tanh(s / c)``.
        sinks: ``(nheads,)`` sink logits.
        head_groups: run over that many groups of query heads one after the other, as in
            :func:`attention` (Note [Head groups]).

    Returns:
        ``(T_local, nheads, headdim_v)`` in q's dtype, contiguous. Gradients
        are partial (the sum over the CP group is the true gradient of replicated tensors).

    Raises:
        ValueError: non-3-dim tensors, mismatched dtypes/devices, q and k with different
            head dims, k and v with different token or head counts, ``nheads`` not a
            multiple of ``nheads_kv``, negative or non-int lengths, bad options, and -- raised on
            every CP rank -- ``seq_lens`` that do not place exactly each rank's token count there
            or that differ between ranks, and ranks that disagree on shapes or options;
            ``head_groups`` not an int >= 1 or more than ``nheads``.
    """
    if torch.compiler.is_compiling() and head_groups != 1:
        def run(q_g, k_g, v_g, sinks_g, _):
            return varlen_attention(
                q_g[0], k_g[0], v_g[0], state, seq_lens, causal=causal, softmax_scale=softmax_scale,
                backend=backend, window=window, softcap=softcap, sinks=sinks_g, chunk_size=chunk_size,
            )[None]

        where = "seqpar.varlen_attention"
        groups = _resolved_groups(check_head_groups(head_groups, where), state, q[None], k[None], None, causal, window,
                                  where)
        return _compiled_groups(q[None], k[None], v[None], sinks, None, groups, run, where)[0]
    if torch.compiler.is_compiling():  # one opaque custom op (Note [torch.compile] in seqpar.compiled)
        from .compiled import compiled_varlen_attention

        return compiled_varlen_attention(
            q, k, v, state, seq_lens, causal=causal, softmax_scale=softmax_scale, backend=backend,
            window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
        )
    call = prepare_varlen(
        q, k, v, state, seq_lens, causal=causal, softmax_scale=softmax_scale, backend=backend,
        window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size, head_groups=head_groups,
    )
    where = "seqpar.varlen_attention"
    groups = _resolved_groups(check_head_groups(head_groups, where), state, call.qb, call.kb, sum(call.seq_lens),
                              causal, window, where)
    return _apply_groups(call, sinks, groups, where)[0]


class SequenceParallelAttention(nn.Module):
    """``nn.Module`` form of :func:`attention` with fixed options (it has no parameters).

    Args:
        state, causal, softmax_scale, layout, backend, window, softcap, chunk_size,
        replicated_prefix, replicated_suffix, mask: as in :func:`attention`. Sinks and ALiBi
        slopes are tensor inputs (usually of the surrounding module): pass them to :meth:`forward`.

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
        window: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        chunk_size: int | None = None,
        replicated_prefix: int = 0,
        replicated_suffix: int = 0,
        mask: MaskSlices | None = None,
    ) -> None:
        super().__init__()
        where = "SequenceParallelAttention"
        require_state(state, where)
        check_dense_options(
            causal=causal, softmax_scale=softmax_scale, layout=layout, seq_len=None, window=window, softcap=softcap,
            chunk_size=chunk_size, replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix,
            where=where, mask=mask,
        )
        if not isinstance(backend, (str, AttentionBackend)):
            raise ValueError(f"{where}: backend must be a name or a backend, got {type(backend).__name__}")
        self.state = state
        self.options = dict(
            causal=causal, softmax_scale=softmax_scale, layout=layout, backend=backend,
            window=tuple(window), softcap=softcap, chunk_size=chunk_size,
            replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix, mask=mask,
        )

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, seq_len: int | None = None, sinks: Tensor | None = None,
        alibi_slopes: Tensor | None = None,
    ) -> Tensor:
        """:func:`attention` of the local shards ``q, k, v`` (shapes per ``layout``)."""
        return attention(q, k, v, self.state, seq_len=seq_len, sinks=sinks, alibi_slopes=alibi_slopes, **self.options)

    def extra_repr(self) -> str:
        opts = {k: (v if isinstance(v, (str, int, float, bool, tuple, type(None))) else type(v).__name__)
                for k, v in self.options.items()}
        return f"{self.state!r}, " + ", ".join(f"{k}={v!r}" for k, v in opts.items())
