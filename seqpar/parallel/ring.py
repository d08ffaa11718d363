"""The ring driver: executes a :class:`~seqpar.placement.RingPlan`, forward and backward.

Dense and packed attention both run here (packed buffers are a batch of one); *what* each step
computes is the plan's (Note [Ring blocks]), *how* is this module's. ``ring_forward`` /
``ring_backward`` are plain functions (kernels, merging, transfers; no autograd) on inputs the
public entry points validated; ``seqpar.parallel.hybrid`` composes them with Ulysses.

Note [Ring schedule]
~~~~~~~~~~~~~~~~~~~~
Step ``i`` (``i = 0 .. R-1``) of ring rank ``r`` attends the K/V of ``src = (r - i) mod R`` and
sends its own K/V rows to ``dst = (r + i) mod R``; every transfer is one hop, only the rows the
plan says the receiver reads, received into one of two alternating buffers (ping-pong)::

    forward, step i:   post  K/V rows -> dst(i+1), K/V rows of src(i+1) <-     ("post", i+1)
                       compute step i's calls, merge into the fp32 accumulators ("compute", i)
                       wait for the K/V of step i+1                            ("wait", i+1)

    backward, step i:  post K/V exactly as in the forward                     ("post", i+1)
                       compute step i: dQ into its accumulator, dK/dV of the
                       rows of src(i) (own accumulators at i = 0)              ("compute", i)
                       wait for step i-1's gradients, add them to own rows     ("wait_grad", i-1)
                       post  dK/dV -> src(i), dK/dV of own rows <- dst(i)      ("post_grad", i)
                       wait for the K/V of step i+1                            ("wait", i+1)

Each step's transfer overlaps the compute of the step after it (``trace``, a list, records the
events for tests). Every rank posts its point-to-point operations in the same order, so the
messages of each pair of ranks pair up in order. A step the plan leaves empty moves nothing and
runs no kernel. Results are merged by LSE in fp32 (``seqpar.parallel.merge``); sinks join last
(Note [Attention sinks]). Extra local K/V (replicated text tokens of joint attention) are attended
by every query row at step 0 and never travel.

Memory (buffers from the workspace, Note [Workspace]: fresh per call by default, freed once
dead): the K/V of two steps (the one computed, the one arriving), one staging copy of the rows
sent when they are not one contiguous view, the dK/dV of two steps (the one computed, the one
in flight) and one receive slot for gradients (with H == Hkv about 9 shards of K/V next to the
output and the three gradients at the backward's peak: the price of overlapping every transfer);
accumulators start as the first kernel result that covers every row (no zero fill), kernel
results are dropped as soon as they are added, and large unmasked blocks that are not a whole
step run their backward in two halves of the keys (smaller kernel results). Only q, k, v, out
and the LSE of the shard are saved for backward. Without overlap (Note [Serial ring]) only the
step's own K/V and gradients are held.

Note [Gradients sent as computed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The dK/dV of a remote step travel back in the input dtype, one buffer per step. When the step
is one kernel call over all of its key rows (every remote step of dense causal or full attention
on the zig-zag placement), the kernel's own dK/dV results are that buffer: they are sent as they
are, with no send slot and no copy, and die when the transfer completes. Otherwise the results
are written into a send slot (two, alternating, as the previous step's may still be in flight);
sums over several calls (segments, shared key rows) are made in the slot itself when it is in
the accumulator dtype. Measured at S = 4096, H = 8, D = 64, fp32, causal, 4 ranks
(``scripts/bench_memory.py``, docs/performance.md): the ring's peak per rank fell 3-11% (H = Hkv
dense 29.0 -> 27.0 MiB, packed 37.8 -> 33.8 MiB).

A grouped-query step (fewer K/V heads than query heads) on a backend whose backward expands K/V
heads (``KernelBackend.backward_expands_kv_heads``: FlashAttention on CUDA keeps dK/dV of all
query heads while it runs, the efficient and reference kernels repeat K/V first) is the
exception: a whole-step call's scratch is ``2 * group`` K/V-sized tensors over every key row, so
its wide blocks run as two key halves into a send slot instead. In units of one K/V-sized tensor
of the step that is ``5 + group`` at the kernel (two slots, half the scratch, half the results)
against ``4 + 2 * group`` sent as computed: less from a group of 2. Measured on one H200 (ring 8
of a Llama-8B-shaped stack, group 4, bf16, 40,960 tokens per rank): 8.734 GiB sent as computed,
8.499 GiB in halves. The PyTorch CPU kernel adds each query head into its K/V head (no expanded
scratch), so on the CPU grouped steps travel as computed too.

Note [Step buffers released]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A remote step's K/V buffers are read for the last time by its kernels. The backward drops its
references to them right there, before it allocates the buffers that receive this rank's own
dK/dV, and the swap to the next step's buffers leaves one reference, not two. Otherwise the
step's K/V lived until the next swap: on the last step of a ring of 2 they sat next to the
kernel's dK/dV and the receive buffers, which made that moment the layer's peak (4-layer stack,
2 x 2, H = Hkv = 8, S = 4096, fp32: 27.06 -> 26.57 x-shards per rank, the peak back at a kernel).

Note [Own K/V released]
~~~~~~~~~~~~~~~~~~~~~~~
A rank's own K/V are read by step 0's kernels and by the transfers that send its rows; once the
last of those has completed (the K/V of the last step have arrived, so every send before them is
done) nothing reads them. Under Ulysses they are the head shards the backward itself received,
so ``ulysses_ring_backward`` hands them over (``handed=[k_u, v_u]``, holding no other reference)
and the ring empties the list there: they are freed before the remaining steps' kernels. On a
ring of 2 that is the one remote step, the layer's peak with H == Hkv (4-layer stack, 2 x 2,
H = Hkv = 8, S = 4096, fp32: 26.57 -> 24.57 x-shards per rank, docs/performance.md). What
outlives them -- their shapes and dtypes, for the gradients -- is kept in storage-less tensors.
Ring-only calls read the token shards autograd saved, which stay alive anyway.

Note [Serial ring]
~~~~~~~~~~~~~~~~~~
``ParallelState(ring_comm="p2p_serial")`` (``RingSetup.overlap=False``) runs the same plan with
no transfer in flight next to a kernel::

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
The messages between two ranks come in another order than the overlapped schedule's, so every
rank must run the same transport: it is part of the call signature ``checks`` compares. Results
are bitwise those of ``"p2p"`` (the same kernels, summed in the same order). Measured figures:
docs/performance.md, "The serial ring".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends.base import KernelBackend, Packing
from ..comm import Group, Workspace, post
from ..placement.ring import (
    BlockCall, RingPlan, SegmentCall, is_single_block, sent_as_computed, split_wide_blocks, sums_keys,
)
from .merge import accumulator_dtype, add_sinks, merge_, new_accumulators, sinks_grad

__all__ = ["RingSetup", "ring_forward", "ring_backward"]


@dataclass(frozen=True, eq=False)
class RingSetup:
    """Everything a ring call needs besides its tensors (built once per call by the caller).

    Attributes:
        group: the ring group; plan: this rank's :class:`~seqpar.placement.RingPlan`;
        backend, scale, softcap: the kernel and its scalar options;
        alibi: ``[H]`` ALiBi slopes of this rank's query heads (Note [ALiBi blocks]), or None;
        workspace: reused transfer buffers (Note [Workspace]), or None to allocate per call;
        trace: a list to record the schedule's events in (tests), or None;
        overlap: ``True``: each step's transfers overlap another step's kernels (Note [Ring
            schedule]); ``False``: they complete before the step's kernels run and its gradients
            arrive before the next step starts (Note [Serial ring], ``ring_comm="p2p_serial"``).
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


