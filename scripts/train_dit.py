"""Train a small video DiT (flow matching) on synthetic clips with its attention under parallel_sdpa.

    python -m torch.distributed.run --standalone --nproc_per_node 4 scripts/train_dit.py --ring 2 --ulysses 2 \\
        --steps 30 --check --plot dit_loss.png

The model (``seqpar.tools.models.VideoDiT``) is plain PyTorch: every attention is
``F.scaled_dot_product_attention``. The only changes for context parallelism are here: the
patch tokens of a clip (13 x 9 x 15 = 1755 by default, an odd count) and their global positions are
sharded over the CP ranks, the forward runs inside ``seqpar.parallel_sdpa(state)``, and each rank
backpropagates its share of the global mean squared error (``seqpar.training.sharded_mean``).
Data-parallel replicas (``world / (ring * ulysses)``) draw different clips; gradients are summed
over CP and averaged over DP by ``seqpar.training.wrap_ddp``.

Clips are a few Gaussian blobs moving in straight lines; the model learns the flow-matching
velocity ``x1 - x0`` from ``x_t = (1 - t) x0 + t x1`` (``x0`` noise, ``x1`` the clip).

``--check`` makes rank 0 repeat the first ``--check-steps`` steps on one device on the unsharded
clips and exits non-zero if any step's loss or gradient norm differs by more than ``--tol``
(relative; the gradient norm catches a wrong gradient scale, which Adam's updates would hide).
``--plot`` saves the loss curve.
"""

from __future__ import annotations

import argparse
import sys

import torch

import seqpar
from seqpar.tools.models import VideoDiT, patchify
from seqpar.tools.report import script_parser
from seqpar.tools.train_harness import (
    Plot,
    add_check_args,
    add_parallel_args,
    finish,
    launch,
    parallel_state,
    train_loop,
)
from seqpar.training import sharded_mean, wrap_ddp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__)
    add_parallel_args(p)
    p.add_argument(
        "--grid", type=int, nargs=3, default=(13, 9, 15), metavar=("T", "H", "W"), help="token grid"
    )
    p.add_argument("--channels", type=int, default=4, help="latent channels")
    p.add_argument("--batch", type=int, default=1, help="clips per step and DP replica")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    p.add_argument("--dim", type=int, default=48, help="model width")
    p.add_argument("--depth", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=3, help="attention heads (3: not a multiple of U=2)")
    add_check_args(p, check_steps=5)
    return p.parse_args(argv)


PATCH = (1, 2, 2)


def make_batch(
    args: argparse.Namespace, step: int, replica: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_t tokens, t, velocity tokens)``: ``[B, S, P]``, ``[B]``, ``[B, S, P]`` (same on a replica)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + replica)
    gt, gh, gw = args.grid
    frames, height, width = gt * PATCH[0], gh * PATCH[1], gw * PATCH[2]
    tt = torch.arange(frames, dtype=torch.float32)[:, None, None]
    yy = torch.arange(height, dtype=torch.float32)[None, :, None]
    xx = torch.arange(width, dtype=torch.float32)[None, None, :]
    clips = torch.zeros(args.batch, args.channels, frames, height, width)
    for b in range(args.batch):
        for _ in range(3):
            y0, x0 = torch.rand(2, generator=g) * torch.tensor([height, width])
            vy, vx = (torch.rand(2, generator=g) - 0.5) * 2
            color = torch.randn(args.channels, generator=g)
            sigma = 1.5 + 2 * torch.rand(1, generator=g)
            d2 = (yy - y0 - vy * tt) ** 2 + (xx - x0 - vx * tt) ** 2
            clips[b] += color[:, None, None, None] * torch.exp(-d2 / (2 * sigma**2))
    x1 = patchify(clips, PATCH)
    x0 = torch.randn(x1.shape, generator=g)
    t = torch.rand(args.batch, generator=g)
    xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
    return xt, t, x1 - x0


def new_model(args: argparse.Namespace, device: torch.device) -> VideoDiT:
    torch.manual_seed(args.seed)
    return VideoDiT(
        in_channels=args.channels,
        patch=PATCH,
        grid=tuple(args.grid),
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
    ).to(device)


def main(argv: list[str] | None = None) -> int:
    return launch(parse_args(argv), train)


def train(args: argparse.Namespace, device: torch.device) -> int:
    state = parallel_state("train_dit", args)
    model = wrap_ddp(new_model(args, device), state)
    num_tokens = args.grid[0] * args.grid[1] * args.grid[2]
    positions = seqpar.shard_positions(num_tokens, state, device)

    def loss_share(step: int) -> torch.Tensor:
        """This rank's share of the step's global mean squared error."""
        xt, t, v = (x.to(device) for x in make_batch(args, step, state.dp_rank))
        with seqpar.parallel_sdpa(state, seq_len=num_tokens):
            pred = model(seqpar.shard(xt, state), t, positions)  # [B, S_local, P]
        return sharded_mean((pred - seqpar.shard(v, state)) ** 2, state)

    def replica_loss(ref: torch.nn.Module, step: int, replica: int) -> torch.Tensor:
        """``--check``: the mean squared error on one replica's unsharded clips."""
        xt, t, v = (x.to(device) for x in make_batch(args, step, replica))
        return ((ref(xt, t) - v) ** 2).mean()

    losses, norms = train_loop("train_dit", args, state, model, loss_share)
    grid = "x".join(map(str, args.grid))
    return finish(
        "train_dit",
        args,
        state,
        device,
        losses,
        norms,
        reference_model=lambda: new_model(args, device),
        replica_loss=replica_loss,
        plot_style=Plot(
            f"video DiT, {grid} = {num_tokens} tokens, ring {args.ring} x ulysses {args.ulysses} x dp "
            f"{state.dp_size} ({state.dp_size * state.cp_size} ranks)",
            ylabel="flow-matching MSE",
            label="context parallel (parallel_sdpa)",
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
