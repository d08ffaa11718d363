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
from ..placement.ring import BlockCall, SegmentCall, split_wide_blocks
from .merge import accumulator_dtype, add_sinks, merge_, new_accumulators, sinks_grad
from .ring import (
    RingSetup,
    _Accumulator,
    _buffer,
    _call_backward,
    _call_backward_into,
    _call_forward,
    _disjoint_keys,
    _record,
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
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, out: Tensor, lse: Tensor, run: RingSetup | AllGatherSetup,
) -> tuple[Tensor | None, ...]:
    """:func:`~seqpar.parallel.ring.ring_backward` or :func:`allgather_backward`, by ``run``'s type."""
    if isinstance(run, AllGatherSetup):
        return allgather_backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse, run)
    return ring_backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse, run)


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
    acc = accumulator_dtype(q.dtype)
    B, L, H, _ = q.shape
    out_shape = (B, L, H, v.shape[-1])
    out_acc: Tensor | None = None
    lse_acc: Tensor | None = None
    cache: dict = {}

    def merge(rows, out, lse) -> None:
        nonlocal out_acc, lse_acc
        if out_acc is None:
            if rows is None or (rows.start == 0 and rows.stop == L):
                out_acc, lse_acc = out.to(acc), lse.to(acc)
                return
            out_acc, lse_acc = new_accumulators(out_shape, device=q.device, dtype=q.dtype)
        if rows is None:
            merge_(out_acc, lse_acc, out, lse)
        else:
            merge_(out_acc[:, rows], lse_acc[..., rows], out, lse)

    pending, k_all, v_all = _start_gather(run, k, v)
    _record(ring, "gather", 0)
    _record(ring, "compute", 0)
    for call in steps[0].calls:
        merge(*_call_forward(ring, call, q, k, v, cache))
    if extra_k is not None and extra_k.shape[1] and L:
        call = BlockCall(0, L, 0, extra_k.shape[1], (-1, -1))
        merge(*_call_forward(ring, call, q, extra_k, extra_v, cache))
    pending.wait()
    _record(ring, "wait", 0)
    for i, step in enumerate(steps[1:], 1):
        if not step.calls:
            continue
        _record(ring, "compute", i)
        k_i = _step_rows(run, i, k_all[step.src], "allgather.step_k", step.kv_len)
        v_i = _step_rows(run, i, v_all[step.src], "allgather.step_v", step.kv_len)
        for call in step.calls:
            merge(*_call_forward(ring, call, q, k_i, v_i, cache))
    if out_acc is None:
        out_acc, lse_acc = new_accumulators(out_shape, device=q.device, dtype=q.dtype)
    if sinks is not None:
        out_acc, lse_acc = add_sinks(out_acc, lse_acc, sinks)
    return out_acc.to(q.dtype), lse_acc


def _step_grads(
    run: AllGatherSetup, step, i: int, dout, q, k_i, v_i, out, lse, dq: _Accumulator, gk: Tensor, gv: Tensor,
    cache: dict,
) -> None:
    """dQ of step ``i`` into ``dq``; dK/dV of its compact K/V rows into ``gk`` / ``gv``
    (``[B, kv_len, ...]`` in the input dtype, every row written)."""
    ring = run.ring
    acc = accumulator_dtype(q.dtype)
    calls = split_wide_blocks(step.calls)
    if not any(isinstance(c, SegmentCall) for c in calls) and _disjoint_keys(calls):
        gk.zero_()  # rows no call reads (none in a plan's compact buffer) stay zero
        gv.zero_()
        for call in calls:
            rows, cols, g_q, g_k, g_v = _call_backward(ring, call, dout, q, k_i, v_i, out, lse, cache)
            dq.add(rows, g_q)
            (gk if cols is None else gk[:, cols]).copy_(g_k)
            (gv if cols is None else gv[:, cols]).copy_(g_v)
            del g_q, g_k, g_v
        return
    sum_k = _buffer(ring, "allgather.sum_grad_k", tuple(gk.shape), gk, acc).zero_()
    sum_v = _buffer(ring, "allgather.sum_grad_v", tuple(gv.shape), gv, acc).zero_()
    for call in calls:
        if isinstance(call, SegmentCall):
            _call_backward_into(ring, call, dout, q, k_i, v_i, out, lse, (dq.result(), sum_k, sum_v), cache)
            continue
        rows, cols, g_q, g_k, g_v = _call_backward(ring, call, dout, q, k_i, v_i, out, lse, cache)
        dq.add(rows, g_q)
        sum_k[:, cols] += g_k
        sum_v[:, cols] += g_v
        del g_q, g_k, g_v
    gk.copy_(sum_k)
    gv.copy_(sum_v)


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
    for call in steps[0].calls:
        if isinstance(call, SegmentCall):  # added in place, sequence by sequence
            _call_backward_into(ring, call, dout, q, k, v, out, lse, (dq.result(), dk.result(), dv.result()), cache)
            continue
        rows, cols, g_q, g_k, g_v = _call_backward(ring, call, dout, q, k, v, out, lse, cache)
        dq.add(rows, g_q)
        dk.add(cols, g_k)
        dv.add(cols, g_v)
        del g_q, g_k, g_v
    dextra = None
    if extra_k is not None:
        dextra = (_Accumulator(extra_k.shape, acc, q.device), _Accumulator(extra_v.shape, acc, q.device))
        if extra_k.shape[1] and q.shape[1]:
            call = BlockCall(0, q.shape[1], 0, extra_k.shape[1], (-1, -1))
            _, cols, g_q, g_k, g_v = _call_backward(ring, call, dout, q, extra_k, extra_v, out, lse, cache)
            dq.add(None, g_q)
            dextra[0].add(cols, g_k)
            dextra[1].add(cols, g_v)
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
            _step_grads(run, step, i, dout, q, k_i, v_i, out, lse, dq, gk_all[step.src][:, a:b],
                        gv_all[step.src][:, a:b], cache)
            continue
        gk = _buffer(ring, "allgather.step_grad_k", tuple(k_i.shape), k, k.dtype)
        gv = _buffer(ring, "allgather.step_grad_v", tuple(v_i.shape), v, v.dtype)
        _step_grads(run, step, i, dout, q, k_i, v_i, out, lse, dq, gk, gv, cache)
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
