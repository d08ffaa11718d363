"""A token-sharded KV cache: every CP rank keeps the K/V rows of its own tokens (Note [Sharded KV cache]).

Note [Sharded KV cache]
~~~~~~~~~~~~~~~~~~~~~~~
After a sharded prefill (the prompt placed as for training, ``docs/sharding.md``), CP rank ``c``
keeps, for every layer, the keys and values *it computed from its own tokens* -- all K/V heads,
before any Ulysses all-to-all -- with their global positions. That shard is balanced whatever the
ring x Ulysses split (it is the placement's ``S / N`` tokens), also when the heads do not divide
the Ulysses size or ``Hkv < U``. Decoding then needs no K/V traffic at all: the new tokens'
queries are on every rank, each rank attends them over its own rows, and the partial results are
merged exactly by their log-sum-exp (``seqpar.inference.decode``, Note [Decoding over shards]).

Each new token is kept by exactly one rank, the one with the fewest live rows in that layer
(ties: the lowest CP rank). Every rank knows every rank's row count (host ints that follow from
the placement and the same sequence of appends and drops), so all ranks pick the same owner
without communication, and the shards stay within one row of each other once the prompt's
imbalance, if any, has been evened out.

Rows a causal window or a chunk mask can never show again are dropped: after the token at
position ``p``, future queries sit at ``p + 1`` or later, so a window ``(left, 0)`` needs keys
``>= p + 1 - left`` and a chunk size ``C`` keys ``>= C * ((p + 1) // C)``. A rank's rows are in
increasing position order (a placement shard is, and appends grow), so dropped rows are a prefix
of its buffer; buffers grow and compact in steps of ``1/16`` of their rows, so a rank holds at
most about ``1.07x`` its live rows (:attr:`LayerCache.nbytes` counts the whole buffers).

The batch dimension is the same on every rank, so beam search's reordering (:meth:`KVCache.reorder`)
is local.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from ..placement import Mask, Placement
from ..state import ParallelState, require_state

__all__ = ["KVCache", "LayerCache", "keep_from"]

_MIN_GROWTH = 16  # rows: the smallest buffer growth, and the dead prefix tolerated before compacting


def keep_from(mask: Mask, newest: int) -> int:
    """The first position any query after ``newest`` can attend under ``mask`` (causal), else 0.

    Args:
        mask: the layer's mask; only ``causal`` masks drop rows.
        newest: the largest position seen so far.
    """
    if not mask.causal:
        return 0
    start = 0
    left = mask.window[0]
    if left >= 0:
        start = max(start, newest + 1 - left)
    if mask.chunk_size is not None:
        start = max(start, mask.chunk_size * ((newest + 1) // mask.chunk_size))
    return start


class LayerCache:
    """One layer's rows on this CP rank (Note [Sharded KV cache]).

    Attributes:
        length: the global sequence length seen by this layer (the next token's position).
        counts: live rows of every CP rank, ``cp_rank`` order (the same list on every rank).
        start: the first position still kept anywhere (rows below were dropped).
    """

    def __init__(self, cp_size: int, cp_rank: int) -> None:
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self._keys: Tensor | None = None  # [B, capacity, Hkv, D]
        self._values: Tensor | None = None  # [B, capacity, Hkv, Dv]
        self._positions: Tensor | None = None  # int64 [capacity]
        self._lo = 0  # first live row of the buffers
        self._hi = 0  # one past the last live row
        self.length = 0
        self.start = 0
        self.counts = [0] * cp_size
        self._owners: deque[int] = deque()  # owner of every position in [start, length), windowed layers only
        self._track_owners = False
        self._placement: Placement | None = None  # the prefill's, to rebuild owners at the first drop

    # -- what is held ----------------------------------------------------------------------------

    @property
    def keys(self) -> Tensor | None:
        """``(batch, rows, nheads_kv, headdim)``: this rank's live keys, or ``None`` before any."""
        return None if self._keys is None else self._keys[:, self._lo:self._hi]

    @property
    def values(self) -> Tensor | None:
        """``(batch, rows, nheads_kv, headdim_v)``: this rank's live values, or ``None`` before any."""
        return None if self._values is None else self._values[:, self._lo:self._hi]

    @property
    def positions(self) -> Tensor | None:
        """int64 ``(rows,)``: the global position of every live row, increasing."""
        return None if self._positions is None else self._positions[self._lo:self._hi]

    @property
    def rows(self) -> int:
        return self._hi - self._lo

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for this layer: the whole buffers (spare capacity included)."""
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values, self._positions) if t is not None)

    # -- filling ---------------------------------------------------------------------------------

    def check_rows(self, k: Tensor, v: Tensor) -> None:
        """Raise unless new rows ``k`` ``(batch, T, nheads_kv, headdim)`` and ``v`` match the cached
        ones (batch, K/V heads, head dims, dtype); a layer with no rows yet accepts any.

        Raises:
            ValueError: naming both shapes and dtypes.
        """
        if self._keys is None:
            return
        want_k, want_v = self._keys.shape, self._values.shape
        if (k.shape[0], *k.shape[2:]) != (want_k[0], *want_k[2:]) or v.shape[-1] != want_v[-1] or k.dtype != self._keys.dtype:
            raise ValueError(
                f"seqpar KV cache: new keys {tuple(k.shape)} {k.dtype} / values {tuple(v.shape)} do not match the "
                f"cached rows (batch {want_k[0]}, {want_k[2]} K/V heads, head dims {want_k[3]}/{want_v[3]}, "
                f"{self._keys.dtype}); every call of a layer must pass the same batch, heads, head dims and dtype"
            )

    def _reallocate(self, capacity: int) -> None:
        """Move the live rows to the front of new buffers of ``capacity`` rows."""
        live = self.rows
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            buf = old.new_empty((old.shape[0], capacity, *old.shape[2:]))
            buf[:, :live] = old[:, self._lo:self._hi]
            setattr(self, name, buf)
        pos = self._positions.new_empty(capacity)
        pos[:live] = self._positions[self._lo:self._hi]
        self._positions, self._lo, self._hi = pos, 0, live

    def _reserve(self, extra: int) -> None:
        """Room for ``extra`` more rows at the end (the buffers grow by 1/16 of their rows)."""
        if self._hi + extra > self._keys.shape[1]:
            need = self.rows + extra
            self._reallocate(need + max(_MIN_GROWTH, need // 16))

    def store_prefill(self, k: Tensor, v: Tensor, positions: Tensor, placement: Placement) -> None:
        """Keep this rank's prefill rows.

        Args:
            k: ``(batch, rows, nheads_kv, headdim)``, this rank's shard of the prompt's keys.
            v: ``(batch, rows, nheads_kv, headdim_v)``.
            positions: int64 ``(rows,)``, their global positions (increasing).
            placement: the prompt's placement (every rank's row count).
        """
        if self.length:
            raise ValueError(
                f"seqpar KV cache: a layer that already holds {self.length} tokens got a sharded prefill; a "
                "prefill fills an empty cache, later tokens go through seqpar.inference.decode"
            )
        self._keys, self._values = k.detach().clone(), v.detach().clone()
        self._positions = positions.to(device=k.device, dtype=torch.long).clone()
        self._lo, self._hi = 0, k.shape[1]
        self.length = placement.total
        self.counts = list(placement.shard_lengths)
        self._owners = deque()
        self._placement = placement  # owners are built lazily, at the first drop (windowed layers only)

    def append(self, k: Tensor, v: Tensor) -> list[int]:
        """Append ``T`` new tokens at positions ``length .. length + T - 1``; each is kept by the
        least-filled rank (Note [Sharded KV cache]).

        Args:
            k: ``(batch, T, nheads_kv, headdim)``, the same on every CP rank.
            v: ``(batch, T, nheads_kv, headdim_v)``.

        Returns:
            The owner (CP rank) of each new token.
        """
        self.check_rows(k, v)
        t = k.shape[1]
        owners = []
        for _ in range(t):
            owner = min(range(self.cp_size), key=lambda r: (self.counts[r], r))
            self.counts[owner] += 1
            owners.append(owner)
        mine = [i for i, o in enumerate(owners) if o == self.cp_rank]
        positions = torch.arange(self.length, self.length + t, dtype=torch.long, device=k.device)
        if self._track_owners:
            self._owners.extend(owners)
        self.length += t
        if not mine:
            if self._keys is None:  # nothing held yet: keep the shapes for later checks
                self._keys = k.detach()[:, :0].clone()
                self._values = v.detach()[:, :0].clone()
                self._positions = positions[:0].clone()
            return owners
        index = torch.tensor(mine, device=k.device)
        new_k, new_v = k.detach().index_select(1, index), v.detach().index_select(1, index)
        if self._keys is None:
            self._keys, self._values = new_k.clone(), new_v.clone()
            self._positions = positions[index].clone()
            self._lo, self._hi = 0, len(mine)
            return owners
        self._reserve(len(mine))
        n = len(mine)
        self._keys[:, self._hi:self._hi + n] = new_k
        self._values[:, self._hi:self._hi + n] = new_v
        self._positions[self._hi:self._hi + n] = positions[index]
        self._hi += n
        return owners

    def drop_before(self, start: int) -> None:
        """Forget every row at a position below ``start`` (on every rank: counts stay in step)."""
        if start <= self.start:
            return
        start = min(start, self.length)
        if not self._track_owners:  # first drop of this layer: owners of [self.start, length)
            self._track_owners = True
            placement = self._placement
            owners = torch.full((self.length - self.start,), -1, dtype=torch.long)
            if placement is not None:
                for rank in range(self.cp_size):
                    index = placement.global_index(rank) - self.start
                    index = index[index >= 0]
                    owners[index] = rank
            # Appended tokens: replay the least-filled rule from the prefill counts.
            counts = list(placement.shard_lengths) if placement is not None else [0] * self.cp_size
            first_appended = placement.total if placement is not None else 0
            for p in range(first_appended, self.length):
                owner = min(range(self.cp_size), key=lambda r: (counts[r], r))
                counts[owner] += 1
                if p >= self.start:
                    owners[p - self.start] = owner
            self._owners = deque(owners.tolist())
        for _ in range(start - self.start):
            self.counts[self._owners.popleft()] -= 1
        self.start = start
        if self._positions is not None and self.rows:
            dead = int(torch.searchsorted(self.positions, torch.tensor(start, device=self._positions.device)))
            self._lo += dead
        if self._keys is not None and self._lo > max(_MIN_GROWTH, self.rows // 16):
            self._reallocate(self.rows + max(_MIN_GROWTH, self.rows // 16))

    def select_batch(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search's reorder), on every rank alike."""
        if self._keys is not None:
            index = index.to(self._keys.device)
            self._keys = self._keys.index_select(0, index)
            self._values = self._values.index_select(0, index)

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (``repeat_interleave``), e.g. to start beam search."""
        if self._keys is not None:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)


class KVCache:
    """The token-sharded KV cache of one model on one CP group (Note [Sharded KV cache]).

    Filled by :func:`seqpar.inference.prefill` (the prompt's shards) and
    :func:`seqpar.inference.decode` (new tokens, the same on every rank); see ``docs/inference.md``.

    Args:
        state: the parallel state whose CP group shares the cache.
        num_layers: how many attention layers (``layer`` indices ``0 .. num_layers - 1``).

    Raises:
        ValueError: a bad ``state`` or a negative ``num_layers``.
    """

    def __init__(self, state: ParallelState, num_layers: int) -> None:
        require_state(state, "seqpar.inference.KVCache")
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0:
            raise ValueError(f"seqpar.inference.KVCache: num_layers must be an int >= 0, got {num_layers!r}")
        self.state = state
        self.layers: list[LayerCache] = [LayerCache(state.cp_size, state.cp_rank) for _ in range(num_layers)]
        self.prefill_placement: Placement | None = None  # set by the first layer's prefill

    def layer(self, index: int) -> LayerCache:
        """Layer ``index``'s cache, growing the list for a new index."""
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"seqpar KV cache: layer index must be an int >= 0, got {index!r}")
        while len(self.layers) <= index:
            self.layers.append(LayerCache(self.state.cp_size, self.state.cp_rank))
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """The global sequence length of layer 0 (0 before any token)."""
        return self.layers[0].length if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds over all layers (buffers, spare capacity and positions included)."""
        return sum(layer.nbytes for layer in self.layers)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` in every layer (beam search); the same call on every rank."""
        for layer in self.layers:
            layer.select_batch(index)

    def repeat(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in every layer."""
        for layer in self.layers:
            layer.repeat_batch(repeats)

    def counts(self, layer: int = 0) -> Sequence[int]:
        """Live rows of every CP rank in ``layer`` (``cp_rank`` order)."""
        return list(self.layers[layer].counts)
