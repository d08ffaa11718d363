"""The all-gather K/V transport: the ring plan executed with one all-gather instead of ``R - 1`` hops.

``ParallelState(..., ring_comm="allgather")`` selects it; *what* each step computes is still the
ring plan's (Note [Ring blocks]), *which rows travel where* is Note [All-gather K/V] in
``seqpar/placement/gather.py``, and the kernel calls, accumulators and LSE merge are the ring
driver's (``seqpar.parallel.ring``). :func:`kv_forward` / :func:`kv_backward` run a call with the
transport its setup names; ``seqpar.parallel.hybrid`` and the Ulysses composition call them.

Note [All-gather schedule]
~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    forward:   start the all-gather of the contributed K/V rows   ("gather", 0)
               compute step 0 on the local K/V (+ extra keys)     ("compute", 0)
               wait for the all-gather                            ("wait", 0)
               compute steps 1 .. R-1 on their slots              ("compute", i)

    backward:  start the all-gather again (nothing was kept)      ("gather", 0)
               step 0: dQ, dK/dV of the own rows                  ("compute", 0)
               wait; steps 1 .. R-1: dQ, dK/dV of slot src(i)     ("wait", 0), ("compute", i)
               start the reduce-scatter of the dK/dV slots        ("reduce_scatter", R-1)
               wait, add the summed slot to the own rows          ("wait_grad", R-1)

The gather overlaps step 0 (with few ring ranks, ``1 / R`` of the compute); the reduce-scatter
overlaps nothing, as in every all-gather based context parallelism. Gradients of remote rows are
written in the input dtype (each rank's sum of its kernel results, rounded once, as the ring sends
them) and summed by the reduce-scatter in that dtype; own rows are summed in the accumulator dtype.
Buffers live in the state's workspace (Note [Workspace]): the gathered K/V (``R * width`` rows),
the rank's own contribution, and in the backward the dK/dV slots (``R * width`` rows) and the
summed own slot. A step whose rows are not one range of its slot copies them into one buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from ..comm import Pending, start_all_gather, start_reduce_scatter
from ..placement.gather import GatherPlan
from .merge import accumulator_dtype, sinks_grad
from .ring import (
    RingSetup,
    _Accumulator,
    _buffer,
    _call_forward,
    _extra_grads,
    _local_grads,
    _Output,
    _record,
    _remote_grads_into,
    extra_block,
    ring_backward,
    ring_forward,
)

__all__ = ["AllGatherSetup", "allgather_forward", "allgather_backward", "kv_forward", "kv_backward"]


@dataclass(frozen=True, eq=False)
class AllGatherSetup:
    """A ring call run by all-gather: the ring's setup (group, plan, kernel, workspace, trace) and
    the gather layout of its ring group (:class:`~seqpar.placement.gather.GatherPlan`)."""

    ring: RingSetup
    gather: GatherPlan

    @property
    def workspace(self):
        """The ring setup's workspace (the scope of a call opens on it)."""
        return self.ring.workspace


def kv_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None, extra_v: Tensor | None,
    run: RingSetup | AllGatherSetup,
) -> tuple[Tensor, Tensor]:
    """:func:`~seqpar.parallel.ring.ring_forward` or :func:`allgather_forward`, by ``run``'s type."""
    if isinstance(run, AllGatherSetup):
        return allgather_forward(q, k, v, sinks, extra_k, extra_v, run)
    return ring_forward(q, k, v, sinks, extra_k, extra_v, run)


def kv_backward(
    dout: Tensor, q: Tensor, k: Tensor | None, v: Tensor | None, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, out: Tensor, lse: Tensor, run: RingSetup | AllGatherSetup,
    handed: list[Tensor] | None = None,
) -> tuple[Tensor | None, ...]:
    """:func:`~seqpar.parallel.ring.ring_backward` or :func:`allgather_backward`, by ``run``'s type;
    ``handed``: ``[k, v]`` instead of ``k, v``, for the p2p ring to free once sent (Note [Own K/V
    released]; the all-gather holds them to the end)."""
    if isinstance(run, AllGatherSetup):
        if handed is not None:
            k, v = handed
        return allgather_backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse, run)
    return ring_backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse, run, handed)


