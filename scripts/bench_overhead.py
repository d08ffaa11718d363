"""Benchmark seqpar's per-call overhead: a short ``seqpar.attention`` call against its backend.

One process, ``ParallelState()``: the call validates its inputs, resolves the plan (cached), runs
its autograd function and the kernels. Two baselines run the same backend's ``forward`` and
``backward`` on the same tensors: called directly (no autograd: the issue's target, seqpar <=
1.3 x), and inside a bare autograd function that saves what the backward needs and does nothing
else (the floor any autograd-aware call pays; seqpar over it is seqpar's own work). All three run
forward+backward, interleaved in rounds so that machine noise hits them alike; each ratio is the
median over rounds of (seqpar time / baseline time), each round taking the median of ``--iters``
calls.

    python scripts/bench_overhead.py                  # 64 tokens, H=8, D=64, causal, fp32
    python scripts/bench_overhead.py --seq-len 1024 --plot overhead.png
    python scripts/bench_overhead.py --device cuda --dtype bfloat16   # on a GPU (synchronised calls)
    valgrind --tool=cachegrind --cache-sim=no "$(python -c 'import sys; print(sys.executable)')" \
        scripts/bench_overhead.py --seq-len 1 --heads 1 --head-dim 8 --only seqpar --calls 1000
                                            # instructions (minus those of --calls 0, over 1000)

On CUDA every timed call is followed by a synchronisation, so a call's time is the longer of its
host work (validation, plan, autograd, kernel launches) and its kernels; a short call is bound by
the host.
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
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--only", choices=("seqpar", "autograd", "kernel"), default=None,
                        help="run --calls calls of this side after the warm-up and print nothing else (for "
                             "instruction counters: the count of --calls N minus that of --calls 0, over N)")
    parser.add_argument("--calls", type=int, default=1000, help="calls of the --only side")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the call runs")
    parser.add_argument("--iters", type=int, default=50, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    add_output_arguments(parser, "the seqpar / backend time ratios of every round and their medians")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_overhead: --device cuda, but torch.cuda.is_available() is False")
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, args.seq_len, args.heads, args.head_dim, generator=g).to(device, dtype)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    state = seqpar.ParallelState()
    backend = get_backend("auto", device, dtype)
    scale = args.head_dim ** -0.5

    def ours() -> None:
        seqpar.attention(q, k, v, state, causal=True, seq_len=args.seq_len).backward(dout)
        q.grad = k.grad = v.grad = None

    def floor() -> None:
        _Floor.apply(q, k, v, backend, scale).backward(dout)
        q.grad = k.grad = v.grad = None

    def kernel() -> None:
        out, lse = backend.forward(q.detach(), k.detach(), v.detach(), causal=True, scale=scale)
        backend.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=True, scale=scale)

    sides = {"seqpar": ours, "autograd": floor, "kernel": kernel}
    if args.only is None:
        progress("bench_overhead", "warm-up (20 calls of each)")
    for _ in range(20):  # warm-up: imports, caches
        for fn in sides.values():
            fn()
    if args.only is not None:
        for _ in range(args.calls):
            sides[args.only]()
        return
    rounds = []
    for i in range(args.rounds):
        progress("bench_overhead", f"round {i + 1}/{args.rounds}: {args.iters} calls of each side in turn")
        t = {name: median_seconds(fn, args.iters, device, warmup=0, barrier=False, over_ranks=False)
             for name, fn in sides.items()}
        rounds.append({**{f"{name}_s": x for name, x in t.items()}, "ratio": t["seqpar"] / t["kernel"],
                       "ratio_vs_autograd": t["seqpar"] / t["autograd"]})
    us = {name: statistics.median(r[f"{name}_s"] for r in rounds) * 1e6 for name in sides}
    ratio = statistics.median(r["ratio"] for r in rounds)
    ratio_floor = statistics.median(r["ratio_vs_autograd"] for r in rounds)
    text = (
        f"seqpar.attention vs its backend ({backend.name} on {_device_name(device)}), forward+backward, "
        f"B=1 S={args.seq_len} H={args.heads} D={args.head_dim} {args.dtype}, causal, {args.threads} thread(s)\n"
        + table(["", "us per call", "seqpar / this (median of rounds)"], [
            ["seqpar.attention", f"{us['seqpar']:.0f}", None],
            [f"{backend.name} kernels in a bare autograd function", f"{us['autograd']:.0f}", f"{ratio_floor:.2f}"],
            [f"{backend.name} kernels called directly", f"{us['kernel']:.0f}", f"{ratio:.2f}"],
        ])
    )
    report = {"args": vars(args), "device": _device_name(device), "torch": torch.__version__, "backend": backend.name,
              "seqpar_us": us["seqpar"], "autograd_us": us["autograd"], "kernel_us": us["kernel"], "ratio": ratio,
              "ratio_vs_autograd": ratio_floor, "rounds": rounds}
    notes = ["ratio = median over interleaved rounds of (median seqpar call / median call of the other side); "
             "against the direct calls the difference is validation, the plan look-up and autograd; against the "
             "bare autograd function (the same kernels, nothing else) it is seqpar's own work"]
    plot = chart(
        args.plot,
        f"seqpar.attention / {backend.name}, forward+backward, B=1 S={args.seq_len} H={args.heads} "
        f"D={args.head_dim} {args.dtype}, causal, {args.threads} thread(s); median of {args.iters} calls per round",
        [f"round {i + 1}" for i in range(len(rounds))] + ["median of rounds"],
        {"seqpar / direct kernels": [r["ratio"] for r in rounds] + [ratio],
         "seqpar / bare autograd function": [r["ratio_vs_autograd"] for r in rounds] + [ratio_floor]},
        "time ratio (1.0 = no overhead)",
    )
    emit(report, text, notes, args.json, plot=plot)


class _Floor(torch.autograd.Function):
    """The least an autograd-aware attention call does: the backend's forward and backward
    kernels, saving q, k, v, out and the LSE; no validation, no plan."""

    @staticmethod
    def forward(ctx, q, k, v, backend, scale):
        out, lse = backend.forward(q, k, v, causal=True, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.scale = backend, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, causal=True, scale=ctx.scale)
        return dq, dk, dv, None, None


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
