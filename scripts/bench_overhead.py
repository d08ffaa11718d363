"""Benchmark seqpar's per-call overhead: a short ``seqpar.attention`` call against its backend.

One process, ``ParallelState()``: the call validates its inputs, resolves the plan (cached), runs
its autograd function and the kernels. The baseline calls the same backend's ``forward`` and
``backward`` directly on the same tensors. Both run forward+backward, interleaved in rounds so
that machine noise hits both alike; the reported ratio is the median over rounds of
(seqpar time / backend time), each round taking the median of ``--iters`` calls.

    python scripts/bench_overhead.py                  # 64 tokens, H=8, D=64, causal, fp32
    python scripts/bench_overhead.py --seq-len 1024 --plot overhead.png
"""

from __future__ import annotations

import statistics

import torch

import seqpar
from seqpar.backends import get_backend
from seqpar.tools.profiling import median_seconds
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens")
    parser.add_argument("--heads", type=int, default=8, help="heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim")
    parser.add_argument("--dtype", default="float32", help="dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--iters", type=int, default=50, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    add_output_arguments(parser, "the seqpar / backend time ratio of every round and their median")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, args.seq_len, args.heads, args.head_dim, generator=g).to(dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    state = seqpar.ParallelState()
    cpu = torch.device("cpu")
    backend = get_backend("auto", cpu, dtype)
    scale = args.head_dim ** -0.5

    def ours() -> None:
        seqpar.attention(q, k, v, state, causal=True, seq_len=args.seq_len).backward(dout)
        q.grad = k.grad = v.grad = None

    def kernel() -> None:
        out, lse = backend.forward(q.detach(), k.detach(), v.detach(), causal=True, scale=scale)
        backend.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=True, scale=scale)

    progress("bench_overhead", "warm-up (20 calls of each)")
    for _ in range(20):  # warm-up: imports, caches
        ours()
        kernel()
    rounds = []
    for i in range(args.rounds):
        progress("bench_overhead", f"round {i + 1}/{args.rounds}: {args.iters} calls of seqpar, then of the kernel")
        a, b = (median_seconds(fn, args.iters, cpu, warmup=0, barrier=False, over_ranks=False) for fn in (ours, kernel))
        rounds.append((a, b, a / b))
    ratio = statistics.median(r[2] for r in rounds)
    ours_us = statistics.median(r[0] for r in rounds) * 1e6
    kernel_us = statistics.median(r[1] for r in rounds) * 1e6
    text = (
        f"seqpar.attention vs its backend ({backend.name}), forward+backward, B=1 S={args.seq_len} "
        f"H={args.heads} D={args.head_dim} {args.dtype}, causal, {args.threads} thread(s)\n"
        + table(["", "us per call"], [["seqpar.attention", f"{ours_us:.0f}"], [f"{backend.name} kernels", f"{kernel_us:.0f}"],
                                      ["ratio (median of rounds)", f"{ratio:.2f}"]])
    )
    report = {"args": vars(args), "backend": backend.name, "seqpar_us": ours_us, "kernel_us": kernel_us,
              "ratio": ratio, "rounds": [{"seqpar_s": a, "kernel_s": b, "ratio": r} for a, b, r in rounds]}
    notes = ["ratio = median over interleaved rounds of (median seqpar call / median direct backend call); "
             "the difference is validation, plan lookup and the autograd function"]
    plot = chart(
        args.plot,
        f"seqpar.attention / direct {backend.name} calls, forward+backward, B=1 S={args.seq_len} H={args.heads} "
        f"D={args.head_dim} {args.dtype}, causal, {args.threads} thread(s); median of {args.iters} calls per round",
        [f"round {i + 1}" for i in range(len(rounds))] + ["median of rounds"],
        {"seqpar / backend": [r[2] for r in rounds] + [ratio]},
        "time ratio (1.0 = no overhead)",
    )
    emit(report, text, notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
