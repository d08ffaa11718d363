"""Head-parallel token mixing: any mixer on whole sequences of some heads, exact on shards.

Note [Head-parallel mixing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A token mixer that is independent per head (a depthwise convolution, a linear recurrence, a
state-space scan) needs every token of a head, in global order, but never another head. So, over
the whole CP group of ``N = R * U`` ranks (``cp_group``: ranks in ``cp_rank`` order):

1. **To heads.** One uneven all-to-all (``seqpar.comm.all_to_all_many``, heads scattered, tokens
   gathered) turns every rank's token shard ``[B, S_local, H, ...]`` into all tokens of its heads.
   The gathered tokens are the shards concatenated in ``cp_rank`` order -- the placement's
   permutation (``Placement.permutation``, Note [Sharding placement]) -- so one ``index_select``
   with its inverse puts them in global order (dense: undoing the zig-zag; packed: the balanced
   packed placement of ``shard_packed``, each sequence whole and in place).
2. **Mix.** ``fn`` runs on ``[B, S, H_mine, ...]`` (packed ``[T, H_mine, ...]``, with the global
   ``cu_seqlens``): the one-device computation of those heads, bitwise.
3. **Back.** The permutation, then the reverse all-to-all (tokens scattered, heads gathered)
   returns every rank its shard of all heads, in its own placement.

Every step is an autograd node (the all-to-all's backward is the reverse all-to-all, the
permutation's is a scatter), so the backward is exact by composition: nothing here writes one.

Heads are split with ``split_sizes(H, N)``: ``H`` need not divide ``N`` and ranks past ``H`` get no
head. Such a rank still takes part in both exchanges (with empty pieces) but never calls ``fn``: a
mixer kernel may not accept zero heads. It learns the shapes of ``fn``'s outputs from the other
ranks in one small exchange of ints (only when some rank has no head).

Grouped heads. A tensor may have fewer heads ``H_t`` than ``H`` (``H % H_t == 0``): its head ``j``
serves heads ``j * G .. (j + 1) * G - 1`` (``G = H / H_t``), the GQA relation
(``repeat_interleave``): gated-delta K heads shared by V heads, Mamba2's B/C groups. A rank receives
the contiguous range of grouped heads its heads read (``seqpar.placement.head_assignments``, Note
[Ulysses head placement]): a grouped head whose ``G`` heads are cut between ranks goes to each of
them, and the all-to-all's backward sums its gradients. Outputs with grouped heads (a convolution
of K) come back from the first rank that holds each head only, so nothing returns twice.

Bytes per call on each rank: its shard of every input out and in once, and its shard of every
output out and in once (grouped heads once per rank that reads them). Independent of ``N``.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..comm import all_to_all_many, exchange_ints
from ..placement import Placement, head_assignments, offsets
from ..placement.sizes import as_int, check_seq_lens
from ..prepare import collective_checks
from ..state import ParallelState, require_state

__all__ = ["HeadShard", "head_parallel"]

Mixer = Callable[..., "Tensor | Sequence[Tensor]"]


@dataclass(frozen=True, eq=False)
class HeadShard:
    """What one CP rank mixes in :func:`head_parallel`: some heads, over whole sequences.

    ``fn`` receives it first. Heads are those the work is split by (``H``, the largest head count);
    grouped tensors have fewer heads, each serving ``H / H_t`` consecutive heads.

    Attributes:
        num_heads: ``H``.
        start, count: this rank's heads ``[start, start + count)`` of ``H`` (``count >= 1``
            whenever ``fn`` is called).
        seq_lens: the global sequence lengths (``(S,)`` for dense tensors, shared by every row).
        cu_seqlens: packed calls: ``[nseq + 1]`` int64 on the tensors' device, the global
            sequence boundaries in the packed token dim; ``None`` for dense calls.
        cp_rank, cp_size: this rank and the group the heads are split over.
    """

    num_heads: int
    start: int
    count: int
    seq_lens: tuple[int, ...]
    cu_seqlens: Tensor | None
    cp_rank: int
    cp_size: int

    @property
    def packed(self) -> bool:
        """Whether the tensors are packed ``[T, h, ...]`` (else dense ``[B, S, h, ...]``)."""
        return self.cu_seqlens is not None

    def heads_of(self, num_heads: int) -> tuple[int, int]:
        """``(start, length)`` of the heads this rank holds of a tensor with ``num_heads`` heads
        (``num_heads`` dividing ``H``; ``H`` itself gives ``(start, count)``).

        Raises:
            ValueError: if ``num_heads`` does not divide ``H``.
        """
        return _assignment(self.num_heads, num_heads, self.cp_size, self.cp_rank, "HeadShard.heads_of")

    def narrow(self, x: Tensor, dim: int = 0, num_heads: int | None = None) -> Tensor:
        """This rank's heads of a tensor that every rank holds whole (a per-head parameter:
        ``A_log``, ``dt_bias``, a conv weight ``[C, K]``), ``num_heads`` (default ``x.shape[dim]``)
        along ``dim``. Its gradient is partial (zero outside these heads): summed over the CP
        group it is exact, as for every parameter (``docs/api.md``, gradient convention)."""
        n = x.shape[dim] if num_heads is None else num_heads
        start, length = self.heads_of(n)
        return x.narrow(dim, start, length)

    def expand(self, x: Tensor, num_heads: int, dim: int) -> Tensor:
        """Grouped heads received by this rank (``num_heads`` of them globally, along ``dim``)
        repeated to one per head of this rank: ``[..., count, ...]``, local head ``i`` reading
        grouped head ``(start + i) // G`` (``G = H / num_heads``). ``x`` itself when
        ``num_heads == H``."""
        g_start, g_len = self.heads_of(num_heads)
        if x.shape[dim] != g_len:
            raise ValueError(
                f"HeadShard.expand: x has {x.shape[dim]} heads along dim {dim}, but this rank holds "
                f"{g_len} of the {num_heads} grouped heads"
            )
        if num_heads == self.num_heads:
            return x
        group = self.num_heads // num_heads
        index = [(self.start + i) // group - g_start for i in range(self.count)]
        return x.index_select(dim, torch.tensor(index, dtype=torch.long, device=x.device))


def _assignment(num_heads: int, group_heads: int, n: int, rank: int, where: str) -> tuple[int, int]:
    """``(start, length)`` of the ``group_heads``-head tensor that rank ``rank`` of ``n`` reads."""
    if group_heads < 1 or num_heads % group_heads:
        raise ValueError(
            f"{where}: a tensor with {group_heads} heads cannot be grouped onto {num_heads} heads; "
            f"every head count must divide heads={num_heads}"
        )
    return _ranges(num_heads, group_heads, n)[rank]


@functools.lru_cache(maxsize=256)
def _ranges(num_heads: int, group_heads: int, n: int) -> tuple[tuple[int, int], ...]:
    """Per rank, the ``(start, length)`` of the ``group_heads`` heads it reads."""
    if group_heads == num_heads:
        sizes = [a.q_len for a in head_assignments(num_heads, num_heads, n)]
        return tuple(zip(offsets(sizes)[:-1], sizes))
    return tuple((a.kv_start, a.kv_len) for a in head_assignments(num_heads, group_heads, n))


@functools.lru_cache(maxsize=256)
def _owned(num_heads: int, group_heads: int, n: int) -> tuple[tuple[int, int], ...]:
    """Per rank, the ``(offset into its heads, length)`` it returns of an output with
    ``group_heads`` heads: each head from the first rank that holds it (a partition)."""
    out, covered = [], 0
    for start, length in _ranges(num_heads, group_heads, n):
        first = max(start, covered)
        keep = max(0, start + length - first)
        out.append((first - start if keep else 0, keep))
        covered = max(covered, start + length)
    return tuple(out)


@dataclass(frozen=True)
class _Order:
    """The token order of a placement: ``perm`` (global index of the shards concatenated in
    ``cp_rank`` order) and its inverse, or ``None`` for both when it is the identity."""

    shard_lengths: tuple[int, ...]
    perm: Tensor | None
    inverse: Tensor | None


@functools.lru_cache(maxsize=64)
def _order(seq_lens: tuple[int, ...], ring_size: int, ulysses_size: int) -> _Order:
    placement = Placement(seq_lens, ring_size, ulysses_size)
    perm = placement.permutation()
    if torch.equal(perm, torch.arange(perm.numel())):
        return _Order(placement.shard_lengths, None, None)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return _Order(placement.shard_lengths, perm, inverse)


_DTYPES = (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.complex128, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_OK, _FAILED, _NO_HEADS = 0, 1, 2  # per-rank status in the exchanges


def _crc(values: object) -> int:
    return zlib.crc32(repr(values).encode())


def _describe_inputs(
    tensors: Sequence[Tensor], heads: int | None, out_heads: Sequence[int] | None, packed: bool,
) -> tuple[int, int, int, list[int]]:
    """``(B, local tokens, H, per-tensor heads)`` of validated inputs.

    Raises:
        ValueError: naming the tensor and its shape.
    """
    where = "head_parallel"
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence) or not tensors:
        raise ValueError(f"{where}: tensors must be a non-empty list of tensors, got {type(tensors).__name__}")
    layout = "[T_local, H, ...] (packed, seq_lens given)" if packed else "[B, S_local, H, ...]"
    lead = 1 if packed else 2
    for i, x in enumerate(tensors):
        if not isinstance(x, Tensor):
            raise ValueError(f"{where}: tensors[{i}] is a {type(x).__name__}, not a tensor")
        if x.ndim < lead + 1:
            raise ValueError(f"{where}: tensors[{i}] has shape {tuple(x.shape)}; expected {layout}")
        if x.shape[lead] < 1:
            raise ValueError(f"{where}: tensors[{i}] {tuple(x.shape)} has no head; every tensor needs one")
    x0 = tensors[0]
    for i, x in enumerate(tensors[1:], 1):
        if x.shape[:lead] != x0.shape[:lead] or x.device != x0.device:
            raise ValueError(
                f"{where}: tensors[{i}] {tuple(x.shape)} on {x.device} does not match tensors[0] "
                f"{tuple(x0.shape)} on {x0.device} in its leading dims {layout}; every tensor holds "
                "the same tokens"
            )
    counts = [x.shape[lead] for x in tensors]
    if out_heads is not None and (isinstance(out_heads, (str, bytes)) or not isinstance(out_heads, Sequence)):
        raise ValueError(f"{where}: out_heads must be a list of head counts, one per output of fn, got {out_heads!r}")
    if heads is None:
        heads = max(counts)
    heads = as_int(heads, "heads", where, minimum=1)
    for name, values in (("tensors", counts), ("out_heads", list(out_heads or []))):
        for i, h in enumerate(values):
            h = as_int(h, f"out_heads[{i}]", where, minimum=1) if name == "out_heads" else h
            if heads % h:
                raise ValueError(
                    f"{where}: {name}[{i}] has {h} heads, which does not divide heads={heads}; grouped "
                    "heads must each serve the same number of heads (H % H_t == 0)"
                )
    batch = 1 if packed else x0.shape[0]
    return batch, x0.shape[lead - 1], heads, counts


def head_parallel(
    fn: Mixer,
    tensors: Sequence[Tensor],
    state: ParallelState,
    *,
    heads: int | None = None,
    out_heads: Sequence[int] | None = None,
    seq_len: int | None = None,
    seq_lens: Sequence[int] | Tensor | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Run a per-head token mixer on whole sequences, from token shards and back (Note above).

    Every CP rank passes its token shards; ``fn`` runs on some heads over every token, in global
    order, and the result comes back as token shards in the inputs' placement. Differentiable
    (backward exact); one all-to-all over ``state.cp_group`` per distinct trailing shape each way.

    ``fn(shard, *tensors)`` gets a :class:`HeadShard` (its heads; ``cu_seqlens`` for packed
    calls) and the tensors as ``[B, S, h_t, ...]`` (packed: ``[T, h_t, ...]``), ``h_t`` this
    rank's heads of tensor ``t`` (``shard.heads_of(H_t)[1]``). It returns one tensor or a tuple,
    each ``[B, S, h_o, ...]`` (packed ``[T, h_o, ...]``) with this rank's heads of its head
    count (``out_heads``, default ``H``). It is never called on a rank that has no head (``H <
    cp_size``); that rank still takes part in every collective.

    Args:
        fn: the mixer, as above; it must do the same thing on every rank (it may use per-head
            parameters through ``shard.narrow``).
        tensors: per-head tensors ``[B, S_local, H_t, ...]`` (any trailing dims, several
            trailing shapes and dtypes allowed), or packed ``[T_local, H_t, ...]`` with
            ``seq_lens``. Per-channel tensors ``[B, S_local, C]`` have ``C`` heads.
        state: the parallel state; the heads are split over its whole CP group.
        heads: ``H``, the head count the work is split by (default: the largest ``H_t``); every
            ``H_t`` divides it (grouped heads: head ``j`` serves heads ``j*G .. j*G+G-1``).
        out_heads: the head count of each of ``fn``'s outputs (default ``H`` for each).
        seq_len: dense calls: the global length ``S`` (``None``: exchanged, one small collective).
        seq_lens: packed calls: the global sequence lengths; the shards follow ``shard_packed``.

    Returns:
        ``fn``'s outputs as token shards ``[B, S_local, H_o, ...]`` (packed ``[T_local, H_o,
        ...]``): a tensor if ``fn`` returned one, else a tuple.

    Raises:
        ValueError: malformed tensors, head counts that do not divide ``H``, local lengths that are
            not this rank's share, ranks that disagree, outputs of the wrong shape. Where the CP
            ranks check collectively (``ParallelState.checks``, Note [Global length]) every rank
            raises the same error; an exception in ``fn`` on one rank then raises on every rank.
    """
    where = "head_parallel"
    require_state(state, where)
    packed = seq_lens is not None
    n, me = state.cp_size, state.cp_rank
    problem: str | None = None
    batch = local = num_heads = 0
    counts: list[int] = []
    lens: tuple[int, ...] = ()
    try:
        if not callable(fn):
            raise ValueError(f"{where}: fn must be callable, got {type(fn).__name__}")
        if packed and seq_len is not None:
            raise ValueError(f"{where}: pass seq_len for dense tensors or seq_lens for packed ones, not both")
        if packed:
            lens = check_seq_lens(seq_lens, where)
        elif seq_len is not None:
            lens = (as_int(seq_len, "seq_len", where),)
        batch, local, num_heads, counts = _describe_inputs(tensors, heads, out_heads, packed)
    except ValueError as e:
        problem = str(e)
    first = tensors[0] if isinstance(tensors, Sequence) and tensors else None
    device = first.device if isinstance(first, Tensor) else torch.device("cpu")
    signature = None if problem is not None else (
        packed, batch, num_heads, tuple(out_heads or ()), lens if packed or seq_len is not None else None,
        tuple((tuple(x.shape[(1 if packed else 2):]), str(x.dtype)) for x in tensors),
    )

    lens = agree_on_call(
        state, local, problem, signature, lens, packed, device, where, lengths_given=seq_len is not None or packed,
        options="shapes outside the token dim, dtypes, heads, out_heads, seq_len / seq_lens",
    )

    order = _order(lens, state.ring_size, state.ulysses_size)
    cu_seqlens = None
    if packed:
        cu_seqlens = torch.tensor(offsets(lens), dtype=torch.long, device=device)
    start, count = _ranges(num_heads, num_heads, n)[me]
    shard = HeadShard(num_heads, start, count, lens, cu_seqlens, me, n)
    out_counts = None if out_heads is None else [int(h) for h in out_heads]
    lead = 1 if packed else 2
    as_bshf = [_bshf(x, lead) for x in tensors]  # [B, S_local, H_t, F_t], trailing dims flattened

    mixed = _to_heads(as_bshf, counts, num_heads, order, state)  # [B, S, h_t, F_t], global order
    views = [_unflatten(m, x, lead) for m, x in zip(mixed, tensors)]
    outs, single, status, error, meta = None, False, _NO_HEADS, None, []
    if count:
        try:
            result = fn(shard, *views)
            single = isinstance(result, Tensor)
            outs = [result] if single else list(result) if isinstance(result, (tuple, list)) else None
            if outs is None:
                raise ValueError(
                    f"{where}: fn returned a {type(result).__name__}; return a tensor or a tuple of tensors"
                )
            _check_outputs(outs, out_counts, shard, batch, sum(lens), packed)
            meta = _meta(outs, single, lead)
            status = _OK
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
            status, error = _FAILED, e
    zero_ranks = num_heads < n  # some rank has no head (the last ones: split_sizes)
    if n > 1 and (zero_ranks or collective_checks(state, device, True)):
        rows = exchange_ints([status, len(meta), _crc(meta)], state.cp_group, device)
        failed = [c for c, row in enumerate(rows) if row[0] == _FAILED]
        if failed:
            if error is not None:
                raise error
            raise ValueError(
                f"{where}: fn failed on cp rank {failed[0]} (its own error says why); every rank "
                "raises so that none waits for it"
            )
        ok = [c for c, row in enumerate(rows) if row[0] == _OK]  # cp rank 0 always has a head
        bad = [c for c in ok if rows[c][1:] != rows[0][1:]]
        if bad:
            raise ValueError(
                f"{where}: fn's outputs on cp rank {bad[0]} differ from cp rank 0's in number, "
                "trailing shape, dtype or requires_grad; fn must do the same on every rank"
            )
        if zero_ranks:
            # Ranks without heads learn the outputs from cp rank 0: one more small exchange.
            shared = exchange_ints(meta or [-1] * rows[0][1], state.cp_group, device)[0]
            if status == _NO_HEADS:
                single, outs = _placeholders(shared, views, lead)
    elif error is not None:
        raise error
    counts_out = out_counts or [num_heads] * len(outs)
    back = _to_tokens([_bshf(o, lead) for o in outs], counts_out, num_heads, order, state)
    results = tuple(_unflatten(b, o, lead) for b, o in zip(back, outs))
    return results[0] if single else results