def _rows(run: RingSetup, role: str, x: Tensor, ranges: tuple[tuple[int, int], ...]) -> Tensor:
    """The rows ``ranges`` of ``x`` ``[B, L, ...]``, contiguous: a view when they already are one,
    else gathered into a transfer buffer."""
    if len(ranges) == 1:
        a, b = ranges[0]
        view = x[:, a:b]
        if view.is_contiguous():
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


def _call_backward(run: RingSetup, call, dout, q, k, v, out, lse, cache: dict):
    """``(query rows, key rows, dq, dk, dv)`` of one kernel call (rows ``None``: everything)."""
    b = run.backend
    if isinstance(call, BlockCall):
        rows, cols = slice(call.q0, call.q1), slice(call.k0, call.k1)
        grads = b.kernel_backward(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[..., rows],
            scale=run.scale, window=call.window, softcap=run.softcap, **_alibi(run, call),
        )
        return (rows, cols, *grads)
    g_q, g_k, g_v = b.kernel_varlen_backward(
        dout[0], q[0], k[0], v[0], out[0], lse[0], _packing(call, b, q.device, cache),
        scale=run.scale, window=call.window, softcap=run.softcap,
    )
    return None, None, g_q[None], g_k[None], g_v[None]


def _call_backward_into(run: RingSetup, call: SegmentCall, dout, q, k, v, out, lse, grads, cache: dict) -> None:
    """Add one varlen call's gradients into ``grads = (dq, dk, dv)`` (``[1, L, ...]`` each)."""
    run.backend.kernel_varlen_backward_into(
        tuple(g[0] for g in grads), dout[0], q[0], k[0], v[0], out[0], lse[0],
        _packing(call, run.backend, q.device, cache), scale=run.scale, window=call.window,
        softcap=run.softcap,
    )


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


