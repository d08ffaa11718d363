"""Benchmark a backend's varlen and sliding-window paths against dense calls doing the same FLOPs.

Varlen: for each packing scenario the varlen forward (and forward + backward) time is compared with

- ``1xS``: one dense ``[1, S_eq, H, D]`` call, ``S_eq = sqrt(sum(len_q * len_k))`` (equal FLOPs,
  same causal flag);
- ``nxL``: one dense ``[n, L_rms, H, D]`` call, ``n`` = number of sequences and
  ``L_rms = sqrt(mean(len**2))`` (equal FLOPs *and* equal sequence count: what the kernel itself
  costs for sequences that short, so ``varlen / nxL`` is the packing overhead);
- ``loop``: one dense call per sequence.

Windows (``--windows S:W,...``): one dense ``[1, S, H, D]`` block with the causal sliding window
``(W, 0)`` (query ``i`` sees keys ``i-W .. i``), against

- ``eq``: a non-causal ``[1, S_eq, H, D]`` call with ``S_eq^2`` = the window's attended pairs
  (equal useful FLOPs): ``window / eq`` is the cost of the windowed path per attended pair;
- ``causal``: plain causal attention over the same ``S`` (what the window should save).

Times are the minimum over repeated runs (robust to other processes on the machine), the device
synchronised around every timed call.

    python scripts/bench_kernels.py                      # CPU backend, fp32 and bf16
    python scripts/bench_kernels.py --dtype bfloat16 --threads 1
    python scripts/bench_kernels.py --dtype float32 --windows 16384:4096 --no-varlen

Output: the tables, then the whole report as one JSON line (last line); ``--json PATH`` also
writes it to a file; ``--plot PATH`` saves a chart of ``varlen / nxL`` and ``window / eq`` (each
path against dense calls doing the same work), forward and forward + backward.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import random
from collections.abc import Callable

import torch

from seqpar.backends import get_backend
from seqpar.tools.bench import usable_cores
from seqpar.tools.profiling import iteration_seconds
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table


def _best_times(fns: dict[str, Callable[[], object]], rounds: int, device: torch.device) -> dict[str, float]:
    """Minimum wall time in ms of each function, measured round-robin after one untimed call each
    (``iteration_seconds``: the device synchronised around every call)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], iteration_seconds(fn, 1, device, warmup=0, barrier=False)[0] * 1e3)
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


