"""Benchmark seqpar.attention: Ulysses, ring and hybrid next to one device, and sliding windows
against full causal attention.

Every configuration ``R x U`` (ring x Ulysses) computes the same problem -- attention over ``B x
S`` tokens with ``H`` heads -- split over ``R * U`` ranks, forward and backward. Per configuration
and mask the script reports:

- **time**: median over ``--iters`` forward+backward iterations of the slowest rank (all ranks
  start each iteration together, ``seqpar.tools.profiling``); with several masks (``--window``) their
  iterations are interleaved, so drifting background load hits them alike;
- **plan figures** (host maths, exact, from ``seqpar.placement``): attended (query, key) pairs
  and kernel FLOPs per rank, and the bytes of K/V each rank sends around the ring (below);
- **kernel time**: the wall time of the ring's kernel calls (a backend wrapper), and from it
  nanoseconds per attended (query, key, head) pair, forward+backward;
- unless ``--window``: the single-device baseline (the whole problem in one process, same
  kernel), peak memory per rank, and the ring's kernel efficiency: one equal-FLOP non-causal
  kernel call against the ring's kernel calls, in the ring and replayed alone.

``--ring-comm p2p,allgather`` (or ``p2p,p2p_serial``, or all three) times those K/V transports of
the ring (``ParallelState(ring_comm=...)``, ``docs/performance.md``: "All-gather K/V vs ring p2p",
"The serial ring") on every configuration with ``R > 1``, in one run, on the same tensors,
iterations interleaved, with peak memory per rank and the workspace each state holds between
calls, and prints each other transport's ratios to p2p of time, memory and bytes.

``--window W`` compares, in one run and on the same tensors, full causal attention with causal
sliding-window attention (window ``(W, 0)``: query ``i`` sees keys ``i-W .. i``), and prints
window/full ratios of FLOPs, ring bytes and time. ``--frames F`` does the same for block-causal
attention over ``F`` frames (``seqpar.MaskSlices.block_causal``: frame ``b`` sees frames ``<= b``;
autoregressive video), with the ratio of the ring bytes actually posted next to the plan's.

What is counted (plan figures, ``seqpar.placement.cost``, Note [Plan cost]):

- pairs: ``sum(tile_pairs(step.tiles))`` over the ring steps of the rank's plan, times its
  heads ``H_u`` and ``B``: the (query, key, head) triples the mask attends, not what a kernel
  computes (the CPU kernel also computes masked-out parts of its tiles);
- kernel FLOPs, forward: ``4 * D * pairs`` (``QK^T`` and ``PV``, a multiply-add = 2 FLOPs);
  the backward (``QK^T`` recomputed, ``dP``, ``dS``->``dQ``, ``dK``, ``dV``) is ``2.5x`` that,
  so every FLOP ratio is also the forward+backward one;
- ring bytes sent per rank, forward: ``sum over steps of rows(send_rows) * B * Hkv_u * (D + Dv)
  * itemsize`` (K and V; ``Hkv_u`` = K/V heads in the ring after Ulysses). The backward sends the
  same K/V again (Note [Ring schedule]) plus dK/dV of the rows it received, in the input dtype:
  ``rows(recv_rows) * B * Hkv_u * (D + Dv) * itemsize``. Ulysses all-to-all traffic (``U > 1``)
  does not depend on the mask and is not included. Cross-check: the bytes each rank actually
  hands to the ring's point-to-point sends (``seqpar.parallel.ring.post``, wrapped for one
  untimed iteration) are recorded too; the output warns if they differ from the plan's.

Run:
    python scripts/bench_attention.py                         # CPU: 4 gloo ranks, 3 configs
    python scripts/bench_attention.py --world 2 --seq-len 4096 --causal
    python scripts/bench_attention.py --ring 4 --window 4096 --seq-len 65536 --heads 2 --head-dim 64
    python scripts/bench_attention.py --ring 4 --frames 16 --seq-len 16384 --heads 4
    python scripts/bench_attention.py --ring-comm p2p,allgather --causal --seq-len 4096
    python -m torch.distributed.run --nproc-per-node 8 scripts/bench_attention.py     # CUDA/NCCL, one GPU per rank

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the live storages created by
ATen ops (``seqpar.tools.profiling.PeakMemory``; tensors only, not kernel scratch), measured in a
separate untimed iteration. With more CPU ranks than cores the ranks time-share the cores:
compare ratios within one run (the output says so).

Output: the tables, notes and warnings, then the whole report as one JSON line (last line);
``--json PATH`` also writes it to a file. ``--plot PATH`` saves a chart: with ``--window``, the
window/full ratios of FLOPs, ring bytes, time and kernel time per configuration; otherwise the
speedup and peak memory against the single-device baseline (or, without it, the work balance).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from typing import Self, get_args

import torch
import torch.distributed as dist

import seqpar
from seqpar.backends import KernelBackend, get_backend
from seqpar.parallel import ring as ring_module
from seqpar.placement import Mask, MaskSlices, Placement, head_assignments, ring_plan
from seqpar.placement.cost import kv_bytes, plan_costs
from seqpar.placement.gather import gather_plan
from seqpar.state import RingComm
from seqpar.tools.bench import (
    Ranks,
    few_iterations_warning,
    inputs,
    time_sharing_warning,
    usable_cores,
)
from seqpar.tools.one_rank import instrument
from seqpar.tools.profiling import (
    PeakMemory,
    iteration_seconds,
    max_over_ranks,
    maxrss_bytes,
    median_seconds,
)
from seqpar.tools.report import Panel, add_output_arguments, chart_panels, emit, progress, script_parser, table

_TRANSPORTS = get_args(RingComm)  # ParallelState(ring_comm=...)

# ---------------------------------------------------------------------------------------------
# Masks and plan figures (host maths, no tensors of the problem)


def frame_sizes(seq_len: int, frames: int) -> list[int]:
    """``frames`` frame sizes summing to ``seq_len`` (the first ``seq_len % frames`` one longer)."""
    base, extra = divmod(seq_len, frames)
    return [base + (f < extra) for f in range(frames)]


def _masks(p: dict) -> list[tuple[str, dict]]:
    """``(label, attention kwargs)`` of every mask this run measures."""
    if p.get("frames") is not None:
        F = p["frames"]
        sizes = frame_sizes(p["seq_len"], F)
        return [("causal", {"causal": True}), (f"block-causal {F} frames", {"mask": MaskSlices.block_causal(sizes)})]
    if p["window"] is None:
        return [("causal" if p["causal"] else "full", {"causal": p["causal"]})]
    W = p["window"]
    return [("causal", {"causal": True}), (f"window ({W}, 0)", {"causal": True, "window": (W, 0)})]


def _gather_bytes(p: dict, R: int, U: int, mask: Mask, itemsize: int) -> list[int]:
    """Per CP rank, the K/V bytes one all-gather of the ring group brings it (``R - 1`` parts of
    the largest contribution, Note [All-gather K/V]); the backward moves them again and
    reduce-scatters as many dK/dV."""
    placement = Placement.dense(p["seq_len"], R, U)
    width = gather_plan([ring_plan(placement, r, mask, varlen=p["batch"] == 1) for r in range(R)], 0).width
    heads = head_assignments(p["heads"], p["kv_heads"], U)
    return [(R - 1) * kv_bytes(width, heads[u].kernel_kv_heads if heads[u].q_len else 0, p["head_dim"], p["batch"],
                               itemsize) for r in range(R) for u in range(U)]


def plan_figures(p: dict, R: int, U: int, mask_kwargs: dict, ring_comm: str = "p2p") -> dict:
    """Per CP rank (``cp_rank`` order): attended pairs, forward kernel FLOPs and ring bytes sent
    (``seqpar.placement.cost.plan_costs``, Note [Plan cost]); with ``ring_comm="allgather"`` the
    bytes are the all-gather's (forward) and the all-gather's and reduce-scatter's (backward).

    See the module docstring for what is counted.
    """
    S, B = p["seq_len"], p["batch"]
    if "mask" in mask_kwargs:
        mask = Mask(slices=mask_kwargs["mask"])
    else:
        mask = Mask(mask_kwargs["causal"], mask_kwargs.get("window", (-1, -1))).normalised(S)
    itemsize = torch.empty(0, dtype=getattr(torch, p["dtype"])).element_size()
    costs = plan_costs(Placement.dense(S, R, U), mask, p["heads"], p["kv_heads"], p["head_dim"], batch=B,
                       element_size=itemsize, varlen=B == 1)
    ranks = [{
        "pairs": c.pairs,
        "fwd_flops": c.fwd_flops,
        "ring_kv_bytes_fwd": c.ring_kv_bytes_fwd,
        "ring_bytes_bwd": c.ring_bytes_bwd,
        "kernel_calls_fwd": c.kernel_calls_fwd,
        "active_steps": c.active_steps,
    } for c in costs]
    if ring_comm == "allgather" and R > 1:
        for rank, moved in zip(ranks, _gather_bytes(p, R, U, mask, itemsize)):
            rank["ring_kv_bytes_fwd"], rank["ring_bytes_bwd"] = moved, 2 * moved

    def total(key: str) -> int:
        return sum(x[key] for x in ranks)

    def most(key: str) -> int:
        return max(x[key] for x in ranks)

    return {
        "mask": mask.describe(),
        "per_rank": ranks,
        "pairs_total": total("pairs"),
        "pairs_max": most("pairs"),
        "pairs_max_over_mean": most("pairs") * len(ranks) / max(1, total("pairs")),
        "fwd_flops_max": most("fwd_flops"),
        "ring_kv_bytes_fwd_max": most("ring_kv_bytes_fwd"),
        "ring_kv_bytes_fwd_total": total("ring_kv_bytes_fwd"),
        "ring_bytes_fwd_bwd_max": max(x["ring_kv_bytes_fwd"] + x["ring_bytes_bwd"] for x in ranks),
        "ring_bytes_fwd_bwd_total": total("ring_kv_bytes_fwd") + total("ring_bytes_bwd"),
    }


# ---------------------------------------------------------------------------------------------
# Measurement helpers


def _peak_bytes(fn: Callable[[], None], device: torch.device) -> int | None:
    """Peak tensor bytes while ``fn`` runs (``seqpar.tools.profiling.PeakMemory``)."""
    with PeakMemory(device) as mem:
        fn()
    return mem.peak


def _inputs(p: dict, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """The whole problem's q, k, v, dout ``[B, S, H(kv), D]`` (``seqpar.tools.bench.inputs``)."""
    return inputs((p["batch"], p["seq_len"]), p["heads"], p["kv_heads"], p["head_dim"], seed=p["seed"],
                  device=device, dtype=dtype)