def _local_only(run: AllGatherSetup) -> bool:
    """Nothing travels (one ring rank, or a mask no rank reads a remote row of): the ring's own
    step 0 is the whole call."""
    return run.gather.ring_size == 1 or run.gather.width == 0


def _start_gather(run: AllGatherSetup, k: Tensor, v: Tensor) -> tuple[Pending, Tensor, Tensor]:
    """Start the all-gather of this rank's contributed K/V rows (one collective for K and V).

    Returns ``(pending, k_all, v_all)``: ``[R, B, width, Hkv, D]`` / ``[..., Dv]`` views of the
    gathered buffer, valid after ``pending.wait()``.
    """
    ring, g = run.ring, run.gather
    B, R, W = k.shape[0], g.ring_size, g.width
    nk, nv = B * W * math.prod(k.shape[2:]), B * W * math.prod(v.shape[2:])
    part = _buffer(ring, "allgather.part", (nk + nv,), k, k.dtype)
    k_part = part[:nk].view(B, W, *k.shape[2:])
    v_part = part[nk:].view(B, W, *v.shape[2:])
    off = 0
    for a, b in g.rows[g.ring_rank]:
        k_part[:, off:off + b - a].copy_(k[:, a:b])
        v_part[:, off:off + b - a].copy_(v[:, a:b])
        off += b - a
    gathered = _buffer(ring, "allgather.kv", (R, nk + nv), k, k.dtype)
    pending = start_all_gather(gathered.view(-1), part, ring.group)
    k_all = gathered[:, :nk].unflatten(1, (B, W, *k.shape[2:]))
    v_all = gathered[:, nk:].unflatten(1, (B, W, *v.shape[2:]))
    return pending, k_all, v_all


def _step_rows(run: AllGatherSetup, i: int, slot: Tensor, role: str, kv_len: int) -> Tensor:
    """Step ``i``'s compact buffer ``[B, kv_len, ...]`` from its slot: a view when its rows are one
    range there, else a copy into a workspace buffer."""
    ranges = run.gather.steps[i]
    if len(ranges) == 1:
        a, b = ranges[0]
        return slot[:, a:b]
    out = _buffer(run.ring, role, (slot.shape[0], kv_len, *slot.shape[2:]), slot, slot.dtype)
    off = 0
    for a, b in ranges:
        out[:, off:off + b - a].copy_(slot[:, a:b])
        off += b - a
    return out


def allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, run: AllGatherSetup,
) -> tuple[Tensor, Tensor]:
    """All-gather attention forward on ring-local buffers (Note [All-gather schedule]); no autograd.

    Args and returns as :func:`~seqpar.parallel.ring.ring_forward`: q ``[B, L, H, D]``, k / v
    ``[B, L, Hkv, D]`` / ``[B, L, Hkv, Dv]``, sinks ``[H]`` or None, extra_k / extra_v
    ``[B, P, Hkv, D]`` / ``[..., Dv]`` or None; ``out`` ``[B, L, H, Dv]`` in q's dtype and ``lse``
    ``[B, H, L]`` in the accumulator dtype.
    """
    ring = run.ring
    if _local_only(run):
        return ring_forward(q, k, v, sinks, extra_k, extra_v, ring)
    steps = ring.plan.steps
    result = _Output(q, (*q.shape[:3], v.shape[-1]))
    cache: dict = {}
    pending, k_all, v_all = _start_gather(run, k, v)
    _record(ring, "gather", 0)
    _record(ring, "compute", 0)
    for call in steps[0].calls:
        result.add(*_call_forward(ring, call, q, k, v, cache))
    if (call := extra_block(q, extra_k)) is not None:
        result.add(*_call_forward(ring, call, q, extra_k, extra_v, cache))
    pending.wait()
    _record(ring, "wait", 0)
    for i, step in enumerate(steps[1:], 1):
        if not step.calls:
            continue
        _record(ring, "compute", i)
        k_i = _step_rows(run, i, k_all[step.src], "allgather.step_k", step.kv_len)
        v_i = _step_rows(run, i, v_all[step.src], "allgather.step_v", step.kv_len)
        for call in step.calls:
            result.add(*_call_forward(ring, call, q, k_i, v_i, cache))
    return result.result(sinks)