def _placement_words(lens: tuple[int, ...], packed: bool, state: ParallelState) -> str:
    what = f"seq_lens (total {sum(lens)})" if packed else f"seq_len={lens[0]}"
    return f"{what} over ring {state.ring_size} x ulysses {state.ulysses_size}"


def _raise_refusals(rows: list[list[int]], problem: str | None, what: str, where: str) -> None:
    """Raise on every rank if some rank flagged a problem (its own message where it is local)."""
    flagged = [c for c, row in enumerate(rows) if row[1]]
    if problem is not None:
        raise ValueError(problem)
    if flagged:
        raise ValueError(
            f"{where}: cp rank {flagged[0]} refused {what} (its own error says why); every rank "
            "raises so that none waits for it"
        )


def agree_on_call(
    state: ParallelState, local: int, problem: str | None, signature: object, lens: tuple[int, ...],
    packed: bool, device: torch.device, where: str, *, lengths_given: bool, options: str,
) -> tuple[int, ...]:
    """The global lengths of a mixing call, after every CP rank agreed on it: one exchange of
    ``[local tokens, problem?, signature hash]`` where the ranks check collectively
    (``collective_checks``; ``lengths_given`` must follow from the call's arguments alone, so that
    every rank decides alike), else this rank's own checks. ``problem`` is this rank's own error,
    ``options`` names what ``signature`` covers. Shared by :func:`head_parallel` and
    :func:`~seqpar.mixing.state_passing.state_passing`.

    Raises:
        ValueError: the same on every rank where checked collectively: a rank's own problem, other
            options on some rank, local lengths that are not the placement's.
    """
    n, me = state.cp_size, state.cp_rank
    if n > 1 and collective_checks(state, device, lengths_given):
        rows = exchange_ints([local, int(problem is not None), _crc(signature)], state.cp_group, device)
        _raise_refusals(rows, problem, "its inputs", where)
        bad = [c for c, row in enumerate(rows) if row[2] != rows[0][2]]
        if bad:
            raise ValueError(
                f"{where}: cp rank {bad[0]} passes other tensors or options than cp rank 0 ({options}); "
                "every rank passes its shard of the same call"
            )
        got = [row[0] for row in rows]
        lens = lens or (sum(got),)
        want = list(_order(lens, state.ring_size, state.ulysses_size).shard_lengths)
        if got != want:
            raise ValueError(
                f"{where}: the CP ranks hold {got} tokens, but {_placement_words(lens, packed, state)} "
                f"places {want}; shard with seqpar.shard / seqpar.shard_packed and pass the global length"
            )
        return lens
    if problem is not None:
        raise ValueError(problem)
    if not lens:  # one rank, dense, no seq_len (collective_checks holds without lengths on more)
        return (local,)
    want = _order(lens, state.ring_size, state.ulysses_size).shard_lengths
    if local != want[me]:
        raise ValueError(
            f"{where}: cp rank {me} holds {local} tokens, but {_placement_words(lens, packed, state)} "
            f"places {want[me]} there (all ranks: {list(want)}); shard with seqpar.shard / "
            "seqpar.shard_packed and pass the global length"
        )
    return lens


