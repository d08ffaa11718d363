"""Flat all-gather and reduce-scatter started asynchronously (the all-gather K/V transport's).

Like :func:`~seqpar.comm.post`, each returns a :class:`~seqpar.comm.Pending` whose ``wait`` blocks
until the collective completed, so the caller computes while data is in flight::

    pending = start_all_gather(out, part, group)   # out: [N * part.numel()], rank i's part at i
    ...compute on local data...
    pending.wait()

Both take contiguous flat tensors of one dtype; every rank passes parts of the same size (pad
uneven parts). gloo runs them on its own threads, NCCL on its stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import Group
from .p2p import Pending

__all__ = ["start_all_gather", "start_reduce_scatter"]


def _check(out: torch.Tensor, part: torch.Tensor, n: int, where: str) -> None:
    if not (out.is_contiguous() and part.is_contiguous()) or out.numel() != n * part.numel():
        raise ValueError(
            f"{where}: needs contiguous tensors with out.numel() == group size {n} x part.numel(), got "
            f"out {tuple(out.shape)} and part {tuple(part.shape)}"
        )


def start_all_gather(out: torch.Tensor, part: torch.Tensor, group: Group) -> Pending:
    """Start gathering every rank's ``part`` into ``out`` (rank ``i``'s at ``out[i * n:(i + 1) * n]``,
    ``n = part.numel()``)."""
    _check(out, part, dist.get_world_size(group), "start_all_gather")
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return Pending([fn(out, part, group=group, async_op=True)], [part])


def start_reduce_scatter(out: torch.Tensor, parts: torch.Tensor, group: Group) -> Pending:
    """Start summing ``parts`` (``N`` equal parts, flat) over the group into ``out``: rank ``i``
    receives the sum of every rank's part ``i``."""
    _check(parts, out, dist.get_world_size(group), "start_reduce_scatter")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return Pending([fn(out, parts, op=dist.ReduceOp.SUM, group=group, async_op=True)], [parts])