def extra_block(q: Tensor, extra_k: Tensor | None) -> BlockCall | None:
    """The one block of every query against the replicated extra keys (joint attention), or None."""
    if extra_k is None or not extra_k.shape[1] or not q.shape[1]:
        return None
    return BlockCall(0, q.shape[1], 0, extra_k.shape[1], (-1, -1))


def _local_grads(run: RingSetup, calls, dout, q, k, v, out, lse, dq: _Accumulator, dk: _Accumulator,
                 dv: _Accumulator, cache: dict) -> None:
    """Add the gradients of the calls on this rank's own K/V (step 0) into ``dq``, ``dk``, ``dv``."""
    for call in calls:
        if isinstance(call, SegmentCall):  # added in place, sequence by sequence
            _call_backward_into(run, call, dout, q, k, v, out, lse, (dq.result(), dk.result(), dv.result()), cache)
            continue
        rows, cols, g_q, g_k, g_v = _call_backward(run, call, dout, q, k, v, out, lse, cache)
        dq.add(rows, g_q)
        dk.add(cols, g_k)
        dv.add(cols, g_v)
        del g_q, g_k, g_v


def _extra_grads(run: RingSetup, dout, q, extra_k, extra_v, out, lse, dq: _Accumulator, cache: dict):
    """``(dextra_k, dextra_v)`` accumulators of the replicated extra keys (None without them); their
    block's dQ goes into ``dq``."""
    if extra_k is None:
        return None
    acc = accumulator_dtype(q.dtype)
    dextra = (_Accumulator(extra_k.shape, acc, q.device), _Accumulator(extra_v.shape, acc, q.device))
    call = extra_block(q, extra_k)
    if call is not None:
        _, cols, g_q, g_k, g_v = _call_backward(run, call, dout, q, extra_k, extra_v, out, lse, cache)
        dq.add(None, g_q)
        dextra[0].add(cols, g_k)
        dextra[1].add(cols, g_v)
    return dextra


def _remote_grads(run: RingSetup, slot: int, like: tuple[Tensor, Tensor], kv_len: int, calls, dout, q, k, v,
                  out, lse, dq: _Accumulator, cache: dict) -> tuple[Tensor, Tensor]:
    """dQ of the calls on a remote rank's K/V rows (``k``, ``v``: that step's compact buffers,
    ``kv_len`` rows, None when the step reads none) into ``dq``; returns their dK/dV in the dtype
    of ``like`` (this rank's own k, v), to be sent back (Note [Gradients sent as computed]).
    ``slot``: the step's send slot (0 or 1), alternated for the buffers a kept workspace would
    reuse while the previous step's are in flight."""
    k_own, v_own = like
    expanded = run.backend.backward_expands_kv_heads and q.shape[2] > k_own.shape[2]
    if sent_as_computed(calls, kv_len, expanded=expanded):
        # One kernel call whose results are every row: they travel as they are.
        rows, _, g_q, g_k, g_v = _call_backward(run, calls[0], dout, q, k, v, out, lse, cache)
        dq.add(rows, g_q)
        return g_k, g_v
    gk = _buffer(run, f"ring.send_grad_k.{slot}", (k_own.shape[0], kv_len, *k_own.shape[2:]), k_own, k_own.dtype)
    gv = _buffer(run, f"ring.send_grad_v.{slot}", (v_own.shape[0], kv_len, *v_own.shape[2:]), v_own, v_own.dtype)
    _remote_grads_into(run, calls, dout, q, k, v, out, lse, dq, gk, gv, cache)
    return gk, gv


