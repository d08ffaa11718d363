"""Queries replicated on every CP rank (the text tokens of joint attention) over sharded keys.

Note [Replicated tokens]
~~~~~~~~~~~~~~~~~~~~~~~~
In joint text+image attention (Flux, SD3, HunyuanVideo) the ``P`` text tokens are the same on
every CP rank and the image tokens are sharded. Attention is non-causal, so:

- *image queries* attend the image keys of all ranks (Ulysses/ring, as usual) plus the text keys,
  which every rank has: the text K/V join the ring as local extra keys (``ring_forward``'s
  ``extra_k``/``extra_v``, sliced to the rank's heads under Ulysses) and never travel;
- *text queries* attend the text keys (the same block on every rank) and the image keys of every
  rank. Each rank computes the text queries against its own image shard only (all heads, before
  any all-to-all: work is split evenly) and the partial results are merged across the CP group by
  their LSE: one all-reduce (max) of the ``[B, H, P]`` LSE and one all-reduce (sum) of the
  weighted ``[B, P, H, Dv]`` outputs. The text-text block, identical everywhere, is merged after.

Gradients follow the partial rule: the incoming text-output gradient on each rank is that rank's
share. The text-text block's backward uses it as is (its gradients are shares too, summing to the
true ones over the group); the image block's backward needs the *whole* gradient, because the
image keys it differentiates live on this rank only, so the shares are summed over the group (one
all-reduce of ``[B, P, H, Dv]``). Its dq is then this rank's keys' part of the text queries'
gradient, again a share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends.base import KernelBackend, empty_forward
from ..comm import Group, reduce_
from .merge import accumulator_dtype, add_sinks, merge, merge_over_group, sinks_grad

__all__ = ["ReplicatedSetup", "replicated_forward", "replicated_backward"]


@dataclass(frozen=True, eq=False)
class ReplicatedSetup:
    """The CP group, backend and scalar options of one call."""

    group: Group
    backend: KernelBackend
    scale: float
    softcap: float


def _block(run: ReplicatedSetup, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(out [B, P, H, Dv], lse [B, H, P])`` of one block (empty sides: zeros and ``-inf``)."""
    if q.shape[1] == 0 or k.shape[1] == 0:
        return empty_forward(q, (q.shape[0], q.shape[2], q.shape[1]), v.shape[-1])
    return run.backend.kernel_forward(q, k, v, scale=run.scale, window=(-1, -1), softcap=run.softcap)


def _block_backward(run: ReplicatedSetup, dout, q, k, v, out, lse) -> tuple[Tensor, Tensor, Tensor]:
    if q.shape[1] == 0 or k.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return run.backend.kernel_backward(
        dout, q, k, v, out, lse, scale=run.scale, window=(-1, -1), softcap=run.softcap
    )


def replicated_forward(
    q: Tensor, k_rep: Tensor, v_rep: Tensor, k_loc: Tensor, v_loc: Tensor, sinks: Tensor | None,
    run: ReplicatedSetup,
) -> tuple[Tensor, Tensor]:
    """Attention of replicated queries over replicated keys and every rank's key shard (no
    autograd; Note [Replicated tokens]); collective over ``run.group``.

    Args:
        q: ``(batch, P, nheads, headdim)``, the same on every rank.
        k_rep, v_rep: ``(batch, P_k, nheads_kv, headdim)`` / ``(..., headdim_v)``, the same on
            every rank.
        k_loc, v_loc: ``(batch, S_local, nheads_kv, headdim)`` / ``(..., headdim_v)``, this
            rank's shard of the others.
        sinks: ``(nheads,)`` sink logits or None.

    Returns:
        ``out`` ``(batch, P, nheads, headdim_v)`` in q's dtype, the same on every rank, and ``lse``
        ``(batch, nheads, P)`` in the accumulator dtype.
    """
    out_t, lse_t = _block(run, q, k_rep, v_rep)  # the same on every rank
    out_l, lse_l = _block(run, q, k_loc, v_loc)  # this rank's image shard
    out_l, lse_l = merge_over_group(out_l, lse_l, run.group)
    out, lse = merge(out_t, lse_t, out_l, lse_l)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def replicated_backward(
    dout: Tensor, q: Tensor, k_rep: Tensor, v_rep: Tensor, k_loc: Tensor, v_loc: Tensor,
    sinks: Tensor | None, out: Tensor, lse: Tensor, run: ReplicatedSetup,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients ``(dq, dk_rep, dv_rep, dk_loc, dv_loc, dsinks)`` from :func:`replicated_forward`'s
    ``out`` and ``lse``; ``dq``, ``dk_rep`` and ``dv_rep`` are this rank's partial shares."""
    dq_t, dk_rep, dv_rep = _block_backward(run, dout, q, k_rep, v_rep, out, lse)
    # A fresh buffer: the all-reduce is in place and dout is still needed as this rank's share.
    whole = dout.to(accumulator_dtype(dout.dtype), memory_format=torch.contiguous_format, copy=True)
    whole = reduce_(whole, run.group, "sum").to(dout.dtype)
    dq_l, dk_loc, dv_loc = _block_backward(run, whole, q, k_loc, v_loc, out, lse)
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
    return dq_t + dq_l, dk_rep, dv_rep, dk_loc, dv_loc, dsinks
