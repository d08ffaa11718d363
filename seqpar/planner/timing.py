"""Timing a call on any device: the planner's calibration measures with these, and so do the
benchmarks and tools (``seqpar.tools.profiling`` re-exports them beside its memory and
communication counters).

``PhaseTimer`` reads the seconds between marks of one call (the device synchronised at each mark,
or CUDA events); ``iteration_seconds`` times each call of a function with it, every rank starting
each call together; ``max_over_ranks`` takes the slowest rank per iteration and
``median_seconds`` the median, by default the slowest rank's (a collective finishes when its
slowest rank does).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["PhaseTimer", "iteration_seconds", "max_over_ranks", "median_seconds", "sync"]


def sync(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (CUDA); CPU ops run eagerly, a no-op."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Seconds between the marks of one timed call on ``device``.

    ``start()`` opens the call, each ``mark()`` ends a phase, ``stop()`` ends the last one and
    returns every phase's seconds::

        timer = PhaseTimer(device)
        timer.start()
        out = forward()
        timer.mark()
        out.backward(dout)
        fwd_s, bwd_s = timer.stop()

    By default every mark synchronises ``device`` (:func:`sync`), then waits at a barrier of
    ``group`` when ``barrier`` is set and a process group is initialised (all ranks pass the mark
    together: a phase then lasts as long as on the slowest rank), and reads ``perf_counter``. With
    ``events`` on a CUDA device a mark records a CUDA event instead and ``stop`` synchronises once:
    device time of each phase, the host not blocked in between (``barrier`` does not apply).
    """

    def __init__(
        self, device: torch.device, *, events: bool = False, barrier: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.events = events and self.device.type == "cuda"
        self.barrier, self.group = barrier, group
        self._marks: list = []

    def _now(self):
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        sync(self.device)
        if self.barrier and dist.is_initialized():
            dist.barrier(group=self.group)
        return time.perf_counter()

    def start(self) -> None:
        """Open a call: its first mark."""
        self._marks = [self._now()]

    def mark(self) -> None:
        """End a phase (and begin the next)."""
        self._marks.append(self._now())

    def stop(self) -> list[float]:
        """End the last phase; returns the seconds of every phase since :meth:`start`, in order."""
        self.mark()
        marks, self._marks = self._marks, []
        if self.events:
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
        return [b - a for a, b in itertools.pairwise(marks)]


def iteration_seconds(
    fn: Callable[[], object],
    iters: int,
    device: torch.device,
    *,
    warmup: int = 1,
    barrier: bool = True,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """Wall-clock seconds of each of ``iters`` calls of ``fn`` on this rank, after ``warmup``
    untimed calls.

    Each timed call starts after a barrier of ``group`` (the default group for ``None``) when
    ``barrier`` is set and a process group is initialised, so that all ranks start it together;
    ``device`` is synchronised before and after the call, so a time covers the device work that
    ``fn`` queued. Pass ``barrier=False`` when only some ranks of the group time ``fn``.

    Returns:
        ``iters`` times in seconds, in call order (this rank's only; see :func:`max_over_ranks`).
    """
    for _ in range(warmup):
        fn()
    together = barrier and dist.is_initialized()
    timer = PhaseTimer(device)
    times = []
    for _ in range(iters):
        if together:
            dist.barrier(group=group)
        timer.start()
        fn()
        times.append(timer.stop()[0])
    return times


def max_over_ranks(
    seconds: list[float], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Element-wise maximum of ``seconds`` over the ranks of ``group`` (a collective: every rank
    passes as many values): per iteration, the slowest rank's time. Unchanged without a process
    group. ``device`` holds the reduction's buffer (the backend's device, e.g. CUDA for NCCL)."""
    if not dist.is_initialized():
        return list(seconds)
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def median_seconds(
    fn: Callable[[], object],
    iters: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    *,
    warmup: int = 1,
    barrier: bool = True,
    over_ranks: bool = True,
) -> float:
    """The median time of ``fn``, in seconds: by default the slowest rank's.

    Each rank takes the median of ``iters`` timed calls after ``warmup`` untimed ones (see
    :func:`iteration_seconds` for ``barrier`` and ``group``). With ``over_ranks`` the result is
    the largest of these medians over the ranks of ``group`` -- a collective finishes when its
    slowest rank does -- and the call is a collective itself; without it, or without a process
    group, this process's own median.

    Raises:
        ValueError: if ``iters < 1``.
    """
    if iters < 1:
        raise ValueError(f"median_seconds needs iters >= 1 timed calls, got iters={iters}")
    mine = statistics.median(iteration_seconds(fn, iters, device, warmup=warmup, barrier=barrier, group=group))
    return max_over_ranks([mine], device, group)[0] if over_ranks else mine
