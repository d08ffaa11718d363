"""Command line: ``python -m seqpar <command>`` (also installed as ``seqpar``).

Commands:
    demo    hybrid ring x Ulysses attention on local ranks, verified against one device
    info    versions, devices and attention backends available here
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    import platform

    import torch

    import seqpar
    from seqpar.backends import available_backends

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
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the chosen command; returns the exit code."""
    from . import demo

    parser = argparse.ArgumentParser(
        prog="python -m seqpar", description="seqpar: exact sequence/context parallelism for attention."
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="run hybrid ring x Ulysses attention on local ranks and verify it against one device",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    info_parser = commands.add_parser("info", help="show versions, devices and available attention backends")
    info_parser.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
