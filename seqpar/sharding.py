"""Shard a global sequence onto CP ranks and back, following Note [Sharding placement].

Gradients are partial (DESIGN.md): ``shard``'s backward scatters the local gradient into zeros
(no communication), so per-rank gradients sum over the CP group to the exact gradient;
``unshard``'s backward reduce-scatters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import layout
from .comm import all_gather
from .comm._group import check_dim, exchange_ints
from .state import ParallelState

__all__ = ["shard", "unshard", "shard_positions", "shard_packed", "unshard_packed", "exchange_seq_len"]


def _check(x: object, state: object, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(x).__name__}")
    if not isinstance(state, ParallelState):
        raise ValueError(f"{where}: state must be a seqpar.ParallelState, got {type(state).__name__}")


def _local_ranges(seq_len: int, state: ParallelState) -> list[tuple[int, int]]:
    """Global ``(start, stop)`` ranges this rank holds (at most two), in local order."""
    chunks = layout.zigzag_chunk_ranges(seq_len, state.ring_size, state.ring_rank)
    total = sum(b - a for a, b in chunks)
    lo, hi = layout.local_range(total, state.ulysses_size, state.ulysses_rank)
    out, pos = [], 0
    for a, b in chunks:
        # Intersect the chunk's local span [pos, pos + b - a) with [lo, hi).
        s, e = max(lo, pos), min(hi, pos + b - a)
        if e > s:
            out.append((a + s - pos, a + e - pos))
        pos += b - a
    return out


def shard_positions(
    seq_len: int, state: ParallelState, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global position of each local token, ``[S_local]`` int64 (e.g. ``position_ids`` for RoPE).

    Raises:
        ValueError: if ``seq_len`` is negative or not an int.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"shard_positions: seq_len must be a non-negative int, got {seq_len!r}")
    pos = layout.ranges_to_index(_local_ranges(seq_len, state))
    return pos.to(device) if device is not None else pos


def exchange_seq_len(
    local: int,
    state: ParallelState,
    device: torch.device,
    where: str,
    agree: tuple[str, list[int]] | None = None,
) -> int:
    """The global length ``S`` from every CP rank's local length (one all-gather of a few ints).

    Every rank checks the result the same way, so a mistake raises the same error everywhere
    instead of leaving some ranks waiting in a collective.

    Args:
        local: this rank's shard length.
        agree: ``(label, values)``: ints every CP rank must share (e.g. ``("(B, H, Hkv, D)",
            [B, H, Hkv, D])``), exchanged in the same collective.

    Raises:
        ValueError: if the ranks disagree on ``agree``, or their lengths are not the placement
            (``layout.shard_lengths``) of their sum.
    """
    label, values = agree if agree is not None else ("", [])
    rows = exchange_ints([local, *values], state.cp_group, device)
    dims = [row[1:] for row in rows]
    if any(d != dims[0] for d in dims):
        raise ValueError(
            f"{where}: the CP ranks disagree on {label}: {dims} (in cp_rank order); every "
            "rank must pass shards of the same tensors"
        )
    got = [row[0] for row in rows]
    total = sum(got)
    want = layout.shard_lengths(total, state.ring_size, state.ulysses_size)
    if got != want:
        raise ValueError(
            f"{where}: the CP ranks hold {got} tokens (cp_rank order), which is not the placement "
            f"of their {total} tokens over ring {state.ring_size} x ulysses {state.ulysses_size} "
            f"({want}); shard inputs with seqpar.shard(x, state, dim=<sequence dim>)"
        )
    return total


def shard(x: torch.Tensor, state: ParallelState, dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full sequence ``x`` (identical on every CP rank).

    Args:
        x: ``[..., S, ...]`` with the sequence along ``dim`` (default 1, as in ``[B, S, ...]``).
        state: the parallel state; placement per Note [Sharding placement].

    Returns:
        ``[..., S_local, ...]`` where ``S_local = layout.shard_lengths(S, R, U)[cp_rank]``.
        Backward scatters the gradient into zeros at this rank's positions (no communication).

    Raises:
        ValueError: if ``x`` is not a tensor, ``state`` is not a ParallelState or ``dim`` is out
            of range.
    """
    _check(x, state, "shard")
    dim = check_dim(dim, x.ndim, "dim", "shard")
    pieces = [x.narrow(dim, a, b - a) for a, b in _local_ranges(x.shape[dim], state)]
    if not pieces:
        return x.narrow(dim, 0, 0)
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def _gather_and_unpermute(
    x: torch.Tensor, state: ParallelState, dim: int, sizes: list[int], perm: torch.Tensor
) -> torch.Tensor:
    full = all_gather(x, state.cp_group, dim, sizes)  # shards in cp_rank order
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return full.index_select(dim, inv.to(x.device))


