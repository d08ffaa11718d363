"""The degree planner's choice against measured times: is the chosen ring x Ulysses factorisation
within 10% of the fastest one?

On the ranks of the job (or ``--local N`` gloo ranks), calibrates a cost model, plans a few layer
shapes with it, and times ``seqpar.attention`` forward+backward of every factorisation the plan
lists. Every time is the slowest rank's; the factorisations are timed in *paired rounds* (each
round times all of them once, in a shuffled order), and the ratio of the chosen one to the fastest
one (lowest median) is taken per round, which cancels the drift that other jobs cause.

"Within 10%" is read as "not significantly slower than 1.10 x the fastest": a shape passes once the
median ratio is at most ``--tol`` after ``--min-rounds`` rounds, fails when the one-sided 95% lower
bound of the median (the k-th smallest ratio, k from Binomial(n, 1/2)) exceeds it, and is measured
again otherwise, up to ``--max-rounds``; still undecided then, it is reported "within noise". A
failing shape is judged once more after a fresh calibration: on a shared machine the cost of a
point-to-point wait moves by tens of percent within a minute, and a wrong model fails twice.
See docs/planner.md ("Checked against measurements").

    python scripts/bench_planner.py --local 4                           # 4 CPU ranks (gloo)
    python -m torch.distributed.run --nproc-per-node 8 scripts/bench_planner.py --shapes 65536,32,8,128,1
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

import seqpar
from seqpar.planner import calibrate, plan
from seqpar.tools.bench import Ranks, under_torchrun
from seqpar.tools.report import add_output_arguments, emit, script_parser, table

# (S, H, Hkv, D, causal, window): windows shorter than a zig-zag chunk (the ring moves little),
# uneven heads with GQA, MQA with Hkv < U, a short causal sequence, a long full one.
SHAPES = [
    (4096, 8, 8, 64, True, (255, 0)),
    (8192, 2, 2, 32, True, (63, 0)),
    (2048, 6, 2, 64, False, (-1, -1)),
    (2048, 4, 1, 64, True, (-1, -1)),
    (1024, 8, 8, 64, True, (-1, -1)),
]


def lower_bound(ratios: list[float]) -> float:
    """One-sided 95% lower confidence bound of the median: the k-th smallest ratio with
    P(Binomial(n, 1/2) < k) <= 0.05 (0 when n is too small for one)."""
    n = len(ratios)
    k, below = 0, 0.0
    while below + math.comb(n, k) / 2**n <= 0.05:
        below += math.comb(n, k) / 2**n
        k += 1
    return sorted(ratios)[max(k - 1, 0)] if k else 0.0


def _runs(p, S, H, Hkv, D, causal, window, dtype, device):
    """One fwd+bwd closure per candidate of plan ``p`` (its state, sharded inputs)."""
    runs = {}
    for c in p.candidates:
        st = seqpar.ParallelState(c.ring_size, c.ulysses_size)
        g = torch.Generator().manual_seed(S)
        q, k, v = (seqpar.shard(torch.randn(1, S, h, D, generator=g).to(device, dtype), st).requires_grad_()
                   for h in (H, Hkv, Hkv))
        dout = seqpar.shard(torch.randn(1, S, H, D, generator=g).to(device, dtype), st)

        def run(q=q, k=k, v=v, dout=dout, st=st):
            seqpar.attention(q, k, v, st, causal=causal, window=window, seq_len=S).backward(dout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        runs[(c.ring_size, c.ulysses_size)] = run
    return runs


def _judge(runs, chosen, rng, opts):
    """Paired rounds until a verdict; the same on every rank (the times are all-reduced)."""
    times = {key: [] for key in runs}
    verdict, start = "undecided", time.perf_counter()
    for i in range(opts["max_rounds"] + 1):
        order = list(runs)
        rng.shuffle(order)
        mine = []
        for key in order:
            dist.barrier()
            t0 = time.perf_counter()
            runs[key]()
            mine.append(time.perf_counter() - t0)
        slowest = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i == 0:
            continue  # warm-up: plans, workspaces, connections
        for key, t in zip(order, slowest.tolist()):
            times[key].append(t)
        rounds = len(times[chosen])
        fastest = min(times, key=lambda key: statistics.median(times[key]))
        ratios = [a / b for a, b in zip(times[chosen], times[fastest])]
        if rounds >= opts["min_rounds"] and statistics.median(ratios) <= opts["tol"]:
            verdict = "pass"
        elif lower_bound(ratios) > opts["tol"]:
            verdict = "fail"
        elif rounds >= opts["min_rounds"] and time.perf_counter() - start > opts["budget_s"]:
            verdict = "within noise"
        if verdict != "undecided":
            break
    return dict(verdict="within noise" if verdict == "undecided" else verdict, fastest=list(fastest),
                rounds=rounds, median_ratio=statistics.median(ratios), lower_bound=lower_bound(ratios),
                measured_ms={f"{r}x{u}": 1e3 * statistics.median(t) for (r, u), t in times.items()})


def _measure(shapes, dtype_name, ranks_per_node, opts):
    """On every rank: calibrate, then plan and judge every shape (twice where the first fails)."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    start = time.perf_counter()
    cost = calibrate(seqpar.ParallelState(1, world), dtype=dtype, ranks_per_node=ranks_per_node)
    calibration_s = time.perf_counter() - start
    rng = random.Random(0)
    report = []
    for shape in shapes:
        for attempt in (1, 2):
            if attempt == 2:  # conditions drifted since the calibration? measure them again
                cost = calibrate(seqpar.ParallelState(1, world), dtype=dtype, ranks_per_node=ranks_per_node)
            S, H, Hkv, D, causal, window = shape
            p = plan(world, seq_len=S, num_heads=H, num_kv_heads=Hkv, head_dim=D, causal=causal, window=window,
                     dtype=dtype, ranks_per_node=ranks_per_node, cost=cost, ring_comm="p2p")
            chosen = (p.ring_size, p.ulysses_size)
            row = _judge(_runs(p, *shape, dtype, device), chosen, rng, opts)
            row.update(shape=list(shape), chosen=list(chosen), attempt=attempt,
                       predicted_ms={f"{c.ring_size}x{c.ulysses_size}": 1e3 * c.time_s for c in p.candidates})
            report.append(row)
            if row["verdict"] != "fail":
                break
    return dict(rows=report, calibration_s=calibration_s, cost=json.loads(cost.to_json()), seconds=time.perf_counter() - start)