def _check_outputs(
    outs: list[Tensor], out_counts: list[int] | None, shard: HeadShard, batch: int, total: int, packed: bool,
) -> None:
    where = "head_parallel"
    if out_counts is not None and len(out_counts) != len(outs):
        raise ValueError(f"{where}: fn returned {len(outs)} outputs but out_heads has {len(out_counts)} entries")
    lead = 1 if packed else 2
    want_lead = (total,) if packed else (batch, total)
    for i, o in enumerate(outs):
        if not isinstance(o, Tensor):
            raise ValueError(f"{where}: fn's output {i} is a {type(o).__name__}, not a tensor")
        h = shard.num_heads if out_counts is None else out_counts[i]
        mine = shard.heads_of(h)[1]
        if o.ndim < lead + 1 or tuple(o.shape[:lead]) != want_lead or o.shape[lead] != mine:
            layout = "[T, h, ...]" if packed else "[B, S, h, ...]"
            raise ValueError(
                f"{where}: fn's output {i} on cp rank {shard.cp_rank} has shape {tuple(o.shape)}; expected "
                f"{layout} with {want_lead} tokens and this rank's {mine} of its {h} heads (out_heads)"
            )


def _meta(outs: list[Tensor], single: bool, lead: int) -> list[int]:
    """Ints that describe ``fn``'s outputs: ``[single, then per output: dtype, requires_grad,
    ndim of the trailing shape, the trailing shape]``."""
    meta = [int(single)]
    for o in outs:
        if o.dtype not in _DTYPES:
            raise ValueError(f"head_parallel: fn's outputs may not be {o.dtype}")
        trailing = list(o.shape[lead + 1:])
        meta += [_DTYPES.index(o.dtype), int(o.requires_grad), len(trailing), *trailing]
    return meta


