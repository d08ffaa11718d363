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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..placement import Mask, Placement, imbalance, ring_plan
from ..placement.cost import StepWork, kernel_flops, kv_bytes, rank_cost, ring_work
from ..placement.gather import gather_plan
from ..placement.heads import HeadAssignment, head_assignments
from ..placement.ring import RingPlan, is_single_block, sent_as_computed, split_wide_blocks, sums_keys
from .cost import CostModel, Link

__all__ = ["Shape", "Candidate", "predict"]


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


@functools.lru_cache(maxsize=32)
def _ring_plans(seq_len: int, ring_size: int, mask: Mask) -> tuple[RingPlan, ...]:
    """Every ring rank's plan of a dense sequence (independent of ``U``: the Ulysses split comes
    after the ring placement). ``R`` plans of ``R`` steps: the planner's main cost."""
    placement = Placement.dense(seq_len, ring_size, 1)
    return tuple(ring_plan(placement, r, mask, varlen=False) for r in range(ring_size))


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


def _combine(per_rank: list[float], nodes: list[int], cost: CostModel) -> float:
    """Duration of a phase in which rank ``c`` computes ``per_rank[c]`` seconds on node ``nodes[c]``."""
    slowest = max(per_rank, default=0.0)
    if cost.compute_capacity is None:
        return slowest
    load: dict[int, float] = {}
    for t, n in zip(per_rank, nodes):
        load[n] = load.get(n, 0.0) + t
    return max(slowest, max(load.values(), default=0.0) / cost.compute_capacity)


def _overlapped(compute: float, transfer: float, overlap: float) -> float:
    return compute + transfer - overlap * min(compute, transfer)


def _a2a_phase(
    placement: Placement, heads: list[HeadAssignment], q_mult: int, kv_mult: int, to_heads: bool,
    shape: Shape, ranks_per_node: int, cost: CostModel,
) -> tuple[float, list[int], bool]:
    """``(seconds, bytes sent per cp rank, crosses nodes)`` of one fused all-to-all per ring rank.

    ``to_heads``: token shards -> head shards (rank ``i`` sends rank ``j`` its tokens of ``j``'s
    heads); else the reverse. Each tensor counts ``q_mult`` query-head and ``kv_mult`` K/V-head
    tensors.
    """
    R, U = placement.ring_size, placement.ulysses_size
    row = shape.head_dim * shape.element_size * shape.batch
    width = [q_mult * a.q_len + kv_mult * a.kv_len for a in heads]
    sent = [0] * (R * U)
    seconds = 0.0
    crosses = False
    for r in range(R):
        sizes = placement.ulysses_sizes(r)
        # bytes[i][j]: from Ulysses rank i to j.
        if to_heads:
            moved = [[sizes[i] * width[j] * row for j in range(U)] for i in range(U)]
        else:
            moved = [[sizes[j] * width[i] * row for j in range(U)] for i in range(U)]
        for i in range(U):
            c = r * U + i
            out = {"intra": 0, "inter": 0}
            inn = {"intra": 0, "inter": 0}
            peers = {"intra": 0, "inter": 0}
            for j in range(U):
                if j == i:
                    continue
                link = "intra" if c // ranks_per_node == (r * U + j) // ranks_per_node else "inter"
                out[link] += moved[i][j]
                inn[link] += moved[j][i]
                peers[link] += 1
            sent[c] = out["intra"] + out["inter"]
            crosses = crosses or peers["inter"] > 0
            t = max(
                cost.ulysses_intra.seconds(max(out["intra"], inn["intra"])),
                cost.ulysses_inter.seconds(max(out["inter"], inn["inter"])),
            )
            seconds = max(seconds, t)
    return seconds, sent, crosses


def _link(cost_intra: Link, cost_inter: Link, a: int, b: int, ranks_per_node: int) -> tuple[Link, bool]:
    inter = a // ranks_per_node != b // ranks_per_node
    return (cost_inter if inter else cost_intra), inter