def _shape(text: str) -> tuple:
    """``S,H,Hkv,D,causal[,left,right]`` -> a shape tuple."""
    parts = [int(x) for x in text.split(",")]
    if len(parts) not in (5, 7):
        raise ValueError(f"a shape is S,H,Hkv,D,causal[,left,right], got {text!r}")
    window = tuple(parts[5:]) if len(parts) == 7 else (-1, -1)
    return (*parts[:4], bool(parts[4]), window)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--local", type=int, metavar="N", help="spawn N local CPU ranks (gloo) instead of torchrun")
    parser.add_argument("--shapes", nargs="+", metavar="SHAPE",
                        help="S,H,Hkv,D,causal[,left,right] per shape (default: five CPU-sized shapes)")
    parser.add_argument("--ranks-per-node", type=int, help="consecutive ranks per node (default: all the job's)")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tol", type=float, default=1.10, help="the claim: chosen time <= tol x the fastest")
    parser.add_argument("--min-rounds", type=int, default=5)
    parser.add_argument("--max-rounds", type=int, default=13)
    parser.add_argument("--budget-s", type=float, default=70.0,
                        help="per shape: stop extending beyond --min-rounds after this many seconds")
    add_output_arguments(parser, "median time of every factorisation, ms")
    args = parser.parse_args(argv)
    try:
        shapes = [_shape(s) for s in args.shapes] if args.shapes else SHAPES
    except ValueError as e:
        parser.error(str(e))
    if not args.local and not under_torchrun():
        parser.error("run under torchrun (or pass --local N for local CPU ranks)")
    opts = dict(tol=args.tol, min_rounds=args.min_rounds, max_rounds=args.max_rounds, budget_s=args.budget_s)
    with Ranks(args.local, torchrun=not args.local, timeout_s=900) as ranks:
        rpn = args.ranks_per_node or ranks.ranks_per_node
        result = ranks.run(_measure, shapes, args.dtype, rpn, opts)[0]  # the same on every rank
        rank = ranks.rank
    if rank != 0:
        return 0
    rows = [[",".join(map(str, r["shape"][:4])) + (" causal" if r["shape"][4] else "") + f" w{tuple(r['shape'][5])}",
             r["attempt"], "x".join(map(str, r["chosen"])), "x".join(map(str, r["fastest"])),
             " / ".join(f"{k} {v:.0f}" for k, v in r["measured_ms"].items()),
             " / ".join(f"{k} {v:.0f}" for k, v in r["predicted_ms"].items()),
             f"{r['median_ratio']:.3f}", f"{r['lower_bound']:.3f}", r["rounds"], r["verdict"]] for r in result["rows"]]
    text = table(["shape S,H,Hkv,D", "try", "chosen", "fastest", "measured ms", "predicted ms", "median ratio",
                  "95% low", "rounds", "verdict"], rows)
    failed = [r for r in result["rows"] if r["verdict"] == "fail" and r["attempt"] == 2]
    notes = [f"calibration {result['calibration_s']:.1f} s, {result['seconds']:.0f} s in all; {args.dtype}, "
             f"{ranks.world} ranks", f"{len(failed)} shape(s) failed twice" if failed else "no shape failed twice"]
    emit({"args": vars(args), **result}, text, notes, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
