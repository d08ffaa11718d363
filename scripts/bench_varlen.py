"""Benchmark packed variable-length attention across CP configurations against one device.

For a long-tailed mix of document lengths (log-normal, packed into one ``--total``-token batch)
and each ``RxU`` configuration (ring x Ulysses), every rank times ``seqpar.varlen_attention`` on
its ``shard_packed`` shard, forward and forward+backward, and reports its peak memory; the same
attention is run unsharded (one process, ``ParallelState()``) as the baseline. The attention work
per rank (``seqpar.placement.attention_work``: attended (query, key, head) triples) gives the
balance that the timings should follow.

Work balance is also printed, without timing (host maths on the placement and the ring plan),
for realistic mixes -- 1000 documents of 1..64 tokens, one 60k-token document with 300 of 200
tokens, 64 equal documents, and the timed mix -- over the ``--balance-configs``:

- ``ring max/mean``: the attended (query, key) pairs of each ring rank (per head), max / mean --
  what the placement (zig-zag per sequence, remainders rotated) balances;
- ``cp max/mean``: the same per CP rank with the ``--heads`` query heads split over Ulysses as
  the all-to-all splits them (``split_sizes(H, U)``): adds the head-split imbalance when ``U``
  does not divide ``H``;
- ``tokens max/mean``: local tokens per CP rank.

Two launchers:

- default: a local gloo pool of ``--world`` CPU processes (``seqpar.tools.testing.DistPool``), one
  thread each, the baseline in the parent with one thread. On a machine with fewer cores than
  ranks the per-rank times include time-sharing (the output warns); work balance does not
  depend on it.
- ``python -m torch.distributed.run --nproc-per-node N scripts/bench_varlen.py --device cuda ...``: one process per
  GPU with NCCL (rank 0 prints; the baseline runs on rank 0's device).

Output: the tables, notes and warnings, then the whole report as one JSON line (last line);
``--json PATH`` also writes it to a file; ``--plot PATH`` saves a chart of the ``cp max/mean``
work balance of every mix per ``--balance-configs`` configuration.

Examples::

    python scripts/bench_varlen.py                          # ~1-2 min on 2 cores
    python scripts/bench_varlen.py --balance-only           # balance tables only, seconds
    python scripts/bench_varlen.py --balance-only --plot balance.png
    python scripts/bench_varlen.py --total 131072 --heads 8 --head-dim 64 --world 8 \\
        --configs 8x1,4x2,2x4,1x8 --json out.json
"""

from __future__ import annotations

import math
import random
import statistics

import torch

import seqpar
from seqpar.placement import Mask, Placement, attention_work, imbalance, split_sizes
from seqpar.tools.bench import (
    Ranks,
    few_iterations_warning,
    inputs,
    parse_configs,
    time_sharing_warning,
    usable_cores,
)
from seqpar.tools.profiling import PeakMemory, iteration_seconds
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def length_mix(total: int, median: int, sigma: float, seed: int) -> list[int]:
    """Log-normal document lengths (clipped to ``[1, total]``) packed to exactly ``total`` tokens."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        n = int(rng.lognormvariate(math.log(median), sigma))
        lens.append(min(max(n, 1), total))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def mix_summary(lens: list[int]) -> dict:
    s = sorted(lens)
    return {
        "sequences": len(s),
        "total": sum(s),
        "min": s[0],
        "median": s[len(s) // 2],
        "max": s[-1],
        # The length a random attended (query, key) pair sits in; what the balance bound needs.
        "work_weighted_mean": round(sum(n * n for n in s) / sum(s), 1),
    }


def measure(cfg: dict, state: seqpar.ParallelState, device: torch.device, together: bool) -> dict:
    """Time and memory of this rank's varlen_attention on its shard of the configured batch.

    With ``together``, all ranks start each timed call at once (a barrier); the unsharded
    baseline runs alone. Peak memory: ``PeakMemory(resident=True)`` over the timed fwd+bwd calls
    (the CUDA allocator's high-water mark, or the CPU process's resident set).
    """
    lens, causal = cfg["lens"], cfg["causal"]
    q, k, v, dout = inputs((sum(lens),), cfg["heads"], cfg["kv_heads"], cfg["head_dim"], seed=cfg["seed"],
                           device=device, dtype=DTYPES[cfg["dtype"]])
    ql, kl, vl, dl = (seqpar.shard_packed(t, state, lens) for t in (q, k, v, dout))
    del q, k, v, dout
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))

    def forward():
        with torch.no_grad():
            seqpar.varlen_attention(ql, kl, vl, state, lens, causal=causal, backend=cfg["backend"])

    def forward_backward():
        out = seqpar.varlen_attention(ql, kl, vl, state, lens, causal=causal, backend=cfg["backend"])
        torch.autograd.grad(out, (ql, kl, vl), dl)

    fwd = iteration_seconds(forward, cfg["iters"], device, warmup=cfg["warmup"], barrier=together)
    iteration_seconds(forward_backward, 0, device, warmup=cfg["warmup"], barrier=together)
    with PeakMemory(device, resident=True) as mem:
        fwd_bwd = iteration_seconds(forward_backward, cfg["iters"], device, warmup=0, barrier=together)
    return {
        "tokens": ql.shape[0],
        "fwd_s": statistics.median(fwd),
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "peak_bytes": mem.peak,
    }


def _rank(cfg: dict, R: int, U: int, device: torch.device) -> dict:
    """Runs on every rank (module level so that it pickles): this rank's figures under ``R x U``."""
    state = seqpar.ParallelState(ring_size=R, ulysses_size=U)
    try:
        return measure(cfg, state, device, together=True)
    finally:
        state.close()


