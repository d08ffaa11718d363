"""``plan``: predict every ring x Ulysses factorisation of a CP group and choose one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
import torch.distributed as dist

from ..checks import check_gqa, check_mask_options
from ..placement import Mask
from ..placement.sizes import as_int
from ..state import ParallelState, RingComm
from .cost import CostModel
from .predict import Candidate, Shape, predict

__all__ = ["DegreePlan", "plan", "TIE_RTOL"]

# Predicted times closer than this (relative) are a tie: the cost model is not that accurate
# (measured choices are checked to within 10% in tests/test_planner.py), so 205 ms against 206 ms
# says nothing about which split is faster.
TIE_RTOL = 0.02
RING_COMMS = ("auto", *get_args(RingComm))


def _mib(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point (``"12.3 MiB"``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms"


@dataclass(frozen=True)
class DegreePlan:
    """The planner's answer for one layer shape on ``cp_size`` ranks (see :func:`plan`).

    Attributes:
        cp_size: ``N``; ranks_per_node: consecutive ranks sharing a node.
        shape: the layer (``seq_len``, heads, ``head_dim``, ``batch``, mask, element size).
        cost: the :class:`~seqpar.planner.CostModel` used.
        candidates: one :class:`~seqpar.planner.Candidate` per factorisation ``R x U = N`` and
            K/V transport (``R > 1``: ``"p2p"`` then ``"allgather"`` when both are considered),
            by increasing ring size.
        chosen: the candidate with the lowest predicted time (ties: less memory).
        explanation: one paragraph saying why.
    """

    cp_size: int
    ranks_per_node: int
    shape: Shape
    cost: CostModel
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    explanation: str

    @property
    def ring_size(self) -> int:
        """``R`` of the chosen factorisation."""
        return self.chosen.ring_size

    @property
    def ulysses_size(self) -> int:
        """``U`` of the chosen factorisation."""
        return self.chosen.ulysses_size

    @property
    def ring_comm(self) -> str:
        """The chosen K/V transport, ``"p2p"``, ``"p2p_serial"`` or ``"allgather"``
        (``ParallelState(ring_comm=...)``)."""
        return self.chosen.ring_comm

    @property
    def tied(self) -> tuple[Candidate, ...]:
        """The other candidates predicted within ``TIE_RTOL`` (2%) of the chosen one's time: as fast
        as far as the cost model can tell."""
        limit = self.chosen.time_s * (1 + TIE_RTOL)
        return tuple(c for c in self.candidates if c is not self.chosen and c.time_s <= limit)

    def candidate(self, ring_size: int, ulysses_size: int, ring_comm: str | None = None) -> Candidate:
        """The prediction for ``R x U`` with K/V transport ``ring_comm`` (``None``: the first
        considered, ``"p2p"`` unless only ``"allgather"`` was).

        Raises:
            ValueError: ``R * U`` is not a factorisation of ``cp_size`` (or was not predicted with
                ``ring_comm``), listing the valid ones.
        """
        for c in self.candidates:
            if (c.ring_size, c.ulysses_size) == (ring_size, ulysses_size) and ring_comm in (None, c.ring_comm):
                return c
        valid = sorted({(c.ring_size, c.ulysses_size, c.ring_comm) for c in self.candidates})
        what = (ring_size, ulysses_size) if ring_comm is None else (ring_size, ulysses_size, ring_comm)
        raise ValueError(f"DegreePlan.candidate: {what} is not one of {valid}")

    def state(self, group: dist.ProcessGroup | None = None) -> ParallelState:
        """``ParallelState(ring_size=R, ulysses_size=U, group=group, ring_comm=..., keep_head_shards=...)``
        of the chosen factorisation, transport and Ulysses saving (a collective constructor: every
        rank of ``group`` calls it)."""
        return ParallelState(
            ring_size=self.ring_size, ulysses_size=self.ulysses_size, group=group, ring_comm=self.ring_comm,
            keep_head_shards=self.chosen.keep_head_shards,
        )

    def table(self) -> str:
        """The candidates as a plain-text table (the chosen one marked ``*``, ties ``=``)."""
        head = ("", "ring x ulysses", "K/V by", "time/layer", "all-to-all", "ring K/V", "memory", "imbalance",
                "heads/rank")
        rows = [head]
        for c in self.candidates:
            heads = sorted(set(c.heads))
            rows.append((
                "*" if c is self.chosen else "=" if c in self.tied else "",
                f"{c.ring_size} x {c.ulysses_size}",
                "-" if c.ring_size == 1 else c.ring_comm,
                _ms(c.time_s),
                _mib(c.ulysses_bytes),
                _mib(c.ring_bytes),
                _mib(c.memory_bytes),
                f"{c.imbalance:.3f}",
                "-".join(str(h) for h in reversed(heads)),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)

    def __str__(self) -> str:
        return f"{self.table()}\n\n{self.explanation}"


def _transfers(c: Candidate) -> str:
    """How a candidate's ring moves K/V, for the explanation."""
    if c.ring_size == 1:
        return "(no ring)"
    if c.ring_comm == "allgather":
        return "in one all-gather (and a reduce-scatter back)"
    steps = c.ring_size - 1
    serial = ", each waited for" if c.ring_comm == "p2p_serial" else ""
    return f"over {steps} step{'s' if steps > 1 else ''}{serial}"