def predict(
    shape: Shape, ring_size: int, ulysses_size: int, ranks_per_node: int, cost: CostModel, ring_comm: str = "p2p",
    keep_head_shards: bool = False,
) -> Candidate:
    """The :class:`Candidate` of ``R x U`` with K/V transport ``ring_comm`` for ``shape`` (Note
    [Planner prediction]); trusted inputs (``seqpar.planner.plan`` validates them)."""
    R, U = ring_size, ulysses_size
    keep = keep_head_shards and U > 1
    N = R * U
    S, H, Hkv, D, B, e = (
        shape.seq_len, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.batch, shape.element_size,
    )
    placement = Placement.dense(S, R, U)
    mask = shape.mask
    heads = head_assignments(H, Hkv, U)
    h = [a.q_len for a in heads]
    kvh = [a.kernel_kv_heads for a in heads]  # K/V heads the ring moves (expanded)
    nodes = [c // ranks_per_node for c in range(N)]

    # 1. Ulysses: four all-to-alls.
    a2a_s = 0.0
    a2a_bytes = [0] * N
    a2a_inter = False
    if U > 1:
        backward_to_heads = (1, 0, True) if keep else (3, 2, True)  # dout only, or q, k, v, out, dout
        for q_mult, kv_mult, to_heads in ((1, 2, True), (1, 0, False), backward_to_heads, (1, 2, False)):
            t, sent, crosses = _a2a_phase(placement, heads, q_mult, kv_mult, to_heads, shape, ranks_per_node, cost)
            a2a_s += t
            a2a_inter = a2a_inter or crosses
            a2a_bytes = [x + y for x, y in zip(a2a_bytes, sent)]

    # 2-4. The ring: per step, compute and transfers of every cp rank.
    plans = _ring_plans(S, R, mask)
    rings = [ring_work(plan) for plan in plans]  # per step: pairs, blocks, rows (Note [Plan cost])
    acc = 4 if e <= 4 else e  # accumulator element size (fp32; fp64 stays fp64)
    ring_inter = False
    fwd_total = bwd_total = 0.0
    kernel_total = elem_total = exposed_total = 0.0
    grad_prev = [0.0] * N  # backward: the previous step's gradient transfer, per rank
    allgather = ring_comm == "allgather" and R > 1
    serial = ring_comm == "p2p_serial" and R > 1  # every transfer exposed (Note [Serial ring])
    overlap = 0.0 if serial else cost.overlap
    width = gather_plan(plans, 0).width if allgather else 0
    x_gather = [0.0] * N  # all-gather: one collective of R - 1 parts of `width` rows (ring algorithm)
    for c in range(N) if allgather else ():
        r, u = divmod(c, U)
        inter = any((j * U + u) // ranks_per_node != c // ranks_per_node for j in range(R))
        if h[u] and width:
            link = cost.ring_inter if inter else cost.ring_intra
            x_gather[c] = link.seconds((R - 1) * kv_bytes(width, kvh[u], D, B, e), R - 1)
            ring_inter = ring_inter or inter
    for i in range(R):
        comp_f, comp_b, kern_f, kern_b, elem_f, elem_b = ([0.0] * N for _ in range(6))
        x_next = [0.0] * N  # K/V of step i + 1 in flight during step i
        x_grad = [0.0] * N  # gradients of step i (sent after its compute)
        for r in range(R):
            w = rings[r].steps[i]
            for u in range(U):
                c = r * U + u
                if h[u] == 0:
                    continue
                kern_f[c] = _kernel_seconds(w, h[u], B, D, cost, backward=False)
                kern_b[c] = _kernel_seconds(w, h[u], B, D, cost, backward=True)
                # Forward: every result merged into the fp32 accumulators (read, write, block, lse).
                merged = w.q_rows * h[u] * D * B * (3 * acc + e)
                if i == R - 1:
                    merged += plans[r].q_len * h[u] * D * B * (acc + e)  # final cast
                elem_f[c] = merged / cost.memory_bandwidth
                # Backward: dq added, dK/dV summed (step 0) or copied out, received grads added.
                grads = w.q_rows * h[u] * D * B * (2 * acc + e)
                grads += w.k_rows * kvh[u] * D * B * 2 * (2 * acc + e)
                grads += w.send_rows * kvh[u] * D * B * 2 * (2 * acc + e)
                if i == R - 1:
                    grads += plans[r].q_len * (h[u] + 2 * kvh[u]) * D * B * (acc + e)
                elem_b[c] = grads / cost.memory_bandwidth
                comp_f[c] = kern_f[c] + elem_f[c]
                comp_b[c] = kern_b[c] + elem_b[c]
                if i + 1 < R and not allgather:
                    nxt = rings[r].steps[i + 1]
                    step = plans[r].steps[i + 1]
                    out_link, out_inter = _link(cost.ring_intra, cost.ring_inter, c, step.dst * U + u, ranks_per_node)
                    in_link, in_inter = _link(cost.ring_intra, cost.ring_inter, c, step.src * U + u, ranks_per_node)
                    send, recv = kv_bytes(nxt.send_rows, kvh[u], D, B, e), kv_bytes(nxt.recv_rows, kvh[u], D, B, e)
                    x_next[c] = max(out_link.seconds(send, 2), in_link.seconds(recv, 2))
                    ring_inter = ring_inter or (send and out_inter) or (recv and in_inter)
                if i > 0 and not allgather:
                    step = plans[r].steps[i]
                    back_link, _ = _link(cost.ring_intra, cost.ring_inter, c, step.src * U + u, ranks_per_node)
                    home_link, _ = _link(cost.ring_intra, cost.ring_inter, c, step.dst * U + u, ranks_per_node)
                    send, recv = kv_bytes(w.recv_rows, kvh[u], D, B, e), kv_bytes(w.send_rows, kvh[u], D, B, e)
                    x_grad[c] = max(back_link.seconds(send, 2), home_link.seconds(recv, 2))
        c_f, c_b = _combine(comp_f, nodes, cost), _combine(comp_b, nodes, cost)
        kernels = _combine(kern_f, nodes, cost) + _combine(kern_b, nodes, cost)
        kernel_total += kernels
        elem_total += c_f + c_b - kernels
        x_f = max(x_next)
        x_b = max(a + b for a, b in zip(x_next, grad_prev))
        fixed = cost.ring_step_s if R > 1 else 0.0  # a lone local step waits for no peer
        if allgather:  # the gather overlaps step 0 only; later steps wait for nothing
            x_f = x_b = max(x_gather) if i == 0 else 0.0
            fixed = cost.ring_step_s if i == 0 else 0.0
        step_f = _overlapped(c_f, x_f, overlap) + fixed
        step_b = _overlapped(c_b, x_b, overlap) + fixed
        fwd_total += step_f
        bwd_total += step_b
        exposed_total += step_f - c_f + step_b - c_b
        grad_prev = x_grad
    last = max(grad_prev)  # the last step's gradients travel with nothing left to hide them
    if allgather:  # the reduce-scatter of dK/dV (the gather's bytes) hides behind nothing
        last = max(x_gather) + cost.ring_step_s
    bwd_total += last
    exposed_total += last

    # attention_work(placement, mask, num_heads=H), from the plans already built.
    work = [rings[r].pairs * h[u] for r in range(R) for u in range(U)]
    # Ring bytes sent per cp rank: K/V forward, again backward, and dK/dV back (Note [Plan cost]).
    ring_bytes = [rank_cost(rings[r], heads[u], head_dim=D, batch=B, element_size=e).ring_bytes
                  for r in range(R) for u in range(U)]
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
        memory_bytes=_memory(shape, placement, plans, heads, acc, width if allgather else None, keep, serial,
                             cost.device != "cpu"),
        imbalance=imbalance(work),
        heads=tuple(h),
        kv_heads=tuple(a.kv_len for a in heads),
        kv_replication=sum(a.kv_len for a in heads) / Hkv,
        ulysses_link="none" if U == 1 else ("inter" if a2a_inter else "intra"),
        ring_link="none" if R == 1 else ("inter" if ring_inter else "intra"),
        ring_comm="allgather" if allgather else "p2p_serial" if serial else "p2p",
        keep_head_shards=keep,
    )


def _memory(
    shape: Shape, placement: Placement, plans: tuple[RingPlan, ...], heads: list[HeadAssignment], acc: int,
    gather_width: int | None = None, keep_head_shards: bool = False, serial: bool = False, expands: bool = False,
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
    """
    R, U = placement.ring_size, placement.ulysses_size
    H, Hkv, D, B, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.batch, shape.element_size
    unit = D * B
    worst = 0
    for r in range(R):
        plan = plans[r]
        L = plan.q_len
        for u in range(U):
            a = heads[u]
            local = placement.shard_lengths[r * U + u]
            h, kv = a.q_len, a.kernel_kv_heads
            held = local * (2 * H if keep_head_shards else 3 * H + 2 * Hkv) * unit * e
            held += B * L * h * 4  # the forward's log-sum-exps (fp32), this rank's heads
            grads = local * (H + 2 * Hkv) * unit * e  # dq, dk, dv of the shard
            if U > 1:
                inputs = L * (3 * h + 2 * a.kv_len) * unit * e  # q, k, v, out, dout of its heads
                at_kernel = inputs
                if a.kv_index is not None:  # K/V expanded to the kernel's heads; the received
                    # ones die then unless the forward kept them (Note [Ulysses memory])
                    at_kernel += 2 * L * (kv - (0 if keep_head_shards else a.kv_len)) * unit * e
                own = 0
                if h and not keep_head_shards:  # the ring frees the K/V the kernels read once sent
                    own = 2 * L * (a.kv_len if a.kv_index is None else kv) * unit * e  # (Note [Own K/V released])
                    at_kernel -= own
                ring = _ring_peak(plan, h, kv, unit, B, e, acc, gather_width, serial, own, expands) if h else 0
                moments = (
                    inputs + local * H * unit * e,  # their exchange: one staging copy at a time
                    at_kernel + ring,
                    L * (h + 2 * a.kv_len + max(h, a.kv_len)) * unit * e + grads,  # dq, dk, dv back
                )
            else:
                moments = (_ring_peak(plan, h, kv, unit, B, e, acc, gather_width, serial, 0, expands) if h else 0,
                           grads)
            worst = max(worst, held + max(moments))
    return worst


def _results(call, h: int, kv: int, unit: int, e: int) -> int:
    """Bytes of one block call's dq, dk, dv (``h`` query and ``kv`` K/V heads, ``unit`` elements a row)."""
    return ((call.q1 - call.q0) * h + 2 * (call.k1 - call.k0) * kv) * unit * e


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
    ``h > kv`` a remote step's wide block runs as two key halves into a send slot."""
    L, steps = plan.q_len, plan.steps

    def sent_whole(i: int) -> bool:  # a remote step whose one kernel call's results are sent as they are
        return i > 0 and sent_as_computed(steps[i].calls, steps[i].kv_len, expanded=expands and h > kv)

    def kernel_results(i: int) -> int:  # the largest call's dq, dk, dv (remote steps' wide blocks cut in two)
        calls = steps[i].calls if i == 0 or sent_whole(i) else split_wide_blocks(steps[i].calls)
        return max((_results(c, h, kv, unit, e) for c in calls), default=0)

    kernel_out = [kernel_results(i) for i in range(len(steps))]
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
        rows = step.send_rows
        if not rows or (len(rows) == 1 and (batch == 1 or rows[0] == (0, L))):
            return 0
        return kv_rows(sent_rows(step))

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
        slot = 0
        if i and not sent_whole(i):
            slot = kv_rows(step.kv_len)
            if e != acc and sums_keys(split_wide_blocks(step.calls)):
                slot += 2 * step.kv_len * kv * unit * acc  # summed in fp32 first
        at_kernel = accumulators + kernel_out[i]
        if i == 0 and is_single_block(step.calls[:1], L, step.kv_len):
            # The first result that covers every row becomes the accumulators (a copy in a wider
            # accumulator dtype); the step's later calls add into them.
            later = max((_results(c, h, kv, unit, e) for c in step.calls[1:]), default=0)
            at_kernel = max(kernel_out[0] + (accumulators if e != acc else 0), accumulators + later if later else 0)
        mine = own if i < len(steps) - 1 else 0  # freed once the last step's K/V have arrived
        peak = max(peak, mine + at_kernel + here + ahead + prev + slot)
        if i:  # after its kernels: the step's K/V freed, its dK/dV sent, this rank's arriving
            peak = max(peak, mine + accumulators + ahead + prev + kv_rows(step.kv_len) + kv_rows(sent_rows(step)))
    return peak