def _remote_grads_into(run: RingSetup, calls, dout, q, k, v, out, lse, dq: _Accumulator, gk: Tensor, gv: Tensor,
                       cache: dict) -> None:
    """dQ of the calls on a remote rank's K/V rows into ``dq``; their dK/dV into ``gk`` / ``gv``
    (``[B, rows, ...]`` in the input dtype; every row is written, as every row of a step's compact
    buffer is read by some call): directly when the calls read disjoint key rows, else summed in the
    accumulator dtype first (segments, shared key rows; in ``gk`` / ``gv`` themselves when they
    are in that dtype)."""
    calls = split_wide_blocks(calls)
    if not sums_keys(calls):
        for call in calls:
            rows, cols, g_q, g_k, g_v = _call_backward(run, call, dout, q, k, v, out, lse, cache)
            dq.add(rows, g_q)
            (gk if cols is None else gk[:, cols]).copy_(g_k)
            (gv if cols is None else gv[:, cols]).copy_(g_v)
            del g_q, g_k, g_v
        return
    acc = accumulator_dtype(q.dtype)
    if gk.dtype == gv.dtype == acc:
        sum_k, sum_v = gk.zero_(), gv.zero_()
    else:
        sum_k = _buffer(run, "ring.sum_grad_k", tuple(gk.shape), gk, acc).zero_()
        sum_v = _buffer(run, "ring.sum_grad_v", tuple(gv.shape), gv, acc).zero_()
    for call in calls:
        if isinstance(call, SegmentCall):
            _call_backward_into(run, call, dout, q, k, v, out, lse, (dq.result(), sum_k, sum_v), cache)
            continue
        rows, cols, g_q, g_k, g_v = _call_backward(run, call, dout, q, k, v, out, lse, cache)
        dq.add(rows, g_q)
        sum_k[:, cols] += g_k
        sum_v[:, cols] += g_v
        del g_q, g_k, g_v
    if sum_k is not gk:
        gk.copy_(sum_k)
        gv.copy_(sum_v)


def _post_kv(run: RingSetup, step, k: Tensor, v: Tensor, slot: int):
    """Post step ``step``'s K/V transfers; return ``(pending, k_buffer, v_buffer)``."""
    sends = []
    if step.send_rows:
        # One staging slot suffices: a step's sends complete before the next step posts.
        sends = [
            (step.dst, _rows(run, "ring.send_k", k, step.send_rows)),
            (step.dst, _rows(run, "ring.send_v", v, step.send_rows)),
        ]
    k_in = v_in = None
    recvs = []
    if step.recv_rows:
        k_in = _buffer(run, f"ring.k.{slot % 2}", (k.shape[0], step.kv_len, *k.shape[2:]), k, k.dtype)
        v_in = _buffer(run, f"ring.v.{slot % 2}", (v.shape[0], step.kv_len, *v.shape[2:]), v, v.dtype)
        recvs = [(step.src, k_in), (step.src, v_in)]
    return post(run.group, sends, recvs), k_in, v_in


