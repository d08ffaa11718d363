"""Run a diffusers transformer context-parallel with seqpar and check it against one device.

    python scripts/example_diffusers.py                          # Flux, 2 ranks, Ulysses
    python scripts/example_diffusers.py --model wan --world 3 --ring 3
    python -m torch.distributed.run --nproc-per-node 4 scripts/example_diffusers.py --ring 2 --ulysses 2

A small random model (no download) of the chosen family is built on every rank from one seed.
Each rank calls ``seqpar.integrations.diffusers.parallelize(model, state)`` -- the model's own
``_cp_plan`` says which inputs are split and where the output is gathered -- and then calls the
model with the *full* inputs; it gets the full output. One training step follows: every rank
backpropagates the same loss divided by ``cp_size``, and the parameter gradients summed over the
CP group are the single-device gradients. Rank 0 compares both with the model on one device and
the script exits non-zero if they differ by more than ``--tol``.

Without ``torchrun`` the ranks are local gloo processes (``seqpar.tools.bench.Ranks``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import seqpar
from seqpar.integrations.diffusers import parallelize
from seqpar.tools.bench import check_on_ranks
from seqpar.tools.report import script_parser


def build(family: str, tokens: tuple[int, int, int], text: int):
    """A random model of ``family`` and full inputs with ``F x H x W`` latent patches."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    F, H, W = tokens
    torch.manual_seed(0)
    if family == "flux":
        model = FluxTransformer2DModel(
            in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 4, 8),
        )
        ids = torch.stack(torch.meshgrid(torch.arange(F), torch.arange(H), torch.arange(W), indexing="ij"), -1)
        inputs = dict(
            hidden_states=torch.randn(1, F * H * W, 16), encoder_hidden_states=torch.randn(1, text, 32),
            pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]),
            img_ids=ids.reshape(-1, 3).float(), txt_ids=torch.zeros(text, 3),
        )
    else:
        model = WanTransformer3DModel(
            num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
        )
        inputs = dict(
            hidden_states=torch.randn(1, 4, F, 2 * H, 2 * W), encoder_hidden_states=torch.randn(1, text, 32),
            timestep=torch.tensor([500]),
        )
    with torch.no_grad():  # random weights everywhere (diffusers zero-initialises some layers)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    return model.eval(), inputs


def step(model, inputs, cp_size: int):
    """Full output and gradients of ``sum(output * weight) / cp_size`` (the same loss on every rank)."""
    out = model(**inputs, return_dict=False)[0]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ((out * weight).sum() / cp_size).backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def run(args: argparse.Namespace) -> float:
    """On every rank: the parallel model vs one device; returns the larger relative error."""
    state = seqpar.ParallelState(ring_size=args.ring, ulysses_size=args.ulysses)
    tokens = tuple(args.tokens)
    model, inputs = build(args.model, tokens, args.text)
    out, grads = step(parallelize(model, state), inputs, state.cp_size)
    for g in grads.values():  # the convention: parameter gradients are summed over the CP group
        dist.all_reduce(g, group=state.cp_group)

    ref_model, ref_inputs = build(args.model, tokens, args.text)
    ref_out, ref_grads = step(ref_model, ref_inputs, 1)
    out_err = float((out - ref_out).abs().max() / ref_out.abs().max())
    grad_err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in ref_grads.items())
    if state.cp_rank == 0 and dist.get_rank() == 0:
        print(
            f"{args.model}: {'x'.join(map(str, tokens))} = {tokens[0] * tokens[1] * tokens[2]} latent tokens + "
            f"{args.text} text tokens over ring {args.ring} x ulysses {args.ulysses}: output "
            f"{tuple(out.shape)}, max relative error {out_err:.1e}; summed gradients of {len(grads)} "
            f"parameters, max relative error {grad_err:.1e}"
        )
    return max(out_err, grad_err)


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--model", choices=["flux", "wan"], default="flux", help="model family")
    p.add_argument("--world", type=int, default=2, help="local gloo ranks (ignored under torchrun)")
    p.add_argument("--ring", type=int, default=1, help="ring size R")
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses size U (default: world // ring)")
    p.add_argument("--tokens", type=int, nargs=3, default=(3, 5, 7), metavar=("F", "H", "W"),
                   help="latent patches per frame, height and width (default 3 5 7: 105 tokens)")
    p.add_argument("--text", type=int, default=11, help="text tokens")
    p.add_argument("--tol", type=float, default=1e-4, help="max difference from the single-device model")
    args = p.parse_args()
    check_on_ranks(run, args)


if __name__ == "__main__":
    main()
