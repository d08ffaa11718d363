"""The ring step loop shared by dense (``seqpar.ring``) and packed (``seqpar.varlen``) ring
attention.

Note [Ring engine]
~~~~~~~~~~~~~~~~~~
Ring attention on ``R`` ranks runs ``R`` steps. At step ``i`` ring rank ``r`` holds the K/V of ring
rank ``src = (r - i) % R`` (step 0: its own) and computes the attention blocks of its queries
against them. The engine owns only the transport and the gradient bookkeeping; *what* a step
computes is a callback, so the same loop serves dense zig-zag and packed varlen ring attention.

Interface (tensors are opaque to the engine: any number, any shapes, any dtype)::

    ring_forward(group, kv, kv_shapes, forward_step, trace=None) -> None
    ring_backward(group, kv, kv_shapes, backward_step, trace=None) -> list[Tensor]

- ``kv``: this rank's own tensors that travel, e.g. ``[k, v]`` (``[B, S_r, Hkv, D]`` each) or one
  packed buffer. Every rank must pass the same number of tensors, with the same dtypes.
- ``kv_shapes(src) -> list[shape]``: the shapes of ring rank ``src``'s ``kv`` (sizes differ per
  rank: uneven zig-zag chunks); the engine allocates receive buffers from it. It must agree with
  what rank ``src`` actually passes as ``kv``.
- ``forward_step(src, kv_src) -> None``: compute this step's blocks against ``kv_src`` (the tensors
  of ring rank ``src``, read-only: they are being sent to the next rank meanwhile) and merge them
  into accumulators the callback owns (``seqpar.merge.merge_``). It is called for every ``src``,
  also when ``kv_src`` or the local queries are empty; skipping empty blocks is its job.
- ``backward_step(src, kv_src, dkv) -> None``: compute this step's block gradients; add dQ into an
  accumulator the callback owns and add the gradients w.r.t. ``kv_src`` into ``dkv`` -- zeroed
  tensors shaped like ``kv_src`` in ``accumulator_dtype`` (fp32, fp64 for fp64 inputs). Rows
  that the step does not touch are left alone.
- ``ring_backward`` returns the gradients of this rank's own ``kv`` (accumulator dtype), summed
  over every rank's queries.

Schedule (``R > 1``; ``R == 1`` is one step with no communication)::

    forward, step i:   post send kv_cur -> next, recv kv of src(i+1) <- prev    ("post_recv", i+1)
                       forward_step(src(i), kv_cur)                             ("compute", i)
                       wait K/V                                                 ("wait", i+1)

    backward, step i:  post K/V exchange as in forward                          ("post_recv", i+1)
                       backward_step(src(i), kv_cur, dkv_blk)                   ("compute", i)
                       wait the partial dK/dV of src(i) from prev (i > 0)       ("wait_grad", i)
                       dkv_blk += partial; post send dkv_blk -> next and
                       recv the partial of src(i+1) <- prev                     ("post_grad", i)
                       wait K/V                                                 ("wait", i+1)
                   after step R-1: wait for the own dK/dV, back from prev       ("wait_grad", R)

The dK/dV of ring rank ``j``'s K/V start at ``j`` and follow its K/V one hop behind, collecting each
rank's contribution; the hop after step ``R-1`` brings them home (``src(R) == r``). Each step's
dK/dV transfer overlaps the next step's compute. Every rank posts its sends to ``next`` in the same
order as ``next`` posts the matching receives (K/V of step 1, dK/dV of step 0, K/V of step 2, ...),
so point-to-point messages pair up in order. ``trace`` (a list, for tests) records the events above.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .comm import group_rank, group_size
from .comm._group import Group
from .comm.p2p import RingExchange
from .merge import accumulator_dtype

__all__ = ["ring_forward", "ring_backward", "KVShapes", "ForwardStep", "BackwardStep"]

KVShapes = Callable[[int], Sequence[Sequence[int]]]
ForwardStep = Callable[[int, Sequence[Tensor]], None]
BackwardStep = Callable[[int, Sequence[Tensor], Sequence[Tensor]], None]


def _record(trace: list | None, event: str, step: int) -> None:
    if trace is not None:
        trace.append((event, step))


def _buffers(
    shapes: Sequence[Sequence[int]], like: Sequence[Tensor], *, accumulator: bool, zero: bool
) -> list[Tensor]:
    """Contiguous buffers of ``shapes`` on the devices of ``like``, in their dtypes or (with
    ``accumulator``) their accumulator dtypes; zero-filled if ``zero``.

    Raises:
        ValueError: if ``kv_shapes`` gave a different number of shapes than there are kv tensors.
    """
    if len(shapes) != len(like):
        raise ValueError(f"kv_shapes gave {len(shapes)} shapes for {len(like)} kv tensors")
    new = torch.zeros if zero else torch.empty
    return [
        new(tuple(s), dtype=accumulator_dtype(t.dtype) if accumulator else t.dtype, device=t.device)
        for s, t in zip(shapes, like)
    ]


def ring_forward(
    group: Group,
    kv: Sequence[Tensor],
    kv_shapes: KVShapes,
    forward_step: ForwardStep,
    *,
    trace: list | None = None,
) -> None:
    """Run the forward ring: ``forward_step(src, kv_src)`` once per ring rank ``src``.

    Args:
        group: the ring's process group (rank order = ring order); ``None``: default group, or one
            process.
        kv: this rank's travelling tensors (see Note [Ring engine]).
        kv_shapes: ``kv_shapes(src)`` gives the shapes of ring rank ``src``'s ``kv``.
        forward_step: the per-step block computation; it accumulates its own results.
        trace: if a list, ``(event, step)`` tuples are appended to it.
    """
    size, rank = group_size(group), group_rank(group)
    exchange = RingExchange(group) if size > 1 else None
    current = list(kv)
    for step in range(size):
        incoming = None
        if step + 1 < size:
            incoming = _buffers(
                kv_shapes((rank - step - 1) % size), current, accumulator=False, zero=False
            )
            exchange.start(send=current, recv=incoming)
            _record(trace, "post_recv", step + 1)
        _record(trace, "compute", step)
        forward_step((rank - step) % size, current)
        if incoming is not None:
            exchange.wait()
            _record(trace, "wait", step + 1)
            current = incoming


def ring_backward(
    group: Group,
    kv: Sequence[Tensor],
    kv_shapes: KVShapes,
    backward_step: BackwardStep,
    *,
    trace: list | None = None,
) -> list[Tensor]:
    """Run the backward ring; return the gradients of this rank's own ``kv``.

    Args:
        group: the ring's process group, as in :func:`ring_forward`.
        kv: this rank's travelling tensors, the same as in the forward.
        kv_shapes: ``kv_shapes(src)`` gives the shapes of ring rank ``src``'s ``kv``.
        backward_step: ``backward_step(src, kv_src, dkv)`` adds the step's gradients w.r.t.
            ``kv_src`` into the zeroed ``dkv`` and accumulates dQ itself.
        trace: if a list, ``(event, step)`` tuples are appended to it.

    Returns:
        One tensor per ``kv`` tensor, same shape, in ``accumulator_dtype`` of its dtype: the sum of
        every rank's gradient contribution to this rank's K/V.
    """
    size, rank = group_size(group), group_rank(group)
    kv_exchange = RingExchange(group) if size > 1 else None
    grad_exchange = RingExchange(group) if size > 1 else None
    current = list(kv)
    partial: list[Tensor] | None = None  # dK/dV of src(step) summed over the ranks before us
    for step in range(size):
        src = (rank - step) % size
        incoming = None
        if step + 1 < size:
            incoming = _buffers(
                kv_shapes((rank - step - 1) % size), current, accumulator=False, zero=False
            )
            kv_exchange.start(send=current, recv=incoming)
            _record(trace, "post_recv", step + 1)
        grads = _buffers([t.shape for t in current], current, accumulator=True, zero=True)
        _record(trace, "compute", step)
        backward_step(src, current, grads)
        if size == 1:
            return grads
        if partial is not None:
            grad_exchange.wait()
            _record(trace, "wait_grad", step)
            for g, p in zip(grads, partial):
                g.add_(p)
        # Step R-1 sends the finished dK/dV of src(R-1) = rank+1 home and receives our own.
        partial = _buffers(
            kv_shapes((rank - step - 1) % size), current, accumulator=True, zero=False
        )
        grad_exchange.start(send=grads, recv=partial)
        _record(trace, "post_grad", step)
        if incoming is not None:
            kv_exchange.wait()
            _record(trace, "wait", step + 1)
            current = incoming
    grad_exchange.wait()
    _record(trace, "wait_grad", size)
    return partial