def realistic_mixes(timed: list[int], seed: int) -> dict[str, list[int]]:
    """The document-length mixes whose work balance is reported (the timed mix last)."""
    rng = random.Random(seed)
    return {
        "1000 docs of 1..64": [rng.randint(1, 64) for _ in range(1000)],
        "60000 + 300 x 200": [60000] + [200] * 300,
        "64 x 1024": [1024] * 64,
        "timed (log-normal)": timed,
    }


def balance(lens: list[int], R: int, U: int, causal: bool, heads: int) -> dict:
    """Work and token balance of ``lens`` over ring ``R`` x Ulysses ``U`` (host maths only)."""
    placement = Placement.packed(lens, R, U)
    mask = Mask(causal).normalised(max(lens, default=0))
    per_ring = attention_work(placement, mask)[::U]  # pairs per head of each ring rank
    # As attention_work(..., num_heads=heads): query heads split over Ulysses like the all-to-all.
    per_cp = [w * h for w in per_ring for h in split_sizes(heads, U)]
    tokens = list(placement.shard_lengths)
    return {
        "config": f"{R}x{U}", "ring_size": R, "ulysses_size": U,
        "ring_work_per_rank": per_ring, "ring_max_over_mean": imbalance(per_ring),
        "cp_work_per_rank": per_cp, "cp_max_over_mean": imbalance(per_cp),
        "tokens_per_rank": tokens, "tokens_max_over_mean": imbalance(tokens),
    }


def _summarise(R: int, U: int, ranks: list[dict], cfg: dict, base: dict) -> dict:
    cp = R * U
    ranks = ranks[:cp]  # one CP group
    bal = balance(cfg["lens"], R, U, cfg["causal"], cfg["heads"])
    fb = [r["fwd_bwd_s"] for r in ranks]
    peaks = [r["peak_bytes"] for r in ranks if r["peak_bytes"] is not None]
    return {
        "config": f"{R}x{U}",
        "ring_size": R,
        "ulysses_size": U,
        "per_rank": ranks,
        "work_per_rank": bal["cp_work_per_rank"],
        "work_max_over_mean": bal["cp_max_over_mean"],
        "ring_work_max_over_mean": bal["ring_max_over_mean"],
        "tokens_max_over_mean": max(r["tokens"] for r in ranks) * cp / sum(r["tokens"] for r in ranks),
        "fwd_s_max": max(r["fwd_s"] for r in ranks),
        "fwd_bwd_s_max": max(fb),
        "time_max_over_mean": max(fb) / statistics.mean(fb),
        "speedup_fwd_bwd": base["fwd_bwd_s"] / max(fb),
        "peak_mib_max": max(peaks) / 2**20 if peaks else None,
    }


def _timing_table(results: list[dict], base: dict) -> str:
    cols = ["config", "fwd ms", "fwd+bwd ms", "speedup", "time max/mean", "work max/mean", "peak MiB"]
    mib = None if base["peak_bytes"] is None else f"{base['peak_bytes'] / 2**20:.1f}"
    rows = [["1 (ref)", f"{base['fwd_s'] * 1e3:.1f}", f"{base['fwd_bwd_s'] * 1e3:.1f}", "1.00", None, None, mib]]
    for r in results:
        rows.append([
            r["config"], f"{r['fwd_s_max'] * 1e3:.1f}", f"{r['fwd_bwd_s_max'] * 1e3:.1f}",
            f"{r['speedup_fwd_bwd']:.2f}", f"{r['time_max_over_mean']:.3f}", f"{r['work_max_over_mean']:.4f}",
            None if r["peak_mib_max"] is None else f"{r['peak_mib_max']:.1f}",
        ])
    return table(cols, rows)


def _balance_table(balances: dict[str, dict]) -> str:
    cols = ["mix", "docs", "tokens", "longest", "R x U", "ring max/mean", "cp max/mean", "tokens max/mean"]
    rows = []
    for name, entry in balances.items():
        mix = entry["mix"]
        for b in entry["configs"]:
            rows.append([
                name, mix["sequences"], mix["total"], mix["max"], b["config"], f"{b['ring_max_over_mean']:.4f}",
                f"{b['cp_max_over_mean']:.4f}", f"{b['tokens_max_over_mean']:.4f}",
            ])
    return table(cols, rows)


