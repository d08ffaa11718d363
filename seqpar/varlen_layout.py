"""Packed variable-length placement maths: pure functions of ``seq_lens``, no communication.

Everything here follows Note [Sharding placement] (``seqpar.layout``): each sequence is zig-zag
split on its own into ``2R`` chunks of ``split_sizes(n, 2R)`` (ring rank ``r`` keeps chunks ``r``
and ``2R-1-r``), the ring-local pieces are concatenated in sequence order, and that ring-local
concatenation is split contiguously over the ``U`` Ulysses ranks. The functions are vectorised over
sequences (one pass of tensor arithmetic, no Python loop per sequence), so they stay cheap for
hundreds of thousands of sequences.

Coordinates are given either as a :class:`~seqpar.ParallelState` or as plain ints, so that a
benchmark or a data loader can ask about any rank without a process group:

- ``sizes``: ``(ring_size, ulysses_size)``;
- ``coords``: ``(ring_size, ulysses_size, cp_rank)`` with ``cp_rank = ring_rank * U + ulysses_rank``.

Note [Varlen ring blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~
Ring rank ``r`` holds, per sequence ``s``, the pieces ``f_s = chunk r`` and ``g_s = chunk 2R-1-r``;
its ring-local buffer is ``[f_0 g_0 | f_1 g_1 | ...]``. At the ring step that brings the K/V of ring
rank ``j`` (pieces ``f'_s g'_s``), the dense zig-zag rule (Note [Zig-zag causal blocks]) applies to
every sequence separately:

- ``j == r``: causal attention of ``[f_s g_s]`` over itself (the local positions of one sequence
  increase, so the local causal mask is the global one);
- ``j < r``: all of ``[f_s g_s]`` attends ``f'_s`` (no mask);
- ``j > r``: ``g_s`` attends all of ``[f'_s g'_s]`` (no mask);
- non-causal: all of ``[f_s g_s]`` attends all of ``[f'_s g'_s]`` at every step.

A varlen kernel pairs query segment ``i`` with key segment ``i`` of two packed buffers whose
segments are consecutive. The pieces that do not take part (``g'_s`` for ``j < r``, ``f_s`` for
``j > r``) are interleaved with those that do, so instead of gathering rows we describe the buffers
as *twice as many segments*, pairing each skipped piece with an empty segment on the other side::

    j < r:  q segments  [f0 g0] [ ]  [f1 g1] [ ]  ...      (query rows of [ ] : none)
            k segments  [f'0]   [g'0] [f'1]  [g'1] ...     (g'_s meets no query)

    j > r:  q segments  [f0]  [g0]          [f1]  [g1]          ...
            k segments  [ ]   [f'0 g'0]     [ ]   [f'1 g'1]     ...   (f_s meets no key)

Kernels accept empty segments on either side (rows without keys give ``out = 0``, ``lse = -inf``,
which merges as nothing and has zero gradient), so every step runs on the whole received buffer
and its whole query buffer: no index tensor, no gather, no scatter of gradients. Segment pairs
that are empty on both sides are dropped. A step whose segments hold no (query, key) pair at all
is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import (
    check_seq_lens,
    local_range,
    packed_local_tokens,
    packed_ring_local_lengths,
    packed_ring_pieces,
    split_sizes,
    zigzag_chunk_table,
)
from .state import ParallelState

__all__ = [
    "zigzag_pieces",
    "ring_local_lengths",
    "shard_token_counts",
    "local_seq_lens",
    "local_cu_seqlens",
    "local_positions",
    "local_seq_ids",
    "varlen_work",
    "VarlenBlock",
    "ring_varlen_blocks",
]

Sizes = ParallelState | tuple[int, int]
Coords = ParallelState | tuple[int, int, int]


def _positive(value: object, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def _sizes(arg: object, where: str) -> tuple[int, int]:
    """``(R, U)`` from a ParallelState or a ``(ring_size, ulysses_size)`` tuple."""
    if isinstance(arg, ParallelState):
        return arg.ring_size, arg.ulysses_size
    if isinstance(arg, (tuple, list)) and len(arg) in (2, 3):
        return _positive(arg[0], "ring_size", where), _positive(arg[1], "ulysses_size", where)
    raise ValueError(
        f"{where}: expected a ParallelState or (ring_size, ulysses_size), got {arg!r}"
    )


def _coords(arg: object, where: str) -> tuple[int, int, int, int]:
    """``(R, r, U, u)`` from a ParallelState or a ``(ring_size, ulysses_size, cp_rank)`` tuple."""
    if isinstance(arg, ParallelState):
        return arg.ring_size, arg.ring_rank, arg.ulysses_size, arg.ulysses_rank
    if isinstance(arg, (tuple, list)) and len(arg) == 3:
        ring, uly = _sizes(arg, where)
        cp_rank = arg[2]
        if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < ring * uly:
            raise ValueError(
                f"{where}: cp_rank must be an int in 0..{ring * uly - 1} for ring_size={ring} x "
                f"ulysses_size={uly}, got {cp_rank!r}"
            )
        return ring, cp_rank // uly, uly, cp_rank % uly
    raise ValueError(
        f"{where}: expected a ParallelState or (ring_size, ulysses_size, cp_rank), got {arg!r}"
    )


def _lens(seq_lens: Sequence[int] | torch.Tensor, where: str) -> torch.Tensor:
    """Validated lengths as an int64 CPU tensor ``[S]``."""
    try:
        lens = check_seq_lens(seq_lens)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return torch.tensor(lens, dtype=torch.long)


def zigzag_pieces(
    seq_lens: Sequence[int] | torch.Tensor, ring_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths of the two pieces every ring rank holds of every sequence.

    Args:
        seq_lens: ``S`` packed sequence lengths (non-negative ints).
        ring_size: ``R``.

    Returns:
        ``(first, second)``, int64 ``[R, S]``: ring rank ``j`` holds ``first[j, s]`` tokens of chunk
        ``j`` then ``second[j, s]`` tokens of chunk ``2R-1-j`` of sequence ``s``. With ``R == 1``
        ``first`` is ``seq_lens`` and ``second`` is zero.

    Raises:
        ValueError: negative or non-int lengths, or ``ring_size < 1``.
    """
    where = "zigzag_pieces"
    ring_size = _positive(ring_size, "ring_size", where)
    lens = _lens(seq_lens, where)
    sizes, _ = zigzag_chunk_table(lens, ring_size)
    if ring_size == 1:
        return sizes, torch.zeros_like(sizes)
    return sizes[:ring_size], sizes.flip(0)[:ring_size]


