"""Calibrate and validate the memory model of seqpar.planner.memory (the longest context that fits).

Runs ONE rank of a ring x Ulysses job (torch's fake process group: the rank's own kernels, copies
and buffers, communication free) of a Llama-8B-shaped decoder stack -- hidden 4096, 32 heads, 8
K/V heads of 128, FFN 14336, vocabulary 128256, bf16, --layers layers -- with activation
checkpointing, the tiled loss (linear_cross_entropy) and the tiled MLP (TiledTokenwise), one
forward+backward per length (Note [Longest-context measurement] in seqpar/tools/longest.py):

1. measures the peak bytes at each of --lengths tokens per rank and fits peak = a + b * T: b the
   larger of the least-squares slope and the last segment's, a raised until no measured point lies
   above the line (the upper envelope: the prediction errs on the side of fitting);
2. calibrates the model from that line (seqpar.planner.memory.calibrate_from_fit: the layer
   factor from the slope, the overhead from the raised intercept); the line must be the model's
   layer moment at every fitted length (a length where the loss's backward is the peak is refused).
   Fit near the lengths you predict: within a layer's backward the peak is one of several
   moments (attention's kernels, a norm's or the MLP's backward), each its own line, and a line
   fitted below the length where a steeper one crosses it under-predicts beyond (measured in
   docs/performance.md, "Longest context");
3. validates it: the predicted longest T for --budget-gib runs with a peak within the budget, and
   T * 1.1 does not (its measured peak exceeds the budget). --reserve-mib keeps that much of the
   budget out of the prediction (the model's reserve term): on CUDA the caching allocator's
   rounding moves a peak by a few MiB from one length to the next (2-6 MiB on an H200, where the
   model is otherwise within 0.03%), which no line through the fit points follows.
   --validate-with shipped predicts from the calibration seqpar ships for the device instead
   (seqpar.planner.GPU_CALIBRATION on CUDA, CPU_CALIBRATION on the CPU): the check that constants
   measured on one split predict another (every run also prints measured / shipped model).

On the CPU the peak is the CPU allocator's (AllocatorTracker: torch.profiler's memory events, kernel
scratch included; --storage-tracker for the tensor-storage peak of earlier calibrations) plus the
bytes alive before the step (every trainable gradient allocated before it, as under gradient
accumulation); on CUDA the allocator's high-water mark. The embedding and lm-head are frozen by default
(--train-embeddings to train them), and there is no optimizer step: their gradient and optimizer
bytes are static ones the model counts from the parameter count, and leaving them out keeps the
run inside a budget this shared machine can afford. The JSON report is the last line.

    python scripts/bench_longest.py                                  # 2 x 2, 1 layer, budget 3.5 GiB
    python scripts/bench_longest.py --ring 1 --ulysses 4 --json longest.json
    python scripts/bench_longest.py --ring 1 --ulysses 4 --keep-head-shards
    python scripts/bench_longest.py --device cuda --budget-gib 40 --lengths 8192,16384,32768
"""

from __future__ import annotations

import math
import time

import torch

from seqpar.planner.memory import CPU_CALIBRATION, GPU_CALIBRATION, ModelShape, calibrate_from_fit, derived, longest_context
from seqpar.tools.longest import StackConfig, add_stack_arguments, measure_peak, stack_arguments
from seqpar.tools.one_rank import fake_world
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table

GiB = 2**30


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if len(values) < 2 or min(values) < 1 or len(set(values)) < 2:
        raise ValueError(f"--lengths needs at least two different positive token counts, got {text!r}")
    return sorted(set(values))


def _fit(points: list[tuple[int, int]]) -> tuple[float, float, float]:
    """``peak = a + b * T``: the slope ``b`` the larger of the least-squares slope and the last
    segment's, with ``a`` raised to the upper envelope (every point on or below the line). Returns
    ``(b, a, largest |residual| of the least-squares line in bytes)``.

    The envelope matters on a GPU: the allocator's peaks scatter by tens of MiB around the line
    (53 MiB on an H200 at 32k-98k tokens per rank), and a least-squares line then predicts a length
    whose peak lands that much over the budget (20.032 GiB for a 20 GiB budget, measured). The last
    segment matters on the CPU: the peak is the largest of several moments' lines (convex in
    ``T``), so the steepest one takes over at the longest lengths (fp32, 2 x 2, trained lm-head:
    56,484 bytes per token between 8,192 and 9,216 tokens, 58,436 from there on, measured), and a
    flatter least-squares slope lands the predicted length over the budget.
    """
    points = sorted(points)
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(p for _, p in points) / n
    b_ls = sum((t - mx) * (p - my) for t, p in points) / sum((t - mx) ** 2 for t, _ in points)
    residual = max(abs(p - (my + b_ls * (t - mx))) for t, p in points)
    (t1, p1), (t2, p2) = points[-2:]
    b = max(b_ls, (p2 - p1) / (t2 - t1))
    a = max(p - b * t for t, p in points)
    return b, a, residual


