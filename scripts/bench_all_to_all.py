"""Benchmark seqpar.comm.all_to_all: bytes allocated and time against a bare all_to_all_single.

For each case, every rank holds a shard and runs one ``all_to_all``; we report

* ``alloc/input``: bytes of tensor storage the call created (``seqpar.profiling.StorageTracker``)
  over the input's bytes -- the design bound is 2.0 (one staging copy plus the output);
* ``time ratio``: median time of ``seqpar.comm.all_to_all`` over the median time of a bare
  ``torch.distributed.all_to_all_single`` moving the same bytes between preallocated contiguous
  buffers (no layout work, no allocation) -- the cost of the layout handling;
* ``fresh ratio``: the same against a bare call that allocates its two buffers (a contiguous
  copy of the input and the output) on every call, as ``all_to_all`` must. On CPU large blocks
  go back to the OS when freed, so fresh buffers cost page faults on first touch; CUDA's caching
  allocator hides that, so there the plain ratio is the one to read.

Cases cover the Ulysses directions (scatter heads / gather tokens and back), batch > 1, a 5-D
video layout, and sizes that do not divide the group.

Run:
    python scripts/bench_all_to_all.py                 # CPU: spawns 4 gloo ranks
    python scripts/bench_all_to_all.py --world 3 --seq-len 8191
    torchrun --nproc-per-node 8 scripts/bench_all_to_all.py   # CUDA/NCCL
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from seqpar.comm import all_to_all, split_sizes
from seqpar.profiling import StorageTracker, median_seconds


def _cases(args: argparse.Namespace, n: int) -> list[dict]:
    S, H, D = args.seq_len, args.heads, args.head_dim
    cases = []
    for B in (1, args.batch):
        # Ulysses forward: [B, S_local, H, D] -> [B, S, H_local, D]; and back.
        cases.append(dict(name=f"ulysses fwd B={B}", global_shape=[B, S, H, D], scatter=2, gather=1))
        cases.append(dict(name=f"ulysses bwd B={B}", global_shape=[B, S, H, D], scatter=1, gather=2))
    cases.append(dict(name="unaligned fwd", global_shape=[1, S + 1, H + 1, D], scatter=2, gather=1))
    cases.append(dict(name="unaligned bwd", global_shape=[1, S + 1, H + 1, D], scatter=1, gather=2))
    T = max(n + 1, 13)
    cases.append(
        dict(name="video 5-D", global_shape=[1, T, max(S // T, 1), H, D], scatter=3, gather=2)
    )
    return cases


def _run_case(case: dict, iters: int, device: torch.device, dtype: torch.dtype) -> dict:
    n, r = dist.get_world_size(), dist.get_rank()
    shape, sd, gd = case["global_shape"], case["scatter"], case["gather"]
    local_shape = list(shape)
    local_shape[gd] = split_sizes(shape[gd], n)[r]
    x = torch.randn(local_shape, device=device, dtype=dtype)
    with StorageTracker() as mem:
        y = all_to_all(x, None, sd, gd, gather_size=shape[gd])
    del y
    seconds = median_seconds(lambda: all_to_all(x, None, sd, gd, gather_size=shape[gd]), iters, device)
    # Bare collective: same total bytes, equal splits, preallocated contiguous buffers.
    numel = torch.tensor([x.numel()], device=device)
    dist.all_reduce(numel, op=dist.ReduceOp.MAX)  # equal sizes on every rank
    per = -(-int(numel.item()) // n)
    src = torch.empty(per * n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    bare = median_seconds(lambda: dist.all_to_all_single(dst, src, group=None), iters, device)

    def bare_fresh() -> None:
        staged = src.clone()
        dist.all_to_all_single(torch.empty_like(staged), staged, group=None)

    fresh = median_seconds(bare_fresh, iters, device)
    alloc = torch.tensor([mem.allocated / max(x.nbytes, 1)], dtype=torch.float64, device=device)
    dist.all_reduce(alloc, op=dist.ReduceOp.MAX)
    return {
        "case": case["name"],
        "global_shape": shape,
        "scatter_dim": sd,
        "gather_dim": gd,
        "input_bytes": x.nbytes,
        "alloc_over_input": round(alloc.item(), 3),
        "seconds": seconds,
        "bare_seconds": bare,
        "time_ratio": round(seconds / bare, 3) if bare > 0 else None,
        "bare_fresh_seconds": fresh,
        "fresh_ratio": round(seconds / fresh, 3) if fresh > 0 else None,
    }


def bench(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    return [_run_case(c, args.iters, device, dtype) for c in _cases(args, dist.get_world_size())]


def _print(results: list[dict], world: int, args: argparse.Namespace) -> None:
    print(json.dumps({"world_size": world, "dtype": args.dtype, "results": results}, indent=1))
    print()
    print(f"all_to_all over {world} ranks ({args.dtype}); bound on alloc/input: 2.00")
    head = f"{'case':<16} {'global shape':<22} {'s->g':<5} {'alloc/input':>11} {'ms':>9} {'bare ms':>9} {'ratio':>7} {'fresh ms':>9} {'fresh ratio':>11}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['case']:<16} {str(r['global_shape']):<22} {r['scatter_dim']}->{r['gather_dim']:<2} "
            f"{r['alloc_over_input']:>11.2f} {r['seconds'] * 1e3:>9.2f} {r['bare_seconds'] * 1e3:>9.2f} "
            f"{r['time_ratio']:>7.2f} {r['bare_fresh_seconds'] * 1e3:>9.2f} {r['fresh_ratio']:>11.2f}"
        )


def _worker(args: argparse.Namespace) -> list[dict]:
    return bench(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks to spawn on CPU (ignored under torchrun)")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        results = bench(args)
        if dist.get_rank() == 0:
            _print(results, dist.get_world_size(), args)
        dist.destroy_process_group()
        return
    from seqpar.testing import DistPool

    with DistPool(args.world, timeout_s=600) as pool:
        results = pool.run(_worker, args)[0]
    _print(results, args.world, args)


if __name__ == "__main__":
    main()
