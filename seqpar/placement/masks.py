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
merge (``seqpar.parallel.merge``). ALiBi (``alibi_slopes``) changes the scores by the global
distance ``|i - j|``; the mask records that it is on (``Mask.alibi``) because every kernel block then
needs rows of consecutive positions (Note [Ring blocks]).

Note [Mask slices]
~~~~~~~~~~~~~~~~~~
:class:`MaskSlices` is a mask given as a union of rectangles of one dense sequence (MagiAttention's
model): slice ``s`` covers queries ``[qs, qe)`` and keys ``[ks, ke)``, all of them (``"full"``) or
those on or below its bottom-right aligned diagonal (``"causal"``, flash-attn's alignment:
``j - ks <= i - qs + (ke - ks) - (qe - qs)``, i.e. ``j - i <= ke - qe``). Query ``i`` attends key
``j`` iff some slice covers ``(i, j)``; a row covered by no slice attends nothing (zeros, no
gradient). Block-causal video (frame ``b`` sees frames ``<= b``) and prefix-LM (``j < P`` or
``j <= i``) are two constructors::

    block_causal([2, 3, 1])          prefix_lm(6, 2)        x = attended
            k: 0 1 2 3 4 5            k: 0 1 2 3 4 5
        q 0    x x . . . .        q 0    x x . . . .
          1    x x . . . .          1    x x . . . .
          2    x x x x x .          2    x x x . . .
          3    x x x x x .          3    x x x x . .
          4    x x x x x .          4    x x x x x .
          5    x x x x x x          5    x x x x x x

Every constraint of a slice has the form ``j - i <= h`` inside a rectangle, so the union cuts into
disjoint *cells*: the query axis and the key axis are split at every slice boundary, and the cell
of a query segment and a key segment is attended where ``j - i <= h`` with ``h`` the largest bound
of the slices covering it (none when a full slice covers it). :meth:`MaskSlices.cells` returns them
merged along the keys where a row of cells is one band; the ring plan intersects its pieces with
the cells, so overlapping slices are never counted twice.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .sizes import is_int

__all__ = ["Mask", "MaskSlices"]

