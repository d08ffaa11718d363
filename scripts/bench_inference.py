"""Benchmark long-context inference with the sharded KV cache against one device.

For every ring x Ulysses configuration and prompt length, every rank prefills its shard of a
random prompt through ``seqpar.inference.prefill`` (one attention layer), then runs ``--steps``
decode steps through ``seqpar.inference.decode``; CP rank 0 then does the same on one device
(a size-1 state: the whole prompt, the whole cache) while the others wait. Reported per row:

* ``prefill x``: prefill time on the CP ranks / on one device (the slowest rank);
* ``cache MiB`` and ``cache x``: the largest per-rank cache (every byte of its buffers, spare
  capacity and positions included) after the prefill and after the decode steps, and that times
  N over the one-device cache (1.0 is a perfect 1/N share);
* ``step ms`` and ``step x``: mean decode step time on the CP ranks / on one device;
* ``bytes/step``: bytes each rank sends per layer and decode step (counted on the collectives
  the step calls), which must not grow with the prompt.

Attention only (no model, one layer): the MLPs and projections a model runs on every rank per new
token are left out. Local ranks share the machine's cores, so CPU times are ratios of a crowded
machine; run under torchrun with ``--device cuda`` (one GPU per rank) for device timings.

    python scripts/bench_inference.py                               # 4 ranks: 2x2, 4x1; 3 prompt lengths
    python scripts/bench_inference.py --configs 2x1 --world 2 --prompt-lens 256,1024 --steps 8
    torchrun --nproc-per-node 4 scripts/bench_inference.py --device cuda --prompt-lens 8192,32768,131072
    python scripts/bench_inference.py --plot inference.png          # chart of the ratios

Output: the table and notes, then the whole report as one JSON line (last line); ``--json PATH``
also writes it to a file.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import seqpar
from seqpar.inference import KVCache, decode, prefill
from seqpar.tools.bench import Ranks, parse_configs
from seqpar.tools.report import Panel, add_output_arguments, chart_panels, emit, progress, script_parser, table


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CountBytes:
    """Bytes this rank sends through torch.distributed's all-gathers while active."""

    _NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.sent = 0
        self._saved: dict = {}

    def __enter__(self) -> _CountBytes:
        for name in self._NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def counted(out, t, *a, _fn=fn, **k):
                self.sent += t.numel() * t.element_size()
                return _fn(out, t, *a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _run(state: seqpar.ParallelState, args: argparse.Namespace, S: int, device: torch.device) -> dict:
    """Prefill ``S`` tokens and decode ``args.steps`` on ``state``; times, bytes and cache sizes."""
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, S, args.heads, args.head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, S, args.kv_heads, args.head_dim, generator=g).to(device, dtype)
    new = [torch.randn(1, 1, h, args.head_dim, generator=g).to(device, dtype) for h in (args.heads, args.kv_heads)]
    opts = dict(causal=True, window=(args.window, 0) if args.window else (-1, -1))
    qs, ks = seqpar.shard(q, state), seqpar.shard(k, state)
    for _ in range(args.warmup):  # warm-up prefill and steps on a throwaway cache
        warm = KVCache(state, 1)
        prefill(qs, ks, ks, warm, 0, **opts)
        decode(new[0], new[1], new[1], warm, 0, **opts)
    cache = KVCache(state, 1)
    _sync(device)
    t0 = time.perf_counter()
    prefill(qs, ks, ks, cache, 0, **opts)
    _sync(device)
    t_prefill = time.perf_counter() - t0
    bytes_prefill = cache.nbytes
    with _CountBytes() as counter:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            decode(new[0], new[1], new[1], cache, 0, **opts)
        _sync(device)
        t_step = (time.perf_counter() - t0) / args.steps
    return {
        "prefill_s": t_prefill, "step_s": t_step, "cache_prefill": bytes_prefill, "cache_after": cache.nbytes,
        "bytes_per_step": counter.sent / args.steps,
    }


