"""Benchmark the attention's memory per rank against one device: how close to 1/N it gets.

For every ring x Ulysses configuration, every rank runs one forward+backward of
``seqpar.attention`` (dense) or ``seqpar.varlen_attention`` (packed) on its shard after a warm-up
call, and measures the tensor memory of that call:

* ``in-call``: the peak of tensor storage created inside the call (``seqpar.tools.profiling
  .StorageTracker`` on CPU: every storage an op creates, alive or freed; on CUDA the allocator's
  peak above what was allocated before the call) -- the outputs, saved activations, kernel
  results and accumulators;
* ``+ workspace``: the same plus the rank's reused scratch buffers (``state.workspace``:
  transfer and staging buffers, allocated once and shared by every call on the state, so every
  layer of a model), i.e. the footprint of the call when it is the only attention in flight.

Each is reported as ``peak x N / ideal``, where the **ideal** is the in-call peak of *one device*
running the whole sequence with the same kernel (the backend's forward and backward called
directly: output, LSE and the three gradients), so 1.0 means a perfect 1/N share. The ranks
share the machine's cores; memory does not depend on that.

    python scripts/bench_memory.py                       # N=4: 4x1, 1x4, 2x2; dense and packed
    python scripts/bench_memory.py --world 8 --configs 8x1,1x8,2x4,4x2 --kv-heads 2
    python scripts/bench_memory.py --seq-len 1024 --plot memory.png   # chart of both ratios

Output: the table and notes, then the whole report as one JSON line (last line); ``--json PATH``
also writes it to a file.
"""

from __future__ import annotations

import argparse

import torch

import seqpar
from seqpar.backends import get_backend
from seqpar.tools.bench import Ranks, inputs, parse_configs
from seqpar.tools.profiling import PeakMemory
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table


