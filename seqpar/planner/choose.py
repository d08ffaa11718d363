"""``plan``: predict every ring x Ulysses factorisation of a CP group and choose one."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import get_args

import torch
import torch.distributed as dist

from ..checks import check_gqa, check_mask_options
from ..placement import Mask
from ..placement.sizes import as_int
from ..state import ParallelState, RingComm
from .cost import CostModel
from .predict import Candidate, GroupPrediction, Shape, predict, predict_head_groups

__all__ = ["DegreePlan", "plan", "TIE_RTOL", "HEAD_GROUPS_RTOL", "GROUPS_FOR_EVERY_CANDIDATE", "recommend_head_groups",
           "auto_head_groups"]

# Predicted times closer than this (relative) are a tie: the cost model is not that accurate
# (measured choices against 1.10 x the fastest: scripts/bench_planner.py), so 205 ms against 206 ms
# says nothing about which split is faster.
TIE_RTOL = 0.02
RING_COMMS = ("auto", *get_args(RingComm))

# Without a memory budget, more head groups are recommended only while they cost at most this much
# predicted time over one group (Note [Planner head groups] in seqpar/planner/predict.py).
HEAD_GROUPS_RTOL = 0.10
# Up to this many ranks a plan predicts head groups for every candidate; above, for the chosen one
# (each group count costs about one more prediction, seconds at cp_size 1024).
GROUPS_FOR_EVERY_CANDIDATE = 64


def recommend_head_groups(groups: tuple[GroupPrediction, ...], memory_budget: int | None = None) -> int:
    """The ``head_groups`` to run with, from one split's predictions (``Candidate.groups``).

    With ``memory_budget`` (bytes one rank may hold for the call): the smallest count whose
    predicted peak fits it, else (none fits) the count with the lowest peak. Without: the count
    with the lowest peak among those predicted within ``HEAD_GROUPS_RTOL`` (10%) of one group's
    time (ties: fewer groups). 1 when ``groups`` is empty.
    """
    if not groups:
        return 1
    if memory_budget is not None:
        fits = [g for g in groups if g.memory_bytes <= memory_budget]
        if fits:
            return min(fits, key=lambda g: g.head_groups).head_groups
        return min(groups, key=lambda g: (g.memory_bytes, g.head_groups)).head_groups
    one = next((g for g in groups if g.head_groups == 1), groups[0])
    near = [g for g in groups if g.time_s <= one.time_s * (1 + HEAD_GROUPS_RTOL)]
    return min(near, key=lambda g: (g.memory_bytes, g.head_groups)).head_groups


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
        memory_budget: the bytes per rank the recommended ``head_groups`` were chosen to fit
            (:func:`recommend_head_groups`), or None.
    """

    cp_size: int
    ranks_per_node: int
    shape: Shape
    cost: CostModel
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    explanation: str
    memory_budget: int | None = None

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
    def head_groups(self) -> int:
        """The recommended ``head_groups`` of the chosen candidate (``seqpar.attention(...,
        head_groups=G)``; Note [Planner head groups])."""
        return self.chosen.head_groups

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
        return _aligned(rows)

    def groups_table(self) -> str:
        """Per candidate with head-group predictions, the predicted time and peak per group count
        (``G1``, ``G2``, ...), the recommended one marked ``*``; empty when none has them."""
        cands = [c for c in self.candidates if c.groups]
        if not cands:
            return ""
        counts = sorted({g.head_groups for c in cands for g in c.groups})
        rows = [("ring x ulysses", "K/V by", *(f"G{n}: time, memory" for n in counts))]
        for c in cands:
            cells = {g.head_groups: f"{'*' if g.head_groups == c.head_groups else ''}{_ms(g.time_s)}, "
                                    f"{_mib(g.memory_bytes)}" for g in c.groups}
            rows.append((f"{c.ring_size} x {c.ulysses_size}", "-" if c.ring_size == 1 else c.ring_comm,
                         *(cells.get(n, "-") for n in counts)))
        return _aligned(rows)

    def __str__(self) -> str:
        groups = self.groups_table()
        return f"{self.table()}\n\n{self.explanation}" + (f"\n\nhead groups (per call):\n{groups}" if groups else "")