def allgather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, out: Tensor, lse: Tensor, run: AllGatherSetup,
) -> tuple[Tensor | None, ...]:
    """All-gather attention backward (Note [All-gather schedule]); no autograd.

    Returns, as :func:`~seqpar.parallel.ring.ring_backward`, ``dq, dk, dv, dsinks, dextra_k,
    dextra_v`` (None where the input is None); ``dk``/``dv`` are the gradients of this rank's own
    K/V summed over every rank's queries.
    """
    ring, g = run.ring, run.gather
    if _local_only(run):
        return ring_backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse, ring)
    steps = ring.plan.steps
    acc = accumulator_dtype(q.dtype)
    dq = _Accumulator(q.shape, acc, q.device)
    dk, dv = _Accumulator(k.shape, acc, k.device), _Accumulator(v.shape, acc, v.device)
    cache: dict = {}

    pending, k_all, v_all = _start_gather(run, k, v)
    _record(ring, "gather", 0)
    _record(ring, "compute", 0)
    _local_grads(ring, steps[0].calls, dout, q, k, v, out, lse, dq, dk, dv, cache)
    dextra = _extra_grads(ring, dout, q, extra_k, extra_v, out, lse, dq, cache)
    pending.wait()
    _record(ring, "wait", 0)

    # dK/dV slots shaped like the gathered buffer; slots (and rows) no step writes stay zero.
    R, B, W = g.ring_size, k.shape[0], g.width
    nk, nv = B * W * math.prod(k.shape[2:]), B * W * math.prod(v.shape[2:])
    grads = _buffer(ring, "allgather.grad", (R, nk + nv), k, k.dtype).zero_()
    gk_all = grads[:, :nk].unflatten(1, (B, W, *k.shape[2:]))
    gv_all = grads[:, nk:].unflatten(1, (B, W, *v.shape[2:]))
    for i, step in enumerate(steps[1:], 1):
        if not step.calls:
            continue
        _record(ring, "compute", i)
        k_i = _step_rows(run, i, k_all[step.src], "allgather.step_k", step.kv_len)
        v_i = _step_rows(run, i, v_all[step.src], "allgather.step_v", step.kv_len)
        ranges = g.steps[i]
        if len(ranges) == 1:  # straight into the slot
            a, b = ranges[0]
            _remote_grads_into(ring, step.calls, dout, q, k_i, v_i, out, lse, dq, gk_all[step.src][:, a:b],
                               gv_all[step.src][:, a:b], cache)
            continue
        gk = _buffer(ring, "allgather.step_grad_k", tuple(k_i.shape), k, k.dtype)
        gv = _buffer(ring, "allgather.step_grad_v", tuple(v_i.shape), v, v.dtype)
        _remote_grads_into(ring, step.calls, dout, q, k_i, v_i, out, lse, dq, gk, gv, cache)
        off = 0
        for a, b in ranges:
            gk_all[step.src][:, a:b].copy_(gk[:, off:off + b - a])
            gv_all[step.src][:, a:b].copy_(gv[:, off:off + b - a])
            off += b - a
    home = _buffer(ring, "allgather.grad_home", (nk + nv,), k, k.dtype)
    pending = start_reduce_scatter(home, grads.view(-1), ring.group)
    _record(ring, "reduce_scatter", len(steps) - 1)
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
    pending.wait()
    _record(ring, "wait_grad", len(steps) - 1)
    hk, hv = home[:nk].view(B, W, *k.shape[2:]), home[nk:].view(B, W, *v.shape[2:])
    off = 0
    for a, b in g.rows[g.ring_rank]:
        dk.add(slice(a, b), hk[:, off:off + b - a], owned=False)  # workspace rows are reused
        dv.add(slice(a, b), hv[:, off:off + b - a], owned=False)
        off += b - a
    dek = dev = None
    if dextra is not None:
        dek, dev = dextra[0].result().to(extra_k.dtype), dextra[1].result().to(extra_v.dtype)
    return dq.result().to(q.dtype), dk.result().to(k.dtype), dv.result().to(v.dtype), dsinks, dek, dev
