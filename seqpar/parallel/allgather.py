"""The all-gather K/V transport: the ring plan executed with one all-gather instead of ``R - 1`` hops.

``ParallelState(..., ring_comm="allgather")`` selects it; *what* each step computes is still the
ring plan's (Note [Ring blocks]), *which rows travel where* is Note [All-gather K/V] in
``seqpar/placement/gather.py``, and the loops, kernel calls, accumulators and LSE merge are the ring
driver's (``seqpar.parallel.ring``): :class:`AllGather` is one of its transports (Note [Ring
transports]). :func:`kv_forward` / :func:`kv_backward` run a call with the transport its setup
names; ``seqpar.parallel.hybrid`` and the Ulysses composition call them.

Note [All-gather schedule]
~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    forward:   step 0: start the all-gather of the contributed K/V rows  ("gather", 0)
                       compute on the local K/V (+ extra keys)           ("compute", 0)
               step 1: wait for the all-gather                           ("wait", 0)
               steps 1 .. R-1: compute on slot src(i)                    ("compute", i)

    backward:  the same, gathered again (nothing was kept); steps 1 .. R-1 write the dK/dV of
               slot src(i) into that slot of the gradients' buffer
               then: start the reduce-scatter of the dK/dV slots         ("reduce_scatter", R-1)
                     wait, add the summed slot to the own rows           ("wait_grad", R-1)

The gather overlaps step 0 (with few ring ranks, ``1 / R`` of the compute); the reduce-scatter
overlaps nothing, as in every all-gather based context parallelism. Gradients of remote rows are
written in the input dtype (each rank's sum of its kernel results, rounded once, as the ring sends
them) and summed by the reduce-scatter in that dtype; own rows are summed in the accumulator dtype.
Buffers live in the state's workspace (Note [Workspace]): the gathered K/V (``R * width`` rows,
freed after the last step's kernels), the rank's own contribution, and in the backward the dK/dV
slots (``R * width`` rows) and the summed own slot. A step whose rows are not one range of its
slot copies them into one buffer, and its dK/dV from one buffer into their ranges of the slot. The
own K/V are held to the end of the call (the ring's p2p transports free them once sent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from ..comm import start_all_gather, start_reduce_scatter
from ..placement.gather import GatherPlan
from .ring import Extra, RingSetup, Transport, ring_backward, ring_forward

__all__ = ["AllGatherSetup", "AllGather", "kv_forward", "kv_backward"]


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

    def transport(self) -> Transport:
        """A fresh transport for one forward or backward: :class:`AllGather`, or the ring's own
        where nothing travels (one ring rank, or a mask no rank reads a remote row of)."""
        if self.gather.ring_size == 1 or self.gather.width == 0:
            return self.ring.transport()
        return AllGather(self.ring, self.gather)


def kv_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra: Extra, run: RingSetup | AllGatherSetup,
) -> tuple[Tensor, Tensor]:
    """:func:`~seqpar.parallel.ring.ring_forward` with the transport ``run`` names."""
    return ring_forward(q, k, v, sinks, extra, _ring(run), run.transport())


def kv_backward(
    dout: Tensor, q: Tensor, kv: list[Tensor], sinks: Tensor | None, extra: Extra, out: Tensor, lse: Tensor,
    run: RingSetup | AllGatherSetup,
) -> tuple[Tensor | None, ...]:
    """:func:`~seqpar.parallel.ring.ring_backward` with the transport ``run`` names (``kv``: the
    list ``[k, v]`` the p2p transports empty once sent, Note [Own K/V released])."""
    return ring_backward(dout, q, kv, sinks, extra, out, lse, _ring(run), run.transport())


def _ring(run: RingSetup | AllGatherSetup) -> RingSetup:
    return run.ring if isinstance(run, AllGatherSetup) else run


class AllGather(Transport):
    """Every step's K/V from one all-gather of the ring group, the dK/dV home by one
    reduce-scatter (Note [All-gather schedule])."""

    # A step's dK/dV are written into their slot of the reduce-scatter's buffer.
    sends_kernel_results = False

    def __init__(self, run: RingSetup, gather: GatherPlan) -> None:
        super().__init__(run)
        self.gather = gather

    def start(self, kv: list[Tensor]) -> None:
        super().start(kv)  # held to the end: the list is never emptied
        self.pending = self.k_all = self.v_all = None  # the all-gather in flight, its K and V views
        self.grads = None  # (buffer, dK slots, dV slots) of the backward, once written

    def _sizes(self) -> tuple[int, int]:
        """Elements of one slot's K and of its V: ``B * width * Hkv * D`` / ``... * Dv``."""
        (k, v), W = self.like, self.gather.width
        return k.shape[0] * W * math.prod(k.shape[2:]), v.shape[0] * W * math.prod(v.shape[2:])

    def _slots(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """``flat`` ``[R, nk + nv]`` as K and V slots: ``[R, B, width, Hkv, D]`` / ``[..., Dv]``."""
        (k, v), W, (nk, _) = self.like, self.gather.width, self._sizes()
        return (flat[:, :nk].unflatten(1, (k.shape[0], W, *k.shape[2:])),
                flat[:, nk:].unflatten(1, (v.shape[0], W, *v.shape[2:])))

    def kv(self, i: int) -> tuple[Tensor | None, Tensor | None]:
        if i == 0:
            self._start_gather()
            self.record("gather", 0)
            return self.k, self.v
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.record("wait", 0)
        step = self.steps[i]
        kv = None, None
        if step.calls:
            # A view where the step's rows are one range of the slot (the kernels take strided
            # K/V), else a copy.
            ranges = self.gather.steps[i]
            kv = (self.rows("allgather.step_k", self.k_all[step.src], ranges, contiguous=False),
                  self.rows("allgather.step_v", self.v_all[step.src], ranges, contiguous=False))
        if i == len(self.steps) - 1:  # read for the last time by this step's kernels
            self.k_all = self.v_all = None
        return kv

    def _start_gather(self) -> None:
        """Start the all-gather of this rank's contributed K/V rows (one collective for K and V)."""
        k, v, g = self.k, self.v, self.gather
        nk, nv = self._sizes()
        part = self.buffer("allgather.part", (nk + nv,), k, k.dtype)
        k_part = part[:nk].view(k.shape[0], g.width, *k.shape[2:])
        v_part = part[nk:].view(v.shape[0], g.width, *v.shape[2:])
        off = 0
        for a, b in g.rows[g.ring_rank]:
            k_part[:, off:off + b - a].copy_(k[:, a:b])
            v_part[:, off:off + b - a].copy_(v[:, a:b])
            off += b - a
        gathered = self.buffer("allgather.kv", (g.ring_size, nk + nv), k, k.dtype)
        self.pending = start_all_gather(gathered.view(-1), part, self.run.group)
        self.k_all, self.v_all = self._slots(gathered)

    def _grad_slots(self) -> tuple[Tensor, Tensor, Tensor]:
        """The dK/dV slots shaped like the gathered buffer; slots (and rows) no step writes stay zero."""
        if self.grads is None:
            k = self.like[0]
            flat = self.buffer("allgather.grad", (self.gather.ring_size, sum(self._sizes())), k, k.dtype).zero_()
            self.grads = (flat, *self._slots(flat))
        return self.grads

    def grad_buffers(self, i: int) -> tuple[Tensor, Tensor]:
        _, gk_all, gv_all = self._grad_slots()
        step, ranges = self.steps[i], self.gather.steps[i]
        if len(ranges) == 1:  # straight into the slot
            a, b = ranges[0]
            return gk_all[step.src][:, a:b], gv_all[step.src][:, a:b]
        k, v = self.like
        return (self.buffer("allgather.step_grad_k", (k.shape[0], step.kv_len, *k.shape[2:]), k, k.dtype),
                self.buffer("allgather.step_grad_v", (v.shape[0], step.kv_len, *v.shape[2:]), v, v.dtype))

    def send_grads(self, i: int, gk: Tensor | None, gv: Tensor | None, dk, dv) -> None:
        ranges = self.gather.steps[i]
        if gk is None or len(ranges) == 1:  # nothing written, or written in the slot itself
            return
        _, gk_all, gv_all = self._grad_slots()
        src, off = self.steps[i].src, 0
        for a, b in ranges:
            gk_all[src][:, a:b].copy_(gk[:, off:off + b - a])
            gv_all[src][:, a:b].copy_(gv[:, off:off + b - a])
            off += b - a

    def collect(self, dk, dv) -> None:
        flat, _, _ = self._grad_slots()
        k, v = self.like
        nk, _ = self._sizes()
        home = self.buffer("allgather.grad_home", (flat.shape[1],), k, k.dtype)
        pending = start_reduce_scatter(home, flat.view(-1), self.run.group)
        self.record("reduce_scatter", len(self.steps) - 1)
        pending.wait()
        self.record("wait_grad", len(self.steps) - 1)
        self.grads = flat = None
        W = self.gather.width
        hk = home[:nk].view(k.shape[0], W, *k.shape[2:])
        hv = home[nk:].view(v.shape[0], W, *v.shape[2:])
        self.add_rows(dk, dv, hk, hv, self.gather.rows[self.gather.ring_rank])
