"""Process-group helpers shared by the collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def check_group(group: object, where: str) -> None:
    """Raise ``ValueError`` unless ``group`` is a ``ProcessGroup`` or ``None``."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{where}: group must be a torch.distributed ProcessGroup or None, got "
            f"{type(group).__name__}; pass e.g. state.ulysses_group"
        )


def group_timeout(group: Group):
    """The collective timeout of ``group`` (a ``timedelta``), or ``None`` if torch does not say."""
    if group is None:
        group = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# Names of the process groups ``ParallelState.close`` destroyed (Note [Closed states] in
# ``seqpar.state``). torch may give a later group the same name, so a name here means "closed"
# only for a group torch no longer knows.
_CLOSED_NAMES: set[str] = set()


def mark_closed(groups: list) -> None:
    """Record ``groups`` as destroyed by ``ParallelState.close`` (called just before destroying them)."""
    for pg in groups:
        name = getattr(pg, "group_name", None)
        if name:
            _CLOSED_NAMES.add(name)


def check_open(group: Group, where: str = "seqpar") -> None:
    """Raise seqpar's closed-state ``ValueError`` if ``group`` is one a closed ``ParallelState``
    destroyed (torch answers a rank lookup with "not registered ... new_group" and a size lookup
    without complaint). Called by the helpers below, which every collective of seqpar goes through."""
    if group is None or getattr(group, "group_name", None) not in _CLOSED_NAMES:
        return
    try:
        dist.get_rank(group)  # raises for a group torch no longer knows (its size does not)
        return  # a live group that took a destroyed one's name
    except (ValueError, RuntimeError):
        pass
    raise ValueError(
        f"{where}: this ParallelState was closed (ParallelState.close destroyed its process groups), but a call "
        "still communicates over them -- typically the backward of an attention or shard call made before "
        "close; run the backward before closing the state, or build a new state and run the call again"
    )


def group_size(group: Group) -> int:
    """Size of ``group``; ``None`` is the default group, or a single process when none exists."""
    if group is None and not _initialized():
        return 1
    check_open(group)
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank in ``group`` (0 for ``None`` without a process group)."""
    if group is None and not _initialized():
        return 0
    check_open(group)
    return dist.get_rank(group)


def check_dim(dim: int, ndim: int, name: str, where: str) -> int:
    """Normalise a possibly negative ``dim``; ``ValueError`` if out of range."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{where}: {name} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{where}: {name}={dim} is out of range for a {ndim}-dim tensor (valid: {-ndim}..{ndim - 1})"
        )
    return dim % ndim


def check_sizes(sizes: list[int] | tuple[int, ...], parts: int, total: int | None, where: str) -> list[int]:
    """Validate a per-rank sizes list: ``parts`` non-negative ints summing to ``total``."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != parts:
        raise ValueError(f"{where}: sizes has {len(sizes)} entries {sizes} but the group has {parts} ranks")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{where}: sizes {sizes} has a negative entry")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"{where}: sizes {sizes} sum to {sum(sizes)} but the dimension has {total} elements")
    return sizes


def exchange_ints(values: list[int], group: Group, device: torch.device) -> list[list[int]]:
    """All-gather a short list of ints from every rank: ``out[rank] == values`` of that rank."""
    n = group_size(group)
    if n == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.long, device=device)
    out = torch.empty(n * len(values), dtype=torch.long, device=device)
    all_gather_flat(out, t, group=group)
    return out.view(n, len(values)).tolist()


# torch >= 2.13 renames the flat-tensor collectives; older releases only have the old names.
# Looked up at call time, so that wrappers installed on torch.distributed (tests counting
# collectives, profilers) see the calls.
def all_gather_flat(out: torch.Tensor, t: torch.Tensor, group: Group = None) -> None:
    """``all_gather_single`` (torch >= 2.13) or ``all_gather_into_tensor``."""
    check_open(group)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t, group=group)


def reduce_scatter_flat(out: torch.Tensor, t: torch.Tensor, op=None, group: Group = None) -> None:
    """``reduce_scatter_single`` (torch >= 2.13) or ``reduce_scatter_tensor``."""
    check_open(group)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, t, op=dist.ReduceOp.SUM if op is None else op, group=group)


def refuse_double_backward(what: str) -> None:
    """Raise in a backward that runs with ``create_graph=True`` (grad mode on).

    seqpar's collectives and attention have backward passes that are not themselves
    differentiable; without this check a gradient penalty would silently get gradients that do
    not require grad (second-order terms of zero). Called first thing in a backward, before any
    communication, so every rank raises.

    Raises:
        RuntimeError: naming ``what`` and the way out.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} does not support double backward (torch.autograd.grad(..., create_graph=True),"
            " e.g. a gradient penalty through attention): its backward is not differentiable; "
            "compute such terms without it"
        )