def _placeholders(meta: list[int], views: list[Tensor], lead: int) -> tuple[bool, list[Tensor]]:
    """The empty outputs of a rank without heads, from cp rank 0's :func:`_meta`.

    They hang off the inputs' head shards (empty too), so that the backward of the exchange into
    head shards runs on this rank as on the others; an output that requires grad elsewhere does
    so here (else this rank would skip the reverse exchange's backward and the others wait)."""
    single, pos, outs = bool(meta[0]), 1, []
    while pos < len(meta):
        dtype, grad, nd = _DTYPES[meta[pos]], bool(meta[pos + 1]), meta[pos + 2]
        shape = [*views[0].shape[:lead], 0, *meta[pos + 3: pos + 3 + nd]]
        pos += 3 + nd
        out = views[0].new_zeros(shape, dtype=dtype)
        if dtype.is_floating_point or dtype.is_complex:
            for v in views:
                out = out + v.reshape(shape).to(dtype)
            if grad and not out.requires_grad:
                out.requires_grad_()
        outs.append(out)
    return single, outs


def _bshf(x: Tensor, lead: int) -> Tensor:
    """``[B, S, H, ...]`` (``lead=2``) or ``[T, H, ...]`` (``lead=1``) as ``[B, S, H, F]``."""
    b = (1,) if lead == 1 else (x.shape[0],)
    return x.reshape(*b, x.shape[lead - 1], x.shape[lead], math.prod(x.shape[lead + 1:]))


