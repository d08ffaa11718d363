"""Benchmark seqpar's diffusers ``parallelize`` against diffusers' own context parallelism.

A random Flux transformer (``FluxTransformer2DModel``, sizes below) runs one denoising forward on
every rank of a local gloo pool, full inputs in, full output out, in two copies built from one
seed: one with ``seqpar.integrations.diffusers.parallelize(model, ParallelState(1, U))``, one with
diffusers' ``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=U))``. Both use
the model's own ``_cp_plan``. The two are timed interleaved (median over ``--iters``, after one
warm-up) and their outputs compared with each other and with the single-process model.

diffusers' context parallelism as shipped (0.42.1) does not run on CPU; this script patches, for
its own run only and never in seqpar:

- ``enable_parallelism`` computes the device as ``rank % torch.accelerator.device_count()``, which
  divides by zero without an accelerator: ``torch.accelerator.device_count`` answers 1 while
  ``enable_parallelism`` runs (the device mesh is then built on ``"cpu"`` with gloo);
- ``ulysses_anything`` gathers uneven parts with ``dist.all_gather`` of unequal shapes, which gloo
  refuses: the token counts here divide ``U`` and plain Ulysses is used;
- ring attention (``ring_degree > 1``) needs ``return_lse=True`` from the attention backend, which
  the native (SDPA) backend refuses: not benchmarked.

On a machine with fewer cores than ranks the times include time-sharing (the output warns); the
ratio between the two implementations, measured the same way and interleaved, stays comparable.

Output: a table, notes, then the report as one JSON line (last line); ``--json PATH`` writes it,
``--plot PATH`` saves a chart of the diffusers / seqpar time ratio per Ulysses degree.

Examples::

    python scripts/bench_diffusers.py                       # Ulysses 2 and 4, ~1-2 min on 2 cores
    python scripts/bench_diffusers.py --image-tokens 4096 --ulysses 2 --iters 5
"""

from __future__ import annotations

import argparse
import statistics

import torch

from seqpar.tools.bench import (
    Ranks,
    few_iterations_warning,
    time_sharing_warning,
    usable_cores,
)
from seqpar.tools.profiling import PhaseTimer
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table


def build(args: argparse.Namespace):
    """The random Flux model and its full inputs (the same on every rank)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=args.layers, num_single_layers=args.single_layers,
        attention_head_dim=args.head_dim, num_attention_heads=args.heads, joint_attention_dim=64,
        pooled_projection_dim=32, axes_dims_rope=(args.head_dim // 4, args.head_dim // 4, args.head_dim // 2),
    ).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    S, T = args.image_tokens, args.text_tokens
    inputs = dict(
        hidden_states=torch.randn(1, S, 16, generator=g), encoder_hidden_states=torch.randn(1, T, 64, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
        img_ids=torch.randn(S, 3, generator=g), txt_ids=torch.randn(T, 3, generator=g), return_dict=False,
    )
    return model, inputs


def enable_diffusers_cp(model, ulysses: int) -> None:
    """diffusers' own Ulysses, with the CPU patch described in the module docstring."""
    from diffusers import ContextParallelConfig

    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(count(), 1)
    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses))
    finally:
        torch.accelerator.device_count = count


