"""Attention work per rank under a placement and a mask (no communication), for balance checks.

After the Ulysses all-to-all every rank of a Ulysses group holds all ring-local tokens of its own
heads, so work is split by query ownership across the ring and by heads inside a Ulysses group
(the contiguous token split only decides who sends what).
"""

from __future__ import annotations

from .ring import ring_plan, tile_pairs
from .masks import Mask
from .layout import Placement
from .sizes import split_sizes

__all__ = ["attention_work", "imbalance"]


def attention_work(placement: Placement, mask: Mask, *, num_heads: int | None = None) -> list[int]:
    """Attended (query, key) pairs of every CP rank, in ``cp_rank`` order.

    Args:
        placement: where the tokens live.
        mask: the mask in global positions (Note [Masks]).
        num_heads: ``H``; if given, entries count (query, key, head) triples with the query heads
            split by ``split_sizes(H, U)`` as the Ulysses all-to-all does; if ``None``, the ``U``
            ranks of a ring rank all report its pairs per head.

    Returns:
        ``R * U`` ints. Per head, over the ring they sum to the pairs of the whole mask.
    """
    R, U = placement.ring_size, placement.ulysses_size
    per_ring = [
        sum(tile_pairs(step.tiles) for step in ring_plan(placement, r, mask, varlen=True).steps)
        for r in range(R)
    ]
    heads = [1] * U if num_heads is None else split_sizes(num_heads, U)
    return [per_ring[r] * heads[u] for r in range(R) for u in range(U)]


def imbalance(work: list[int]) -> float:
    """``max / mean`` of per-rank work (1.0 is perfect; 1.0 for no work at all)."""
    mean = sum(work) / len(work) if work else 0
    return max(work) / mean if mean else 1.0
