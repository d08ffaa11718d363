"""``python -m seqpar.tools.demo``: hybrid attention on local ranks, checked against one device.

The demo spawns ``--world-size`` processes (gloo on CPU; NCCL when there are enough GPUs), runs
``seqpar.attention`` forward and backward on one long sequence sharded over a ring x Ulysses
state, and compares every rank's output and input gradients with single-device SDPA in float64.
The tolerance follows flash-attn's rule: at most twice the error of the same computation on one
device in the same dtype (with a small floor per dtype).

It also reports, per rank, the median forward and backward time over ``--iters`` calls after a
warm-up call, and the tensor memory of one call, everything counted: the storage created inside
it plus the buffers the state keeps between calls (``state.workspace``; none by default), each
next to one device running the whole sequence with the same kernel in the same process setup. CPU ranks that share cores time-share them: read the times as a comparison of
configurations, not as a speedup (the report says when that is the case).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

from .profiling import PeakMemory, PhaseTimer

__all__ = ["add_arguments", "help_description", "run"]

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Smallest tolerance per dtype: the baseline error of a tiny problem can be ~0.
_FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class _Config:
    world_size: int
    ring: int
    ulysses: int
    seq_len: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: str
    device: str
    backend: str
    seed: int
    iters: int


def help_description() -> str:
    """This module's docstring as ``--help`` shows it: inline literals (double backticks) and roles
    (``:func:`x```) reduced to their text, line breaks kept (use ``RawDescriptionHelpFormatter``)."""
    text = re.sub(r"``(.+?)``", r"\1", __doc__.strip(), flags=re.DOTALL)
    return re.sub(r":(?:[a-z]+:)?[a-z]+:`~?([^`]+)`", r"\1", text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument("--world-size", type=int, default=4, help="number of local ranks (default 4)")
    parser.add_argument("--ring", type=int, default=2, help="ring size R (default 2)")
    parser.add_argument("--ulysses", type=int, default=2, help="Ulysses size U (default 2)")
    parser.add_argument("--seq-len", type=int, default=3001, help="global sequence length (default 3001)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--heads", type=int, default=9, help="query heads H (default 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads Hkv, dividing H (default 3)")
    parser.add_argument("--head-dim", type=int, default=32, help="head dim D (default 32)")
    parser.add_argument("--causal", action="store_true", help="causal attention")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="dtype (default float32)")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA + NCCL when there are >= world-size GPUs, else CPU + gloo (default auto)",
    )
    parser.add_argument("--backend", default="auto", help="seqpar attention backend (default auto)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--iters", type=int, default=3, help="timed calls after one warm-up call (default 3)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def _inputs(cfg: _Config, dp_rank: int) -> tuple[torch.Tensor, ...]:
    """Full q, k, v, dout ``[B, S, H(kv), D]`` in float64 (identical on every rank of a replica)."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + dp_rank)
    shape_q = (cfg.batch, cfg.seq_len, cfg.heads, cfg.head_dim)
    shape_kv = (cfg.batch, cfg.seq_len, cfg.kv_heads, cfg.head_dim)
    return tuple(
        torch.randn(shape, generator=g, dtype=torch.float64)
        for shape in (shape_q, shape_kv, shape_kv, shape_q)
    )


def _measure(call, timer: PhaseTimer, iters: int) -> dict:
    """Median forward/backward seconds of ``call() -> (out, backward)`` after one warm-up call,
    each phase ended by a mark of ``timer``, and the tensor bytes one call creates at its peak
    (``PeakMemory``: CUDA the allocator's peak above the start, CPU storages created)."""
    out, backward = call()  # warm-up: imports, workspace, caches
    backward()
    del out
    fwd, bwd = [], []
    for _ in range(iters):
        timer.start()
        out, backward = call()
        timer.mark()
        backward()
        f, b = timer.stop()
        fwd.append(f)
        bwd.append(b)
        del out
    with PeakMemory(timer.device) as mem:
        out, backward = call()
        backward()
        del out
    return {"fwd_ms": 1e3 * statistics.median(fwd), "bwd_ms": 1e3 * statistics.median(bwd), "peak_bytes": mem.peak}


def _attention_call(seqpar, q, k, v, dout, state, cfg: _Config, seq_len: int):
    def call():
        for t in (q, k, v):
            t.grad = None
        out = seqpar.attention(q, k, v, state, causal=cfg.causal, backend=cfg.backend, seq_len=seq_len)
        return out, lambda: out.backward(dout)

    return call


