"""Split / gather / reduce collectives with uneven sizes, autograd-aware.

Uneven all-gathers pad every part to the largest and trim (gloo's list forms need equal sizes);
reduce-scatters pad the same way. Parts are laid out ``dim``-first in the flat buffers so that
equal sizes need no copy after the collective.

The region mappings (forward / backward) are::

    split           keep own part      /  all-gather
    gather          all-gather         /  keep own part
    all_gather      all-gather         /  reduce-scatter (sum of partial gradients)
    reduce_scatter  reduce-scatter     /  all-gather
    all_reduce      all-reduce         /  identity
    copy_to         identity           /  all-reduce

``grad_scale`` (``split``/``gather``): ``"up"`` multiplies the gradient by the group size,
``"down"`` divides by it, ``None`` leaves it.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from ..placement.sizes import offsets, split_sizes
from .group import (
    Group,
    all_gather_flat,
    check_dim,
    check_group,
    check_sizes,
    exchange_ints,
    group_rank,
    group_size,
    reduce_scatter_flat,
)

__all__ = ["split", "gather", "all_gather", "reduce_scatter", "all_reduce", "copy_to", "reduce_"]

GradScale = Literal["up", "down"] | None


def _gather_impl(x: torch.Tensor, group: Group, dim: int, sizes: list[int]) -> torch.Tensor:
    """All-gather uneven parts along ``dim``; rank ``i`` holds ``sizes[i]`` elements."""
    n = len(sizes)
    if n == 1:
        return x
    m = max(sizes)
    moved = x.movedim(dim, 0)
    staging = x.new_zeros((m, *moved.shape[1:])) if x.shape[dim] < m else None
    if staging is None:
        send = moved.contiguous()
    else:
        staging[: x.shape[dim]].copy_(moved)
        send = staging
    out = x.new_empty((n * m, *moved.shape[1:]))
    all_gather_flat(out, send, group=group)
    if all(s == m for s in sizes):
        full = out
    else:
        full = torch.cat([out[i * m : i * m + s] for i, s in enumerate(sizes)])
    return full.movedim(0, dim)


def _reduce_scatter_impl(x: torch.Tensor, group: Group, dim: int, sizes: list[int]) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's part ``sizes[rank]`` along ``dim``."""
    n, me = len(sizes), group_rank(group)
    if n == 1:
        return x
    m = max(sizes)
    moved = x.movedim(dim, 0)
    if all(s == m for s in sizes):
        staging = moved.contiguous()
    else:
        staging = x.new_zeros((n * m, *moved.shape[1:]))
        for i, off in enumerate(offsets(sizes)[:-1]):
            staging[i * m : i * m + sizes[i]].copy_(moved[off : off + sizes[i]])
    out = x.new_empty((m, *moved.shape[1:]))
    reduce_scatter_flat(out, staging, op=dist.ReduceOp.SUM, group=group)
    return out[: sizes[me]].movedim(0, dim)


def _own_part(x: torch.Tensor, group: Group, dim: int, sizes: list[int]) -> torch.Tensor:
    me = group_rank(group)
    return x.narrow(dim, offsets(sizes)[me], sizes[me])


