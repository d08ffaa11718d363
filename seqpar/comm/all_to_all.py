"""Uneven all-to-all over any pair of tensor dims, autograd-aware, one staging copy.

Note [All-to-all layout]
~~~~~~~~~~~~~~~~~~~~~~~~
Each rank cuts ``x`` along ``scatter_dim`` into one piece per destination rank and receives one
piece from every source rank, concatenated along ``gather_dim``. Sizes never need to divide: piece
``j`` of the scatter dim has ``split_sizes(x.shape[scatter_dim], N)[j]`` elements (or arbitrary
ranges, possibly overlapping, for the fused form), and the gather dim may differ between ranks.

We run one ``all_to_all_single`` over a flat staging buffer. Each piece is written into the
staging buffer *gather-dim first*: the piece ``x.narrow(scatter_dim, ...)`` is copied as
``piece.movedim(gather_dim, 0)``. The received flat buffer is then the concatenation, over source
ranks, of ``[g_i, ...]`` blocks, i.e. one contiguous ``[G, ...]`` tensor, and the result is the view
``buffer.movedim(0, gather_dim)`` -- no copy after the collective, for any ndim and any dim pair
but one. Bytes allocated: the staging copy plus the output, 2x the input. The price is that the
result is a strided tensor (contiguous only when every dim before ``gather_dim`` has size 1, e.g.
the Ulysses ``[1, S/N, H, D] -> [1, S, H/N, D]`` direction); call ``.contiguous()`` if a later op
needs it. The exception is a gather over the last dim, whose blocks travel in the input's own
order into a contiguous output (Note [Gather over the last dim]).

The backward of an all-to-all is the all-to-all with the two dims swapped. For the fused form the
output gradients are staged directly (stacked along the forward's scatter dim, which the reverse
gathers), and each input's gradient is cut out of the received buffer; pieces of overlapping ranges
are added.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from ..placement.sizes import as_int, offsets, split_sizes
from .group import Group, check_dim, check_group, exchange_ints, group_rank, group_size, refuse_double_backward
from .workspace import Workspace

__all__ = ["all_to_all", "all_to_all_many", "fused_all_to_all", "fused_all_to_all_backward"]

Ranges = list[tuple[int, int]]  # per destination rank: (start, length) along the scatter dim


def _moved_shape(shape: Sequence[int], gather_dim: int) -> list[int]:
    return [shape[gather_dim]] + [s for d, s in enumerate(shape) if d != gather_dim]


def _moved_dim(dim: int, gather_dim: int) -> int:
    """Position of ``dim`` once ``gather_dim`` has been moved to the front."""
    return dim + 1 if dim < gather_dim else dim


def _exchange(
    xs: Sequence[torch.Tensor],
    group: Group,
    scatter_dim: int,
    gather_dim: int,
    ranges: Sequence[Ranges],
    gather_sizes: Sequence[int],
    stack: Literal["scatter", "gather"] = "scatter",
    workspace: Workspace | None = None,
    out_role: str | None = None,
    release_inputs: bool = False,
) -> torch.Tensor:
    """No-grad core. Returns the combined output in the input's dim order (strided, except over
    the last dim, where it is contiguous: Note [Gather over the last dim]; a view only of a
    workspace buffer or, with one rank, of the staging copy).

    Several tensors travel in one collective, stacked in every rank's block along ``stack``:

    - ``"scatter"``: ``xs`` share every dim but ``scatter_dim`` and each has its own ``ranges``;
      the output's scatter dim holds, for this rank, tensor 0's piece, then tensor 1's, ...;
    - ``"gather"``: ``xs`` share every dim but ``gather_dim`` and ``ranges`` holds one list for
      all of them; each source's block holds tensor 0's rows, then tensor 1's, ... along the
      gather dim, and ``gather_sizes[i]`` is the total of source ``i``'s rows.

    The output's gather dim has ``sum(gather_sizes)`` elements, source-major. With a
    ``workspace`` the staging copy (and over the last dim the receive buffer) is a workspace
    buffer (Note [Workspace]); with ``out_role`` too, so is the output (for outputs the caller
    consumes before the call returns). With
    ``release_inputs`` (``xs`` a list) the list is emptied once staged, so inputs whose last
    reference it held are freed before the output is allocated.
    """
    n, me = group_size(group), group_rank(group)
    x0 = xs[0]
    dtype, device = x0.dtype, x0.device
    # Blocks are staged gather-dim first, except over the last dim (Note [Gather over the last dim]).
    # Every rank must choose the same block layout, so the choice depends on shapes only, never on
    # a rank's own strides (whether a rank sends its input without a copy may differ: same layout).
    natural = gather_dim == x0.ndim - 1
    gd_m = gather_dim if natural else 0  # the gather dim's place in a block
    sd_m = scatter_dim if natural else _moved_dim(scatter_dim, gather_dim)
    base = list(x0.shape) if natural else _moved_shape(x0.shape, gather_dim)
    if stack == "scatter":
        lens = [sum(r[j][1] for r in ranges) for j in range(n)]  # scatter length per rank
        local_rows = x0.shape[gather_dim]
    else:
        lens = [ranges[0][j][1] for j in range(n)]
        local_rows = sum(x.shape[gather_dim] for x in xs)

    def block_shape(g: int, length: int) -> list[int]:
        shape = list(base)
        shape[gd_m], shape[sd_m] = g, length
        return shape

    send_shapes = [block_shape(local_rows, lens[j]) for j in range(n)]
    send_numel = [torch.Size(s).numel() for s in send_shapes]
    recv_shapes = [block_shape(g, lens[me]) for g in gather_sizes]
    recv_numel = [torch.Size(s).numel() for s in recv_shapes]
    out_shape = block_shape(sum(gather_sizes), lens[me])

    def buffer(role: str | None, numel: int) -> torch.Tensor:
        if workspace is not None and role is not None:
            return workspace.get(role, (numel,), dtype, device)
        return torch.empty(numel, dtype=dtype, device=device)

    def release(t: torch.Tensor) -> None:
        """Free a fresh transfer buffer whose transfer has completed (Note [Staging release])."""
        if device.type == "cpu" and (workspace is None or not workspace.holds(t)):
            t.untyped_storage().resize_(0)

    def collective(out: torch.Tensor) -> None:
        dist.all_to_all_single(out, staging, recv_numel, send_numel, group=group)
        if owned:
            release(staging)

    owned = True  # the staging buffer is this call's (not a view of the input)
    if natural and n > 1 and _sends_itself(xs, stack, scatter_dim, ranges):
        staging, owned = xs[0].reshape(-1), False  # the blocks already lie in send order
    else:
        # With one rank the staging block is the output: it is staged where the output must live.
        staging = buffer(out_role if n == 1 else "all_to_all.staging", sum(send_numel))
        _stage(xs, staging, stack, scatter_dim, gather_dim, natural, sd_m, gd_m, ranges, send_shapes, send_numel)
    if release_inputs:
        x0 = None  # this function's last reference
        xs.clear()
    if n == 1:
        return staging.view(out_shape) if natural else staging.view(out_shape).movedim(0, gather_dim)
    if natural:
        recv = buffer("all_to_all.recv", sum(recv_numel))
        collective(recv)
        staging = None
        if workspace is not None and out_role is not None:
            out = workspace.get(out_role, tuple(out_shape), dtype, device)
        else:
            out = torch.empty(out_shape, dtype=dtype, device=device)
        _unstage(recv, out, gather_dim, gather_sizes, recv_shapes, recv_numel)
        release(recv)
        return out
    if workspace is not None and out_role is not None:
        recv = workspace.get(out_role, (sum(recv_numel),), dtype, device)
        collective(recv)
        return recv.view(out_shape).movedim(0, gather_dim)
    # A fresh output is allocated in its final dim order, so that it is a tensor of its own (not
    # a view): callers may then modify it in place.
    out = _empty_moved(out_shape, gather_dim, staging)
    collective(out.as_strided((out.numel(),), (1,)))
    return out


def _stage(
    xs: Sequence[torch.Tensor], staging: torch.Tensor, stack: str, scatter_dim: int, gather_dim: int, natural: bool,
    sd_m: int, gd_m: int, ranges: Sequence[Ranges], send_shapes: list[list[int]], send_numel: list[int],
) -> None:
    """Copy every tensor's pieces into their destinations' blocks of ``staging`` (block layout:
    :func:`_exchange`'s ``natural`` order or gather dim first)."""
    n = len(send_numel)
    block_off = offsets(send_numel)
    subs = [0] * n  # per destination: where the next tensor's piece starts in its block
    for t, x in enumerate(xs):
        r = ranges[t if stack == "scatter" else 0]
        # Destinations j0 .. j0 + m - 1 whose pieces are consecutive in x and whose blocks are
        # consecutive and alike in the staging buffer take one strided copy (Note [Staging runs]).
        for j0, m in _runs(r, subs, send_numel, block_off):
            start, length = r[j0]
            if length == 0:
                continue
            src = x.narrow(scatter_dim, start, m * length)
            src = src if natural else src.movedim(gather_dim, 0)
            src = src.unflatten(sd_m, (m, length)).movedim(sd_m, 0)  # [m, *block with length]
            blocks = staging[block_off[j0] : block_off[j0 + m]].view(m, *send_shapes[j0])
            if stack == "scatter":
                _copy(blocks.narrow(sd_m + 1, subs[j0], length), src)
            else:
                _copy(blocks.narrow(gd_m + 1, subs[j0], src.shape[gd_m + 1]), src)
        step = [length for _, length in r] if stack == "scatter" else [x.shape[gather_dim]] * n
        subs = [a + b for a, b in zip(subs, step)]


def _sends_itself(xs: Sequence[torch.Tensor], stack: str, scatter_dim: int, ranges: Sequence[Ranges]) -> bool:
    """Whether one contiguous tensor already holds its natural-order blocks one after the other:
    its pieces partition the scatter dim in rank order and no dim before it has more than one
    element."""
    x = xs[0]
    return (len(xs) == 1 and stack == "scatter" and x.is_contiguous() and _is_partition(ranges[0], x.shape[scatter_dim])
            and all(s == 1 for s in x.shape[:scatter_dim]))


def _unstage(recv: torch.Tensor, out: torch.Tensor, gather_dim: int, gather_sizes: Sequence[int],
             recv_shapes: list[list[int]], recv_numel: list[int]) -> None:
    """Copy the received natural-order blocks into ``out`` along ``gather_dim`` (its last dim),
    one strided copy per run of sources with one gather length."""
    off, goff = offsets(recv_numel), offsets(gather_sizes)
    i0 = 0
    while i0 < len(gather_sizes):
        i1 = i0 + 1
        while i1 < len(gather_sizes) and gather_sizes[i1] == gather_sizes[i0]:
            i1 += 1
        m, g = i1 - i0, gather_sizes[i0]
        if g and recv_numel[i0]:
            src = recv[off[i0]:off[i1]].view(m, *recv_shapes[i0]).movedim(0, gather_dim)  # [..., m, g]
            _copy(out.narrow(gather_dim, goff[i0], m * g).unflatten(gather_dim, (m, g)), src)
        i0 = i1


# Note [Gather over the last dim]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Staging gather-dim first makes the received buffer the output (Note [All-to-all layout]), at
# the price of a transposing staging copy when the gather dim is the innermost one: every element
# of the contiguous last dim then lands in another row, and the output keeps that layout, so the
# next copy of it (autograd's, a matmul's) transposes again. Over the last dim the blocks are
# therefore staged in the input's own dim order -- with one contiguous input whose pieces are
# already consecutive (every dim before the scatter dim of size 1) not copied at all -- and the
# received blocks are copied into a fresh, contiguous output, runs of whole gather pieces. Bytes
# held: the received buffer and the output (2x), as before.


# Note [Staging release]
# ~~~~~~~~~~~~~~~~~~~~~~
# gloo runs a collective on a worker thread, and its work object holds the input tensor until that
# thread has finished its bookkeeping, which may be after ``all_to_all_single`` has returned here.
# The staging buffer dropped at this function's return then stays allocated, at random, while the
# caller allocates what comes next: measured on 2 gloo ranks (U = 2, S = 8192, H = 8, D = 64,
# fp32), 2 of 24 calls peaked one fused staging buffer higher (80.1 MiB instead of 72.2, the
# gradients' exchange). Once the collective has completed nothing reads the staging copy, so a
# fresh one has its storage freed at once (``resize_(0)``), whoever still holds the tensor. Only
# on the CPU: a CUDA collective's buffers are stream-ordered by the caching allocator, and a
# kept arena's slice is never freed.


# Note [Staging runs]
# ~~~~~~~~~~~~~~~~~~~
# The staging buffer holds one contiguous block per destination rank. Copying each tensor's
# piece for each destination separately costs one copy per (tensor, rank): a fixed host cost
# per call that grows with the group (8 ranks: 8 launches per tensor on a GPU). Near-even
# splits (``split_sizes``) give at most two piece lengths, the longer first, so the destinations
# fall into at most two runs whose pieces are consecutive along the scatter dim and whose blocks
# are consecutive and of one shape: each run is one strided copy of ``[m, *block]``. Ranges that
# are not laid out that way (overlapping or reordered pieces) fall back to runs of one. Where the
# last dim is contiguous and whole 8-byte words long, the copy moves int64 words instead of the
# dtype's elements (a strided copy costs per element: bf16 moves 4 x fewer elements).


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of one dtype and shape, moved as 8-byte words where both
    layouts allow it (Note [Staging runs]): a strided copy of 2-byte elements moves a quarter
    of the bytes per element that it could. Bitwise either way."""
    k = 8 // src.element_size() if src.element_size() < 8 else 1
    if k > 1 and _words_fit(dst, k) and _words_fit(src, k):
        dst.view(torch.int64).copy_(src.detach().view(torch.int64))
    else:
        dst.copy_(src)


def _words_fit(t: torch.Tensor, k: int) -> bool:
    """Whether ``t.view(torch.int64)`` is valid: ``k`` elements per word along a unit-stride
    last dim, every other stride and the offset whole words."""
    return (t.stride(-1) == 1 and t.shape[-1] % k == 0 and t.storage_offset() % k == 0
            and all(s % k == 0 for s in t.stride()[:-1]))


def _runs(r: Ranges, subs: Sequence[int], numel: Sequence[int], off: Sequence[int]) -> list[tuple[int, int]]:
    """``(j0, m)``: maximal runs of destinations ``j0 .. j0 + m - 1`` whose pieces ``r[j]``
    (``(start, length)``) follow each other with one length, at one offset ``subs[j]`` in blocks
    of one size ``numel[j]`` that follow each other in the staging buffer (``off``)."""
    runs: list[tuple[int, int]] = []
    j0 = 0
    for j in range(1, len(r) + 1):
        if j < len(r):
            (s0, l0), (s, length) = r[j - 1], r[j]
            if (length == l0 and s == s0 + l0 and subs[j] == subs[j0] and numel[j] == numel[j0]
                    and off[j] == off[j - 1] + numel[j - 1]):
                continue
        runs.append((j0, j - j0))
        j0 = j
    return runs


def _empty_moved(shape: Sequence[int], gather_dim: int, like: torch.Tensor) -> torch.Tensor:
    """``torch.empty(shape).movedim(0, gather_dim)`` as a base tensor (same strides, no view),
    of ``like``'s dtype and device."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    order = list(range(1, len(shape)))
    order.insert(gather_dim, 0)
    return torch.empty_strided(
        [shape[d] for d in order], [strides[d] for d in order], dtype=like.dtype, device=like.device
    )


def fused_all_to_all(
    xs: Sequence[torch.Tensor],
    group: Group,
    scatter_dim: int,
    gather_dim: int,
    ranges: Sequence[Ranges],
    gather_sizes: Sequence[int],
    *,
    workspace: Workspace | None = None,
    out_role: str | None = None,
    release_inputs: bool = False,
) -> list[torch.Tensor]:
    """The forward of :func:`all_to_all_many` without autograd, on validated arguments.

    For code that writes its own backward (``seqpar.parallel.ulysses``): ``ranges[t][j]`` is the
    ``(start, length)`` of tensor ``t`` sent to rank ``j`` along ``scatter_dim``; ``gather_sizes``
    every rank's ``gather_dim`` length. Returns one view per tensor of one receive buffer (a
    ``workspace`` buffer of ``out_role`` if given: then valid only until that role is reused); a
    single tensor with no ``out_role`` comes back as a tensor of its own, not a view.
    """
    combined = _exchange(
        xs, group, scatter_dim, gather_dim, ranges, gather_sizes, "scatter", workspace, out_role, release_inputs
    )
    me = group_rank(group)
    if len(ranges) == 1:
        return [combined]
    outs, sub = [], 0
    for r in ranges:
        outs.append(combined.narrow(scatter_dim, sub, r[me][1]))
        sub += r[me][1]
    return outs


def fused_all_to_all_backward(
    grads: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    group: Group,
    scatter_dim: int,
    gather_dim: int,
    ranges: Sequence[Ranges],
    gather_sizes: Sequence[int],
    *,
    workspace: Workspace | None = None,
    release_inputs: bool = False,
    recv_role: str = "all_to_all.back",
) -> list[torch.Tensor]:
    """The gradients of :func:`fused_all_to_all`'s inputs (``shapes``) from those of its outputs.

    The reverse all-to-all; slices sent to several ranks (overlapping ranges) get the sum of
    their gradients. Without autograd; the results are fresh tensors. With a ``workspace``, the
    received gradients land in its ``recv_role`` buffer before being cut into the results.
    """
    sd, gd = scatter_dim, gather_dim
    n = group_size(group)
    lens = [sum(r[j][1] for r in ranges) for j in range(n)]
    # Each output's gradient goes straight into the staging buffer, stacked along the reverse's
    # gather dim (the forward's scatter dim): no combined gradient buffer.
    back_ranges = [list(zip(offsets(gather_sizes)[:-1], gather_sizes))]
    single = len(ranges) == 1 and _is_partition(ranges[0], shapes[0][sd])
    back = _exchange(
        grads, group, gd, sd, back_ranges, lens, "gather", workspace, None if single else recv_role,
        release_inputs,
    )
    # back: [.., gather_sizes[me] at gather_dim, .., sum(lens) at scatter_dim], source-major.
    if single:
        return [back]
    dxs = []
    lens_off = offsets(lens)
    sub_off = [0] * n
    for shape, r in zip(shapes, ranges):
        # A partition is written once per element; overlapping ranges are summed.
        partition = _is_partition(r, shape[sd])
        dx = back.new_empty(shape) if partition else back.new_zeros(shape)
        for j in range(n):
            start, length = r[j]
            if length:
                src = back.narrow(sd, lens_off[j] + sub_off[j], length)
                target = dx.narrow(sd, start, length)
                if partition:
                    target.copy_(src)
                else:
                    target.add_(src)
            sub_off[j] += length
        dxs.append(dx)
    return dxs


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, scatter_dim, gather_dim, ranges, gather_sizes, workspace, *xs):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        ctx.ranges, ctx.gather_sizes, ctx.workspace = ranges, gather_sizes, workspace
        ctx.shapes = [x.shape for x in xs]
        outs = fused_all_to_all(xs, group, scatter_dim, gather_dim, ranges, gather_sizes, workspace=workspace)
        ctx.out_shapes = [o.shape for o in outs]
        ctx.dtype, ctx.device = outs[0].dtype, outs[0].device
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        refuse_double_backward("seqpar.comm.all_to_all")
        grads = [
            g if g is not None else torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
            for g, shape in zip(grads, ctx.out_shapes)
        ]
        dxs = fused_all_to_all_backward(
            grads, ctx.shapes, ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.ranges, ctx.gather_sizes,
            workspace=ctx.workspace,
        )
        # No gradient for group, scatter_dim, gather_dim, ranges, gather_sizes, workspace.
        return (None, None, None, None, None, None, *dxs)


