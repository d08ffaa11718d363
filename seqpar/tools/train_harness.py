"""What ``scripts/train_lm.py`` and ``scripts/train_dit.py`` share: launch, training loop, ``--check``, plot.

A training script supplies its model, its data and two losses -- this rank's share of a step's
global loss under context parallelism, and the full loss of one data-parallel replica's batch on
one device -- and calls, in order::

    add_parallel_args(parser) ... add_check_args(parser, check_steps=...)
    launch(args, train)                 # device, process group; train(args, device) -> exit code
    state = parallel_state(script, args)
    losses, norms = train_loop(script, args, state, model, loss_share)
    return finish(script, args, state, device, losses, norms, reference_model, replica_loss, plot_style)

``--check`` makes rank 0 repeat the first ``--check-steps`` steps on one device
(:func:`reference_run`) and fail loudly if any step's loss or gradient norm differs by more than
``--tol`` (relative); every rank exits with rank 0's verdict.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import seqpar
from seqpar.training import global_loss

from .bench import torchrun_group


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--ring`` and ``--ulysses``, the context-parallel sizes."""
    p.add_argument("--ring", type=int, default=2, help="ring size R")
    p.add_argument("--ulysses", type=int, default=2, help="Ulysses size U")


def add_check_args(p: argparse.ArgumentParser, *, check_steps: int) -> None:
    """``--seed``, ``--check``, ``--check-steps`` (default ``check_steps``), ``--tol``, ``--plot``."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare the first steps with one device")
    p.add_argument("--check-steps", type=int, default=check_steps)
    p.add_argument(
        "--tol", type=float, default=1e-4, help="max relative difference of loss and gradient norm in --check"
    )
    p.add_argument("--plot", default=None, help="save the loss curve to this image path")


def launch(args: argparse.Namespace, train: Callable[[argparse.Namespace, torch.device], int]) -> int:
    """Run ``train(args, device)`` on this torchrun rank inside a process group; return its code.

    CUDA (one GPU per local rank, NCCL) when available, else CPU with gloo and the cores split
    evenly between the node's ranks (``seqpar.tools.bench.torchrun_group``, which also makes the
    ranks leave together). ``--check-steps`` is capped at ``--steps``.
    """
    args.check_steps = min(args.check_steps, args.steps)
    with torchrun_group("auto", timeout_s=600, split_cpu_threads=True) as device:
        return train(args, device)


def parallel_state(script: str, args: argparse.Namespace) -> seqpar.ParallelState:
    """``ParallelState(--ring, --ulysses)``; exits with the reason (prefixed ``script:``) if the
    sizes do not fit the world."""
    try:
        return seqpar.ParallelState(args.ring, args.ulysses)
    except ValueError as e:
        raise SystemExit(f"{script}: {e}") from None


def grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of all parameter gradients (sensitive to the gradient scale, unlike Adam's steps)."""
    return torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    ).item()


