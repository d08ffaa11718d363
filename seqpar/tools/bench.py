"""What the benchmarks under ``scripts/`` share: where their ranks run, their inputs, core
counts, warnings about measurements that would mislead and ``RxU`` parsing.

A benchmark runs the same function on every rank with :class:`Ranks`: under ``torchrun`` this
process is one rank (NCCL on its GPU, or gloo), otherwise it is the parent of local gloo ranks
(``seqpar.tools.testing.DistPool``); either way ``ranks.run(fn, ...)`` returns every rank's result
in rank order. :func:`torchrun_group` is the torchrun half alone (the training scripts use it).
What they print is in :mod:`seqpar.tools.report`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "under_torchrun",
    "torchrun_group",
    "Ranks",
    "check_on_ranks",
    "inputs",
    "usable_cores",
    "time_sharing_warning",
    "few_iterations_warning",
    "parse_configs",
]


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torchrun_device(device: str) -> torch.device:
    """This torchrun rank's device: ``cuda:LOCAL_RANK`` for ``"cuda"`` (and ``"auto"`` with CUDA
    available), else the CPU."""
    kind = torch.device(device).type if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available (torch.cuda.is_available() is False)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if kind != "cpu":
        raise ValueError(f"device={device!r}: expected 'auto', 'cuda' or 'cpu'")
    return torch.device("cpu")


@contextmanager
def torchrun_group(
    device: str = "auto", *, timeout_s: float | None = None, split_cpu_threads: bool = False
) -> Iterator[torch.device]:
    """This torchrun rank's default process group for the block; yields the rank's device.

    ``device``: ``"auto"`` (CUDA when available), ``"cuda"`` or ``"cpu"``. On CUDA the rank uses
    ``cuda:LOCAL_RANK`` and NCCL; on the CPU gloo, and with ``split_cpu_threads`` the node's cores
    are split evenly between its ``LOCAL_WORLD_SIZE`` ranks. ``timeout_s``: the collectives'
    timeout (``None``: torch's default). At exit the ranks leave together -- a gloo rank that tears
    down while its peers still use their connections can abort ("terminate called without an
    active exception") -- and the group is destroyed; after an exception it is only destroyed.

    Raises:
        ValueError: for an unknown ``device``, or ``"cuda"`` without CUDA.
    """
    rank_device = _torchrun_device(device)
    if rank_device.type == "cuda":
        torch.cuda.set_device(rank_device)
    elif split_cpu_threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if rank_device.type == "cuda" else "gloo", timeout=timeout)
    try:
        yield rank_device
        dist.barrier()
    finally:
        dist.destroy_process_group()


class Ranks:
    """The ranks a benchmark runs on: this ``torchrun`` job's, or ``world`` local gloo ranks.

    ::

        with Ranks(args.world) as ranks:
            results = ranks.run(measure, args)  # on every rank; every rank's result, in rank order
            if ranks.rank == 0:
                print(results)

    Under ``torchrun`` (``torchrun=None``: :func:`under_torchrun`) this process is one rank of the
    job (:func:`torchrun_group` with ``device``): :meth:`run` calls the function here and gathers
    every rank's result (``all_gather_object``). Otherwise this process is the parent of a
    ``DistPool`` of ``world`` CPU processes, spawned at the first :meth:`run`; ``device`` is then
    the CPU whatever was asked. ``timeout_s`` is the collectives' timeout either way.

    Attributes:
        torchrun: which of the two.
        world: the number of ranks (``torchrun``'s world size, or ``world``).
        rank: this process's rank (0 for the parent of local ranks).
        device: this rank's device (``cuda:LOCAL_RANK`` or the CPU); local ranks run on the CPU.
        ranks_per_node: ranks sharing this machine's cores (``LOCAL_WORLD_SIZE`` under torchrun).

    Raises:
        ValueError: without ``world`` outside torchrun, or for a ``world`` below 1.
    """

    def __init__(
        self, world: int | None, *, device: str = "auto", timeout_s: float = 600.0, torchrun: bool | None = None
    ) -> None:
        self.torchrun = under_torchrun() if torchrun is None else torchrun
        if not self.torchrun and (world is None or world < 1):
            raise ValueError(f"Ranks: local ranks need a world of at least 1, got world={world!r}")
        self.world = world or 0
        self.rank = 0
        self.device = torch.device("cpu")
        self.ranks_per_node = self.world
        self._device, self._timeout_s = device, timeout_s
        self._group: Any = None
        self._pool: Any = None

    def __enter__(self) -> Ranks:
        if self.torchrun:
            self._group = torchrun_group(self._device, timeout_s=self._timeout_s)
            self.device = self._group.__enter__()
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            self.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        else:
            from .testing import DistPool

            self._pool = DistPool(self.world, timeout_s=self._timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._group is not None:
            group, self._group = self._group, None
            group.__exit__(*exc)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; every rank's result, in rank order.

        For local ranks ``fn`` must be importable by name and picklable with its arguments
        (``DistPool``). Under torchrun every rank must call it (a collective).
        """
        if self._pool is not None:
            return self._pool.run(fn, *args, **kwargs)
        if self._group is None:
            raise RuntimeError("Ranks.run: use the Ranks object inside its with block")
        mine = fn(*args, **kwargs)
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        return gathered


def check_on_ranks(run: Callable[[argparse.Namespace], float], args: argparse.Namespace) -> None:
    """Run ``run(args)`` on every rank -- this process's under ``torchrun`` (gloo), else ``args.world``
    local gloo ranks (:class:`Ranks`) -- with ``args.ulysses`` defaulting to ``world // args.ring``;
    exit with ``FAILED`` when any rank's error exceeds ``args.tol``, else print ``OK`` on rank 0."""
    with Ranks(args.world, device="cpu") as ranks:
        args.ulysses = args.ulysses or ranks.world // args.ring
        errors = ranks.run(run, args)
    if max(errors) > args.tol:
        raise SystemExit(f"FAILED: max relative error {max(errors):.1e} > --tol {args.tol}")
    if ranks.rank == 0:
        print("OK: the parallel model matches one device")


def inputs(
    leading: Sequence[int], heads: int, kv_heads: int, head_dim: int, *, seed: int = 0,
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Random ``q``, ``k``, ``v``, ``dout`` of an attention problem.

    Shapes ``[*leading, H, D]`` for ``q`` and ``dout``, ``[*leading, Hkv, D]`` for ``k`` and ``v``
    (``leading``: e.g. ``(B, S)`` dense, ``(T,)`` packed). Drawn in that order from a CPU generator
    seeded ``seed``, in float32 -- the same numbers on every rank and device -- then moved to
    ``device`` in ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*leading, h, head_dim, generator=gen).to(device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    ]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's core count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def time_sharing_warning(ranks: int, cores: int, device: str) -> str | None:
    """A warning when ``ranks`` single-threaded CPU ranks share fewer ``cores``, else ``None``.

    Each rank then runs only part of the time: an absolute time or a speedup over one process is
    not what the ranks would take on their own cores. Ratios between configurations measured the
    same way in one run (same ranks, same cores, interleaved) remain comparable.
    """
    if device != "cpu" or ranks <= cores:
        return None
    return (
        f"WARNING: {ranks} CPU ranks time-share {cores} core(s): absolute times and speedups over "
        "one process include the time-sharing and do not predict one core per rank; compare only "
        "ratios between configurations of this run"
    )


def few_iterations_warning(iters: int) -> str | None:
    """A warning when a median is taken over fewer than 3 timed iterations."""
    if iters >= 3:
        return None
    return f"WARNING: median over only {iters} timed iteration(s); use --iters 3 or more for stable ratios"


def parse_configs(text: str, option: str = "--configs") -> list[tuple[int, int]]:
    """``"4x1,2x2"`` -> ``[(4, 1), (2, 2)]`` (ring x Ulysses).

    Raises:
        SystemExit: for an item that is not two positive ints joined by ``x``.
    """
    out = []
    for item in text.split(","):
        try:
            r, u = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"{option}: expected items like 2x2 (ring x ulysses), got {item!r}") from None
        if r < 1 or u < 1:
            raise SystemExit(f"{option}: ring and ulysses sizes must be positive, got {item!r}")
        out.append((r, u))
    return out