class _SendCounter:
    """Counts the bytes the ring hands to point-to-point sends while active, by wrapping
    ``seqpar.parallel.ring.post`` (``bytes`` stays None if the ring no longer calls ``post``)."""

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._post = getattr(ring_module, "post", None)

    def __enter__(self) -> Self:
        if self._post is None:
            return self
        self.bytes = 0
        original = self._post

        def counting(group, sends=(), recvs=()):
            self.bytes += sum(t.numel() * t.element_size() for _, t in sends)
            return original(group, sends, recvs)

        ring_module.post = counting
        return self

    def __exit__(self, *exc: object) -> None:
        if self._post is not None:
            ring_module.post = self._post


def _recorded_step(q, k, v, dout, state, p, backend, mask_kwargs: dict) -> tuple[int | None, int | None]:
    """One untimed forward+backward; returns the ring bytes this rank sent in each."""
    for t in (q, k, v):
        t.grad = None
    with _SendCounter() as fwd:
        out = seqpar.attention(q, k, v, state, backend=backend, seq_len=p["seq_len"], **mask_kwargs)
    with _SendCounter() as bwd:
        out.backward(dout)
    return fwd.bytes, bwd.bytes


def _attention_step(q, k, v, dout, state, p, backend, mask_kwargs: dict) -> Callable[[], None]:
    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        out = seqpar.attention(q, k, v, state, backend=backend, seq_len=p["seq_len"], **mask_kwargs)
        out.backward(dout)

    return step


