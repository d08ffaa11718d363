"""Hybrid models on one CUDA GPU: the transformers adapters with the models' own CUDA kernels.

On CPU the hybrid families run their torch fallbacks (tests/test_hybrid_*.py, float64). With
flash-linear-attention installed, transformers 5.23 calls its Triton kernels instead (the gated
delta rule, Kimi delta attention, the gated RMSNorm), and seqpar's adapters run whatever kernel
the model calls, on head shards of whole sequences (docs/hybrid-models.md). This script checks that
on a GPU and times the kernel the head-parallel mode runs:

1. ``exact``: ``--world`` gloo ranks, all on ``cuda:0`` (NCCL takes one GPU per rank; this machine
   has one), Ulysses ``1 x world``: each rank builds the one-device float32 model and the same model
   with ``attn_implementation=register(state)``, runs both on the same ids (sharded for the second)
   and reports logits and CP-summed gradient errors relative to max(1, |reference|), and which
   kernel implementation the modeling module resolved (``fla`` or ``torch``).
2. ``kernel``: the gated delta rule on one rank, bf16, forward + backward, as head-parallel runs it
   on ``cp`` ranks (whole sequence, ``H / cp`` heads) and as state passing's first pass would
   (``S / cp`` tokens, all heads), flash-linear-attention against transformers' torch fallback.

Both steps run each family under every ``--splits`` and ``--mixing`` mode (a mode an adapter does
not offer is refused at install and reported as such). Where flash-linear-attention refuses its
gated backward (Hopper with Triton < 3.7.1, fla #640), its rows are forward only: run the script a
second time without fla on the path for the gradients through the torch fallback.

Usage: python scripts/gpu_hybrid.py [--world 2] [--seq 1031] [--splits 1x2]
       [--mixing head_parallel,state_passing] [--no-kernel] [--out DIR]
Writes hybrid.json and prints a table. Exit code 0 when every family ran and was within tolerance.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

VOCAB = 97
DEVICE = "cuda"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()
# fp32 with Triton kernels (tf32 dots inside fla): a wrong mixer on shards is off by 1e-1 or more.
TOL = 2e-2
FAMILIES = {
    "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32,
                       linear_value_head_dim=32, head_dim=32),
    "kimi_linear": dict(linear_head_dim=32),
    "lfm2": {},
    "minimax": {},
    "mamba2": {},
}
KERNEL_NAMES = {  # modeling module -> the hub-or-package wrapped functions it calls
    "qwen3_next": ("torch_chunk_gated_delta_rule",),
    "kimi_linear": ("chunk_kimi_delta_attention",),
}


def _implementation(family: str) -> str:
    """Which implementation transformers resolved for the family's rule kernel: 'fla' or 'torch'."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for name in KERNEL_NAMES.get(family, ()):
        fn = getattr(mod, name, None)
        while fn is not None and "implementation" not in getattr(getattr(fn, "__code__", None), "co_freevars", ()):
            fn = getattr(fn, "__wrapped__", None)
        if fn is not None:
            impl = fn.__closure__[fn.__code__.co_freevars.index("implementation")].cell_contents
            return "fla" if getattr(impl, "__module__", "").startswith("fla") else "torch"
    return "torch"


def _build(family: str, attn: str):
    from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config

    torch.manual_seed(0)
    config = tiny_hf_config(family, vocab_size=VOCAB, **FAMILIES[family])
    kwargs = {} if family == "mamba2" else dict(attn_implementation=attn, experts_implementation="eager")
    return causal_lm_class(family)._from_config(config, **kwargs).to(DEVICE, torch.float32).eval()