def _rank_main(rank: int, cfg: _Config, store_dir: str) -> None:
    import torch.distributed as dist

    import seqpar

    device = torch.device(f"cuda:{rank}") if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    store = dist.FileStore(os.path.join(store_dir, "store"), cfg.world_size)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=cfg.world_size,
        timeout=timedelta(seconds=300),
    )
    say = _progress if rank == 0 else (lambda text: None)
    try:
        state = seqpar.ParallelState(cfg.ring, cfg.ulysses)
        say(f"{cfg.world_size} ranks up; timing {cfg.iters} forward+backward calls after a warm-up call")
        dtype = _DTYPES[cfg.dtype]
        q, k, v, dout = (seqpar.shard(t, state).to(device, dtype) for t in _inputs(cfg, state.dp_rank))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        # Every mark waits for the device and for the CP group: a phase lasts as on its slowest rank.
        timer = PhaseTimer(device, barrier=True, group=state.cp_group)
        stats = _measure(_attention_call(seqpar, q, k, v, dout, state, cfg, cfg.seq_len), timer, cfg.iters)
        say("measured; one more call for the comparison with one device")
        for t in (q, k, v):
            t.grad = None
        out = seqpar.attention(q, k, v, state, causal=cfg.causal, backend=cfg.backend, seq_len=cfg.seq_len)
        out.backward(dout)
        result = {
            "rank": rank,
            "dp": state.dp_rank,
            "cp": state.cp_rank,
            "ring": state.ring_rank,
            "ulysses": state.ulysses_rank,
            "tokens": q.shape[1],
            **stats,
            "workspace_bytes": state.workspace.nbytes,
            "out": out.detach().cpu(),
            "dq": q.grad.cpu(),
            "dk": k.grad.cpu(),
            "dv": v.grad.cpu(),
        }
        torch.save(result, os.path.join(store_dir, f"rank{rank}.pt"))
        dist.barrier()  # tear down together (see seqpar.tools.bench.torchrun_group)
        state.close()
    finally:
        dist.destroy_process_group()