def _lengths(seq_len: int) -> list[int]:
    """The packed mix: a quarter, a half and the rest of ``seq_len``."""
    return [seq_len // 4, seq_len // 2, seq_len - seq_len // 4 - seq_len // 2]


def _inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """The whole sequence's q, k, v, dout ``[1, S, H(kv), D]`` (``seqpar.tools.bench.inputs``)."""
    return inputs((1, args.seq_len), args.heads, args.kv_heads, args.head_dim, device=device,
                  dtype=getattr(torch, args.dtype))


def _peak(run, device: torch.device) -> int:
    """Tensor bytes one call of ``run`` creates at its peak (after a warm-up call; ``PeakMemory``)."""
    run()
    with PeakMemory(device) as mem:
        run()
    return mem.peak


def ideal(args: argparse.Namespace, packed: bool, device: torch.device) -> int:
    """One device, the whole sequence, the backend's kernels called directly."""
    q, k, v, dout = _inputs(args, device)
    backend = get_backend(args.backend, device, q.dtype)
    scale = args.head_dim ** -0.5
    lens = _lengths(args.seq_len)
    cu = torch.tensor([0, lens[0], lens[0] + lens[1], args.seq_len], dtype=torch.int32, device=device)

    def run() -> None:
        if packed:
            out, lse = backend.varlen_forward(q[0], k[0], v[0], cu, cu, max(lens), max(lens), causal=args.causal,
                                              scale=scale)
            backend.varlen_backward(dout[0], q[0], k[0], v[0], out, lse, cu, cu, max(lens), max(lens),
                                    causal=args.causal, scale=scale)
        else:
            out, lse = backend.forward(q, k, v, causal=args.causal, scale=scale)
            backend.backward(dout, q, k, v, out, lse, causal=args.causal, scale=scale)

    return _peak(run, device)


def measure(args: argparse.Namespace, R: int, U: int, packed: bool) -> dict:
    """On every rank: the in-call peak and the workspace of one forward+backward."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    state = seqpar.ParallelState(R, U)
    full = _inputs(args, device)
    lens = _lengths(args.seq_len)
    if packed:
        local = [seqpar.shard_packed(t[0], state, lens).clone() for t in full]
    else:
        local = [seqpar.shard(t, state).clone() for t in full]
    q, k, v = (t.requires_grad_() for t in local[:3])

    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        if packed:
            out = seqpar.varlen_attention(q, k, v, state, lens, causal=args.causal, backend=args.backend)
        else:
            out = seqpar.attention(q, k, v, state, causal=args.causal, seq_len=args.seq_len, backend=args.backend)
        out.backward(local[3])

    peak = _peak(run, device)
    result = {"peak": peak, "workspace": state.workspace.nbytes}
    state.close()
    return result


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--world", type=int, default=4, help="local CPU ranks")
    parser.add_argument("--configs", default=None, help="ring x ulysses list, e.g. 4x1,1x4,2x2 (default: ring only, "
                        "Ulysses only and an even hybrid of --world)")
    parser.add_argument("--seq-len", type=int, default=4096, help="global tokens")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim")
    parser.add_argument("--dtype", default="float32", help="dtype")
    parser.add_argument("--backend", default="auto", help="attention backend")
    parser.add_argument("--non-causal", dest="causal", action="store_false", help="non-causal (default: causal)")
    add_output_arguments(parser, "in-call x and +workspace x (memory per rank x N / one device) per configuration")
    args = parser.parse_args()
    n = args.world
    half = next(d for d in range(int(n**0.5), 0, -1) if n % d == 0)
    configs = parse_configs(args.configs) if args.configs else list(dict.fromkeys([(n, 1), (1, n), (n // half, half)]))
    for R, U in configs:
        if R * U != n:
            raise SystemExit(f"--configs: {R}x{U} does not use the {n} ranks of --world {n}")

    device = torch.device("cpu")
    rows, results = [], []
    ideals = {packed: ideal(args, packed, device) for packed in (False, True)}
    with Ranks(n, torchrun=False, timeout_s=600) as ranks:  # local CPU ranks only
        for R, U in configs:
            for packed in (False, True):
                progress("bench_memory", f"ring {R} x ulysses {U}, {'packed' if packed else 'dense'}")
                per_rank = ranks.run(measure, args, R, U, packed)
                peak = max(r["peak"] for r in per_rank)
                total = max(r["peak"] + r["workspace"] for r in per_rank)
                entry = {
                    "config": f"{R}x{U}", "layout": "packed" if packed else "dense", "ideal_bytes": ideals[packed],
                    "peak_bytes_max_rank": peak, "workspace_bytes_max_rank": max(r["workspace"] for r in per_rank),
                    "in_call_x_ideal": peak * n / ideals[packed], "with_workspace_x_ideal": total * n / ideals[packed],
                }
                results.append(entry)
                rows.append([
                    entry["config"], entry["layout"], f"{ideals[packed] / 2**20:.1f}", f"{peak / 2**20:.1f}",
                    f"{entry['workspace_bytes_max_rank'] / 2**20:.1f}", f"{entry['in_call_x_ideal']:.2f}",
                    f"{entry['with_workspace_x_ideal']:.2f}",
                ])
    text = (
        f"attention memory per rank x {n} / one device (ideal 1.0); S={args.seq_len} H={args.heads} "
        f"Hkv={args.kv_heads} D={args.head_dim} {args.dtype} {'causal' if args.causal else 'non-causal'}, "
        "packed = 3 sequences\n"
        + table(["config", "layout", "ideal MiB", "in-call MiB", "workspace MiB", "in-call x", "+workspace x"], rows)
    )
    notes = [
        "ideal = one device, whole sequence, same kernel called directly (output, LSE, three gradients); "
        "in-call = tensor storage created inside one forward+backward on the busiest rank; +workspace adds "
        "the rank's reused transfer/staging buffers (shared by every layer on the state)",
    ]
    report = {"world": n, "args": vars(args), "results": results}
    plot = chart(
        args.plot,
        f"attention memory per rank x {n} / one device (1.0 = a perfect 1/{n} share); S={args.seq_len} "
        f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype} "
        f"{'causal' if args.causal else 'non-causal'}, packed = 3 sequences",
        [f"{e['config']} {e['layout']}" for e in results],
        {"in-call": [e["in_call_x_ideal"] for e in results],
         "+ workspace": [e["with_workspace_x_ideal"] for e in results]},
        f"peak per rank x {n} / one device (lower is better; dashed line: the ideal 1.0)",
    )
    emit(report, text, notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
