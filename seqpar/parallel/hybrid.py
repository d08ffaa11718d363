"""The composition of one attention call, written once for eager and compiled code.

Note [Hybrid composition]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every ``seqpar.attention`` / ``seqpar.varlen_attention`` call runs :func:`hybrid_forward` and
:func:`hybrid_backward`, plain functions without autograd: the eager autograd function in
``seqpar.attention`` and the custom operators of ``seqpar.compiled`` both call them, so a change
here reaches both paths::

    this rank's shard [B, S_local, H, D]             (replicated rows split off first, if any)
      -> Ulysses all-to-all over the Ulysses group    [B, S_ring_local, H_u, D]    (U > 1)
      -> the ring plan over the ring group            kernels per block, fp32 LSE merge
                                                      (K/V by p2p hops or one all-gather)
      -> Ulysses all-to-all back                      [B, S_local, H, Dv]          (U > 1)
    replicated rows (joint text tokens): attend the replicated keys and every rank's shard,
    merged over the CP group (Note [Replicated tokens]); the shard's rows see the replicated
    keys as local extra keys of the ring.

v and the output may have their own head dim ``Dv`` (MLA); every piece carries q and k with
``D`` and v, out and their gradients with ``Dv``. Packed sequences are the same composition on a
batch of one. What each piece needs besides its
tensors is a *setup* (:class:`~seqpar.parallel.ring.RingSetup`,
:class:`~seqpar.parallel.ulysses.UlyssesSetup`,
:class:`~seqpar.parallel.replicated.ReplicatedSetup`), built once per call by
``seqpar.prepare``; :class:`HybridSetup` bundles them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .allgather import AllGatherSetup, kv_backward, kv_forward
from .merge import accumulator_dtype
from .replicated import ReplicatedSetup, replicated_backward, replicated_forward
from .ring import RingSetup
from .ulysses import (
    DoutExchanged, Saved, UlyssesSetup, heads_backward, heads_forward, ulysses_ring_backward, ulysses_ring_forward,
)

__all__ = [
    "HybridSetup", "hybrid_forward", "hybrid_backward", "splits_at_heads", "to_head_shards",
    "head_grads_to_tokens", "head_shards_forward", "head_shards_backward", "out_to_tokens", "dout_to_heads",
    "exchanges_dout_first", "dout_first_shapes", "dout_first", "hands_over", "Saved", "DoutExchanged",
]


@dataclass(frozen=True, eq=False)
class HybridSetup:
    """Everything one call's composition needs besides its tensors.

    Attributes:
        ring: the ring over this rank's (head-sharded) tokens: a :class:`RingSetup` (point-to-point
            transport) or an :class:`~seqpar.parallel.allgather.AllGatherSetup` (the same plan
            by all-gather, ``ring_comm="allgather"``; Note [All-gather K/V]).
        ulysses: the Ulysses exchange, or None when ``ulysses_size == 1``.
        replicated: the merge of replicated queries over the CP group, or None without them.
        prefix, suffix: replicated rows before / after the shard's rows.
    """

    ring: RingSetup | AllGatherSetup
    ulysses: UlyssesSetup | None
    replicated: ReplicatedSetup | None
    prefix: int = 0
    suffix: int = 0


def _body_forward(setup: HybridSetup, q, k, v, sinks, extra) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    if setup.ulysses is None:
        return (*kv_forward(q, k, v, sinks, extra, setup.ring), ())
    return ulysses_ring_forward(q, k, v, sinks, extra, setup.ulysses, setup.ring)


def _body_backward(setup: HybridSetup, dout: Tensor | DoutExchanged, saved: Saved, sinks, extra):
    if setup.ulysses is None:
        q, k, v, out = saved.tokens
        return kv_backward(dout, q, [k, v], sinks, extra, out, saved.lse, setup.ring)
    return ulysses_ring_backward(dout, saved, sinks, extra, setup.ulysses, setup.ring)


def hands_over(setup: HybridSetup) -> bool:
    """Whether the backward can take over the saved token shards of q, k, v and out (Note [Saved
    tensors handed over] in ``seqpar.saved``): Ulysses without ``keep_head_shards`` and without
    replicated rows, whose backward exchanges them first and needs them no more."""
    return setup.ulysses is not None and not setup.ulysses.keep_head_shards and setup.replicated is None


def splits_at_heads(setup: HybridSetup) -> bool:
    """Whether an eager call runs as three autograd nodes around the head shards (Note [Head
    shards as a node]): Ulysses with ``keep_head_shards`` and no replicated rows."""
    return setup.ulysses is not None and setup.ulysses.keep_head_shards and setup.replicated is None


# Note [Head shards as a node]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``keep_head_shards`` an eager call is three autograd nodes instead of one, the graph
# autograd through the two all-to-alls would build (DeepSpeed's and yunchang's form):
#
#   q, k, v --to_head_shards--> q_u, k_u, v_u --head_shards_forward--> out_u --out_to_tokens--> out
#            (saves nothing)                   (saves q_u, k_u, v_u,          (saves nothing)
#                                               out_u, the LSE)
#
# Autograd frees a node's saved tensors and incoming gradients when its backward returns: dout is
# gone once it has been exchanged to dout_u, the head shards once their gradients exist, and the
# gradients go back one tensor at a time. One node would hold all of it through the gradients'
# all-to-all (a quarter of a call's peak, ``docs/performance.md``). The pieces are the ones
# ``hybrid_forward`` / ``hybrid_backward`` compose (same exchanges and kernels, same order);
# ``seqpar.compiled`` keeps the one-node form (one operator); calls with replicated rows are the
# two nodes of Note [Dout exchanged first].


# Note [Dout exchanged first]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd holds a node's incoming gradient until its backward returns. A Ulysses call's backward
# exchanges dout to the head shards, and from then on the token-sharded dout is dead, but as the
# one node's incoming gradient it was held through the kernels -- next to dout_u, one
# output-sized tensor more at the backward's peak. An eager Ulysses call that does not split at
# the head shards (:func:`exchanges_dout_first`) is therefore two nodes:
#
#   q, k, v --attention--> out, handles --pass-through--> out (an alias: in-place changes are caught)
#             (saves q, k, v, out,           backward: dout -> (dout_u, dout_r) (:func:`dout_first`),
#              the LSEs; its backward        returned as the handles' gradients
#              gets dout_u, dout_r)
#
# The handles are storage-less tensors (one expanded element each) of the shapes of dout_u
# ``[B, L, H_mine, Dv]`` and of the replicated rows' dout ``[B, prefix + suffix, H, Dv]`` (no rows
# without joint attention), so autograd passes them on as their gradients; the output's own
# gradient stays None. When the second node returns, autograd frees dout unless something else
# holds it (a caller's own ``out.backward(dout)`` tensor, a residual branch's gradient passed on
# as is); in a layer with an output projection, dout is that projection's input gradient and
# goes. Measured, one rank of 1 x 8 of ``scripts/bench_memory.py``'s 4-layer stack, S = 4096,
# H = 8, Hkv = 2: the peak fell 17.58 -> 16.58 token shards of x (``docs/performance.md``). The
# exchanges, the kernels and the results are unchanged (bitwise); dout now travels before q, k,
# v, out instead of after them. ``seqpar.compiled`` keeps the one-node form (one operator), and
# ``keep_head_shards`` without replicated rows its three nodes (Note [Head shards as a node]),
# whose last one frees dout the same way.


def to_head_shards(setup: HybridSetup, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, S_local, H | Hkv, D | Dv]`` token shards -> ``(q_u, k_u, v_u)``, all ``L``
    ring-local tokens of this rank's heads, tensors of their own (Note [Head shards as a node])."""
    with _scope(setup):
        q_u, k_u, v_u = setup.ulysses.to_heads_each([q, k, v], "qkk", kept=True)
    return q_u, k_u, v_u