def main(argv: list[str] | None = None) -> None:
    p = script_parser(__doc__)
    p.add_argument("--total", type=int, default=32768, help="packed tokens of the timed batch")
    p.add_argument("--median", type=int, default=1024, help="median document length")
    p.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma (tail weight)")
    p.add_argument("--heads", type=int, default=4, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv")
    p.add_argument("--head-dim", type=int, default=32, help="head dim D")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="non-causal attention (default: causal)")
    p.add_argument("--configs", default="4x1,2x2,1x4", help="timed RxU (ring x ulysses), comma-separated")
    p.add_argument("--balance-configs", default="2x1,4x1,8x1,2x2,4x2,2x4,1x4",
                   help="RxU whose work balance is computed for every mix (host maths)")
    p.add_argument("--balance-only", action="store_true", help="print the balance tables only, no timing")
    p.add_argument("--world", type=int, default=4, help="processes of the local pool")
    p.add_argument("--device", default="cpu", help="cpu, or cuda under torchrun")
    p.add_argument("--backend", default="auto", help="attention backend")
    p.add_argument("--iters", type=int, default=3, help="timed calls per configuration; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--seed", type=int, default=0, help="seed of the length mixes and the inputs")
    add_output_arguments(p, "the cp max/mean work balance of every mix per --balance-configs configuration")
    args = p.parse_args(argv)

    configs = parse_configs(args.configs)
    lens = length_mix(args.total, args.median, args.sigma, args.seed)
    cfg = {
        "lens": lens, "causal": args.causal, "heads": args.heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "dtype": args.dtype, "backend": args.backend,
        "iters": args.iters, "warmup": args.warmup, "seed": args.seed,
    }
    base, results = None, []
    with Ranks(args.world, device=args.device, timeout_s=3600) as ranks:
        if not ranks.torchrun:
            torch.set_num_threads(1)  # the same as each local rank
        torchrun, world, rank, device = ranks.torchrun, ranks.world, ranks.rank, ranks.device
        if not args.balance_only:
            for R, U in configs:
                if world % (R * U):
                    raise SystemExit(f"--configs: {R}x{U} = {R * U} ranks does not divide the world of {world}")
            if rank == 0:
                progress("bench_varlen", "unsharded baseline")
                base = measure(cfg, seqpar.ParallelState(), device, together=False)
            for R, U in configs:
                if rank == 0:
                    progress("bench_varlen", f"ring {R} x ulysses {U}")
                gathered = ranks.run(_rank, cfg, R, U, device)
                if rank == 0:
                    results.append(_summarise(R, U, gathered, cfg, base))
    if rank != 0:
        return

    balances = {
        name: {
            "mix": mix_summary(mix),
            "configs": [balance(mix, R, U, args.causal, args.heads) for R, U in parse_configs(args.balance_configs, "--balance-configs")],
        }
        for name, mix in realistic_mixes(lens, args.seed).items()
    }
    settings = {k: v for k, v in cfg.items() if k != "lens"} | {
        "world": world, "device": str(device), "launcher": "torchrun" if torchrun else "pool",
        "cpu_cores": usable_cores(),
    }
    report = {
        "mix": mix_summary(lens), "settings": settings, "unsharded": base, "results": results,
        "balance": balances, "seq_lens": lens,
    }
    mask = "causal" if args.causal else "non-causal"
    parts = [f"timed mix: {report['mix']}", f"settings: {settings}"]
    if results:
        parts += ["", f"{mask} varlen attention, slowest rank's median (work max/mean: per CP rank, H={args.heads}):",
                  _timing_table(results, base)]
    title = (f"{mask} work balance (host maths; ring: pairs per ring rank; cp: with H={args.heads} heads "
             "split over Ulysses; max/mean, 1.0 = perfect):")
    parts += ["", title, _balance_table(balances)]
    notes = []
    if results:
        notes = [
            None if torchrun else time_sharing_warning(world, usable_cores(), device.type),
            few_iterations_warning(args.iters),
            "WARNING: --warmup 0: each first timed call includes one-time costs (allocations, plans), so "
            "times and speedups mislead; use --warmup 1 or more" if args.warmup == 0 else None,
        ]
    plot = chart(
        args.plot,
        f"{mask} varlen attention work per CP rank, max / mean (1.0 = perfect balance; host maths, H={args.heads} "
        "heads split over Ulysses)",
        [b["config"] for b in next(iter(balances.values()))["configs"]],
        {name: [b["cp_max_over_mean"] for b in entry["configs"]] for name, entry in balances.items()},
        "attended (query, key, head) triples per CP rank, max / mean",
        value_format=".4f",
    )
    emit(report, "\n".join(parts), notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