def _scale(g: torch.Tensor, group: Group, grad_scale: GradScale) -> torch.Tensor:
    if grad_scale == "up":
        return g * group_size(group)
    if grad_scale == "down":
        return g / group_size(group)
    return g


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes, grad_scale):
        ctx.group, ctx.dim, ctx.sizes, ctx.grad_scale = group, dim, sizes, grad_scale
        return _own_part(x, group, dim, sizes).clone()

    @staticmethod
    def backward(ctx, g):
        g = _gather_impl(g, ctx.group, ctx.dim, ctx.sizes)
        # No gradient for group, dim, sizes, grad_scale.
        return _scale(g, ctx.group, ctx.grad_scale), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes, grad_scale):
        ctx.group, ctx.dim, ctx.sizes, ctx.grad_scale = group, dim, sizes, grad_scale
        return _gather_impl(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        g = _own_part(g, ctx.group, ctx.dim, ctx.sizes)
        return _scale(g, ctx.group, ctx.grad_scale), None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _gather_impl(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_impl(g, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _reduce_scatter_impl(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        return _gather_impl(g, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if group_size(group) == 1:
            return x.clone()
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if group_size(ctx.group) == 1:
            return g, None
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _check_tensor(x: object, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(x).__name__}")


def _check_grad_scale(grad_scale: object, where: str) -> None:
    if grad_scale not in (None, "up", "down"):
        raise ValueError(f"{where}: grad_scale must be None, 'up' or 'down', got {grad_scale!r}")


def _part_sizes(
    x: torch.Tensor, group: Group, dim: int, sizes: list[int] | None, where: str
) -> list[int]:
    """Per-rank part sizes for a gather of local parts (exchanged when not given)."""
    n, me = group_size(group), group_rank(group)
    if sizes is None:
        return [v[0] for v in exchange_ints([x.shape[dim]], group, x.device)]
    sizes = check_sizes(sizes, n, None, where)
    if sizes[me] != x.shape[dim]:
        raise ValueError(
            f"{where}: sizes {sizes} give rank {me} {sizes[me]} elements but its tensor has "
            f"{x.shape[dim]} along dim {dim}"
        )
    return sizes


def split(
    x: torch.Tensor,
    group: Group,
    dim: int,
    sizes: list[int] | None = None,
    grad_scale: GradScale = None,
) -> torch.Tensor:
    """Keep this rank's part of ``x`` along ``dim``; backward all-gathers the gradient.

    Args:
        x: the full tensor, identical on every rank of ``group``.
        sizes: part sizes per rank (default ``split_sizes(x.shape[dim], N)``); must sum to
            ``x.shape[dim]``.
        grad_scale: ``None`` / ``"up"`` (x N) / ``"down"`` (/ N) applied in backward.

    Returns:
        ``x.narrow(dim, offset, sizes[rank])`` (a copy).

    Raises:
        ValueError: bad dim, group, grad_scale or sizes (wrong count, negative, wrong sum).
    """
    where = "split"
    _check_tensor(x, where)
    check_group(group, where)
    _check_grad_scale(grad_scale, where)
    dim = check_dim(dim, x.ndim, "dim", where)
    n = group_size(group)
    sizes = split_sizes(x.shape[dim], n) if sizes is None else check_sizes(sizes, n, x.shape[dim], where)
    return _Split.apply(x, group, dim, sizes, grad_scale)


def gather(
    x: torch.Tensor,
    group: Group,
    dim: int,
    sizes: list[int] | None = None,
    grad_scale: GradScale = None,
) -> torch.Tensor:
    """All-gather the parts of every rank along ``dim``; backward keeps this rank's part.

    Args:
        x: this rank's part; shapes agree between ranks except along ``dim``.
        sizes: every rank's part size (``None``: exchanged with one small collective).
        grad_scale: ``None`` / ``"up"`` / ``"down"`` applied in backward.

    Returns:
        ``x.shape`` with ``dim -> sum(sizes)``, parts in rank order.

    Raises:
        ValueError: bad dim, group or grad_scale; ``sizes`` of the wrong length, negative, or
            disagreeing with this rank's ``x.shape[dim]``.
    """
    where = "gather"
    _check_tensor(x, where)
    check_group(group, where)
    _check_grad_scale(grad_scale, where)
    dim = check_dim(dim, x.ndim, "dim", where)
    sizes = _part_sizes(x, group, dim, sizes, where)
    return _Gather.apply(x, group, dim, sizes, grad_scale)


def all_gather(x: torch.Tensor, group: Group, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather along ``dim`` whose backward reduce-scatters (sums partial gradients).

    Use it where each rank's upstream gradient is a partial sum (the gradient
    convention); :func:`gather` is the form for replicated gradients. Shapes and errors as
    :func:`gather`.
    """
    where = "all_gather"
    _check_tensor(x, where)
    check_group(group, where)
    dim = check_dim(dim, x.ndim, "dim", where)
    sizes = _part_sizes(x, group, dim, sizes, where)
    return _AllGather.apply(x, group, dim, sizes)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's part along ``dim``; backward all-gathers.

    Args:
        x: full-size tensor on every rank.
        sizes: part sizes per rank (default ``split_sizes(x.shape[dim], N)``), summing to
            ``x.shape[dim]``.

    Returns:
        ``x.shape`` with ``dim -> sizes[rank]``.

    Raises:
        ValueError: bad dim, group, or sizes.
    """
    where = "reduce_scatter"
    _check_tensor(x, where)
    check_group(group, where)
    dim = check_dim(dim, x.ndim, "dim", where)
    n = group_size(group)
    sizes = split_sizes(x.shape[dim], n) if sizes is None else check_sizes(sizes, n, x.shape[dim], where)
    return _ReduceScatter.apply(x, group, dim, sizes)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over the group (out of place); backward passes the gradient through."""
    _check_tensor(x, "all_reduce")
    check_group(group, "all_reduce")
    return _AllReduce.apply(x, group)


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over the group."""
    _check_tensor(x, "copy_to")
    check_group(group, "copy_to")
    return _CopyTo.apply(x, group)


def reduce_(x: torch.Tensor, group: Group, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
    """In-place all-reduce of ``x`` over ``group`` without autograd (sum or max); returns ``x``.

    For code that writes its own backward (e.g. the LSE merge of replicated queries).
    """
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return x