def ring_local_lengths(seq_lens: Sequence[int] | torch.Tensor, ring_size: int) -> list[int]:
    """Ring-local token count of every ring rank (the length ``U`` Ulysses ranks share).

    Raises:
        ValueError: as :func:`zigzag_pieces`.
    """
    try:
        return packed_ring_local_lengths(seq_lens, _positive(ring_size, "ring_size", "ring_local_lengths"))
    except ValueError as e:
        raise ValueError(f"ring_local_lengths: {e}") from None


def shard_token_counts(seq_lens: Sequence[int] | torch.Tensor, sizes: Sizes) -> list[int]:
    """Local token count of every CP rank, indexed by ``cp_rank``.

    ``layout.packed_shard_lengths`` (vectorised over sequences) taking a state or sizes.

    Raises:
        ValueError: bad lengths or sizes.
    """
    R, U = _sizes(sizes, "shard_token_counts")
    return [n for ring_len in ring_local_lengths(seq_lens, R) for n in split_sizes(ring_len, U)]


def local_seq_lens(seq_lens: Sequence[int] | torch.Tensor, coords: Coords) -> torch.Tensor:
    """How many tokens of each sequence one CP rank holds (what ``shard_packed`` places there).

    Args:
        seq_lens: ``S`` global sequence lengths.
        coords: a ``ParallelState`` or ``(ring_size, ulysses_size, cp_rank)``.

    Returns:
        int64 ``[S]``, summing to ``layout.packed_shard_lengths(seq_lens, R, U)[cp_rank]``. A
        sequence can be cut by the Ulysses split, and is absent (0) on many ranks when short.

    Raises:
        ValueError: bad lengths or coordinates.
    """
    where = "local_seq_lens"
    lens = _lens(seq_lens, where)
    R, r, U, u = _coords(coords, where)
    first, second, _, _ = packed_ring_pieces(lens, R, r)
    ends = torch.cumsum(first + second, 0)
    lo, hi = local_range(int(ends[-1]) if ends.numel() else 0, U, u)
    starts = ends - (first + second)
    return (ends.clamp(max=hi) - starts.clamp(min=lo)).clamp(min=0)