def _interleaved(
    steps: list[Callable[[], None]], p: dict, device: torch.device, distributed: bool
) -> list[list[float]]:
    """Per step, ``iters`` times (slowest rank per iteration when ``distributed``), the steps'
    iterations interleaved: s0, s1, ..., s0, s1, ..."""
    for _ in range(p["warmup"]):
        for fn in steps:
            fn()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(p["iters"]):
        for i, fn in enumerate(steps):
            times[i] += iteration_seconds(fn, 1, device, warmup=0, barrier=distributed)
    if distributed:
        times = [max_over_ranks(t, device) for t in times]
    return times


def _summary(times: list[float]) -> dict:
    return {"time_ms": 1e3 * statistics.median(times), "min_time_ms": 1e3 * min(times),
            "times_ms": [round(1e3 * t, 3) for t in times]}


def single_device(p: dict, device: torch.device) -> list[dict]:
    """The whole problem in one process with the same kernel (no communication), every mask."""
    dtype = getattr(torch, p["dtype"])
    q, k, v, dout = _inputs(p, device, dtype)
    for t in (q, k, v):
        t.requires_grad_()
    state = seqpar.ParallelState(ring_size=1, ulysses_size=1)  # a size-1 group (each rank alone)
    steps = [_attention_step(q, k, v, dout, state, p, p["backend"], kw) for _, kw in _masks(p)]
    # Under torchrun every rank runs the baseline at once, each on its own device: no barrier.
    rows = [_summary(t) for t in _interleaved(steps, p, device, distributed=False)]
    if p["memory"]:
        for row, step in zip(rows, steps):
            row["peak_bytes"] = _peak_bytes(step, device)
    return rows


