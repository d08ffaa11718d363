"""The all-gather K/V layout: which rows every ring rank contributes to one all-gather of the ring
group, and where each step of a ring plan finds its rows in the gathered buffer. Pure host maths on
the ring plans of every ring rank (Note [Ring blocks]); no tensors of the model, no communication.

Note [All-gather K/V]
~~~~~~~~~~~~~~~~~~~~~
``ParallelState(..., ring_comm="allgather")`` runs the same ring plans as the point-to-point ring,
with another transport (the Llama 3 style of context parallelism): instead of ``R - 1`` hops,
the ring group all-gathers, once, every K/V row some rank's plan reads.

- Ring rank ``j`` contributes ``rows[j]``: the union, over every other ring rank ``d``, of the
  rows ``d``'s plan receives from ``j`` (``recv_rows`` of the step whose ``src`` is ``j``), sorted
  and merged. Under a causal mask every row of ``j`` is read by some rank; under a window
  shorter than a zig-zag chunk only the rows next to a chunk edge are; rows nobody reads stay home.
- Every contribution is padded to ``width = max(len(rows[j]))`` rows (an all-gather moves equal
  parts), so the gathered buffer is ``[R, B, width, Hkv, D]`` for K (``Dv`` for V): slot ``j``
  holds ``rows[j]`` compacted, in order.
- Step ``i`` of this rank (``src = (r - i) mod R``) reads ``recv_rows`` of ``src``; in slot
  ``src`` they are the ranges ``steps[i]`` (in ``recv_rows`` order). When those are one range the
  step's compact K/V buffer is a view of the slot, else a copy of the ranges; either way it is the
  buffer whose key rows the step's kernel calls index, so the calls run unchanged.
- Backward, dK/dV of slot ``src``'s ranges are written into a zeroed gradient buffer shaped like
  the gathered one, and a reduce-scatter of the ring group sums every rank's slot ``j`` on rank
  ``j``, which adds it to the gradients of ``rows[j]``.

Bytes per rank (forward): every rank sends ``width`` rows and receives ``(R - 1) * width`` rows of
K and V; the backward gathers K/V again and reduce-scatters dK/dV (``(R - 1) * width`` rows out,
``width`` summed home). Memory: the gathered buffer holds ``R * width`` rows of K and V at once
(the ring holds two steps' rows), and the backward a gradient buffer of the same size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .ring import RingPlan

__all__ = ["GatherPlan", "gather_plan"]

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GatherPlan:
    """The all-gather of one ring group, seen from ring rank ``ring_rank`` (Note [All-gather K/V]).

    Attributes:
        ring_size, ring_rank: ``R`` and ``r``.
        rows: per ring rank ``j``, the ``(start, stop)`` ranges of its K/V buffer it contributes.
        width: rows of one slot of the gathered buffer (the largest contribution).
        steps: per step ``i`` of ``r``'s plan, the ranges of slot ``src`` that hold the step's
            ``recv_rows``, in that order, adjacent ranges merged (step 0 and empty steps: ``()``).
    """

    ring_size: int
    ring_rank: int
    rows: tuple[Ranges, ...]
    width: int
    steps: tuple[Ranges, ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Rows each ring rank contributes."""
        return tuple(sum(b - a for a, b in r) for r in self.rows)

    def sent_rows(self) -> int:
        """Rows this rank puts into the all-gather (padding included): ``width``."""
        return self.width if self.ring_size > 1 else 0

    def received_rows(self) -> int:
        """Rows this rank receives from the others (padding included): ``(R - 1) * width``."""
        return (self.ring_size - 1) * self.width


def _merged(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _in_slot(rows: Ranges, wanted: Ranges) -> Ranges:
    """``wanted`` ranges of a buffer as ranges of its contribution ``rows`` compacted, merged
    where adjacent."""
    starts, packed, off = [], [], 0
    for a, b in rows:
        starts.append((a, b))
        packed.append(off)
        off += b - a
    out: list[list[int]] = []
    for a, b in wanted:
        for (s, e), p in zip(starts, packed):
            if s <= a and b <= e:
                lo = p + a - s
                if out and out[-1][1] == lo:
                    out[-1][1] = lo + b - a
                else:
                    out.append([lo, lo + b - a])
                break
        else:
            raise RuntimeError(f"seqpar internal error: rows {(a, b)} are not in the contribution {rows}")
    return tuple((a, b) for a, b in out)


def gather_plan(plans: Sequence[RingPlan], ring_rank: int) -> GatherPlan:
    """The :class:`GatherPlan` of ring rank ``ring_rank``, from the plans of every ring rank
    (``plans[j]`` is ring rank ``j``'s :class:`~seqpar.placement.RingPlan` of the same call)."""
    R = len(plans)
    if any(p.ring_rank != j or p.ring_size != R for j, p in enumerate(plans)):
        raise RuntimeError("seqpar internal error: gather_plan needs the plans of ring ranks 0..R-1 in order")
    needed: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    for plan in plans:
        for step in plan.steps[1:]:
            needed[step.src].extend(step.recv_rows)
    rows = tuple(_merged(n) for n in needed)
    width = max((sum(b - a for a, b in r) for r in rows), default=0)
    mine = plans[ring_rank]
    steps = tuple(
        _in_slot(rows[s.src], s.recv_rows) if i and s.recv_rows else () for i, s in enumerate(mine.steps)
    )
    return GatherPlan(R, ring_rank, rows, width, steps)
