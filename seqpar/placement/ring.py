"""The ring plan: for every ring step, which (query rows, key rows, window) blocks a rank computes
and which K/V rows travel. Pure host maths on a :class:`~seqpar.placement.Placement` and a
:class:`~seqpar.placement.Mask`; no tensors of the model, no communication.

Note [Ring blocks]
~~~~~~~~~~~~~~~~~~
Step ``i`` of the ring brings ring rank ``r`` the K/V of ring rank ``src = (r - i) mod R`` (step 0:
its own). Both ring-local buffers are lists of *pieces*: runs of consecutive positions of one
sequence (per sequence, chunk ``r`` then chunk ``2R-1-r`` of Note [Sharding placement]; with
``chunk_size`` the runs are further cut at chunk boundaries). A query piece and a key piece meet
only when they belong to the same sequence (and the same attention chunk). For such a pair, with
global starts ``qa`` and ``ka``, the band of Note [Masks] becomes, in local rows,
``lo + qa - ka <= j - i <= hi + qa - ka``. The pair is then

- *trimmed* to the query rows that see at least one key and the keys some query sees (a pair
  can become empty: then no kernel runs), and
- expressed as a kernel window ``(wl, wr)`` in flash-attn's convention (aligned bottom-right:
  row ``i`` sees ``j`` in ``[i + Sk - Sq - wl, i + Sk - Sq + wr]``, ``-1`` unbounded). After
  trimming both sides are ``>= 0`` when bounded, so every kernel can express the block.

Two merges keep the number of kernel calls at the minimum when no window cuts a sequence:
pieces whose pairs are all unmasked are one full block over their rows, and a rank's own K/V
under a plain causal mask is one causal block (local positions increase, so the global causal
mask is the local one). A dense causal ring therefore computes, per step, one block: causal at
``src == r``, all queries against the first chunk of ``src`` when ``src < r``, and the second
query chunk against all of ``src`` when ``src > r`` -- each rank the same work.

Blocks are grouped into kernel calls. Blocks of one step that share a window and whose query
rows and key rows both increase together form one varlen call (segments pair query rows with key
rows; rows between blocks are paired with empty segments), so a packed batch of many sequences
costs a few calls per step; with a batch dimension (or a single block) a call is one dense block.

Traffic follows the mask: ``src`` sends only the key rows some block of ``r`` reads (for a window
``W`` shorter than a chunk, ``W`` rows per neighbour instead of the whole buffer), directly to
``r`` (one hop in step ``i``), and ``r`` computes on that compact buffer. Steps with no block move
nothing and run no kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .masks import Mask
from .layout import Placement

__all__ = ["Tiles", "BlockCall", "SegmentCall", "Step", "RingPlan", "ring_plan", "ring_step", "pair_geometry", "tile_pairs", "split_wide_blocks", "SPLIT_KEYS_FROM",
           "sent_as_computed", "sums_keys", "is_single_block"]

_NEG, _POS = -(1 << 60), 1 << 60


@dataclass(frozen=True)
class Tiles:
    """Blocks as int64 arrays ``[n]``: query rows ``[q0, q1)``, key rows ``[k0, k1)``, window
    ``(wl, wr)`` (bottom-right aligned, ``-1`` unbounded), wave class (blocks of one class can
    share a varlen call) and, when the plan keeps positions (ALiBi), ``off``: the global position
    of query row ``q0`` minus that of key row ``k0`` (rows of a block are consecutive positions)."""

    q0: Tensor
    q1: Tensor
    k0: Tensor
    k1: Tensor
    wl: Tensor
    wr: Tensor
    wave: Tensor
    off: Tensor | None = None

    def __len__(self) -> int:
        return int(self.q0.numel())

    def select(self, keep: Tensor) -> Tiles:
        return Tiles(
            *(getattr(self, f)[keep] for f in ("q0", "q1", "k0", "k1", "wl", "wr", "wave")),
            None if self.off is None else self.off[keep],
        )

    def key_ranges(self) -> list[tuple[int, int]]:
        """Sorted, merged ``(start, stop)`` key-row ranges the blocks read."""
        if len(self) == 0:
            return []
        order = torch.argsort(self.k0, stable=True)
        out: list[list[int]] = []
        for a, b in zip(self.k0[order].tolist(), self.k1[order].tolist()):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]


@dataclass(frozen=True)
class BlockCall:
    """One dense kernel call: query rows ``[q0, q1)`` against key rows ``[k0, k1)``; ``offset``:
    global position of query row ``q0`` minus that of key row ``k0`` (used by ALiBi plans only)."""

    q0: int
    q1: int
    k0: int
    k1: int
    window: tuple[int, int]
    offset: int = 0


@dataclass(frozen=True)
class SegmentCall:
    """One varlen kernel call over the whole query buffer and the whole K/V buffer of the step.

    Query segment ``s`` (``seg_q[s]`` rows) attends key segment ``s`` (``seg_k[s]`` rows) with the
    same ``window`` per segment; segments empty on one side skip rows.
    """

    seg_q: Tensor  # int64 [nseg]
    seg_k: Tensor
    window: tuple[int, int]
    cu_q: Tensor = field(repr=False)  # int32 [nseg + 1], host
    cu_k: Tensor = field(repr=False)
    max_q: int = 0
    max_k: int = 0

    @staticmethod
    def build(seg_q: Tensor, seg_k: Tensor, window: tuple[int, int]) -> SegmentCall:
        keep = (seg_q > 0) | (seg_k > 0)
        seg_q, seg_k = seg_q[keep], seg_k[keep]
        cu_q = torch.zeros(seg_q.numel() + 1, dtype=torch.int32)
        cu_k = torch.zeros(seg_k.numel() + 1, dtype=torch.int32)
        torch.cumsum(seg_q, 0, out=cu_q[1:])
        torch.cumsum(seg_k, 0, out=cu_k[1:])
        return SegmentCall(seg_q, seg_k, window, cu_q, cu_k, int(seg_q.max()), int(seg_k.max()))


Call = BlockCall | SegmentCall


@dataclass(frozen=True)
class Step:
    """One ring step of one rank (see Note [Ring blocks]).

    Attributes:
        src: the ring rank whose K/V the step attends.
        recv_rows: ``(start, stop)`` ranges of ``src``'s K/V buffer this rank needs, compacted into
            the step's buffer in this order (empty: nothing; step 0 uses the local buffer).
        kv_len: rows of the step's K/V buffer.
        calls: the kernel calls, key rows relative to the step's buffer.
        tiles: the blocks behind the calls (for work accounting).
        dst: the ring rank this rank sends its own K/V to in this step.
        send_rows: ranges of this rank's buffer ``dst`` needs (empty: nothing).
    """

    src: int
    recv_rows: tuple[tuple[int, int], ...]
    kv_len: int
    calls: tuple[Call, ...]
    tiles: Tiles
    dst: int
    send_rows: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RingPlan:
    """Every step of one ring rank: ``steps[i]`` attends the K/V of ``(r - i) mod R``."""

    ring_size: int
    ring_rank: int
    q_len: int
    kv_lens: tuple[int, ...]
    steps: tuple[Step, ...]

    @property
    def max_recv(self) -> int:
        """Largest K/V buffer received in one step (rows)."""
        return max((s.kv_len for s in self.steps[1:] if s.recv_rows), default=0)


# ---------------------------------------------------------------------------------------------
# Pieces and blocks.


@dataclass(frozen=True)
class _Pieces:
    key: Tensor  # group: sequence (and attention chunk)
    pos: Tensor  # first position within the sequence
    length: Tensor
    row: Tensor  # first row in the ring-local buffer
    run: Tensor  # 0: the chunk r piece, 1: the chunk 2R-1-r piece


def _pieces(placement: Placement, ring_rank: int, chunk_size: int | None) -> _Pieces:
    first, first_start, second, second_start = placement.ring_pieces(ring_rank)
    nseq = first.numel()
    seq_row = torch.cumsum(first + second, 0) - first - second
    length = torch.stack([first, second], 1).flatten()
    pos = torch.stack([first_start, second_start], 1).flatten()
    row = torch.stack([seq_row, seq_row + first], 1).flatten()
    seq = torch.arange(nseq, dtype=torch.long).repeat_interleave(2)
    run = torch.tensor([0, 1], dtype=torch.long).repeat(nseq)
    keep = length > 0
    length, pos, row, seq, run = length[keep], pos[keep], row[keep], seq[keep], run[keep]
    if chunk_size is None:
        return _Pieces(seq, pos, length, row, run)
    c_first = pos // chunk_size
    count = (pos + length - 1) // chunk_size - c_first + 1
    idx = torch.repeat_interleave(torch.arange(pos.numel()), count)
    within = torch.arange(idx.numel()) - (torch.cumsum(count, 0) - count)[idx]
    chunk = c_first[idx] + within
    start = torch.maximum(pos[idx], chunk * chunk_size)
    stop = torch.minimum(pos[idx] + length[idx], (chunk + 1) * chunk_size)
    per_seq = max(placement.seq_lens, default=0) // chunk_size + 1
    key = seq[idx] * per_seq + chunk
    return _Pieces(key, start, stop - start, row[idx] + start - pos[idx], run[idx])


def _pair_tiles(qp: _Pieces, kp: _Pieces, mask: Mask, same_rank: bool, hi_of_key: Tensor | None = None) -> Tiles:
    """The trimmed, merged blocks between query pieces ``qp`` and key pieces ``kp``; with
    ``hi_of_key`` (mask slices) the band's upper side is per group key, the lower one unbounded."""
    lo_b, hi_b = mask.band
    lo = _NEG if lo_b is None else lo_b
    hi = _POS if hi_b is None else hi_b
    left = torch.searchsorted(kp.key, qp.key, right=False)
    right = torch.searchsorted(kp.key, qp.key, right=True)
    counts = right - left
    qi = torch.repeat_interleave(torch.arange(qp.key.numel()), counts)
    ki = left[qi] + torch.arange(qi.numel()) - (torch.cumsum(counts, 0) - counts)[qi]
    nq, nk = qp.length[qi], kp.length[ki]
    if hi_of_key is not None:
        hi = hi_of_key[qp.key[qi]]
    delta = qp.pos[qi] - kp.pos[ki]
    lo_l, hi_l = lo + delta, hi + delta
    i0 = torch.clamp(-hi_l, min=0)
    i1 = torch.minimum(nq - 1, nk - 1 - lo_l)
    alive = i0 <= i1
    j0 = torch.clamp(i0 + lo_l, min=0)
    j1 = torch.minimum(nk - 1, i1 + hi_l)
    sq, sk = i1 - i0 + 1, j1 - j0 + 1
    lo_t, hi_t = lo_l + i0 - j0, hi_l + i0 - j0
    left_on, right_on = lo_t + sq - 1 > 0, hi_t < sk - 1
    untrimmed = (i0 == 0) & (i1 == nq - 1) & (j0 == 0) & (j1 == nk - 1)
    full = alive & ~left_on & ~right_on & untrimmed
    q0, k0 = qp.row[qi] + i0, kp.row[ki] + j0
    tiles = Tiles(
        q0=q0, q1=q0 + sq, k0=k0, k1=k0 + sk,
        wl=torch.where(left_on, sk - sq - lo_t, -1), wr=torch.where(right_on, hi_t - (sk - sq), -1),
        wave=_wave_class(qp.run[qi], kp.run[ki]),
        off=(delta + i0 - j0) if mask.alibi else None,
    )
    if qi.numel() == 0:
        return tiles
    if mask.alibi:  # blocks keep consecutive positions: no merging across pieces
        tiles = tiles.select(alive)
        return tiles.select(torch.argsort(tiles.q0 * (1 << 31) + tiles.k0, stable=True))
    # Groups (sequence, attention chunk) that collapse into one block (Note [Ring blocks]).
    group, inverse = torch.unique_consecutive(qp.key[qi], return_inverse=True)
    n_groups = group.numel()
    if same_rank and lo_b is None and hi_b == 0:
        merge = torch.ones(n_groups, dtype=torch.bool)  # own K/V, plain causal: one causal block
        window = (-1, 0)
    else:
        # All alive pairs untrimmed-full and forming a product of query pieces x key pieces.
        bad = torch.zeros(n_groups, dtype=torch.long).index_add_(0, inverse, (alive & ~full).long())
        n_alive = torch.zeros(n_groups, dtype=torch.long).index_add_(0, inverse, alive.long())
        q_rows = _distinct_per_group(inverse, qi, alive, n_groups)
        k_rows = _distinct_per_group(inverse, ki, alive, n_groups)
        merge = (bad == 0) & (n_alive > 0) & (n_alive == q_rows * k_rows)
        window = (-1, -1)
    use = alive & merge[inverse]
    merged = _group_bounds(tiles, inverse, use, n_groups)
    keep_single = alive & ~merge[inverse]
    singles = tiles.select(keep_single)
    has = merge & (torch.zeros(n_groups, dtype=torch.long).index_add_(0, inverse, use.long()) > 0)
    mq0, mq1, mk0, mk1 = (t[has] for t in merged)
    n = mq0.numel()
    joined = Tiles(
        q0=torch.cat([mq0, singles.q0]), q1=torch.cat([mq1, singles.q1]),
        k0=torch.cat([mk0, singles.k0]), k1=torch.cat([mk1, singles.k1]),
        wl=torch.cat([torch.full((n,), window[0]), singles.wl]),
        wr=torch.cat([torch.full((n,), window[1]), singles.wr]),
        wave=torch.cat([torch.zeros(n, dtype=torch.long), singles.wave]),
    )
    order = torch.argsort(joined.q0 * (1 << 31) + joined.k0, stable=True)
    return joined.select(order)


