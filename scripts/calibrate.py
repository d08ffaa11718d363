"""Measure the degree planner's cost model on the ranks that will train, save it as JSON, and
optionally print the planner's choice for a layer shape with it.

    python -m torch.distributed.run --nproc-per-node 8 scripts/calibrate.py --out cost.json          # one 8-GPU node
    python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 ... scripts/calibrate.py --ranks-per-node 8 --out cost.json
    python scripts/calibrate.py --local 4 --out cost.json                     # 4 local CPU ranks (gloo)

    python -m seqpar info --cost cost.json --cp-size 16 --seq-len 262144 --heads 32 --kv-heads 8

Every rank of the job takes part (``seqpar.planner.calibrate`` is a collective over a CP group of
all of them); rank 0 writes ``--out``. See ``docs/planner.md`` for what is measured.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import seqpar
from seqpar.planner import CostModel, calibrate
from seqpar.tools.bench import Ranks, under_torchrun
from seqpar.tools.report import script_parser

_DTYPES = ("bfloat16", "float16", "float32")


def _measure(ranks_per_node: int | None, dtype: str | None, repeats: int) -> str:
    """On every rank: the cost model of a CP group of all ranks, as JSON."""
    state = seqpar.ParallelState(ring_size=1, ulysses_size=dist.get_world_size())
    cost = calibrate(state, dtype=getattr(torch, dtype) if dtype else None, ranks_per_node=ranks_per_node,
                     repeats=repeats)
    return cost.to_json()


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--out", default="cost.json", help="where rank 0 writes the cost model (default cost.json)")
    parser.add_argument("--local", type=int, metavar="N", help="spawn N local CPU ranks (gloo) instead of torchrun")
    parser.add_argument("--ranks-per-node", type=int, help="consecutive ranks per node (default: GPUs per node, or all)")
    parser.add_argument("--dtype", choices=_DTYPES, help="training dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median; default 5)")
    args = parser.parse_args(argv)

    if not args.local and not under_torchrun():
        parser.error("run under torchrun (or pass --local N for local CPU ranks)")
    with Ranks(args.local, torchrun=not args.local, timeout_s=300) as ranks:
        text = ranks.run(_measure, args.ranks_per_node, args.dtype, args.repeats)[0]  # the same on every rank
        rank = ranks.rank
    if rank == 0:
        cost = CostModel.from_json(text)
        cost.save(args.out)
        print(f"{cost.name}: saved to {args.out}")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
