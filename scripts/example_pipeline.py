"""Run a whole diffusers pipeline call context-parallel with seqpar and check it against one device.

    python scripts/example_pipeline.py                            # Flux, 2 ranks, Ulysses
    python scripts/example_pipeline.py --model wan2.2 --world 3 --ring 3
    python -m torch.distributed.run --nproc-per-node 4 scripts/example_pipeline.py --ring 2 --ulysses 2

A tiny random pipeline of the chosen family (seqpar.tools.models.pipelines: real tiny VAE and
scheduler, no download, text given as embeddings) is built on every rank from one seed. Each rank
first calls it on its own (the one-device reference), then calls
``seqpar.integrations.diffusers.parallelize(model, state)`` on the pipeline's transformer(s) --
Wan 2.2's two-stage pipeline has two -- and calls it again with the same generator seed: the
latents (and so the image or video) are split over the CP ranks inside each transformer call and
gathered after it. Rank 0 prints both outputs' largest difference; the script exits non-zero if
it exceeds ``--tol``.

Without ``torchrun`` the ranks are local gloo processes (``seqpar.tools.bench.Ranks``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import seqpar
from seqpar.integrations.diffusers import parallelize
from seqpar.tools.bench import check_on_ranks
from seqpar.tools.models.pipelines import (
    denoisers,
    flux_call,
    latent_tokens,
    tiny_flux_pipeline,
    tiny_wan_pipeline,
    wan_call,
)
from seqpar.tools.report import script_parser


def build(args: argparse.Namespace):
    """The tiny pipeline of ``args.model`` and its call's keyword arguments."""
    if args.model == "flux":
        return tiny_flux_pipeline(), flux_call(
            height=args.height or 12, width=args.width or 20, steps=args.steps, text_tokens=args.text
        )
    pipe = tiny_wan_pipeline(two_stage=args.model == "wan2.2")
    return pipe, wan_call(
        height=args.height or 16, width=args.width or 80, num_frames=args.frames, steps=args.steps,
        text_tokens=args.text,
    )


def generate(pipe, call: dict, seed: int) -> torch.Tensor:
    """The pipeline's decoded output (images or video frames in [0, 1]) as one tensor."""
    return torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(seed), output_type="np",
                                return_dict=False)[0])


def run(args: argparse.Namespace) -> float:
    """On every rank: the pipeline on one device, then with parallel transformers; the difference."""
    state = seqpar.ParallelState(ring_size=args.ring, ulysses_size=args.ulysses)
    pipe, call = build(args)
    want = generate(pipe, call, args.seed)
    for model in denoisers(pipe):
        parallelize(model, state)
    got = generate(pipe, call, args.seed)  # the same seed on every CP rank: the same latents
    err = float((got - want).abs().max())
    if state.cp_rank == 0 and dist.get_rank() == 0:
        print(
            f"{type(pipe).__name__} ({args.model}, {len(denoisers(pipe))} transformer(s)): "
            f"{latent_tokens(pipe, call)} latent tokens + {args.text} text tokens, {args.steps} steps over ring "
            f"{args.ring} x ulysses {args.ulysses}: output {tuple(got.shape)}, max difference from one device {err:.1e}"
        )
    return err


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--model", choices=["flux", "wan", "wan2.2"], default="flux",
                   help="pipeline: FluxPipeline, WanPipeline (2.1), or WanPipeline with two transformers (2.2)")
    p.add_argument("--world", type=int, default=2, help="local gloo ranks (ignored under torchrun)")
    p.add_argument("--ring", type=int, default=1, help="ring size R")
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses size U (default: world // ring)")
    p.add_argument("--height", type=int, default=None,
                   help="pixels, a multiple of 4 for flux, of 16 for wan (default: 12 for flux, 16 for wan)")
    p.add_argument("--width", type=int, default=None,
                   help="pixels, a multiple of 4 for flux, of 16 for wan (default: 20 for flux, 80 for wan)")
    p.add_argument("--frames", type=int, default=9, help="video frames for wan, 4 k + 1 (default 9: 3 latent frames)")
    p.add_argument("--text", type=int, default=7, help="text tokens (default 7)")
    p.add_argument("--steps", type=int, default=3, help="inference steps (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed, the same on every rank (default 0)")
    p.add_argument("--tol", type=float, default=1e-4, help="max difference from one device (default 1e-4)")
    args = p.parse_args()
    check_on_ranks(run, args)


if __name__ == "__main__":
    main()