def _parse_windows(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        try:
            s, w = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--windows: expected items like 8192:1024 (seq_len:window), got {item!r}") from None
        if not 0 <= w < s - 1:
            raise SystemExit(f"--windows: {item!r}: need 0 <= W < S - 1 (a window that masks something)")
        out.append((s, w))
    return out


def _rand(device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def _dense(backend, args: tuple[torch.Tensor, ...], bwd: bool, causal: bool, scale: float,
           window: tuple[int, int] = (-1, -1)) -> None:
    out, lse = backend.forward(*args[:3], causal=causal, scale=scale, window=window)
    if bwd:
        backend.backward(args[3], *args[:3], out, lse, causal=causal, scale=scale, window=window)


def _bench_varlen(name: str, device: torch.device, dtype: torch.dtype, lens: list[int],
                  causal: bool, h: int, hkv: int, d: int, rounds: int) -> dict[str, float]:
    backend = get_backend(name, device, dtype)
    scale = d**-0.5
    rand = functools.partial(_rand, device, dtype)
    total, longest = sum(lens), max(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    q, k, v, dout = rand(total, h, d), rand(total, hkv, d), rand(total, hkv, d), rand(total, h, d)
    s_eq = round(math.sqrt(sum(n * n for n in lens)))
    l_rms = round(math.sqrt(sum(n * n for n in lens) / len(lens)))
    one = (rand(1, s_eq, h, d), rand(1, s_eq, hkv, d), rand(1, s_eq, hkv, d), rand(1, s_eq, h, d))
    bat = tuple(rand(len(lens), l_rms, hh, d) for hh in (h, hkv, hkv, h))
    pieces = [(q[None, a:b], k[None, a:b], v[None, a:b], dout[None, a:b])
              for a, b in itertools.pairwise(cu.tolist())]

    def varlen(bwd: bool) -> None:
        out, lse = backend.varlen_forward(q, k, v, cu, cu, longest, longest, causal=causal, scale=scale)
        if bwd:
            backend.varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal, scale=scale)

    dense = functools.partial(_dense, backend, causal=causal, scale=scale)
    fns: dict[str, Callable[[], object]] = {}
    for p, bwd in (("f", False), ("b", True)):
        fns["var" + p] = functools.partial(varlen, bwd)
        fns["one" + p] = functools.partial(dense, one, bwd)
        fns["bat" + p] = functools.partial(dense, bat, bwd)
        fns["loop" + p] = functools.partial(lambda b: [dense(x, b) for x in pieces], bwd)
    return _best_times(fns, rounds, device)


def _window_pairs(s: int, w: int) -> int:
    """Attended (query, key) pairs of causal window ``(w, 0)`` over ``s`` tokens, per head."""
    return s * (w + 1) - w * (w + 1) // 2  # sum over i of min(i, w) + 1


def _bench_window(name: str, device: torch.device, dtype: torch.dtype, s: int, w: int,
                  h: int, hkv: int, d: int, rounds: int) -> dict[str, float]:
    backend = get_backend(name, device, dtype, window=True)
    scale = d**-0.5
    rand = functools.partial(_rand, device, dtype)
    s_eq = round(math.sqrt(_window_pairs(s, w)))
    full = (rand(1, s, h, d), rand(1, s, hkv, d), rand(1, s, hkv, d), rand(1, s, h, d))
    eq = (rand(1, s_eq, h, d), rand(1, s_eq, hkv, d), rand(1, s_eq, hkv, d), rand(1, s_eq, h, d))
    fns: dict[str, Callable[[], object]] = {}
    for p, bwd in (("f", False), ("b", True)):
        fns["win" + p] = functools.partial(_dense, backend, full, bwd, True, scale, (w, 0))
        fns["eq" + p] = functools.partial(_dense, backend, eq, bwd, False, scale)
        fns["cau" + p] = functools.partial(_dense, backend, full, bwd, True, scale)
    return _best_times(fns, rounds, device) | {"s_eq": s_eq}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--backend", default="cpu", help="kernel backend")
    parser.add_argument("--device", default="cpu", help="device")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: both)")
    parser.add_argument("--heads", type=int, default=8, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim D")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random sequence lengths")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per call; the minimum is reported")
    parser.add_argument("--varlen", action=argparse.BooleanOptionalAction, default=True,
                        help="run the varlen scenarios")
    parser.add_argument("--windows", default="4096:512,8192:1024",
                        help="S:W causal sliding-window blocks to time ('' for none)")
    add_output_arguments(parser, "varlen / nxL and window / eq per scenario, forward and forward+backward")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    windows = _parse_windows(args.windows)

    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    device = torch.device(args.device)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    settings = {
        "backend": args.backend, "device": str(device), "heads": h, "kv_heads": hkv, "head_dim": d,
        "threads": torch.get_num_threads(), "cpu_cores": usable_cores(), "rounds": args.rounds,
        "time": "minimum over rounds, ms",
    }
    varlen_rows, window_rows = [], []
    if args.varlen:
        for dtype, (label, lens), causal in itertools.product(dtypes, _scenarios(args.seed).items(), (False, True)):
            progress("bench_kernels", f"varlen {str(dtype)[6:]} {label} {'causal' if causal else 'non-causal'}")
            t = _bench_varlen(args.backend, device, dtype, lens, causal, h, hkv, d, args.rounds)
            row = {"dtype": str(dtype)[6:], "scenario": label, "sequences": len(lens), "tokens": sum(lens), "causal": causal}
            for p, phase in (("f", "fwd"), ("b", "fwd_bwd")):
                row[phase] = {
                    "varlen_ms": t["var" + p], "one_dense_ms": t["one" + p], "batched_dense_ms": t["bat" + p],
                    "loop_ms": t["loop" + p], "varlen_over_one": t["var" + p] / t["one" + p],
                    "varlen_over_batched": t["var" + p] / t["bat" + p],
                }
            varlen_rows.append(row)
    for dtype, (s, w) in itertools.product(dtypes, windows):
        progress("bench_kernels", f"window {str(dtype)[6:]} S={s} W={w}")
        t = _bench_window(args.backend, device, dtype, s, w, h, hkv, d, args.rounds)
        row = {"dtype": str(dtype)[6:], "seq_len": s, "window": w, "pairs_per_head": _window_pairs(s, w),
               "equal_pairs_seq_len": t["s_eq"]}
        for p, phase in (("f", "fwd"), ("b", "fwd_bwd")):
            row[phase] = {
                "window_ms": t["win" + p], "equal_pairs_dense_ms": t["eq" + p], "causal_ms": t["cau" + p],
                "window_over_equal_pairs": t["win" + p] / t["eq" + p], "window_over_causal": t["win" + p] / t["cau" + p],
            }
        window_rows.append(row)

    parts = [(f"backend={args.backend} device={device} H={h} Hkv={hkv} D={d} threads={torch.get_num_threads()}; "
              f"times in ms (min of {args.rounds} runs)")]
    if varlen_rows:
        cols = ["dtype", "scenario", "causal"] + [f"{p} {c}" for p in ("fwd", "f+b")
                                                  for c in ("varlen", "1xS", "nxL", "loop", "/1xS", "/nxL")]
        rows = []
        for r in varlen_rows:
            cells = [r["dtype"], r["scenario"], r["causal"]]
            for phase in ("fwd", "fwd_bwd"):
                x = r[phase]
                cells += [f"{x['varlen_ms']:.2f}", f"{x['one_dense_ms']:.2f}", f"{x['batched_dense_ms']:.2f}",
                          f"{x['loop_ms']:.1f}", f"{x['varlen_over_one']:.2f}", f"{x['varlen_over_batched']:.2f}"]
            rows.append(cells)
        parts += ["", "varlen vs dense calls of equal FLOPs:", table(cols, rows)]
    if window_rows:
        cols = ["dtype", "S", "W", "S_eq"] + [f"{p} {c}" for p in ("fwd", "f+b")
                                              for c in ("window", "eq", "causal", "/eq", "/causal")]
        rows = []
        for r in window_rows:
            cells = [r["dtype"], r["seq_len"], r["window"], r["equal_pairs_seq_len"]]
            for phase in ("fwd", "fwd_bwd"):
                x = r[phase]
                cells += [f"{x['window_ms']:.1f}", f"{x['equal_pairs_dense_ms']:.1f}", f"{x['causal_ms']:.1f}",
                          f"{x['window_over_equal_pairs']:.2f}", f"{x['window_over_causal']:.3f}"]
            rows.append(cells)
        title = ("causal window (W, 0) block vs a non-causal call of equal attended pairs (eq) and plain "
                 "causal over S:")
        parts += ["", title, table(cols, rows)]
    notes = []
    if torch.get_num_threads() > usable_cores():
        notes.append(f"WARNING: {torch.get_num_threads()} threads on {usable_cores()} usable core(s): "
                     "kernels time-share; pass --threads")
    labels = [f"varlen/nxL {r['dtype']} {r['scenario']}{' causal' if r['causal'] else ''}" for r in varlen_rows]
    labels += [f"window/eq {r['dtype']} S={r['seq_len']} W={r['window']}" for r in window_rows]
    plot = chart(
        args.plot if labels else None,
        f"backend={args.backend} device={device} H={h} Hkv={hkv} D={d} threads={torch.get_num_threads()}: varlen "
        "vs one dense [n, L_rms] call (nxL), causal window vs a non-causal call of equal attended pairs (eq); "
        f"min of {args.rounds} runs",
        labels,
        {phase: [r[key]["varlen_over_batched"] for r in varlen_rows]
         + [r[key]["window_over_equal_pairs"] for r in window_rows]
         for phase, key in (("fwd", "fwd"), ("fwd+bwd", "fwd_bwd"))},
        "time / dense call doing the same work (1.0 = no overhead)",
        value_format=".2f",
    )
    if args.plot is not None and not labels:
        notes.append("--plot: nothing was timed (--no-varlen and no --windows), no chart written")
    emit({"settings": settings, "varlen": varlen_rows, "windows": window_rows}, "\n".join(parts), notes, args.json,
         plot=plot)


if __name__ == "__main__":
    main()
