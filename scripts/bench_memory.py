"""Benchmark attention memory per rank against one device, everything a rank allocates counted.

For every ring x Ulysses configuration, dense (``seqpar.attention``) and packed
(``seqpar.varlen_attention``), every rank measures two workloads on a **fresh state** (after a
warm-up on another state, so that caches, plans and connections exist but the new state holds no
buffer yet):

* ``call``: one forward+backward of attention on its shard;
* ``stack``: one forward+backward of a stack of ``--layers`` attention layers with their
  projections (``x + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))`` per layer, hidden size
  ``H * D``, frozen weights: their gradients are the same on every rank and one device, not
  attention memory).

Memory is the peak of tensor storage created inside the workload (``seqpar.tools.profiling
.PeakMemory``: on CPU every storage an op creates, alive or freed; on CUDA the allocator's peak
above the start), **including what the state keeps**: the first call on the fresh state allocates
any kept buffers (``state.workspace``, Note [Workspace]) inside the measured block, and a second,
later call is counted with the bytes kept before it added (``total = max(first, later + kept)``).
The ``later`` column alone is the in-call peak of a later call without the kept buffers.

Each figure is ``peak x N / ideal``, where the **ideal** is the peak of *one device* running the
whole sequence through the same workload with the backend's kernels called directly, so 1.0 means
a perfect ``1/N`` share. The ranks share the machine's cores; memory does not depend on that.

    python scripts/bench_memory.py                       # N=4: 4x1, 1x4, 2x2; dense and packed
    python scripts/bench_memory.py --world 8 --configs 8x1,1x8,2x4,4x2 --kv-heads 2
    python scripts/bench_memory.py --keep                # a kept arena (Workspace(keep=True))
    python scripts/bench_memory.py --keep-head-shards    # ParallelState(keep_head_shards=True)
    python scripts/bench_memory.py --ring-comm p2p_serial  # the ring without overlap
    python scripts/bench_memory.py --seq-len 1024 --plot memory.png
    python scripts/bench_memory.py --head-groups 1,2,4,8 --layers 0  # Note [Head groups]: calls per group

With ``--head-groups`` every configuration runs once per group count (``head_groups=G`` on every
call) and the table adds the median time of ``--time-iters`` later calls (the busiest rank's
CPU wall time: a relative cost on shared cores, not a speed).

Output: the table and notes, then the whole report as one JSON line (last line); ``--json PATH``
also writes it to a file.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import get_args

import torch

import seqpar
from seqpar.backends import get_backend
from seqpar.comm import Workspace
from seqpar.state import RingComm
from seqpar.tools.bench import Ranks, inputs, parse_configs
from seqpar.tools.profiling import PeakMemory
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table


def _lengths(seq_len: int) -> list[int]:
    """The packed mix: a quarter, a half and the rest of ``seq_len``."""
    return [seq_len // 4, seq_len // 2, seq_len - seq_len // 4 - seq_len // 2]


def _inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """The whole sequence's q, k, v, dout ``[1, S, H(kv), D]`` (``seqpar.tools.bench.inputs``)."""
    return inputs((1, args.seq_len), args.heads, args.kv_heads, args.head_dim, device=device,
                  dtype=getattr(torch, args.dtype))