def _is_partition(ranges: Ranges, size: int) -> bool:
    pos = 0
    for start, length in ranges:
        if start != pos:
            return False
        pos += length
    return pos == size


def _check_dims(x: torch.Tensor, scatter_dim: int, gather_dim: int, where: str) -> tuple[int, int]:
    sd = check_dim(scatter_dim, x.ndim, "scatter_dim", where)
    gd = check_dim(gather_dim, x.ndim, "gather_dim", where)
    if sd == gd:
        raise ValueError(
            f"{where}: scatter_dim={scatter_dim} and gather_dim={gather_dim} are the same dim of a "
            f"{x.ndim}-dim tensor; they must differ"
        )
    return sd, gd


def _gather_sizes(
    xs: Sequence[torch.Tensor], group: Group, gather_dim: int, scatter_dim: int,
    gather_size: int | Sequence[int] | None, where: str,
) -> list[int]:
    """Gather-dim length on every rank, from ``gather_size`` or by exchanging shapes."""
    n, me = group_size(group), group_rank(group)
    local = xs[0].shape[gather_dim]
    if isinstance(gather_size, torch.Tensor) and gather_size.dim() == 0:
        gather_size = gather_size.item()  # a 0-dim tensor is one size, checked below
    if isinstance(gather_size, (str, bytes)) or (
        gather_size is not None and not isinstance(gather_size, numbers.Number) and not hasattr(gather_size, "__iter__")
    ):
        raise ValueError(f"{where}: gather_size must be an int, a list of ints or None, got {gather_size!r}")
    if gather_size is not None and not isinstance(gather_size, numbers.Number):
        sizes = [as_int(s, "gather_size[i]", where) for s in gather_size]
        if len(sizes) != n or sizes[me] != local:
            raise ValueError(
                f"{where}: gather sizes {sizes} must give each of the {n} ranks its length; rank "
                f"{me} has {local} along gather_dim={gather_dim}"
            )
        return sizes
    if gather_size is not None:
        gather_size = as_int(gather_size, "gather_size", where)  # numpy / torch integer scalars too
        sizes = split_sizes(gather_size, n)
        if sizes[me] != local:
            raise ValueError(
                f"{where}: gather_size={gather_size} over {n} ranks gives rank {me} "
                f"{sizes[me]} elements (split {sizes}), but its tensor has {local} along "
                f"gather_dim={gather_dim}; pass gather_size=None to exchange the actual sizes"
            )
        return sizes
    shapes = exchange_ints([len(x.shape) for x in xs] + [s for x in xs for s in x.shape], group, xs[0].device)
    mine = shapes[me]
    for rank, other in enumerate(shapes):
        if other != mine:
            # Only the gather dim may differ between ranks.
            def dims(v: list[int]) -> list[list[int]]:
                out, pos = [], len(xs)
                for nd in v[: len(xs)]:
                    out.append(v[pos : pos + nd])
                    pos += nd
                return out

            for a, b in zip(dims(other), dims(mine)):
                if len(a) != len(b) or any(p != q for d, (p, q) in enumerate(zip(a, b)) if d != gather_dim):
                    raise ValueError(
                        f"{where}: rank {rank} has shape {a} and rank {me} has shape {b}; all ranks "
                        f"must agree on every dim except gather_dim={gather_dim}"
                    )
    return [v[len(xs) + gather_dim] for v in shapes]


