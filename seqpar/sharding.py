"""Shard a global sequence onto CP ranks and back, following Note [Sharding placement].

Gradients are partial (see ``docs/api.md``): ``shard``'s backward scatters the local gradient
into zeros (no communication), so per-rank gradients sum over the CP group to the exact
gradient; ``unshard``'s backward reduce-scatters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .comm import all_gather, check_dim, exchange_ints
from .placement import Placement
from .placement.sizes import as_int, check_seq_lens
from .state import ParallelState, require_state

__all__ = ["shard", "unshard", "shard_positions", "shard_packed", "unshard_packed", "shard_packed_positions"]


def _check(x: object, state: object, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(x).__name__}")
    require_state(state, where)


def _local_ranges(placement: Placement, cp_rank: int) -> list[tuple[int, int]]:
    """Global ``(start, stop)`` ranges a CP rank holds of a dense sequence (at most two)."""
    index = placement.global_index(cp_rank)
    if index.numel() == 0:
        return []
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).flatten().tolist()
    starts = [0, *(b + 1 for b in breaks)]
    stops = [*(b + 1 for b in breaks), index.numel()]
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in zip(starts, stops)]


def shard_positions(seq_len: int, state: ParallelState, device: torch.device | str | None = None) -> torch.Tensor:
    """Global position of each local token, ``[S_local]`` int64 (e.g. ``position_ids`` for RoPE).

    Raises:
        ValueError: if ``seq_len`` is negative or not an int, or ``state`` is not a usable
            ParallelState (e.g. closed: its ranks may no longer be this process's).
    """
    require_state(state, "shard_positions")
    seq_len = as_int(seq_len, "seq_len", "shard_positions")
    pos = Placement.dense(seq_len, state.ring_size, state.ulysses_size).global_index(state.cp_rank)
    return pos.to(device) if device is not None else pos


def shard(x: torch.Tensor, state: ParallelState, dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full sequence ``x`` (identical on every CP rank).

    Args:
        x: ``[..., S, ...]`` with the sequence along ``dim`` (default 1, as in ``[B, S, ...]``).
        state: the parallel state; placement per Note [Sharding placement].

    Returns:
        ``[..., S_local, ...]``: this rank's tokens in local order (at most two contiguous pieces,
        so the result is a view or one concatenation). Backward scatters the gradient into zeros
        at this rank's positions (no communication).

    Raises:
        ValueError: if ``x`` is not a tensor, ``state`` is not a ParallelState or ``dim`` is out
            of range.
    """
    _check(x, state, "shard")
    dim = check_dim(dim, x.ndim, "dim", "shard")
    placement = Placement.dense(x.shape[dim], state.ring_size, state.ulysses_size)
    pieces = [x.narrow(dim, a, b - a) for a, b in _local_ranges(placement, state.cp_rank)]
    if not pieces:
        return x.narrow(dim, 0, 0)
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def _gather_and_unpermute(
    x: torch.Tensor, state: ParallelState, dim: int, placement: Placement
) -> torch.Tensor:
    full = all_gather(x, state.cp_group, dim, list(placement.shard_lengths))  # cp_rank order
    perm = placement.permutation()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return full.index_select(dim, inv.to(x.device))


def unshard(x: torch.Tensor, state: ParallelState, dim: int = 1, size: int | None = None) -> torch.Tensor:
    """Reassemble the full sequence from every CP rank's shard (inverse of :func:`shard`).

    Args:
        x: this rank's shard ``[..., S_local, ...]`` (sequence along ``dim``).
        size: the global length ``S``; ``None`` infers it from the shards (one small collective,
            after which every rank checks the lengths the same way).

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
        got = [row[0] for row in exchange_ints([x.shape[dim]], state.cp_group, x.device)]
        size = sum(got)
        want = list(Placement.dense(size, R, U).shard_lengths)
        if got != want:
            raise ValueError(
                f"unshard: the CP ranks hold {got} tokens along dim {dim}, not the placement of "
                f"their {size} tokens over ring {R} x ulysses {U} ({want}); shard with seqpar.shard"
            )
    size = as_int(size, "size", "unshard")
    placement = Placement.dense(size, R, U)
    want = placement.shard_lengths
    if x.shape[dim] != want[state.cp_rank]:
        raise ValueError(
            f"unshard: cp rank {state.cp_rank} holds {x.shape[dim]} tokens along dim {dim}, but "
            f"size={size} over ring {R} x ulysses {U} places {want[state.cp_rank]} there ({list(want)})"
        )
    if state.cp_size == 1:
        return x
    return _gather_and_unpermute(x, state, dim, placement)


def _packed(seq_lens: Sequence[int] | torch.Tensor, state: ParallelState, where: str) -> Placement:
    return Placement(check_seq_lens(seq_lens, where), state.ring_size, state.ulysses_size)


def shard_packed(x: torch.Tensor, state: ParallelState, seq_lens: Sequence[int], dim: int = 0) -> torch.Tensor:
    """This rank's shard of packed sequences: each sequence zig-zagged over the ring on its own.

    Args:
        x: ``[..., T, ...]`` with ``T = sum(seq_lens)`` packed tokens along ``dim`` (default 0,
            as in ``[T, H, D]``).
        seq_lens: lengths of the packed sequences (any non-negative ints).

    Returns:
        ``[..., T_local, ...]``: this rank's tokens per Note [Sharding placement] (the single
        source of the packed placement; see ``docs/sharding.md``).

    Raises:
        ValueError: negative lengths, or ``sum(seq_lens) != x.shape[dim]``.
    """
    _check(x, state, "shard_packed")
    dim = check_dim(dim, x.ndim, "dim", "shard_packed")
    placement = _packed(seq_lens, state, "shard_packed")
    if placement.total != x.shape[dim]:
        raise ValueError(
            f"shard_packed: seq_lens sum to {placement.total} but x has {x.shape[dim]} tokens along dim {dim}"
        )
    return x.index_select(dim, placement.global_index(state.cp_rank).to(x.device))


def unshard_packed(x: torch.Tensor, state: ParallelState, seq_lens: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Reassemble packed sequences from every CP rank's shard (inverse of :func:`shard_packed`).

    Returns:
        ``[..., T, ...]`` on every CP rank; backward reduce-scatters.

    Raises:
        ValueError: negative lengths, or a local token count that disagrees with the placement.
    """
    _check(x, state, "unshard_packed")
    dim = check_dim(dim, x.ndim, "dim", "unshard_packed")
    placement = _packed(seq_lens, state, "unshard_packed")
    want = placement.shard_lengths
    if x.shape[dim] != want[state.cp_rank]:
        raise ValueError(
            f"unshard_packed: cp rank {state.cp_rank} holds {x.shape[dim]} tokens along dim {dim}, "
            f"but seq_lens (total {placement.total}) over ring {state.ring_size} x ulysses "
            f"{state.ulysses_size} place {want[state.cp_rank]} there ({list(want)})"
        )
    if state.cp_size == 1:
        return x
    return _gather_and_unpermute(x, state, dim, placement)


def shard_packed_positions(
    seq_lens: Sequence[int] | torch.Tensor, state: ParallelState, device: torch.device | str | None = None
) -> torch.Tensor:
    """Position of every local token within its own sequence, ``[T_local]`` int64.

    The ``position_ids`` of packed sequences for RoPE (0 at each sequence's first token), in
    ``shard_packed`` order.

    Raises:
        ValueError: negative or non-int lengths.
    """
    require_state(state, "shard_packed_positions")
    _, pos = _packed(seq_lens, state, "shard_packed_positions").local_tokens(state.cp_rank)
    return pos.to(device) if device is not None else pos