def unshard(x: torch.Tensor, state: ParallelState, dim: int = 1, size: int | None = None) -> torch.Tensor:
    """Reassemble the full sequence from every CP rank's shard (inverse of :func:`shard`).

    Args:
        x: this rank's shard ``[..., S_local, ...]`` (sequence along ``dim``).
        size: the global length ``S``; ``None`` infers it from the shards (one small collective).

    Returns:
        ``[..., S, ...]`` on every CP rank. Backward reduce-scatters: each rank gets the sum over
        CP ranks of the gradient at its own positions.

    Raises:
        ValueError: if the local length disagrees with the placement of ``size`` over the state.
    """
    _check(x, state, "unshard")
    dim = check_dim(dim, x.ndim, "dim", "unshard")
    R, U = state.ring_size, state.ulysses_size
    if size is None:
        size = exchange_seq_len(x.shape[dim], state, x.device, "unshard")
    want = layout.shard_lengths(size, R, U)
    if x.shape[dim] != want[state.cp_rank]:
        raise ValueError(
            f"unshard: cp rank {state.cp_rank} holds {x.shape[dim]} tokens along dim {dim}, but "
            f"size={size} over ring {R} x ulysses {U} places {want[state.cp_rank]} there ({want})"
        )
    if state.cp_size == 1:
        return x
    return _gather_and_unpermute(x, state, dim, want, layout.placement_permutation(size, R, U))


def _packed_total(seq_lens: Sequence[int], where: str) -> tuple[list[int], int]:
    try:
        lens = layout.check_seq_lens(seq_lens)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return lens, sum(lens)


def shard_packed(x: torch.Tensor, state: ParallelState, seq_lens: Sequence[int], dim: int = 0) -> torch.Tensor:
    """This rank's shard of packed sequences: each sequence zig-zagged on its own.

    Args:
        x: ``[..., T, ...]`` with ``T = sum(seq_lens)`` packed tokens along ``dim`` (default 0,
            as in ``[T, H, D]``).
        seq_lens: lengths of the packed sequences (any non-negative ints).

    Returns:
        ``[..., T_local, ...]`` with ``T_local = layout.packed_shard_lengths(seq_lens, R, U)[cp_rank]``.

    Raises:
        ValueError: negative lengths, or ``sum(seq_lens) != x.shape[dim]``.
    """
    _check(x, state, "shard_packed")
    dim = check_dim(dim, x.ndim, "dim", "shard_packed")
    lens, total = _packed_total(seq_lens, "shard_packed")
    if total != x.shape[dim]:
        raise ValueError(
            f"shard_packed: seq_lens sum to {total} but x has {x.shape[dim]} tokens along dim {dim}"
        )
    idx = layout.packed_positions(lens, state.ring_size, state.ring_rank, state.ulysses_size, state.ulysses_rank)
    return x.index_select(dim, idx.to(x.device))


def unshard_packed(x: torch.Tensor, state: ParallelState, seq_lens: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Reassemble packed sequences from every CP rank's shard (inverse of :func:`shard_packed`).

    Returns:
        ``[..., T, ...]`` on every CP rank; backward reduce-scatters.

    Raises:
        ValueError: negative lengths, or a local token count that disagrees with the placement.
    """
    _check(x, state, "unshard_packed")
    dim = check_dim(dim, x.ndim, "dim", "unshard_packed")
    lens, total = _packed_total(seq_lens, "unshard_packed")
    R, U = state.ring_size, state.ulysses_size
    want = layout.packed_shard_lengths(lens, R, U)
    if x.shape[dim] != want[state.cp_rank]:
        raise ValueError(
            f"unshard_packed: cp rank {state.cp_rank} holds {x.shape[dim]} tokens along dim {dim}, "
            f"but seq_lens (total {total}) over ring {R} x ulysses {U} place {want[state.cp_rank]} "
            f"there ({want})"
        )
    if state.cp_size == 1:
        return x
    return _gather_and_unpermute(x, state, dim, want, layout.packed_placement_permutation(lens, R, U))