def _explain(shape: Shape, cp_size: int, ranks_per_node: int, cost: CostModel, cands: list[Candidate],
             best: Candidate, serial: Candidate | None = None) -> str:
    """The plan's paragraph; ``serial``: the chosen p2p split predicted without overlap (Note
    [Serial ring]), named when it holds markedly less."""
    S, H, Hkv, D = shape.seq_len, shape.num_heads, shape.num_kv_heads, shape.head_dim
    mask = Mask(shape.causal, shape.window).describe()
    what = f"S={S}, H={H}, Hkv={Hkv}, D={D}, batch {shape.batch}, {mask}, {shape.element_size}-byte elements"
    if len(cands) == 1:
        return (f"cp_size {cp_size}: {best.label()} is the only factorisation ({what}); predicted "
                f"{_ms(best.time_s)} per layer, forward and backward. Costs: {cost.name}.")
    others = sorted((c for c in cands if c is not best), key=lambda c: c.time_s)
    runner = others[0]
    worst = others[-1]
    against = f"{_ms(runner.time_s)} for {runner.label()}"
    if worst is not runner:
        against += f" and {_ms(worst.time_s)} for {worst.label()}"
    tied = [c for c in others if c.time_s <= best.time_s * (1 + TIE_RTOL)]
    if tied:
        labels = [best.label(), *(c.label() for c in tied)]
        names = ", ".join(labels[:-1]) + f" and {labels[-1]}"
        parts = [
            f"For {what} on {cp_size} ranks ({ranks_per_node} per node), {names} are tied: predicted "
            f"{', '.join(_ms(c.time_s) for c in [best, *tied])} per layer (forward and backward), within "
            f"{TIE_RTOL:.0%}, closer than the cost model can tell apart. The plan takes {best.label()} (the lower "
            "prediction, by a hair); measure them if it matters."
        ]
    else:
        parts = [
            f"For {what} on {cp_size} ranks ({ranks_per_node} per node), {best.label()} is predicted "
            f"fastest at {_ms(best.time_s)} per layer (forward and backward), against {against}."
        ]
    gains = {k: runner.parts[k] - best.parts[k] for k in best.parts}
    reason = max(gains, key=gains.get)
    if gains[reason] > 0:
        detail = {
            "all-to-all": (
                f"its all-to-alls cost {_ms(best.parts['all-to-all'])} against {_ms(runner.parts['all-to-all'])} "
                f"(Ulysses sends {_mib(best.ulysses_bytes)} per rank against {_mib(runner.ulysses_bytes)}; "
                "an all-to-all moves every token whatever the mask and hides behind nothing)"
            ),
            "ring transfer": (
                f"its ring adds {_ms(best.parts['ring transfer'])} to the compute against "
                f"{_ms(runner.parts['ring transfer'])} (the ring sends {_mib(best.ring_bytes)} per rank "
                f"{_transfers(best)} against {_mib(runner.ring_bytes)} {_transfers(runner)}; "
                f"{cost.overlap:.0%} of a step's shorter side hidden by overlap"
                f"{', none without (p2p_serial)' if 'p2p_serial' in (best.ring_comm, runner.ring_comm) else ''})"
            ),
            "kernels": (
                f"its kernels take {_ms(best.parts['kernels'])} against {_ms(runner.parts['kernels'])} "
                f"(work imbalance {best.imbalance:.3f} against {runner.imbalance:.3f}, and fewer, larger kernel calls)"
            ),
            "element-wise": (
                f"it spends {_ms(best.parts['element-wise'])} on LSE merges and gradient sums against "
                f"{_ms(runner.parts['element-wise'])} (fewer ring steps to merge)"
            ),
        }[reason]
        parts.append(f"The largest difference to the runner-up: {detail}.")
    uneven = [c for c in cands if c.ulysses_size > 1 and (H % c.ulysses_size or c.kv_replication > 1)]
    for c in uneven[:2]:
        note = f"With U={c.ulysses_size} the {H} query heads split {list(c.heads)}"
        if c.idle_ranks:
            note += f", leaving {c.idle_ranks} of every {c.ulysses_size} ranks without a head"
        if c.kv_replication > 1:
            note += f", and the {Hkv} K/V heads are sent {c.kv_replication:.2g}x (a K/V head to every rank that reads it)"
        parts.append(note + f" (imbalance {c.imbalance:.3f}).")
    left = shape.mask.window[0]
    if left >= 0 and any(c.ring_size > 1 for c in cands):
        ring = max(cands, key=lambda c: c.ring_size)
        chunk = S // (2 * ring.ring_size)
        if left < chunk:
            parts.append(
                f"The window of {left} keys is shorter than a zig-zag chunk ({chunk} tokens at R={ring.ring_size}), "
                f"so a ring step sends only the rows the window reads ({_mib(ring.ring_bytes)} per rank at R={ring.ring_size})."
            )
    cross = [c.label() for c in cands if "inter" in (c.ulysses_link, c.ring_link)]
    if cross:
        parts.append(f"Crossing nodes: {', '.join(cross)} (Ulysses across nodes pays the slower link on every all-to-all).")
    if cost.compute_capacity is not None:
        parts.append(
            f"Ranks share compute here (about {cost.compute_capacity:.2g} ranks of a node run at full speed at "
            "once), so a rank without work frees compute for the others."
        )
    lightest = min(cands, key=lambda c: c.memory_bytes)
    if lightest is not best and lightest.memory_bytes < 0.8 * best.memory_bytes:
        parts.append(
            f"If memory is tight, {lightest.label()} holds {_mib(lightest.memory_bytes)} per rank against "
            f"{_mib(best.memory_bytes)}."
        )
    if serial is not None and serial.memory_bytes < 0.95 * best.memory_bytes:
        parts.append(
            f"Without overlap (ring_comm='p2p_serial') {best.label()} would hold {_mib(serial.memory_bytes)} per "
            f"rank instead of {_mib(best.memory_bytes)}, at a predicted {_ms(serial.time_s)} against "
            f"{_ms(best.time_s)}."
        )
    twin = next((c for c in cands if c is not best and (c.ring_size, c.ulysses_size) ==
                 (best.ring_size, best.ulysses_size)), None)
    if twin is not None:  # the same split with the other K/V transport
        how = {"p2p": "point-to-point hops overlapping every step", "allgather": "one all-gather of the ring group",
               "p2p_serial": "point-to-point hops overlapping nothing"}
        parts.append(
            f"K/V travel by {how[best.ring_comm]} (ring_comm={best.ring_comm!r}): {_ms(best.time_s)} and "
            f"{_mib(best.memory_bytes)} per rank, against {_ms(twin.time_s)} and {_mib(twin.memory_bytes)} by "
            f"{how[twin.ring_comm]}."
        )
    parts.append(f"Costs: {cost.name}.")
    return " ".join(parts)


