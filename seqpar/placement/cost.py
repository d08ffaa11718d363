"""What a ring x Ulysses plan costs: attended pairs, kernel FLOPs and ring bytes (host maths only).

Note [Plan cost]
~~~~~~~~~~~~~~~~
One attention layer of ``B`` sequences of ``S`` tokens (or one packed batch, ``B = 1``) with ``H``
query and ``Hkv`` key/value heads of dim ``D``, placed over ring ``R`` x Ulysses ``U`` ranks
(``cp_rank = ring_rank * U + ulysses_rank``). Per CP rank:

- **pairs**: the (query, key, head) triples its plan attends. Ring rank ``r``'s plan
  (``ring_plan``, Note [Ring blocks]) gives per step the blocks it computes; ``tile_pairs`` counts
  their attended (query, key) pairs per head and batch row. The CP rank multiplies the sum over
  steps by its query heads ``H_u`` (``head_assignments``: ``split_sizes(H, U)``) and by ``B``.
  These are the pairs the mask attends, not what a kernel computes: the tiles a mask edge cuts
  are computed whole (the degree planner adds that as ``extra_keys`` per query row).
- **kernel FLOPs**: forward ``4 * D`` per pair (``Q K^T`` and ``P V``, a multiply-add = 2 FLOPs),
  backward ``10 * D`` per pair, 2.5x the forward (``Q K^T`` recomputed, ``dP``, ``dS`` -> ``dQ``,
  ``dK``, ``dV``; flash-attention's convention).
- **ring bytes**: forward, the K and V rows the rank sends around the ring (``send_rows`` of every
  step) times its K/V heads as the kernel sees them (``kernel_kv_heads``; none for a rank without
  a query head, which skips the ring) times ``B * D * element_size``, for K and for V (``Dv =
  D``). The backward sends the same K/V again and dK/dV of the rows it received (``recv_rows``)
  back, in the input dtype. The Ulysses all-to-alls are not counted here (they do not depend on
  the mask; the planner's Note [Planner prediction] has them).

Shapes: every count is a Python ``int`` (``kernel_flops`` keeps a float ``pairs`` a float); lists
are in ``cp_rank`` order, ``R * U`` entries; :class:`StepWork` and :class:`RingWork` are per query
head and batch row, :class:`RankCost` per CP rank with its heads and batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .heads import HeadAssignment, head_assignments
from .layout import Placement
from .masks import Mask
from .ring import SPLIT_KEYS_FROM, RingPlan, Step, ring_plan, tile_pairs

__all__ = [
    "FWD_FLOPS_PER_PAIR",
    "BWD_FLOPS_PER_PAIR",
    "kernel_flops",
    "kv_bytes",
    "square_pairs",
    "StepWork",
    "step_work",
    "work_of_step",
    "RingWork",
    "ring_work",
    "RankCost",
    "rank_cost",
    "plan_costs",
]

FWD_FLOPS_PER_PAIR = 4  # per attended (query, key) pair, head and head-dim element
BWD_FLOPS_PER_PAIR = 10  # 2.5x the forward


def kernel_flops(pairs: int | float, head_dim: int, *, backward: bool = False) -> int | float:
    """FLOPs of the attention kernel over ``pairs`` (query, key, head) triples of head dim ``D``:
    ``4 * pairs * D`` forward, ``10 * pairs * D`` backward (Note [Plan cost])."""
    return (BWD_FLOPS_PER_PAIR if backward else FWD_FLOPS_PER_PAIR) * pairs * head_dim


def kv_bytes(rows: int, kv_heads: int, head_dim: int, batch: int, element_size: int) -> int:
    """Bytes of K and V (or dK and dV) over ``rows`` token rows: ``[B, rows, Hkv, D]`` twice."""
    return 2 * rows * kv_heads * head_dim * batch * element_size


def square_pairs(n: int, causal: bool) -> int:
    """Attended pairs of one ``n x n`` block per head: ``n (n + 1) / 2`` causal, ``n^2`` otherwise."""
    return n * (n + 1) // 2 if causal else n * n


@dataclass(frozen=True)
class StepWork:
    """One ring step of one ring rank, per query head and batch row.

    Attributes:
        pairs: attended (query, key) pairs.
        kinds: block kind (``"full"``: unmasked, ``"causal"``: square causal, ``"window"``: any
            other band) -> ``(attended pairs, query rows, pairs of the whole blocks)``.
        fwd_calls, bwd_calls: kernel calls forward and backward (the backward cuts wide unmasked
            blocks of a remote step in two, ``SPLIT_KEYS_FROM``).
        q_rows: query rows merged into the accumulators.
        k_rows: key rows whose gradients the step produces.
        send_rows, recv_rows: K/V rows sent to the next rank and received for this step.
    """

    pairs: int
    kinds: dict[str, tuple[int, int, int]]
    fwd_calls: int
    bwd_calls: int
    q_rows: int
    k_rows: int
    send_rows: int
    recv_rows: int


def step_work(plan: RingPlan, i: int) -> StepWork:
    """:class:`StepWork` of step ``i`` of ``plan``."""
    return work_of_step(plan.steps[i], remote=i > 0)


def work_of_step(step: Step, *, remote: bool) -> StepWork:
    """:class:`StepWork` of one ring step (``remote``: a step ``> 0``, whose wide unmasked blocks
    run their backward in two calls)."""
    tiles = step.tiles
    sq, sk = tiles.q1 - tiles.q0, tiles.k1 - tiles.k0
    unbounded = tiles.wl < 0
    masks = {"full": unbounded & (tiles.wr < 0), "causal": unbounded & (tiles.wr == 0) & (sq == sk)}
    masks["window"] = ~(masks["full"] | masks["causal"])
    kinds = {}
    for kind, sel in masks.items():
        if bool(sel.any()):
            kinds[kind] = (tile_pairs(tiles.select(sel)), int(sq[sel].sum()), int((sq[sel] * sk[sel]).sum()))
    wide = int((masks["full"] & (sk >= SPLIT_KEYS_FROM)).sum()) if remote else 0
    return StepWork(
        sum(p for p, _, _ in kinds.values()), kinds, len(step.calls), len(step.calls) + wide,
        int(sq.sum()), int(sk.sum()), sum(b - a for a, b in step.send_rows), sum(b - a for a, b in step.recv_rows),
    )


@dataclass(frozen=True)
class RingWork:
    """Every step of one ring rank's plan (:class:`StepWork`, per query head and batch row), and
    their sums."""

    steps: tuple[StepWork, ...]

    @property
    def pairs(self) -> int:
        """Attended (query, key) pairs over the steps."""
        return sum(s.pairs for s in self.steps)

    @property
    def send_rows(self) -> int:
        """K/V rows sent around the ring over the steps."""
        return sum(s.send_rows for s in self.steps)

    @property
    def recv_rows(self) -> int:
        """K/V rows received over the steps."""
        return sum(s.recv_rows for s in self.steps)

    @property
    def kernel_calls(self) -> int:
        """Forward kernel calls over the steps."""
        return sum(s.fwd_calls for s in self.steps)

    @property
    def active_steps(self) -> int:
        """Steps that run a kernel."""
        return sum(1 for s in self.steps if s.fwd_calls)


def ring_work(plan: RingPlan) -> RingWork:
    """:class:`RingWork` of every step of ``plan``."""
    return RingWork(tuple(step_work(plan, i) for i in range(len(plan.steps))))


@dataclass(frozen=True)
class RankCost:
    """One CP rank's share of one attention layer, all its query heads and batch rows (Note [Plan
    cost]).

    Attributes:
        pairs: attended (query, key, head) triples times the batch.
        fwd_flops, bwd_flops: kernel FLOPs forward and backward.
        ring_kv_bytes_fwd: K/V bytes sent around the ring in the forward.
        ring_bytes_bwd: bytes sent in the backward (the K/V again, and dK/dV back).
        kernel_calls_fwd: forward kernel calls.
        active_steps: ring steps that run a kernel.
    """

    pairs: int
    fwd_flops: int
    bwd_flops: int
    ring_kv_bytes_fwd: int
    ring_bytes_bwd: int
    kernel_calls_fwd: int
    active_steps: int

    @property
    def ring_bytes(self) -> int:
        """Bytes sent around the ring, forward and backward."""
        return self.ring_kv_bytes_fwd + self.ring_bytes_bwd


def rank_cost(work: RingWork, heads: HeadAssignment, *, head_dim: int, batch: int, element_size: int) -> RankCost:
    """The :class:`RankCost` of the CP rank with ``heads`` (its ``head_assignments`` entry) on the
    ring rank whose plan gave ``work``; ``element_size``: bytes of one element of K and V."""
    h_q = heads.q_len
    h_kv = heads.kernel_kv_heads if h_q else 0
    pairs = work.pairs * h_q * batch
    kv_fwd = kv_bytes(work.send_rows, h_kv, head_dim, batch, element_size)
    return RankCost(
        pairs=pairs,
        fwd_flops=kernel_flops(pairs, head_dim),
        bwd_flops=kernel_flops(pairs, head_dim, backward=True),
        ring_kv_bytes_fwd=kv_fwd,
        ring_bytes_bwd=kv_fwd + kv_bytes(work.recv_rows, h_kv, head_dim, batch, element_size),
        kernel_calls_fwd=work.kernel_calls,
        active_steps=work.active_steps,
    )


def plan_costs(
    placement: Placement,
    mask: Mask,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    batch: int = 1,
    element_size: int = 2,
    varlen: bool = True,
) -> list[RankCost]:
    """Every CP rank's :class:`RankCost`, in ``cp_rank`` order (Note [Plan cost]).

    Args:
        placement: where the tokens live (``Placement.dense`` or ``Placement.packed``).
        mask: the mask in global positions, normalised by the caller (``Mask.normalised``).
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv`` (dividing ``H``), ``D``.
        batch: ``B`` (1 for a packed batch).
        element_size: bytes of one element of K and V (2 for bf16).
        varlen: whether the plans group blocks into varlen calls (buffers without a batch
            dimension); changes ``kernel_calls_fwd`` only.

    Raises:
        ValueError: for head counts ``head_assignments`` refuses.
    """
    R, U = placement.ring_size, placement.ulysses_size
    heads = head_assignments(num_heads, num_kv_heads, U)
    rings = [ring_work(ring_plan(placement, r, mask, varlen=varlen)) for r in range(R)]
    return [
        rank_cost(rings[r], heads[u], head_dim=head_dim, batch=batch, element_size=element_size)
        for r in range(R)
        for u in range(U)
    ]
