"""The ring driver: executes a :class:`~seqpar.placement.RingPlan`, forward and backward.

Dense and packed attention both run here (packed buffers are a batch of one); *what* each step
computes is the plan's (Note [Ring blocks]), *how* is this module's. Layers: ``_forward`` /
``_backward`` (kernels, merging, transfers), ``_RingAttention`` (autograd), ``ring_attention``
(the trusted entry the public functions call after validating their inputs).

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
                       post  dK/dV -> src(i), dK/dV of own rows <- dst(i)      ("post_grad", i)
                       wait for step i-1's gradients, add them to own rows     ("wait_grad", i-1)
                       wait for the K/V of step i+1                            ("wait", i+1)

Each step's transfer overlaps the compute of the step before (``trace``, a list, records the
events for tests). Every rank posts its point-to-point operations in the same order, so the
messages of each pair of ranks pair up in order. A step the plan leaves empty moves nothing and
runs no kernel. Results are merged by LSE in fp32 (``seqpar.parallel.merge``); sinks join last
(Note [Attention sinks]). Extra local K/V (replicated text tokens of joint attention) are attended
by every query row at step 0 and never travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends.base import KernelBackend, Packing
from ..comm import Group, post, refuse_double_backward
from ..placement.blocks import BlockCall, RingPlan, SegmentCall
from .merge import accumulator_dtype, add_sinks, merge_, new_accumulators, sinks_grad

__all__ = ["RingRun", "ring_attention"]


@dataclass(frozen=True, eq=False)
class RingRun:
    """Everything a ring call needs besides its tensors (built once per call by the caller)."""

    group: Group
    plan: RingPlan
    backend: KernelBackend
    scale: float
    softcap: float
    trace: list | None = None


def _record(run: RingRun, event: str, step: int) -> None:
    if run.trace is not None:
        run.trace.append((event, step))


def _rows(x: Tensor, ranges: tuple[tuple[int, int], ...]) -> Tensor:
    """The rows ``ranges`` of ``x`` ``[B, L, ...]`` concatenated, contiguous (a view if possible)."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return x[:, a:b].contiguous()
    return torch.cat([x[:, a:b] for a, b in ranges], dim=1)


class _Buffers:
    """Two alternating receive buffers per role, allocated once at the largest size needed."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str, int], Tensor] = {}

    def get(self, role: str, slot: int, shape: tuple[int, ...], like: Tensor, dtype: torch.dtype) -> Tensor:
        numel = 1
        for s in shape:
            numel *= s
        key = (role, slot % 2)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < numel or flat.dtype != dtype:
            flat = self._flat[key] = torch.empty(numel, dtype=dtype, device=like.device)
        return flat[:numel].view(shape)


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


def _call_forward(run: RingRun, call, q: Tensor, k: Tensor, v: Tensor, cache: dict):
    """``(query rows, out, lse)`` of one kernel call (rows ``None``: the whole buffer)."""
    b = run.backend
    if isinstance(call, BlockCall):
        rows = slice(call.q0, call.q1)
        out, lse = b.kernel_forward(
            q[:, rows], k[:, call.k0:call.k1], v[:, call.k0:call.k1], scale=run.scale,
            window=call.window, softcap=run.softcap,
        )
        return rows, out, lse
    out, lse = b.kernel_varlen_forward(
        q[0], k[0], v[0], _packing(call, b, q.device, cache), scale=run.scale, window=call.window,
        softcap=run.softcap,
    )
    return None, out[None], lse[None]


def _call_backward(run: RingRun, call, dout, q, k, v, out, lse, dq, dk, dv, cache: dict) -> None:
    """Add one kernel call's gradients into ``dq`` and ``dk``/``dv`` (accumulator dtype)."""
    b = run.backend
    if isinstance(call, BlockCall):
        rows, cols = slice(call.q0, call.q1), slice(call.k0, call.k1)
        g_q, g_k, g_v = b.kernel_backward(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[..., rows],
            scale=run.scale, window=call.window, softcap=run.softcap,
        )
        dq[:, rows] += g_q
        dk[:, cols] += g_k
        dv[:, cols] += g_v
        return
    g_q, g_k, g_v = b.kernel_varlen_backward(
        dout[0], q[0], k[0], v[0], out[0], lse[0], _packing(call, b, q.device, cache),
        scale=run.scale, window=call.window, softcap=run.softcap,
    )
    dq[0] += g_q
    dk[0] += g_k
    dv[0] += g_v