def _stack_tensors(args: argparse.Namespace, device: torch.device) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Frozen weights ``(Wq, Wk, Wv, Wo)`` per layer and the whole sequence's ``x``, ``dx``
    ``[1, S, H * D]`` (the same numbers on every rank)."""
    g = torch.Generator().manual_seed(1)
    dtype = getattr(torch, args.dtype)
    hidden, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * rows ** -0.5).to(device, dtype)

    weights = [(w(hidden, hidden), w(hidden, kv), w(hidden, kv), w(hidden, hidden)) for _ in range(args.layers)]
    x, dx = (torch.randn(1, args.seq_len, hidden, generator=g).to(device, dtype) for _ in range(2))
    return weights, x, dx


def _stack(x: torch.Tensor, weights: list, attend, args: argparse.Namespace) -> torch.Tensor:
    """``x + o_proj(attend(q_proj(x), k_proj(x), v_proj(x)))`` per layer; ``x`` ``[..., H * D]``."""
    for wq, wk, wv, wo in weights:
        q = (x @ wq).unflatten(-1, (args.heads, args.head_dim))
        k = (x @ wk).unflatten(-1, (args.kv_heads, args.head_dim))
        v = (x @ wv).unflatten(-1, (args.kv_heads, args.head_dim))
        x = x + attend(q, k, v).flatten(-2) @ wo
    return x


class _Direct(torch.autograd.Function):
    """The backend's kernels called directly (the one-device ideal), dense or packed."""

    @staticmethod
    def forward(ctx, q, k, v, backend, causal, scale, cu, max_len):
        if cu is None:
            out, lse = backend.forward(q, k, v, causal=causal, scale=scale)
        else:
            out, lse = backend.varlen_forward(q, k, v, cu, cu, max_len, max_len, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.causal, ctx.scale, ctx.cu, ctx.max_len = backend, causal, scale, cu, max_len
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, cu, m = ctx.backend, ctx.cu, ctx.max_len
        if cu is None:
            grads = b.backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        else:
            grads = b.varlen_backward(dout, q, k, v, out, lse, cu, cu, m, m, causal=ctx.causal, scale=ctx.scale)
        return (*grads, None, None, None, None, None)  # no gradient for the options


def _peak(run, device: torch.device) -> int:
    """Tensor bytes one call of ``run`` creates at its peak (``PeakMemory``)."""
    with PeakMemory(device) as mem:
        run()
    return mem.peak


def ideal(args: argparse.Namespace, packed: bool, stack: bool, device: torch.device) -> int:
    """One device, the whole sequence, the backend's kernels called directly (after a warm-up)."""
    dtype = getattr(torch, args.dtype)
    backend = get_backend(args.backend, device, dtype)
    scale = args.head_dim ** -0.5
    lens = _lengths(args.seq_len)
    cu = torch.tensor([0, lens[0], lens[0] + lens[1], args.seq_len], dtype=torch.int32, device=device)

    def attend(q, k, v):
        if packed:
            return _Direct.apply(q, k, v, backend, args.causal, scale, cu, max(lens))
        return _Direct.apply(q, k, v, backend, args.causal, scale, None, None)

    if stack:
        weights, x, dx = _stack_tensors(args, device)
        x = (x[0] if packed else x).requires_grad_()
        dx = dx[0] if packed else dx

        def run() -> None:
            x.grad = None
            _stack(x, weights, attend, args).backward(dx)
    else:
        q, k, v, dout = _inputs(args, device)
        if packed:
            q, k, v, dout = (t[0] for t in (q, k, v, dout))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def run() -> None:
            for t in (q, k, v):
                t.grad = None
            attend(q, k, v).backward(dout)

    run()  # warm-up
    return _peak(run, device)


def measure(args: argparse.Namespace, R: int, U: int, packed: bool, stack: bool, head_groups: int = 1) -> dict:
    """On every rank: the peaks of a first and a later call on a fresh state, and what it keeps."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    lens = _lengths(args.seq_len)

    def shard(t: torch.Tensor, state) -> torch.Tensor:
        if packed:
            return seqpar.shard_packed(t[0], state, lens).clone()
        return seqpar.shard(t, state).clone()

    def workload(state):
        def attend(q, k, v):
            if packed:
                return seqpar.varlen_attention(q, k, v, state, lens, causal=args.causal, backend=args.backend,
                                               head_groups=head_groups)
            return seqpar.attention(q, k, v, state, causal=args.causal, seq_len=args.seq_len, backend=args.backend,
                                    head_groups=head_groups)

        if stack:
            weights, x_full, dx_full = _stack_tensors(args, device)
            x, dx = shard(x_full, state).requires_grad_(), shard(dx_full, state)
            del x_full, dx_full

            def run() -> None:
                x.grad = None
                _stack(x, weights, attend, args).backward(dx)
        else:
            local = [shard(t, state) for t in _inputs(args, device)]
            q, k, v = (t.requires_grad_() for t in local[:3])

            def run() -> None:
                for t in (q, k, v):
                    t.grad = None
                attend(q, k, v).backward(local[3])

        return run

    def fresh_state():
        state = seqpar.ParallelState(R, U, keep_head_shards=args.keep_head_shards, ring_comm=args.ring_comm)
        if args.keep:
            state.workspace = Workspace(keep=True)
        return state

    warm = fresh_state()  # plans, caches, connections; then a fresh state that holds nothing yet
    workload(warm)()
    warm.close()
    state = fresh_state()
    run = workload(state)
    first = _peak(run, device)
    kept = state.workspace.nbytes
    later = _peak(run, device)
    result = {"first": first, "later": later, "kept": kept, "total": max(first, later + kept)}
    times = []
    for _ in range(args.time_iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    result["seconds"] = statistics.median(times) if times else 0.0
    state.close()
    return result


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--world", type=int, default=4, help="local CPU ranks")
    parser.add_argument("--configs", default=None, help="ring x ulysses list, e.g. 4x1,1x4,2x2 (default: ring only, "
                        "Ulysses only and an even hybrid of --world)")
    parser.add_argument("--seq-len", type=int, default=4096, help="global tokens")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim")
    parser.add_argument("--layers", type=int, default=4, help="layers of the stack workload (0: no stack)")
    parser.add_argument("--dtype", default="float32", help="dtype")
    parser.add_argument("--backend", default="auto", help="attention backend")
    parser.add_argument("--non-causal", dest="causal", action="store_false", help="non-causal (default: causal)")
    parser.add_argument("--keep", action="store_true", help="states keep a workspace arena (Workspace(keep=True)) "
                        "instead of fresh buffers per call")
    parser.add_argument("--keep-head-shards", action="store_true",
                        help="ParallelState(keep_head_shards=True): Ulysses keeps its head shards for the backward")
    parser.add_argument("--ring-comm", default="p2p", choices=get_args(RingComm),
                        help="ParallelState(ring_comm=...): the ring's K/V transport")
    parser.add_argument("--head-groups", default="1",
                        help="head_groups of every call, a list such as 1,2,4,8 (Note [Head groups]); a count above "
                        "--heads is skipped")
    parser.add_argument("--time-iters", type=int, default=0,
                        help="later calls timed per measurement (median; default 0, or 3 with --head-groups lists)")
    add_output_arguments(parser, "total x (everything counted) per configuration, single call and stack")
    args = parser.parse_args()
    n = args.world
    group_counts = [int(g) for g in args.head_groups.split(",")]
    if len(group_counts) > 1 and args.time_iters == 0:
        args.time_iters = 3
    group_counts = [g for g in group_counts if g <= args.heads]
    half = next(d for d in range(int(n**0.5), 0, -1) if n % d == 0)
    configs = parse_configs(args.configs) if args.configs else list(dict.fromkeys([(n, 1), (1, n), (n // half, half)]))
    for R, U in configs:
        if R * U != n:
            raise SystemExit(f"--configs: {R}x{U} does not use the {n} ranks of --world {n}")

    device = torch.device("cpu")
    workloads = ["call"] + (["stack"] if args.layers > 0 else [])
    ideals = {(p, w): ideal(args, p, w == "stack", device) for p in (False, True) for w in workloads}
    rows, results = [], []
    with Ranks(n, torchrun=False, timeout_s=600) as ranks:  # local CPU ranks only
        for R, U in configs:
            for packed in (False, True):
                for work in workloads:
                    for G in group_counts:
                        layout = "packed" if packed else "dense"
                        progress("bench_memory", f"ring {R} x ulysses {U}, {layout}, {work}, head_groups {G}")
                        per_rank = ranks.run(measure, args, R, U, packed, work == "stack", G)
                        base = ideals[(packed, work)]
                        entry = {"config": f"{R}x{U}", "layout": layout, "workload": work, "head_groups": G,
                                 "ideal_bytes": base}
                        for key in ("first", "later", "kept", "total"):
                            entry[f"{key}_bytes_max_rank"] = max(r[key] for r in per_rank)
                        entry["total_x_ideal"] = entry["total_bytes_max_rank"] * n / base
                        entry["later_x_ideal"] = entry["later_bytes_max_rank"] * n / base
                        entry["seconds_max_rank"] = max(r["seconds"] for r in per_rank)
                        results.append(entry)
                        rows.append([
                            entry["config"], layout, work, str(G), f"{base / 2**20:.1f}",
                            *(f"{entry[f'{key}_bytes_max_rank'] / 2**20:.1f}" for key in ("first", "later", "kept")),
                            f"{entry['later_x_ideal']:.2f}", f"{entry['total_x_ideal']:.2f}",
                            f"{entry['seconds_max_rank'] * 1e3:.0f}" if args.time_iters else "--",
                        ])
    what = (f"S={args.seq_len} H={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype} "
            f"{'causal' if args.causal else 'non-causal'}, packed = 3 sequences, stack = {args.layers} layers, "
            f"workspace {'kept (arena)' if args.keep else 'per call'}"
            f"{', Ulysses head shards kept' if args.keep_head_shards else ''}, ring_comm {args.ring_comm}")
    text = (
        f"attention memory per rank x {n} / one device (ideal 1.0), everything counted; {what}\n"
        + table(["config", "layout", "workload", "groups", "ideal MiB", "first MiB", "later MiB", "kept MiB", "later x",
                 "total x", "ms"], rows)
    )
    notes = [
        "total x = max(first call on a fresh state, later call + bytes kept before it) x N / ideal: everything "
        "the busiest rank allocates, kept buffers included; later x = a later call's in-call peak alone; "
        "ideal = one device, whole sequence, same workload, kernels called directly; stack weights are frozen",
    ]
    report = {"world": n, "args": vars(args), "results": results}
    plot = chart(
        args.plot,
        f"attention memory per rank x {n} / one device (1.0 = a perfect 1/{n} share), everything counted; {what}",
        [f"{e['config']} {e['layout']} {e['workload']} G{e['head_groups']}" for e in results],
        {"total (kept buffers included)": [e["total_x_ideal"] for e in results],
         "later call alone": [e["later_x_ideal"] for e in results]},
        f"peak per rank x {n} / one device (lower is better; dashed line: the ideal 1.0)",
    )
    emit(report, text, notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