def local_cu_seqlens(
    seq_lens: Sequence[int] | torch.Tensor,
    coords: Coords,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, int]:
    """Cumulative local lengths of every sequence on one CP rank, for local varlen kernels.

    The local tokens of a sequence are contiguous in the shard (its two zig-zag pieces, possibly
    cut by the Ulysses split), so ``cu_seqlens[s]:cu_seqlens[s+1]`` are sequence ``s``'s local rows.
    Every sequence keeps its entry (zero-length where absent), so index ``s`` always means
    sequence ``s`` of ``seq_lens``.

    Args:
        seq_lens: ``S`` global sequence lengths.
        coords: a ``ParallelState`` or ``(ring_size, ulysses_size, cp_rank)``.
        device: where to put ``cu_seqlens`` (default CPU).

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 ``[S + 1]`` starting at 0 and ending at ``T_local``,
        and the longest local piece.

    Raises:
        ValueError: bad lengths or coordinates.
    """
    local = local_seq_lens(seq_lens, coords)
    cu = torch.zeros(local.numel() + 1, dtype=torch.int32)
    torch.cumsum(local, 0, out=cu[1:])
    max_len = int(local.max()) if local.numel() else 0
    return (cu.to(device) if device is not None else cu), max_len


def _local_tokens(seq_lens: Sequence[int] | torch.Tensor, coords: Coords, where: str):
    """Sequence id and position within its sequence of every local token, both ``[T_local]``."""
    return packed_local_tokens(_lens(seq_lens, where), *_coords(coords, where))


