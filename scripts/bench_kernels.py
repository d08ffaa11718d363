"""Benchmark a backend's varlen path against dense calls doing the same FLOPs.

For each packing scenario the varlen forward (and forward + backward) time is compared with

- ``1xS``: one dense ``[1, S_eq, H, D]`` call, ``S_eq = sqrt(sum(len_q * len_k))`` (equal FLOPs,
  same causal flag);
- ``nxL``: one dense ``[n, L_rms, H, D]`` call, ``n`` = number of sequences and
  ``L_rms = sqrt(mean(len**2))`` (equal FLOPs *and* equal sequence count: what the kernel itself
  costs for sequences that short, so ``varlen / nxL`` is the packing overhead);
- ``loop``: one dense call per sequence.

Times are the minimum over repeated runs (robust to other processes on the machine).

    python scripts/bench_kernels.py                      # CPU backend, fp32 and bf16
    python scripts/bench_kernels.py --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import random
import time
from collections.abc import Callable

import torch

from seqpar.backends import get_backend


def _best_times(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Minimum wall time in ms of each function, measured round-robin."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def _scenarios(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    short: list[int] = []
    while sum(short) < 8192:
        short.append(rng.randint(1, 128))
    mixed = [1500, 700] + [rng.randint(1, 64) for _ in range(96)]
    return {
        "4 long (1024..256)": [1024, 768, 512, 256],
        "short U[1,128], 8k tok": short,
        "2048 x len 4": [4] * 2048,
        "256 x len 32": [32] * 256,
        "mixed 2 long + 96 short": mixed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: both)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    device = torch.device(args.device)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    print(f"backend={args.backend} device={device} H={h} Hkv={hkv} D={d} "
          f"threads={torch.get_num_threads()}; times in ms (min of {args.rounds} runs)")
    print(f"{'dtype':8} {'scenario':25} {'causal':6} "
          f"{'fwd':>7} {'1xS':>6} {'nxL':>6} {'loop':>7} {'/1xS':>5} {'/nxL':>5} | "
          f"{'f+b':>7} {'1xS':>6} {'nxL':>6} {'loop':>7} {'/1xS':>5} {'/nxL':>5}")
    for dtype, (label, lens), causal in itertools.product(
        dtypes, _scenarios(args.seed).items(), (False, True)
    ):
        t = _bench_one(args.backend, device, dtype, lens, causal, h, hkv, d, args.rounds)
        row = [f"{str(dtype)[6:]:8} {label:25} {str(causal):6}"]
        for p in ("f", "b"):
            row.append(
                f"{t['var' + p]:7.2f} {t['one' + p]:6.2f} {t['bat' + p]:6.2f} {t['loop' + p]:7.1f} "
                f"{t['var' + p] / t['one' + p]:5.2f} {t['var' + p] / t['bat' + p]:5.2f}"
            )
        print(" | ".join(row).replace("  | ", " | "))


def _bench_one(name: str, device: torch.device, dtype: torch.dtype, lens: list[int],
               causal: bool, h: int, hkv: int, d: int, rounds: int) -> dict[str, float]:
    backend = get_backend(name, device, dtype)
    scale = d**-0.5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    total, longest = sum(lens), max(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    q, k, v, dout = rand(total, h, d), rand(total, hkv, d), rand(total, hkv, d), rand(total, h, d)
    s_eq = round(math.sqrt(sum(n * n for n in lens)))
    l_rms = round(math.sqrt(sum(n * n for n in lens) / len(lens)))
    one = (rand(1, s_eq, h, d), rand(1, s_eq, hkv, d), rand(1, s_eq, hkv, d), rand(1, s_eq, h, d))
    bat = tuple(rand(len(lens), l_rms, hh, d) for hh in (h, hkv, hkv, h))
    pieces = [(q[None, a:b], k[None, a:b], v[None, a:b], dout[None, a:b])
              for a, b in itertools.pairwise(cu.tolist())]

    def dense(args: tuple[torch.Tensor, ...], bwd: bool) -> None:
        out, lse = backend.forward(*args[:3], causal=causal, scale=scale)
        if bwd:
            backend.backward(args[3], *args[:3], out, lse, causal=causal, scale=scale)

    def varlen(bwd: bool) -> None:
        out, lse = backend.varlen_forward(
            q, k, v, cu, cu, longest, longest, causal=causal, scale=scale
        )
        if bwd:
            backend.varlen_backward(
                dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal, scale=scale
            )

    fns: dict[str, Callable[[], object]] = {}
    for p, bwd in (("f", False), ("b", True)):
        fns["var" + p] = functools.partial(varlen, bwd)
        fns["one" + p] = functools.partial(dense, one, bwd)
        fns["bat" + p] = functools.partial(dense, bat, bwd)
        fns["loop" + p] = functools.partial(lambda b: [dense(x, b) for x in pieces], bwd)
    return _best_times(fns, rounds)

if __name__ == "__main__":
    main()