def pair_geometry(placement: Placement, mask: Mask) -> Tensor:
    """int64 ``[R, R]``: a code per (query ring rank, key ring rank) of a dense sequence such that
    two pairs with the same code get the same blocks, calls and K/V rows (in their own buffers):
    ``ring_step`` of a pair depends only on the code (and, for the diagonal, being a rank's own
    step). The code is the four pieces' lengths and, per (query piece, key piece), whether the
    pair has no block, one whole unmasked block, or -- a mask edge cuts it -- the distance of
    their starts (Note [Ring blocks]: a block depends on nothing else). The degree planner builds
    one step per code instead of every rank's plan.

    Raises:
        ValueError: a placement of several sequences or free lengths, ``R == 1``, or a mask with
            chunks, slices or ALiBi (whose blocks depend on more).
    """
    R = placement.ring_size
    if R < 2 or len(placement.seq_lens) != 1 or not placement.positional or mask.chunk_size is not None \
            or mask.slices is not None or mask.alibi:
        raise ValueError(
            f"pair_geometry: needs one dense sequence over R >= 2 ring ranks and a causal or window mask, got R={R}, "
            f"{len(placement.seq_lens)} sequence(s), {mask.describe()}"
        )
    sizes, starts = (t[:, 0] for t in placement.chunks)
    ranks = torch.arange(R)
    pieces = (ranks, 2 * R - 1 - ranks)  # chunk r, then chunk 2R-1-r (Note [Sharding placement])
    lo_b, hi_b = mask.band
    # Distances are within +-S: a band side beyond that is unbounded (and int32 holds them all).
    far = placement.total + 2
    lo = -far if lo_b is None else max(lo_b, -far)
    hi = far if hi_b is None else min(hi_b, far)
    small = torch.int32 if 2 * far < 2**31 else torch.long
    lengths, length_id = torch.unique(sizes, return_inverse=True)
    nL = lengths.numel()
    code = ((length_id[pieces[0]] * nL + length_id[pieces[1]]) * nL * nL)[:, None] \
        + (length_id[pieces[0]] * nL + length_id[pieces[1]])[None, :]
    kinds, deltas = [], []
    for qc in pieces:
        for kc in pieces:
            nq, nk = sizes[qc][:, None], sizes[kc][None, :]
            delta = (starts[qc][:, None] - starts[kc][None, :]).to(small)  # query start - key start
            # _pair_tiles in closed form: a pair's keys lie at -delta - (nq - 1) ... -delta + nk - 1
            # from its queries; no block when that range misses the band [lo, hi] (or a piece is
            # empty), one whole unmasked block when the band holds it (untrimmed, no window side).
            none_below = torch.where(nq > 0, -hi - (nq - 1), far).to(small)
            none_above = torch.where(nk > 0, nk - 1 - lo, -far).to(small)
            whole_from = torch.where(nk > 0, nk - 1 - hi, far).to(small)
            whole_to = torch.where(nq > 0, -lo - (nq - 1), -far).to(small)
            whole = (delta >= whole_from) & (delta <= whole_to)
            cut = ~((delta < none_below) | (delta > none_above) | whole)
            kinds.append((whole, cut))
            deltas.append(delta)
    distances = torch.unique(torch.cat([d[c] for d, (_, c) in zip(deltas, kinds)]))
    radix = 2 + distances.numel()  # per (query piece, key piece): 0 no block, 1 whole, 2 + the distance's index: cut
    if nL**4 * radix**4 >= 2**62:  # (never for a real shape: each distance cut is a mask edge)
        columns = [code] + [torch.where(c, 2 + torch.searchsorted(distances, d), w.long()) for d, (w, c) in zip(deltas, kinds)]
        return _unique_rows([c.reshape(-1) for c in columns])[1].view(R, R)
    for d, (whole, cut) in zip(deltas, kinds):
        column = whole.long()
        if distances.numel():
            column = torch.where(cut, 2 + torch.searchsorted(distances, d), column)
        code = code * radix + column
    return code


