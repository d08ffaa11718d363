"""``ParallelState``: the process groups of hybrid context parallelism, passed explicitly.

Rank layout (``docs/sharding.md``): the parent group is cut into data-parallel replicas of ``cp_size =
ring_size * ulysses_size`` consecutive ranks. Within a CP group, ``cp_rank = ring_rank *
ulysses_size + ulysses_rank`` (Ulysses innermost, so its all-to-all stays inside a node)::

    parent rank g:  dp_rank = g // cp_size,  cp_rank = g % cp_size
    cp_rank c:      ring_rank = c // ulysses_size,  ulysses_rank = c % ulysses_size

Every group's members are ordered by their rank along that axis, so a collective over
``cp_group`` sees the CP ranks in ``cp_rank`` order.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch.distributed as dist

from .comm import Workspace, group_rank, group_size, group_timeout

Checks = Literal["auto", "always", "never"]
_CHECKS = ("auto", "always", "never")

__all__ = ["ParallelState"]


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"ParallelState: {name} must be a positive int, got {value!r}")
    return int(value)


def _new_group(
    ranks: list[int], parent_ranks: list[int], parent: dist.ProcessGroup | None, local: bool,
    timeout: timedelta | None, created: list,
):
    """A group over ``ranks`` (global ranks), reusing ``parent`` when it is the same set with the
    same timeout.

    With the default group as parent every rank takes part in every ``new_group`` call, which
    is torch's usual contract. With a sub-group as parent only its members call, so groups are
    created with local synchronisation (torch then names them from the ranks and the number of
    groups the process already has: the parent's members must have created the same number).
    Groups this process belongs to are appended to ``created`` (for :meth:`ParallelState.close`).
    """
    if ranks == parent_ranks and timeout == group_timeout(parent):
        return parent
    if local:
        pg = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    else:
        pg = dist.new_group(ranks, timeout=timeout)
    if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
        created.append(pg)
    return pg


@dataclass(init=False, repr=False, eq=False)
class ParallelState:
    """Ring, Ulysses, CP and DP groups of one process (a collective constructor).

    Args:
        ring_size: ``R``, ranks in the outer ring (point-to-point K/V exchange).
        ulysses_size: ``U``, ranks in the inner Ulysses all-to-all group.
        group: parent process group; ``None`` means the default group. ``ring_size *
            ulysses_size`` must divide its size; the remaining factor is data parallelism.
            With ``torch.distributed`` not initialised, only the size-1 state is possible.
        timeout: how long collectives over this state's groups wait; ``None`` takes the parent
            group's timeout (what ``init_process_group(timeout=...)`` set). A group with the
            parent's ranks is the parent itself unless the timeouts differ.
        checks: when attention calls check that every CP rank passes matching shards and
            options (Note [Global length] in ``seqpar.attention``): ``"auto"`` with a collective
            whenever that costs no host synchronisation -- ``seq_len=None``, or tensors on the
            CPU -- and only local checks for accelerator tensors with ``seq_len`` given;
            ``"always"`` on every call; ``"never"`` only when ``seq_len`` is unknown. With
            ``"auto"``, ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in the environment at construction
            means ``"always"``.

    Attributes:
        ring_size, ring_rank, ring_group, ulysses_size, ulysses_rank, ulysses_group,
        cp_size, cp_rank, cp_group, dp_size, dp_rank, dp_group. Groups are ``None`` only in a
        process with no process group (then every size is 1 and every rank 0).
        workspace: scratch buffers that attention calls on this state reuse (staging copies,
            ring transfer buffers; Note [Workspace] in ``seqpar.comm.workspace``);
            ``state.workspace.clear()`` frees them.

    Raises:
        ValueError: if a size is not a positive int, if ``ring_size * ulysses_size`` does not
            divide the parent group's size, if sizes > 1 are asked for without a process group,
            or if this process is not a member of ``group``.

    Every rank of the parent group must construct the state with the same arguments (it creates
    process groups). Example: 8 ranks, ``ParallelState(ring_size=2, ulysses_size=2)`` gives
    ``dp_size == 2``; rank 5 has ``dp_rank 1, cp_rank 1, ring_rank 0, ulysses_rank 1``.
    :meth:`close` (or ``with ParallelState(...) as state:``) frees the groups it created.
    """

    ring_size: int
    ring_rank: int
    ring_group: dist.ProcessGroup | None
    ulysses_size: int
    ulysses_rank: int
    ulysses_group: dist.ProcessGroup | None
    cp_size: int
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    parent_group: dist.ProcessGroup | None = field(default=None)
    workspace: Workspace = field(default_factory=Workspace)
    checks: Checks = "auto"
    timeout: timedelta | None = None

    def __init__(
        self,
        ring_size: int = 1,
        ulysses_size: int = 1,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: timedelta | None = None,
        checks: Checks = "auto",
    ) -> None:
        self.workspace = Workspace()
        self._created: list = []
        self._closed = False
        if checks not in _CHECKS:
            raise ValueError(f"ParallelState: checks must be one of {list(_CHECKS)}, got {checks!r}")
        if checks == "auto" and os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            checks = "always"
        self.checks = checks
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"ParallelState: timeout must be a datetime.timedelta or None, got {timeout!r}")
        ring_size = _check_size("ring_size", ring_size)
        ulysses_size = _check_size("ulysses_size", ulysses_size)
        cp_size = ring_size * ulysses_size
        self.ring_size, self.ulysses_size, self.cp_size = ring_size, ulysses_size, cp_size

        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError("ParallelState: a group was given but torch.distributed is not initialised")
            if cp_size != 1:
                raise ValueError(
                    f"ParallelState: ring_size={ring_size} x ulysses_size={ulysses_size} needs "
                    f"{cp_size} ranks, but torch.distributed is not initialised; call "
                    "torch.distributed.init_process_group first (or use ParallelState() for one process)"
                )
            self.ring_rank = self.ulysses_rank = self.cp_rank = self.dp_rank = 0
            self.dp_size = 1
            self.ring_group = self.ulysses_group = self.cp_group = self.dp_group = None
            self.parent_group = None
            self.timeout = timeout
            return

        if group is not None and not isinstance(group, dist.ProcessGroup):
            if group == dist.GroupMember.NON_GROUP_MEMBER:
                raise ValueError(
                    f"ParallelState: this process (global rank {dist.get_rank()}) is not a member of "
                    "the group it was given (torch.distributed.new_group returns a placeholder on the "
                    "ranks outside it); build the state only on the group's members"
                )
            raise ValueError(f"ParallelState: group must be a ProcessGroup or None, got {type(group).__name__}")
        parent = group if group is not None else dist.group.WORLD
        if dist.get_rank(parent) < 0:
            raise ValueError(
                f"ParallelState: this process (global rank {dist.get_rank()}) is not a member of the "
                f"given group (ranks {dist.get_process_group_ranks(parent)}); build the state only on "
                "the group's members"
            )
        timeout = timeout if timeout is not None else group_timeout(parent)
        self.timeout = timeout
        local = group_size(parent) != dist.get_world_size()
        world = group_size(parent)
        if world % cp_size != 0:
            raise ValueError(
                f"ParallelState: ring_size={ring_size} x ulysses_size={ulysses_size} = {cp_size} "
                f"does not divide the {world} ranks of the group; choose sizes whose product divides "
                f"{world} (e.g. ring_size * ulysses_size in {_divisors(world)})"
            )
        rank = group_rank(parent)
        parent_ranks = dist.get_process_group_ranks(parent)
        dp_size = world // cp_size
        self.parent_group = parent
        self.dp_size = dp_size
        self.dp_rank, self.cp_rank = divmod(rank, cp_size)
        self.ring_rank, self.ulysses_rank = divmod(self.cp_rank, ulysses_size)

        def g(dp: int, ring: int, uly: int) -> int:
            return parent_ranks[dp * cp_size + ring * ulysses_size + uly]

        # Every rank creates every group in the same order (new_group is collective).
        for dp in range(dp_size):
            ranks = [g(dp, r, u) for r in range(ring_size) for u in range(ulysses_size)]
            pg = _new_group(ranks, parent_ranks, parent, local, timeout, self._created)
            if dp == self.dp_rank:
                self.cp_group = pg
        for dp in range(dp_size):
            for u in range(ulysses_size):
                pg = _new_group([g(dp, r, u) for r in range(ring_size)], parent_ranks, parent, local, timeout,
                                self._created)
                if (dp, u) == (self.dp_rank, self.ulysses_rank):
                    self.ring_group = pg
            for r in range(ring_size):
                pg = _new_group([g(dp, r, u) for u in range(ulysses_size)], parent_ranks, parent, local, timeout,
                                self._created)
                if (dp, r) == (self.dp_rank, self.ring_rank):
                    self.ulysses_group = pg
        for c in range(cp_size):
            pg = _new_group([parent_ranks[dp * cp_size + c] for dp in range(dp_size)], parent_ranks, parent, local,
                            timeout, self._created)
            if c == self.cp_rank:
                self.dp_group = pg

    def check_usable(self, where: str) -> None:
        """Raise ``ValueError`` if this state cannot serve a call: it was closed, or it was built
        for one process before ``torch.distributed`` was initialised and the world is now larger
        (it has no groups, and ``None`` would mean the whole world to a collective)."""
        if self.parent_group is not None:
            return
        if self._closed:
            raise ValueError(f"{where}: this ParallelState was closed; build a new one")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"{where}: this ParallelState was built before torch.distributed was initialised, so "
                f"it describes a single process and has no process groups, but the world now has "
                f"{dist.get_world_size()} ranks; build the state after init_process_group"
            )

    def close(self) -> None:
        """Free the process groups this state created and its workspace (idempotent).

        A collective in spirit: every rank of the parent group closes its state; the state is
        unusable afterwards (its group attributes become ``None``). The parent group is not
        touched.
        """
        for pg in self._created:
            try:
                dist.destroy_process_group(pg)
            except (ValueError, RuntimeError):  # already destroyed with the default group
                pass
        self._created = []
        self.workspace.clear()
        if self.parent_group is not None:
            self.ring_group = self.ulysses_group = self.cp_group = self.dp_group = None
            self.parent_group = None
            self._closed = True

    def __enter__(self) -> ParallelState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ParallelState(ring {self.ring_rank}/{self.ring_size}, ulysses "
            f"{self.ulysses_rank}/{self.ulysses_size}, cp {self.cp_rank}/{self.cp_size}, "
            f"dp {self.dp_rank}/{self.dp_size})"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