def local_positions(
    seq_lens: Sequence[int] | torch.Tensor,
    coords: Coords,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Position of every local token within its own sequence (``position_ids`` for RoPE).

    Args:
        seq_lens: ``S`` global sequence lengths.
        coords: a ``ParallelState`` or ``(ring_size, ulysses_size, cp_rank)``.
        device: where to put the result (default CPU).

    Returns:
        int64 ``[T_local]``, in local (``shard_packed``) order; ``0`` is each sequence's first token.

    Raises:
        ValueError: bad lengths or coordinates.
    """
    _, pos = _local_tokens(seq_lens, coords, "local_positions")
    return pos.to(device) if device is not None else pos


def local_seq_ids(
    seq_lens: Sequence[int] | torch.Tensor,
    coords: Coords,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Index into ``seq_lens`` of the sequence every local token belongs to, int64 ``[T_local]``.

    Raises:
        ValueError: bad lengths or coordinates.
    """
    ids, _ = _local_tokens(seq_lens, coords, "local_seq_ids")
    return ids.to(device) if device is not None else ids


def _causal_pairs(sizes: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(query, key) pairs of causal chunks: a query at position ``p`` sees ``p + 1`` keys."""
    return sizes * starts + sizes * (sizes + 1) // 2


def varlen_work(
    seq_lens: Sequence[int] | torch.Tensor,
    sizes: Sizes,
    causal: bool,
    *,
    num_heads: int | None = None,
) -> list[int]:
    """Attention work of every CP rank under the packed placement (no communication).

    After the Ulysses all-to-all every rank of a Ulysses group holds *all* ring-local tokens of
    its own heads, so the attention work is split by heads inside a Ulysses group and by query
    ownership across the ring (the contiguous token split only decides who sends what).

    Args:
        seq_lens: ``S`` global sequence lengths.
        sizes: a ``ParallelState`` or ``(ring_size, ulysses_size)``.
        causal: count only keys at or before their query (within the query's sequence).
        num_heads: ``H``; if given, entries count (query, key, head) triples with the query heads
            split by ``split_sizes(H, U)`` as the Ulysses all-to-all does; if ``None``, entries
            count (query, key) pairs per head.

    Returns:
        ``R * U`` ints indexed by ``cp_rank``. Per head, the ``U`` ranks of ring rank ``r`` all
        report ring rank ``r``'s pairs; over the ring they sum to ``sum(n * (n + 1) // 2)``
        (causal) or ``sum(n * n)``.

    Raises:
        ValueError: bad lengths, sizes or ``num_heads``.
    """
    where = "varlen_work"
    R, U = _sizes(sizes, where)
    lens = _lens(seq_lens, where)
    chunk_sizes, starts = zigzag_chunk_table(lens, R)
    if causal:
        per_chunk = _causal_pairs(chunk_sizes, starts)
    else:
        per_chunk = chunk_sizes * lens[None, :]
    per_chunk = per_chunk.sum(1)  # [2R] (or [1])
    ring = per_chunk if R == 1 else per_chunk[:R] + per_chunk.flip(0)[:R]
    heads = [1] * U if num_heads is None else split_sizes(_positive(num_heads, "num_heads", where), U)
    return [int(ring[r]) * heads[u] for r in range(R) for u in range(U)]


@dataclass(frozen=True)
class VarlenBlock:
    """The packed block of one ring step (Note [Varlen ring blocks]).

    Query segment ``i`` (``seg_q[i]`` consecutive rows of the ring-local query buffer) attends key
    segment ``i`` (``seg_k[i]`` consecutive rows of the source rank's K/V buffer).

    Attributes:
        seg_q, seg_k: int64 ``[nseg]`` segment lengths, summing to the two buffers' lengths.
        causal: diagonal-aligned causal mask per segment (then ``seg_q == seg_k``).
        max_seqlen_q, max_seqlen_k: longest segments.
        pairs: attended (query, key) pairs of the block, per head.
    """

    seg_q: torch.Tensor
    seg_k: torch.Tensor
    causal: bool
    max_seqlen_q: int
    max_seqlen_k: int
    pairs: int


def _block(seg_q: torch.Tensor, seg_k: torch.Tensor, causal: bool) -> VarlenBlock | None:
    """Drop segment pairs empty on both sides; ``None`` if no pair attends anything."""
    pairs = seg_q * (seg_k + 1) // 2 if causal else seg_q * seg_k
    total = int(pairs.sum())
    if total == 0:
        return None
    keep = (seg_q > 0) | (seg_k > 0)
    seg_q, seg_k = seg_q[keep], seg_k[keep]
    return VarlenBlock(seg_q, seg_k, causal, int(seg_q.max()), int(seg_k.max()), total)


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[a0, b0, a1, b1, ...]``."""
    return torch.stack([a, b], 1).flatten()


def ring_varlen_blocks(
    seq_lens: Sequence[int] | torch.Tensor, ring_size: int, ring_rank: int, causal: bool
) -> list[VarlenBlock | None]:
    """The block ring rank ``ring_rank`` computes against the K/V of every ring rank.

    Args:
        seq_lens: ``S`` global sequence lengths.
        ring_size, ring_rank: ``R`` and ``r``.
        causal: per-sequence causal attention.

    Returns:
        ``R`` entries indexed by the source ring rank ``j``: a :class:`VarlenBlock` built as in
        Note [Varlen ring blocks], or ``None`` when that step attends no (query, key) pair.

    Raises:
        ValueError: bad lengths or ranks.
    """
    where = "ring_varlen_blocks"
    R = _positive(ring_size, "ring_size", where)
    if isinstance(ring_rank, bool) or not isinstance(ring_rank, int) or not 0 <= ring_rank < R:
        raise ValueError(f"{where}: ring_rank must be in 0..{R - 1}, got {ring_rank!r}")
    first, second = zigzag_pieces(seq_lens, R)
    f, g = first[ring_rank], second[ring_rank]
    zeros = torch.zeros_like(f)
    blocks: list[VarlenBlock | None] = []
    for j in range(R):
        fj, gj = first[j], second[j]
        if not causal:
            blocks.append(_block(f + g, fj + gj, False))
        elif j == ring_rank:
            blocks.append(_block(f + g, f + g, True))
        elif j < ring_rank:
            blocks.append(_block(_interleave(f + g, zeros), _interleave(fj, gj), False))
        else:
            blocks.append(_block(_interleave(f, g), _interleave(zeros, fj + gj), False))
    return blocks
