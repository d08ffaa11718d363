"""Command line: ``python -m seqpar <command>`` (also installed as ``seqpar``).

Commands:
    demo    hybrid ring x Ulysses attention on local ranks, verified against one device
    check   every mode on this cluster's ranks (torchrun) or local ranks: exactness, time, bandwidth
    info    versions, devices, attention backends, and the degree planner's choice for a shape
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _add_info_arguments(parser: argparse.ArgumentParser) -> None:
    """The layer shape ``info`` asks the degree planner about (``seqpar.plan``). Left out, the
    world, sequence length, dtype, ranks per node and cost model describe this machine
    (:func:`_machine_defaults`)."""
    shape = parser.add_argument_group(
        "degree planner", "the attention layer to choose ring x Ulysses sizes for (default: this machine's devices)"
    )
    shape.add_argument("--world", "--cp-size", dest="world", type=int, default=None,
                       help="ranks in the CP group (default: this machine's GPUs, or its CPU cores, at least 2)")
    shape.add_argument("--seq-len", type=int, default=None,
                       help="global tokens per sequence (default 131072 on GPUs, 8192 on CPU)")
    shape.add_argument("--heads", type=int, default=32, help="query heads H (default 32)")
    shape.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv (default 8)")
    shape.add_argument("--head-dim", type=int, default=128, help="head dim D (default 128)")
    shape.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    shape.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask (default)")
    shape.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                       help="sliding window in global positions, -1 unbounded (default -1 -1)")
    shape.add_argument("--dtype", choices=_DTYPES, default=None,
                       help="dtype of q, k, v (default bfloat16 on GPUs or with --preset h100, float32 on CPU)")
    shape.add_argument("--ranks-per-node", type=int, default=None,
                       help="consecutive ranks per node (default: this machine's GPUs; without GPUs --world, "
                       "or 8 with --preset h100)")
    shape.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                       help="GiB one rank may hold for one attention call: the recommended head_groups is the "
                       "fewest predicted to fit (default: the lowest peak within 10%% of one group's time)")
    costs = shape.add_mutually_exclusive_group()
    costs.add_argument("--cost", metavar="PATH", help="a cost model saved by scripts/calibrate.py (JSON)")
    costs.add_argument("--preset", default=None,
                       help="a built-in cost model: h100 or cpu (default: h100 with GPUs, cpu without)")


def _machine_defaults(args: argparse.Namespace, gpus: int, cores: int) -> tuple[argparse.Namespace, list[str]]:
    """``args`` with every option left out set from this machine, and a note per choice made."""
    import torch

    on_gpu = gpus > 0
    out = argparse.Namespace(**vars(args))
    notes = []
    if out.world is None:
        out.world = max(2, gpus if on_gpu else cores)
        what = f"{gpus} GPU(s)" if on_gpu else f"{cores} CPU core(s), one gloo rank each"
        notes.append(f"{out.world} ranks ({what}; --world N for another size)")
    if out.seq_len is None:
        out.seq_len = 131072 if on_gpu else 8192
    if out.cost is None and out.preset is None:
        out.preset = "h100" if on_gpu else "cpu"
        if on_gpu and "H100" not in torch.cuda.get_device_name(0):
            notes.append(
                f"cost model: the h100 preset; this GPU is a {torch.cuda.get_device_name(0)}: "
                "scripts/calibrate.py measures its own (--cost PATH)"
            )
    if out.dtype is None:
        out.dtype = "bfloat16" if on_gpu or out.preset == "h100" else "float32"
    if out.ranks_per_node is None:
        # This machine's node, or an 8-GPU H100 node when asking about one from elsewhere.
        out.ranks_per_node = gpus if on_gpu else 8 if out.preset == "h100" else out.world
    return out, notes


def _describe_machine(gpus: int, cores: int) -> str:
    """One line about the devices here (``"cpu: 2 cores, ..."``, ``"cuda: 8 x NVIDIA H100 ..."``)."""
    import torch

    line = f"machine: {cores} CPU core(s) (torch uses {torch.get_num_threads()} thread(s))"
    if gpus:
        props = torch.cuda.get_device_properties(0)
        line += f"; cuda: {gpus} x {props.name}, {props.total_memory / 2**30:.0f} GiB each"
    else:
        line += "; no CUDA device (torch.cuda.is_available() is False)"
    return line


def _state_arguments(candidate) -> str:
    """The ``seqpar.ParallelState`` arguments that run ``candidate`` (a ``seqpar.planner.Candidate``),
    as ``DegreePlan.state()`` passes them: the K/V transport wherever there is a ring, the kept head
    shards when predicted with them."""
    args = [f"ring_size={candidate.ring_size}", f"ulysses_size={candidate.ulysses_size}"]
    if candidate.ring_size > 1:
        args.append(f"ring_comm={candidate.ring_comm!r}")
    if candidate.keep_head_shards:
        args.append("keep_head_shards=True")
    return ", ".join(args)


def _call_arguments(candidate) -> str:
    """The ``seqpar.attention`` arguments the plan recommends for ``candidate`` beyond the state:
    ``head_groups=G`` with its predicted peak and time against one group."""
    from seqpar.planner.choose import _mib, _ms

    one, rec = candidate.group(1), candidate.group(candidate.head_groups)
    return (f"head_groups={rec.head_groups}: predicted {_mib(rec.memory_bytes)} per rank at {_ms(rec.time_s)}, "
            f"against {_mib(one.memory_bytes)} at {_ms(one.time_s)} with one group")


def _info(args: argparse.Namespace) -> int:
    import os
    import platform

    import torch

    import seqpar
    from seqpar.backends import available_backends
    from seqpar.planner import TIE_RTOL, CostModel, plan

    print(f"seqpar {seqpar.__version__} from {os.path.dirname(seqpar.__file__)}")
    print(f"torch {torch.__version__}, python {platform.python_version()} ({sys.executable})")
    print(
        f"distributed: gloo={torch.distributed.is_gloo_available()} nccl={torch.distributed.is_nccl_available()}"
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    print(_describe_machine(gpus, cores))
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if gpus else [])
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            print(
                f"backends on {device.type} {str(dtype).removeprefix('torch.')}: {available_backends(device, dtype)}"
            )
    args, notes = _machine_defaults(args, gpus, cores)
    try:
        cost = CostModel.load(args.cost) if args.cost else CostModel.preset(args.preset)
        choice = plan(
            args.world, seq_len=args.seq_len, num_heads=args.heads, num_kv_heads=args.kv_heads,
            head_dim=args.head_dim, causal=args.causal, dtype=getattr(torch, args.dtype),
            ranks_per_node=args.ranks_per_node, batch=args.batch, window=tuple(args.window), cost=cost,
            memory_budget=None if args.memory_budget is None else max(1, round(args.memory_budget * 2**30)),
        )
    except (ValueError, OSError) as e:
        print(f"python -m seqpar info: {e}", file=sys.stderr)
        return 2
    print(f"\ndegree planner: {choice.chosen.label()} for {args.world} ranks, S={args.seq_len}, {args.dtype}; "
          f"build it with seqpar.ParallelState({_state_arguments(choice.chosen)})")
    if choice.tied:  # never the chosen candidate itself; the same split by another transport may be
        print(f"  predicted within {TIE_RTOL:.0%} of it (closer than the cost model can tell apart; measure if it "
              f"matters): " + "; ".join(f"ParallelState({_state_arguments(c)})" for c in choice.tied))
    if choice.head_groups != 1:  # a call option, not the state's: every attention call passes it
        print(f"  and call seqpar.attention(..., {_call_arguments(choice.chosen)}) "
              f"(head_groups='auto' applies the same rule, without a budget, to each call's shapes)")
    for note in notes:
        print(f"  shape from this machine: {note}")
    print(choice)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the chosen command; returns the exit code."""
    from .tools import check, demo  # imported here: the command line only

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
    check_parser = commands.add_parser(
        "check",
        help="check every mode on this cluster's ranks against one device: exactness, time, bandwidth",
        description=check.help_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_arguments(check_parser)
    check_parser.set_defaults(func=check.run)
    info_parser = commands.add_parser(
        "info",
        help="show versions, devices, attention backends and the degree planner's choice for a shape",
        description="Which seqpar (version, path) and torch run here, this machine's devices and attention "
        "backends, then seqpar.plan's choice of ring x Ulysses sizes for a Llama-3-8B-like layer (32 heads, 8 K/V "
        "heads, head dim 128) on this machine's devices: its GPUs (131072 tokens, bfloat16, the h100 cost "
        "model), or one rank per CPU core (8192 tokens, float32, the cpu cost model). --world and --seq-len "
        "choose another shape.",
    )
    _add_info_arguments(info_parser)
    info_parser.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
