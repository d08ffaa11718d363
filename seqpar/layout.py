"""Token placement maths: pure index functions, no communication.

Note [Sharding placement]
~~~~~~~~~~~~~~~~~~~~~~~~~
A dense sequence of length ``S`` on a state with ring size ``R`` and Ulysses size ``U``:

1. If ``R > 1`` the sequence is cut into ``2R`` chunks of sizes ``split_sizes(S, 2R)``; ring rank
   ``r`` holds chunks ``r`` and ``2R-1-r`` (in that order), so causal work is balanced:

       S = 0 1 2 3 4 5 6 7 8 9 (R = 2, chunks [3, 3, 2, 2])
       chunks:  |0 1 2|3 4 5|6 7|8 9|
       ring 0:  |0 1 2|            8 9|   chunks 0 and 3
       ring 1:        |3 4 5|6 7|         chunks 1 and 2

   With ``R == 1`` the ring-local sequence is the whole sequence.
2. The ring-local sequence is split contiguously with ``split_sizes(len, U)``; Ulysses rank ``u``
   takes part ``u``.

Packed sequences apply step 1 to each sequence separately and concatenate the pieces in sequence
order; step 2 then splits that ring-local concatenation contiguously (a sequence may straddle
Ulysses ranks).

Concatenating every CP rank's shard in ``cp_rank = ring_rank * U + ulysses_rank`` order gives the
ring-local sequences in ring order, so the placement of the whole CP group is one permutation of
the global positions (``placement_permutation``); ``unshard`` applies its inverse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "split_sizes",
    "offsets",
    "zigzag_chunk_ranges",
    "ring_local_ranges",
    "ring_local_length",
    "local_range",
    "shard_lengths",
    "dense_positions",
    "placement_permutation",
    "packed_ring_local_ranges",
    "packed_positions",
    "packed_shard_lengths",
    "packed_placement_permutation",
    "packed_ring_local_lengths",
    "packed_ring_pieces",
    "packed_local_tokens",
    "zigzag_chunk_table",
    "check_seq_lens",
    "ranges_to_index",
]


def split_sizes(n: int, parts: int) -> list[int]:
    """Near-even split of ``n`` elements into ``parts`` parts.

    The first ``n % parts`` parts get one extra element:
    ``split_sizes(10, 4) == [3, 3, 2, 2]``, ``split_sizes(3, 4) == [1, 1, 1, 0]``.

    Raises:
        ValueError: if ``n < 0`` or ``parts < 1``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"split_sizes: n must be a non-negative int, got {n!r}")
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"split_sizes: parts must be a positive int, got {parts!r}")
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: ``offsets([3, 3, 2]) == [0, 3, 6, 8]`` (length ``len(sizes) + 1``)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def zigzag_chunk_ranges(seq_len: int, ring_size: int, ring_rank: int) -> list[tuple[int, int]]:
    """Global ``(start, stop)`` of the chunks ring rank ``ring_rank`` holds, in local order.

    ``ring_size == 1`` gives ``[(0, seq_len)]``; otherwise chunks ``r`` and ``2R-1-r`` of
    ``split_sizes(seq_len, 2R)`` (either may be empty).
    """
    if ring_size == 1:
        return [(0, seq_len)]
    off = offsets(split_sizes(seq_len, 2 * ring_size))
    first, second = ring_rank, 2 * ring_size - 1 - ring_rank
    return [(off[first], off[first + 1]), (off[second], off[second + 1])]


def ring_local_ranges(seq_len: int, ring_size: int, ring_rank: int) -> list[tuple[int, int]]:
    """Alias of :func:`zigzag_chunk_ranges` (the ring-local sequence as global ranges)."""
    return zigzag_chunk_ranges(seq_len, ring_size, ring_rank)


def ring_local_length(seq_len: int, ring_size: int, ring_rank: int) -> int:
    """Length of ring rank ``ring_rank``'s ring-local sequence."""
    return sum(b - a for a, b in zigzag_chunk_ranges(seq_len, ring_size, ring_rank))


