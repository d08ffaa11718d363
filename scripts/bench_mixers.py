"""Benchmark the two modes of seqpar.mixing for linear recurrences: bytes and time.

Two parts, on ``--world`` ranks (ring ``--ring`` x Ulysses ``world / ring``):

* **bytes per rank per layer** of ``state_passing`` and ``recurrence_head_parallel`` for a gated
  delta rule layer and a Mamba2 (SSD) layer at ``--lengths`` tokens (default 1k .. 64k): every
  ``torch.distributed`` collective of one forward and backward is counted
  (``seqpar.tools.profiling.CollectiveRecorder``, the bytes each rank hands to send), the largest
  over ranks. State passing moves fixed-size piece summaries, so its column stays constant;
  head-parallel moves the shard of every input and output, so its column grows with ``S``.
  (``checks="never"`` with the length given: no agreement exchange, only the data.)
* **time** of one forward and backward of each mode against one device (rank 0 alone, the
  others waiting, on the whole sequence) at ``--time-len`` tokens, for the gated delta rule, the
  SSD layer and Mamba1's selective scan (``--mamba1-len``: its torch kernel is a per-token loop).
  Slowest rank's median of ``--iters``.

Output: the two tables, notes, then the report as one JSON line (last line); ``--json PATH`` also
writes it to a file.

Run:
    python scripts/bench_mixers.py                     # 4 gloo ranks on the CPU, ~2 minutes on 2 cores
    python scripts/bench_mixers.py --lengths 1024,65536 --time-len 2048
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import seqpar
from seqpar import ParallelState
from seqpar.mixing import (
    GatedDeltaRule,
    ScalarDecayAttention,
    SelectiveScan,
    recurrence_head_parallel,
    state_passing,
)
from seqpar.tools.bench import Ranks, few_iterations_warning, time_sharing_warning, usable_cores
from seqpar.tools.profiling import CollectiveRecorder, iteration_seconds, max_over_ranks
from seqpar.tools.report import add_output_arguments, emit, progress, script_parser, table


def _layer(kind: str, S: int, args: argparse.Namespace, seed: int = 0):
    """``(recurrence, full inputs)`` of one layer: fp32, batch 1, every input requiring grad."""
    g = torch.Generator().manual_seed(seed)
    H, D = args.heads, args.head_dim

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    if kind == "gated delta":
        Hk = max(1, H // 2)
        xs = [rnd(1, S, Hk, D), rnd(1, S, Hk, D), rnd(1, S, H, D), rnd(1, S, H),
              torch.rand(1, S, H, generator=g).requires_grad_()]
        return GatedDeltaRule(use_qk_l2norm=True, A_log=rnd(H, scale=0.5), dt_bias=rnd(H, scale=0.5)), xs
    if kind == "mamba2 ssd":
        N = args.state_dim
        xs = [rnd(1, S, 1, N, scale=0.3), rnd(1, S, 1, N, scale=0.3), rnd(1, S, H, D), rnd(1, S, H)]
        return ScalarDecayAttention(A_log=rnd(H, scale=0.5), dt_bias=rnd(H, scale=0.5), D=rnd(H)), xs
    C, N = H * D, args.state_dim  # mamba1: every channel its own diagonal state
    xs = [rnd(1, S, C), rnd(1, S, C), rnd(1, S, 1, N), rnd(1, S, 1, N)]
    return SelectiveScan(rnd(C, N, scale=0.5), D=rnd(C), dt_bias=rnd(C, scale=0.5)), xs


def _step(mode: str, rec, local: list[torch.Tensor], state: ParallelState, S: int) -> None:
    """One forward and backward of ``mode`` on this rank's shards."""
    xs = [x.detach().requires_grad_() for x in local]
    if mode == "state passing":
        outs, final = state_passing(rec, xs, state, seq_len=S)
        loss = sum(o.float().pow(2).sum() for o in outs) + final.pow(2).sum() / state.cp_size
    else:
        outs = recurrence_head_parallel(rec, xs, state, seq_len=S)
        loss = sum(o.float().pow(2).sum() for o in outs)
    loss.backward()


def _bytes(args: argparse.Namespace, state: ParallelState) -> list[dict]:
    rows = []
    for kind in ("gated delta", "mamba2 ssd"):
        for S in args.lengths:
            progress("bench_mixers", f"bytes: {kind} S={S}")
            rec, full = _layer(kind, S, args)
            local = [seqpar.shard(x.detach(), state) for x in full]
            sent = []
            for mode in ("state passing", "head-parallel"):
                with CollectiveRecorder() as rec_bytes:
                    _step(mode, rec, local, state, S)
                sent.append(sum(rec_bytes.bytes.values()))
            sent = max_over_ranks([float(b) for b in sent], torch.device("cpu"))
            rows.append({"layer": kind, "seq_len": S, "state_passing_bytes": int(sent[0]),
                         "head_parallel_bytes": int(sent[1])})
    return rows


