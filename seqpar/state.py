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

import contextlib
import hashlib
import itertools
import os
import threading
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Literal, get_args

import torch
import torch.distributed as dist

from .comm import Workspace, group_rank, group_size, group_timeout
from .comm.group import mark_closed
from .placement.sizes import is_int

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Checks = Literal["auto", "always", "never"]
_CHECKS = ("auto", "always", "never")
RingComm = Literal["p2p", "p2p_serial", "allgather"]
_RING_COMMS = get_args(RingComm)

__all__ = ["ParallelState", "require_state"]


# Live states by handle: seqpar's custom operators (torch.compile, ``seqpar.compiled``) take a state
# as this integer. Weak values: the registry never keeps a state alive.
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def state_from_handle(handle: str) -> ParallelState:
    """The live :class:`ParallelState` whose ``handle`` is ``handle``."""
    state = _LIVE.get(handle)
    if state is None:
        raise ValueError(f"seqpar: no live ParallelState has handle {handle} (it was garbage collected)")
    return state


def _check_size(name: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"ParallelState: {name} must be a positive int, got {value!r}")
    return int(value)


def _new_group(
    ranks: list[int], parent_ranks: list[int], parent: dist.ProcessGroup | None, names: _GroupNames | None,
    timeout: timedelta | None, created: list,
):
    """A group over ``ranks`` (global ranks), reusing ``parent`` when it is the same set with the
    same timeout.

    With the default group as parent every rank takes part in every ``new_group`` call, which
    is torch's usual contract. With a sub-group as parent only its members call, so groups are
    created with local synchronisation, under the names ``names`` gives them (Note [Group
    names]). Groups this process belongs to are appended to ``created`` (for
    :meth:`ParallelState.close`).
    """
    if ranks == parent_ranks and timeout == group_timeout(parent):
        return parent
    if names is not None:
        with names.naming(ranks):
            pg = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    else:
        pg = dist.new_group(ranks, timeout=timeout)
    if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
        created.append(pg)
    return pg


class _GroupNames:
    """Unique names for the groups one ``ParallelState`` creates with local synchronisation.

    Note [Group names]
    ~~~~~~~~~~~~~~~~~~
    ``dist.new_group(ranks, use_local_synchronization=True)`` names the group after its ranks and
    the number of groups the process holds, and the group's ranks rendezvous under that name in the
    default group's store. After :meth:`ParallelState.close` destroys its groups, that number is
    back where it was, so a new state over the same sub-group gives its groups the *destroyed*
    groups' names; the store still holds their old rendezvous keys, and the new groups connect to
    ranks that no longer listen (``Gloo connectFullMesh failed``, or one rank waiting forever).

    So the groups of a state over a sub-group are named ``seqpar:<generation>:<index>:<ranks>``:
    the generation is agreed by the parent group's members (the maximum of their per-process
    counters, one all-reduce) and is new for every state built over any parent; the index is the
    group's place in the construction order, which every member walks in full (also past groups
    it is not in), so all members of a group name it alike. torch has no public argument for a
    group's name: its name function is replaced for the one ``new_group`` call of this thread,
    for exactly these ranks (torch's own name is used if that function is missing).
    """

    _generations = itertools.count()  # per process; the parent's members agree on the maximum

    def __init__(self, parent: dist.ProcessGroup) -> None:
        mine = torch.tensor([next(self._generations)], dtype=torch.long, device=_group_device(parent))
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=parent)
        self.generation = int(mine.item())
        while next(self._generations) < self.generation:  # no later state reuses this generation
            pass
        self.index = 0

    @contextlib.contextmanager
    def naming(self, ranks: list[int]):
        """Name the group this thread creates over ``ranks`` while the context is open."""
        c10d = dist.distributed_c10d
        original = getattr(c10d, "_process_group_name", None)
        key = f"seqpar:{self.generation}:{self.index}:{'_'.join(map(str, sorted(ranks)))}"
        self.index += 1
        if original is None:  # pragma: no cover - depends on the torch version
            yield
            return
        thread = threading.get_ident()

        def name(group_ranks, use_hashed_name):
            if use_hashed_name and threading.get_ident() == thread and list(group_ranks) == sorted(ranks):
                return hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()
            return original(group_ranks, use_hashed_name)

        c10d._process_group_name = name
        try:
            yield
        finally:
            c10d._process_group_name = original