def local_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` of a contiguous ``split_sizes(length, parts)`` split."""
    sizes = split_sizes(length, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def shard_lengths(seq_len: int, ring_size: int, ulysses_size: int) -> list[int]:
    """Local length of every CP rank (indexed by ``cp_rank``) for a dense sequence."""
    out = []
    for r in range(ring_size):
        out.extend(split_sizes(ring_local_length(seq_len, ring_size, r), ulysses_size))
    return out


def ranges_to_index(ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Concatenate ``arange(start, stop)`` over ``ranges`` into one ``[n]`` int64 tensor."""
    parts = [torch.arange(a, b, dtype=torch.long) for a, b in ranges if b > a]
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def dense_positions(
    seq_len: int, ring_size: int, ring_rank: int, ulysses_size: int, ulysses_rank: int
) -> torch.Tensor:
    """Global positions of the tokens one CP rank holds, in local order, ``[S_local]`` int64."""
    ring_local = ranges_to_index(zigzag_chunk_ranges(seq_len, ring_size, ring_rank))
    a, b = local_range(len(ring_local), ulysses_size, ulysses_rank)
    return ring_local[a:b]


def placement_permutation(seq_len: int, ring_size: int, ulysses_size: int) -> torch.Tensor:
    """Global positions of all CP shards concatenated in ``cp_rank`` order, ``[S]`` int64.

    ``x[..., perm]`` lays a full sequence out shard after shard; ``argsort(perm)`` undoes it.
    """
    ranges = [rg for r in range(ring_size) for rg in zigzag_chunk_ranges(seq_len, ring_size, r)]
    return ranges_to_index(ranges)


def check_seq_lens(seq_lens: Sequence[int]) -> list[int]:
    """Validate packed sequence lengths and return them as a list of ints.

    Raises:
        ValueError: if a length is negative or not an integer.
    """
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.tolist()
    out = []
    for i, n in enumerate(seq_lens):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(
                f"seq_lens[{i}] = {n!r}: every sequence length must be a non-negative int"
            )
        out.append(n)
    return out


def packed_ring_local_ranges(
    seq_lens: Sequence[int], ring_size: int, ring_rank: int
) -> list[list[tuple[int, int]]]:
    """Per sequence, the global packed ``(start, stop)`` ranges ring rank ``ring_rank`` holds."""
    starts = offsets(seq_lens)
    out = []
    for s, n in zip(starts, seq_lens):
        out.append([(s + a, s + b) for a, b in zigzag_chunk_ranges(n, ring_size, ring_rank)])
    return out


def _lens_tensor(seq_lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.tensor(check_seq_lens(seq_lens), dtype=torch.long)


def zigzag_chunk_table(lens: torch.Tensor, ring_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sizes and start offsets (within its sequence) of every zig-zag chunk of every sequence.

    Vectorised over sequences: chunk ``i`` of a length-``n`` sequence has ``n // 2R + (i < n % 2R)``
    tokens (``split_sizes(n, 2R)``); with ``R == 1`` there is one chunk, the whole sequence.

    Args:
        lens: int64 ``[S]`` sequence lengths.
        ring_size: ``R``.

    Returns:
        ``(sizes, starts)``, int64 ``[2R, S]`` (``[1, S]`` when ``R == 1``).
    """
    parts = 1 if ring_size == 1 else 2 * ring_size
    base, extra = lens // parts, lens % parts
    i = torch.arange(parts, dtype=torch.long)[:, None]
    sizes = base[None, :] + (i < extra[None, :]).long()
    starts = i * base[None, :] + torch.minimum(i, extra[None, :])
    return sizes, starts


def packed_ring_pieces(lens: torch.Tensor, ring_size: int, ring_rank: int) -> tuple[torch.Tensor, ...]:
    """The two pieces ring rank ``r`` holds of every sequence: ``(first, second, first_start,
    second_start)``, int64 ``[S]`` each (lengths and start offsets within the sequence; with
    ``R == 1`` the first piece is the whole sequence and the second is empty)."""
    sizes, starts = zigzag_chunk_table(lens, ring_size)
    if ring_size == 1:
        return sizes[0], torch.zeros_like(sizes[0]), starts[0], starts[0]
    c = 2 * ring_size - 1 - ring_rank
    return sizes[ring_rank], sizes[c], starts[ring_rank], starts[c]


def packed_local_tokens(
    lens: torch.Tensor, ring_size: int, ring_rank: int, ulysses_size: int, ulysses_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence index and position within that sequence of every token one CP rank holds.

    Args:
        lens: int64 ``[S]`` sequence lengths.

    Returns:
        ``(seq_ids, positions)``, int64 ``[T_local]`` each, in local order.
    """
    first, second, first_start, second_start = packed_ring_pieces(lens, ring_size, ring_rank)
    per_seq = first + second
    seq_end = torch.cumsum(per_seq, 0)  # ring-local end of each sequence
    lo, hi = local_range(int(seq_end[-1]) if seq_end.numel() else 0, ulysses_size, ulysses_rank)
    tokens = torch.arange(lo, hi)
    ids = torch.searchsorted(seq_end, tokens, right=True)  # first sequence ending after the token
    offset = tokens - (seq_end - per_seq)[ids]  # offset within the sequence's local pieces
    in_first = offset < first[ids]
    pos = torch.where(in_first, first_start[ids] + offset, second_start[ids] + offset - first[ids])
    return ids, pos


def packed_positions(
    seq_lens: Sequence[int], ring_size: int, ring_rank: int, ulysses_size: int, ulysses_rank: int
) -> torch.Tensor:
    """Global packed positions of the tokens one CP rank holds, in local order, ``[T_local]``.

    Vectorised over sequences (no Python loop per sequence).
    """
    lens = _lens_tensor(seq_lens)
    ids, pos = packed_local_tokens(lens, ring_size, ring_rank, ulysses_size, ulysses_rank)
    seq_start = torch.cumsum(lens, 0) - lens
    return seq_start[ids] + pos


def packed_ring_local_lengths(seq_lens: Sequence[int], ring_size: int) -> list[int]:
    """Ring-local token count of every ring rank (shared by its ``U`` Ulysses ranks)."""
    sizes, _ = zigzag_chunk_table(_lens_tensor(seq_lens), ring_size)
    per_chunk = sizes.sum(1)
    ring = per_chunk if ring_size == 1 else per_chunk[:ring_size] + per_chunk.flip(0)[:ring_size]
    return ring.tolist()


def packed_shard_lengths(seq_lens: Sequence[int], ring_size: int, ulysses_size: int) -> list[int]:
    """Local token count of every CP rank (indexed by ``cp_rank``) for packed sequences."""
    return [n for ring_len in packed_ring_local_lengths(seq_lens, ring_size) for n in split_sizes(ring_len, ulysses_size)]


def packed_placement_permutation(
    seq_lens: Sequence[int], ring_size: int, ulysses_size: int
) -> torch.Tensor:
    """Packed analogue of :func:`placement_permutation`, ``[T]`` int64 with ``T = sum(seq_lens)``."""
    parts = [packed_positions(seq_lens, ring_size, r, 1, 0) for r in range(ring_size)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
