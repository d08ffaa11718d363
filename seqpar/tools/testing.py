"""Run functions on several local CPU ranks (gloo), for tests and examples.

``DistPool(world_size)`` spawns ``world_size`` worker processes once, initialises a gloo process
group in each (``FileStore`` in a temporary directory), and then runs any number of functions on
all ranks with :meth:`DistPool.run`. Many test cases share one spawn, which on a 2-core machine
is the difference between seconds and minutes.

A function must be importable by name (module level) and picklable with its arguments; it
receives the arguments given to ``run`` and sees ``torch.distributed`` initialised with the
pool's ranks. An exception on any rank is re-raised in the parent with that rank's traceback,
after which the pool is torn down (its ranks may be out of step) and re-spawned on next use.

Process groups a function creates (its ``ParallelState``'s ring, Ulysses, CP and DP groups) are
destroyed when it returns: every gloo group keeps a ``gloo_tcp_loop`` thread that wakes up
periodically, and a few hundred leaked groups per rank made an unrelated single-process test ten
times slower on a 2-core machine. So a function must not leave groups for the next one.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistPool", "DistributedError"]


class DistributedError(AssertionError):
    """Raised in the parent when a function failed on one or more ranks."""


def _worker(rank: int, world_size: int, store_path: str, tasks, results, timeout_s: float) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            before = set(_groups())
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - reported to the parent verbatim
                results.put((rank, False, traceback.format_exc()))
            finally:
                _destroy_new_groups(before)
    finally:
        dist.destroy_process_group()


def _groups() -> list[Any]:
    """The live process groups of this process, the default group included (torch's registry of
    groups is private; without it nothing is cleaned up)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}))


def _destroy_new_groups(before: set[Any]) -> None:
    """Destroy the groups created since ``before`` (a local operation for a non-default group)."""
    for pg in _groups():
        if pg not in before and pg is not dist.GroupMember.WORLD:
            try:
                dist.destroy_process_group(pg)
            except (ValueError, RuntimeError):  # destroyed meanwhile
                pass


class DistPool:
    """A pool of ``world_size`` gloo ranks that runs functions on all of them.

    Args:
        world_size: number of ranks (processes).
        timeout_s: collective timeout inside the ranks, and how long ``run`` waits for results
            (beyond that: 30 s of slack, plus ``startup_s`` on the run that spawns the ranks).
        startup_s: what spawning takes at most: every rank imports torch (and the function's
            modules) afresh, which on a loaded 2-core machine takes minutes for four ranks.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0, startup_s: float = 300.0) -> None:
        if world_size < 1:
            raise ValueError(f"DistPool: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self._procs: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="seqpar-pool-")
        store_path = os.path.join(self._tmp.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, store_path, self._tasks[r], self._results, self.timeout_s),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            DistributedError: if any rank raised (with its traceback) or did not answer in time.
        """
        wait_s = self.timeout_s + 30
        if not self._procs:
            self._start()
            wait_s += self.startup_s
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while len(results) + len(errors) < self.world_size:
            try:
                # Short waits: a rank that died (killed, or failed to start) never answers, and
                # waiting out the whole timeout for it would only delay the same error.
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if not dead and time.monotonic() < deadline:
                    continue
                self.close()
                raise DistributedError(
                    f"{fn.__name__}: no answer from {self.world_size - len(results) - len(errors)} "
                    f"rank(s) within {wait_s:.0f}s (dead ranks: {dead}); errors so far: {errors}"
                ) from None
            (results if ok else errors)[rank] = value
        if errors:
            self.close()
            # A rank that failed on its own is the cause; "closed by peer" errors are its echo.
            own = [r for r in sorted(errors) if "closed by peer" not in errors[r]] or sorted(errors)
            report = "\n".join(f"--- rank {r}:\n{errors[r]}" for r in own[:2])
            raise DistributedError(f"{fn.__name__} failed on ranks {sorted(errors)} of {self.world_size}\n{report}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        # Interpreter teardown of a torch process takes seconds; the ranks hold nothing worth
        # a clean exit, so give them all one moment together and then stop them.
        started = [p for p in self._procs if p.pid is not None]
        deadline = time.monotonic() + 0.5
        for p in started:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join()
        self._procs = []
        if hasattr(self, "_tmp"):
            self._tmp.cleanup()
            del self._tmp

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