def _single_device(cfg: _Config) -> dict:
    """One device, the whole sequence, the same kernel and dtype, one rank's thread count."""
    import seqpar

    device = torch.device("cuda:0") if cfg.device == "cuda" else torch.device("cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    try:
        state = seqpar.ParallelState()
        q, k, v, dout = (t.to(device, _DTYPES[cfg.dtype]) for t in _inputs(cfg, 0))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        stats = _measure(_attention_call(seqpar, q, k, v, dout, state, cfg, cfg.seq_len), PhaseTimer(device), cfg.iters)
        stats["workspace_bytes"] = state.workspace.nbytes
        return stats
    finally:
        torch.set_num_threads(threads)


def _reference(cfg: _Config, dp_rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Single-device SDPA forward/backward of a replica's sequence in ``dtype``, bshd results."""
    import torch.nn.functional as F

    q, k, v, dout = (t.to(dtype) for t in _inputs(cfg, dp_rank))
    q, k, v = (t.transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal, enable_gqa=cfg.kv_heads != cfg.heads)
    out.backward(dout.transpose(1, 2))
    return {
        name: t.transpose(1, 2).detach()
        for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
    }


def _check(args: argparse.Namespace) -> _Config:
    def fail(msg: str):
        raise SystemExit(f"seqpar demo: {msg}")

    for name in ("world_size", "ring", "ulysses", "seq_len", "batch", "heads", "kv_heads", "head_dim", "iters"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world_size % (args.ring * args.ulysses) != 0:
        fail(
            f"--ring {args.ring} x --ulysses {args.ulysses} = {args.ring * args.ulysses} must divide "
            f"--world-size {args.world_size}"
        )
    if args.heads % args.kv_heads != 0:
        fail(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    device = args.device
    if device == "auto":
        device = (
            "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "cpu"
        )
    if device == "cuda" and torch.cuda.device_count() < args.world_size:
        fail(f"--device cuda needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
    return _Config(
        args.world_size,
        args.ring,
        args.ulysses,
        args.seq_len,
        args.batch,
        args.heads,
        args.kv_heads,
        args.head_dim,
        bool(args.causal),
        args.dtype,
        device,
        args.backend,
        args.seed,
        args.iters,
    )


def _progress(text: str) -> None:
    """A progress line on stderr (stdout keeps the report, or the JSON)."""
    print(f"seqpar demo: {text}", file=sys.stderr, flush=True)


def _head_split(cfg: _Config) -> list[int]:
    """Query heads per Ulysses rank, e.g. ``[5, 4]`` for H=9 over U=2."""
    from seqpar.placement.sizes import split_sizes

    return split_sizes(cfg.heads, cfg.ulysses)


def _memory_notes(cfg: _Config, workspace_mib: float) -> list[str]:
    """What the ``x ideal`` column means, and why it is above 1 here."""
    cp = cfg.ring * cfg.ulysses
    heads = _head_split(cfg)
    notes = [
        f"x ideal: this rank's memory x {cp} / one device's memory for the whole sequence; 1.00 would be an "
        f"exact 1/{cp} share. Above 1 because a rank also holds communication buffers the single device does "
        "not need: Ulysses' all-to-all inputs and outputs (its ring-local tokens for its heads), the ring's K/V "
        f"block in flight next to the current one, and dK/dV travelling back (counted; of them "
        f"{workspace_mib:.1f} MiB per rank stay allocated between calls)."
    ]
    uneven_kv = cfg.ulysses > 1 and cfg.kv_heads % cfg.ulysses != 0
    if len(set(heads)) > 1 or uneven_kv:
        split_kv = (
            f", and the {cfg.kv_heads} K/V heads do not split evenly: a K/V head read by several Ulysses ranks is "
            "sent to each of them" if uneven_kv else ""
        )
        notes.append(
            f"uneven heads: H={cfg.heads} query heads over ulysses {cfg.ulysses} are split {heads}, so a Ulysses rank "
            f"holds up to {max(heads)}/{cfg.heads} of them, not 1/{cfg.ulysses}{split_kv}. The demo's default shape "
            "is this worst case on purpose (nothing needs to divide anything); with heads that divide "
            "(--heads 8 --kv-heads 2) every rank holds the same share and x ideal drops (3.0 instead of 4.9 "
            "at this size on CPU)."
        )
    return notes


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run(args: argparse.Namespace) -> int:
    """Run the demo; print the table and the verification line. Returns the exit code (0 = OK)."""
    import torch.multiprocessing as mp

    import seqpar

    from .report import origin

    cfg = _check(args)
    dtype = _DTYPES[cfg.dtype]
    _progress(origin())
    say = (lambda *a, **k: None) if args.json else print
    say(
        f"seqpar demo: {cfg.world_size} ranks ({'nccl' if cfg.device == 'cuda' else 'gloo'}, {cfg.device}), "
        f"ring {cfg.ring} x ulysses {cfg.ulysses} (dp {cfg.world_size // (cfg.ring * cfg.ulysses)}), "
        f"B={cfg.batch} S={cfg.seq_len} H={cfg.heads} Hkv={cfg.kv_heads} D={cfg.head_dim}, {cfg.dtype}, "
        f"{'causal' if cfg.causal else 'non-causal'}",
        flush=True,
    )
    start = time.perf_counter()
    _progress(f"starting {cfg.world_size} rank processes (spawn: each imports torch, a few seconds)")
    with tempfile.TemporaryDirectory(prefix="seqpar-demo-") as tmp:
        mp.start_processes(
            _rank_main, args=(cfg, tmp), nprocs=cfg.world_size, start_method="spawn", join=True
        )
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(cfg.world_size)]
    spawn_s = time.perf_counter() - start
    _progress(f"ranks done in {spawn_s:.1f}s; timing the whole sequence on one device")
    single = _single_device(cfg)
    _progress("computing the float64 single-device reference and comparing")

    exact: dict[int, dict[str, torch.Tensor]] = {}
    same: dict[int, dict[str, torch.Tensor]] = {}
    for dp in sorted({r["dp"] for r in results}):
        exact[dp] = _reference(cfg, dp, torch.float64)
        same[dp] = _reference(cfg, dp, dtype)
    base_out = max(_max_err(same[dp]["out"], exact[dp]["out"]) for dp in exact)
    base_grad = max(_max_err(same[dp][g], exact[dp][g]) for dp in exact for g in ("dq", "dk", "dv"))
    tol_out = max(2 * base_out, _FLOOR[dtype])
    tol_grad = max(2 * base_grad, _FLOOR[dtype])

    cp = cfg.ring * cfg.ulysses
    placement = seqpar.placement.Placement.dense(cfg.seq_len, cfg.ring, cfg.ulysses)
    rows = []
    worst_out = worst_grad = 0.0
    for r in results:
        idx = placement.global_index(r["ring"] * cfg.ulysses + r["ulysses"])
        ref = exact[r["dp"]]
        e_out = _max_err(r["out"], ref["out"][:, idx])
        e_grad = max(_max_err(r[g], ref[g][:, idx]) for g in ("dq", "dk", "dv"))
        worst_out, worst_grad = max(worst_out, e_out), max(worst_grad, e_grad)
        rows.append({
            key: r[key] for key in ("rank", "dp", "ring", "ulysses", "tokens", "fwd_ms", "bwd_ms", "peak_bytes",
                                    "workspace_bytes")
        } | {
            # Everything counted (the call's peak plus the bytes the state keeps) against a perfect
            # 1/cp share of the single device's (1.0 = ideal).
            "total_bytes": r["peak_bytes"] + r["workspace_bytes"],
            "memory_vs_ideal": (r["peak_bytes"] + r["workspace_bytes"]) * cp
            / max(1, single["peak_bytes"] + single["workspace_bytes"]),
            "out_err": e_out, "grad_err": e_grad,
        })
    ok = worst_out <= tol_out and worst_grad <= tol_grad
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    shared = cfg.device == "cpu" and cfg.world_size > cores
    report = {
        "config": asdict(cfg),
        "ok": ok,
        "ranks": rows,
        "single_device": single,
        "fwd_vs_single": max(r["fwd_ms"] for r in rows) / single["fwd_ms"],
        "bwd_vs_single": max(r["bwd_ms"] for r in rows) / single["bwd_ms"],
        "tolerance": {"out": tol_out, "grad": tol_grad, "single_dtype_err_out": base_out,
                      "single_dtype_err_grad": base_grad},
        "max_err": {"out": worst_out, "grad": worst_grad},
        "cores": cores,
        "time_shared": shared,
        "wall_s": spawn_s,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0 if ok else 1
    header = (
        f"{'rank':>4} {'dp':>3} {'ring':>4} {'uly':>4} {'tokens':>7} {'fwd ms':>8} {'bwd ms':>8} "
        f"{'MiB':>7} {'x ideal':>7} {'|out err|':>10} {'|grad err|':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['rank']:>4} {r['dp']:>3} {r['ring']:>4} {r['ulysses']:>4} {r['tokens']:>7} "
            f"{r['fwd_ms']:>8.1f} {r['bwd_ms']:>8.1f} {r['total_bytes'] / 2**20:>7.1f} "
            f"{r['memory_vs_ideal']:>7.2f} {r['out_err']:>10.2e} {r['grad_err']:>10.2e}"
        )
    print(
        f"one device, whole sequence, same kernel: fwd {single['fwd_ms']:.1f} ms, bwd {single['bwd_ms']:.1f} ms, "
        f"{single['peak_bytes'] / 2**20:.1f} MiB; slowest rank / one device: fwd "
        f"{report['fwd_vs_single']:.2f}, bwd {report['bwd_vs_single']:.2f}"
    )
    print(
        f"times: median of {cfg.iters} calls after a warm-up; MiB: everything a rank holds for one call, the "
        f"storage created in it ({'CUDA allocator peak' if cfg.device == 'cuda' else 'counted per storage'}) plus "
        "the buffers its state keeps between calls"
    )
    for note in _memory_notes(cfg, max(r["workspace_bytes"] for r in rows) / 2**20):
        print(textwrap.fill(note, 100, subsequent_indent="  "))
    if shared:
        print(
            f"note: {cfg.world_size} ranks share {cores} CPU core(s); rank times include the time-sharing and "
            "are not a speedup measurement"
        )
    print(
        f"single-device {cfg.dtype} error vs float64: out {base_out:.2e}, grad {base_grad:.2e}; "
        f"tolerance out {tol_out:.1e}, grad {tol_grad:.1e}; wall {spawn_s:.1f}s"
    )
    verdict = "OK" if ok else "FAILED"
    print(
        f"demo: {verdict} — max |out err| {worst_out:.2e} (tol {tol_out:.1e}), max |grad err| "
        f"{worst_grad:.2e} (tol {tol_grad:.1e}) vs single-device float64 SDPA",
        flush=True,
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m seqpar.tools.demo``."""
    parser = argparse.ArgumentParser(
        prog="seqpar demo", description=help_description(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