def _group_device(group: dist.ProcessGroup) -> torch.device:
    """A device ``group``'s collectives accept: the CPU if it has a CPU backend, else the current
    CUDA device (NCCL)."""
    try:
        group._get_backend(torch.device("cpu"))
        return torch.device("cpu")
    except (RuntimeError, ValueError, AttributeError):
        return torch.device("cuda", torch.cuda.current_device())


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
            options (Note [Global length] in ``seqpar.prepare``): ``"auto"`` with a collective
            whenever that costs no host synchronisation -- ``seq_len=None``, or tensors on the
            CPU -- and only local checks for accelerator tensors with ``seq_len`` given;
            ``"always"`` on every call; ``"never"`` only when ``seq_len`` is unknown. With
            ``"auto"``, ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in the environment at construction
            means ``"always"``.
        ring_comm: how K/V travel over the ring group (``docs/performance.md``, "All-gather K/V vs
            ring p2p"): ``"p2p"`` (default), one hop per ring step overlapping that step's
            kernels; ``"p2p_serial"``, the same hops, each completed before its step's kernels
            run (the least memory: no K/V or dK/dV of another step alive next to a kernel, at the
            price of transfers no longer hidden; ``docs/performance.md``, "The serial ring");
            ``"allgather"``, one all-gather of every row some rank's plan reads (Llama 3
            style: fewer, larger transfers, all of the group's needed K/V held at once) and a
            reduce-scatter of dK/dV in the backward. Same plans, masks and results.
        keep_head_shards: with ``ulysses_size > 1``, whether the forward keeps the head-sharded
            q, k, v and output for the backward (Note [Ulysses memory] in
            ``seqpar.parallel.ulysses``). ``False`` (default): only the token shards are kept and
            the backward sends q, k, v and out again (12 shard transfers per call, the least
            memory); ``True``: the backward sends only dout and the gradients (8 transfers, the
            traffic of DeepSpeed's and yunchang's Ulysses) at the memory of the kept head shards
            (``docs/performance.md``, ``seqpar.plan``). Same results; no effect with ``U == 1``.

    Attributes:
        ring_size, ring_rank, ring_group, ulysses_size, ulysses_rank, ulysses_group,
        cp_size, cp_rank, cp_group, dp_size, dp_rank, dp_group. Groups are ``None`` only in a
        process with no process group (then every size is 1 and every rank 0).
        ring_comm: ``"p2p"``, ``"p2p_serial"`` or ``"allgather"``, as given.
        keep_head_shards: as given; may be set between calls.
        workspace: where attention calls on this state take their transfer and staging buffers
            (Note [Workspace] in ``seqpar.comm.workspace``): by default fresh per call, nothing
            kept between calls; ``state.workspace = seqpar.comm.Workspace(keep=True)`` keeps one
            arena instead (``state.workspace.nbytes``; ``clear()`` frees it).
        handle: a short string naming this state to seqpar's custom operators (``torch.compile``,
            ``docs/compile.md``); unique in the process. A string, so that the compiler keeps it a
            constant (an int attribute becomes a symbolic int under ``dynamic=True``).

    Raises:
        ValueError: if a size is not a positive int, if ``ring_size * ulysses_size`` does not
            divide the parent group's size, if sizes > 1 are asked for without a process group,
            if this process is not a member of ``group``, if ``ring_comm`` is not one of
            ``"p2p"``, ``"p2p_serial"``, ``"allgather"``, or if ``keep_head_shards`` is not a bool.

    Every rank of the parent group must construct the state with the same arguments (it creates
    process groups). Example: 8 ranks, ``ParallelState(ring_size=2, ulysses_size=2)`` gives
    ``dp_size == 2``; rank 5 has ``dp_rank 1, cp_rank 1, ring_rank 0, ulysses_rank 1``.
    :meth:`close` (or ``with ParallelState(...) as state:``) frees the groups it created.
    :meth:`from_device_mesh` takes the groups of a ``DeviceMesh`` instead, and
    :meth:`device_mesh` wraps a state's groups in one (``docs/howto-fsdp.md``).
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
    ring_comm: RingComm = "p2p"
    keep_head_shards: bool = False

    def __init__(
        self,
        ring_size: int = 1,
        ulysses_size: int = 1,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: timedelta | None = None,
        checks: Checks = "auto",
        ring_comm: RingComm = "p2p",
        keep_head_shards: bool = False,
    ) -> None:
        self._begin(checks, "ParallelState", ring_comm, keep_head_shards)
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

        # A sub-group's members create groups on their own, under names of their own (Note [Group names]).
        local = _GroupNames(parent) if world != dist.get_world_size() else None

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

    @classmethod
    def from_device_mesh(
        cls,
        mesh: DeviceMesh,
        *,
        dp: str | None = "dp",
        cp: str | None = "cp",
        ring: str | None = "ring",
        ulysses: str | None = "ulysses",
        checks: Checks = "auto",
        ring_comm: RingComm = "p2p",
        keep_head_shards: bool = False,
    ) -> ParallelState:
        """The state whose groups are the process groups of a ``torch`` ``DeviceMesh`` (collective).

        Note [States from a DeviceMesh]: the keywords name the mesh axes (``mesh_dim_names``)
        that play each role. Every axis of ``mesh`` must have one of these roles, and an axis
        name the mesh does not have means that role has size 1. The CP ranks are either

        - one ``cp`` axis, run as a **ring** (``ring_size = cp``, ``ulysses_size = 1``, the
          torchtitan convention); for Ulysses over that axis instead pass ``ulysses="cp"``; or
        - a ``ring`` axis and/or an ``ulysses`` axis (hybrid ``R x U``); the CP group is then
          the flattened ``mesh[ring, ulysses]`` (``DeviceMesh._flatten``, cached by the mesh).

        The axes must appear in seqpar's rank layout order (``docs/sharding.md``): ``dp``
        outermost, then ``ring``, then ``ulysses`` innermost, so that ``cp_rank = ring_rank *
        ulysses_size + ulysses_rank`` and a parent rank ``g`` has ``dp_rank = g // cp_size``.
        Examples: ``init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "cp"))`` gives
        ``R=4, U=1, dp_size=2``; ``(2, 2, 2)`` with ``("dp", "ring", "ulysses")`` gives ``R=U=2``.

        Groups come from the mesh (``mesh.get_group``), so their timeouts and backends are the
        mesh's, and :meth:`close` leaves them alone (the mesh owns them). Only the size-1 groups
        of roles the mesh lacks (e.g. ``ulysses_group`` for a ``("dp", "cp")`` mesh) are created
        here, one local group per rank, and freed by :meth:`close`. The parent group is the
        flattened mesh (``dist.group.WORLD`` when the mesh is the whole world in rank order).

        Args:
            mesh: a ``DeviceMesh`` with named axes, 1 to 3 of them; a sub-mesh such as
                ``world_mesh["dp", "cp"]`` of a larger (e.g. ``dp x cp x tp``) mesh is fine.
            dp: name of the data-parallel axis (``None``: no such axis).
            cp: name of a single context-parallel axis, run as a ring.
            ring: name of the ring axis of a hybrid mesh.
            ulysses: name of the Ulysses axis of a hybrid mesh.
            checks, ring_comm, keep_head_shards: as for :class:`ParallelState`.

        Returns:
            A :class:`ParallelState` with the same rank layout as ``ParallelState(R, U,
            group=parent)`` over the mesh's ranks.

        Raises:
            ValueError: ``mesh`` is not a ``DeviceMesh``, has no axis names, does not contain
                this rank, has an axis with no role, names both a ``cp`` axis and ``ring`` /
                ``ulysses`` axes, orders its axes against the rank layout, or its process groups
                disagree with its rank tensor. Messages name the axes, their sizes and the fix.
        """
        from torch.distributed.device_mesh import DeviceMesh

        where = "ParallelState.from_device_mesh"
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(
                f"{where}: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}"
            )
        roles = _mesh_roles(mesh, {"dp": dp, "cp": cp, "ring": ring, "ulysses": ulysses}, where)
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(
                f"{where}: this process (global rank {dist.get_rank()}) is not in the mesh "
                f"{mesh.mesh.tolist()}; build the state only on the mesh's ranks"
            )
        state = cls.__new__(cls)
        state._begin(checks, where, ring_comm, keep_head_shards)
        size = {role: mesh.size(axis) for role, axis in roles.items()}
        rank = {role: coordinate[axis] for role, axis in roles.items()}
        ring_size, ulysses_size, dp_size = size.get("ring", 1), size.get("ulysses", 1), size.get("dp", 1)
        state.ring_size, state.ulysses_size, state.dp_size = ring_size, ulysses_size, dp_size
        state.cp_size = ring_size * ulysses_size
        state.ring_rank, state.ulysses_rank = rank.get("ring", 0), rank.get("ulysses", 0)
        state.dp_rank = rank.get("dp", 0)
        state.cp_rank = state.ring_rank * ulysses_size + state.ulysses_rank

        names = mesh.mesh_dim_names
        parent = mesh._flatten().get_group() if mesh.ndim > 1 else mesh.get_group(0)
        state.parent_group = parent
        state.timeout = group_timeout(parent)

        def axis_group(role: str) -> dist.ProcessGroup:
            if role in roles:
                return mesh.get_group(roles[role])
            pg = dist.new_group([dist.get_rank()], timeout=state.timeout, use_local_synchronization=True)
            state._created.append(pg)
            return pg

        state.dp_group = axis_group("dp")
        state.ring_group = axis_group("ring")
        state.ulysses_group = axis_group("ulysses")
        if "ring" in roles and "ulysses" in roles:
            state.cp_group = mesh[names[roles["ring"]], names[roles["ulysses"]]]._flatten().get_group()
        else:
            state.cp_group = state.ulysses_group if "ulysses" in roles else state.ring_group
        _check_mesh_groups(state, mesh, where)
        return state

    def device_mesh(self, device_type: str, *, split_cp: bool = False) -> DeviceMesh:
        """A ``DeviceMesh`` over this state's ranks built from its own groups (for FSDP2/DTensor).

        ``DeviceMesh.from_group`` wraps the existing groups; no process group is created. The
        mesh's rank tensor is the parent group's ranks in seqpar's layout, so
        ``ParallelState.from_device_mesh(state.device_mesh(...))`` has this state's layout.

        Args:
            device_type: the mesh's device type, ``"cuda"`` or ``"cpu"`` (no index).
            split_cp: ``False``: axes ``("dp", "cp")``, shape ``(dp_size, cp_size)``;
                ``True``: axes ``("dp", "ring", "ulysses")``, shape ``(dp_size, R, U)``.

        Returns:
            The ``DeviceMesh``. It uses this state's groups: keep the state open while it is in
            use (:meth:`close` destroys the groups the state created).

        Raises:
            ValueError: the state has no process groups (built without ``torch.distributed``,
                or closed).
        """
        from torch.distributed.device_mesh import DeviceMesh

        self.check_usable("ParallelState.device_mesh")
        if self.parent_group is None:
            raise ValueError(
                "ParallelState.device_mesh: this state has no process groups (torch.distributed is not "
                "initialised); a DeviceMesh needs init_process_group first"
            )
        ranks = torch.tensor(dist.get_process_group_ranks(self.parent_group), dtype=torch.int)
        if split_cp:
            groups = [self.dp_group, self.ring_group, self.ulysses_group]
            shape, axes = (self.dp_size, self.ring_size, self.ulysses_size), ("dp", "ring", "ulysses")
        else:
            groups, shape, axes = [self.dp_group, self.cp_group], (self.dp_size, self.cp_size), ("dp", "cp")
        return DeviceMesh.from_group(groups, device_type, mesh=ranks.reshape(shape), mesh_dim_names=axes)

    def _begin(self, checks: object, where: str, ring_comm: object = "p2p", keep_head_shards: object = False) -> None:
        """Bookkeeping shared by every constructor: workspace, handle, ``checks``, ``ring_comm``,
        ``keep_head_shards``."""
        if not isinstance(keep_head_shards, bool):
            raise ValueError(
                f"{where}: keep_head_shards must be True or False, got {keep_head_shards!r} (True keeps the "
                "Ulysses head shards for the backward instead of sending q, k, v, out again)"
            )
        self.keep_head_shards = keep_head_shards
        if not isinstance(ring_comm, str) or ring_comm not in _RING_COMMS:
            raise ValueError(
                f"{where}: ring_comm must be one of {list(_RING_COMMS)}, got {ring_comm!r} "
                '("p2p": K/V hop around the ring, overlapping the kernels; "p2p_serial": the same hops '
                'without overlap, fewer buffers alive; "allgather": one all-gather of the ring group)'
            )
        self.ring_comm = ring_comm
        self.workspace = Workspace()
        self._created: list = []  # groups this state created and :meth:`close` destroys
        self._closed = False
        self.handle = f"seqpar-state-{next(_HANDLES)}"
        _LIVE[self.handle] = self
        if checks not in _CHECKS:
            raise ValueError(f"{where}: checks must be one of {list(_CHECKS)}, got {checks!r}")
        if checks == "auto" and os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            checks = "always"
        self.checks = checks

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
        touched. Every later seqpar call through the state raises seqpar's closed-state
        ``ValueError``, also the backward of a call made before ``close`` (Note [Closed states]).

        Note [Closed states]
        ~~~~~~~~~~~~~~~~~~~~
        A call's autograd graph keeps the groups it was made with, so its backward may run after
        ``close``. Its groups are then of two kinds: ones this state created, now destroyed (torch
        answers "not registered ... new_group" for a rank, a size without complaint), and the
        parent itself when an axis spans the whole parent (the ring of 4 x 1), still alive -- the
        backward would run silently through a closed state. So ``close`` leaves two marks that a
        call's own path reads before it communicates: the names of the destroyed groups
        (``seqpar.comm.group``'s rank, size and gather helpers, which seqpar's collectives go
        through, raise seqpar's error for them) and the state's workspace, closed (every attention
        forward and backward opens a scope on it first, whatever groups it uses). Public entries
        check :meth:`check_usable` as before. A workspace another live state shares is left open.
        Not covered: ``shard`` / ``unshard`` / ``seqpar.comm`` autograd functions over a group
        that is the parent itself keep only that live group, and still run.
        """
        reason = (
            "seqpar: this ParallelState was closed, but a call made on it still runs (the backward of an "
            "attention call made before close); run the backward before closing the state, or build a new "
            "state and run the call again"
        )
        shared = any(other is not self and other.workspace is self.workspace for other in list(_LIVE.values()))
        if not shared and self.parent_group is not None:
            self.workspace.close(reason)
        mark_closed(self._created)
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
            f"dp {self.dp_rank}/{self.dp_size}, ring_comm {self.ring_comm!r})"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_ROLE_ORDER = ("dp", "ring", "ulysses")  # outermost to innermost (docs/sharding.md, rank layout)


def _example_axes(ndim: int) -> tuple[str, ...]:
    return {1: ("cp",), 2: ("dp", "cp"), 3: ("dp", "ring", "ulysses")}.get(ndim, ("dp", "ring", "ulysses"))


def _mesh_roles(mesh: DeviceMesh, names: dict[str, str | None], where: str) -> dict[str, int]:
    """The mesh axis index of each role (``"dp"``, ``"ring"``, ``"ulysses"``) the mesh has.

    ``names`` maps ``"dp"``, ``"cp"``, ``"ring"``, ``"ulysses"`` to axis names (Note [States from a
    DeviceMesh] in :meth:`ParallelState.from_device_mesh`); a lone ``cp`` axis becomes the ring.

    Raises:
        ValueError: unnamed axes, a non-string name, an axis without a role or with two, a ``cp``
            axis besides ``ring``/``ulysses`` axes, or axes out of the rank layout's order.
    """
    axes, shape = mesh.mesh_dim_names, tuple(mesh.shape)
    if not axes:
        raise ValueError(
            f"{where}: the mesh of shape {shape} has no axis names; build it with names, e.g. "
            f"init_device_mesh(device_type, {shape}, mesh_dim_names={_example_axes(len(shape))})"
        )
    for role, name in names.items():
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{where}: {role}= must be a mesh axis name (str) or None, got {name!r}")
    index = {name: i for i, name in enumerate(axes)}
    found = {role: index[name] for role, name in names.items() if name in index}

    def show(indices) -> str:
        return ", ".join(f"{axes[i]!r} (size {shape[i]})" for i in indices)

    roles = {role: found[role] for role in ("dp", "ring", "ulysses") if role in found}
    if "cp" in found:
        if "ring" not in roles and "ulysses" not in roles:
            roles["ring"] = found["cp"]  # a single CP axis runs as a ring
        elif found["cp"] not in (roles.get("ring"), roles.get("ulysses")):
            hybrid = [roles[r] for r in ("ring", "ulysses") if r in roles]
            raise ValueError(
                f"{where}: mesh axes {axes} of sizes {shape} have a cp axis {show([found['cp']])} and "
                f"ring/ulysses axes {show(hybrid)}; the CP ranks are one or the other: pass cp=None "
                f"to use the ring/ulysses axes, or ring=None, ulysses=None to use {axes[found['cp']]!r}"
            )
    owner: dict[int, str] = {}
    for role, axis in roles.items():
        if axis in owner:
            raise ValueError(
                f"{where}: mesh axis {show([axis])} is named for both {owner[axis]} and {role}; "
                "give each role its own axis"
            )
        owner[axis] = role
    free = [i for i in range(len(axes)) if i not in owner]
    if free:
        used = tuple(axes[i] for i in sorted(owner))
        fix = f", or pass the sub-mesh of seqpar's axes, mesh[{', '.join(map(repr, used))}]" if used else ""
        raise ValueError(
            f"{where}: mesh axes {axes} of sizes {shape}: {show(free)} is not one of seqpar's axes "
            f"(dp={names['dp']!r}, cp={names['cp']!r}, ring={names['ring']!r}, "
            f"ulysses={names['ulysses']!r}); name it with the dp=/cp=/ring=/ulysses= keywords{fix}"
        )
    order = [role for role in _ROLE_ORDER if role in roles]
    if [roles[r] for r in order] != sorted(roles.values()):
        want = tuple(axes[roles[r]] for r in order)
        want_shape = tuple(shape[roles[r]] for r in order)
        raise ValueError(
            f"{where}: mesh axes {axes} of sizes {shape} are out of seqpar's rank layout order "
            "(docs/sharding.md): dp outermost, then ring, then ulysses innermost, so that cp_rank = "
            "ring_rank * ulysses_size + ulysses_rank; build the mesh as "
            f"init_device_mesh(device_type, {want_shape}, mesh_dim_names={want})"
        )
    return roles


def _check_mesh_groups(state: ParallelState, mesh: DeviceMesh, where: str) -> None:
    """Check every group of ``state`` against the mesh's rank tensor (no communication).

    With the axes in layout order the rank tensor reshapes to ``(dp_size, R, U)``; each group's
    members, in group-rank order, must be the corresponding line of it.
    """
    grid = mesh.mesh.reshape(state.dp_size, state.ring_size, state.ulysses_size)
    d, r, u = state.dp_rank, state.ring_rank, state.ulysses_rank
    expected = {
        "dp_group": grid[:, r, u],
        "ring_group": grid[d, :, u],
        "ulysses_group": grid[d, r, :],
        "cp_group": grid[d].reshape(-1),
        "parent_group": grid.reshape(-1),
    }
    for name, want in expected.items():
        got = dist.get_process_group_ranks(getattr(state, name))
        if got != want.tolist():
            state.close()
            raise ValueError(
                f"{where}: the mesh's {name} has ranks {got}, but its rank tensor {mesh.mesh.tolist()} "
                f"puts ranks {want.tolist()} on that axis; build the mesh with init_device_mesh, or "
                "DeviceMesh.from_group with groups that match its rank tensor"
            )


def require_state(state: object, where: str) -> ParallelState:
    """``state`` if it is a usable :class:`ParallelState` (the one check every public entry makes).

    Args:
        state: what the caller passed as ``state``.
        where: the public function's name, prefixed to the message.

    Raises:
        ValueError: ``state`` is not a ``ParallelState``, was closed, or describes one process while
            ``torch.distributed`` now has several (:meth:`ParallelState.check_usable`).
    """
    if not isinstance(state, ParallelState):
        raise ValueError(
            f"{where}: state must be a seqpar.ParallelState, got {type(state).__name__}; build one with "
            "seqpar.ParallelState(ring_size=..., ulysses_size=...)"
        )
    state.check_usable(where)
    return state
