"""Run a timm ViT / DeiT / EVA context-parallel with seqpar and check it against one device.

    python scripts/example_timm.py                               # ViT with 4 register tokens, 2 ranks
    python scripts/example_timm.py --model eva02 --world 3 --ring 3
    python -m torch.distributed.run --nproc-per-node 4 scripts/example_timm.py --model deit --ring 2 --ulysses 2

A small random model (no download) is built on every rank from one seed and passed to
``seqpar.integrations.timm.parallelize(model, state)``. Every rank feeds the *full* images and
gets the full logits: the class / distillation / register tokens stay replicated, the patch tokens
are split over the CP ranks. One training step follows: every rank backpropagates the same loss
divided by ``cp_size``; the parameter gradients summed over the CP group are the single-device
gradients. Rank 0 compares both with the model on one device (exit status 1 above ``--tol``).

timm imports torchvision at import time. Where no torchvision works with the installed torch
(a CPU-only torch for which the registry has no torchvision build), ``--torchvision-stand-in``
imports timm behind a stand-in whose every object raises when used
(``seqpar.tools.torchvision_stub.import_timm``); the ViT and EVA models never use it. Without
``torchrun`` the ranks are local gloo processes (``seqpar.tools.bench.Ranks``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import seqpar
from seqpar.tools.bench import check_on_ranks
from seqpar.tools.report import script_parser
from seqpar.tools.torchvision_stub import import_timm


def build(name: str):
    """A random model and an image batch; 5 x 7 = 35 patches (an odd count)."""
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.eva import Eva
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    common = dict(img_size=(40, 56), patch_size=8, embed_dim=64, depth=3, num_heads=4, num_classes=10)
    if name == "vit":
        model = VisionTransformer(**common, reg_tokens=4)
    elif name == "deit":
        model = VisionTransformerDistilled(**common)
        model.set_distilled_training(True)  # returns (class logits, distillation logits)
    else:
        model = Eva(**common, swiglu_mlp=True, use_rot_pos_emb=True, ref_feat_shape=(5, 7))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    return model, torch.randn(2, 3, 40, 56)


def step(model, images, cp_size: int):
    out = model(images)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    (loss / cp_size).backward()
    return torch.cat([o.detach().flatten() for o in outs]), {n: p.grad for n, p in model.named_parameters()}


def run(args: argparse.Namespace) -> float:
    """On every rank: the parallel model vs one device; returns the larger relative error."""
    import_timm(args.torchvision_stand_in)
    from seqpar.integrations.timm import parallelize

    state = seqpar.ParallelState(ring_size=args.ring, ulysses_size=args.ulysses)
    model, images = build(args.model)
    out, grads = step(parallelize(model, state), images, state.cp_size)
    for g in grads.values():
        dist.all_reduce(g, group=state.cp_group)
    ref_model, ref_images = build(args.model)
    ref_out, ref_grads = step(ref_model, ref_images, 1)
    out_err = float((out - ref_out).abs().max() / ref_out.abs().max())
    grad_err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in ref_grads.items())
    if dist.get_rank() == 0:
        print(
            f"{args.model}: {model.num_prefix_tokens} replicated prefix token(s) + 35 patches over ring "
            f"{args.ring} x ulysses {args.ulysses}: {out.numel()} logits, max relative error "
            f"{out_err:.1e}; summed gradients of {len(grads)} parameters, max relative error {grad_err:.1e}"
        )
    return max(out_err, grad_err)


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--model", choices=["vit", "deit", "eva02"], default="vit", help="model family")
    p.add_argument("--world", type=int, default=2, help="local gloo ranks (ignored under torchrun)")
    p.add_argument("--ring", type=int, default=1, help="ring size R")
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses size U (default: world // ring)")
    p.add_argument("--tol", type=float, default=1e-4, help="max difference from the single-device model")
    p.add_argument("--torchvision-stand-in", action="store_true",
                   help="import timm behind a stand-in for torchvision if no torchvision works here")
    args = p.parse_args()
    try:
        _, why = import_timm(args.torchvision_stand_in)  # fail early, before starting ranks
    except ImportError as e:
        raise SystemExit(f"{e} (here: pass --torchvision-stand-in)") from None
    if why and os.environ.get("RANK", "0") == "0":
        print(f"note: timm imported with a stand-in for torchvision ({why})")
    check_on_ranks(run, args)


if __name__ == "__main__":
    main()
