"""Benchmark seqpar.attention: Ulysses-only, ring-only and hybrid next to single-device attention.

Every configuration computes the same problem -- full attention over ``B x S`` tokens with ``H``
heads -- split over ``N`` ranks; the single-device baseline computes all of it in one process with
the same kernel. Reported per configuration: forward+backward time (median over iterations of the
slowest rank), peak memory per rank, and for configurations with a ring the ring's kernel
efficiency: the time the ring's kernel calls took on each rank versus one monolithic call of the
same kernel doing the same FLOPs (a ``[B, S_eq, H_u, D]`` non-causal call with ``S_eq^2`` equal to
the rank's attended query-key pairs), measured concurrently on every rank; a replay of the ring's
recorded block shapes, outside the ring, separates small-block cost from interference with the
communication.

Run:
    python scripts/bench_attention.py                       # CPU: spawns 4 gloo ranks
    python scripts/bench_attention.py --world 2 --seq-len 4096 --causal
    torchrun --nproc-per-node 8 scripts/bench_attention.py  # CUDA/NCCL, one GPU per rank

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above the inputs; on CPU a
``TorchDispatchMode`` that follows every storage created by an ATen op until it is freed (weak
storage references) -- tensors only, not a kernel's internal scratch -- plus the process's
``ru_maxrss`` for reference. Memory is measured in a separate, untimed iteration.

With more ranks than CPU cores the ranks time-share the cores; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import seqpar
from seqpar.backends import AttentionBackend, get_backend
from seqpar.profiling import PeakMemory, iteration_seconds, max_over_ranks, maxrss_bytes, sync


# ---------------------------------------------------------------------------------------------
# Measurement helpers


class _TimedBackend:
    """Wraps a backend: records the wall time and the shapes of every kernel call."""

    def __init__(self, inner: AttentionBackend, device: torch.device) -> None:
        self.inner, self.device, self.name = inner, device, inner.name
        self.calls: list[tuple[str, tuple, tuple, bool]] = []  # (kind, q shape, k shape, causal)
        self._pending: list[tuple[Any, Any]] = []
        self.seconds = 0.0

    def _timed(self, fn: Callable[[], Any]) -> Any:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self._pending.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn()
        self.seconds += time.perf_counter() - t0
        return out

    def total_seconds(self) -> float:
        sync(self.device)
        self.seconds += sum(s.elapsed_time(e) for s, e in self._pending) / 1e3
        self._pending = []
        return self.seconds

    def forward(self, q, k, v, *, causal, scale):
        self.calls.append(("forward", tuple(q.shape), tuple(k.shape), causal))
        return self._timed(lambda: self.inner.forward(q, k, v, causal=causal, scale=scale))

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        self.calls.append(("backward", tuple(q.shape), tuple(k.shape), causal))
        return self._timed(
            lambda: self.inner.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        )

    def varlen_forward(self, *args, **kwargs):  # not used by dense attention
        return self.inner.varlen_forward(*args, **kwargs)

    def varlen_backward(self, *args, **kwargs):
        return self.inner.varlen_backward(*args, **kwargs)


def _pairs(q_shape: tuple, k_shape: tuple, causal: bool) -> int:
    """Attended (query, key) pairs of one block, over batch and heads."""
    b, sq, h, _ = q_shape
    sk = k_shape[1]
    per_head = sq * (sq + 1) // 2 if causal else sq * sk
    return b * h * per_head


def _kernel_fwd_bwd(backend: AttentionBackend, q, k, v, dout, causal: bool, scale: float) -> None:
    out, lse = backend.forward(q, k, v, causal=causal, scale=scale)
    backend.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


def _seconds(
    fn: Callable[[], None], device: torch.device, iters: int, slowest: bool = True
) -> tuple[float, float]:
    """``(median, min)`` over ``iters`` of the time of ``fn`` after one warm-up; all ranks start
    each iteration together, and with ``slowest`` each iteration counts the slowest rank."""
    times = iteration_seconds(fn, iters, device)
    if slowest:
        times = max_over_ranks(times, device)
    return statistics.median(times), min(times)


def _peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak tensor bytes while ``fn`` runs (``seqpar.profiling.PeakMemory``: the CUDA allocator's
    high-water mark, on CPU the live storages created by ATen ops)."""
    with PeakMemory(device) as mem:
        fn()
    return mem.peak


# ---------------------------------------------------------------------------------------------
# The problem