def _optimise(
    model: torch.nn.Module, lr: float, steps: Iterable[int], backward: Callable[[int], float]
) -> tuple[list[float], list[float]]:
    """AdamW over ``steps``: each step zeroes the gradients, calls ``backward(step)`` (which
    backpropagates the step's loss and returns its value), records the gradient norm, updates.

    Returns:
        ``(losses, grad_norms)``, one value per step.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        losses.append(backward(step))
        norms.append(grad_norm(model))
        opt.step()
    return losses, norms


def train_loop(
    script: str,
    args: argparse.Namespace,
    state: seqpar.ParallelState,
    model: torch.nn.Module,
    loss_share: Callable[[int], torch.Tensor],
) -> tuple[list[float], list[float]]:
    """``--steps`` AdamW steps (``--lr``) of the context-parallel run, a tqdm bar on rank 0.

    ``loss_share(step)`` is this rank's share of the step's global loss (its batch sharded over
    the CP group, e.g. ``seqpar.training.sharded_cross_entropy``); ``model`` is wrapped by
    ``seqpar.training.wrap_ddp``, so the backward sums gradients over CP and averages over DP.

    Returns:
        ``(losses, grad_norms)`` per step: the global loss (sum over CP, mean over DP) and this
        rank's gradient norm after synchronisation.
    """
    from tqdm import tqdm

    bar = tqdm(
        range(args.steps),
        disable=dist.get_rank() != 0,
        desc=f"{script} ring {args.ring} x ulysses {args.ulysses}",
    )

    def backward(step: int) -> float:
        share = loss_share(step)
        share.backward()  # DDP: gradients summed over CP, averaged over DP
        loss = global_loss(share, state).item()
        bar.set_postfix(loss=f"{loss:.4f}")
        return loss

    return _optimise(model, args.lr, bar, backward)


def reference_run(
    args: argparse.Namespace,
    model: torch.nn.Module,
    dp_size: int,
    replica_loss: Callable[[torch.nn.Module, int, int], torch.Tensor],
) -> tuple[list[float], list[float]]:
    """The first ``--check-steps`` steps on one device, the same optimiser as :func:`train_loop`.

    ``replica_loss(model, step, replica)`` is the mean loss of replica ``replica``'s unsharded
    batch; each step backpropagates their mean over the ``dp_size`` replicas.

    Returns:
        ``(losses, grad_norms)`` per step: the mean over replicas of their mean loss, and the
        gradient norm.
    """

    def backward(step: int) -> float:
        total = 0.0
        for replica in range(dp_size):
            loss = replica_loss(model, step, replica) / dp_size
            loss.backward()
            total += loss.item()
        return total

    return _optimise(model, args.lr, range(args.check_steps), backward)


def _check(
    script: str,
    args: argparse.Namespace,
    losses: list[float],
    norms: list[float],
    reference: list[float],
    ref_norms: list[float],
) -> bool:
    """Compare each checked step's loss and gradient norm (relative difference at most ``--tol``);
    print the verdict -- on failure a banner with both runs, to stderr."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    norm_diffs = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
    worst = max(diffs + norm_diffs)
    if worst > args.tol:
        print(
            "\n"
            + "!" * 72
            + f"\n{script} --check FAILED: context-parallel training differs from the single-device run\n"
            f"  max relative difference {worst:.3e} > tol {args.tol:.1e}\n"
            f"  loss, context parallel:      {[round(x, 6) for x in losses[: args.check_steps]]}\n"
            f"  loss, single device:         {[round(x, 6) for x in reference]}\n"
            f"  grad norm, context parallel: {[round(x, 6) for x in norms[: args.check_steps]]}\n"
            f"  grad norm, single device:    {[round(x, 6) for x in ref_norms]}\n" + "!" * 72,
            file=sys.stderr,
            flush=True,
        )
        return False
    print(
        f"{script} --check OK: {args.check_steps} steps, max relative difference of loss and "
        f"gradient norm {worst:.2e} "
        f"(tol {args.tol:.0e}) vs single device",
        flush=True,
    )
    return True


@dataclass(frozen=True)
class Plot:
    """How ``--plot`` draws the loss curve."""

    title: str
    ylabel: str = "loss"
    label: str = "context parallel"


def plot(path: str, losses: list[float], reference: list[float] | None, style: Plot) -> None:
    """Save the loss curve per step, with the single-device losses of ``--check`` as circles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(losses)), losses, label=style.label)
    if reference:
        ax.plot(range(len(reference)), reference, "o", mfc="none", label="single device (--check)")
    ax.set_xlabel("step")
    ax.set_ylabel(style.ylabel)
    ax.set_title(style.title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(
    script: str,
    args: argparse.Namespace,
    state: seqpar.ParallelState,
    device: torch.device,
    losses: list[float],
    norms: list[float],
    reference_model: Callable[[], torch.nn.Module],
    replica_loss: Callable[[torch.nn.Module, int, int], torch.Tensor],
    plot_style: Plot,
) -> int:
    """After :func:`train_loop`: ``--check`` on rank 0, its verdict broadcast, the summary and
    ``--plot``.

    With ``--check``, rank 0 builds ``reference_model()`` (same initial weights, stock attention,
    on ``device``) and runs :func:`reference_run` with ``replica_loss``.

    Returns:
        The exit code, the same on every rank: 1 if ``--check`` failed, else 0.
    """
    rank = dist.get_rank()
    ok = torch.ones(1, device=device)
    reference = None
    if args.check:
        if rank == 0:
            reference, ref_norms = reference_run(args, reference_model(), state.dp_size, replica_loss)
            if not _check(script, args, losses, norms, reference, ref_norms):
                ok.zero_()
        dist.broadcast(ok, src=0)
    if rank == 0:
        print(f"{script}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps", flush=True)
        if args.plot:
            plot(args.plot, losses, reference, plot_style)
            print(f"{script}: plot saved to {args.plot}", flush=True)
    return 0 if bool(ok.item()) else 1
