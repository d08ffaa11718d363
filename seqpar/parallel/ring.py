"""The ring driver: executes a :class:`~seqpar.placement.RingPlan`, forward and backward.

Dense and packed attention both run here (packed buffers are a batch of one); *what* each step
computes is the plan's (Note [Ring blocks]), *how the K/V get there* is a transport's (Note [Ring
transports]), and the kernels, accumulators and merging are this module's. ``ring_forward`` /
``ring_backward`` are plain functions (kernels, merging, transfers; no autograd) on inputs the
public entry points validated; ``seqpar.parallel.hybrid`` composes them with Ulysses.

Note [Ring transports]
~~~~~~~~~~~~~~~~~~~~~~
One forward loop and one backward loop run every step of the plan, whatever moves the K/V; a
:class:`Transport` is asked for them and for where the gradients go::

    forward:   step i:  k_i, v_i = t.kv(i); step i's calls, merged by LSE
    backward:  step i:  k_i, v_i = t.kv(i); step i's calls: dQ, and dK/dV of the rows of src(i)
                        (own accumulators at i = 0), written into t.grad_buffers(i) or, where
                        t.sends_kernel_results, sent as the kernel returned them; t.send_grads(i)
               then     t.collect(dk, dv): the own rows' dK/dV from every rank, added home

When a transfer starts and completes, which buffers it uses and when this rank's own K/V may
go is the transport's; which calls run and when a step's buffers die is the loops'. Three
transports: :class:`P2P` (one hop per step, overlapping the next step's compute, Note [Ring
schedule]), :class:`SerialP2P` (the same hops, each completed before its step's kernels, Note
[Serial ring]) and ``seqpar.parallel.allgather.AllGather`` (one all-gather and one
reduce-scatter, Note [All-gather schedule]), on the same plan (host maths, Note [Ring blocks]).
Every rank of a ring runs the same transport, as their messages pair up in its order (the
transport is part of the call signature ``checks`` compares).

Note [Ring schedule]
~~~~~~~~~~~~~~~~~~~~
Step ``i`` (``i = 0 .. R-1``) of ring rank ``r`` attends the K/V of ``src = (r - i) mod R`` and
sends its own K/V rows to ``dst = (r + i) mod R``; every transfer is one hop, only the rows the
plan says the receiver reads, received into one of two alternating buffers (ping-pong). The
:class:`P2P` transport::

    forward, step i:   wait for the K/V of step i                               ("wait", i)
                       post  K/V rows -> dst(i+1), K/V rows of src(i+1) <-     ("post", i+1)
                       compute step i's calls, merge into the fp32 accumulators ("compute", i)

    backward, step i:  K/V exactly as in the forward                ("wait", i), ("post", i+1)
                       compute step i: dQ into its accumulator, dK/dV of the
                       rows of src(i) (own accumulators at i = 0)              ("compute", i)
                       wait for step i-1's gradients, add them to own rows     ("wait_grad", i-1)
                       post  dK/dV -> src(i), dK/dV of own rows <- dst(i)      ("post_grad", i)

The K/V of step i+1 travel while step i computes, and step i's gradients while step i+1
computes (``trace``, a list, records the events for tests). Every rank posts its point-to-point
operations in the same order, so the messages of each pair of ranks pair up in order. A step the
plan leaves empty moves nothing and runs no kernel. Results are merged by LSE in fp32
(``seqpar.parallel.merge``); sinks join last (Note [Attention sinks]). Extra local K/V (replicated
text tokens of joint attention) are attended by every query row at step 0 and never travel.

Memory (buffers from the workspace, Note [Workspace]: fresh per call by default, freed once
dead): the K/V of two steps (the one computed, the one arriving), one staging copy of the rows
sent when they are not one contiguous view, the dK/dV of two steps (the one computed, the one
in flight) and one receive slot for gradients (with H == Hkv about 9 shards of K/V next to the
output and the three gradients at the backward's peak: the price of overlapping every transfer);
accumulators start as the first kernel result that covers every row (no zero fill), kernel
results are dropped as soon as they are added, and large unmasked blocks that are not a whole
step run their backward in two halves of the keys (smaller kernel results). Only q, k, v, out
and the LSE of the shard are saved for backward; the sinks' gradient is computed first, before
any step buffer exists. Without overlap (Note [Serial ring]) only the step's own K/V and
gradients are held.

Note [Gradients sent as computed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The dK/dV of a remote step travel back in the input dtype, one buffer per step. When the step
is one kernel call over all of its key rows (every remote step of dense causal or full attention
on the zig-zag placement), the kernel's own dK/dV results are that buffer: a point-to-point
transport sends them as they are, with no send slot and no copy, and they die when the transfer
completes. Otherwise the results are written into the transport's buffers (the p2p rings' send
slots: two, alternating, as the previous step's may still be in flight; the all-gather's slot of
``src``); sums over several calls (segments, shared key rows) are made in that buffer itself when
it is in the accumulator dtype. The ring's peak fell 3-11% on the CPU (docs/performance.md).

A grouped-query step (fewer K/V heads than query heads) on a backend whose backward expands K/V
heads (``KernelBackend.backward_expands_kv_heads``: FlashAttention on CUDA keeps dK/dV of all
query heads while it runs, the efficient and reference kernels repeat K/V first) is the
exception: a whole-step call's scratch is ``2 * group`` K/V-sized tensors over every key row, so
its wide blocks run as two key halves into a send slot instead. In units of one K/V-sized tensor
of the step that is ``5 + group`` at the kernel (two slots, half the scratch, half the results)
against ``4 + 2 * group`` sent as computed: less from a group of 2 (measured on an H200:
docs/performance.md). The PyTorch CPU kernel adds each query head into its K/V head (no expanded
scratch), so on the CPU grouped steps travel as computed too.

Note [Step buffers released]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A remote step's K/V buffers are read for the last time by its kernels. The backward loop drops
its references to them right there, before the transport allocates the buffers that receive this
rank's own dK/dV, and transports hand a step's buffers over without keeping them, so one
reference dies, not two. Otherwise the step's K/V lived until the next step's arrived: on the last
step of a ring of 2 they sat next to the kernel's dK/dV and the receive buffers, which made that
moment the layer's peak (it is back at a kernel now).

Note [Own K/V released]
~~~~~~~~~~~~~~~~~~~~~~~
A rank's own K/V are read by step 0's kernels and by the transfers that send its rows; once the
last of those has completed (the K/V of the last step have arrived, so every send before them is
done) nothing reads them. Under Ulysses they are the head shards the backward itself received,
so ``ulysses_ring_backward`` hands them over (``ring_backward``'s list ``kv = [k_u, v_u]``,
holding no other reference) and the p2p transports empty the list there: they are freed before
the remaining steps' kernels.
On a ring of 2 that is the one remote step, the layer's peak with H == Hkv (docs/performance.md).
What outlives them -- their shapes and dtypes, for the gradients -- is kept in storage-less
tensors (:attr:`Transport.like`). Ring-only calls read the token shards autograd saved, which stay
alive anyway; the all-gather holds them to the end of the call.

Note [Serial ring]
~~~~~~~~~~~~~~~~~~
``ParallelState(ring_comm="p2p_serial")`` (``RingSetup.overlap=False``, the :class:`SerialP2P`
transport) runs the same plan with no transfer in flight next to a kernel::

    forward, step i > 0:   post K/V rows -> dst(i), K/V rows of src(i) <-; wait  ("post", i), ("wait", i)
                           compute step i's calls                                ("compute", i)
    backward, step i > 0:  the same K/V exchange, then compute step i            ("compute", i)
                           post dK/dV -> src(i), own dK/dV <- dst(i); wait;
                           add them home                                 ("post_grad", i), ("wait_grad", i)

The previous step's K/V buffers are dropped before the next step's are allocated, so next to a
kernel a rank holds only what it computes with: its shard's tensors, the accumulators, one
step's K/V and the kernel's results. The overlapped schedule also holds the next step's K/V and
the previous step's dK/dV both ways, with H == Hkv about four shards of K/V more at the
backward's peak. The price is time: no transfer hides behind a kernel, so a step lasts its
compute plus its transfers (the planner prices it so, ``seqpar.plan(ring_comm="p2p_serial")``).
The messages between two ranks come in another order than the overlapped schedule's (Note [Ring
transports]). Results are bitwise those of ``"p2p"`` (the same kernels, summed in the same
order). Measured figures: docs/performance.md, "The serial ring".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends.base import KernelBackend, Packing
from ..comm import Group, Workspace, post
from ..placement.ring import (
    BlockCall, RingPlan, SegmentCall, Step, is_single_block, sent_as_computed, split_wide_blocks, sums_keys,
)
from .merge import accumulator_dtype, add_sinks, merge_, new_accumulators, sinks_grad

__all__ = ["RingSetup", "Transport", "P2P", "SerialP2P", "Extra", "extra_block", "ring_forward", "ring_backward"]

# Replicated keys and values every query of the call also attends (joint attention's text rows,
# Note [Replicated tokens]): ``(extra_k, extra_v)``, local to every rank, never sent; or None.
Extra = tuple[Tensor, Tensor] | None


@dataclass(frozen=True, eq=False)
class RingSetup:
    """Everything a ring call needs besides its tensors (built once per call by the caller).

    Attributes:
        group: the ring group; plan: this rank's :class:`~seqpar.placement.RingPlan`;
        backend, scale, softcap: the kernel and its scalar options;
        alibi: ``[H]`` ALiBi slopes of this rank's query heads (Note [ALiBi blocks]), or None;
        workspace: reused transfer buffers (Note [Workspace]), or None to allocate per call;
        trace: a list to record the schedule's events in (tests), or None;
        overlap: the point-to-point transport: ``True`` :class:`P2P` (each step's transfers
            overlap another step's kernels, Note [Ring schedule]); ``False`` :class:`SerialP2P`
            (they complete before the step's kernels run, Note [Serial ring],
            ``ring_comm="p2p_serial"``).
    """

    group: Group
    plan: RingPlan
    backend: KernelBackend
    scale: float
    softcap: float
    workspace: Workspace | None = None
    trace: list | None = None
    alibi: Tensor | None = None
    overlap: bool = True

    def transport(self) -> Transport:
        """A fresh point-to-point transport for one forward or backward (:attr:`overlap`)."""
        return P2P(self) if self.overlap else SerialP2P(self)


def _alibi(run: RingSetup, call) -> dict:
    """The kernel's ALiBi keyword for a dense block call (empty without ALiBi)."""
    return {} if run.alibi is None else {"alibi": (run.alibi, call.offset)}


def _record(run: RingSetup, event: str, step: int) -> None:
    if run.trace is not None:
        run.trace.append((event, step))


def _buffer(run: RingSetup, role: str, shape: tuple[int, ...], like: Tensor, dtype: torch.dtype) -> Tensor:
    """A transfer buffer: a workspace buffer of ``role``, or a fresh tensor without a workspace."""
    if run.workspace is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return run.workspace.get(role, shape, dtype, like.device)


def _rows(
    run: RingSetup, role: str, x: Tensor, ranges: tuple[tuple[int, int], ...], contiguous: bool = True,
) -> Tensor:
    """The rows ``ranges`` of ``x`` ``[B, L, ...]`` as one tensor: a view when they are one range
    (and, with ``contiguous``, a send buffer's need, contiguous), else gathered into a transfer
    buffer."""
    if len(ranges) == 1:
        a, b = ranges[0]
        view = x[:, a:b]
        if not contiguous or view.is_contiguous():
            return view
    out = _buffer(run, role, (x.shape[0], sum(b - a for a, b in ranges), *x.shape[2:]), x, x.dtype)
    off = 0
    for a, b in ranges:
        out[:, off:off + b - a].copy_(x[:, a:b])
        off += b - a
    return out


def _packing(call: SegmentCall, backend: KernelBackend, device: torch.device, cache: dict) -> Packing:
    """The call's varlen packing, its ``cu_seqlens`` copied to ``device`` once per ring call."""
    packing = cache.get(id(call))
    if packing is None:
        if device.type == "cpu":
            cu_q, cu_k = call.cu_q, call.cu_k
        else:  # pinned + non_blocking: no wait for the kernels already queued
            cu_q = call.cu_q.pin_memory().to(device, non_blocking=True)
            cu_k = call.cu_k.pin_memory().to(device, non_blocking=True)
        lens = (call.seg_q.tolist(), call.seg_k.tolist()) if backend.host_lengths else None
        packing = cache[id(call)] = Packing(cu_q, cu_k, call.max_q, call.max_k, lens)
    return packing


def _call_forward(run: RingSetup, call, q: Tensor, k: Tensor, v: Tensor, cache: dict):
    """``(query rows, out, lse)`` of one kernel call (rows ``None``: the whole buffer)."""
    b = run.backend
    if isinstance(call, BlockCall):
        rows = slice(call.q0, call.q1)
        out, lse = b.kernel_forward(
            q[:, rows], k[:, call.k0:call.k1], v[:, call.k0:call.k1], scale=run.scale,
            window=call.window, softcap=run.softcap, **_alibi(run, call),
        )
        return rows, out, lse
    out, lse = b.kernel_varlen_forward(
        q[0], k[0], v[0], _packing(call, b, q.device, cache), scale=run.scale, window=call.window,
        softcap=run.softcap,
    )
    return None, out[None], lse[None]


class _Accumulator:
    """A sum over kernel results along dim 1, in ``dtype``: the first result that covers every
    row *becomes* the accumulator (no zero-filled buffer, no copy when the dtype matches)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.value: Tensor | None = None

    def add(self, rows: slice | None, part: Tensor, owned: bool = True) -> None:
        """Add ``part`` at ``rows``; ``owned``: ``part`` is a fresh result nobody else uses."""
        whole = rows is None or (rows.start == 0 and rows.stop == self.shape[1])
        if self.value is None:
            if whole:
                self.value = part.to(self.dtype, copy=not owned)
                return
            self.value = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        if whole:
            self.value += part
        else:
            self.value[:, rows] += part

    def result(self) -> Tensor:
        if self.value is None:
            self.value = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.value

    def take(self, dtype: torch.dtype) -> Tensor:
        """The sum in ``dtype``; the accumulator lets go of it, so a cast frees the wider buffer
        before the next accumulator's cast allocates."""
        value, self.value = self.result(), None
        return value.to(dtype)


@dataclass(eq=False)
class _Queries:
    """What every kernel call of one ring backward reads besides a step's K/V (this rank's
    queries, their output, dout and LSE; the call's packings), and where their dQ goes."""

    run: RingSetup
    dout: Tensor
    q: Tensor
    out: Tensor
    lse: Tensor
    dq: _Accumulator
    cache: dict

    def grads(self, call, k: Tensor, v: Tensor):
        """``(query rows, key rows, dq, dk, dv)`` of one kernel call (rows ``None``: everything)."""
        run, b = self.run, self.run.backend
        dout, q, out, lse = self.dout, self.q, self.out, self.lse
        if isinstance(call, BlockCall):
            rows, cols = slice(call.q0, call.q1), slice(call.k0, call.k1)
            grads = b.kernel_backward(
                dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[..., rows],
                scale=run.scale, window=call.window, softcap=run.softcap, **_alibi(run, call),
            )
            return (rows, cols, *grads)
        g_q, g_k, g_v = b.kernel_varlen_backward(
            dout[0], q[0], k[0], v[0], out[0], lse[0], _packing(call, b, q.device, self.cache),
            scale=run.scale, window=call.window, softcap=run.softcap,
        )
        return None, None, g_q[None], g_k[None], g_v[None]

    def grads_into(self, call: SegmentCall, k: Tensor, v: Tensor, dk: Tensor, dv: Tensor) -> None:
        """Add one varlen call's dQ into ``dq`` and its dK/dV into ``dk``, ``dv`` (``[1, L, ...]``)."""
        run = self.run
        run.backend.kernel_varlen_backward_into(
            (self.dq.result()[0], dk[0], dv[0]), self.dout[0], self.q[0], k[0], v[0], self.out[0], self.lse[0],
            _packing(call, run.backend, self.q.device, self.cache), scale=run.scale, window=call.window,
            softcap=run.softcap,
        )


class _Output:
    """The forward's ``(out, lse)`` merged block by block by LSE (Note [LSE merge]), in the
    accumulator dtype: the first result that covers every row *becomes* the accumulator."""

    def __init__(self, q: Tensor, out_shape: tuple[int, ...]) -> None:
        self.q, self.shape = q, out_shape
        self.acc = accumulator_dtype(q.dtype)
        self.out: Tensor | None = None
        self.lse: Tensor | None = None

    def add(self, rows: slice | None, out: Tensor, lse: Tensor) -> None:
        if self.out is None:
            if rows is None or (rows.start == 0 and rows.stop == self.shape[1]):
                self.out, self.lse = out.to(self.acc), lse.to(self.acc)
                return
            self.out, self.lse = new_accumulators(self.shape, device=self.q.device, dtype=self.q.dtype)
        if rows is None:
            merge_(self.out, self.lse, out, lse)
        else:
            merge_(self.out[:, rows], self.lse[..., rows], out, lse)

    def result(self, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
        """``(out in q's dtype, lse)``, sinks joined last; rows no block reached are 0 / -inf."""
        if self.out is None:
            self.out, self.lse = new_accumulators(self.shape, device=self.q.device, dtype=self.q.dtype)
        out, lse = self.out, self.lse
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        return out.to(self.q.dtype), lse


def extra_block(q: Tensor, extra: Extra) -> BlockCall | None:
    """The one block of every query against the replicated extra keys (joint attention), or None."""
    if extra is None or not extra[0].shape[1] or not q.shape[1]:
        return None
    return BlockCall(0, q.shape[1], 0, extra[0].shape[1], (-1, -1))


def _local_grads(qs: _Queries, calls, k: Tensor, v: Tensor, dk: _Accumulator, dv: _Accumulator) -> None:
    """Add the gradients of the calls on this rank's own K/V (step 0) into ``qs.dq``, ``dk``, ``dv``."""
    for call in calls:
        if isinstance(call, SegmentCall):  # added in place, sequence by sequence
            qs.grads_into(call, k, v, dk.result(), dv.result())
            continue
        rows, cols, g_q, g_k, g_v = qs.grads(call, k, v)
        qs.dq.add(rows, g_q)
        dk.add(cols, g_k)
        dv.add(cols, g_v)
        del g_q, g_k, g_v


def _extra_grads(qs: _Queries, extra: Extra):
    """``(dextra_k, dextra_v)`` accumulators of the replicated extra keys (None without them); their
    block's dQ goes into ``qs.dq``."""
    if extra is None:
        return None
    acc = accumulator_dtype(qs.q.dtype)
    dextra = tuple(_Accumulator(x.shape, acc, qs.q.device) for x in extra)
    call = extra_block(qs.q, extra)
    if call is not None:
        _, cols, g_q, g_k, g_v = qs.grads(call, *extra)
        qs.dq.add(None, g_q)
        dextra[0].add(cols, g_k)
        dextra[1].add(cols, g_v)
    return dextra


def _remote_grads(qs: _Queries, t: Transport, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """dQ of step ``i``'s calls on a remote rank's K/V rows (``k``, ``v``: that step's compact
    buffers) into ``qs.dq``; returns their dK/dV in the dtype of this rank's own k, v, to be sent
    back by ``t`` (Note [Gradients sent as computed]): the kernel's own results where the step is
    one call over every row and ``t`` sends them as they are, else ``t``'s buffers, written."""
    run = qs.run
    step = run.plan.steps[i]
    expanded = run.backend.backward_expands_kv_heads and qs.q.shape[2] > t.like[0].shape[2]
    if t.sends_kernel_results and sent_as_computed(step.calls, step.kv_len, expanded=expanded):
        # One kernel call whose results are every row: they travel as they are.
        rows, _, g_q, g_k, g_v = qs.grads(step.calls[0], k, v)
        qs.dq.add(rows, g_q)
        return g_k, g_v
    gk, gv = t.grad_buffers(i)
    _remote_grads_into(qs, step.calls, k, v, gk, gv)
    return gk, gv


def _remote_grads_into(qs: _Queries, calls, k: Tensor, v: Tensor, gk: Tensor, gv: Tensor) -> None:
    """dQ of the calls on a remote rank's K/V rows into ``qs.dq``; their dK/dV into ``gk`` / ``gv``
    (``[B, rows, ...]`` in the input dtype; every row is written, as every row of a step's compact
    buffer is read by some call): directly when the calls read disjoint key rows, else summed in the
    accumulator dtype first (segments, shared key rows; in ``gk`` / ``gv`` themselves when they
    are in that dtype)."""
    calls = split_wide_blocks(calls)
    if not sums_keys(calls):
        for call in calls:
            rows, cols, g_q, g_k, g_v = qs.grads(call, k, v)
            qs.dq.add(rows, g_q)
            (gk if cols is None else gk[:, cols]).copy_(g_k)
            (gv if cols is None else gv[:, cols]).copy_(g_v)
            del g_q, g_k, g_v
        return
    acc = accumulator_dtype(qs.q.dtype)
    if gk.dtype == gv.dtype == acc:
        sum_k, sum_v = gk.zero_(), gv.zero_()
    else:
        sum_k = _buffer(qs.run, "ring.sum_grad_k", tuple(gk.shape), gk, acc).zero_()
        sum_v = _buffer(qs.run, "ring.sum_grad_v", tuple(gv.shape), gv, acc).zero_()
    for call in calls:
        if isinstance(call, SegmentCall):
            qs.grads_into(call, k, v, sum_k, sum_v)
            continue
        rows, cols, g_q, g_k, g_v = qs.grads(call, k, v)
        qs.dq.add(rows, g_q)
        sum_k[:, cols] += g_k
        sum_v[:, cols] += g_v
        del g_q, g_k, g_v
    if sum_k is not gk:
        gk.copy_(sum_k)
        gv.copy_(sum_v)


class Transport:
    """How the K/V of each ring step reach this rank and their dK/dV go home (Note [Ring
    transports]); one object per forward or backward, started by the loop with this rank's K/V.

    A subclass implements :meth:`kv` and, for the backward, :meth:`grad_buffers`,
    :meth:`send_grads` and :meth:`collect`; the steps are called in order ``0 .. R-1``, each
    once. ``sends_kernel_results``: whether a step's dK/dV may be sent as the kernel returned them
    (Note [Gradients sent as computed]) instead of being written into :meth:`grad_buffers`.
    """

    sends_kernel_results = True

    def __init__(self, run: RingSetup) -> None:
        self.run = run
        self.steps = run.plan.steps

    def start(self, kv: list[Tensor]) -> None:
        """Take this rank's K/V, the caller's list ``[k, v]`` (``[B, L, Hkv, D]`` / ``[..., Dv]``),
        which the transport may empty once nothing reads them (Note [Own K/V released])."""
        k, v = self.k, self.v = kv
        self.handed = kv
        # Shapes, dtypes and device of k, v without their storage, for what outlives them.
        self.like = (k.new_empty((k.shape[0], 0, *k.shape[2:])), v.new_empty((v.shape[0], 0, *v.shape[2:])))

    def kv(self, i: int) -> tuple[Tensor | None, Tensor | None]:
        """Step ``i``'s K/V, ready to read: this rank's own at ``i = 0``, else the compact
        ``[B, kv_len, ...]`` buffers of ``steps[i].recv_rows`` (None where the step reads none).
        The transport keeps no reference to them (Note [Step buffers released])."""
        raise NotImplementedError

    def grad_buffers(self, i: int) -> tuple[Tensor, Tensor]:
        """Where step ``i``'s dK/dV of ``src``'s rows are written: ``[B, kv_len, ...]`` each, in the
        dtype of this rank's k, v."""
        raise NotImplementedError

    def send_grads(self, i: int, gk: Tensor | None, gv: Tensor | None, dk, dv) -> None:
        """Step ``i``'s dK/dV (None: the step read nothing) go towards ``src``; the own rows'
        dK/dV that have arrived are added into the accumulators ``dk``, ``dv``."""
        raise NotImplementedError

    def collect(self, dk, dv) -> None:
        """After the last step: every transfer completed, the own rows' dK/dV added home."""
        raise NotImplementedError

    def buffer(self, role: str, shape: tuple[int, ...], like: Tensor, dtype: torch.dtype) -> Tensor:
        """A transfer buffer of the call's workspace (Note [Workspace])."""
        return _buffer(self.run, role, shape, like, dtype)

    def rows(self, role: str, x: Tensor, ranges: tuple[tuple[int, int], ...], contiguous: bool = True) -> Tensor:
        """The rows ``ranges`` of ``x`` as one tensor: a view where they are one range (and
        contiguous, if asked), else a copy in a transfer buffer of ``role``."""
        return _rows(self.run, role, x, ranges, contiguous)

    def record(self, event: str, step: int) -> None:
        """An event of the schedule, for tests (``RingSetup.trace``)."""
        _record(self.run, event, step)

    @staticmethod
    def add_rows(dk, dv, gk: Tensor, gv: Tensor, ranges: tuple[tuple[int, int], ...]) -> None:
        """Add received ``gk``/``gv`` (the rows ``ranges`` of this rank's K/V, compacted) into
        ``dk``/``dv``; they are transfer buffers, reused, so the accumulators copy them."""
        off = 0
        for a, b in ranges:
            rows = slice(a, b)
            dk.add(rows, gk[:, off:off + b - a], owned=False)
            dv.add(rows, gv[:, off:off + b - a], owned=False)
            off += b - a


def _post_kv(t: Transport, step: Step, slot: int):
    """Post ``step``'s K/V transfers of this rank's K/V; return ``(pending, k_buffer, v_buffer)``."""
    k, v = t.k, t.v
    sends = []
    if step.send_rows:
        # One staging slot suffices: a step's sends complete before the next step posts.
        sends = [
            (step.dst, _rows(t.run, "ring.send_k", k, step.send_rows)),
            (step.dst, _rows(t.run, "ring.send_v", v, step.send_rows)),
        ]
    k_in = v_in = None
    recvs = []
    if step.recv_rows:
        k_in = t.buffer(f"ring.k.{slot % 2}", (k.shape[0], step.kv_len, *k.shape[2:]), k, k.dtype)
        v_in = t.buffer(f"ring.v.{slot % 2}", (v.shape[0], step.kv_len, *v.shape[2:]), v, v.dtype)
        recvs = [(step.src, k_in), (step.src, v_in)]
    return post(t.run.group, sends, recvs), k_in, v_in


class P2P(Transport):
    """One hop per ring step, overlapping the kernels (Note [Ring schedule]): step ``i + 1``'s
    K/V travel while step ``i`` computes, step ``i``'s dK/dV while step ``i + 1`` does."""

    def start(self, kv: list[Tensor]) -> None:
        super().start(kv)
        self.next = None  # (pending, k, v) of the step in flight
        self.grads_in = None  # (pending, dk rows, dv rows, ranges) of the own rows' dK/dV in flight

    def kv(self, i: int) -> tuple[Tensor | None, Tensor | None]:
        kv = self.k, self.v
        if i:
            pending, k_i, v_i = self.next
            self.next = None
            pending.wait()
            self.record("wait", i)
            self._release_own(i)
            kv = k_i, v_i
        if i + 1 < len(self.steps):
            self.next = _post_kv(self, self.steps[i + 1], i + 1)
            self.record("post", i + 1)
        return kv

    def _release_own(self, i: int) -> None:
        """After step ``i``'s K/V arrived: the own K/V go if they were sent for the last time."""
        if i == len(self.steps) - 1:
            self.k = self.v = None
            self.handed.clear()

    def _slot(self, i: int) -> int:
        # Alternated: the previous step's send slot may still be in flight.
        return i % 2

    def grad_buffers(self, i: int) -> tuple[Tensor, Tensor]:
        (k_like, v_like), n, slot = self.like, self.steps[i].kv_len, self._slot(i)
        gk = self.buffer(f"ring.send_grad_k.{slot}", (k_like.shape[0], n, *k_like.shape[2:]), k_like, k_like.dtype)
        gv = self.buffer(f"ring.send_grad_v.{slot}", (v_like.shape[0], n, *v_like.shape[2:]), v_like, v_like.dtype)
        return gk, gv

    def send_grads(self, i: int, gk: Tensor | None, gv: Tensor | None, dk, dv) -> None:
        # The previous step's gradients have arrived by now (their transfer overlapped this
        # step's compute): add them home, which frees the receive slot reused below.
        if self.grads_in is not None:
            self._add_home(dk, dv)
            self.record("wait_grad", i - 1)
        self._post_grads(i, gk, gv)

    def _post_grads(self, i: int, gk: Tensor | None, gv: Tensor | None) -> None:
        """Post ``gk``/``gv`` -> src(i) and the own rows' dK/dV <- dst(i)."""
        step = self.steps[i]
        sends = [(step.src, gk), (step.src, gv)] if step.recv_rows else []
        recvs, hk, hv = [], None, None
        if step.send_rows:
            rows_home = sum(b - a for a, b in step.send_rows)
            k_like, v_like = self.like
            hk = self.buffer("ring.grad_k", (k_like.shape[0], rows_home, *k_like.shape[2:]), k_like, k_like.dtype)
            hv = self.buffer("ring.grad_v", (v_like.shape[0], rows_home, *v_like.shape[2:]), v_like, v_like.dtype)
            recvs = [(step.dst, hk), (step.dst, hv)]
        self.grads_in = (post(self.run.group, sends, recvs), hk, hv, step.send_rows)
        self.record("post_grad", i)

    def _add_home(self, dk, dv) -> None:
        pending, hk, hv, ranges = self.grads_in
        self.grads_in = None
        pending.wait()
        self.add_rows(dk, dv, hk, hv, ranges)

    def collect(self, dk, dv) -> None:
        if self.grads_in is not None:
            self._add_home(dk, dv)
            self.record("wait_grad", len(self.steps) - 1)


class SerialP2P(P2P):
    """The hops of :class:`P2P`, each completed before its step's kernels run and its gradients
    home before the next step starts (Note [Serial ring]): no transfer next to a kernel."""

    def kv(self, i: int) -> tuple[Tensor | None, Tensor | None]:
        if not i:
            return self.k, self.v
        # The staging copy of the rows sent dies on return.
        pending, k_i, v_i = _post_kv(self, self.steps[i], 0)
        self.record("post", i)
        pending.wait()
        self.record("wait", i)
        self._release_own(i)
        return k_i, v_i

    def _slot(self, i: int) -> int:
        return 0

    def send_grads(self, i: int, gk: Tensor | None, gv: Tensor | None, dk, dv) -> None:
        self._post_grads(i, gk, gv)
        self._add_home(dk, dv)
        self.record("wait_grad", i)


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra: Extra, run: RingSetup,
    transport: Transport | None = None,
) -> tuple[Tensor, Tensor]:
    """Ring attention forward on ring-local buffers (Note [Ring transports]); no autograd.

    Args:
        q: ``[B, L, H, D]`` this ring rank's queries (packed: ``B = 1``).
        k, v: ``[B, L, Hkv, D]`` / ``[B, L, Hkv, Dv]`` its keys and values (``Dv`` may differ
            from ``D``; K and V rows travel in separate buffers of their own widths).
        sinks: ``[H]`` sink logits or None.
        extra: ``(extra_k, extra_v)``, ``[B, P, Hkv, D]`` / ``[B, P, Hkv, Dv]`` local keys every
            query attends, or None.
        run: the ring's setup; transport: how K/V travel (default ``run.transport()``).

    Returns:
        ``out`` ``[B, L, H, Dv]`` in q's dtype and ``lse`` ``[B, H, L]`` in the accumulator dtype.
    """
    acc = accumulator_dtype(q.dtype)
    if _single_block(run, q, k, extra):  # one process, or one Ulysses-inner step: the kernel alone
        call = run.plan.steps[0].calls[0]
        out, lse = run.backend.kernel_forward(
            q, k, v, scale=run.scale, window=call.window, softcap=run.softcap, **_alibi(run, call)
        )
        if sinks is not None:
            out, lse = add_sinks(out, lse.to(acc), sinks)
        return out, lse.to(acc)
    t = transport or run.transport()
    t.start([k, v])
    result = _Output(q, (*q.shape[:3], v.shape[-1]))
    cache: dict = {}
    for i, step in enumerate(run.plan.steps):
        k_i, v_i = t.kv(i)
        t.record("compute", i)
        for call in step.calls:
            result.add(*_call_forward(run, call, q, k_i, v_i, cache))  # block results die here
        if i == 0 and (call := extra_block(q, extra)) is not None:
            result.add(*_call_forward(run, call, q, *extra, cache))
        k_i = v_i = None  # dead transfer buffers, freed before the next step's or the cast
    return result.result(sinks)


def ring_backward(
    dout: Tensor, q: Tensor, kv: list[Tensor], sinks: Tensor | None, extra: Extra, out: Tensor, lse: Tensor,
    run: RingSetup, transport: Transport | None = None,
) -> tuple[Tensor | None, ...]:
    """Ring attention backward (Note [Ring transports]); no autograd.

    Gradients of a remote rank's rows travel back in the input dtype (each is one rank's sum of
    its kernel results, rounded once); every rank sums what it receives for its own rows in the
    accumulator dtype.

    ``kv``: this rank's ``[k, v]``, a list the transport may empty once their last transfer has
    completed: a caller that holds no other reference to them frees them there, before the
    remaining steps' kernels (Note [Own K/V released]). ``extra``: as in :func:`ring_forward`.
    ``transport``: how K/V and gradients travel (default ``run.transport()``).

    Returns:
        ``dq, dk, dv, dsinks, dextra_k, dextra_v`` (None where the input is None); ``dk``/``dv``
        are the gradients of this rank's own K/V summed over every rank's queries.
    """
    acc = accumulator_dtype(q.dtype)
    k, v = kv
    kv.clear()  # this call holds them now; the transport gets them in a list of its own
    if _single_block(run, q, k, extra):
        call = run.plan.steps[0].calls[0]
        dq, dk, dv = run.backend.kernel_backward(
            dout, q, k, v, out, lse, scale=run.scale, window=call.window, softcap=run.softcap,
            **_alibi(run, call),
        )
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None
    # First, while no step buffer exists: its [B, L, H] product is the size of the output.
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
    qs = _Queries(run, dout, q, out, lse, _Accumulator(q.shape, acc, q.device), {})
    dk, dv = _Accumulator(k.shape, acc, k.device), _Accumulator(v.shape, acc, v.device)
    t = transport or run.transport()
    t.start([k, v])
    k = v = None  # the transport holds them for as long as it sends them (Note [Own K/V released])
    dextra = None
    for i, step in enumerate(run.plan.steps):
        k_i, v_i = t.kv(i)
        t.record("compute", i)
        if i == 0:
            _local_grads(qs, step.calls, k_i, v_i, dk, dv)
            dextra = _extra_grads(qs, extra)
            k_i = v_i = None
            continue
        gk = gv = None
        if step.calls:
            gk, gv = _remote_grads(qs, t, i, k_i, v_i)
        # This step's K/V are read for the last time: free them before the transport allocates
        # the buffers that receive this rank's own dK/dV (Note [Step buffers released]).
        k_i = v_i = None
        t.send_grads(i, gk, gv, dk, dv)
        gk = gv = None
    t.collect(dk, dv)
    # Every transfer buffer is dead now (Note [Workspace]: fresh buffers are freed when their
    # last user drops them); each accumulator lets go of its sum as it is cast.
    like_k, like_v = t.like
    t = None
    dek = dev = None
    if dextra is not None:
        dek, dev = dextra[0].take(extra[0].dtype), dextra[1].take(extra[1].dtype)
    return qs.dq.take(q.dtype), dk.take(like_k.dtype), dv.take(like_v.dtype), dsinks, dek, dev


def _single_block(run: RingSetup, q: Tensor, k: Tensor, extra: Extra) -> bool:
    """Whether the whole call is one kernel call on the whole buffers (no ring, no extra keys)."""
    steps = run.plan.steps
    return len(steps) == 1 and extra is None and is_single_block(steps[0].calls, q.shape[1], k.shape[1])
