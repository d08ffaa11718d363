"""Benchmark seqpar.comm.all_to_all: bytes allocated and time against a bare all_to_all_single.

For each case, every rank holds a shard and runs one ``all_to_all``; we report

* ``alloc/input``: bytes of tensor storage the call created (``seqpar.tools.profiling.StorageTracker``)
  over the input's bytes, largest over ranks; ``bound`` is the design bound, one staging copy
  of the input plus the output, ``(input + output) / input`` of the same rank: 2.0 when the split
  is even, more on a rank whose output is larger than its input (uneven splits);
  ``alloc/bound`` (at most 1.0 by design) is the number to check;
* ``time ratio``: median time of ``seqpar.comm.all_to_all`` over the median time of a bare
  ``torch.distributed.all_to_all_single`` moving the same bytes between preallocated contiguous
  buffers (no layout work, no allocation) -- the cost of the layout handling;
* ``ws ratio``: the same with the staging copy taken from a kept arena
  (``Workspace(keep=True)``, Note [Workspace]); ``ws alloc/input`` its bytes created per call;
* ``fresh ratio``: the same against a bare call that allocates its two buffers (a contiguous
  copy of the input and the output) on every call, as ``all_to_all`` must. On CPU large blocks
  go back to the OS when freed, so fresh buffers cost page faults on first touch; CUDA's caching
  allocator hides that, so there the plain ratio is the one to read.

Cases cover the Ulysses directions (scatter heads / gather tokens and back), batch > 1, a 5-D
video layout, and sizes that do not divide the group.

Output: the table, notes and warnings, then the whole report as one JSON line (last line);
``--json PATH`` also writes it to a file, ``--plot PATH`` saves a chart of the three time ratios
per case.

Run:
    python scripts/bench_all_to_all.py                 # CPU: spawns 4 gloo ranks
    python scripts/bench_all_to_all.py --world 3 --seq-len 8191
    python -m torch.distributed.run --nproc-per-node 8 scripts/bench_all_to_all.py   # CUDA/NCCL
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from seqpar.comm import Workspace, all_to_all, split_sizes
from seqpar.tools.bench import (
    Ranks,
    few_iterations_warning,
    time_sharing_warning,
    usable_cores,
)
from seqpar.tools.profiling import StorageTracker, iteration_seconds, max_over_ranks
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table


def _cases(args: argparse.Namespace, n: int) -> list[dict]:
    S, H, D = args.seq_len, args.heads, args.head_dim
    cases = []
    for B in sorted({1, args.batch}):
        # Ulysses forward: [B, S_local, H, D] -> [B, S, H_local, D]; and back.
        cases.append(dict(name=f"ulysses fwd B={B}", global_shape=[B, S, H, D], scatter=2, gather=1))
        cases.append(dict(name=f"ulysses bwd B={B}", global_shape=[B, S, H, D], scatter=1, gather=2))
    cases.append(dict(name="unaligned fwd", global_shape=[1, S + 1, H + 1, D], scatter=2, gather=1))
    cases.append(dict(name="unaligned bwd", global_shape=[1, S + 1, H + 1, D], scatter=1, gather=2))
    T = max(n + 1, 13)
    cases.append(
        dict(name="video 5-D", global_shape=[1, T, max(S // T, 1), H, D], scatter=3, gather=2)
    )
    return cases


def _run_case(case: dict, iters: int, device: torch.device, dtype: torch.dtype) -> dict:
    n, r = dist.get_world_size(), dist.get_rank()
    shape, sd, gd = case["global_shape"], case["scatter"], case["gather"]
    local_shape = list(shape)
    local_shape[gd] = split_sizes(shape[gd], n)[r]
    x = torch.randn(local_shape, device=device, dtype=dtype)
    with StorageTracker() as mem:
        y = all_to_all(x, None, sd, gd, gather_size=shape[gd])
    out_bytes = y.nbytes
    del y
    # With a kept arena (Workspace(keep=True), inside its scope): the staging copy reuses storage.
    ws = Workspace(keep=True)

    def kept() -> torch.Tensor:
        with ws.scope():
            return all_to_all(x, None, sd, gd, gather_size=shape[gd], workspace=ws)

    kept()
    with StorageTracker() as mem_ws:
        y = kept()
    del y
    # Bare collective: same total bytes, equal splits, preallocated contiguous buffers.
    numel = torch.tensor([x.numel()], device=device)
    dist.all_reduce(numel, op=dist.ReduceOp.MAX)  # equal sizes on every rank
    per = -(-int(numel.item()) // n)
    src = torch.empty(per * n, device=device, dtype=dtype)
    dst = torch.empty_like(src)

    def bare_fresh() -> None:
        staged = src.clone()
        dist.all_to_all_single(torch.empty_like(staged), staged, group=None)

    variants = {
        "seqpar": lambda: all_to_all(x, None, sd, gd, gather_size=shape[gd]),
        "workspace": kept,
        "bare": lambda: dist.all_to_all_single(dst, src, group=None),
        "fresh": bare_fresh,
    }
    # Interleaved: every round times one call of each variant, so drift on a shared machine hits
    # all of them alike; two untimed rounds first absorb the first-call costs.
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(iters + 2):
        for name, fn in variants.items():
            t = iteration_seconds(fn, 1, device, warmup=0)[0]
            if round_ >= 2:
                times[name].append(t)
    medians = max_over_ranks([statistics.median(times[name]) for name in variants], device)
    seconds, ws_seconds, bare, fresh = medians
    # Per rank: created bytes over the input's, the bound (staging + output) over the input's,
    # and created bytes over the bound; each the largest over ranks.
    inp = max(x.nbytes, 1)
    alloc = torch.tensor([mem.allocated / inp, (x.nbytes + out_bytes) / inp, mem.allocated / max(1, x.nbytes + out_bytes)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(alloc, op=dist.ReduceOp.MAX)
    over_input, bound, over_bound = alloc.tolist()
    return {
        "case": case["name"],
        "global_shape": shape,
        "scatter_dim": sd,
        "gather_dim": gd,
        "input_bytes": x.nbytes,
        "alloc_over_input": round(over_input, 3),
        "bound_over_input": round(bound, 3),
        "alloc_over_bound": round(over_bound, 3),
        "seconds": seconds,
        "bare_seconds": bare,
        "time_ratio": round(seconds / bare, 3) if bare > 0 else None,
        "workspace_seconds": ws_seconds,
        "workspace_ratio": round(ws_seconds / bare, 3) if bare > 0 else None,
        "workspace_alloc_over_input": round(mem_ws.allocated / inp, 3),
        "bare_fresh_seconds": fresh,
        "fresh_ratio": round(seconds / fresh, 3) if fresh > 0 else None,
    }


def bench(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    cases = _cases(args, dist.get_world_size())
    results = []
    for i, case in enumerate(cases):
        progress("bench_all_to_all", f"case {i + 1}/{len(cases)}: {case['name']} {case['global_shape']}")
        results.append(_run_case(case, args.iters, device, dtype))
    return results


def _report(results: list[dict], world: int, args: argparse.Namespace, device: str, ranks_per_node: int) -> None:
    head = ["case", "global shape", "s->g", "alloc/input", "bound", "alloc/bound", "ms", "bare ms", "ratio",
            "ws ms", "ws ratio", "ws alloc/input", "fresh ms", "fresh ratio"]
    rows = [[
        r["case"], str(r["global_shape"]), f"{r['scatter_dim']}->{r['gather_dim']}", f"{r['alloc_over_input']:.2f}",
        f"{r['bound_over_input']:.2f}", f"{r['alloc_over_bound']:.3f}",
        f"{r['seconds'] * 1e3:.2f}", f"{r['bare_seconds'] * 1e3:.2f}",
        None if r["time_ratio"] is None else f"{r['time_ratio']:.2f}",
        f"{r['workspace_seconds'] * 1e3:.2f}", f"{r['workspace_ratio']:.2f}", f"{r['workspace_alloc_over_input']:.2f}",
        f"{r['bare_fresh_seconds'] * 1e3:.2f}",
        None if r["fresh_ratio"] is None else f"{r['fresh_ratio']:.2f}",
    ] for r in results]
    over = [r["case"] for r in results if r["alloc_over_bound"] > 1.0]
    notes = [
        f"WARNING: allocation above the bound (staging copy + output) in: {', '.join(over)}" if over else None,
        time_sharing_warning(ranks_per_node, usable_cores(), device),
        few_iterations_warning(args.iters),
    ]
    text = "\n".join([
        (f"all_to_all over {world} ranks ({args.dtype}, {device}); bound = (input + output) / input per rank "
         f"(2.00 for even splits); times: slowest rank's median of {args.iters}"),
        table(head, rows),
        ("ratio = all_to_all / bare all_to_all_single on preallocated buffers (read this one on CUDA); fresh "
         "ratio = the same against a bare call that allocates its buffers per call (read this one on CPU)"),
    ])
    report = {"world_size": world, "dtype": args.dtype, "device": device, "iters": args.iters,
              "cpu_cores": usable_cores(), "results": results}
    plot = chart(
        args.plot,
        f"seqpar.comm.all_to_all / bare all_to_all_single over {world} ranks ({args.dtype}, {device}); slowest "
        f"rank's median of {args.iters}; on CPU read 'fresh', on CUDA 'preallocated'",
        [r["case"] for r in results],
        {
            "vs preallocated bare (ratio)": [r["time_ratio"] for r in results],
            "with workspace vs preallocated (ws ratio)": [r["workspace_ratio"] for r in results],
            "vs bare allocating per call (fresh ratio)": [r["fresh_ratio"] for r in results],
        },
        "time ratio (1.0 = as fast as the bare collective)",
    )
    emit(report, text, notes, args.json, plot=plot)


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--world", type=int, default=4, help="ranks to spawn on CPU (ignored under torchrun)")
    p.add_argument("--seq-len", type=int, default=16384, help="global tokens S")
    p.add_argument("--heads", type=int, default=16, help="heads H")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D")
    p.add_argument("--batch", type=int, default=4, help="batch of the B > 1 cases")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype")
    p.add_argument("--iters", type=int, default=10, help="timed calls per case; the median is reported")
    add_output_arguments(p, "the three time ratios (ratio, ws ratio, fresh ratio) per case")
    args = p.parse_args()
    with Ranks(args.world, timeout_s=600) as ranks:
        results = ranks.run(bench, args)[0]
        if ranks.rank == 0:
            _report(results, ranks.world, args, ranks.device.type, ranks.ranks_per_node)


if __name__ == "__main__":
    main()
