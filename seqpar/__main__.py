"""Command line: ``python -m seqpar <command>`` (also installed as ``seqpar``).

Commands:
    demo    hybrid ring x Ulysses attention on local ranks, verified against one device
    info    versions, devices, attention backends, and the degree planner's choice for a shape
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _add_info_arguments(parser: argparse.ArgumentParser) -> None:
    """The layer shape ``info`` asks the degree planner about (``seqpar.plan``)."""
    shape = parser.add_argument_group("degree planner", "the attention layer to choose ring x Ulysses sizes for")
    shape.add_argument("--cp-size", type=int, default=8, help="ranks in the CP group (default 8)")
    shape.add_argument("--seq-len", type=int, default=131072, help="global tokens per sequence (default 131072)")
    shape.add_argument("--heads", type=int, default=32, help="query heads H (default 32)")
    shape.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv (default 8)")
    shape.add_argument("--head-dim", type=int, default=128, help="head dim D (default 128)")
    shape.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    shape.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask (default)")
    shape.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                       help="sliding window in global positions, -1 unbounded (default -1 -1)")
    shape.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="dtype of q, k, v (default bfloat16)")
    shape.add_argument("--ranks-per-node", type=int, default=8, help="consecutive ranks per node (default 8)")
    costs = shape.add_mutually_exclusive_group()
    costs.add_argument("--cost", metavar="PATH", help="a cost model saved by scripts/calibrate.py (JSON)")
    costs.add_argument("--preset", default="h100", help="a built-in cost model: h100 (default) or cpu")


def _info(args: argparse.Namespace) -> int:
    import platform

    import torch

    import seqpar
    from seqpar.backends import available_backends
    from seqpar.planner import CostModel, plan

    print(f"seqpar {seqpar.__version__}, torch {torch.__version__}, python {platform.python_version()}")
    print(
        f"distributed: gloo={torch.distributed.is_gloo_available()} nccl={torch.distributed.is_nccl_available()}"
    )
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
        print(f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            print(
                f"backends on {device.type} {str(dtype).removeprefix('torch.')}: {available_backends(device, dtype)}"
            )
    try:
        cost = CostModel.load(args.cost) if args.cost else CostModel.preset(args.preset)
        choice = plan(
            args.cp_size, seq_len=args.seq_len, num_heads=args.heads, num_kv_heads=args.kv_heads,
            head_dim=args.head_dim, causal=args.causal, dtype=getattr(torch, args.dtype),
            ranks_per_node=args.ranks_per_node, batch=args.batch, window=tuple(args.window), cost=cost,
        )
    except (ValueError, OSError) as e:
        print(f"python -m seqpar info: {e}", file=sys.stderr)
        return 2
    print(f"\ndegree planner: ring {choice.ring_size} x ulysses {choice.ulysses_size} "
          f"(seqpar.ParallelState(ring_size={choice.ring_size}, ulysses_size={choice.ulysses_size}))")
    print(choice)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the chosen command; returns the exit code."""
    from .tools import demo  # imported here: the command line only

    parser = argparse.ArgumentParser(
        prog="python -m seqpar", description="seqpar: exact sequence/context parallelism for attention."
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="run hybrid ring x Ulysses attention on local ranks and verify it against one device",
        description=demo.help_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    info_parser = commands.add_parser(
        "info",
        help="show versions, devices, attention backends and the degree planner's choice for a shape",
        description="Versions, devices and attention backends here, then seqpar.plan's choice of ring x "
        "Ulysses sizes for the layer shape given (defaults: a Llama-3-8B-like layer, 131072 tokens, 8 ranks).",
    )
    _add_info_arguments(info_parser)
    info_parser.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
