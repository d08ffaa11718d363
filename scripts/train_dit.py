"""Train a small video DiT (flow matching) on synthetic clips with its attention under parallel_sdpa.

    torchrun --standalone --nproc_per_node 4 scripts/train_dit.py --ring 2 --ulysses 2 \\
        --steps 30 --check --plot dit_loss.png

The model (``seqpar.models.VideoDiT``) is plain PyTorch: every attention is
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
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import seqpar
from seqpar.models import VideoDiT, patchify
from seqpar.training import global_loss, sharded_mean, wrap_ddp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ring", type=int, default=2, help="ring size R")
    p.add_argument("--ulysses", type=int, default=2, help="Ulysses size U")
    p.add_argument(
        "--grid", type=int, nargs=3, default=(13, 9, 15), metavar=("T", "H", "W"), help="token grid"
    )
    p.add_argument("--channels", type=int, default=4, help="latent channels")
    p.add_argument("--batch", type=int, default=1, help="clips per step and DP replica")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dim", type=int, default=48)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=3, help="attention heads (3: not a multiple of U=2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare the first steps with one device")
    p.add_argument("--check-steps", type=int, default=5)
    p.add_argument(
        "--tol", type=float, default=1e-4, help="max relative difference of loss and gradient norm in --check"
    )
    p.add_argument("--plot", default=None, help="save the loss curve to this image path")
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


def grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of all parameter gradients (sensitive to the gradient scale, unlike Adam's steps)."""
    return torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    ).item()


def reference_losses(
    args: argparse.Namespace, dp_size: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """The first ``--check-steps`` steps on one device: per step, the mean over replicas of their
    mean loss and the gradient norm."""
    model = new_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, norms = [], []
    for step in range(args.check_steps):
        total = 0.0
        opt.zero_grad(set_to_none=True)
        for replica in range(dp_size):
            xt, t, v = (x.to(device) for x in make_batch(args, step, replica))
            loss = ((model(xt, t) - v) ** 2).mean() / dp_size
            loss.backward()
            total += loss.item()
        norms.append(grad_norm(model))
        opt.step()
        losses.append(total)
    return losses, norms


def plot(path: str, losses: list[float], reference: list[float] | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(losses)), losses, label="context parallel (parallel_sdpa)")
    if reference:
        ax.plot(range(len(reference)), reference, "o", mfc="none", label="single device (--check)")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching MSE")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.check_steps = min(args.check_steps, args.steps)
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=10))
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> int:
    from tqdm import tqdm

    try:
        state = seqpar.ParallelState(args.ring, args.ulysses)
    except ValueError as e:
        raise SystemExit(f"train_dit: {e}") from None
    rank = dist.get_rank()
    model = wrap_ddp(new_model(args, device), state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    num_tokens = args.grid[0] * args.grid[1] * args.grid[2]
    positions = seqpar.shard_positions(num_tokens, state, device)
    losses, norms = [], []
    bar = tqdm(
        range(args.steps), disable=rank != 0, desc=f"train_dit ring {args.ring} x ulysses {args.ulysses}"
    )
    for step in bar:
        xt, t, v = (x.to(device) for x in make_batch(args, step, state.dp_rank))
        with seqpar.parallel_sdpa(state, seq_len=num_tokens):
            pred = model(seqpar.shard(xt, state), t, positions)  # [B, S_local, P]
        share = sharded_mean((pred - seqpar.shard(v, state)) ** 2, state)
        opt.zero_grad(set_to_none=True)
        share.backward()  # DDP: gradients summed over CP, averaged over DP
        norms.append(grad_norm(model))
        opt.step()
        losses.append(global_loss(share, state).item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")

    ok = torch.ones(1, device=device)
    reference = None
    if args.check:
        if rank == 0:
            reference, ref_norms = reference_losses(args, state.dp_size, device)
            diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
            norm_diffs = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
            worst = max(diffs + norm_diffs)
            if worst > args.tol:
                print(
                    "\n"
                    + "!" * 72
                    + f"\ntrain_dit --check FAILED: context-parallel training differs from the single-device run\n"
                    f"  max relative difference {worst:.3e} > tol {args.tol:.1e}\n"
                    f"  loss, context parallel:      {[round(x, 6) for x in losses[: args.check_steps]]}\n"
                    f"  loss, single device:         {[round(x, 6) for x in reference]}\n"
                    f"  grad norm, context parallel: {[round(x, 6) for x in norms[: args.check_steps]]}\n"
                    f"  grad norm, single device:    {[round(x, 6) for x in ref_norms]}\n" + "!" * 72,
                    file=sys.stderr,
                    flush=True,
                )
                ok.zero_()
            else:
                print(
                    f"train_dit --check OK: {args.check_steps} steps, max relative difference of loss and "
                    f"gradient norm {worst:.2e} "
                    f"(tol {args.tol:.0e}) vs single device",
                    flush=True,
                )
        dist.broadcast(ok, src=0)
    if rank == 0:
        print(f"train_dit: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps", flush=True)
        if args.plot:
            grid = "x".join(map(str, args.grid))
            plot(
                args.plot,
                losses,
                reference,
                f"video DiT, {grid} = {num_tokens} tokens, ring {args.ring} x ulysses {args.ulysses}",
            )
            print(f"train_dit: plot saved to {args.plot}", flush=True)
    return 0 if bool(ok.item()) else 1


if __name__ == "__main__":
    sys.exit(main())