def run_rank(args: argparse.Namespace, ulysses: int) -> dict:
    """On every rank: time both implementations interleaved; return times and output errors."""
    import seqpar
    from seqpar.integrations.diffusers import parallelize

    ours, inputs = build(args)
    parallelize(ours, seqpar.ParallelState(ring_size=1, ulysses_size=ulysses))
    theirs, _ = build(args)
    enable_diffusers_cp(theirs, ulysses)
    times = {"seqpar": [], "diffusers": []}
    outs = {}
    timer = PhaseTimer(torch.device("cpu"))
    with torch.no_grad():
        for it in range(args.iters + 1):
            for name, model in (("seqpar", ours), ("diffusers", theirs)):
                timer.start()
                outs[name] = model(**inputs)[0]
                seconds = timer.stop()[0]
                if it:  # the first round warms up
                    times[name].append(seconds)
    return {
        "seqpar_s": statistics.median(times["seqpar"]),
        "diffusers_s": statistics.median(times["diffusers"]),
        "seqpar_vs_diffusers_max_diff": float((outs["seqpar"] - outs["diffusers"]).abs().max()),
        "seqpar_out": outs["seqpar"],
    }


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--ulysses", default="2,4", help="Ulysses degrees to run, comma-separated")
    parser.add_argument("--image-tokens", type=int, default=2048, help="image tokens (patches) S")
    parser.add_argument("--text-tokens", type=int, default=256, help="text tokens T")
    parser.add_argument("--heads", type=int, default=8, help="attention heads H")
    parser.add_argument("--head-dim", type=int, default=32, help="head dim D")
    parser.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=2, help="single-stream blocks")
    parser.add_argument("--iters", type=int, default=3, help="timed forwards after one warm-up; the median is reported")
    add_output_arguments(parser, "the diffusers / seqpar time ratio per Ulysses degree")
    args = parser.parse_args()
    degrees = [int(u) for u in args.ulysses.split(",")]
    for u in degrees:
        if u < 2 or args.image_tokens % u or args.text_tokens % u or args.heads % u:
            raise SystemExit(
                f"--ulysses {u}: diffusers' plain Ulysses needs U >= 2 dividing --image-tokens "
                f"({args.image_tokens}), --text-tokens ({args.text_tokens}) and --heads ({args.heads})"
            )

    torch.set_num_threads(1)
    model, inputs = build(args)
    timer = PhaseTimer(torch.device("cpu"))
    progress("bench_diffusers", "one-process reference")
    with torch.no_grad():
        timer.start()
        reference = model(**inputs)[0]
        [one_process_s] = timer.stop()

    rows, results, cores = [], [], usable_cores()
    for u in degrees:
        progress("bench_diffusers", f"ulysses {u}: {u} local ranks, seqpar then diffusers")
        with Ranks(u, torchrun=False, timeout_s=3600) as ranks:  # local CPU ranks (see the docstring)
            per_rank = ranks.run(run_rank, args, u)
        seqpar_s = max(r["seqpar_s"] for r in per_rank)  # the slowest rank finishes the step
        diffusers_s = max(r["diffusers_s"] for r in per_rank)
        err = max(float((r["seqpar_out"] - reference).abs().max()) for r in per_rank)
        between = max(r["seqpar_vs_diffusers_max_diff"] for r in per_rank)
        results.append(dict(ulysses=u, seqpar_s=seqpar_s, diffusers_s=diffusers_s,
                            diffusers_over_seqpar=diffusers_s / seqpar_s, seqpar_max_err=err,
                            seqpar_vs_diffusers_max_diff=between))
        rows.append([f"ulysses {u}", f"{seqpar_s * 1e3:.1f}", f"{diffusers_s * 1e3:.1f}",
                     f"{diffusers_s / seqpar_s:.2f}", f"{err:.1e}", f"{between:.1e}"])
    text = table(["config", "seqpar ms", "diffusers ms", "diffusers/seqpar", "seqpar err", "seqpar-diffusers"], rows)
    notes = [
        (
            f"Flux forward: {args.image_tokens} image + {args.text_tokens} text tokens, {args.heads} heads x "
            f"{args.head_dim}, {args.layers} double + {args.single_layers} single blocks; one process: "
            f"{one_process_s * 1e3:.1f} ms; times are the slowest rank's median over {args.iters} iterations"
        ),
        "errors: max |output - one-process output| (seqpar), max |seqpar - diffusers| (both fp32)",
        few_iterations_warning(args.iters),
        time_sharing_warning(max(degrees), cores, "cpu"),
    ]
    report = dict(benchmark="diffusers", args=vars(args), one_process_s=one_process_s, cores=cores, results=results)
    plot = chart(
        args.plot,
        f"Flux forward, diffusers' Ulysses / seqpar's (> 1: seqpar faster): {args.image_tokens} image + "
        f"{args.text_tokens} text tokens, {args.heads} heads x {args.head_dim}; slowest rank's median over "
        f"{args.iters} iterations, interleaved",
        [f"ulysses {r['ulysses']}" for r in results],
        {"diffusers / seqpar": [r["diffusers_over_seqpar"] for r in results]},
        "time ratio (1.0 = equally fast)",
        value_format=".2f",
    )
    emit(report, text, notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
