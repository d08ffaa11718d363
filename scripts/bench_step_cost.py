"""What the memory savers cost in step time: activation offload and MLP chunks.

Times one training step (forward+backward) of ONE rank of a ring x Ulysses job (torch's fake process
group: the rank's own kernels and copies, communication free) of the Llama-8B-shaped stack of
scripts/bench_longest.py -- activation checkpointing, the tiled loss, the MLP in TiledTokenwise
chunks -- for every combination of --mlp-chunks and --offload (the checkpointed layer inputs in
pinned host memory, torch.autograd.graph.save_on_cpu; CUDA only). The variants are built once and
stepped in interleaved rounds after a warm-up step each; the time is the median over the rounds,
and each variant's ratio is against the first (the fewest chunks, no offload), measured in the
same rounds. Each variant's peak bytes in its last step are printed beside (on CUDA: its parameters,
gradients, ids and labels, plus the allocator's high-water mark above what every variant held
before the step; not measured on the CPU: see bench_longest.py). The JSON
report is the last line.

    python scripts/bench_step_cost.py --device cuda --ring 8 --ulysses 1 --layers 4 --tokens 16384
    python scripts/bench_step_cost.py --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 --ffn 896 \\
        --vocab 4096 --dtype float32 --tokens 1024 --mlp-chunks 1,8        # CPU: chunks only
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from seqpar.tools.longest import StackConfig, add_stack_arguments, build_stack, stack_arguments
from seqpar.tools.one_rank import fake_world
from seqpar.tools.profiling import sync
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table

GiB = 2**30


def _positive_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{what} needs positive integers, comma-separated, got {text!r}")
    return sorted(set(values))


def main() -> None:
    parser = script_parser(__doc__)
    add_stack_arguments(parser, layers=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--mlp-chunks", default="8,64", help="TiledTokenwise chunk counts to time, comma-separated")
    parser.add_argument("--offload", default="both", choices=("off", "on", "both"),
                        help="time without offload, with it, or both (on and both: CUDA only)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (each steps every variant once)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    add_output_arguments(parser, "median step time of every variant, seconds")
    args = parser.parse_args()
    try:
        chunks = _positive_ints(args.mlp_chunks, "--mlp-chunks")
        if args.rounds < 1 or args.tokens < 1:
            raise ValueError(f"--rounds and --tokens must be positive, got {args.rounds} and {args.tokens}")
        if args.device != "cuda" and args.offload != "off":
            if args.offload == "on":
                raise ValueError("--offload on moves activations from a CUDA device to the host; on the CPU "
                                 "the host is the device (use --device cuda, or --offload off)")
            args.offload = "off"  # "both" on the CPU: the offload variants do not exist there
        offloads = {"off": [False], "on": [True], "both": [False, True]}[args.offload]
        configs = [StackConfig(**stack_arguments(args), mlp_chunks=n, offload=o)
                   for o, n in itertools.product(offloads, chunks)]
    except ValueError as e:
        parser.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    torch.set_num_threads(args.threads)
    device = configs[0].torch_device

    def label(c: StackConfig) -> str:
        return f"{c.mlp_chunks} chunks" + (", offload" if c.offload else "")

    start = time.perf_counter()
    times: dict[str, list[float]] = {label(c): [] for c in configs}
    peaks: dict[str, int | None] = {}
    with fake_world(args.ring * args.ulysses, 0, device):
        runs = [build_stack(c, args.tokens) for c in configs]
        try:
            for c, r in zip(configs, runs):  # warm-up: kernels chosen, pinned buffers and workspaces created
                progress("bench_step_cost", f"warm-up: {label(c)}")
                r.step()
            sync(device)
            for i in range(args.rounds):
                progress("bench_step_cost", f"round {i + 1} of {args.rounds}")
                for c, r in zip(configs, runs):
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                        held = torch.cuda.memory_allocated(device)  # every variant's stack
                    t0 = time.perf_counter()
                    r.step()
                    sync(device)
                    times[label(c)].append(time.perf_counter() - t0)
                    # This variant's peak: its bytes before the step and what the step added.
                    peaks[label(c)] = (r.before_bytes + torch.cuda.max_memory_allocated(device) - held
                                       if device.type == "cuda" else None)
            local_tokens, seq_len = runs[0].local_tokens, runs[0].seq_len
        finally:
            for r in runs:
                r.close()
    seconds = time.perf_counter() - start

    base = statistics.median(times[label(configs[0])])
    results = []
    for c in configs:
        t = times[label(c)]
        results.append({"variant": label(c), "mlp_chunks": c.mlp_chunks, "offload": c.offload,
                        "median_s": statistics.median(t), "times_s": t,
                        "ratio_to_first": statistics.median(t) / base, "peak_bytes": peaks[label(c)]})
    rows = [[r["variant"], f"{r['median_s'] * 1e3:.1f}", f"{min(r['times_s']) * 1e3:.1f}",
             f"{max(r['times_s']) * 1e3:.1f}", f"{r['ratio_to_first']:.3f}",
             "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GiB:.2f}"] for r in results]
    text = (f"One rank of ring {args.ring} x Ulysses {args.ulysses}: Llama-shaped stack, {args.layers} layer(s), "
            f"hidden {args.hidden}, H {args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, FFN {args.ffn}, "
            f"V {args.vocab}, {args.dtype} on {args.device}; {local_tokens:,} tokens per rank (S = {seq_len:,})\n"
            + table(["variant", "median ms", "min ms", "max ms", "time / first", "peak GiB"], rows))
    report = {"args": vars(args), "local_tokens": local_tokens, "seq_len": seq_len, "results": results,
              "seconds": seconds}
    notes = [f"{seconds:.0f} s in all; median of {args.rounds} interleaved rounds after one warm-up step each",
             "ratios against the first variant, measured in the same rounds",
             None if args.device == "cuda" else "CPU: no offload variants (the host is the device)"]
    plot = chart(args.plot, "Step time per variant (s)", [r["variant"] for r in results],
                 {"median": [r["median_s"] for r in results]}, "s")
    emit(report, text, notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
