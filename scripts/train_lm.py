"""Train a tiny Llama-style causal LM on long synthetic documents with hybrid context parallelism.

    torchrun --standalone --nproc_per_node 4 scripts/train_lm.py --ring 2 --ulysses 2 \\
        --seq-len 1023 --steps 40 --check --plot lm_loss.png

Every step, each data-parallel replica (``world / (ring * ulysses)`` of them) draws one batch of
``--seq-len`` tokens made of documents of random length (random walks on a fixed sparse Markov
chain that often copy the token 17 positions back, see ``make_batch``). Labels are shifted on the global
sequence (no target across a document boundary), the sequence is sharded over the replica's CP
ranks (zig-zag ring x Ulysses), the model runs with ``attn_implementation="seqpar"`` on its shard
and every rank backpropagates its share of the global token-mean loss. Gradients are summed over
CP and averaged over DP by ``seqpar.training.wrap_ddp``.

``--check`` makes rank 0 repeat the first ``--check-steps`` steps on one device with the stock
``sdpa`` attention on the unsharded batches, and exits non-zero if any step's loss or gradient
norm differs by more than ``--tol`` (relative; the gradient norm catches a wrong gradient scale,
which Adam's updates would hide). ``--plot`` saves the loss curve (and the reference) as an image.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar.integrations.transformers import register
from seqpar.models import tiny_llama_config
from seqpar.training import global_loss, sharded_cross_entropy, shift_labels, wrap_ddp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ring", type=int, default=2, help="ring size R")
    p.add_argument("--ulysses", type=int, default=2, help="Ulysses size U")
    p.add_argument("--seq-len", type=int, default=1023, help="tokens per sequence (any length)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step and DP replica")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare the first steps with one device")
    p.add_argument("--check-steps", type=int, default=6)
    p.add_argument(
        "--tol", type=float, default=1e-4, help="max relative difference of loss and gradient norm in --check"
    )
    p.add_argument("--plot", default=None, help="save the loss curve to this image path")
    return p.parse_args(argv)


def make_batch(args: argparse.Namespace, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, both ``[batch, seq_len]``, identical on every rank of a replica.

    Documents of 40-400 tokens are random walks on a fixed sparse Markov chain (4 successors per
    token, learnable quickly) that often repeat the token seen 17 positions earlier
    (learnable only through attention). Labels are shifted on the global sequence with the
    document boundaries (no target across documents).
    """
    successors = torch.randint(
        1, args.vocab, (args.vocab, 4), generator=torch.Generator().manual_seed(args.seed)
    )
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + replica)
    ids = torch.empty(args.batch, args.seq_len, dtype=torch.long)
    labels = torch.empty_like(ids)
    for b in range(args.batch):
        lens, total = [], 0
        while total < args.seq_len:
            n = min(int(torch.randint(40, 400, (1,), generator=g)), args.seq_len - total)
            lens.append(n)
            total += n
        choice = torch.randint(0, 4, (args.seq_len,), generator=g).tolist()
        copy = (torch.rand(args.seq_len, generator=g) < 0.25).tolist()
        seq, start = [], 0
        for n in lens:
            doc = [0]  # document start
            for i in range(1, n):
                j = start + i
                doc.append(doc[i - 17] if copy[j] and i >= 17 else int(successors[doc[-1], choice[j]]))
            seq.extend(doc)
            start += n
        ids[b] = torch.tensor(seq)
        labels[b] = shift_labels(ids[b], seq_lens=lens)
    return ids, labels


def new_model(args: argparse.Namespace, attn_implementation: str, device: torch.device):
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.seq_len),
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn_implementation).to(device)


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
    model = new_model(args, "sdpa", device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, norms = [], []
    for step in range(args.check_steps):
        total = 0.0
        opt.zero_grad(set_to_none=True)
        for replica in range(dp_size):
            ids, labels = (t.to(device) for t in make_batch(args, step, replica))
            logits = model(input_ids=ids).logits
            loss = (
                F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100) / dp_size
            )
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
    ax.plot(range(len(losses)), losses, label="context parallel")
    if reference:
        ax.plot(range(len(reference)), reference, "o", mfc="none", label="single device (--check)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check and args.check_steps > args.steps:
        args.check_steps = args.steps
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
        raise SystemExit(f"train_lm: {e}") from None
    rank = dist.get_rank()
    model = wrap_ddp(new_model(args, register(state), device), state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    positions = seqpar.shard_positions(args.seq_len, state, device)[None]
    losses, norms = [], []
    bar = tqdm(
        range(args.steps), disable=rank != 0, desc=f"train_lm ring {args.ring} x ulysses {args.ulysses}"
    )
    for step in bar:
        ids, labels = make_batch(args, step, state.dp_rank)
        ids, labels = seqpar.shard(ids.to(device), state), seqpar.shard(labels.to(device), state)
        logits = model(input_ids=ids, position_ids=positions).logits  # [B, S_local, V]
        share = sharded_cross_entropy(logits, labels, state)
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
                    + f"\ntrain_lm --check FAILED: context-parallel training differs from the single-device run\n"
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
                    f"train_lm --check OK: {args.check_steps} steps, max relative difference of loss and "
                    f"gradient norm {worst:.2e} "
                    f"(tol {args.tol:.0e}) vs single device",
                    flush=True,
                )
        dist.broadcast(ok, src=0)
    if rank == 0:
        print(f"train_lm: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps", flush=True)
        if args.plot:
            plot(
                args.plot,
                losses,
                reference,
                f"tiny Llama, S={args.seq_len}, ring {args.ring} x ulysses {args.ulysses}",
            )
            print(f"train_lm: plot saved to {args.plot}", flush=True)
    return 0 if bool(ok.item()) else 1


if __name__ == "__main__":
    sys.exit(main())
