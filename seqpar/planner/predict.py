"""What one ring x Ulysses factorisation costs: bytes, memory, balance and time (host maths only).

Note [Planner prediction]
~~~~~~~~~~~~~~~~~~~~~~~~~
For one attention layer, forward and backward, of ``S`` tokens over ring ``R`` x Ulysses ``U``
(``cp_rank = ring_rank * U + ulysses_rank``, ranks of a node consecutive), the prediction follows
what ``seqpar.attention`` runs, piece by piece:

1. **Ulysses** (``U > 1``, per ring rank): four fused all-to-alls (Note [Ulysses memory] in
   ``seqpar.parallel.ulysses``): forward q, k, v to heads and the output back; backward q, k, v,
   out, dout to heads and dq, dk, dv back -- only dout to heads with ``keep_head_shards``. Every rank's bytes come from its token count
   (``Placement.ulysses_sizes``) and its heads (``head_assignments``: query heads by
   ``split_sizes(H, U)``, K/V heads replicated where a group of query heads is cut).
2. **Ring**: the exact plan of every ring rank (``ring_plan``): per step, the K/V rows sent and
   received (``send_rows`` / ``recv_rows``, which already leave out what a causal mask or a window
   never reads) times the rank's K/V heads (expanded as the kernel sees them), and backward the
   same K/V again plus dK/dV going back. Ranks without a query head (``H < U``) skip the ring.
   With ``ring_comm="allgather"`` (Note [All-gather K/V]) the same plans are served by one
   all-gather of ``width`` rows per rank (the largest contribution) instead: ``R - 1`` parts
   of K and V received per rank (ring algorithm: ``R - 1`` messages), overlapping step 0 only,
   again in the backward, and a reduce-scatter of dK/dV after the last step that overlaps
   nothing; the step overhead ``ring_step_s`` is paid once per collective, not per step.
3. **Kernels**: every call of the plan, ``4 * D`` (forward) and ``10 * D`` (backward) FLOPs per
   computed pair and head (``seqpar.placement.cost``, Note [Plan cost]) -- the attended pairs
   (``tile_pairs``) plus the block kind's ``extra_keys`` per query row -- at the cost model's rate
   for the kind.
4. **Element-wise passes**: LSE merges and casts of the fp32 accumulators in the forward,
   gradient accumulation and sums in the backward, at ``memory_bandwidth``.

A ring step lasts ``C + X - overlap * min(C, X) + ring_step_s``: ``C`` the slowest rank's compute (with
``compute_capacity``, at least a node's summed compute over its capacity), ``X`` the slowest
rank's transfer in flight (forward: the next K/V; backward: the next K/V and the previous
step's gradients). All-to-alls do not overlap anything. Summed over phases, that is the predicted
time of the layer.

The memory estimate is the bytes one rank holds at the peak of the layer's backward, followed
moment by moment: held throughout, the shards of q, k, v, out, dout and the log-sum-exps; then the
largest of the exchange to heads (the head-sharded q, k, v, out, dout, one staging copy), each
ring step's kernel and the moment after it (K/V expanded to the kernel's heads where the mapping
is not uniform, the received ones gone unless kept; the fp32 accumulators, the step's K/V and the next step's arriving, the previous step's dK/dV in flight
both ways, the kernel's results, a send slot only where results are not sent as they are, the
head-sharded K/V until the last step's K/V have arrived: Notes [Ring schedule], [Gradients sent
as computed], [Step buffers released], [Own K/V released], [Serial ring]) and the way back (the
head-sharded gradients, one staging copy, the shard's dq, dk, dv). Not counted: kernel scratch
(the CPU backend's windowed band kernels allocate some) and the allocator's fragmentation. The
all-gather transport holds ``R + 1`` slots of ``width`` K/V rows (the gathered buffer and the own
part) and as many for dK/dV, counted whole. With ``keep_head_shards`` the token shards of q, k
and v are not held (nothing saves them), the head shards are (the same head-sharded terms). The
Ulysses hand-over (Note [Saved tensors handed over]) is not counted: whether the token shards die
once sent depends on whether the model holds them elsewhere.

Note [Planner head groups]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``head_groups=G`` runs a call as G calls over groups of query heads (Note [Head groups] in
``seqpar/attention.py``); the groups, with the K/V heads each carries, come from
``seqpar.planner.memory.group_shapes``, the list the memory model counts too. A count's **time**
is the sum of its groups' predictions (each group a layer of its query and K/V heads, every piece
above with its own latencies: the all-to-alls, ring steps and kernel calls are G times as many),
plus element-wise passes over the shard: the output written group by group, the gradients joined.
Its **peak** follows :func:`_memory` per group: held throughout, the call's shards of q, k, v, out,
dout, every group's log-sum-exps, the earlier groups' token-shard gradients (kept until the last
group is done), a group's K/V picked per query head where it reads them unevenly, and with
``keep_head_shards`` the other groups' saved head shards; then that group's exchange, ring and way
back; finally the join (dq's copy next to every group's gradients). One group is exactly
:func:`predict`'s figures. Not counted: copies a kernel makes of a group's non-contiguous head
slices (measured on CPU: the ring without Ulysses peaks up to 5% above the prediction).

Note [Planner by shard geometry]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``R`` ring ranks run ``R`` steps each, and the prediction reads every one of those ``R^2`` steps
(a step lasts as long as its slowest rank, a node sums its ranks' compute, a rank's memory peaks at
one of its steps). Building each rank's whole plan made cp 256 take minutes and cp 1024 hours. But
a step's blocks, calls and received rows depend only on the geometry of the two shards it pairs
(``seqpar.placement.ring.pair_geometry``): their pieces' lengths, equal up to the remainder of
``S / 2R``, and, where a mask edge cuts a block, the distance of their starts. A dense causal ring
has a handful of geometries whatever ``R``; a window adds a few per edge. So ``_ring_table``
builds one step per geometry (``ring_step``) and records which geometry every (step, rank)
computes and sends; every per-rank figure is the same Python expression of that step as before,
tabulated per (geometry, Ulysses rank) and gathered to ``[step, ring rank, Ulysses rank]``, and
only maxima, node sums (a running sum, rank after rank, as the ranks come) and integer byte sums
are array maths. The figures are bitwise those of the rank-by-rank computation
(``tests/test_planner.py`` keeps it as the reference).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..placement import Mask, Placement, imbalance, offsets
from ..placement.cost import StepWork, kernel_flops, kv_bytes, work_of_step
from ..placement.heads import HeadAssignment, cached_head_assignments
from ..placement.ring import (
    RingPlan, Step, is_single_block, pair_geometry, ring_step, sent_as_computed, split_wide_blocks, sums_keys,
)
from .cost import CostModel
from .memory import group_shapes

__all__ = ["Shape", "Candidate", "GroupPrediction", "predict", "predict_head_groups", "group_counts"]


@dataclass(frozen=True)
class Shape:
    """One attention layer: ``B`` sequences of ``S`` tokens, ``H`` / ``Hkv`` heads of dim ``D``.

    ``element_size`` is the bytes of one element of q, k, v (2 for bf16).
    """

    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    causal: bool
    window: tuple[int, int]
    element_size: int

    @property
    def mask(self) -> Mask:
        """The mask as ``seqpar.attention`` runs it (a window no sequence reaches is dropped)."""
        return Mask(self.causal, self.window).normalised(self.seq_len)


@dataclass(frozen=True)
class GroupPrediction:
    """One candidate run with ``head_groups`` groups of query heads (Note [Planner head groups]).

    Attributes:
        head_groups: ``G``, the calls' ``head_groups``.
        time_s: predicted seconds of the layer's attention, forward and backward.
        memory_bytes: predicted peak bytes of the busiest rank during the call's backward.
    """

    head_groups: int
    time_s: float
    memory_bytes: int


@dataclass(frozen=True)
class Candidate:
    """The prediction for one factorisation ``R x U`` (per rank, one layer, forward + backward).

    Attributes:
        ring_size, ulysses_size: ``R`` and ``U``.
        time_s: predicted seconds.
        parts: that time split into ``"all-to-all"``, ``"ring transfer"`` (what transfers and
            ``ring_step_s`` add to the ring's compute), ``"kernels"`` and ``"element-wise"``.
        ulysses_bytes, ring_bytes: bytes the busiest rank sends (all-to-alls; ring K/V, dK/dV).
        memory_bytes: peak bytes of the layer's tensors on the busiest rank (an estimate).
        imbalance: attention work ``max / mean`` over the CP ranks (``attention_work``).
        heads: query heads per Ulysses rank (``split_sizes(H, U)``).
        kv_heads: K/V heads each Ulysses rank receives (``head_assignments``).
        kv_replication: ``sum(kv_heads) / Hkv``: 1.0 when no K/V head is sent to two ranks.
        ulysses_link, ring_link: ``"intra"``, ``"inter"`` (some traffic crosses nodes) or ``"none"``.
        ring_comm: the K/V transport of the ring, ``"p2p"``, ``"p2p_serial"`` (Note [Serial ring])
            or ``"allgather"`` (Note [All-gather K/V]); ``"p2p"`` when ``R == 1``.
        keep_head_shards: predicted with ``ParallelState(keep_head_shards=True)`` (Note [Ulysses
            memory]); ``False`` when ``U == 1``, where it changes nothing.
        groups: the same split with ``head_groups`` 1, 2, 4, ... (:func:`group_counts`), one
            :class:`GroupPrediction` each (Note [Planner head groups]); empty where the plan did
            not predict them. ``time_s`` and ``memory_bytes`` above are those of one group.
        head_groups: the recommended ``head_groups`` (``seqpar.planner.recommend_head_groups``);
            1 where ``groups`` is empty.
    """

    ring_size: int
    ulysses_size: int
    time_s: float
    parts: dict[str, float]
    ulysses_bytes: int
    ring_bytes: int
    memory_bytes: int
    imbalance: float
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_replication: float
    ulysses_link: str
    ring_link: str
    ring_comm: str = "p2p"
    keep_head_shards: bool = False
    groups: tuple[GroupPrediction, ...] = field(default=(), compare=False)
    head_groups: int = field(default=1, compare=False)

    def group(self, head_groups: int) -> GroupPrediction:
        """The prediction with ``head_groups`` groups.

        Raises:
            ValueError: a count that was not predicted (listing those that were).
        """
        for g in self.groups:
            if g.head_groups == head_groups:
                return g
        raise ValueError(f"Candidate.group: head_groups={head_groups!r} was not predicted for {self.label()}; "
                         f"predicted: {[g.head_groups for g in self.groups]}")

    @property
    def idle_ranks(self) -> int:
        """Ulysses ranks (per ring rank) with no query head: ``max(U - H, 0)``."""
        return sum(1 for h in self.heads if h == 0)

    def label(self) -> str:
        """``"ring R x ulysses U"``, and ``" (all-gather)"`` or ``" (serial)"`` for the other K/V transports."""
        comm = {"allgather": " (all-gather)", "p2p_serial": " (serial)"}.get(self.ring_comm, "")
        keep = " (head shards kept)" if self.keep_head_shards else ""
        return f"ring {self.ring_size} x ulysses {self.ulysses_size}{comm}{keep}"


# ---------------------------------------------------------------------------------------------
# Every ring step, by shard geometry (Note [Planner by shard geometry]).


@dataclass(frozen=True, eq=False)
class _RingTable:
    """Every step of every ring rank of a dense sequence, one entry per geometry (Note [Planner
    by shard geometry]); independent of ``U`` (the Ulysses split comes after the ring placement).

    Attributes:
        lengths: ``L_r``, the ring-local tokens of every ring rank.
        compute: int64 ``[R, R]``, step ``i`` of ring rank ``r``: its geometry ``g`` (what it
            computes and receives) -- ``steps[g]`` is such a step.
        send: int64 ``[R, R]``: the geometry of the step that receives what ``r`` sends in step
            ``i`` (the same step ``i`` of its destination); ``len(steps)`` (nothing) at step 0.
        src, dst: int64 ``[R, R]``, the ring ranks ``r`` receives from and sends to in step ``i``.
        steps, remote, work: per geometry a step (``ring_step``), whether it is a step ``> 0``,
            and its ``work_of_step`` (whose ``send_rows`` are the representative's, unused).
        q_len, key_len: per geometry, the rows of the query side's buffer (its rank's ``L``) and
            of the buffer the received rows come from (the sender's ``L``).
        q_rows, k_rows, recv_rows, kv_len, received: int64 per geometry and one zero entry for
            nothing: ``StepWork``'s counts, the step's K/V buffer rows, whether it receives rows.
        staged_one, staged_any: per geometry: the received rows, as the sender's send rows, are
            staged (copied out, ``_ring_peak``) with one batch row, and with several.
        pairs, sent_rows, recv_rows_total: per ring rank, over its steps: attended pairs (per head
            and batch row), K/V rows sent and received.
        width: the all-gather slot rows (``gather_plan(...).width``; 0 when ``R == 1``).
    """

    lengths: tuple[int, ...]
    compute: Tensor
    send: Tensor
    src: Tensor
    dst: Tensor
    steps: tuple[Step, ...]
    remote: tuple[bool, ...]
    work: tuple[StepWork, ...]
    q_len: tuple[int, ...]
    key_len: tuple[int, ...]
    q_rows: Tensor
    k_rows: Tensor
    recv_rows: Tensor
    kv_len: Tensor
    received: Tensor
    staged_one: tuple[bool, ...]
    staged_any: tuple[bool, ...]
    pairs: list[int]
    sent_rows: list[int]
    recv_rows_total: list[int]
    width: int


def _union_rows(ranges: list[tuple[int, int]]) -> int:
    """Rows covered by ``ranges`` (overlaps counted once)."""
    total, end = 0, None
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def _gather(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` (rows of ``table`` at every entry of ``index``), by ``index_select``."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])


def _by_step(a: Tensor) -> tuple[Tensor, Tensor]:
    """``a[r, (r - i) mod R]`` and ``a[r, (r + i) mod R]`` as ``[i, r]`` (``a``: ``[R, R]``): the
    rows of ``a`` rotated, read as strided views of ``a`` twice side by side (no index arrays)."""
    R = a.shape[0]
    twice = torch.cat([a, a], 1)  # twice[r, c] at r * 2R + c
    # (r + i) mod R is column r + i: offset 0, strides (1, 2R + 1) over (i, r).
    ahead = twice.as_strided((R, R), (1, 2 * R + 1)).contiguous()
    # (r - i) mod R is column R + r - i; with j = R - 1 - i: 1 + j + r (2R + 1), then j reversed.
    behind = twice.as_strided((R, R), (1, 2 * R + 1), 1).flip(0)
    return behind, ahead


def _ids(code: Tensor) -> tuple[Tensor, int]:
    """``(ids, n)``: ``code`` (int64 >= 0) with its distinct values numbered ``0 .. n - 1`` in
    increasing order (``torch.unique``'s inverse; a count instead of a sort when the values are
    few)."""
    top = int(code.max()) + 1
    if top > 4 * code.numel() + 4096:
        _, ids = torch.unique(code, return_inverse=True)
        return ids, int(ids.max()) + 1
    seen = torch.zeros(top, dtype=torch.long)
    seen.index_fill_(0, code.reshape(-1), 1)
    return (seen.cumsum(0) - 1).index_select(0, code.reshape(-1)).view(code.shape), int(seen.sum())


@functools.lru_cache(maxsize=16)
def _ring_table(seq_len: int, ring_size: int, mask: Mask) -> _RingTable:
    """The :class:`_RingTable` of ``seq_len`` tokens over ``ring_size`` ring ranks."""
    R = ring_size
    placement = Placement.dense(seq_len, R, 1)
    ranks = torch.arange(R)
    src, dst = _by_step(ranks[None, :].expand(R, R))  # [i, r]: (r - i) mod R and (r + i) mod R
    if R == 1:
        steps = (ring_step(placement, 0, 0, mask, varlen=False),)
        remote, queries, keys, compute = (False,), (0,), (0,), torch.zeros((1, 1), dtype=torch.long)
        send = torch.ones((1, 1), dtype=torch.long)
        width = 0
    else:
        code = pair_geometry(placement, mask)  # [query ring rank, key ring rank]
        own, n_own = _ids(code.diagonal())  # step 0: a rank's own K/V
        off = code + 1
        off.fill_diagonal_(0)
        geometry, n_remote = _ids(off)  # id 0: the diagonal
        geometry, n_remote = geometry - 1, n_remote - 1
        flat = torch.full((n_remote + 1,), R * R).scatter_reduce_(0, geometry.view(-1) + 1, torch.arange(R * R), "amin")
        first_own = torch.full((n_own,), R).scatter_reduce_(0, own, ranks, "amin")
        pairs = [divmod(int(f), R) for f in flat[1:]]  # a (query rank, key rank) of each geometry
        steps = tuple(
            [ring_step(placement, a, (a - b) % R, mask, varlen=False) for a, b in pairs]
            + [ring_step(placement, int(a), 0, mask, varlen=False) for a in first_own]
        )
        remote = (True,) * n_remote + (False,) * n_own
        queries = tuple(a for a, _ in pairs) + tuple(int(a) for a in first_own)
        keys = tuple(b for _, b in pairs) + tuple(int(a) for a in first_own)
        compute = _by_step(geometry)[0]  # geometry[r, src]
        compute[0] = n_remote + own
        send = _by_step(geometry.T)[1]  # geometry[dst, r]
        send[0] = len(steps)
        # The all-gather's slot: the most rows some rank contributes, the union of what every
        # other rank reads from it (gather_plan): per key rank, the geometries that read it.
        read = torch.zeros((R, n_remote + 1), dtype=torch.bool)
        geometry.fill_diagonal_(n_remote)
        read.view(-1)[(ranks * (n_remote + 1)) + geometry] = True  # read[key rank, geometry]
        width = max(
            (_union_rows([rows for g in torch.nonzero(row).view(-1).tolist() for rows in steps[g].recv_rows])
             for row in torch.unique(read[:, :-1], dim=0)),
            default=0,
        )
    work = tuple(work_of_step(s, remote=m) for s, m in zip(steps, remote))
    lengths = placement.ring_lengths

    def column(values: list[int]) -> Tensor:  # per geometry, and 0 for nothing
        return torch.tensor([*values, 0], dtype=torch.long)

    key_len = tuple(lengths[k] for k in keys)
    recv_rows = column([w.recv_rows for w in work])
    return _RingTable(
        lengths, compute, send, src, dst, steps, remote, work,
        q_len=tuple(lengths[q] for q in queries),
        key_len=key_len,
        q_rows=column([w.q_rows for w in work]),
        k_rows=column([w.k_rows for w in work]),
        recv_rows=recv_rows,
        kv_len=column([s.kv_len for s in steps]),
        received=column([int(bool(s.recv_rows)) for s in steps]),
        staged_one=tuple(_staged_rows(s.recv_rows, n, 1) for s, n in zip(steps, key_len)),
        staged_any=tuple(_staged_rows(s.recv_rows, n, 2) for s, n in zip(steps, key_len)),
        pairs=column([w.pairs for w in work])[compute].sum(0).tolist(),
        sent_rows=recv_rows[send].sum(0).tolist(),  # what r sends: its destinations' received rows
        recv_rows_total=recv_rows[compute].sum(0).tolist(),
        width=width,
    )


def _kernel_seconds(work: StepWork, heads: int, batch: int, head_dim: int, cost: CostModel, backward: bool) -> float:
    """Kernel time of one step: per call a latency, per computed pair (attended pairs plus
    ``extra_keys`` per query row, at most the whole block) its FLOPs at the kind's rate."""
    if heads == 0:
        return 0.0
    seconds = (work.bwd_calls if backward else work.fwd_calls) * cost.kernel_latency_s
    for kind, (pairs, rows, full) in work.kinds.items():
        rates = cost.kernel[kind]
        computed = min(pairs + rows * rates.extra_keys, full)
        flops = kernel_flops(computed, head_dim, backward=backward) * heads * batch
        seconds += flops / (rates.backward if backward else rates.forward)
    return seconds


def _combine(per_rank: Tensor, ranks_per_node: int, cost: CostModel) -> list[float]:
    """Per step, the duration of a phase in which rank ``c`` computes ``per_rank[i, c]`` seconds
    (``[R, N]``, ``cp_rank`` order): the slowest rank, or with ``compute_capacity`` at least a
    node's summed compute over it (summed rank after rank, in ``cp_rank`` order)."""
    slowest = per_rank.amax(1)
    if cost.compute_capacity is None:
        return slowest.tolist()
    pad = (-per_rank.shape[1]) % ranks_per_node
    nodes = torch.nn.functional.pad(per_rank, (0, pad)).view(per_rank.shape[0], -1, ranks_per_node)
    load = nodes.cumsum(2)[..., -1]  # a running sum: left to right, as the ranks come
    return torch.maximum(slowest, load.amax(1) / cost.compute_capacity).tolist()


def _overlapped(compute: float, transfer: float, overlap: float) -> float:
    return compute + transfer - overlap * min(compute, transfer)


def _a2a_phase(
    placement: Placement, heads: list[HeadAssignment], q_mult: int, kv_mult: int, to_heads: bool,
    shape: Shape, ranks_per_node: int, cost: CostModel, calls: int = 1,
) -> tuple[float, list[int], bool]:
    """``(seconds, bytes sent per cp rank, crosses nodes)`` of one phase of all-to-alls per ring
    rank: ``calls`` collectives (one latency each) moving the phase's bytes.

    ``to_heads``: token shards -> head shards (rank ``i`` sends rank ``j`` its tokens of ``j``'s
    heads: ``sizes[i] * width[j]`` rows); else the reverse. Each tensor counts ``q_mult``
    query-head and ``kv_mult`` K/V-head tensors. A rank's peers on its node are a contiguous run of
    its Ulysses group, so what it sends and receives per link are sums over runs (prefix sums);
    ring ranks with the same token count at the same offset within a node move the same bytes.
    """
    R, U = placement.ring_size, placement.ulysses_size
    row = shape.head_dim * shape.element_size * shape.batch
    width = [q_mult * a.q_len + kv_mult * a.kv_len for a in heads]
    width_sum = offsets(width)
    sent = [0] * (R * U)
    seconds = 0.0
    crosses = False
    seen: dict[tuple[int, int], tuple[float, list[int], bool]] = {}
    for r in range(R):
        base = r * U
        key = (placement.ring_lengths[r], base % ranks_per_node)
        if key not in seen:
            sizes = placement.ulysses_sizes(r)
            size_sum = offsets(sizes)
            out_bytes, slowest, cross = [], 0.0, False
            for i in range(U):
                node = (base + i) // ranks_per_node
                lo, hi = max(0, node * ranks_per_node - base), min(U, (node + 1) * ranks_per_node - base)
                w_near, s_near = width_sum[hi] - width_sum[lo] - width[i], size_sum[hi] - size_sum[lo] - sizes[i]
                w_far, s_far = width_sum[U] - width_sum[hi] + width_sum[lo], size_sum[U] - size_sum[hi] + size_sum[lo]
                if to_heads:
                    out = (sizes[i] * w_near * row, sizes[i] * w_far * row)
                    inn = (width[i] * s_near * row, width[i] * s_far * row)
                else:
                    out = (width[i] * s_near * row, width[i] * s_far * row)
                    inn = (sizes[i] * w_near * row, sizes[i] * w_far * row)
                out_bytes.append(out[0] + out[1])
                cross = cross or hi - lo < U
                t = max(cost.ulysses_intra.seconds(max(out[0], inn[0]), calls),
                        cost.ulysses_inter.seconds(max(out[1], inn[1]), calls))
                slowest = max(slowest, t)
            seen[key] = (slowest, out_bytes, cross)
        slowest, out_bytes, cross = seen[key]
        sent[base:base + U] = out_bytes
        seconds = max(seconds, slowest)
        crosses = crosses or cross
    return seconds, sent, crosses


def _steps(
    table: _RingTable, shape: Shape, U: int, h: list[int], kvh: list[int], acc: int, ranks_per_node: int,
    cost: CostModel, transfers: bool,
) -> tuple[list[float], list[float], list[float], list[float], list[float], float, bool]:
    """Per ring step, over every cp rank (Note [Planner prediction], 2-4): the phase times of the
    forward and backward compute and of the kernels alone (``_combine``), the slowest transfer in
    flight forward (the next K/V) and backward (the next K/V and the previous step's gradients);
    then the last step's gradients and whether a transfer crosses nodes. ``transfers``: the p2p
    ring's hops (the all-gather has none per step).

    Every per-rank figure is a Python expression of one step's geometry and the rank's heads,
    tabulated per (geometry, Ulysses rank) and gathered to ``[step, ring rank, Ulysses rank]``
    (Note [Planner by shard geometry]); only the slowest rank, the node sums and the sums of
    integer bytes are array maths."""
    R, G = len(table.lengths), len(table.steps)
    D, B, e = shape.head_dim, shape.batch, shape.element_size
    mbw = cost.memory_bandwidth

    def per_u(fn, dtype=torch.float64) -> Tensor:  # [G + 1, U]: fn(geometry, u); nothing and h == 0: 0
        rows = [[fn(g, u) if h[u] else 0 for u in range(U)] for g in range(G)]
        return torch.tensor([*rows, [0] * U], dtype=dtype)

    def kernel(g: int, u: int, backward: bool) -> float:
        return _kernel_seconds(table.work[g], h[u], B, D, cost, backward)

    def merged(g: int, u: int, last: bool) -> int:  # forward: every result merged into the fp32
        # accumulators (read, write, block, lse); the final cast after the last step
        out = table.work[g].q_rows * h[u] * D * B * (3 * acc + e)
        return out + (table.q_len[g] * h[u] * D * B * (acc + e) if last else 0)

    def grads(g: int, u: int, last: bool) -> int:  # backward: dq added, dK/dV summed (step 0) or
        # copied out (the received grads added: the sent rows, below); the final casts
        w = table.work[g]
        out = w.q_rows * h[u] * D * B * (2 * acc + e) + w.k_rows * kvh[u] * D * B * 2 * (2 * acc + e)
        return out + (table.q_len[g] * (h[u] + 2 * kvh[u]) * D * B * (acc + e) if last else 0)

    def sent_grads(g: int, u: int) -> int:  # g: the geometry whose received rows r sent
        return table.work[g].recv_rows * kvh[u] * D * B * 2 * (2 * acc + e)

    ck, sk = table.compute, table.send
    kern_f = _gather(per_u(lambda g, u: kernel(g, u, False)), ck)
    kern_b = _gather(per_u(lambda g, u: kernel(g, u, True)), ck)
    comp_f = _gather(per_u(lambda g, u: kernel(g, u, False) + merged(g, u, False) / mbw), ck)
    comp_f[-1] = _gather(per_u(lambda g, u: kernel(g, u, False) + merged(g, u, True) / mbw), ck[-1])
    # The backward's element-wise bytes add what the step computes to what r sent: an integer
    # sum per rank before the one division, as a rank's own figure is computed (0 without heads).
    grads_b = _gather(per_u(lambda g, u: grads(g, u, False), torch.long), ck)
    grads_b[-1] = _gather(per_u(lambda g, u: grads(g, u, True), torch.long), ck[-1])
    grads_b += _gather(per_u(sent_grads, torch.long), sk)
    comp_b = kern_b + grads_b.double() / mbw
    N = R * U

    def phase(t: Tensor) -> list[float]:
        return _combine(t.reshape(R, N), ranks_per_node, cost)

    comp_f_s, comp_b_s = phase(comp_f), phase(comp_b)
    kernels = [a + b for a, b in zip(phase(kern_f), phase(kern_b))]
    x_next = torch.zeros((R, R, U), dtype=torch.float64)  # K/V of step i + 1 in flight during step i
    crosses = False
    if transfers and R > 1:
        links = (cost.ring_intra, cost.ring_inter)

        def seconds(rows: Tensor) -> Tensor:  # [G + 1, U, link]: Link.seconds of K and V of a step's rows
            return torch.tensor(
                [[[link.seconds(kv_bytes(n, kvh[u], D, B, e) if h[u] else 0, 2) for link in links] for u in range(U)]
                 for n in rows.tolist()], dtype=torch.float64)

        sec = seconds(table.recv_rows)  # [G + 1, U, link]
        node = (torch.arange(R)[:, None] * U + torch.arange(U)) // ranks_per_node  # [R, U]: node of (r, u)

        def transfer(geometry: Tensor, peer: Tensor) -> tuple[Tensor, Tensor]:
            out = _gather(sec, geometry)  # [step, r, U, link]
            if ranks_per_node >= R * U:  # one node
                return out[..., 0], torch.zeros((), dtype=torch.bool)
            inter = _gather(node, peer) != node
            return torch.where(inter, out[..., 1], out[..., 0]), inter

        # Step i + 1's K/V: r's own rows out to dst (the rows dst's step receives), src's in.
        out_s, out_inter = transfer(sk[1:], table.dst[1:])
        in_s, in_inter = transfer(ck[1:], table.src[1:])
        x_next[:-1] = torch.maximum(out_s, in_s)
        crosses = bool(((out_inter & (out_s > 0)) | (in_inter & (in_s > 0))).any())
    # Step i's gradients go back the way its K/V came, the same bytes over the same links (dK/dV
    # of the received rows to src, this rank's own arriving from dst): step i - 1's x_next.
    grad_prev = torch.cat([torch.zeros((2, R, U), dtype=torch.float64), x_next[:-2]])[:R]
    x_f = x_next.amax((1, 2)).tolist()
    x_b = (x_next + grad_prev).amax((1, 2)).tolist()
    last = float(x_next[-2].max()) if R > 1 else 0.0
    return comp_f_s, comp_b_s, kernels, x_f, x_b, last, crosses


def predict(
    shape: Shape, ring_size: int, ulysses_size: int, ranks_per_node: int, cost: CostModel, ring_comm: str = "p2p",
    keep_head_shards: bool = False, *, memory: bool = True,
) -> Candidate:
    """The :class:`Candidate` of ``R x U`` with K/V transport ``ring_comm`` for ``shape`` (Note
    [Planner prediction]); trusted inputs (``seqpar.planner.plan`` validates them). ``memory=False``
    leaves the peak out (``memory_bytes`` 0): a head group's time, whose peak is the call's."""
    R, U = ring_size, ulysses_size
    keep = keep_head_shards and U > 1
    N = R * U
    S, H, Hkv, D, B, e = (
        shape.seq_len, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.batch, shape.element_size,
    )
    placement = Placement.dense(S, R, U)
    heads = list(cached_head_assignments(H, Hkv, U))
    h = [a.q_len for a in heads]
    kvh = [a.kernel_kv_heads for a in heads]  # K/V heads the ring moves (expanded)

    # 1. Ulysses: four phases of all-to-alls. The backward sends q, k, v, out and dout one
    # collective each (one staging copy alive at a time: Note [Ulysses memory]), so that phase
    # pays five latencies; where a collective's latency is large (gloo: ~10 ms) they decide short
    # sequences.
    a2a_s = 0.0
    a2a_bytes = [0] * N
    a2a_inter = False
    if U > 1:
        backward_to_heads = (1, 0, True, 1) if keep else (3, 2, True, 5)  # dout only, or q, k, v, out, dout
        for q_mult, kv_mult, to_heads, calls in ((1, 2, True, 1), (1, 0, False, 1), backward_to_heads, (1, 2, False, 1)):
            t, sent, crosses = _a2a_phase(placement, heads, q_mult, kv_mult, to_heads, shape, ranks_per_node, cost,
                                          calls)
            a2a_s += t
            a2a_inter = a2a_inter or crosses
            a2a_bytes = [x + y for x, y in zip(a2a_bytes, sent)]

    # 2-4. The ring: per step, compute and transfers of every cp rank.
    table = _ring_table(S, R, shape.mask)
    acc = 4 if e <= 4 else e  # accumulator element size (fp32; fp64 stays fp64)
    allgather = ring_comm == "allgather" and R > 1
    serial = ring_comm == "p2p_serial" and R > 1  # every transfer exposed (Note [Serial ring])
    overlap = 0.0 if serial else cost.overlap
    width = table.width if allgather else 0
    x_gather = [0.0] * U  # all-gather: one collective of R - 1 parts of `width` rows (ring algorithm)
    ring_inter = False
    for u in range(U) if allgather else ():
        # Ranks u, U + u, ... of the ring group are consecutive-node ordered: it crosses nodes
        # when its first and last rank do.
        inter = u // ranks_per_node != ((R - 1) * U + u) // ranks_per_node
        if h[u] and width:
            link = cost.ring_inter if inter else cost.ring_intra
            x_gather[u] = link.seconds((R - 1) * kv_bytes(width, kvh[u], D, B, e), R - 1)
            ring_inter = ring_inter or inter
    comp_f, comp_b, kernels, x_next, x_both, last, crosses = _steps(
        table, shape, U, h, kvh, acc, ranks_per_node, cost, transfers=not allgather)
    ring_inter = ring_inter or crosses
    fwd_total = bwd_total = 0.0
    kernel_total = elem_total = exposed_total = 0.0
    for i in range(R):
        c_f, c_b = comp_f[i], comp_b[i]
        kernel_total += kernels[i]
        elem_total += c_f + c_b - kernels[i]
        x_f, x_b = x_next[i], x_both[i]
        fixed = cost.ring_step_s if R > 1 else 0.0  # a lone local step waits for no peer
        if allgather:  # the gather overlaps step 0 only; later steps wait for nothing
            x_f = x_b = max(x_gather) if i == 0 else 0.0
            fixed = cost.ring_step_s if i == 0 else 0.0
        step_f = _overlapped(c_f, x_f, overlap) + fixed
        step_b = _overlapped(c_b, x_b, overlap) + fixed
        fwd_total += step_f
        bwd_total += step_b
        exposed_total += step_f - c_f + step_b - c_b
    # the last step's gradients travel with nothing left to hide them
    if allgather:  # the reduce-scatter of dK/dV (the gather's bytes) hides behind nothing
        last = max(x_gather) + cost.ring_step_s
    bwd_total += last
    exposed_total += last

    # attention_work(placement, mask, num_heads=H) and the ring bytes sent per cp rank: K/V
    # forward, again backward, and dK/dV back (rank_cost, Note [Plan cost]).
    pairs, sent_rows, recv_rows = table.pairs, table.sent_rows, table.recv_rows_total
    work = [pairs[r] * h[u] for r in range(R) for u in range(U)]
    ring_bytes = [
        2 * kv_bytes(sent_rows[r], kvh[u] if h[u] else 0, D, B, e) + kv_bytes(recv_rows[r], kvh[u] if h[u] else 0, D, B, e)
        for r in range(R) for u in range(U)
    ]
    if allgather:  # forward gather, backward gather and reduce-scatter: R - 1 parts each
        ring_bytes = [3 * (R - 1) * kv_bytes(width, kvh[u], D, B, e) if h[u] else 0 for r in range(R) for u in range(U)]
    return Candidate(
        ring_size=R,
        ulysses_size=U,
        time_s=a2a_s + fwd_total + bwd_total,
        parts={
            "all-to-all": a2a_s,
            "ring transfer": exposed_total,
            "kernels": kernel_total,
            "element-wise": max(0.0, elem_total),
        },
        ulysses_bytes=max(a2a_bytes),
        ring_bytes=max(ring_bytes),
        memory_bytes=_memory(shape, placement, table, heads, acc, width if allgather else None, keep, serial,
                             cost.device != "cpu") if memory else 0,
        imbalance=imbalance(work),
        heads=tuple(h),
        kv_heads=tuple(a.kv_len for a in heads),
        kv_replication=sum(a.kv_len for a in heads) / Hkv,
        ulysses_link="none" if U == 1 else ("inter" if a2a_inter else "intra"),
        ring_link="none" if R == 1 else ("inter" if ring_inter else "intra"),
        ring_comm="allgather" if allgather else "p2p_serial" if serial else "p2p",
        keep_head_shards=keep,
    )


def group_counts(num_heads: int, ulysses_size: int) -> tuple[int, ...]:
    """The head-group counts the planner predicts: 1, 2, 4, ... up to ``H / U`` (a group of fewer
    query heads than Ulysses ranks leaves ranks without work, Note [Head groups])."""
    counts, g = [], 1
    while g <= max(1, num_heads // ulysses_size):
        counts.append(g)
        g *= 2
    return tuple(counts)


def predict_head_groups(
    shape: Shape, candidate: Candidate, ranks_per_node: int, cost: CostModel, counts: tuple[int, ...] | None = None,
) -> tuple[GroupPrediction, ...]:
    """``candidate``'s split run with each of ``counts`` head groups (default :func:`group_counts`),
    Note [Planner head groups]; ``candidate`` is :func:`predict`'s for ``shape`` (one group)."""
    R, U, comm, keep = candidate.ring_size, candidate.ulysses_size, candidate.ring_comm, candidate.keep_head_shards
    H, Hkv, D, B, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.batch, shape.element_size
    placement = Placement.dense(shape.seq_len, R, U)
    table = _ring_table(shape.seq_len, R, shape.mask)
    acc = 4 if e <= 4 else e
    width = table.width if comm == "allgather" and R > 1 else None
    # the output written group by group, the gradients joined: element-wise passes over the shard
    joins = max(placement.shard_lengths) * (4 * H + 6 * Hkv) * D * B * e / cost.memory_bandwidth
    times: dict[tuple[int, int], float] = {}
    out = []
    for G in group_counts(H, U) if counts is None else counts:
        if G == 1:
            out.append(GroupPrediction(1, candidate.time_s, candidate.memory_bytes))
            continue
        groups = []
        for size, n_kv, expanded in group_shapes(H, Hkv, G):
            if (size, n_kv) not in times:
                sub = replace(shape, num_heads=size, num_kv_heads=n_kv)
                times[size, n_kv] = predict(sub, R, U, ranks_per_node, cost, comm, keep, memory=False).time_s
            groups.append((size, n_kv, expanded, cached_head_assignments(size, n_kv, U)))
        memory = _memory(shape, placement, table, list(cached_head_assignments(H, Hkv, U)), acc, width, keep,
                         comm == "p2p_serial" and R > 1, cost.device != "cpu", groups)
        out.append(GroupPrediction(G, sum(times[g[0], g[1]] for g in groups) + joins, memory))
    return tuple(out)


def _memory(
    shape: Shape, placement: Placement, table: _RingTable, heads: list[HeadAssignment], acc: int,
    gather_width: int | None = None, keep_head_shards: bool = False, serial: bool = False, expands: bool = False,
    groups: list[tuple[int, int, bool, tuple[HeadAssignment, ...]]] | None = None,
) -> int:
    """Peak bytes of one rank during the layer's backward (Note [Planner prediction]).

    Held throughout: the shards of q, k, v, out, dout (``keep_head_shards``: out and dout) and
    the log-sum-exps. Then the largest of three moments: the exchange to heads (the head-sharded
    q, k, v, out, dout and the staging copy of the one tensor in flight), the ring backward (the
    head-sharded inputs and :func:`_ring_peak`), and the way back (the head-sharded gradients,
    the staging of one of them, and the shard's dq, dk, dv). ``gather_width``: the all-gather
    transport's slot rows (Note [All-gather K/V]), whose buffers replace the ring's step buffers;
    ``serial``: the ring without overlap (Note [Serial ring]); ``expands``: the device's kernels
    expand K/V heads in the backward (every CUDA backend, ``KernelBackend.backward_expands_kv_heads``).
    ``groups``: the call's head groups (Note [Planner head groups]), each ``(query heads, K/V
    heads, expanded, head assignments)``; None: one group of all heads (``heads``).
    """
    R, U = placement.ring_size, placement.ulysses_size
    H, Hkv, D, B, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.batch, shape.element_size
    unit = D * B
    if groups is None:
        groups = [(H, Hkv, False, tuple(heads))]
    peaks: dict[tuple[int, int, int], list[int]] = {}  # (h, kv, own heads) -> the ring's peak per ring rank
    worst = 0
    for u in range(U):
        lse_heads = sum(g[3][u].q_len for g in groups)  # every group's LSEs are saved for its backward
        done = 0  # heads (query + 2 K/V) of the groups whose token-shard gradients are kept, waiting to join
        seen = set()  # (group shape, L, shard, ring peak): ranks and groups that hold the same
        for size, n_kv, expanded, group_heads in groups:
            a = group_heads[u]
            h, kv = a.q_len, a.kernel_kv_heads
            # the ring frees the K/V the kernels read once sent (Note [Own K/V released]): the
            # received head shards, or their copies expanded to the kernel's heads (the kept
            # head shards themselves stay with the forward's saved tensors)
            own_heads = 0
            if U > 1 and h:
                own_heads = kv if a.kv_index is not None else (0 if keep_head_shards else a.kv_len)
            if h and (h, kv, own_heads) not in peaks:
                peaks[h, kv, own_heads] = _ring_peaks(table, h, kv, own_heads, unit, B, e, acc, gather_width, serial,
                                                      expands)
            # the other groups' head shards, saved for their backward with keep_head_shards
            kept = sum(2 * o[3][u].q_len + 2 * o[3][u].kv_len for o in groups) - 2 * h - 2 * a.kv_len \
                if keep_head_shards and len(groups) > 1 else 0
            for r in range(R):
                L = table.lengths[r]
                local = placement.shard_lengths[r * U + u]
                ring = peaks[h, kv, own_heads][r] if h else 0
                if (size, n_kv, expanded, done, L, local, ring) in seen:
                    continue
                seen.add((size, n_kv, expanded, done, L, local, ring))
                held = local * (2 * H if keep_head_shards else 3 * H + 2 * Hkv) * unit * e
                held += B * L * lse_heads * 4  # the forward's log-sum-exps (fp32), this rank's heads
                held += (local * done + L * kept) * unit * e
                if expanded:  # the group's K and V picked per query head (copies)
                    held += 2 * local * size * unit * e
                grads = local * (size + 2 * n_kv) * unit * e  # dq, dk, dv of the shard (the group's heads)
                if U > 1:
                    inputs = L * (3 * h + 2 * a.kv_len) * unit * e  # q, k, v, out, dout of its heads
                    at_kernel = inputs
                    if a.kv_index is not None:  # K/V expanded to the kernel's heads; the received
                        # ones die then unless the forward kept them (Note [Ulysses memory])
                        at_kernel += 2 * L * (kv - (0 if keep_head_shards else a.kv_len)) * unit * e
                    at_kernel -= 2 * L * own_heads * unit * e
                    moments = (
                        inputs + local * size * unit * e,  # their exchange: one staging copy at a time
                        at_kernel + ring,
                        L * (h + 2 * a.kv_len + max(h, a.kv_len)) * unit * e + grads,  # dq, dk, dv back
                    )
                else:
                    moments = (ring, grads)
                worst = max(worst, held + max(moments))
            done += size + 2 * n_kv
        if len(groups) > 1:  # the groups' gradients joined: dq's copy next to every group's share
            kept = sum(2 * g[3][u].q_len + 2 * g[3][u].kv_len for g in groups) if keep_head_shards else 0
            for r in range(R):
                L, local = table.lengths[r], placement.shard_lengths[r * U + u]
                held = local * (2 * H if keep_head_shards else 3 * H + 2 * Hkv) * unit * e
                held += B * L * lse_heads * 4 + L * kept * unit * e
                worst = max(worst, held + local * (done + H) * unit * e)
    return worst


def _results(call, h: int, kv: int, unit: int, e: int) -> int:
    """Bytes of one block call's dq, dk, dv (``h`` query and ``kv`` K/V heads, ``unit`` elements a row)."""
    return ((call.q1 - call.q0) * h + 2 * (call.k1 - call.k0) * kv) * unit * e


def _sent_whole(step: Step, remote: bool, h: int, kv: int, expands: bool) -> bool:
    """A remote step whose one kernel call's results are sent as they are."""
    return remote and sent_as_computed(step.calls, step.kv_len, expanded=expands and h > kv)


def _kernel_out(step: Step, remote: bool, h: int, kv: int, unit: int, e: int, expands: bool) -> int:
    """The largest call's dq, dk, dv (remote steps' wide blocks cut in two)."""
    calls = step.calls if not remote or _sent_whole(step, remote, h, kv, expands) else split_wide_blocks(step.calls)
    return max((_results(c, h, kv, unit, e) for c in calls), default=0)


def _send_slot(step: Step, remote: bool, h: int, kv: int, unit: int, e: int, acc: int, expands: bool) -> int:
    """A remote step's send slot for dK/dV when its results are not sent as they are."""
    if not remote or _sent_whole(step, remote, h, kv, expands):
        return 0
    slot = 2 * step.kv_len * kv * unit * e
    if e != acc and sums_keys(split_wide_blocks(step.calls)):
        slot += 2 * step.kv_len * kv * unit * acc  # summed in fp32 first
    return slot


def _first_kernel(step: Step, L: int, h: int, kv: int, unit: int, e: int, acc: int, expands: bool) -> int:
    """Step 0's accumulators and kernel results at its kernels."""
    accumulators = L * (h + 2 * kv) * unit * acc
    out = _kernel_out(step, False, h, kv, unit, e, expands)
    if is_single_block(step.calls[:1], L, step.kv_len):
        # The first result that covers every row becomes the accumulators (a copy in a wider
        # accumulator dtype); the step's later calls add into them.
        later = max((_results(c, h, kv, unit, e) for c in step.calls[1:]), default=0)
        return max(out + (accumulators if e != acc else 0), accumulators + later if later else 0)
    return accumulators + out


def _staged_rows(send_rows: tuple[tuple[int, int], ...], L: int, batch: int) -> bool:
    """Whether the K/V rows a step sends are copied out (not one contiguous view)."""
    return bool(send_rows) and not (len(send_rows) == 1 and (batch == 1 or send_rows[0] == (0, L)))


def _ring_peak(plan: RingPlan, h: int, kv: int, unit: int, batch: int, e: int, acc: int,
               gather_width: int | None, serial: bool = False, own: int = 0, expands: bool = False) -> int:
    """Peak bytes of the ring backward's own buffers on one rank (``h`` query and ``kv`` K/V heads
    of ``unit = D * batch`` elements per row), step by step as ``ring_backward`` runs
    (Notes [Ring schedule], [Gradients sent as computed], [Step buffers released]): the fp32
    dq, dk, dv accumulators (a single-block call has none: its kernel's results are the
    gradients; the first result of step 0 that covers every row becomes them), at each kernel
    the step's K/V, the next step's arriving (and their staging when not contiguous), the
    previous step's dK/dV in flight both ways, the kernel's results and the step's send slot
    when its results are not sent as they are; after it, the step's dK/dV sent and this rank's
    arriving. ``serial`` (Note [Serial ring]): no next step's K/V and no previous
    step's dK/dV, but the step's own K/V arriving next to the staging of the rows it sends.
    ``own``: bytes of this rank's K/V handed to the ring (Note [Own K/V released]), alive until
    the last step's K/V have arrived (all-gather and single-step calls: throughout). ``expands``:
    the kernels' backward expands K/V heads (``KernelBackend.backward_expands_kv_heads``), so with
    ``h > kv`` a remote step's wide block runs as two key halves into a send slot.

    :func:`_ring_peaks` has the same terms for every rank of a ring at once; this one is for a
    plan of one step (``R == 1``)."""
    L, steps = plan.q_len, plan.steps
    kernel_out = [_kernel_out(s, i > 0, h, kv, unit, e, expands) for i, s in enumerate(steps)]
    if len(steps) == 1 and is_single_block(steps[0].calls, L, L):
        return own + L * (h + 2 * kv) * unit * e
    accumulators = L * (h + 2 * kv) * unit * acc
    if len(steps) == 1:
        return own + accumulators + kernel_out[0]
    if gather_width is not None:
        R = len(steps)
        rows = (R + 1) * gather_width  # R slots and the own part
        max_recv = plan.max_recv
        return (own + accumulators + max(kernel_out) + 2 * rows * kv * unit * e  # gathered K/V
                + 2 * rows * kv * unit * e  # dK/dV slots and the summed own slot
                + 2 * max_recv * kv * unit * (e + acc))  # a step's rows copied out, summed in fp32

    def kv_rows(rows: int) -> int:  # K and V (or dK and dV) of ``rows`` rows
        return 2 * rows * kv * unit * e

    def sent_rows(step) -> int:
        return sum(b - a for a, b in step.send_rows)

    def staged(step) -> int:  # the K/V rows a step sends, copied out unless they are one contiguous view
        return kv_rows(sent_rows(step)) if _staged_rows(step.send_rows, L, batch) else 0

    peak = 0
    for i, step in enumerate(steps):
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        if serial:  # nothing of another step: this one's K/V arrive while its own rows are sent
            ahead = prev = 0
            if i and step.recv_rows:
                peak = max(peak, own + accumulators + kv_rows(step.kv_len) + staged(step))
        else:
            ahead = (kv_rows(nxt.kv_len) if nxt.recv_rows else 0) + staged(nxt) if nxt else 0
            prev = kv_rows(steps[i - 1].kv_len) + kv_rows(sent_rows(steps[i - 1])) if i >= 2 else 0
        here = kv_rows(step.kv_len) if i else 0
        slot = _send_slot(step, i > 0, h, kv, unit, e, acc, expands)
        at_kernel = accumulators + kernel_out[i] if i else _first_kernel(step, L, h, kv, unit, e, acc, expands)
        mine = own if i < len(steps) - 1 else 0  # freed once the last step's K/V have arrived
        peak = max(peak, mine + at_kernel + here + ahead + prev + slot)
        if i:  # after its kernels: the step's K/V freed, its dK/dV sent, this rank's arriving
            peak = max(peak, mine + accumulators + ahead + prev + kv_rows(step.kv_len) + kv_rows(sent_rows(step)))
    return peak


def _ring_peaks(table: _RingTable, h: int, kv: int, own_heads: int, unit: int, batch: int, e: int, acc: int,
                gather_width: int | None, serial: bool, expands: bool) -> list[int]:
    """:func:`_ring_peak` of every ring rank, ``own = 2 * L * own_heads * unit * e``: its terms per
    geometry, gathered per (step, rank), the largest per rank (Note [Planner by shard geometry])."""
    R = len(table.lengths)
    if R == 1:
        L = table.lengths[0]
        plan = RingPlan(1, 0, L, table.lengths, table.steps)
        return [_ring_peak(plan, h, kv, unit, batch, e, acc, gather_width, serial, 2 * L * own_heads * unit * e, expands)]
    ck, sk = table.compute, table.send
    L = torch.tensor(table.lengths)
    own = 2 * L * own_heads * unit * e
    accumulators = L * (h + 2 * kv) * unit * acc

    def kv_rows(rows: int) -> int:  # K and V (or dK and dV) of ``rows`` rows
        return 2 * rows * kv * unit * e

    def column(values) -> Tensor:  # per geometry, and 0 for nothing
        return torch.tensor([*values, 0], dtype=torch.long)

    geometries = list(zip(table.steps, table.remote, table.q_len))
    kernel_out = [_kernel_out(s, m, h, kv, unit, e, expands) for s, m, _ in geometries]
    if gather_width is not None:
        rows = (R + 1) * gather_width  # R slots and the own part
        max_recv = _gather(column([s.kv_len if m and s.recv_rows else 0 for s, m, _ in geometries]), ck).amax(0)
        return (own + accumulators + _gather(column(kernel_out), ck).amax(0) + 2 * rows * kv * unit * e  # gathered K/V
                + 2 * rows * kv * unit * e  # dK/dV slots and the summed own slot
                + 2 * max_recv * kv * unit * (e + acc)).tolist()  # a step's rows copied out, summed in fp32
    acc_g = [n * (h + 2 * kv) * unit * acc for _, _, n in geometries]
    # At its kernels: the accumulators and results (step 0: _first_kernel), the step's K/V, its send slot.
    at_kernel = _gather(column([
        a + out + kv_rows(s.kv_len) + _send_slot(s, m, h, kv, unit, e, acc, expands) if m
        else _first_kernel(s, n, h, kv, unit, e, acc, expands)
        for (s, m, n), a, out in zip(geometries, acc_g, kernel_out)
    ]), ck)
    after = _gather(column([a + kv_rows(s.kv_len) if m else 0 for (s, m, _), a in zip(geometries, acc_g)]), ck)
    sent = _gather(column([kv_rows(int(n)) for n in table.recv_rows[:-1]]), sk)  # r's rows out: dst's received
    stage = table.staged_one if batch == 1 else table.staged_any
    staged = _gather(column([kv_rows(int(n)) if f else 0 for n, f in zip(table.recv_rows[:-1], stage)]), sk)
    # after its kernels: the step's K/V freed, its dK/dV sent, this rank's arriving (step > 0)
    here = torch.maximum(at_kernel, after + sent)
    if serial:  # nothing of another step: this one's K/V arrive while its own rows are sent
        alone = _gather(table.received, ck) * (own + after + staged)  # steps that receive rows
        extra = torch.zeros_like(here)
    else:  # the next step's K/V arriving (and staged), the previous step's dK/dV both ways
        alone = torch.zeros_like(here)
        ahead = _gather(column([kv_rows(s.kv_len) if s.recv_rows else 0 for s, _, _ in geometries]), ck) + staged
        prev = _gather(column([kv_rows(s.kv_len) for s, _, _ in geometries]), ck) + sent
        zero = torch.zeros((1, R), dtype=torch.long)
        extra = torch.cat([ahead[1:], zero]) + torch.cat([zero, zero, prev[1:-1]])
    terms = here + extra
    # own K/V held until the last step's have arrived
    peak = torch.maximum((terms[:-1].amax(0) + own), terms[-1]) if R > 1 else terms[-1]
    return torch.maximum(peak, alone.amax(0)).clamp(min=0).tolist()