def _post_kv(run: RingRun, step, k: Tensor, v: Tensor, buffers: _Buffers, slot: int):
    """Post step ``step``'s K/V transfers; return ``(pending, k_buffer, v_buffer)``."""
    sends = [(step.dst, _rows(k, step.send_rows)), (step.dst, _rows(v, step.send_rows))] if step.send_rows else []
    k_in = v_in = None
    recvs = []
    if step.recv_rows:
        shape_k = (k.shape[0], step.kv_len, *k.shape[2:])
        shape_v = (v.shape[0], step.kv_len, *v.shape[2:])
        k_in = buffers.get("k", slot, shape_k, k, k.dtype)
        v_in = buffers.get("v", slot, shape_v, v, v.dtype)
        recvs = [(step.src, k_in), (step.src, v_in)]
    return post(run.group, sends, recvs), k_in, v_in


def _forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, run: RingRun,
) -> tuple[Tensor, Tensor]:
    """Ring attention forward on ring-local buffers (see Note [Ring schedule]).

    Args:
        q: ``[B, L, H, D]`` this ring rank's queries (packed: ``B = 1``).
        k, v: ``[B, L, Hkv, D]`` its keys and values.
        sinks: ``[H]`` sink logits or None.
        extra_k, extra_v: ``[B, P, Hkv, D]`` local keys every query attends (or None).

    Returns:
        ``out`` ``[B, L, H, D]`` in q's dtype and ``lse`` ``[B, H, L]`` in the accumulator dtype.
    """
    steps = run.plan.steps
    out_acc, lse_acc = new_accumulators(q.shape, device=q.device, dtype=q.dtype)
    buffers, cache = _Buffers(), {}

    def merge(rows, out, lse) -> None:
        if rows is None:
            merge_(out_acc, lse_acc, out, lse)
        else:
            merge_(out_acc[:, rows], lse_acc[..., rows], out, lse)

    k_cur, v_cur = k, v
    for i, step in enumerate(steps):
        pending = None
        if i + 1 < len(steps):
            pending, k_next, v_next = _post_kv(run, steps[i + 1], k, v, buffers, i + 1)
            _record(run, "post", i + 1)
        _record(run, "compute", i)
        for call in step.calls:
            merge(*_call_forward(run, call, q, k_cur, v_cur, cache))
        if i == 0 and extra_k is not None and extra_k.shape[1] and q.shape[1]:
            merge(*_call_forward(run, BlockCall(0, q.shape[1], 0, extra_k.shape[1], (-1, -1)), q, extra_k, extra_v, cache))
        if pending is not None:
            pending.wait()
            _record(run, "wait", i + 1)
            k_cur, v_cur = k_next, v_next
    if sinks is not None:
        out_acc, lse_acc = add_sinks(out_acc, lse_acc, sinks)
    return out_acc.to(q.dtype), lse_acc


