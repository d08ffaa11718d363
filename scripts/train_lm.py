"""Train a tiny Llama-style causal LM on long synthetic documents with hybrid context parallelism.

    python -m torch.distributed.run --standalone --nproc_per_node 4 scripts/train_lm.py --ring 2 --ulysses 2 \\
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
import sys

import torch
import torch.nn.functional as F

import seqpar
from seqpar.integrations.transformers import register
from seqpar.tools.models import tiny_llama_config
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
from seqpar.training import sharded_cross_entropy, shift_labels, wrap_ddp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__)
    add_parallel_args(p)
    p.add_argument("--seq-len", type=int, default=1023, help="tokens per sequence (any length)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step and DP replica")
    p.add_argument("--steps", type=int, default=40, help="training steps")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--vocab", type=int, default=96, help="vocabulary size")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv")
    add_check_args(p, check_steps=6)
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


def main(argv: list[str] | None = None) -> int:
    return launch(parse_args(argv), train)


def train(args: argparse.Namespace, device: torch.device) -> int:
    state = parallel_state("train_lm", args)
    model = wrap_ddp(new_model(args, register(state), device), state)
    positions = seqpar.shard_positions(args.seq_len, state, device)[None]

    def loss_share(step: int) -> torch.Tensor:
        """This rank's share of the step's global token-mean loss."""
        ids, labels = make_batch(args, step, state.dp_rank)
        ids, labels = seqpar.shard(ids.to(device), state), seqpar.shard(labels.to(device), state)
        logits = model(input_ids=ids, position_ids=positions).logits  # [B, S_local, V]
        return sharded_cross_entropy(logits, labels, state)

    def replica_loss(ref: torch.nn.Module, step: int, replica: int) -> torch.Tensor:
        """``--check``: the token-mean loss of one replica's unsharded batch."""
        ids, labels = (t.to(device) for t in make_batch(args, step, replica))
        logits = ref(input_ids=ids).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    losses, norms = train_loop("train_lm", args, state, model, loss_share)
    return finish(
        "train_lm",
        args,
        state,
        device,
        losses,
        norms,
        reference_model=lambda: new_model(args, "sdpa", device),
        replica_loss=replica_loss,
        plot_style=Plot(
            f"tiny Llama, S={args.seq_len}, ring {args.ring} x ulysses {args.ulysses} x dp {state.dp_size} "
            f"({state.dp_size * state.cp_size} ranks)"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