def _grads(loss, model):
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def fla_backward_refused() -> str | None:
    """Why flash-linear-attention refuses its gated backward here, or ``None``.

    fla 0.6 raises in ``chunk_bwd_dqkwg`` on Hopper with Triton >= 3.4.0 and < 3.7.1 (wrong results
    there, fla #640); the forward kernels are not affected. Where it refuses, this script checks the
    forward (logits) with fla's kernels and leaves the gradients to the torch-fallback run."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return None
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        import triton

        return f"fla refuses its gated backward on Hopper with Triton {triton.__version__} (needs >= 3.7.1)"
    return None


def _exact(families, seq: int, splits, modes, device: str = "cuda"):
    """On one rank of the pool: per split, mode and family, errors of the sharded model against one device."""
    global DEVICE
    DEVICE = device
    import torch.distributed as dist

    from seqpar import ParallelState, shard, shard_positions
    from seqpar.integrations.transformers import register
    from seqpar.integrations.transformers_mixers import install, mixing_modes
    from seqpar.training import sharded_cross_entropy, shift_labels

    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    refused = fla_backward_refused() if DEVICE == "cuda" else None
    out = {}
    refs = {}
    for ring, uly in splits:
        state = ParallelState(ring, uly)
        try:
            for mode in modes:
                name = register(state, name=f"seqpar-gpu-hybrid-{mode}", mixing=mode)
                for family in families:
                    key = f"{family} {ring}x{uly} {mode}"
                    row = {"kernel": _implementation(family)}
                    backward = not (refused and row["kernel"] == "fla")
                    try:
                        ids = torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1)).to(DEVICE)
                        labels = shift_labels(ids)
                        if (family, backward) not in refs:
                            ref = _build(family, "sdpa")
                            logits = ref(input_ids=ids).logits
                            ref_grad = (_grads(torch.nn.functional.cross_entropy(
                                logits.flatten(0, 1), labels.flatten(), ignore_index=-100), ref) if backward else None)
                            refs[family, backward] = (logits.detach(), ref_grad)
                            del ref
                        logits, ref_grad = refs[family, backward]
                        model = _build(family, name)
                        kwargs = {}
                        if family == "mamba2":
                            install(model, state, mixing=mode)
                        else:
                            kwargs["position_ids"] = shard_positions(seq, state)[None].to(DEVICE)
                        _sync()
                        t0 = time.perf_counter()
                        with torch.set_grad_enabled(backward):
                            mine = model(input_ids=shard(ids, state), **kwargs).logits
                        if backward:
                            grad = _grads(sharded_cross_entropy(mine, shard(labels, state), state), model)
                            dist.all_reduce(grad, group=state.cp_group)
                        _sync()
                        row["step_s"] = time.perf_counter() - t0
                        row["ran"] = sorted({m.mode for m in mixing_modes(model).values() if m is not None})
                        row["logits"] = ((mine - shard(logits, state)).abs().max() / max(1.0, logits.abs().max().item())).item()
                        row["grad"] = (((grad - ref_grad).abs().max() / max(1.0, ref_grad.abs().max().item())).item()
                                       if backward else None)
                        if not backward:
                            row["note"] = refused
                        del model, mine
                    except Exception as e:  # noqa: BLE001 - recorded, the next family runs
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    out[key] = row
                    print(f"rank {dist.get_rank()} {key}: {row}", flush=True)
        finally:
            state.close()
    return out


def _time(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _kernel(seqs, heads: int, dim: int, cp: int):
    """Gated delta rule fwd+bwd on one GPU, bf16: head-parallel's and state passing's shapes (fla's
    forward alone where fla refuses its backward on this Triton)."""
    rows = []
    refused = fla_backward_refused()
    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    kernels = {"torch": getattr(mod.torch_chunk_gated_delta_rule, "__wrapped__", mod.torch_chunk_gated_delta_rule)}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        kernels["fla"] = chunk_gated_delta_rule
    except ImportError:
        pass
    for seq in seqs:
        for mode, (s, h) in {"head_parallel": (seq, heads // cp), "state_pass1": (seq // cp, heads)}.items():
            for kname, kernel in kernels.items():
                if kname == "torch" and s > 16384:
                    continue  # the torch fallback's chunk loop: minutes at 64k
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(1, s, h, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                           for _ in range(3))
                gate = (-torch.rand(1, s, h, device="cuda", generator=g)).requires_grad_()
                beta = torch.rand(1, s, h, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()

                backward = not (refused and kname == "fla")

                def step():
                    with torch.set_grad_enabled(backward):
                        o = kernel(q, k, v, g=gate, beta=beta, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=True)[0]
                    if backward:
                        o.float().square().mean().backward()

                try:
                    dt = _time(step, iters=3 if kname == "torch" else 10)
                    rows.append(dict(seq=seq, mode=mode, tokens=s, heads=h, kernel=kname, ms=dt * 1e3,
                                     mtok_per_s=s * h / heads / dt / 1e6, what="fwd+bwd" if backward else "fwd"))
                    print(f"kernel {rows[-1]}", flush=True)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(seq=seq, mode=mode, tokens=s, heads=h, kernel=kname, error=f"{type(e).__name__}: {e}"[:300]))
                    print(f"kernel {rows[-1]}", flush=True)
                del q, k, v, gate, beta
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=1031)
    p.add_argument("--out", default="gpu_check_out")
    p.add_argument("--kernel-seqs", default="16384,65536")
    p.add_argument("--pool-timeout", type=float, default=300)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--splits", default=None,
                   help="ring x Ulysses splits of --world ranks, comma-separated (default: Ulysses 1 x world on the "
                        "GPU, where the ranks share one device over gloo, which sends no CUDA tensor point to point "
                        "(the ring refuses it); with --cpu-smoke also the ring, world x 1)")
    p.add_argument("--mixing", default="head_parallel,state_passing", help="mixing modes, comma-separated")
    p.add_argument("--no-kernel", action="store_true", help="skip the kernel timing step")
    p.add_argument("--cpu-smoke", action="store_true", help="the exactness step on CPU ranks (plumbing)")
    args = p.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_hybrid: no CUDA device")
        return 3
    os.makedirs(args.out, exist_ok=True)
    import transformers

    from seqpar.tools.testing import DistPool

    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "world": args.world, "seq": args.seq}
    try:
        import fla

        result["fla"] = fla.__version__
    except ImportError:
        result["fla"] = None
    if args.splits is None:
        args.splits = f"1x{args.world},{args.world}x1" if args.cpu_smoke else f"1x{args.world}"
    splits = [tuple(int(x) for x in sp.split("x")) for sp in args.splits.split(",")]
    if any(r * u != args.world for r, u in splits):
        p.error(f"every split must multiply to --world {args.world}, got {args.splits}")
    result["fla_backward"] = fla_backward_refused() or "ok"
    result["kernel"] = [] if device == "cpu" or args.no_kernel else _kernel([int(s) for s in args.kernel_seqs.split(",")], heads=16, dim=128, cp=4)
    t0 = time.perf_counter()
    try:
        with DistPool(args.world, timeout_s=args.pool_timeout) as pool:
            per_rank = pool.run(_exact, args.families.split(","), args.seq, splits, args.mixing.split(","), device)
        result["exact"] = {f: [r[f] for r in per_rank] for f in per_rank[0]}
    except Exception as e:  # noqa: BLE001
        result["exact_error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
    result["exact_s"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "hybrid.json"), "w") as f:
        json.dump(result, f, indent=1)
    ok = "exact" in result
    print(f"device {result['device']}, torch {result['torch']}, transformers {result['transformers']}, fla {result['fla']}")
    print(f"\nexact: {args.world} gloo ranks on one device ({args.splits}), S {args.seq}, float32, "
          "max error / max(1, |ref|); grad '-': forward only (fla refuses its backward here)")
    print(f"{'family split mode':40s} {'rank':>4s} {'kernel':>6s} {'ran':>14s} {'logits':>9s} {'grad':>9s} {'step s':>7s}")
    for key, rows in result.get("exact", {}).items():
        for rank, row in enumerate(rows):
            if "error" in row:
                offered = "does not apply to" in row["error"]  # the adapter has no such mode: refused, as it should be
                ok &= offered
                print(f"{key:40s} {rank:4d} {row['kernel']:>6s} {'(not offered)' if offered else row['error']}")
                continue
            ok &= row["logits"] < TOL and (row["grad"] is None or row["grad"] < TOL)
            grad = "-" if row["grad"] is None else f"{row['grad']:9.2e}"
            print(f"{key:40s} {rank:4d} {row['kernel']:>6s} {','.join(row['ran']):>14s} {row['logits']:9.2e} {grad:>9s} "
                  f"{row['step_s']:7.2f}")
    if "exact_error" in result:
        print(result["exact_error"])
    print("\nkernel: gated delta rule, bf16, H 16 x D 128 over cp 4 (one rank's share)")
    print(f"{'S':>7s} {'mode':14s} {'tokens':>7s} {'heads':>5s} {'kernel':>6s} {'what':>8s} {'ms':>9s}")
    for r in result["kernel"]:
        tail = f"{r['what']:>8s} {r['ms']:9.2f}" if "ms" in r else r["error"]
        print(f"{r['seq']:7d} {r['mode']:14s} {r['tokens']:7d} {r['heads']:5d} {r['kernel']:>6s} {tail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