def bench_rank(p: dict, configs: list[tuple[str, int, int]]) -> list[dict]:
    """Runs on every rank: time (and memory, kernel efficiency) of each configuration and mask."""
    device = torch.device(p["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, p["dtype"])
    masks = _masks(p)
    rows = []
    for i, (name, R, U) in enumerate(configs):
        progress("bench_attention", f"configuration {i + 1}/{len(configs)}: {name} ring {R} x ulysses {U}")
        # One state per K/V transport (the same placement: the shards serve every state).
        states = {comm: seqpar.ParallelState(ring_size=R, ulysses_size=U, ring_comm=comm) for comm in _comms(p, R)}
        state = next(iter(states.values()))
        # Own storage per rank (a shard may be a view of the global tensor).
        q, k, v, dout = (seqpar.shard(t, state, dim=1).to(device).clone() for t in _inputs(p, torch.device("cpu"), dtype))
        for t in (q, k, v):
            t.requires_grad_()
        variants = [(comm, label, kw) for comm in states for label, kw in masks]
        kernels = [
            instrument(get_backend(p["backend"], device, dtype, window="window" in kw or "mask" in kw), device) for _, _, kw in variants
        ]
        steps = [_attention_step(q, k, v, dout, states[comm], p, kern, kw)
                 for kern, (comm, _, kw) in zip(kernels, variants)]
        # One untimed call each: records the kernel calls and the ring bytes sent.
        sent = [_recorded_step(q, k, v, dout, states[comm], p, kern, kw)
                for kern, (comm, _, kw) in zip(kernels, variants)]
        calls = [list(kern.calls) for kern in kernels]
        for kern in kernels:
            kern.reset()
        times = _interleaved(steps, {**p, "warmup": max(0, p["warmup"] - 1)}, device, distributed=True)
        for (comm, label, kw), kern, step, t, c, (fwd, bwd) in zip(variants, kernels, steps, times, calls, sent):
            row = {
                "config": name, "ring": R, "ulysses": U, "ring_comm": comm, "mask": label, "rank": dist.get_rank(),
                **_summary(t), "kernel_ms": 1e3 * kern.total_seconds() / p["iters"], "kernel_calls": len(c),
                "ring_bytes_sent_fwd": fwd, "ring_bytes_sent_bwd": bwd,
            }
            if p["memory"]:
                row["peak_bytes"] = _peak_bytes(step, device)
                row["maxrss_bytes"] = maxrss_bytes()
                # Buffers the state keeps between calls (Note [Workspace]), not in the peak above.
                row["workspace_bytes"] = states[comm].workspace.nbytes
            if p["efficiency"] and R > 1:
                pairs = plan_figures(p, R, U, kw)["per_rank"][state.cp_rank]["pairs"]
                row.update(_kernel_efficiency(p, c, kern, pairs, device, dtype, row["kernel_ms"] / 1e3))
            rows.append(row)
        for st in states.values():
            st.close()  # each gloo group left open keeps a polling thread (timings of later configs)
    return rows


def _comms(p: dict, R: int) -> list[str]:
    """The K/V transports a configuration runs: those asked for, only ``"p2p"`` without a ring
    (``R == 1``: nothing travels, the transports are the same computation)."""
    comms = p["ring_comms"]
    return comms if R > 1 else comms[:1]


def _kernel_efficiency(
    p: dict, calls: list, backend: KernelBackend, pairs: int, device: torch.device, dtype: torch.dtype,
    in_ring_s: float,
) -> dict:
    """This rank's in-ring kernel time vs one equal-FLOP non-causal call, and vs replaying the
    ring's kernel calls alone (same shapes and windows, random data)."""
    scale = p["head_dim"] ** -0.5
    B, D = p["batch"], p["head_dim"]
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    def fwd_bwd(q, k, v, dout, window, packing=None) -> None:
        kw = {"scale": scale, "window": window, "softcap": 0.0}
        if packing is None:
            out, lse = backend.kernel_forward(q, k, v, **kw)
            backend.kernel_backward(dout, q, k, v, out, lse, **kw)
        else:
            out, lse = backend.kernel_varlen_forward(q, k, v, packing, **kw)
            backend.kernel_varlen_backward(dout, q, k, v, out, lse, packing, **kw)

    def median_s(fn: Callable[[], None]) -> float:  # this rank alone
        return median_seconds(fn, p["iters"], device, barrier=False, over_ranks=False)

    heads = calls[0][1][-2] if calls else 0
    kv_heads = calls[0][2][-2] if calls else 0
    per_head = pairs // (B * heads) if heads else 0
    s_eq = max(1, round(math.sqrt(per_head))) if per_head else 0
    mono = None
    if s_eq:
        tensors = rand(B, s_eq, heads, D), rand(B, s_eq, kv_heads, D), rand(B, s_eq, kv_heads, D), rand(B, s_eq, heads, D)
        mono = median_s(lambda: fwd_bwd(*tensors, (-1, -1)))
    replayed = []
    for call in calls:
        qs, ks = call[1], call[2]
        replayed.append((rand(*qs), rand(*ks), rand(*ks), rand(*qs), call[-1], call[3] if call[0] == "varlen" else None))

    def replay() -> None:
        for q_b, k_b, v_b, d_b, window, packing in replayed:
            fwd_bwd(q_b, k_b, v_b, d_b, window, packing)

    backend.reset()
    replay_s = median_s(replay)
    backend.reset()
    return {
        "monolithic_seq_len": s_eq, "monolithic_ms": None if mono is None else 1e3 * mono,
        "replay_ms": 1e3 * replay_s,
        "kernel_efficiency": mono / in_ring_s if mono and in_ring_s else None,
        "replay_efficiency": mono / replay_s if mono and replay_s else None,
    }


# ---------------------------------------------------------------------------------------------
# Driver


def _configs(world: int, ring: int | None, ulysses: int | None) -> list[tuple[str, int, int]]:
    if ring is not None or ulysses is not None:
        R, U = ring or 1, ulysses or 1
        name = "ring" if U == 1 else "ulysses" if R == 1 else "hybrid"
        return [(name, R, U)]
    out = [("ulysses", 1, world), ("ring", world, 1)]
    hybrid = [(r, world // r) for r in range(2, world) if world % r == 0]
    if hybrid:
        r, u = min(hybrid, key=lambda ru: abs(ru[0] - ru[1]))
        out.append(("hybrid", r, u))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _summarise(p: dict, single: list[dict] | None, per_rank: list[list[dict]], configs, world: int) -> dict:
    masks = _masks(p)
    entries = []
    rows_by_key: dict[tuple[str, str, str], list[dict]] = {}
    for rank_rows in per_rank:
        for row in rank_rows:
            rows_by_key.setdefault((row["config"], row["ring_comm"], row["mask"]), []).append(row)
    variants = [(name, R, U, comm, m, label, kw) for name, R, U in configs for comm in _comms(p, R)
                for m, (label, kw) in enumerate(masks)]
    for name, R, U, comm, m, label, kw in variants:
        rows = rows_by_key[(name, comm, label)][: R * U]  # one CP group
        first = rows[0]
        plan = plan_figures(p, R, U, kw, comm)
        kernel_ms = [r["kernel_ms"] for r in rows]
        entry = {
            "config": name, "ring": R, "ulysses": U, "ring_comm": comm, "mask": label, "mask_plan": plan["mask"],
            "time_ms": first["time_ms"],  # already the slowest rank's, per iteration
            "min_time_ms": first["min_time_ms"], "times_ms": first["times_ms"],
            "kernel_ms_per_rank": kernel_ms,
            "kernel_calls_per_rank": [r["kernel_calls"] for r in rows],
            "ring_bytes_sent_measured_per_rank": [[r["ring_bytes_sent_fwd"], r["ring_bytes_sent_bwd"]] for r in rows],
            # fwd+bwd kernel wall time per attended (query, key, head) triple, slowest rank.
            "kernel_ns_per_pair": max(1e6 * k / max(1, f["pairs"]) for k, f in zip(kernel_ms, plan["per_rank"])),
            "plan": plan,
        }
        if single is not None:
            entry["speedup_vs_single"] = single[m]["time_ms"] / first["time_ms"]
        if "peak_bytes" in first:
            entry["peak_bytes_per_rank"] = [r["peak_bytes"] for r in rows]
            entry["maxrss_bytes_per_rank"] = [r["maxrss_bytes"] for r in rows]
            entry["workspace_bytes_per_rank"] = [r["workspace_bytes"] for r in rows]
            if single is not None and single[m].get("peak_bytes"):
                entry["peak_vs_single"] = max(r["peak_bytes"] for r in rows) / single[m]["peak_bytes"]
        if "replay_ms" in first:
            for key in ("kernel_efficiency", "replay_efficiency", "monolithic_ms", "replay_ms", "monolithic_seq_len"):
                entry[key + "_per_rank"] = [r[key] for r in rows]
        entries.append(entry)
    report = {"problem": p, "world": world, "single_device": single, "configs": entries}
    if "p2p" in p["ring_comms"] and len(p["ring_comms"]) > 1:
        report["transport_vs_p2p"] = [
            _comm_ratios(e, a) for e in entries for a in entries
            if e["ring_comm"] == "p2p" and a["ring_comm"] != "p2p"
            and (e["config"], e["mask"]) == (a["config"], a["mask"])
        ]
    if p["window"] is not None or p.get("frames") is not None:
        report["window_vs_full"] = [
            _window_ratios(entries[i], entries[i + 1], targets=p["window"] is not None)
            for i in range(0, len(entries), 2)
        ]
    return report


def _held(entry: dict) -> int | None:
    """Largest per-rank peak of one iteration plus the workspace the state keeps between calls."""
    if "peak_bytes_per_rank" not in entry or None in entry["peak_bytes_per_rank"]:
        return None
    return max(a + b for a, b in zip(entry["peak_bytes_per_rank"], entry["workspace_bytes_per_rank"]))


def _comm_ratios(p2p: dict, other: dict) -> dict:
    """Another transport's figures over p2p's, one configuration and mask (same tensors,
    interleaved iterations)."""
    pp, po = p2p["plan"], other["plan"]
    return {
        "config": p2p["config"], "ring": p2p["ring"], "ulysses": p2p["ulysses"], "mask": p2p["mask"],
        "transport": other["ring_comm"], "time_ms_p2p": p2p["time_ms"], "time_ms_other": other["time_ms"],
        "time_ratio": _ratio(other["time_ms"], p2p["time_ms"]),
        "held_bytes_p2p": _held(p2p), "held_bytes_other": _held(other),
        "memory_ratio": _ratio(_held(other), _held(p2p)),
        "ring_bytes_fwd_bwd_ratio_max_rank": _ratio(po["ring_bytes_fwd_bwd_max"], pp["ring_bytes_fwd_bwd_max"]),
    }


def _window_ratios(full: dict, win: dict, targets: bool = True) -> dict:
    """masked/full ratios of one configuration (the window's or the frames' mask over full causal)."""
    pf, pw = full["plan"], win["plan"]
    out = {
        "config": full["config"], "ring": full["ring"], "ulysses": full["ulysses"],
        "fwd_flops_ratio_max_rank": _ratio(pw["fwd_flops_max"], pf["fwd_flops_max"]),
        "pairs_ratio_total": _ratio(pw["pairs_total"], pf["pairs_total"]),
        "ring_kv_bytes_fwd_ratio_max_rank": _ratio(pw["ring_kv_bytes_fwd_max"], pf["ring_kv_bytes_fwd_max"]),
        "ring_kv_bytes_fwd_ratio_total": _ratio(pw["ring_kv_bytes_fwd_total"], pf["ring_kv_bytes_fwd_total"]),
        "ring_bytes_fwd_bwd_ratio_max_rank": _ratio(pw["ring_bytes_fwd_bwd_max"], pf["ring_bytes_fwd_bwd_max"]),
        "time_ratio": _ratio(win["time_ms"], full["time_ms"]),
        "kernel_time_ratio_max_rank": _ratio(max(win["kernel_ms_per_rank"]), max(full["kernel_ms_per_rank"])),
        "kernel_ns_per_pair_full": full["kernel_ns_per_pair"],
        "kernel_ns_per_pair_window": win["kernel_ns_per_pair"],
    }
    # The targets: bytes sent <= 1/3 and time <= 0.4 of full causal.
    b, t = out["ring_kv_bytes_fwd_ratio_max_rank"], out["time_ratio"]
    out["meets_bytes_target_1_3"] = None if b is None or not targets else b <= 1 / 3
    out["meets_time_target_0_4"] = None if t is None or not targets else t <= 0.4
    posted = [max((fb[0] or 0) for fb in e["ring_bytes_sent_measured_per_rank"]) for e in (win, full)]
    out["ring_kv_bytes_posted_fwd_ratio_max_rank"] = _ratio(posted[0] or None, posted[1] or None)
    return out


def _fmt(x: float | None, spec: str = ".3f") -> str | None:
    return None if x is None else format(x, spec)


def _text(report: dict) -> str:
    p, single = report["problem"], report["single_device"]
    mib = 1 / 2**20
    head = (
        f"B={p['batch']} S={p['seq_len']} H={p['heads']} Hkv={p['kv_heads']} D={p['head_dim']} {p['dtype']} "
        f"backend={p['backend']} on {report['world']} ranks ({p['device']}, {p['cpu_cores']} usable CPU "
        f"cores, {p['threads_per_rank']} thread(s) per rank), median of {p['iters']} fwd+bwd iterations"
    )
    cols = ["config", "K/V by", "mask", "R x U", "median ms", "min ms", "kernel ms", "ns/pair", "fwd GFLOP",
            "ring KV MiB fwd", "ring MiB f+b", "pairs max/mean"]
    if single is not None:
        cols.append("speedup")
    if p["memory"]:
        cols += ["peak MiB/rank", "peak/single"]
    if p["efficiency"]:
        cols += ["kernel eff", "replay eff"]

    def span(values: list | None) -> str | None:
        values = [v for v in values or [] if v is not None]
        return f"{min(values):.2f}-{max(values):.2f}" if values else None

    rows = []
    if single is not None:
        for (label, _), s in zip(_masks(p), single):
            row = ["single", None, label, "1 x 1", f"{s['time_ms']:.1f}", f"{s['min_time_ms']:.1f}", None, None,
                   None, None, None, None, "1.00"]
            if p["memory"]:
                row += [_fmt(s.get("peak_bytes", 0) * mib, ".1f"), "1.00"]
            if p["efficiency"]:
                row += [None, None]
            rows.append(row)
    for c in report["configs"]:
        pl = c["plan"]
        row = [
            c["config"], c["ring_comm"] if c["ring"] > 1 else None, c["mask"], f"{c['ring']} x {c['ulysses']}",
            f"{c['time_ms']:.1f}", f"{c['min_time_ms']:.1f}",
            f"{max(c['kernel_ms_per_rank']):.1f}", f"{c['kernel_ns_per_pair']:.2f}",
            f"{pl['fwd_flops_max'] / 1e9:.2f}", f"{pl['ring_kv_bytes_fwd_max'] * mib:.2f}",
            f"{pl['ring_bytes_fwd_bwd_max'] * mib:.2f}", f"{pl['pairs_max_over_mean']:.3f}",
        ]
        if single is not None:
            row.append(_fmt(c.get("speedup_vs_single"), ".2f"))
        if p["memory"]:
            row += [_fmt(max(c["peak_bytes_per_rank"]) * mib, ".1f"), _fmt(c.get("peak_vs_single"), ".2f")]
        if p["efficiency"]:
            row += [span(c.get("kernel_efficiency_per_rank")), span(c.get("replay_efficiency_per_rank"))]
        rows.append(row)
    legend = (
        "per rank, slowest rank shown: kernel ms = the ring's kernel calls (fwd+bwd); ns/pair = kernel ms per "
        "attended (query, key, head) triple; fwd GFLOP = 4*D*pairs; ring KV MiB fwd = K/V rows sent around "
        "the ring in the forward; ring MiB f+b adds the backward's K/V and dK/dV (fp32 accumulators)"
    )
    parts = [head, table(cols, rows), legend]
    if p["efficiency"]:
        parts.append("kernel eff = one equal-FLOP non-causal kernel call / the ring's kernel calls (min-max over "
                     "ranks); replay eff = the same with the ring's calls replayed outside the ring")
    if report.get("transport_vs_p2p"):
        ccols = ["config", "R x U", "mask", "transport", "p2p ms", "other ms", "time other/p2p", "held MiB p2p",
                 "held MiB other", "memory other/p2p", "ring bytes other/p2p"]
        crows = [[
            r["config"], f"{r['ring']} x {r['ulysses']}", r["mask"], r["transport"], _fmt(r["time_ms_p2p"], ".1f"),
            _fmt(r["time_ms_other"], ".1f"), _fmt(r["time_ratio"]),
            _fmt(r["held_bytes_p2p"] and r["held_bytes_p2p"] * mib, ".1f"),
            _fmt(r["held_bytes_other"] and r["held_bytes_other"] * mib, ".1f"), _fmt(r["memory_ratio"]),
            _fmt(r["ring_bytes_fwd_bwd_ratio_max_rank"]),
        ] for r in report["transport_vs_p2p"]]
        parts += ["", "another K/V transport / ring p2p, same tensors, iterations interleaved (held = peak of one "
                  "fwd+bwd + the workspace the state keeps; max rank):", table(ccols, crows)]
    if report.get("window_vs_full"):
        wcols = ["config", "R x U", "FLOPs w/f", "pairs w/f (all)", "KV bytes w/f", "posted w/f", "KV bytes w/f (all)",
                 "f+b bytes w/f", "time w/f", "kernel time w/f", "ns/pair full", "ns/pair window",
                 "bytes<=1/3", "time<=0.4"]
        wrows = [[
            w["config"], f"{w['ring']} x {w['ulysses']}", _fmt(w["fwd_flops_ratio_max_rank"]),
            _fmt(w["pairs_ratio_total"]), _fmt(w["ring_kv_bytes_fwd_ratio_max_rank"]),
            _fmt(w["ring_kv_bytes_posted_fwd_ratio_max_rank"]),
            _fmt(w["ring_kv_bytes_fwd_ratio_total"]), _fmt(w["ring_bytes_fwd_bwd_ratio_max_rank"]),
            _fmt(w["time_ratio"]), _fmt(w["kernel_time_ratio_max_rank"]), _fmt(w["kernel_ns_per_pair_full"], ".2f"),
            _fmt(w["kernel_ns_per_pair_window"], ".2f"),
            {True: "yes", False: "NO", None: None}[w["meets_bytes_target_1_3"]],
            {True: "yes", False: "NO", None: None}[w["meets_time_target_0_4"]],
        ] for w in report["window_vs_full"]]
        what = f"window ({p['window']}, 0)" if p["window"] is not None else f"block-causal {p['frames']} frames"
        title = (f"{what} / full causal, same tensors, iterations interleaved "
                 "(max rank unless '(all)': sum over ranks):")
        parts += ["", title, table(wcols, wrows)]
    return "\n".join(parts)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--world", type=int, default=4, help="CPU ranks to spawn (default: 4, or R*U with --ring/--ulysses)")
    parser.add_argument("--ring", type=int, default=None, help="measure only ring size R (with --ulysses, default: 1)")
    parser.add_argument("--ulysses", type=int, default=None, help="measure only Ulysses size U (with --ring, default: 1)")
    parser.add_argument("--batch", type=int, default=1, help="batch B")
    parser.add_argument("--seq-len", type=int, default=2048, help="global tokens S")
    parser.add_argument("--heads", type=int, default=8, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads Hkv (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim D")
    parser.add_argument("--dtype", default=None, help="dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--causal", action="store_true", help="causal attention")
    parser.add_argument("--window", type=int, default=None, metavar="W",
                        help="compare causal window (W, 0) with full causal attention (implies --causal)")
    parser.add_argument("--frames", type=int, default=None, metavar="F",
                        help="compare block-causal attention over F equal frames (seqpar.MaskSlices.block_causal: "
                             "frame b sees frames <= b) with full causal attention")
    parser.add_argument("--backend", default="auto", help="attention backend")
    parser.add_argument("--ring-comm", default="p2p", metavar="COMMS",
                        help="K/V transports of the ring, comma-separated, of p2p, p2p_serial and allgather "
                             "(e.g. p2p,allgather: all timed in one run, interleaved; default: p2p)")
    parser.add_argument("--iters", type=int, default=3,
                        help="timed forward+backward iterations; the median is reported")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations before timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=None,
                        help="run the single-device baseline (default: on, off with --window)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                        help="measure peak memory in an extra iteration (default: on, off with --window)")
    parser.add_argument("--efficiency", action=argparse.BooleanOptionalAction, default=None,
                        help="measure the ring's kernel efficiency (default: on, off with --window)")
    add_output_arguments(parser, "the window/full ratios per configuration with --window, else the speedup and "
                         "peak memory vs one device")
    args = parser.parse_args()

    if args.window is not None:
        if args.window < 0:
            raise SystemExit(f"--window must be >= 0 (the number of earlier keys a query sees), got {args.window}")
        if args.window >= args.seq_len - 1:
            raise SystemExit(
                f"--window {args.window} >= --seq-len - 1 = {args.seq_len - 1}: the window masks nothing, "
                "windowed and full causal attention are the same computation; pick W < S - 1"
            )
    if args.iters < 1:
        raise SystemExit(f"--iters must be >= 1, got {args.iters}")
    ring_comms = [c.strip() for c in args.ring_comm.split(",") if c.strip()]
    if not ring_comms or any(c not in _TRANSPORTS for c in ring_comms) or len(set(ring_comms)) < len(ring_comms):
        raise SystemExit(f"--ring-comm must list some of {', '.join(_TRANSPORTS)}, each once, got {args.ring_comm!r}")
    if args.frames is not None and (args.frames < 2 or args.frames > args.seq_len or args.window is not None):
        raise SystemExit(f"--frames must be in [2, --seq-len] and without --window, got {args.frames}")
    compare = args.window is not None or args.frames is not None
    run_single = not compare if args.single is None else args.single
    # Local ranks: R * U of --ring/--ulysses, else --world (ignored under torchrun).
    world = (args.ring or 1) * (args.ulysses or 1) if args.ring is not None or args.ulysses is not None else args.world
    with Ranks(world, timeout_s=3600) as ranks:
        device = ranks.device.type
        p = {
            "batch": args.batch, "seq_len": args.seq_len, "heads": args.heads,
            "kv_heads": args.kv_heads or args.heads, "head_dim": args.head_dim,
            "dtype": args.dtype or ("bfloat16" if device == "cuda" else "float32"),
            "causal": args.causal or compare, "window": args.window, "frames": args.frames, "backend": args.backend,
            "iters": args.iters, "warmup": args.warmup, "seed": args.seed, "device": device,
            "memory": not compare if args.memory is None else args.memory,
            "efficiency": not compare if args.efficiency is None else args.efficiency,
            "cpu_cores": usable_cores(), "threads_per_rank": 1, "ring_comms": ring_comms,
        }
        if ranks.torchrun:
            p["threads_per_rank"] = torch.get_num_threads()
        else:
            torch.set_num_threads(1)  # as each rank (DistPool sets one thread per rank)
        configs = _configs(ranks.world, args.ring, args.ulysses)
        # Under torchrun every rank runs the baseline at once (one GPU each), else this process alone;
        # then the configurations on every rank.
        if run_single:
            progress("bench_attention", "single-device baseline")
        single = single_device(p, ranks.device) if run_single else None
        gathered = ranks.run(bench_rank, p, configs)
    if ranks.rank != 0:
        return
    world = ranks.world
    report = _summarise(p, single, gathered, configs, world)
    notes = [
        time_sharing_warning(ranks.ranks_per_node * p["threads_per_rank"], p["cpu_cores"], device),
        few_iterations_warning(args.iters),
    ]
    if compare:
        notes.append(
            "window mode: both masks run on the same tensors and ranks, iterations interleaved; their time "
            "ratio is comparable even when ranks time-share cores (it is not a per-rank speed)"
        )
    if single is not None and device == "cpu" and world > p["cpu_cores"]:
        notes.append("speedup vs single: the single-device baseline runs alone on one thread while the "
                     f"{world} ranks share {p['cpu_cores']} core(s); it is not a parallel speedup")
    notes.append(_bytes_check(report))
    emit(report, _text(report), notes, args.json, plot=chart_panels(args.plot, *_chart(report)))


def _chart(report: dict) -> tuple[str, list[str], list[Panel]]:
    """``--plot``'s title, rows and panels, one quantity per axis (see the module docstring)."""
    p = report["problem"]
    shape = (f"B={p['batch']} S={p['seq_len']} H={p['heads']} Hkv={p['kv_heads']} D={p['head_dim']} {p['dtype']} "
             f"on {report['world']} ranks ({p['device']}), median of {p['iters']} iterations")
    if report.get("window_vs_full"):
        rows = report["window_vs_full"]
        series = {
            "fwd FLOPs (max rank)": [w["fwd_flops_ratio_max_rank"] for w in rows],
            "ring KV bytes fwd (max rank)": [w["ring_kv_bytes_fwd_ratio_max_rank"] for w in rows],
            "ring bytes fwd+bwd (max rank)": [w["ring_bytes_fwd_bwd_ratio_max_rank"] for w in rows],
            "time": [w["time_ratio"] for w in rows],
            "kernel time (max rank)": [w["kernel_time_ratio_max_rank"] for w in rows],
        }
        return (f"causal window ({p['window']}, 0) / full causal, same tensors, iterations interleaved; {shape}",
                [f"{w['config']} {w['ring']} x {w['ulysses']}" for w in rows],
                [Panel("window / full causal (lower is better; 1.0 = no saving)", series)])
    configs = report["configs"]
    labels = [f"{c['config']} {c['ring']} x {c['ulysses']}" + ("" if c.get("ring_comm", "p2p") == "p2p" else f" {c['ring_comm']}")
              for c in configs]
    panels = []
    if report["single_device"] is not None:
        panels.append(Panel("speedup: single time / time (higher is better)",
                            {"speedup": [c.get("speedup_vs_single") for c in configs]}))
    if any("peak_vs_single" in c for c in configs):
        panels.append(Panel(f"peak memory per rank / single (lower is better; ideal 1/{report['world']})",
                            {"memory": [c.get("peak_vs_single") for c in configs]},
                            reference_line=1 / report["world"]))
    if panels:
        title = f"{configs[0]['mask']} attention against one device running the whole problem; {shape}"
        if p["device"] == "cpu" and report["world"] > p["cpu_cores"]:
            title += (f". WARNING: the {report['world']} ranks time-share {p['cpu_cores']} core(s), the baseline "
                      "runs alone: not a parallel speedup")
        return title, labels, panels
    return (f"{configs[0]['mask']} attention, attended pairs per rank; {shape}", labels,
            [Panel("attended pairs, max / mean (lower is better; 1.0 = perfect balance)",
                   {"pairs max/mean": [c["plan"]["pairs_max_over_mean"] for c in configs]})])


def _bytes_check(report: dict) -> str:
    """Whether the plan's ring bytes match the bytes measured at the ring's sends on every rank."""
    bad, unmeasured = [], False
    for c in report["configs"]:
        for cp, (plan, measured) in enumerate(zip(c["plan"]["per_rank"], c["ring_bytes_sent_measured_per_rank"])):
            if None in measured:
                unmeasured = True
            elif c["ring_comm"] == "allgather" and c["ring"] > 1:
                if measured != [0, 0]:  # the all-gather transport sends nothing point-to-point
                    bad.append(f"{c['config']} allgather {c['mask']} cp rank {cp}: {measured} bytes sent point-to-point")
            elif measured != [plan["ring_kv_bytes_fwd"], plan["ring_bytes_bwd"]]:
                bad.append(f"{c['config']} {c['mask']} cp rank {cp}: plan fwd/bwd "
                           f"{plan['ring_kv_bytes_fwd']}/{plan['ring_bytes_bwd']}, measured {measured[0]}/{measured[1]}")
    if bad:
        return "WARNING: ring bytes from the plan differ from the bytes sent: " + "; ".join(bad)
    if unmeasured:
        return "ring bytes: plan figures only (seqpar.parallel.ring has no post() to count sends at)"
    return "ring bytes: the plan's figures equal the bytes every rank handed to the ring's sends (fwd and bwd)"


if __name__ == "__main__":
    main()
