"""Which query and K/V heads each Ulysses rank works on: pure maths, no communication.

Note [Ulysses head placement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each of the ``U`` ranks of a Ulysses group holds ``S_u`` tokens of all heads. One all-to-all
(heads scattered, tokens gathered) gives every rank all ``S = sum(S_u)`` tokens of its heads,
the inner attention runs, and the reverse all-to-all (tokens scattered, heads gathered) restores
the token shards. Query heads are split with ``split_sizes(H, U)``, so ``H`` need not divide by
``U`` and ranks may get no head at all (``H < U``).

K/V heads (GQA/MQA, ``Hkv < H``, group size ``G = H / Hkv``): query head ``h`` reads K/V head
``h // G``. Rank ``u`` receives only the contiguous K/V range its query heads read, from the
head of its first query head to that of its last::

    H = 8, Hkv = 2 (G = 4), U = 3      query heads   K/V heads received   kernel sees
      rank 0                           0 1 2         0                    3 : 1
      rank 1                           3 4 5         0 1  -> 0 1 1        3 : 3 (expanded)
      rank 2                           6 7           1                    2 : 1

A K/V head is sent to several ranks when its group of ``G`` query heads is cut between ranks.
Nothing is replicated when ``G == 1`` (plain multi-head) or ``U`` divides ``Hkv``; otherwise
the query split cuts groups -- always when ``Hkv < U``, where each K/V head goes to about
``U / Hkv`` ranks (MQA: to every rank that has a query head). That replication is unavoidable
-- those ranks all read the head -- and the all-to-all's backward sums its gradients.

The inner kernel wants a uniform GQA ratio: local query head ``i`` reads local K/V head
``i // (H_u / Hkv_u)``. When the received heads do not map that way (rank 1 above: query heads
3, 4, 5 read K/V heads 0, 1, 1), K/V are expanded locally with one ``index_select`` to the
shortest list that does (here ``[0, 1, 1]``, ratio 1; in general blocks of the largest size
dividing ``H_u`` whose query heads share a K/V head). This only happens when a rank's query
heads start or end inside a group and the pieces differ in size; it costs one copy of that
rank's K/V heads, never communication.

Tensors that are replicated on every rank rather than sharded over tokens (sinks, the text K/V of
joint attention) need no all-to-all: the inner attention slices them with its
:class:`HeadAssignment` (``q_heads`` / ``kv_heads``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .sizes import offsets, split_sizes

__all__ = ["HeadAssignment", "head_assignments", "cached_head_assignments", "all_heads"]


@dataclass(frozen=True)
class HeadAssignment:
    """The heads one Ulysses rank works on (see Note [Ulysses head placement]).

    Attributes:
        q_start, q_len: the query heads ``[q_start, q_start + q_len)``.
        kv_start, kv_len: the K/V heads received, ``[kv_start, kv_start + kv_len)``.
        kv_index: ``None`` when the received K/V heads already map uniformly onto the query
            heads; otherwise indices into the received heads that expand them to a uniform list.
    """

    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    kv_index: tuple[int, ...] | None

    @property
    def kernel_kv_heads(self) -> int:
        """K/V heads the inner kernel sees (after any expansion)."""
        return self.kv_len if self.kv_index is None else len(self.kv_index)

    def q_heads(self, x: Tensor, dim: int) -> Tensor:
        """This rank's query heads of a replicated tensor with all ``H`` heads along ``dim``."""
        return x.narrow(dim, self.q_start, self.q_len)

    def kv_heads(self, x: Tensor, dim: int) -> Tensor:
        """This rank's K/V heads (expanded like the received ones) of a replicated ``Hkv`` tensor."""
        x = x.narrow(dim, self.kv_start, self.kv_len)
        if self.kv_index is not None:
            x = x.index_select(dim, torch.tensor(self.kv_index, dtype=torch.long, device=x.device))
        return x


def head_assignments(num_heads: int, num_kv_heads: int, world: int) -> list[HeadAssignment]:
    """Per Ulysses rank, which query and K/V heads it gets; pure maths, no communication.

    Args:
        num_heads: ``H`` query heads.
        num_kv_heads: ``Hkv`` K/V heads, dividing ``H``.
        world: ``U`` ranks.

    Returns:
        ``U`` assignments; query heads follow ``split_sizes(H, U)``.

    Raises:
        ValueError: if ``H % Hkv != 0`` or a count is not positive.
    """
    if num_kv_heads < 1 or num_heads < 1 or world < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"head_assignments: need positive counts with H % Hkv == 0, got H={num_heads}, "
            f"Hkv={num_kv_heads}, U={world}"
        )
    group = num_heads // num_kv_heads
    sizes = split_sizes(num_heads, world)
    out = []
    for q_start, q_len in zip(offsets(sizes), sizes):
        if q_len == 0:
            out.append(HeadAssignment(q_start, 0, 0, 0, None))
            continue
        kv_start = q_start // group
        kv_len = (q_start + q_len - 1) // group + 1 - kv_start
        kv_of = [(q_start + i) // group - kv_start for i in range(q_len)]
        # Largest block size b dividing q_len such that each block of b query heads shares a
        # K/V head; b = 1 always works (one K/V head per query head).
        for b in range(q_len, 0, -1):
            if q_len % b == 0 and all(kv_of[i] == kv_of[i - i % b] for i in range(q_len)):
                break
        kernel_kv = kv_of[::b]
        index = None if kernel_kv == list(range(kv_len)) else tuple(kernel_kv)
        out.append(HeadAssignment(q_start, q_len, kv_start, kv_len, index))
    return out


@functools.lru_cache(maxsize=256)
def cached_head_assignments(num_heads: int, num_kv_heads: int, world: int) -> tuple[HeadAssignment, ...]:
    """:func:`head_assignments` as a tuple, cached (called on every layer)."""
    return tuple(head_assignments(num_heads, num_kv_heads, world))


def all_heads(num_heads: int, num_kv_heads: int) -> HeadAssignment:
    """The assignment of a group of one rank: every head."""
    return HeadAssignment(0, num_heads, 0, num_kv_heads, None)