def main() -> None:
    parser = script_parser(__doc__)
    add_stack_arguments(parser, layers=1)
    parser.add_argument("--cp-rank", type=int, default=0, help="the rank to run")
    parser.add_argument("--mlp-chunks", type=int, default=8, help="TiledTokenwise chunks of the MLP")
    parser.add_argument("--loss-chunk", type=int, default=None,
                        help="tokens per chunk of the tiled loss (default: the library's, 2**24 // vocab)")
    parser.add_argument("--train-embeddings", action="store_true",
                        help="train the embedding and lm-head (default: frozen)")
    parser.add_argument("--offload", action="store_true",
                        help="checkpointed layer inputs in pinned host memory (CUDA only; default: off)")
    parser.add_argument("--keep-head-shards", action="store_true",
                        help="ParallelState(keep_head_shards=True): Ulysses keeps the head shards (U > 1)")
    parser.add_argument("--ring-comm", default="p2p", choices=("p2p", "p2p_serial"),
                        help="ParallelState(ring_comm=...): the ring with or without overlap (R > 1); the "
                             "memory model counts the overlapped ring's buffers either way (an upper estimate)")
    parser.add_argument("--storage-tracker", action="store_true",
                        help="CPU: measure the peak of tensor storage (StorageTracker, a dispatch mode: no kernel "
                             "scratch, gradients summed out of place) instead of the CPU allocator's")
    parser.add_argument("--lengths", default="256,512,1024,1536", help="tokens per rank of the fit, comma-separated")
    parser.add_argument("--check-lengths", default="",
                        help="tokens per rank measured after the fit and compared with the model, not fitted "
                             "(e.g. short lengths where the loss's backward is the peak), comma-separated")
    parser.add_argument("--budget-gib", type=float, default=3.5, help="the validation's memory budget per rank, GiB")
    parser.add_argument("--reserve-mib", type=float, default=0.0,
                        help="MiB of the budget the validation's prediction keeps free (the model's reserve_bytes)")
    parser.add_argument("--no-validate", action="store_true", help="fit only (default: validate too)")
    parser.add_argument("--validate-with", choices=("fit", "shipped"), default="fit",
                        help="the calibration whose prediction the validation runs: this run's fit, or the one "
                             "seqpar ships for the device (GPU_CALIBRATION on cuda, CPU_CALIBRATION on cpu)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    add_output_arguments(parser, "the measured and predicted peak of every run, GiB")
    args = parser.parse_args()
    try:
        lengths = _ints(args.lengths)
        checks = sorted({int(x) for x in args.check_lengths.split(",") if x.strip()})
        if any(t < 1 for t in checks):
            raise ValueError(f"--check-lengths needs positive token counts, got {args.check_lengths!r}")
        config = StackConfig(**stack_arguments(args), cp_rank=args.cp_rank, mlp_chunks=args.mlp_chunks, loss_chunk=args.loss_chunk, train_embeddings=args.train_embeddings,
                             offload=args.offload, keep_head_shards=args.keep_head_shards, ring_comm=args.ring_comm)
        if args.budget_gib <= 0:
            raise ValueError(f"--budget-gib must be positive, got {args.budget_gib}")
        if args.reserve_mib < 0:
            raise ValueError(f"--reserve-mib must be >= 0, got {args.reserve_mib}")
    except ValueError as e:
        parser.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    torch.set_num_threads(args.threads)
    shape = ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, ffn=args.ffn, vocab=args.vocab, dtype=getattr(torch, args.dtype))
    # The model's options for this run: one rank, no optimizer, nothing sharded (ZeRO 0).
    options = dict(ring=args.ring, ulysses=args.ulysses, dp=1, checkpointing=True, offload=args.offload,
                   tiled_loss=True, loss_chunk_tokens=args.loss_chunk, tiled_mlp_chunks=args.mlp_chunks, zero_stage=0, optimizer_bytes_per_param=0,
                   train_embeddings=args.train_embeddings, keep_head_shards=args.keep_head_shards)
    budget = int(args.budget_gib * GiB)
    reserve = int(args.reserve_mib * 2**20)
    derived_fixed = max(m.fixed_bytes for m in derived(shape, **options).moments.values())
    if budget <= derived_fixed + reserve:
        # Checked before the runs: the fit would otherwise end with nothing that fits the budget.
        parser.error(f"--budget-gib {args.budget_gib}: the fixed bytes of this stack alone are "
                     f"{derived_fixed / GiB:.2f} GiB (parameters, the layer's gradients, the loss chunk; "
                     f"{args.dtype}) plus --reserve-mib {args.reserve_mib:g}; pass a larger --budget-gib")
    shipped_cal, shipped_name = ((GPU_CALIBRATION, "GPU_CALIBRATION") if args.device == "cuda"
                                 else (CPU_CALIBRATION, "CPU_CALIBRATION"))
    start = time.perf_counter()
    runs: list[dict] = []

    def run(tokens: int, purpose: str) -> dict:
        progress("bench_longest", f"{purpose}: {tokens} tokens per rank ({config.ring} x {config.ulysses})")
        r = measure_peak(config, tokens, allocator=not args.storage_tracker)
        r["purpose"] = purpose
        runs.append(r)
        return r

    with fake_world(config.ring * config.ulysses, config.cp_rank, torch.device(args.device)):
        points = [(r["local_tokens"], r["peak_bytes"]) for r in (run(t, "fit") for t in lengths)]
        slope, intercept, residual = _fit(points)
        try:
            cal = calibrate_from_fit(slope, intercept, shape, fit_tokens=tuple(t for t, _ in points), source=(
                f"scripts/bench_longest.py --ring {args.ring} --ulysses {args.ulysses} --layers {args.layers} "
                f"--lengths {args.lengths} ({args.device}, {args.dtype})"), **options)
        except ValueError as e:
            measured = ", ".join(f"{t:,} tokens: {p / GiB:.3f} GiB" for t, p in points)
            raise SystemExit(f"bench_longest: {e}\nmeasured peaks: {measured}") from None
        fresh = longest_context(shape, device_bytes=budget, reserve_bytes=0, calibration=cal, **options)
        # The shipped calibration's line (its bytes at any length do not depend on the budget) and its
        # longest for the budget (0 when its fixed bytes alone exceed it).
        shipped_model = longest_context(shape, device_bytes=1 << 60, reserve_bytes=0, calibration=shipped_cal,
                                        **options)
        try:
            shipped = longest_context(shape, device_bytes=budget, reserve_bytes=0, calibration=shipped_cal,
                                      **options).longest_local_tokens
        except ValueError:
            if args.validate_with == "shipped" and not args.no_validate:
                raise SystemExit(f"bench_longest: the shipped {shipped_name} leaves nothing of "
                                 f"--budget-gib {args.budget_gib} for this stack; pass a larger budget") from None
            shipped = 0
        # The validation's calibration and its line.
        judge_cal, judge = (cal, fresh) if args.validate_with == "fit" else (shipped_cal, shipped_model)
        for t in checks:
            run(t, "check (not fitted)")
        validation = None
        if not args.no_validate:
            # The prediction for the budget less the reserve; the table's model column is the line itself.
            t_max = longest_context(shape, device_bytes=budget, reserve_bytes=reserve, calibration=judge_cal,
                                    **options).longest_local_tokens
            t_over = math.ceil(1.1 * t_max)
            at, over = run(t_max, "validate: predicted longest"), run(t_over, "validate: +10%")
            validation = {
                "budget_bytes": budget, "reserve_bytes": reserve, "predicted_local_tokens": t_max,
                "over_local_tokens": t_over,
                "peak_at_predicted": at["peak_bytes"], "peak_at_over": over["peak_bytes"],
                "predicted_peak_at_predicted": judge.device_bytes_at(t_max), "calibration": args.validate_with,
                "fits": at["peak_bytes"] <= budget, "over_exceeds": over["peak_bytes"] > budget,
            }
            validation["passed"] = validation["fits"] and validation["over_exceeds"]
    seconds = time.perf_counter() - start

    rows = [[r["purpose"], f"{r['local_tokens']:,}", f"{r['seq_len']:,}", f"{r['peak_bytes'] / GiB:.3f}",
             f"{fresh.device_bytes_at(r['local_tokens']) / GiB:.3f}",
             f"{r['peak_bytes'] / fresh.device_bytes_at(r['local_tokens']):.4f}",
             f"{r['peak_bytes'] / shipped_model.device_bytes_at(r['local_tokens']):.4f}",
             fresh.moment_at(r["local_tokens"]), f"{r['seconds']:.1f}"]
            for r in runs]
    for r in runs:
        r["shipped_model_bytes"] = shipped_model.device_bytes_at(r["local_tokens"])
    text = (
        f"One rank ({args.cp_rank}) of ring {args.ring} x Ulysses {args.ulysses}: Llama-shaped stack, {args.layers} "
        f"layer(s), hidden {args.hidden}, H {args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, FFN {args.ffn}, "
        f"V {args.vocab}, {args.dtype} on {args.device}, MLP chunks {args.mlp_chunks}, "
        f"embeddings {'trained' if args.train_embeddings else 'frozen'}\n"
        + table(["run", "T (per rank)", "S", "peak GiB", "model GiB", "measured / model",
                 f"measured / {shipped_name}", "model's moment", "seconds"], rows)
        + f"\n\nfit: {slope:,.0f} bytes per token + {intercept / GiB:.3f} GiB (upper envelope; largest residual "
        f"{residual / 2**20:.2f} MiB)\ncalibration: layer_factor {cal.layer_factor:.4f}, overhead "
        f"{cal.overhead_bytes / 2**20:+.1f} MiB (shipped {shipped_name}: {shipped_cal.factor_for(args.ring, args.ulysses):.4f}, "
        f"{shipped_cal.overhead_bytes / 2**20:+.1f} MiB; its longest for the budget: {shipped:,} tokens per rank)"
        "\n\n" + fresh.table()
    )
    if validation is not None:
        text += (
            f"\n\nvalidation at {args.budget_gib} GiB"
            + (f" ({args.reserve_mib:g} MiB kept free)" if reserve else "")
            + (f", predicted by the shipped {shipped_name}" if args.validate_with == "shipped" else "")
            + f": predicted longest {validation['predicted_local_tokens']:,} "
            f"tokens per rank: measured peak {validation['peak_at_predicted'] / GiB:.3f} GiB "
            f"({'fits' if validation['fits'] else 'DOES NOT FIT'}); +10% ({validation['over_local_tokens']:,}): "
            f"{validation['peak_at_over'] / GiB:.3f} GiB ({'exceeds' if validation['over_exceeds'] else 'DOES NOT EXCEED'}"
            f" the budget) -> {'PASSED' if validation['passed'] else 'FAILED'}"
        )
    report = {
        "args": vars(args), "runs": runs, "fit": {"bytes_per_token": slope, "intercept_bytes": intercept,
                                                  "largest_residual_bytes": residual},
        "calibration": {"layer_factor": cal.layer_factor, "overhead_bytes": cal.overhead_bytes, "source": cal.source},
        "shipped_calibration": {"name": shipped_name,
                                "layer_factor": shipped_cal.factor_for(args.ring, args.ulysses),
                                "overhead_bytes": shipped_cal.overhead_bytes,
                                "longest_local_tokens": shipped},
        "prediction": {"bytes_per_token_per_rank": fresh.bytes_per_token_per_rank,
                       "fixed_bytes_per_rank": fresh.fixed_bytes_per_rank,
                       "longest_local_tokens": fresh.longest_local_tokens, "longest_tokens": fresh.longest_tokens,
                       "limited_by_moment": fresh.limited_by_moment, "moments": fresh.breakdown},
        "validation": validation, "seconds": seconds,
    }
    notes = [
        f"{seconds:.0f} s in all, {args.threads} thread(s)",
        "peak: " + runs[0]["measured_by"] + ("; kernel scratch that never becomes a tensor is not seen"
                                             if args.device == "cpu" and args.storage_tracker else ""),
        "frozen embedding and lm-head, no optimizer step: the model's options for this run are zero_stage=0, "
        "optimizer_bytes_per_param=0, train_embeddings=False" if not args.train_embeddings else None,
    ]
    plot = chart(args.plot, "Peak bytes of one rank: measured and predicted (GiB)",
                 [f"{r['purpose']}, T={r['local_tokens']}" for r in runs],
                 {"measured": [r["peak_bytes"] / GiB for r in runs],
                  "model": [fresh.device_bytes_at(r["local_tokens"]) / GiB for r in runs]},
                 "GiB", reference_line=args.budget_gib)
    emit(report, text, notes, args.json, plot=plot)
    if validation is not None and not validation["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
