"""Attention masks in global positions: one definition every plan, kernel and test follows.

Note [Masks]
~~~~~~~~~~~~
Positions count within a sequence (a dense sequence is one sequence). Query ``i`` may attend key
``j`` of the same sequence iff all of:

- ``causal``: ``j <= i``;
- ``window = (left, right)`` (flash-attn's ``window_size``, ``-1`` unbounded):
  ``i - left <= j <= i + right``; with ``causal`` the right side is 0;
- ``chunk_size = C``: ``i // C == j // C`` (Llama 4 chunked attention).

So the mask is a *band* ``lo <= j - i <= hi`` (``lo = -left``, ``hi = 0`` if causal else
``right``; unbounded sides are ``None``), cut into diagonal blocks by the chunks::

    causal, window (2, 0), chunk_size 4        x = attended
            k: 0 1 2 3 4 5 6 7
        q 0    x . . . . . . .
          1    x x . . . . . .
          2    x x x . . . . .
          3    . x x x . . . .
          4    . . . . x . . .      chunk 1 starts: 4 sees only itself
          5    . . . . x x . .
          6    . . . . x x x .
          7    . . . . . x x x

Softcapping and sinks change the scores, not the mask, and are handled by the kernels and the
merge (``seqpar.parallel.merge``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Mask"]


@dataclass(frozen=True)
class Mask:
    """Which (query, key) pairs of a sequence attend (Note [Masks]); positions are global.

    Attributes:
        causal: keys at or before their query only.
        window: ``(left, right)``, ``-1`` unbounded; with ``causal`` the right side is 0 or -1.
        chunk_size: ``C`` or ``None``.
    """

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    chunk_size: int | None = None

    @property
    def band(self) -> tuple[int | None, int | None]:
        """``(lo, hi)``: ``lo <= j - i <= hi``, ``None`` for an unbounded side."""
        left, right = self.window
        lo = -left if left >= 0 else None
        hi = 0 if self.causal else (right if right >= 0 else None)
        return lo, hi

    @property
    def is_full(self) -> bool:
        """Every pair of a sequence attends: the result does not depend on token positions."""
        return not self.causal and self.window == (-1, -1) and self.chunk_size is None

    def normalised(self, max_len: int) -> Mask:
        """The same mask with sides that no sequence of ``max_len`` tokens can reach made unbounded.

        A window or chunk at least as long as every sequence changes nothing (Gemma's 4096-token
        window on a 1000-token input is plain causal attention).
        """
        left, right = self.window
        if left >= max(max_len - 1, 0):
            left = -1
        if right >= max(max_len - 1, 0) or (self.causal and right == 0):
            right = -1
        chunk = self.chunk_size if self.chunk_size is not None and self.chunk_size < max_len else None
        return Mask(self.causal, (left, right), chunk)

    def allows(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bool ``[..., Sq, Sk]``: whether query position ``q_pos[i]`` attends key ``k_pos[j]``.

        Args:
            q_pos: int64 ``[..., Sq]`` positions (within one sequence).
            k_pos: int64 ``[..., Sk]``.
        """
        diff = k_pos[..., None, :] - q_pos[..., :, None]
        ok = torch.ones_like(diff, dtype=torch.bool)
        lo, hi = self.band
        if lo is not None:
            ok &= diff >= lo
        if hi is not None:
            ok &= diff <= hi
        if self.chunk_size is not None:
            ok &= (q_pos[..., :, None] // self.chunk_size) == (k_pos[..., None, :] // self.chunk_size)
        return ok

    def describe(self) -> str:
        """A short human-readable form, e.g. ``"causal, window (4096, 0)"``."""
        parts = ["causal" if self.causal else "non-causal"]
        if self.window != (-1, -1):
            parts.append(f"window {self.window}")
        if self.chunk_size is not None:
            parts.append(f"chunk_size {self.chunk_size}")
        return ", ".join(parts)