def _wave_class(run_q: Tensor, run_k: Tensor) -> Tensor:
    """0: pieces in the same order on both sides; 1: second query piece x first key piece;
    2: first query piece x second key piece. Blocks of one class increase together."""
    return torch.where(run_q == run_k, 0, torch.where(run_q > run_k, 1, 2))


def _unique_rows(columns: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``torch.unique(torch.stack(columns, 1), dim=0, return_inverse=True)`` of integer columns.

    The rows are numbered in one int64 key (column 0 the most significant digit, each column shifted
    to start at 0: the same lexicographic order) where the digits fit, because ``unique`` over
    ``dim=0`` sorts rows one comparison at a time: ~100x slower, seconds per packed plan."""
    lows = [c.min() for c in columns]
    sizes = [int(c.max() - lo) + 1 for c, lo in zip(columns, lows)]
    if math.prod(sizes) >= 1 << 62:
        return torch.unique(torch.stack(columns, 1), dim=0, return_inverse=True)
    key = torch.zeros_like(columns[0])
    for c, lo, size in zip(columns, lows, sizes):
        key = key * size + (c - lo)
    keys, inverse = torch.unique(key, return_inverse=True)
    rows = []
    for lo, size in zip(reversed(lows), reversed(sizes)):
        rows.append(keys % size + lo)
        keys = keys // size
    return torch.stack(rows[::-1], 1), inverse


def _distinct_per_group(inverse: Tensor, piece: Tensor, alive: Tensor, n_groups: int) -> Tensor:
    """Number of distinct ``piece`` ids among the alive pairs of each group."""
    if not bool(alive.any()):
        return torch.zeros(n_groups, dtype=torch.long)
    pairs = _unique_rows([inverse[alive], piece[alive]])[0]
    return torch.zeros(n_groups, dtype=torch.long).index_add_(0, pairs[:, 0], torch.ones(len(pairs), dtype=torch.long))


def _group_bounds(tiles: Tiles, inverse: Tensor, use: Tensor, n_groups: int) -> tuple[Tensor, ...]:
    """Per group, the bounding rows ``(q0, q1, k0, k1)`` of the selected blocks."""
    big = torch.full((n_groups,), _POS, dtype=torch.long)
    small = torch.full((n_groups,), -1, dtype=torch.long)
    idx = inverse[use]
    return (
        big.clone().scatter_reduce_(0, idx, tiles.q0[use], "amin"),
        small.clone().scatter_reduce_(0, idx, tiles.q1[use], "amax"),
        big.clone().scatter_reduce_(0, idx, tiles.k0[use], "amin"),
        small.clone().scatter_reduce_(0, idx, tiles.k1[use], "amax"),
    )


def tile_pairs(tiles: Tiles) -> int:
    """Attended (query, key) pairs of planner blocks (per head and batch row).

    Closed form per block; valid for the planner's trimmed blocks, in which every row sees a key.
    """
    sq, sk = tiles.q1 - tiles.q0, tiles.k1 - tiles.k0
    d = sk - sq
    # Sum over rows of the last key seen: min(sk - 1, i + d + wr), or sk - 1 when unbounded.
    c = d + tiles.wr
    m = torch.where(tiles.wr >= 0, (sk - c).clamp(0) .minimum(sq), torch.zeros_like(sq))
    upper = m * (m - 1) // 2 + m * c + (sq - m) * (sk - 1)
    # Sum over rows of the first key seen: max(0, i + d - wl), or 0 when unbounded.
    e = d - tiles.wl
    a = (-e).clamp(0).minimum(sq)
    lower = torch.where(tiles.wl >= 0, (sq - 1 + a) * (sq - a) // 2 + e * (sq - a), torch.zeros_like(sq))
    return int((upper - lower + sq).sum())


# ---------------------------------------------------------------------------------------------
# Steps and calls.


def _remap(tiles: Tiles, ranges: list[tuple[int, int]]) -> Tiles:
    """Key rows of ``tiles`` in the buffer that holds only ``ranges``, concatenated."""
    starts = torch.tensor([a for a, _ in ranges], dtype=torch.long)
    lens = torch.tensor([b - a for a, b in ranges], dtype=torch.long)
    packed = torch.cumsum(lens, 0) - lens
    m = torch.searchsorted(starts, tiles.k0, right=True) - 1
    shift = packed[m] - starts[m]
    return Tiles(tiles.q0, tiles.q1, tiles.k0 + shift, tiles.k1 + shift, tiles.wl, tiles.wr, tiles.wave, tiles.off)


def _calls(tiles: Tiles, q_len: int, kv_len: int, varlen: bool) -> tuple[Call, ...]:
    if len(tiles) == 0:
        return ()
    calls: list[Call] = []
    groups, inverse = _unique_rows([tiles.wave, tiles.wl, tiles.wr])
    for g in range(groups.shape[0]):
        sel = tiles.select(inverse == g)
        window = (int(groups[g, 1]), int(groups[g, 2]))
        if not varlen or len(sel) == 1 or sel.off is not None:
            offs = sel.off.tolist() if sel.off is not None else [0] * len(sel)
            calls.extend(
                BlockCall(a, b, c, d, window, o)
                for a, b, c, d, o in zip(sel.q0.tolist(), sel.q1.tolist(), sel.k0.tolist(), sel.k1.tolist(), offs)
            )
            continue
        order = torch.argsort(sel.q0 * (1 << 31) + sel.k0, stable=True)
        for chain in _chains(sel.select(order)):
            calls.append(chain if isinstance(chain, BlockCall) else _segment_call(chain, q_len, kv_len, window))
    return tuple(calls)


def _chains(sel: Tiles) -> list:
    """Tiles (sorted by query row) cut into chains whose query rows and key rows both increase
    without overlap (greedy, first chain that fits); a chain of one tile is a :class:`BlockCall`.
    Band masks give one chain per wave class; the cells of mask slices may give several."""
    chains: list[list[int]] = []
    ends: list[tuple[int, int]] = []
    q0, q1, k0, k1 = (t.tolist() for t in (sel.q0, sel.q1, sel.k0, sel.k1))
    for t in range(len(sel)):
        for c, (eq, ek) in enumerate(ends):
            if q0[t] >= eq and k0[t] >= ek:
                chains[c].append(t)
                ends[c] = (q1[t], k1[t])
                break
        else:
            chains.append([t])
            ends.append((q1[t], k1[t]))
    window = (int(sel.wl[0]), int(sel.wr[0])) if len(sel) else (-1, -1)
    return [
        BlockCall(q0[c[0]], q1[c[0]], k0[c[0]], k1[c[0]], window) if len(c) == 1
        else sel.select(torch.tensor(c, dtype=torch.long))
        for c in chains
    ]


def _segment_call(sel: Tiles, q_len: int, kv_len: int, window: tuple[int, int]) -> SegmentCall:
    """One varlen call over a chain of tiles (query and key rows both increasing)."""
    gap_q = sel.q0 - torch.cat([sel.q0.new_zeros(1), sel.q1[:-1]])
    gap_k = sel.k0 - torch.cat([sel.k0.new_zeros(1), sel.k1[:-1]])
    zeros = torch.zeros_like(gap_q)
    # Per block: (gap_q, 0), (0, gap_k), (block_q, block_k); then the trailing rows.
    seg_q = torch.stack([gap_q, zeros, sel.q1 - sel.q0], 1).flatten()
    seg_k = torch.stack([zeros, gap_k, sel.k1 - sel.k0], 1).flatten()
    tail_q, tail_k = q_len - int(sel.q1[-1]), kv_len - int(sel.k1[-1])
    seg_q = torch.cat([seg_q, torch.tensor([tail_q, 0])])
    seg_k = torch.cat([seg_k, torch.tensor([0, tail_k])])
    return SegmentCall.build(seg_q, seg_k, window)


def _all_tiles(placement: Placement, q_rank: int, k_rank: int, mask: Mask) -> Tiles:
    if not placement.positional:
        if not mask.is_full:
            raise ValueError(
                f"ring_plan: a placement of free lengths has no token positions, so it cannot run "
                f"{mask.describe()} attention; shard with seqpar.shard for position-dependent masks"
            )
        nq, nk = placement.ring_lengths[q_rank], placement.ring_lengths[k_rank]
        t = torch.tensor([0] if nq and nk else [], dtype=torch.long)
        return Tiles(t, t + nq, t, t + nk, t - 1, t - 1, t * 0)
    if mask.slices is not None:
        return _slice_tiles(placement, q_rank, k_rank, mask)
    qp = _pieces(placement, q_rank, mask.chunk_size)
    kp = qp if q_rank == k_rank else _pieces(placement, k_rank, mask.chunk_size)
    return _pair_tiles(qp, kp, mask, q_rank == k_rank)


def _cut(p: _Pieces, lo: Tensor, hi: Tensor) -> _Pieces:
    """The parts of pieces ``p`` inside each cell's position range ``[lo[c], hi[c])``, keyed by
    the cell ``c`` (sorted by cell)."""
    start = torch.maximum(p.pos[None, :], lo[:, None])
    stop = torch.minimum((p.pos + p.length)[None, :], hi[:, None])
    c, i = torch.nonzero(stop > start, as_tuple=True)
    a = start[c, i]
    return _Pieces(c, a, stop[c, i] - a, p.row[i] + a - p.pos[i], p.run[i])


def _slice_tiles(placement: Placement, q_rank: int, k_rank: int, mask: Mask) -> Tiles:
    """Blocks of a :class:`MaskSlices` mask (one dense sequence): every piece cut into the cells of
    Note [Mask slices]; a query part and a key part meet in their cell's band ``j - i <= hi``."""
    cells = torch.tensor(
        [(a, b, c, d, _POS if h is None else h) for a, b, c, d, h in mask.slices.cells()], dtype=torch.long
    ).view(-1, 5)
    qp = _cut(_pieces(placement, q_rank, None), cells[:, 0], cells[:, 1])
    kp = _cut(_pieces(placement, k_rank, None), cells[:, 2], cells[:, 3])
    return _pair_tiles(qp, kp, mask, q_rank == k_rank, hi_of_key=cells[:, 4])


def ring_plan(placement: Placement, ring_rank: int, mask: Mask, *, varlen: bool) -> RingPlan:
    """The plan of ring rank ``ring_rank`` (Note [Ring blocks]).

    Args:
        placement: where every token lives.
        ring_rank: ``r``.
        mask: the mask in global positions (normalised by the caller).
        varlen: whether blocks may be grouped into varlen calls (buffers without a batch dim).
    """
    steps = tuple(ring_step(placement, ring_rank, i, mask, varlen=varlen) for i in range(placement.ring_size))
    return RingPlan(placement.ring_size, ring_rank, placement.ring_lengths[ring_rank], placement.ring_lengths, steps)


def ring_step(placement: Placement, ring_rank: int, step: int, mask: Mask, *, varlen: bool) -> Step:
    """Step ``step`` of ring rank ``ring_rank``'s plan (``ring_plan(...).steps[step]``), alone: the
    degree planner builds one step per distinct shard geometry instead of every rank's plan."""
    R, r, i = placement.ring_size, ring_rank, step
    q_len = placement.ring_lengths[r]
    src, dst = (r - i) % R, (r + i) % R
    tiles = _all_tiles(placement, r, src, mask)
    kv_len = placement.ring_lengths[src]
    recv: tuple[tuple[int, int], ...] = ()
    send: tuple[tuple[int, int], ...] = ()
    if i > 0:
        recv = tuple(tiles.key_ranges())
        tiles = _remap(tiles, list(recv)) if recv else tiles
        kv_len = sum(b - a for a, b in recv)
        send = tuple(_all_tiles(placement, dst, r, mask).key_ranges())
    return Step(src, recv, kv_len, _calls(tiles, q_len, kv_len, varlen), tiles, dst, send)


# Unmasked blocks reading at least this many key rows run their backward in two halves of the
# keys: the kernel's dK/dV results (alive next to every accumulator) are then half as large.
SPLIT_KEYS_FROM = 512


def split_wide_blocks(calls: tuple[Call, ...] | list[Call]) -> list[Call]:
    """The calls, with large unmasked blocks cut in two along their keys (same results); the ring's
    backward runs these, so the kernel's dK/dV results (alive next to every accumulator) are half
    as large."""
    out = []
    for call in calls:
        if isinstance(call, BlockCall) and call.window == (-1, -1) and call.k1 - call.k0 >= SPLIT_KEYS_FROM:
            mid = (call.k0 + call.k1) // 2
            out += [BlockCall(call.q0, call.q1, call.k0, mid, call.window, call.offset),
                    BlockCall(call.q0, call.q1, mid, call.k1, call.window, call.offset - (mid - call.k0))]
        else:
            out.append(call)
    return out


def sent_as_computed(calls, kv_len: int, *, expanded: bool = False) -> bool:
    """Whether a remote step's dK/dV are one kernel call's results as they are: the step is one
    block over all ``kv_len`` key rows, and the kernel's backward does not hold them ``expanded``
    to the query heads (a grouped-query call on a backend whose backward expands K/V heads runs
    a wide block as two key halves into a send slot instead; Note [Gradients sent as computed]
    in ``seqpar.parallel.ring``)."""
    whole = len(calls) == 1 and isinstance(calls[0], BlockCall) and (calls[0].k0, calls[0].k1) == (0, kv_len)
    return whole and not (expanded and len(split_wide_blocks(calls)) > 1)


def sums_keys(calls) -> bool:
    """Whether some key row's gradient is a sum over several of ``calls`` (segments, or block
    calls whose key spans overlap), so that dK/dV are summed in the accumulator dtype first."""
    if any(isinstance(c, SegmentCall) for c in calls):
        return True
    spans = sorted((c.k0, c.k1) for c in calls)
    return any(a[1] > b[0] for a, b in zip(spans, spans[1:]))

def is_single_block(calls, q_len: int, kv_len: int) -> bool:
    """Whether ``calls`` are one block of every query row against every key row."""
    if len(calls) != 1 or not isinstance(calls[0], BlockCall):
        return False
    c = calls[0]
    return (c.q0, c.q1, c.k0, c.k1) == (0, q_len, 0, kv_len)