@dataclass(frozen=True)
class Mask:
    """Which (query, key) pairs of a sequence attend (Note [Masks]); positions are global.

    Attributes:
        causal: keys at or before their query only.
        window: ``(left, right)``, ``-1`` unbounded; with ``causal`` the right side is 0 or -1.
        chunk_size: ``C`` or ``None``.
        slices: a :class:`MaskSlices` (then ``causal``, ``window`` and ``chunk_size`` are unset).
        alibi: scores carry an ALiBi bias (``-slope * |i - j|``): blocks must be runs of
            consecutive positions.
    """

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    chunk_size: int | None = None
    slices: MaskSlices | None = None
    alibi: bool = False

    @property
    def band(self) -> tuple[int | None, int | None]:
        """``(lo, hi)``: ``lo <= j - i <= hi``, ``None`` for an unbounded side."""
        left, right = self.window
        lo = -left if left >= 0 else None
        hi = 0 if self.causal else (right if right >= 0 else None)
        return lo, hi

    @property
    def positional(self) -> bool:
        """Whether the result depends on token positions (anything but plain full attention)."""
        return self.causal or self.window != (-1, -1) or self.chunk_size is not None or self.slices is not None or self.alibi

    @property
    def is_full(self) -> bool:
        """Every pair of a sequence attends with a position-free score: the result does not
        depend on token positions."""
        return not self.positional

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
        return Mask(self.causal, (left, right), chunk, self.slices, self.alibi)

    def allows(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bool ``[..., Sq, Sk]``: whether query position ``q_pos[i]`` attends key ``k_pos[j]``.

        Args:
            q_pos: int64 ``[..., Sq]`` positions (within one sequence).
            k_pos: int64 ``[..., Sk]``.
        """
        if self.slices is not None:
            return self.slices.allows(q_pos, k_pos)
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
        if self.slices is not None:
            parts = [self.slices.describe()]
        else:
            parts = ["causal" if self.causal else "non-causal"]
            if self.window != (-1, -1):
                parts.append(f"window {self.window}")
            if self.chunk_size is not None:
                parts.append(f"chunk_size {self.chunk_size}")
        if self.alibi:
            parts.append("ALiBi")
        return ", ".join(parts)


_KINDS = ("full", "causal")


def _as_range(r: object, what: str, s: int) -> tuple[int, int]:
    try:
        a, b = r  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"MaskSlices: {what}[{s}] must be a (start, stop) pair, got {r!r}") from None
    vals = []
    for x in (a, b):
        if isinstance(x, Tensor):
            if x.numel() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
                raise ValueError(f"MaskSlices: {what}[{s}] must hold ints, got {r!r}")
            x = int(x)
        if not is_int(x):
            raise ValueError(f"MaskSlices: {what}[{s}] must hold ints, got {r!r}")
        vals.append(int(x))
    a, b = vals
    if not 0 <= a < b:
        raise ValueError(
            f"MaskSlices: {what}[{s}] = ({a}, {b}) must be a non-empty half-open range of positions "
            "with 0 <= start < stop"
        )
    return a, b


def _ranges(x: object, what: str) -> list:
    if isinstance(x, Tensor):
        if x.dim() != 2 or x.shape[-1] != 2:
            raise ValueError(f"MaskSlices: {what} as a tensor must be [n, 2], got {tuple(x.shape)}")
        return x.tolist()
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ValueError(f"MaskSlices: {what} must be a sequence of (start, stop) pairs, got {type(x).__name__}")
    return list(x)


@dataclass(frozen=True, init=False)
class MaskSlices:
    """A mask as a union of query/key rectangles of one dense sequence (Note [Mask slices]).

    ``MaskSlices(q_ranges, k_ranges, kinds)``: slice ``s`` covers query positions
    ``q_ranges[s] = (qs, qe)`` and key positions ``k_ranges[s] = (ks, ke)`` (global, half-open),
    every pair (``kinds[s] == "full"``) or the bottom-right aligned causal part (``"causal"``).

    Example::

        frames = seqpar.MaskSlices.block_causal([256] * 16)      # 16 frames of 256 tokens
        out = seqpar.attention(q, k, v, state, mask=frames)

    Raises:
        ValueError: ranges that are not non-empty ``(start, stop)`` int pairs, lists of different
            lengths, no slice, or a kind other than ``"full"`` / ``"causal"``.
    """

    q_ranges: tuple[tuple[int, int], ...]
    k_ranges: tuple[tuple[int, int], ...]
    kinds: tuple[str, ...]

    def __init__(self, q_ranges: object, k_ranges: object, kinds: object) -> None:
        qr, kr = _ranges(q_ranges, "q_ranges"), _ranges(k_ranges, "k_ranges")
        if isinstance(kinds, str):
            kinds = [kinds] * len(qr)
        if isinstance(kinds, (bytes,)) or not isinstance(kinds, Sequence):
            raise ValueError(f"MaskSlices: kinds must be a sequence of 'full' / 'causal', got {type(kinds).__name__}")
        kinds = list(kinds)
        if not (len(qr) == len(kr) == len(kinds)):
            raise ValueError(
                f"MaskSlices: q_ranges ({len(qr)}), k_ranges ({len(kr)}) and kinds ({len(kinds)}) "
                "must have one entry per slice"
            )
        if not qr:
            raise ValueError("MaskSlices: at least one slice is needed (a mask that attends nothing has no use)")
        bad = [k for k in kinds if k not in _KINDS]
        if bad:
            raise ValueError(f"MaskSlices: kinds must be 'full' or 'causal', got {bad[0]!r}")
        object.__setattr__(self, "q_ranges", tuple(_as_range(r, "q_ranges", s) for s, r in enumerate(qr)))
        object.__setattr__(self, "k_ranges", tuple(_as_range(r, "k_ranges", s) for s, r in enumerate(kr)))
        object.__setattr__(self, "kinds", tuple(kinds))

    @classmethod
    def block_causal(cls, block_sizes: Sequence[int]) -> MaskSlices:
        """Block ``b`` (of ``block_sizes[b]`` consecutive tokens) sees every token of blocks
        ``<= b`` (autoregressive video: frame-causal attention); sizes may differ.

        Raises:
            ValueError: no block, or a size that is not a positive int.
        """
        sizes = list(block_sizes)
        if not sizes:
            raise ValueError("MaskSlices.block_causal: block_sizes is empty")
        for b, n in enumerate(sizes):
            if not is_int(n) or n < 1:
                raise ValueError(f"MaskSlices.block_causal: block_sizes[{b}] = {n!r} must be a positive int")
        q, start = [], 0
        for n in sizes:
            q.append((start, start + int(n)))
            start += int(n)
        return cls(q, [(0, e) for _, e in q], ["full"] * len(q))

    @classmethod
    def prefix_lm(cls, seq_len: int, prefix_len: int) -> MaskSlices:
        """Query ``i`` sees key ``j`` iff ``j < prefix_len`` or ``j <= i``: a bidirectional prefix
        (a VLM prompt) and causal attention after it.

        Raises:
            ValueError: ``seq_len < 1`` or ``prefix_len`` outside ``[0, seq_len]``.
        """
        for name, x in (("seq_len", seq_len), ("prefix_len", prefix_len)):
            if not is_int(x):
                raise ValueError(f"MaskSlices.prefix_lm: {name} must be an int, got {x!r}")
        S, P = int(seq_len), int(prefix_len)
        if S < 1 or not 0 <= P <= S:
            raise ValueError(f"MaskSlices.prefix_lm: need seq_len >= 1 and 0 <= prefix_len <= seq_len, got {S}, {P}")
        if P == 0:
            return cls([(0, S)], [(0, S)], ["causal"])
        if P == S:
            return cls([(0, S)], [(0, S)], ["full"])
        return cls([(0, S), (P, S)], [(0, P), (P, S)], ["full", "causal"])

    @classmethod
    def from_bool(cls, mask: Tensor, *, max_slices: int = 512, where: str = "MaskSlices.from_bool") -> MaskSlices:
        """The slices of a boolean ``[S, S]`` mask (``True``: attend) whose every row attends one
        contiguous key range -- block-causal, prefix-LM, causal, any staircase of full and causal
        runs. Rows are grouped into runs that are one full or one causal slice each.

        Raises:
            ValueError: not a 2-D square bool tensor, a row whose keys are not one contiguous
                range, or more than ``max_slices`` runs (a sliding window is ``window=``).
        """
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
            got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"{where}: expected a square [S, S] boolean mask, got {got}")
        m = mask.detach().to("cpu")
        S = m.shape[0]
        cols = torch.arange(S)
        count = m.sum(1)
        lo = torch.where(count > 0, torch.where(m, cols, S).amin(1), 0)
        hi = torch.where(count > 0, torch.where(m, cols, -1).amax(1) + 1, 0)
        bad = torch.nonzero((count > 0) & (hi - lo != count)).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"{where}: row {i} of the {S}x{S} mask attends {int(count[i])} keys that are not one "
                f"contiguous range (first {int(lo[i])}, last {int(hi[i]) - 1}); only masks whose rows each "
                "attend one key range (block-causal, prefix-LM, causal staircases) run as mask slices"
            )
        lo_l, hi_l, n_l = lo.tolist(), hi.tolist(), count.tolist()
        q, k, kinds = [], [], []
        i = 0
        while i < S:
            if n_l[i] == 0:
                i += 1
                continue
            # A run of rows with the same key start and either the same end (full) or an end that
            # grows with the row (causal, bottom-right aligned).
            j = i + 1
            while j < S and n_l[j] and lo_l[j] == lo_l[i] and hi_l[j] == hi_l[i]:
                j += 1
            kind = "full"
            if j == i + 1:
                while j < S and n_l[j] and lo_l[j] == lo_l[i] and hi_l[j] - j == hi_l[i] - i:
                    j += 1
                kind = "causal" if j > i + 1 else "full"
            q.append((i, j))
            k.append((lo_l[i], hi_l[j - 1]))
            kinds.append(kind)
            if len(q) > max_slices:
                raise ValueError(
                    f"{where}: the {S}x{S} mask needs more than {max_slices} slices (rows change their key "
                    "range almost every row, e.g. a sliding window); pass window= / chunk_size= to "
                    "seqpar.attention instead"
                )
            i = j
        if not q:
            raise ValueError(f"{where}: the {S}x{S} mask attends nothing")
        return cls(q, k, kinds)

    @property
    def extent(self) -> tuple[int, int]:
        """``(largest query stop, largest key stop)``: the sequence must be at least this long."""
        return max(b for _, b in self.q_ranges), max(b for _, b in self.k_ranges)

    def allows(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bool ``[..., Sq, Sk]``: whether query position ``q_pos[i]`` attends key ``k_pos[j]``."""
        i, j = q_pos[..., :, None], k_pos[..., None, :]
        ok = torch.zeros(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=q_pos.device)
        for (qs, qe), (ks, ke), kind in zip(self.q_ranges, self.k_ranges, self.kinds):
            cover = (i >= qs) & (i < qe) & (j >= ks) & (j < ke)
            if kind == "causal":
                cover &= (j - i) <= (ke - qe)
            ok |= cover
        return ok

    def cells(self) -> tuple[tuple[int, int, int, int, int | None], ...]:
        """Disjoint ``(q0, q1, k0, k1, hi)`` cells whose union is the mask (Note [Mask slices]):
        in each, query ``i`` of ``[q0, q1)`` attends key ``j`` of ``[k0, k1)`` iff ``j - i <= hi``
        (``hi`` None: all); every cell holds at least one attended pair."""
        return _cells(self)

    def describe(self) -> str:
        n = len(self.kinds)
        return f"mask slices ({n} slice{'s' if n != 1 else ''}, queries < {self.extent[0]}, keys < {self.extent[1]})"

    def digest(self) -> int:
        """A 62-bit hash of the slices, for checking that every rank passed the same mask."""
        words = [x for (a, b), (c, d), k in zip(self.q_ranges, self.k_ranges, self.kinds)
                 for x in (a, b, c, d, _KINDS.index(k))]
        h = hashlib.blake2b(struct.pack(f"<{len(words)}q", *words), digest_size=8).digest()
        return int.from_bytes(h, "little") & ((1 << 62) - 1)


@functools.lru_cache(maxsize=64)
def _cells(m: MaskSlices) -> tuple[tuple[int, int, int, int, int | None], ...]:
    qb = sorted({x for r in m.q_ranges for x in r})
    kb = sorted({x for r in m.k_ranges for x in r})
    out: list[tuple[int, int, int, int, int | None]] = []
    for qa, qz in zip(qb, qb[1:]):
        row: list[list] = []
        for ka, kz in zip(kb, kb[1:]):
            full, hi = False, None
            for (qs, qe), (ks, ke), kind in zip(m.q_ranges, m.k_ranges, m.kinds):
                if qs <= qa and qz <= qe and ks <= ka and kz <= ke:
                    if kind == "full":
                        full = True
                        break
                    hi = ke - qe if hi is None else max(hi, ke - qe)
            if not full:
                if hi is None or ka - (qz - 1) > hi:  # not covered, or no pair below the diagonal
                    continue
                if kz - 1 - qa <= hi:  # the diagonal cuts nothing
                    full = True
            cell = [qa, qz, ka, kz, None if full else hi]
            # A cell continues the previous one along the keys when the union is one band: the
            # previous cell is full and lies wholly inside this cell's band (or both are full).
            if row and row[-1][3] == ka and row[-1][4] is None and (full or row[-1][3] - 1 - qa <= hi):
                row[-1][3], row[-1][4] = kz, cell[4]
            else:
                row.append(cell)
        out.extend(tuple(c) for c in row)
    return tuple(out)