def _aligned(rows: list[tuple[str, ...]]) -> str:
    """Rows of cells as right-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


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
    memory_budget: int | None = None,
    predict_groups: bool | None = None,
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
        memory_budget: bytes one rank may hold for one attention call (its peak as
            ``Candidate.memory_bytes`` counts it); the recommended ``head_groups`` is then the
            smallest count predicted to fit (:func:`recommend_head_groups`). ``None``: the count
            with the lowest peak within ``HEAD_GROUPS_RTOL`` (10%) of one group's time. The
            split is chosen as without it, by one group's time.
        predict_groups: predict ``head_groups`` 1, 2, 4, ... up to ``H / U`` (Note [Planner head
            groups]) for every candidate (``True``), for the chosen one only (``False``), or
            (``None``) for every candidate up to ``GROUPS_FOR_EVERY_CANDIDATE`` (64) ranks and
            the chosen one above: each count costs about one more prediction.

    Returns:
        A :class:`DegreePlan`: ``.ring_size``, ``.ulysses_size``, ``.ring_comm``, every
        candidate's bytes, memory, balance and time (and ``.groups``, ``.head_groups``: per
        head-group count, and the recommended one), ``.head_groups`` of the chosen one,
        ``.explanation``, and ``.state(group)`` to build the state.

    Raises:
        ValueError: a non-positive or non-int size, ``H`` not a multiple of ``Hkv``, a bad window,
            a non-floating dtype, a cost that is not a ``CostModel``, an unknown ``ring_comm``, a
            ``keep_head_shards`` or ``predict_groups`` that is not a bool, a non-positive
            ``memory_budget``.
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
    if predict_groups is not None and not isinstance(predict_groups, bool):
        raise ValueError(f"{where}: predict_groups must be True, False or None, got {predict_groups!r}")
    if memory_budget is not None:
        memory_budget = as_int(memory_budget, "memory_budget (bytes per rank for one attention call)", where, minimum=1)
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
    explanation = _explain(shape, cp_size, ranks_per_node, cost, cands, best, serial)
    every = predict_groups if predict_groups is not None else cp_size <= GROUPS_FOR_EVERY_CANDIDATE
    for i, c in enumerate(cands):
        if every or c is best:
            groups = predict_head_groups(shape, c, ranks_per_node, cost)
            cands[i] = replace(c, groups=groups, head_groups=recommend_head_groups(groups, memory_budget))
            best = cands[i] if c is best else best
    explanation += _explain_groups(best, memory_budget)
    return DegreePlan(cp_size, ranks_per_node, shape, cost, tuple(cands), best, explanation, memory_budget)


def _explain_groups(best: Candidate, memory_budget: int | None) -> str:
    """The explanation's sentence on the chosen split's head groups (Note [Planner head groups])."""
    if len(best.groups) < 2:
        return ""
    one, rec = best.group(1), best.group(best.head_groups)
    budget = "" if memory_budget is None else f" (memory budget {_mib(memory_budget)} per rank)"
    if memory_budget is not None and rec.memory_bytes > memory_budget:
        return (f" No head-group count fits the memory budget of {_mib(memory_budget)} per rank with {best.label()}: "
                f"the fewest bytes are {_mib(rec.memory_bytes)} at head_groups={rec.head_groups}.")
    if rec.head_groups == 1:
        lowest = min(best.groups, key=lambda g: (g.memory_bytes, g.head_groups))
        why = (f"{_mib(one.memory_bytes)} fits the budget" if memory_budget is not None else
               f"more groups hold at least {_mib(lowest.memory_bytes)} but cost more than "
               f"{HEAD_GROUPS_RTOL:.0%} more time ({_ms(lowest.time_s)} at head_groups={lowest.head_groups})")
        return f" Head groups: one group (all heads at once){budget}: {why}."
    return (f" Head groups: seqpar.attention(..., head_groups={rec.head_groups}){budget} is predicted to hold "
            f"{_mib(rec.memory_bytes)} per rank instead of {_mib(one.memory_bytes)}, at {_ms(rec.time_s)} against "
            f"{_ms(one.time_s)} for one group.")



def auto_head_groups(
    seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, ring_size: int, ulysses_size: int, *,
    batch: int = 1, causal: bool = False, window: tuple[int, int] = (-1, -1), dtype: torch.dtype = torch.bfloat16,
    device_type: str = "cuda", ring_comm: str = "p2p", keep_head_shards: bool = False,
) -> int:
    """What ``head_groups="auto"`` runs for a call of this shape on a ring x Ulysses state: the
    planner's rule without a memory budget (:func:`recommend_head_groups`: the lowest predicted
    peak within ``HEAD_GROUPS_RTOL`` of one group's time), predicted with the ``cpu`` cost preset
    on a CPU and the ``h100`` preset on any other device, the CP group taken as one node.

    Host maths of the call's shapes alone, no device query and no communication: every rank that
    agrees on the call (the call's checks exchange its shapes) resolves the same count. Cached per
    shape; a packed call passes its total tokens as ``seq_len``.
    """
    return _auto_head_groups(seq_len, num_heads, num_kv_heads, head_dim, ring_size, ulysses_size, batch, causal,
                             tuple(window), dtype, device_type, ring_comm, keep_head_shards)


@functools.lru_cache(maxsize=256)
def _auto_head_groups(
    seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, R: int, U: int, batch: int, causal: bool,
    window: tuple[int, int], dtype: torch.dtype, device_type: str, ring_comm: str, keep_head_shards: bool,
) -> int:
    shape = Shape(seq_len, num_heads, num_kv_heads, head_dim, batch, causal, window,
                  torch.empty((), dtype=dtype).element_size())
    cost = CostModel.preset("cpu" if device_type == "cpu" else "h100")
    comm = ring_comm if R > 1 else "p2p"
    one = predict(shape, R, U, R * U, cost, comm, keep_head_shards and U > 1)
    return recommend_head_groups(predict_head_groups(shape, one, R * U, cost))