def all_to_all(
    x: torch.Tensor,
    group: Group,
    scatter_dim: int,
    gather_dim: int,
    gather_size: int | None = None,
    *,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """All-to-all: scatter ``x`` along ``scatter_dim``, gather the pieces along ``gather_dim``.

    With ``N`` ranks, rank ``j`` receives part ``j`` of ``split_sizes(x.shape[scatter_dim], N)``
    from every rank, and the pieces are concatenated in rank order along ``gather_dim``. Neither
    size needs to divide ``N``; ranks may get zero elements. Works for any ndim and any pair of
    distinct dims. Differentiable: the backward is the reverse all-to-all.

    Example (Ulysses): ``[B, S_local, H, D]`` with ``scatter_dim=2, gather_dim=1`` becomes
    ``[B, S, H_local, D]`` where ``S_local`` follows ``split_sizes(S, N)`` and ``H_local =
    split_sizes(H, N)[rank]``.

    Args:
        x: local tensor; every rank has the same shape except along ``gather_dim``.
        group: process group (``None``: the default group, or a single process without one).
        scatter_dim, gather_dim: distinct dims (negative values allowed).
        gather_size: total length of the gather dim over the group; rank ``i`` must then hold
            ``split_sizes(gather_size, N)[i]`` elements. ``None`` exchanges the actual sizes (one
            small extra collective) and checks the shapes agree.
        workspace: reuse its staging buffer across calls (Note [Workspace]) instead of
            allocating one per call.

    Returns:
        ``x.shape`` with ``scatter_dim -> split_sizes(x.shape[scatter_dim], N)[rank]`` and
        ``gather_dim -> sum of all ranks' gather lengths``. Memory: one staging copy of ``x`` and
        the output (2x the input's bytes) in every direction and batch size; the result is a
        strided tensor of its own, contiguous when all dims before ``gather_dim`` have size 1
        or ``gather_dim`` is the last dim (see Note [All-to-all layout]).

    Raises:
        ValueError: equal or out-of-range dims, a non-ProcessGroup group, a ``gather_size``
            inconsistent with the local piece, or (with ``gather_size=None``) shapes that differ
            between ranks outside ``gather_dim``.
    """
    return all_to_all_many([x], group, scatter_dim, gather_dim, gather_size, workspace=workspace)[0]


def all_to_all_many(
    xs: Sequence[torch.Tensor],
    group: Group,
    scatter_dim: int,
    gather_dim: int,
    gather_size: int | Sequence[int] | None = None,
    scatter_ranges: Sequence[Sequence[tuple[int, int]]] | None = None,
    *,
    workspace: Workspace | None = None,
) -> list[torch.Tensor]:
    """One fused all-to-all of several tensors (e.g. q, k and v), differentiable.

    ``xs`` must share dtype, device and every dim except ``scatter_dim`` (q with ``H`` heads and
    k/v with ``Hkv`` heads, say). ``scatter_ranges[t][j] = (start, length)`` says which slice of
    tensor ``t`` goes to rank ``j`` (default: the ``split_sizes`` partition); ranges may overlap,
    which sends a slice to several ranks (their gradients are summed in backward). Returns one
    tensor per input, as in :func:`all_to_all`; the outputs are views of one receive buffer.
    ``gather_size`` may also be the list of every rank's gather length (any sizes).

    Raises:
        ValueError: as :func:`all_to_all`, plus mismatched tensors or malformed ranges.
    """
    where = "all_to_all"
    check_group(group, where)
    if not xs or not all(isinstance(x, torch.Tensor) for x in xs):
        raise ValueError(f"{where}: expected one or more tensors, got {[type(x).__name__ for x in xs]}")
    x0 = xs[0]
    sd, gd = _check_dims(x0, scatter_dim, gather_dim, where)
    for i, x in enumerate(xs[1:], 1):
        same = x.ndim == x0.ndim and all(a == b for d, (a, b) in enumerate(zip(x.shape, x0.shape)) if d != sd)
        if not same or x.dtype != x0.dtype or x.device != x0.device:
            raise ValueError(
                f"{where}: tensor {i} {tuple(x.shape)} {x.dtype} {x.device} does not match tensor 0 "
                f"{tuple(x0.shape)} {x0.dtype} {x0.device} outside scatter_dim={scatter_dim}"
            )
    n = group_size(group)
    if scatter_ranges is None:
        ranges = []
        for x in xs:
            sizes = split_sizes(x.shape[sd], n)
            ranges.append(list(zip(offsets(sizes)[:-1], sizes)))
    else:
        if len(scatter_ranges) != len(xs):
            raise ValueError(f"{where}: {len(scatter_ranges)} scatter_ranges for {len(xs)} tensors")
        ranges = []
        for t, (x, r) in enumerate(zip(xs, scatter_ranges)):
            r = [(int(a), int(b)) for a, b in r]
            if len(r) != n or any(a < 0 or b < 0 or a + b > x.shape[sd] for a, b in r):
                raise ValueError(
                    f"{where}: scatter_ranges[{t}] = {r} must hold {n} (start, length) pairs inside "
                    f"the {x.shape[sd]} elements of scatter_dim={scatter_dim}"
                )
            ranges.append(r)
    gather_sizes = _gather_sizes(xs, group, gd, sd, gather_size, where)
    return list(_AllToAll.apply(group, sd, gd, ranges, gather_sizes, workspace, *xs))