def measure(args: argparse.Namespace, R: int, U: int, S: int) -> dict:
    """On every rank: the CP run; then CP rank 0 alone on one device."""
    device = torch.device(args.device_resolved) if args.device_resolved != "cpu" else torch.device("cpu")
    state = seqpar.ParallelState(R, U)
    cp = _run(state, args, S, device)
    one = None
    dist.barrier()
    if dist.get_rank() == 0:
        one = _run(seqpar.ParallelState(), args, S, device)
    dist.barrier()
    return {"cp": cp, "one": one}


def _parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--world", type=int, default=4, help="local CPU ranks (ignored under torchrun)")
    p.add_argument("--configs", default="2x2,4x1", help="ring x Ulysses splits, comma-separated")
    p.add_argument("--prompt-lens", default="512,2048,8192", help="prompt lengths, comma-separated")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per row")
    p.add_argument("--warmup", type=int, default=1, help="warm-up prefills (and one step) per row")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="K/V heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dim")
    p.add_argument("--window", type=int, default=0, help="causal window left side (0: none)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda needs torchrun, one GPU per rank")
    add_output_arguments(p, "the prefill, cache and decode-step ratios against one device")
    return p


def main() -> None:
    args = _parser().parse_args()
    lens = [int(x) for x in args.prompt_lens.split(",") if x]
    rows, report_rows = [], []
    with Ranks(args.world, device=args.device) as ranks:
        args.device_resolved = str(ranks.device)
        for R, U in parse_configs(args.configs):
            if R * U != ranks.world:
                raise SystemExit(f"--configs {R}x{U} needs {R * U} ranks, have {ranks.world}")
            for S in lens:
                progress("bench_inference", f"{R}x{U}, prompt {S}")
                per_rank = ranks.run(measure, args, R, U, S)
                cps, one = [r["cp"] for r in per_rank], per_rank[0]["one"]
                n = R * U
                row = {
                    "config": f"{R}x{U}", "prompt": S,
                    "prefill_x": max(c["prefill_s"] for c in cps) / one["prefill_s"],
                    "cache_mib": max(c["cache_after"] for c in cps) / 2**20,
                    "cache_x_prefill": max(c["cache_prefill"] for c in cps) * n / one["cache_prefill"],
                    "cache_x": max(c["cache_after"] for c in cps) * n / one["cache_after"],
                    "step_ms": 1e3 * max(c["step_s"] for c in cps), "step_ms_one": 1e3 * one["step_s"],
                    "step_x": max(c["step_s"] for c in cps) / one["step_s"],
                    "bytes_per_step": max(c["bytes_per_step"] for c in cps),
                }
                report_rows.append(row)
                rows.append([
                    f"{R}x{U} S={S}", f"{row['prefill_x']:.2f}", f"{row['cache_mib']:.2f}",
                    f"{row['cache_x_prefill']:.3f}", f"{row['cache_x']:.3f}", f"{row['step_ms']:.2f}",
                    f"{row['step_ms_one']:.2f}", f"{row['step_x']:.2f}", f"{row['bytes_per_step']:.0f}",
                ])
    if ranks.rank != 0:
        return
    text = table(
        ["config", "prefill x", "cache MiB", "cache x (prefill)", "cache x", "step ms", "step ms (1 dev)",
         "step x", "bytes/step"], rows,
    )
    notes = [
        "x = CP ranks / one device (time: slowest rank; cache: largest rank x N); attention only, one layer",
        f"{args.steps} decode steps per row; bytes/step = bytes each rank sends per layer and step",
    ]
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}, "rows": report_rows}
    labels = [f"{r['config']} S={r['prompt']}" for r in report_rows]
    plot = chart_panels(
        args.plot, "seqpar inference vs one device", labels,
        [
            Panel("cache per rank x N / one device (1.0 ideal)", {"after decode": [r["cache_x"] for r in report_rows]}),
            Panel("time CP / one device", {"prefill": [r["prefill_x"] for r in report_rows],
                                           "decode step": [r["step_x"] for r in report_rows]}),
        ],
    )
    emit(report, text, notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