def _backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, extra_k: Tensor | None,
    extra_v: Tensor | None, out: Tensor, lse: Tensor, run: RingRun,
) -> tuple[Tensor | None, ...]:
    """Ring attention backward (see Note [Ring schedule]).

    Returns:
        ``dq, dk, dv, dsinks, dextra_k, dextra_v`` (None where the input is None); ``dk``/``dv``
        are the gradients of this rank's own K/V summed over every rank's queries.
    """
    steps = run.plan.steps
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    buffers, cache = _Buffers(), {}
    grads_in: tuple | None = None  # (pending, dk rows, dv rows, ranges) of the previous step

    def add_home(grads) -> None:
        pending, gk, gv, ranges = grads
        pending.wait()
        off = 0
        for a, b in ranges:
            dk[:, a:b] += gk[:, off:off + b - a]
            dv[:, a:b] += gv[:, off:off + b - a]
            off += b - a

    k_cur, v_cur = k, v
    dextra = None
    for i, step in enumerate(steps):
        pending = None
        if i + 1 < len(steps):
            pending, k_next, v_next = _post_kv(run, steps[i + 1], k, v, buffers, i + 1)
            _record(run, "post", i + 1)
        _record(run, "compute", i)
        if i == 0:
            dk_step, dv_step = dk, dv
        else:
            dk_step = buffers.get("dk", i, (k.shape[0], step.kv_len, *k.shape[2:]), k, acc).zero_()
            dv_step = buffers.get("dv", i, (v.shape[0], step.kv_len, *v.shape[2:]), v, acc).zero_()
        for call in step.calls:
            _call_backward(run, call, dout, q, k_cur, v_cur, out, lse, dq, dk_step, dv_step, cache)
        if i == 0 and extra_k is not None:
            dextra = (torch.zeros(extra_k.shape, dtype=acc, device=q.device),
                      torch.zeros(extra_v.shape, dtype=acc, device=q.device))
            if extra_k.shape[1] and q.shape[1]:
                call = BlockCall(0, q.shape[1], 0, extra_k.shape[1], (-1, -1))
                _call_backward(run, call, dout, q, extra_k, extra_v, out, lse, dq, *dextra, cache)
        if i > 0:
            sends = [(step.src, dk_step), (step.src, dv_step)] if step.recv_rows else []
            recvs, gk, gv = [], None, None
            if step.send_rows:
                rows = sum(b - a for a, b in step.send_rows)
                gk = buffers.get("gk", i, (k.shape[0], rows, *k.shape[2:]), k, acc)
                gv = buffers.get("gv", i, (v.shape[0], rows, *v.shape[2:]), v, acc)
                recvs = [(step.dst, gk), (step.dst, gv)]
            sent = post(run.group, sends, recvs)
            _record(run, "post_grad", i)
            if grads_in is not None:
                add_home(grads_in)
                _record(run, "wait_grad", i - 1)
            grads_in = (sent, gk, gv, step.send_rows)
        if pending is not None:
            pending.wait()
            _record(run, "wait", i + 1)
            k_cur, v_cur = k_next, v_next
    if grads_in is not None:
        add_home(grads_in)
        _record(run, "wait_grad", len(steps) - 1)
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
    dek, dev = (None, None) if dextra is None else (dextra[0].to(extra_k.dtype), dextra[1].to(extra_v.dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, dek, dev


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, extra_k, extra_v, run):
        out, lse = _forward(q, k, v, sinks, extra_k, extra_v, run)
        ctx.save_for_backward(q, k, v, sinks, extra_k, extra_v, out, lse)
        ctx.run = run
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward("seqpar ring attention")
        q, k, v, sinks, extra_k, extra_v, out, lse = ctx.saved_tensors
        grads = _backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse, ctx.run)
        # No gradient for run.
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None)


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, run: RingRun, *, sinks: Tensor | None = None,
    extra_k: Tensor | None = None, extra_v: Tensor | None = None,
) -> Tensor:
    """Exact attention of ring-local queries over every ring rank's K/V, following ``run.plan``.

    Trusted entry point: the caller validated the tensors against the plan (``seqpar.attention``
    and ``seqpar.varlen_attention`` do). Collective over ``run.group``.

    Args:
        q: ``(batch, L, nheads, headdim)``, this ring rank's ring-local queries (packed: batch 1).
        k, v: ``(batch, L, nheads_kv, headdim)``.
        run: the group, plan, backend and scalar options.
        sinks: ``(nheads,)`` sink logits, or None.
        extra_k, extra_v: ``(batch, P, nheads_kv, headdim)`` keys every query also attends
            (replicated tokens), or None.

    Returns:
        ``(batch, L, nheads, headdim)`` in q's dtype; differentiable w.r.t. every tensor input.
    """
    return _RingAttention.apply(q, k, v, sinks, extra_k, extra_v, run)