def _inputs(p: dict, device: torch.device, dtype: torch.dtype, seq_len: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(p["seed"])
    B, H, Hkv, D = p["batch"], p["heads"], p["kv_heads"], p["head_dim"]
    shapes = [(B, seq_len, H, D), (B, seq_len, Hkv, D), (B, seq_len, Hkv, D), (B, seq_len, H, D)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def _attention_step(q, k, v, dout, state, p, backend) -> Callable[[], None]:
    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        out = seqpar.attention(
            q, k, v, state, causal=p["causal"], backend=backend, seq_len=p["seq_len"]
        )
        out.backward(dout)

    return step


def single_device(p: dict, device: torch.device) -> dict:
    """The whole problem in one process with the same kernel (no communication)."""
    dtype = getattr(torch, p["dtype"])
    q, k, v, dout = _inputs(p, device, dtype, p["seq_len"])
    for t in (q, k, v):
        t.requires_grad_()
    # Without a process group a size-1 state; under torchrun every rank is its own CP group.
    state = seqpar.ParallelState(ring_size=1, ulysses_size=1)
    step = _attention_step(q, k, v, dout, state, p, p["backend"])
    seconds, best = _seconds(step, device, p["iters"])
    return {"time_ms": 1e3 * seconds, "min_time_ms": 1e3 * best, "peak_bytes": _peak_bytes(step, device)}


def bench_rank(p: dict, configs: list[tuple[str, int, int]]) -> list[dict]:
    """Runs on every rank: time, memory and kernel efficiency of each configuration."""
    device = torch.device(p["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, p["dtype"])
    rows = []
    for name, R, U in configs:
        state = seqpar.ParallelState(ring_size=R, ulysses_size=U)
        full = _inputs(p, torch.device("cpu"), dtype, p["seq_len"])
        # Own storage per rank (a shard may be a view of the global tensor).
        q, k, v, dout = (seqpar.shard(t, state, dim=1).to(device).clone() for t in full)
        for t in (q, k, v):
            t.requires_grad_()
        kernel = _TimedBackend(get_backend(p["backend"], device, dtype), device)
        step = _attention_step(q, k, v, dout, state, p, kernel)
        step()  # warm-up; also records one iteration's kernel calls
        calls = list(kernel.calls)
        kernel.total_seconds()  # flush the warm-up's pending CUDA events, then start counting
        kernel.seconds, kernel.calls = 0.0, []
        seconds, best = _seconds(step, device, p["iters"])
        kernel_s = kernel.total_seconds() / (p["iters"] + 1)  # _seconds runs fn iters + 1 times
        peak = _peak_bytes(step, device)
        row = {
            "config": name, "ring": R, "ulysses": U, "rank": dist.get_rank(),
            "time_ms": 1e3 * seconds, "min_time_ms": 1e3 * best, "peak_bytes": peak, "maxrss_bytes": maxrss_bytes(),
            "kernel_ms": 1e3 * kernel_s, "kernel_calls": len(calls),
        }
        if R > 1:
            row.update(_kernel_efficiency(p, calls, kernel.inner, device, dtype, kernel_s))
        rows.append(row)
    return rows


def _kernel_efficiency(
    p: dict, calls: list, backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
    in_ring_s: float,
) -> dict:
    """This rank's in-ring kernel time vs one equal-FLOP call, and vs replaying the blocks alone."""
    scale = p["head_dim"] ** -0.5
    fwd = [(qs, ks, c) for kind, qs, ks, c in calls if kind == "forward"]
    pairs = sum(_pairs(qs, ks, c) for qs, ks, c in fwd)
    B, D = p["batch"], p["head_dim"]
    heads = fwd[0][0][2] if fwd else 1
    kv_heads = fwd[0][1][2] if fwd else 1
    s_eq = max(1, round(math.sqrt(pairs / (B * heads)))) if pairs else 0
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    if s_eq:
        q, dout = rand(B, s_eq, heads, D), rand(B, s_eq, heads, D)
        k, v = rand(B, s_eq, kv_heads, D), rand(B, s_eq, kv_heads, D)
        mono = _seconds(lambda: _kernel_fwd_bwd(backend, q, k, v, dout, False, scale), device, p["iters"], False)[0]
    else:
        mono = _seconds(lambda: None, device, p["iters"], False)[0]
    blocks = [
        (rand(*qs), rand(*ks), rand(*ks), rand(*qs), c) for qs, ks, c in fwd
    ]

    def replay() -> None:
        for q_b, k_b, v_b, d_b, c in blocks:
            _kernel_fwd_bwd(backend, q_b, k_b, v_b, d_b, c, scale)

    replay_s = _seconds(replay, device, p["iters"], False)[0]
    return {
        "kernel_pairs": pairs, "monolithic_seq_len": s_eq, "monolithic_ms": 1e3 * mono,
        "replay_ms": 1e3 * replay_s,
        "kernel_efficiency": mono / in_ring_s if in_ring_s else None,
        "replay_efficiency": mono / replay_s if replay_s else None,
    }


# ---------------------------------------------------------------------------------------------
# Driver


def _configs(world: int) -> list[tuple[str, int, int]]:
    out = [("ulysses", 1, world), ("ring", world, 1)]
    hybrid = [(r, world // r) for r in range(2, world) if world % r == 0]
    if hybrid:
        r, u = min(hybrid, key=lambda ru: abs(ru[0] - ru[1]))
        out.append(("hybrid", r, u))
    return out


def _summarise(p: dict, single: dict, per_rank: list[list[dict]], world: int, cores: int) -> dict:
    configs = []
    for i, rows in enumerate(zip(*per_rank)):
        first = rows[0]
        entry = {
            "config": first["config"], "ring": first["ring"], "ulysses": first["ulysses"],
            "time_ms": first["time_ms"],  # already the slowest rank's, per iteration
            "min_time_ms": first["min_time_ms"],
            "speedup_vs_single": single["time_ms"] / first["time_ms"],
            "speedup_vs_single_min": single["min_time_ms"] / first["min_time_ms"],
            "peak_bytes_per_rank": [r["peak_bytes"] for r in rows],
            "peak_vs_single": max(r["peak_bytes"] for r in rows) / max(1, single["peak_bytes"]),
            "maxrss_bytes_per_rank": [r["maxrss_bytes"] for r in rows],
            "kernel_ms_per_rank": [r["kernel_ms"] for r in rows],
        }
        if "kernel_efficiency" in first:
            for key in ("kernel_efficiency", "replay_efficiency", "monolithic_ms", "replay_ms",
                        "monolithic_seq_len", "kernel_pairs"):
                entry[key + "_per_rank"] = [r[key] for r in rows]
        configs.append(entry)
    return {
        "problem": p, "world": world, "cpu_cores": cores, "device": p["device"],
        "memory_method": "cuda.max_memory_allocated" if p["device"] == "cuda"
        else "TorchDispatchMode live-storage peak (op outputs; excludes kernel scratch)",
        "single_device": single, "configs": configs,
    }


def _print_table(summary: dict) -> None:
    p, single = summary["problem"], summary["single_device"]
    mib = 1 / 2**20
    print(
        f"\nB={p['batch']} S={p['seq_len']} H={p['heads']} Hkv={p['kv_heads']} D={p['head_dim']} "
        f"{p['dtype']} causal={p['causal']} backend={p['backend']} on {summary['world']} ranks "
        f"({summary['device']}, {summary['cpu_cores']} CPU cores); memory: {summary['memory_method']}"
    )
    cols = [("config", 10), ("R x U", 7), ("median ms", 11), ("min ms", 9), ("speedup", 9),
            ("peak MiB/rank", 15), ("peak/single", 13), ("kernel eff", 12), ("replay eff", 12)]

    def row(*values: object) -> str:
        return "".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(values, cols)))

    def span(values: list | None) -> str:
        values = [v for v in values or [] if v is not None]
        return f"{min(values):.2f}-{max(values):.2f}" if values else ""

    print(row(*(name for name, _ in cols)))
    print("-" * sum(w for _, w in cols))
    print(row("single", "1 x 1", f"{single['time_ms']:.1f}", f"{single['min_time_ms']:.1f}", "1.00",
              f"{single['peak_bytes'] * mib:.1f}", "1.00", "", ""))
    for c in summary["configs"]:
        print(row(
            c["config"], f"{c['ring']} x {c['ulysses']}", f"{c['time_ms']:.1f}", f"{c['min_time_ms']:.1f}",
            f"{c['speedup_vs_single']:.2f}", f"{max(c['peak_bytes_per_rank']) * mib:.1f}",
            f"{c['peak_vs_single']:.2f}", span(c.get("kernel_efficiency_per_rank")),
            span(c.get("replay_efficiency_per_rank")),
        ))
    if summary["world"] > summary["cpu_cores"] and summary["device"] == "cpu":
        print(f"note: {summary['world']} ranks share {summary['cpu_cores']} cores; times include time-sharing")
    print("speedup = single median / config median (slowest rank per iteration); kernel eff = one "
          "equal-FLOP kernel call / the ring's kernel calls on that rank (min-max over ranks); replay "
          "eff = the same with the ring's blocks replayed outside the ring")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="CPU ranks to spawn (ignored under torchrun)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the JSON summary to this file")
    args = parser.parse_args()

    torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    device = "cuda" if torchrun and torch.cuda.is_available() else "cpu"
    p = {
        "batch": args.batch, "seq_len": args.seq_len, "heads": args.heads,
        "kv_heads": args.kv_heads or args.heads, "head_dim": args.head_dim,
        "dtype": args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        "causal": args.causal, "backend": args.backend, "iters": args.iters, "seed": args.seed,
        "device": device,
    }
    cores = os.cpu_count() or 1

    if torchrun:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        world = dist.get_world_size()
        # Every rank runs the baseline at once (one GPU each), then the configurations.
        single = single_device(p, torch.device(device))
        rows = bench_rank(p, _configs(world))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if dist.get_rank() == 0:
            summary = _summarise(p, single, gathered, world, cores)
        dist.destroy_process_group()
        if int(os.environ.get("RANK", "0")) != 0:
            return
    else:
        from seqpar.testing import DistPool

        world = args.world
        torch.set_num_threads(1)  # as each rank (DistPool sets one thread per rank)
        single = single_device(p, torch.device("cpu"))
        with DistPool(world, timeout_s=600) as pool:
            gathered = pool.run(bench_rank, p, _configs(world))
        summary = _summarise(p, single, gathered, world, cores)
    print(json.dumps(summary, indent=1))
    _print_table(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
