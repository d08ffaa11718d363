"""The placement rule: which tokens every rank holds (pure index maths, no communication).

Note [Sharding placement]
~~~~~~~~~~~~~~~~~~~~~~~~~
Tokens are described as packed sequences, lengths ``seq_lens`` concatenated; a dense sequence of
length ``S`` is the one-sequence case ``seq_lens = (S,)`` (shared by every batch row). With ring
size ``R`` and Ulysses size ``U``:

1. **Ring (zig-zag, per sequence).** If ``R > 1``, every sequence is cut, in order, into
   ``P = 2R`` chunks. A sequence of ``n`` tokens starting at packed offset ``t`` gives chunk ``c``
   ``n // P`` tokens, plus one when ``(c - t) mod P < n mod P``: the ``n mod P`` remainder tokens
   go to as many consecutive chunks, starting at chunk ``t mod P`` (cyclically). Ring rank ``r`` holds
   chunks ``r`` and ``P-1-r`` of every sequence; its ring-local sequence is, sequence after
   sequence, chunk ``r`` followed by chunk ``P-1-r``. With ``R == 1`` it is everything.
2. **Ulysses (contiguous).** The ring-local sequence is split with ``split_sizes(len, U)``;
   Ulysses rank ``u`` takes part ``u`` (a sequence may straddle Ulysses ranks).

For one sequence (``t = 0``) the chunks are ``split_sizes(S, 2R)``, the dense contract::

    S = 10, R = 2: chunks [3, 3, 2, 2]   |0 1 2|3 4 5|6 7|8 9|
    ring 0 holds chunks 0, 3:  0 1 2 8 9      ring 1 holds chunks 1, 2:  3 4 5 6 7

Rotating the remainder by the packed offset spreads the remainders of many short sequences over
all chunks (the rule ``split_sizes(n, 2R)`` for every sequence would pile them onto the first
chunks, i.e. onto ring rank 0). Pairing chunk ``r`` with chunk ``P-1-r`` balances causal work.

Concatenating every CP rank's shard in ``cp_rank = ring_rank * U + ulysses_rank`` order is one
permutation of the packed positions (:meth:`Placement.permutation`); ``unshard`` applies its
inverse. Local positions increase within every sequence, so a causal mask restricted to one
rank's tokens is the ordinary causal mask of its local rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .sizes import check_seq_lens, split_sizes

__all__ = ["Placement"]


@dataclass(frozen=True, eq=False)
class Placement:
    """The token placement of packed sequences over ring ``R`` x Ulysses ``U`` (Note above).

    Build one with :meth:`dense`, :meth:`packed` or :meth:`free`; every method is pure maths on
    the host, vectorised over sequences.

    Attributes:
        seq_lens: the packed sequence lengths (``(S,)`` for a dense sequence).
        ring_size, ulysses_size: ``R`` and ``U``.
        free_lengths: ``None`` for the rule above; otherwise arbitrary token counts per CP rank
            (``cp_rank`` order) whose positions seqpar does not know -- valid only for attention
            that does not depend on positions (non-causal, no window, no chunks).
    """

    seq_lens: tuple[int, ...]
    ring_size: int
    ulysses_size: int
    free_lengths: tuple[int, ...] | None = None

    @staticmethod
    def dense(seq_len: int, ring_size: int, ulysses_size: int) -> Placement:
        """One sequence of ``seq_len`` tokens (the caller validated the ints)."""
        return Placement((seq_len,), ring_size, ulysses_size)

    @staticmethod
    def packed(seq_lens: Sequence[int] | Tensor, ring_size: int, ulysses_size: int) -> Placement:
        """Packed sequences; ``seq_lens`` is validated (``ValueError`` for negative lengths)."""
        return Placement(check_seq_lens(seq_lens), ring_size, ulysses_size)

    @staticmethod
    def free(lengths: Sequence[int], ring_size: int, ulysses_size: int) -> Placement:
        """Arbitrary per-CP-rank token counts of one sequence whose positions are unknown."""
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != ring_size * ulysses_size:
            raise ValueError(
                f"Placement.free: {len(lengths)} lengths for ring {ring_size} x ulysses {ulysses_size}; pass one "
                f"length per CP rank ({ring_size * ulysses_size})"
            )
        return Placement((sum(lengths),), ring_size, ulysses_size, lengths)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def cp_size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def total(self) -> int:
        """Packed tokens over all ranks."""
        return sum(self.seq_lens)

    @property
    def positional(self) -> bool:
        """Whether the global position of every local token is known (not a free placement)."""
        return self.free_lengths is None

    @cached_property
    def _lens(self) -> Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.long)

    @cached_property
    def chunks(self) -> tuple[Tensor, Tensor]:
        """``(sizes, starts)``, int64 ``[P, nseq]``: every zig-zag chunk of every sequence.

        ``starts`` are positions within the sequence; ``P = 2R`` (``1`` when ``R == 1``).
        """
        lens = self._lens
        parts = 1 if self.ring_size == 1 else 2 * self.ring_size
        base, extra = lens // parts, lens % parts
        origin = (torch.cumsum(lens, 0) - lens) % parts  # packed offset of each sequence, mod P
        c = torch.arange(parts, dtype=torch.long)[:, None]
        plus = ((c - origin[None, :]) % parts < extra[None, :]).long()
        sizes = base[None, :] + plus
        starts = c * base[None, :] + torch.cumsum(plus, 0) - plus
        return sizes, starts

    def ring_pieces(self, ring_rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The two pieces ring rank ``ring_rank`` holds of every sequence.

        Returns:
            ``(first_len, first_start, second_len, second_start)``, int64 ``[nseq]`` each (start =
            position within the sequence). With ``R == 1`` the first piece is the whole sequence
            and the second is empty.
        """
        sizes, starts = self.chunks
        if self.ring_size == 1:
            return sizes[0], starts[0], torch.zeros_like(sizes[0]), starts[0]
        c = 2 * self.ring_size - 1 - ring_rank
        return sizes[ring_rank], starts[ring_rank], sizes[c], starts[c]

    @cached_property
    def ring_lengths(self) -> tuple[int, ...]:
        """Ring-local token count of every ring rank (what its Ulysses group gathers)."""
        if self.free_lengths is not None:
            U = self.ulysses_size
            return tuple(sum(self.free_lengths[r * U:(r + 1) * U]) for r in range(self.ring_size))
        sizes, _ = self.chunks
        per_chunk = sizes.sum(1)
        if self.ring_size == 1:
            return (int(per_chunk[0]),)
        return tuple((per_chunk[: self.ring_size] + per_chunk.flip(0)[: self.ring_size]).tolist())

    def ulysses_sizes(self, ring_rank: int) -> list[int]:
        """Token count of each Ulysses rank of ring rank ``ring_rank``'s group."""
        if self.free_lengths is not None:
            U = self.ulysses_size
            return list(self.free_lengths[ring_rank * U:(ring_rank + 1) * U])
        return split_sizes(self.ring_lengths[ring_rank], self.ulysses_size)

    @cached_property
    def shard_lengths(self) -> tuple[int, ...]:
        """Local token count of every CP rank, in ``cp_rank`` order."""
        return tuple(n for r in range(self.ring_size) for n in self.ulysses_sizes(r))

    def ulysses_range(self, cp_rank: int) -> tuple[int, int]:
        """``(start, stop)`` of CP rank ``cp_rank``'s tokens within its ring-local sequence."""
        r, u = divmod(cp_rank, self.ulysses_size)
        sizes = self.ulysses_sizes(r)
        start = sum(sizes[:u])
        return start, start + sizes[u]

    # -- positions -----------------------------------------------------------------------------

    def _require_positions(self, what: str) -> None:
        if self.free_lengths is not None:
            raise ValueError(f"{what}: a free placement (arbitrary shard lengths) has no known positions")

    def local_tokens(self, cp_rank: int) -> tuple[Tensor, Tensor]:
        """Sequence index and position within it of every token CP rank ``cp_rank`` holds.

        Returns:
            ``(seq_ids, positions)``, int64 ``[T_local]`` each, in local order.
        """
        self._require_positions("local_tokens")
        r = cp_rank // self.ulysses_size
        first, first_start, second, second_start = self.ring_pieces(r)
        per_seq = first + second
        seq_end = torch.cumsum(per_seq, 0)  # ring-local end of each sequence
        lo, hi = self.ulysses_range(cp_rank)
        tokens = torch.arange(lo, hi)
        ids = torch.searchsorted(seq_end, tokens, right=True)
        offset = tokens - (seq_end - per_seq)[ids]  # offset within the sequence's local pieces
        pos = torch.where(offset < first[ids], first_start[ids] + offset, second_start[ids] + offset - first[ids])
        return ids, pos

    def global_index(self, cp_rank: int) -> Tensor:
        """Packed global index of every token CP rank ``cp_rank`` holds, int64 ``[T_local]``."""
        ids, pos = self.local_tokens(cp_rank)
        seq_start = torch.cumsum(self._lens, 0) - self._lens
        return seq_start[ids] + pos

    def permutation(self) -> Tensor:
        """Packed global index of all CP ranks' tokens concatenated in ``cp_rank`` order, ``[T]``.

        ``x[..., perm]`` lays the packed sequences out shard after shard; ``argsort(perm)`` undoes it.
        """
        self._require_positions("permutation")
        parts = [self.global_index(c) for c in range(self.cp_size)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def local_seq_lens(self, cp_rank: int) -> Tensor:
        """How many tokens of each sequence CP rank ``cp_rank`` holds, int64 ``[nseq]``.

        A sequence's local tokens are consecutive rows of the shard.
        """
        self._require_positions("local_seq_lens")
        first, _, second, _ = self.ring_pieces(cp_rank // self.ulysses_size)
        ends = torch.cumsum(first + second, 0)
        lo, hi = self.ulysses_range(cp_rank)
        return (ends.clamp(max=hi) - (ends - first - second).clamp(min=lo)).clamp(min=0)