def plan(
    cp_size: int,
    *,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    ranks_per_node: int = 8,
    batch: int = 1,
    window: tuple[int, int] = (-1, -1),
    cost: CostModel | None = None,
    ring_comm: str = "auto",
    keep_head_shards: bool = False,
) -> DegreePlan:
    """Choose the ring and Ulysses sizes of a CP group for one attention layer shape.

    Every factorisation ``R x U = cp_size`` is predicted from the exact placement, head
    assignment and ring plan seqpar would run (Note [Planner prediction] in
    ``seqpar.planner.predict``) and the cost model (Note [Planner cost model]); the fastest is
    chosen. Pure host maths, no communication: every ring step is built once per distinct shard
    geometry (Note [Planner by shard geometry]), so a plan takes tens of milliseconds up to a few
    dozen ranks and well under a second at ``cp_size`` 1024 (``docs/planner.md`` has the times).

    Args:
        cp_size: ``N``, ranks in the CP group.
        seq_len: ``S``, global tokens per sequence.
        num_heads, num_kv_heads: ``H`` and ``Hkv`` (``H % Hkv == 0``).
        head_dim: ``D``.
        causal, window: the mask in global positions (as ``seqpar.attention``).
        dtype: dtype of q, k, v (element size for the bytes).
        ranks_per_node: consecutive ranks sharing a node (Ulysses is innermost:
            ``cp_rank = ring_rank * U + ulysses_rank``).
        batch: ``B``, sequences per step.
        cost: a :class:`~seqpar.planner.CostModel` (``seqpar.planner.calibrate`` measures one);
            ``None``: ``CostModel.preset("h100")``.
        ring_comm: the K/V transports to consider for ``R > 1``: ``"auto"`` the two that overlap
            their transfers, ``"p2p"`` and ``"allgather"``; or one of those or ``"p2p_serial"``
            (``ParallelState(ring_comm=...)``; ``docs/performance.md``). ``"p2p_serial"``, the
            least memory, is never faster than ``"p2p"`` (its transfers are all exposed), so only
            a plan that asks for it considers it.
        keep_head_shards: predict (and build, ``.state()``) with the Ulysses head shards kept for
            the backward (``ParallelState(keep_head_shards=True)``): less all-to-all traffic, the
            shard's q, k, v no longer held, the head shards kept per layer instead.

    Returns:
        A :class:`DegreePlan`: ``.ring_size``, ``.ulysses_size``, ``.ring_comm``, every
        candidate's bytes, memory, balance and time, ``.explanation``, and ``.state(group)`` to
        build the state.

    Raises:
        ValueError: a non-positive or non-int size, ``H`` not a multiple of ``Hkv``, a bad window,
            a non-floating dtype, a cost that is not a ``CostModel``, an unknown ``ring_comm`` or
            a ``keep_head_shards`` that is not a bool.
    """
    where = "seqpar.plan"
    cp_size = as_int(cp_size, "cp_size", where, minimum=1)
    seq_len = as_int(seq_len, "seq_len", where, minimum=1)
    num_heads = as_int(num_heads, "num_heads", where, minimum=1)
    num_kv_heads = as_int(num_kv_heads, "num_kv_heads", where, minimum=1)
    head_dim = as_int(head_dim, "head_dim", where, minimum=1)
    ranks_per_node = as_int(ranks_per_node, "ranks_per_node", where, minimum=1)
    batch = as_int(batch, "batch", where, minimum=1)
    check_gqa(num_heads, num_kv_heads, where)
    causal, window, _, _ = check_mask_options(causal, window, None, 0.0, where)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}: dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if not isinstance(ring_comm, str) or ring_comm not in RING_COMMS:
        raise ValueError(f"{where}: ring_comm must be one of {list(RING_COMMS)}, got {ring_comm!r}")
    if not isinstance(keep_head_shards, bool):
        raise ValueError(f"{where}: keep_head_shards must be True or False, got {keep_head_shards!r}")
    if cost is None:
        cost = CostModel.preset("h100")
    if not isinstance(cost, CostModel):
        raise ValueError(
            f"{where}: cost must be a seqpar.planner.CostModel (seqpar.planner.calibrate(state), "
            f"CostModel.load(path) or CostModel.preset(name)), got {type(cost).__name__}"
        )
    shape = Shape(
        seq_len, num_heads, num_kv_heads, head_dim, batch, causal, window,
        torch.empty((), dtype=dtype).element_size(),
    )
    comms = ("p2p", "allgather") if ring_comm == "auto" else (ring_comm,)
    cands = [
        predict(shape, r, cp_size // r, ranks_per_node, cost, comm, keep_head_shards)
        for r in range(1, cp_size + 1) if cp_size % r == 0
        for comm in (comms if r > 1 else ("p2p",))
    ]
    best = min(cands, key=lambda c: (c.time_s, c.memory_bytes))
    serial = None
    if best.ring_size > 1 and best.ring_comm == "p2p":  # what the same split holds without overlap
        serial = predict(shape, best.ring_size, best.ulysses_size, ranks_per_node, cost, "p2p_serial",
                         keep_head_shards)
    return DegreePlan(
        cp_size, ranks_per_node, shape, cost, tuple(cands), best,
        _explain(shape, cp_size, ranks_per_node, cost, cands, best, serial),
    )