def _unflatten(y: Tensor, like: Tensor, lead: int) -> Tensor:
    """``[B, S', h, F]`` back to ``like``'s layout with ``S'`` tokens and ``h`` heads."""
    shape = [*y.shape[:2], y.shape[2], *like.shape[lead + 1:]]
    return y.reshape(shape[1:] if lead == 1 else shape)


def _groups(tensors: Sequence[Tensor], key: Callable[[int, Tensor], object]) -> dict[object, list[int]]:
    out: dict[object, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(key(i, t), []).append(i)
    return out


def _to_heads(
    xs: list[Tensor], counts: list[int], num_heads: int, order: _Order, state: ParallelState,
) -> list[Tensor]:
    """Token shards ``[B, S_local, H_t, F]`` to head shards ``[B, S, h_t, F]`` in global order."""
    n = state.cp_size
    if n == 1:
        return list(xs)
    outs: list[Tensor | None] = [None] * len(xs)
    # One all-to-all per trailing size and dtype: the collective needs one shape outside the heads.
    for members in _groups(xs, lambda i, x: (x.shape[3], x.dtype)).values():
        ranges = [list(_ranges(num_heads, counts[i], n)) for i in members]
        got = all_to_all_many([xs[i] for i in members], state.cp_group, 2, 1, list(order.shard_lengths), ranges)
        for i, g in zip(members, got):
            outs[i] = g if order.inverse is None else g.index_select(1, order.inverse.to(g.device))
    return outs


def _to_tokens(
    ys: list[Tensor], counts: list[int], num_heads: int, order: _Order, state: ParallelState,
) -> list[Tensor]:
    """Head shards ``[B, S, h_o, F]`` in global order back to token shards ``[B, S_local, H_o, F]``."""
    n, me = state.cp_size, state.cp_rank
    if n == 1:
        return list(ys)
    tokens = [list(zip(offsets(order.shard_lengths)[:-1], order.shard_lengths))]
    outs: list[Tensor | None] = [None] * len(ys)
    for (h, _, _), members in _groups(ys, lambda i, y: (counts[i], y.shape[3], y.dtype)).items():
        owned = _owned(num_heads, h, n)
        sent = []
        for i in members:
            y = ys[i].narrow(2, *owned[me])  # heads held by several ranks return from the first
            sent.append(y if order.perm is None else y.index_select(1, order.perm.to(y.device)))
        got = all_to_all_many(sent, state.cp_group, 1, 2, [k for _, k in owned], tokens * len(sent))
        for i, g in zip(members, got):
            outs[i] = g
    return outs