def _times(args: argparse.Namespace, state: ParallelState) -> list[dict]:
    rows = []
    cpu = torch.device("cpu")
    for kind, S in (("gated delta", args.time_len), ("mamba2 ssd", args.time_len), ("mamba1 scan", args.mamba1_len)):
        progress("bench_mixers", f"time: {kind} S={S}")
        rec, full = _layer(kind, S, args)
        local = [seqpar.shard(x.detach(), state) for x in full]
        one = ParallelState()  # one device: the whole sequence on this process
        if dist.get_rank() == 0:
            t_one = statistics.median(iteration_seconds(
                lambda: _step("state passing", rec, full, one, S), args.iters, cpu, barrier=False))
        else:
            t_one = 0.0
        dist.barrier()
        medians = [statistics.median(iteration_seconds(lambda m=m: _step(m, rec, local, state, S), args.iters, cpu))
                   for m in ("state passing", "head-parallel")]
        t_sp, t_hp = max_over_ranks(medians, cpu)
        t_one = max_over_ranks([t_one], cpu)[0]
        rows.append({"layer": kind, "seq_len": S, "one_device_s": t_one, "state_passing_s": t_sp,
                     "head_parallel_s": t_hp})
    return rows


def bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    state = ParallelState(args.ring, world // args.ring, checks="never")
    try:
        return {"bytes": _bytes(args, state), "times": _times(args, state)}
    finally:
        state.close()


def _report(result: dict, world: int, args: argparse.Namespace, ranks_per_node: int) -> None:
    kb = [[r["layer"], r["seq_len"], f"{r['state_passing_bytes'] / 1024:.1f}", f"{r['head_parallel_bytes'] / 1024:.1f}",
           f"{r['head_parallel_bytes'] / max(r['state_passing_bytes'], 1):.1f}"] for r in result["bytes"]]
    tm = [[r["layer"], r["seq_len"], f"{r['one_device_s'] * 1e3:.1f}", f"{r['state_passing_s'] * 1e3:.1f}",
           f"{r['head_parallel_s'] * 1e3:.1f}", f"{r['one_device_s'] / r['state_passing_s']:.2f}",
           f"{r['one_device_s'] / r['head_parallel_s']:.2f}"] for r in result["times"]]
    ulysses = world // args.ring
    per_layer = {}
    for r in result["bytes"]:
        per_layer.setdefault(r["layer"], set()).add(r["state_passing_bytes"])
    constant = all(len(v) == 1 for v in per_layer.values())
    text = "\n".join([
        f"linear recurrences over ring {args.ring} x ulysses {ulysses} ({world} gloo ranks, fp32, B=1, "
        f"H={args.heads}, D={args.head_dim}, N={args.state_dim})",
        "bytes sent per rank per layer (forward + backward, largest over ranks)",
        table(["layer", "S", "state passing KiB", "head-parallel KiB", "ratio"], kb),
        "",
        f"one forward + backward, ms (slowest rank's median of {args.iters}); speedup = one device / mode",
        table(["layer", "S", "one device", "state passing", "head-parallel", "speedup sp", "speedup hp"], tm),
    ])
    notes = [
        None if constant else "WARNING: state-passing bytes changed with the sequence length",
        time_sharing_warning(ranks_per_node, usable_cores(), "cpu"),
        few_iterations_warning(args.iters),
    ]
    report = {"world_size": world, "ring_size": args.ring, "ulysses_size": ulysses, "heads": args.heads,
              "head_dim": args.head_dim, "state_dim": args.state_dim, "iters": args.iters,
              "cpu_cores": usable_cores(), "state_passing_bytes_constant": constant, **result}
    emit(report, text, notes, args.json)


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--world", type=int, default=4, help="local gloo ranks to spawn (ignored under torchrun)")
    p.add_argument("--ring", type=int, default=2, help="ring size; Ulysses gets world / ring")
    p.add_argument("--lengths", default="1024,4096,16384,65536", help="sequence lengths of the bytes sweep")
    p.add_argument("--time-len", type=int, default=4096, help="tokens of the timed gated-delta and SSD layers")
    p.add_argument("--mamba1-len", type=int, default=512, help="tokens of the timed Mamba1 layer")
    p.add_argument("--heads", type=int, default=4, help="heads H (gated delta: H / 2 K heads)")
    p.add_argument("--head-dim", type=int, default=32, help="head dim D (Dk = Dv)")
    p.add_argument("--state-dim", type=int, default=16, help="SSM state size N (Mamba1, Mamba2)")
    p.add_argument("--iters", type=int, default=3, help="timed steps per mode; the median is reported")
    add_output_arguments(p, "unused")
    args = p.parse_args()
    args.lengths = [int(v) for v in args.lengths.split(",")]
    if args.world % args.ring:
        raise SystemExit(f"--ring {args.ring} must divide --world {args.world}")
    with Ranks(args.world, timeout_s=900) as ranks:
        result = ranks.run(bench, args)[0]
        if ranks.rank == 0:
            _report(result, ranks.world, args, ranks.ranks_per_node)


if __name__ == "__main__":
    main()