def _serial_kv(run: RingSetup, step, k: Tensor, v: Tensor, i: int) -> tuple[Tensor | None, Tensor | None]:
    """Step ``i``'s K/V without overlap (Note [Serial ring]): its transfers posted and waited
    for; the staging copy of the rows sent dies on return."""
    pending, k_in, v_in = _post_kv(run, step, k, v, 0)
    _record(run, "post", i)
    pending.wait()
    _record(run, "wait", i)
    return k_in, v_in


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, run: RingSetup,
) -> tuple[Tensor, Tensor]:
    """Ring attention forward on ring-local buffers (see Note [Ring schedule]); no autograd.

    Args:
        q: ``[B, L, H, D]`` this ring rank's queries (packed: ``B = 1``).
        k, v: ``[B, L, Hkv, D]`` / ``[B, L, Hkv, Dv]`` its keys and values (``Dv`` may differ
            from ``D``; K and V rows travel in separate buffers of their own widths).
        sinks: ``[H]`` sink logits or None.
        extra_k, extra_v: ``[B, P, Hkv, D]`` / ``[B, P, Hkv, Dv]`` local keys every query
            attends (or None).

    Returns:
        ``out`` ``[B, L, H, Dv]`` in q's dtype and ``lse`` ``[B, H, L]`` in the accumulator dtype.
    """
    steps = run.plan.steps
    acc = accumulator_dtype(q.dtype)
    B, L, H, _ = q.shape
    out_shape = (B, L, H, v.shape[-1])
    if _single_block(run, q, k, extra_k):  # one process, or one Ulysses-inner step: the kernel alone
        call = steps[0].calls[0]
        out, lse = run.backend.kernel_forward(
            q, k, v, scale=run.scale, window=call.window, softcap=run.softcap, **_alibi(run, call)
        )
        if sinks is not None:
            out, lse = add_sinks(out, lse.to(acc), sinks)
        return out, lse.to(acc)
    result = _Output(q, out_shape)
    cache: dict = {}
    k_cur, v_cur = k, v
    for i, step in enumerate(steps):
        pending = None
        if not run.overlap:
            if i:
                k_cur = v_cur = None  # the previous step's buffers go before this step's arrive
                k_cur, v_cur = _serial_kv(run, step, k, v, i)
        elif i + 1 < len(steps):
            pending, k_next, v_next = _post_kv(run, steps[i + 1], k, v, i + 1)
            _record(run, "post", i + 1)
        _record(run, "compute", i)
        for call in step.calls:
            result.add(*_call_forward(run, call, q, k_cur, v_cur, cache))  # block results die here
        if i == 0 and (call := extra_block(q, extra_k)) is not None:
            result.add(*_call_forward(run, call, q, extra_k, extra_v, cache))
        if pending is not None:
            pending.wait()
            _record(run, "wait", i + 1)
            k_cur, v_cur = k_next, v_next
    pending = k_cur = v_cur = k_next = v_next = None  # dead transfer buffers, freed before the cast
    return result.result(sinks)


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor | None, v: Tensor | None, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, out: Tensor, lse: Tensor, run: RingSetup, handed: list[Tensor] | None = None,
) -> tuple[Tensor | None, ...]:
    """Ring attention backward (see Note [Ring schedule]); no autograd.

    Gradients of a remote rank's rows travel back in the input dtype (each is one rank's sum of
    its kernel results, rounded once); every rank sums what it receives for its own rows in the
    accumulator dtype.

    ``handed``: instead of ``k, v`` (None then), the list ``[k, v]`` of a caller that holds no
    other reference to them; the backward empties it once their last transfer has completed, so
    that they are freed before the remaining steps' kernels (Note [Own K/V released]).

    Returns:
        ``dq, dk, dv, dsinks, dextra_k, dextra_v`` (None where the input is None); ``dk``/``dv``
        are the gradients of this rank's own K/V summed over every rank's queries.
    """
    steps = run.plan.steps
    acc = accumulator_dtype(q.dtype)
    if handed is not None:
        k, v = handed
    if _single_block(run, q, k, extra_k):
        call = steps[0].calls[0]
        dq, dk, dv = run.backend.kernel_backward(
            dout, q, k, v, out, lse, scale=run.scale, window=call.window, softcap=run.softcap,
            **_alibi(run, call),
        )
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None
    dq = _Accumulator(q.shape, acc, q.device)
    dk, dv = _Accumulator(k.shape, acc, k.device), _Accumulator(v.shape, acc, v.device)
    # Shapes, dtypes and device of k, v without their storage, for what outlives them.
    like = (k.new_empty((k.shape[0], 0, *k.shape[2:])), v.new_empty((v.shape[0], 0, *v.shape[2:])))
    last = len(steps) - 1
    cache: dict = {}
    grads_in: tuple | None = None  # (pending, dk rows, dv rows, ranges) of the previous step

    def add_home(grads) -> None:
        pending, gk, gv, ranges = grads
        pending.wait()
        off = 0
        for a, b in ranges:
            rows = slice(a, b)
            dk.add(rows, gk[:, off:off + b - a], owned=False)  # transfer buffers are reused
            dv.add(rows, gv[:, off:off + b - a], owned=False)
            off += b - a

    k_cur, v_cur = k, v
    dextra = None
    for i, step in enumerate(steps):
        pending = None
        if not run.overlap:
            if i:
                k_cur = v_cur = None  # the previous step's buffers go before this step's arrive
                k_cur, v_cur = _serial_kv(run, step, k, v, i)
                if i == last and handed is not None:  # own K/V sent for the last time
                    k = v = None
                    handed.clear()
        elif i + 1 < len(steps):
            pending, k_next, v_next = _post_kv(run, steps[i + 1], k, v, i + 1)
            _record(run, "post", i + 1)
        _record(run, "compute", i)
        if i == 0:
            _local_grads(run, step.calls, dout, q, k_cur, v_cur, out, lse, dq, dk, dv, cache)
            dextra = _extra_grads(run, dout, q, extra_k, extra_v, out, lse, dq, cache)
        else:
            # The gradients of src's rows go back to src in q's dtype (the previous step's may
            # still be in flight).
            send_k, send_v = _remote_grads(
                run, i % 2 if run.overlap else 0, like, step.kv_len, step.calls, dout, q, k_cur, v_cur, out,
                lse, dq, cache,
            )
            # This step's K/V are read for the last time: free their slot before the receive
            # buffers below are allocated (Note [Step buffers released]).
            k_cur = v_cur = None
            # The previous step's gradients have arrived by now (their transfer overlapped this
            # step's compute): add them home, which frees the receive slot.
            if grads_in is not None:
                add_home(grads_in)
                _record(run, "wait_grad", i - 1)
            sends = [(step.src, send_k), (step.src, send_v)] if step.recv_rows else []
            recvs, gk, gv = [], None, None
            if step.send_rows:
                rows_home = sum(b - a for a, b in step.send_rows)
                k_like, v_like = like
                gk = _buffer(run, "ring.grad_k", (k_like.shape[0], rows_home, *k_like.shape[2:]), k_like, k_like.dtype)
                gv = _buffer(run, "ring.grad_v", (v_like.shape[0], rows_home, *v_like.shape[2:]), v_like, v_like.dtype)
                recvs = [(step.dst, gk), (step.dst, gv)]
            grads_in = (post(run.group, sends, recvs), gk, gv, step.send_rows)
            _record(run, "post_grad", i)
            if not run.overlap:  # this step's gradients home before the next step's K/V arrive
                add_home(grads_in)
                _record(run, "wait_grad", i)
                grads_in = sends = recvs = send_k = send_v = gk = gv = None
        if pending is not None:
            pending.wait()
            _record(run, "wait", i + 1)
            k_cur, v_cur, k_next, v_next = k_next, v_next, None, None
            if i + 1 == last and handed is not None:  # own K/V sent for the last time, step 0 done
                pending = k = v = None
                handed.clear()
    if grads_in is not None:
        add_home(grads_in)
        _record(run, "wait_grad", len(steps) - 1)
    # Every transfer buffer is dead now: drop the last references before the casts below allocate
    # the results (Note [Workspace]: fresh buffers are freed when their last user drops them).
    grads_in = pending = sends = recvs = k_cur = v_cur = k_next = v_next = send_k = send_v = gk = gv = None
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
    dek = dev = None
    if dextra is not None:
        dek, dev = dextra[0].take(extra_k.dtype), dextra[1].take(extra_v.dtype)
    return dq.take(q.dtype), dk.take(like[0].dtype), dv.take(like[1].dtype), dsinks, dek, dev


def _single_block(run: RingSetup, q: Tensor, k: Tensor, extra_k: Tensor | None) -> bool:
    """Whether the whole call is one kernel call on the whole buffers (no ring, no extra keys)."""
    steps = run.plan.steps
    return len(steps) == 1 and extra_k is None and is_single_block(steps[0].calls, q.shape[1], k.shape[1])