def head_grads_to_tokens(
    setup: HybridSetup, dq_u: Tensor, dk_u: Tensor, dv_u: Tensor, shapes: tuple[torch.Size, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`to_head_shards`: the token shards' gradients (``shapes``: q's, k's, v's)."""
    with _scope(setup):
        dq, dk, dv = setup.ulysses.grads_to_tokens_each([dq_u, dk_u, dv_u], list(shapes), "qkk")
    return dq, dk, dv


def head_shards_forward(
    setup: HybridSetup, q_u: Tensor, k_u: Tensor, v_u: Tensor, sinks: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The ring over this rank's heads: ``(out_u, lse_u)``, ``[B, L, H_mine, Dv]`` and
    ``[B, H_mine, L]`` (Note [Head shards as a node])."""
    with _scope(setup):
        return heads_forward(q_u, k_u, v_u, sinks, None, setup.ulysses, setup.ring)


def head_shards_backward(
    setup: HybridSetup, dout_u: Tensor, q_u: Tensor, k_u: Tensor, v_u: Tensor, out_u: Tensor, lse_u: Tensor,
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Backward of :func:`head_shards_forward`: ``(dq_u, dk_u, dv_u, dsinks)``, the head shards'
    gradients and this rank's partial ``dsinks`` (None without sinks)."""
    with _scope(setup):
        dq_u, dk_u, dv_u, dsinks, _, _ = heads_backward(
            dout_u, q_u, [k_u, v_u], out_u, lse_u, sinks, None, setup.ulysses, setup.ring
        )
    return dq_u, dk_u, dv_u, dsinks


def out_to_tokens(setup: HybridSetup, out_u: Tensor, num_heads: int) -> Tensor:
    """``out_u`` ``[B, L, H_mine, Dv]`` -> the token shard ``[B, S_local, num_heads, Dv]``."""
    with _scope(setup):
        return setup.ulysses.to_tokens([out_u], num_heads)


def exchanges_dout_first(setup: HybridSetup) -> bool:
    """Whether an eager call exchanges dout in an autograd node of its own (Note [Dout exchanged
    first]): every Ulysses call that does not split at the head shards."""
    return setup.ulysses is not None and not splits_at_heads(setup)


def dout_first_shapes(setup: HybridSetup, out: Tensor) -> tuple[torch.Size, torch.Size]:
    """The shapes of :func:`dout_first`'s results for the token shard ``out`` ``[B, S_local, H,
    Dv]``: ``[B, L, H_mine, Dv]`` (all ``L`` ring-local tokens of this rank's query heads) and
    ``[B, prefix + suffix, H, Dv]`` (the replicated rows)."""
    spec, p, s = setup.ulysses, setup.prefix, setup.suffix
    B, _, H, Dv = out.shape
    return torch.Size((B, sum(spec.token_sizes), spec.mine.q_len, Dv)), torch.Size((B, p + s, H, Dv))


def dout_first(setup: HybridSetup, dout: Tensor) -> DoutExchanged:
    """The token shard's dout ``[B, S_local, H, Dv]`` as the backward needs it (Note [Dout
    exchanged first]): the shard's rows exchanged to this rank's heads (:func:`dout_to_heads`)
    and a copy of the replicated rows (prefix then suffix; zero rows without them), both tensors
    of their own."""
    p, s = setup.prefix, setup.suffix
    dout_r = _replicated_rows(dout, p, s)
    return DoutExchanged(dout_to_heads(setup, dout[:, p:dout.shape[1] - s]), dout_r)


def dout_to_heads(setup: HybridSetup, dout: Tensor) -> Tensor:
    """Backward of :func:`out_to_tokens`: ``dout_u`` ``[B, L, H_mine, Dv]``, a tensor of its own."""
    with _scope(setup):
        (dout_u,) = setup.ulysses.to_heads_each([dout], "q", kept=True)
    return dout_u


def _replicated_rows(x: Tensor, prefix: int, suffix: int) -> Tensor:
    """The replicated rows of a bshd tensor: the first ``prefix`` and last ``suffix``."""
    return torch.cat([x[:, :prefix], x[:, x.shape[1] - suffix:]], 1)


def _with_replicated(rows: Tensor, body: Tensor, prefix: int) -> Tensor:
    """Replicated rows (prefix then suffix) around the shard's rows, along dim 1."""
    return torch.cat([rows[:, :prefix], body, rows[:, prefix:]], 1)


def hybrid_forward(
    setup: HybridSetup, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
    """One call's forward (see :func:`_hybrid_forward`), its transfer buffers in one workspace
    scope (Note [Workspace])."""
    with _scope(setup):
        return _hybrid_forward(setup, q, k, v, sinks)


def hybrid_backward(
    setup: HybridSetup, dout: Tensor | DoutExchanged, saved: Saved, sinks: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One call's backward (see :func:`_hybrid_backward`), its transfer buffers in one workspace
    scope (Note [Workspace])."""
    with _scope(setup):
        return _hybrid_backward(setup, dout, saved, sinks)


_NO_SCOPE = contextlib.nullcontext()


def _scope(setup: HybridSetup):
    """The workspace scope of one forward or backward (a no-op without a workspace)."""
    workspace = setup.ring.workspace
    return workspace.scope() if workspace is not None else _NO_SCOPE


def _hybrid_forward(setup: HybridSetup, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, ...]:
    """One call's forward (Note [Hybrid composition]); no autograd.

    Args:
        q: ``(batch, S_local, nheads, headdim)``: ``prefix`` replicated rows, the shard's rows,
            ``suffix`` replicated rows (packed: batch 1).
        k, v: ``(batch, S_local, nheads_kv, headdim)`` / ``(..., headdim_v)``, the same rows.
        sinks: ``(nheads,)`` sink logits or None.

    Returns:
        ``(out, lse_body, lse_replicated, heads)``: ``out`` ``(batch, S_local, nheads,
        headdim_v)`` in q's dtype; ``lse_body`` the shard's log-sum-exp (``(batch, H_mine,
        S_ring_local)`` under Ulysses, ``(batch, nheads, S_local)`` without), ``lse_replicated``
        ``(batch, nheads, prefix + suffix)``, both in the accumulator dtype; ``heads`` the
        Ulysses head shards ``(q_u, k_u, v_u, out_u)`` with ``keep_head_shards``, else ``()``.
        With the inputs (:meth:`Saved.of`; given the head shards and no replicated rows, the
        inputs' shapes suffice) they are what :func:`hybrid_backward` needs.
    """
    p, s = setup.prefix, setup.suffix
    if setup.replicated is None:
        out, lse, heads = _body_forward(setup, q, k, v, sinks, None)
        return out, lse, q.new_empty((q.shape[0], q.shape[2], 0), dtype=accumulator_dtype(q.dtype)), heads
    rows = slice(p, q.shape[1] - s)
    q_r, k_r, v_r = (_replicated_rows(t, p, s) for t in (q, k, v))
    out_body, lse_body, heads = _body_forward(setup, q[:, rows], k[:, rows], v[:, rows], sinks, (k_r, v_r))
    out_r, lse_r = replicated_forward(q_r, k_r, v_r, k[:, rows], v[:, rows], sinks, setup.replicated)
    return _with_replicated(out_r, out_body.to(out_r.dtype), p), lse_body, lse_r, heads


def _hybrid_backward(
    setup: HybridSetup, dout: Tensor | DoutExchanged, saved: Saved, sinks: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One call's backward from :func:`hybrid_forward`'s results (``saved``: its inputs, output,
    LSEs and head shards; the token shards' list emptied as they are sent, Note [Saved tensors
    handed over]); no autograd. ``dout``: the token shard's, or under Ulysses
    :func:`dout_first`'s (Note [Dout exchanged first]).

    Returns:
        ``(dq, dk, dv, dsinks)`` shaped like ``q, k, v, sinks`` (``dsinks`` None without sinks).
        Gradients of replicated rows and of ``sinks`` are this rank's partial shares (their sum
        over the CP group is the true gradient); every rank returns a tensor for each, also a
        rank that holds no query head (``H < ulysses_size``).
    """
    p, s = setup.prefix, setup.suffix
    exchanged = isinstance(dout, DoutExchanged)
    if exchanged and setup.ulysses is None:
        raise ValueError("hybrid_backward: dout exchanged to head shards needs a Ulysses group")
    if setup.replicated is None:
        return _body_backward(setup, dout, saved, sinks, None)[:4]
    # Calls with replicated rows keep their token shards (hands_over is false for them).
    q, k, v, out = saved.tokens
    rows = slice(p, q.shape[1] - s)
    q_r, k_r, v_r = (_replicated_rows(t, p, s) for t in (q, k, v))
    body = Saved.of(q[:, rows], k[:, rows], v[:, rows], out[:, rows], saved.lse, heads=saved.heads)
    dq_b, dk_b, dv_b, ds_b, dk_rb, dv_rb = _body_backward(
        setup, dout if exchanged else dout[:, rows], body, sinks, (k_r, v_r)
    )
    dq_r, dk_r, dv_r, dk_br, dv_br, ds_r = replicated_backward(
        dout.replicated if exchanged else _replicated_rows(dout, p, s), q_r, k_r, v_r, k[:, rows], v[:, rows],
        sinks, _replicated_rows(out, p, s), saved.lse_replicated, setup.replicated,
    )
    dsinks = None if sinks is None else ds_b + ds_r
    return (
        _with_replicated(dq_r, dq_b, p),
        _with_replicated(dk_r + dk_rb, dk_b + dk_br, p),
        _with_replicated(dv_r + dv_rb, dv_b + dv_br, p),
        dsinks,
    )
