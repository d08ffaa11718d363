"""Benchmark ONE rank of ring x Ulysses attention on one GPU: efficiency, TFLOP/s, memory, max length.

Each configuration ``R x U`` runs as rank ``--cp-rank`` of an ``R * U``-rank job, alone in a fresh
process over torch's fake process group (``seqpar.tools.one_rank``, Note [One-rank runs]): the same
kernel calls, buffers and copies as that rank of a real job, with communication free. Per
configuration and length it reports

- the rank's forward and backward time (CUDA events; median of ``--iters``) and TFLOP/s
  (useful FLOPs from the plan: ``4 * D`` per attended (query, key, head) forward, 2.5x backward);
- **efficiency** = (rank FLOPs / rank time) / (FLOPs / time of ONE call of the same backend on a
  dense block with the rank's heads and as many (causal) pairs): 1.0 means the ring's many
  smaller kernel calls, merges and staging copies cost nothing over one big kernel;
- peak memory of one forward+backward (``torch.cuda.max_memory_allocated``), kernel calls,
  and the bytes the rank hands to all-to-alls and ring sends;
- with ``--varlen``: the same tokens as packed documents of mixed lengths (log-uniform from 128
  tokens to a quarter of the sequence) through ``seqpar.varlen_attention``, next to dense;
- with ``--workspace both``: every run twice, once with fresh transfer and staging buffers per
  call (the default state) and once with a kept arena (``seqpar.comm.Workspace(keep=True)``), and
  a table of kept / fresh time and peak memory (the peak counts the arena);
- with ``--max-len``: the longest global sequence whose one-rank forward+backward fits in the
  device's memory, for ``--max-len-configs`` (default 8 and 64 ranks), found by doubling and
  bisection on OOM; ``--probe stub`` (default) replaces the attention kernels by allocations of
  their outputs and calibrated scratch, because a real forward+backward at those lengths takes
  minutes (the report checks the stub's peak against the real kernels' at a small length);
  ``--layer`` repeats the search inside a Llama-8B-shaped decoder layer (hidden 4096, MLP 14336,
  activation checkpointing) with the inputs of ``--layers`` layers kept alive.

Lengths: ``--local-lens`` are tokens per rank (``S = S_local * R * U``; default 4k..64k), or
``--seq-lens`` global lengths. Every number is one rank's with communication free: a real job
adds the transfer time the ring does not hide and the all-to-all time.

    python scripts/bench_gpu_rank.py                                   # on a GPU: the issue's figures
    python scripts/bench_gpu_rank.py --configs 8x1,1x8,2x4 --local-lens 4096,65536 --varlen
    python scripts/bench_gpu_rank.py --workspace both --local-lens 4096,16384 --iters 10
    python scripts/bench_gpu_rank.py --max-len --max-len-configs 8x1,64x1,8x8 --no-efficiency
    python scripts/bench_gpu_rank.py --device cpu --configs 2x1,1x2 --local-lens 256 \\
        --heads 4 --kv-heads 2 --head-dim 16                           # plumbing check on a CPU

Output: tables, notes and warnings, then the whole report as one JSON line (last line);
``--json PATH`` also writes it, ``--plot PATH`` saves a chart of the efficiencies.
"""

from __future__ import annotations

import argparse

import torch

from seqpar.tools.bench import few_iterations_warning, parse_configs
from seqpar.tools.one_rank import MaxLenSearch, OneRankConfig, run_tasks
from seqpar.tools.report import add_output_arguments, chart, emit, progress, script_parser, table

GIB = 2**30


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{option}: expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{option}: expected positive ints, got {text!r}")
    return values


def _fmt(x: float | None, spec: str = ".3f") -> str | None:
    return None if x is None else format(x, spec)


def _parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--configs", default="8x1,1x8,2x4", help="ring x Ulysses configurations to time")
    p.add_argument("--local-lens", default="4096,8192,16384,32768,65536",
                   help="tokens per rank; the global length is S_local * R * U")
    p.add_argument("--seq-lens", default=None, help="global lengths instead of --local-lens")
    p.add_argument("--heads", type=int, default=32, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D")
    p.add_argument("--batch", type=int, default=1, help="batch (dense runs)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention")
    p.add_argument("--backend", default="auto", help="attention backend (auto: torch_flash on CUDA bf16)")
    p.add_argument("--cp-rank", type=int, default=0, help="the rank each configuration runs")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: CUDA when available")
    p.add_argument("--varlen", action="store_true", help="also packed documents of mixed lengths, same tokens")
    p.add_argument("--workspace", default="fresh", choices=("fresh", "kept", "both"),
                   help="transfer/staging buffers: fresh per call (default), a kept arena, or both (compared)")
    p.add_argument("--efficiency", action=argparse.BooleanOptionalAction, default=True,
                   help="run the timed configurations (off: only --max-len)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--max-len", action="store_true", help="search the longest S that fits in memory")
    p.add_argument("--max-len-configs", default="8x1,1x8,2x4,64x1,8x8", help="configurations for --max-len")
    p.add_argument("--probe", default="stub", choices=("stub", "real"), help="--max-len probe kernels")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="--max-len: treat this as the memory (default: the GPU's; required on the CPU)")
    p.add_argument("--granule", type=int, default=1024, help="--max-len resolution, tokens per rank")
    p.add_argument("--check-tokens", type=int, default=4096,
                   help="--max-len --probe stub: tokens per rank of the stub-vs-real peak check")
    p.add_argument("--layer", action="store_true", help="--max-len also inside a Llama-8B-shaped decoder layer")
    p.add_argument("--layer-configs", default=None, help="--layer: configurations (default: --max-len-configs)")
    p.add_argument("--layers", type=int, default=32, help="--layer: layer inputs kept alive (model depth)")
    p.add_argument("--hidden", type=int, default=4096, help="--layer: hidden size")
    p.add_argument("--mlp", type=int, default=14336, help="--layer: MLP width")
    p.add_argument("--timeout", type=float, default=900, help="seconds per task before it is killed")
    add_output_arguments(p, "the efficiency (fwd, bwd, fwd+bwd) of every configuration and length")
    return p


def main() -> None:
    args = _parser().parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available (torch.cuda.is_available() is False)")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    configs = parse_configs(args.configs)
    common = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype, device=device,
                  causal=args.causal, backend=args.backend, warmup=args.warmup, iters=args.iters)
    if args.iters < 1:
        raise SystemExit(f"--iters must be >= 1, got {args.iters}")

    tasks: list = []
    kinds: list[tuple] = []
    try:
        if args.efficiency:
            for R, U in configs:
                lengths = ([(s, None) for s in _ints(args.seq_lens, "--seq-lens")] if args.seq_lens else
                           [(n * R * U, n) for n in _ints(args.local_lens, "--local-lens")])
                for S, local in lengths:
                    for varlen in (False, True) if args.varlen else (False,):
                        for ws in ("fresh", "kept") if args.workspace == "both" else (args.workspace,):
                            cp_rank = args.cp_rank % (R * U)
                            tasks.append(OneRankConfig(R, U, S, cp_rank=cp_rank, batch=1 if varlen else args.batch,
                                                       varlen=varlen, keep_workspace=ws == "kept", **common))
                            kinds.append(("run", R, U, S, local, varlen, ws))
        if args.max_len:
            limit = None if args.memory_limit_gib is None else int(args.memory_limit_gib * GIB)
            if device == "cpu" and limit is None:
                raise SystemExit("--max-len on the CPU needs --memory-limit-gib (nothing runs out of memory)")
            searches = [(R, U, "attention", {}) for R, U in parse_configs(args.max_len_configs, "--max-len-configs")]
            if args.layer:
                layer = dict(model="llama_layer", hidden=args.hidden, mlp=args.mlp, layers=args.layers)
                text = args.layer_configs or args.max_len_configs
                searches += [(R, U, "llama_layer", layer) for R, U in parse_configs(text, "--layer-configs")]
            for R, U, name, extra in searches:
                cfg = OneRankConfig(R, U, R * U, cp_rank=0, batch=args.batch, **{**common, **extra})
                tasks.append(MaxLenSearch(cfg, probe=args.probe, memory_limit_bytes=limit, granule=args.granule,
                                          start=max(args.granule, 8192), check_tokens=args.check_tokens))
                kinds.append(("max_len", R, U, name))
    except ValueError as e:
        raise SystemExit(f"bench_gpu_rank: {e}") from None
    if not tasks:
        raise SystemExit("nothing to run: --no-efficiency without --max-len")

    def started(i: int) -> None:
        kind = kinds[i]
        what = (f"S={kind[3]}{' varlen' if kind[5] else ''}, {kind[6]} workspace" if kind[0] == "run" else f"longest {kind[3]} sequence")
        progress("bench_gpu_rank", f"task {i + 1}/{len(tasks)}: ring {kind[1]} x ulysses {kind[2]}, {what}")

    results = run_tasks(tasks, timeout_s=args.timeout, on_start=started)
    runs = [_run_row(k, r) for k, r in zip(kinds, results) if k[0] == "run"]
    _add_dense_ratio(runs)
    kept_vs_fresh = _kept_vs_fresh(runs)
    searches = [_max_len_row(k, r) for k, r in zip(kinds, results) if k[0] == "max_len"]
    env = next((r["environment"] for r in results if "environment" in r), {"device": device})
    problem = {**common, "batch": args.batch, "cp_rank": args.cp_rank, "varlen": args.varlen,
               "workspace": args.workspace}
    report = {"environment": env, "problem": problem, "runs": runs, "kept_vs_fresh": kept_vs_fresh,
              "max_len": searches}

    notes = [
        None if device == "cuda" else
        "WARNING: measured on the CPU -- these are NOT GPU figures (plumbing check only); run on a CUDA "
        "machine, e.g. scripts/gpu_check",
        few_iterations_warning(args.iters) if args.efficiency else None,
        "one rank alone over a fake process group: communication is free, so times are the rank's compute "
        "(kernels, merges, staging copies); a real job adds unhidden transfer time",
    ]
    errors = [f"{_label(k)}: {r['error']}" for k, r in zip(kinds, results) if "error" in r]
    if errors:
        notes.append("FAILED: " + "; ".join(errors))
    warnings = sorted({w for r in results for w in r.get("warnings", []) if "not GPU" not in w})
    notes += [f"WARNING: {w}" for w in warnings]
    timed = [r for r in runs if r.get("efficiency") is not None]
    plot = chart(
        args.plot if timed else None,
        f"one rank vs one equal-FLOP kernel call (1.0 = parity); H={args.heads} Hkv={args.kv_heads} "
        f"D={args.head_dim} {dtype} on {env.get('device_name', device)}",
        [f"{r['config']} {r['mode']} S_local={r['local_tokens']}" for r in timed],
        {"fwd": [r["efficiency_fwd"] for r in timed], "bwd": [r["efficiency_bwd"] for r in timed],
         "fwd+bwd": [r["efficiency"] for r in timed]},
        "(rank FLOP/s) / (one kernel call's FLOP/s)",
    )
    emit(report, _text(report, args), notes, args.json, plot=plot)


def _label(kind: tuple) -> str:
    if kind[0] == "run":
        _, R, U, S, _, varlen, ws = kind
        return f"{R}x{U} {'packed' if varlen else 'dense'} S={S} {ws} workspace"
    return f"max-len {kind[1]}x{kind[2]} {kind[3]}"


def _run_row(kind: tuple, r: dict) -> dict:
    _, R, U, S, local, varlen, ws = kind
    row = {"config": f"{R}x{U}", "ring": R, "ulysses": U, "mode": "packed" if varlen else "dense", "seq_len": S,
           "local_tokens": r.get("local_tokens", local), "workspace": ws}
    if "error" in r or r.get("oom"):
        row["error"] = r.get("error", "out of memory")
        return row
    mono = r.get("monolithic") or {}
    work = r["work"]
    row.update(
        fwd_ms=r["fwd_ms"], bwd_ms=r["bwd_ms"], fwd_tflops=r.get("fwd_tflops"), bwd_tflops=r.get("bwd_tflops"),
        fwd_flops=work["fwd_flops"], bwd_flops=work["bwd_flops"], heads=work["heads"],
        pairs_max_over_mean=work["pairs_max_over_mean"],
        efficiency_fwd=r.get("efficiency_fwd"), efficiency_bwd=r.get("efficiency_bwd"), efficiency=r.get("efficiency"),
        monolithic_seq_len=mono.get("seq_len"),
        monolithic_fwd_tflops=mono["fwd_flops"] / mono["fwd_ms"] / 1e9 if mono else None,
        monolithic_bwd_tflops=mono["bwd_flops"] / mono["bwd_ms"] / 1e9 if mono else None,
        kernel_share=r["kernel_share"], kernel_fwd_ms=r["kernel_fwd_ms"], kernel_bwd_ms=r["kernel_bwd_ms"],
        kernel_calls=r["kernel_calls"], comm_bytes=r["comm"]["bytes"],
        peak_bytes=(r.get("memory") or {}).get("peak_bytes"),
        workspace_bytes=(r.get("memory") or {}).get("workspace_bytes"),
        backend=r.get("backend"), fwd_ms_all=r["fwd_ms_all"], bwd_ms_all=r["bwd_ms_all"],
    )
    return row


def _add_dense_ratio(runs: list[dict]) -> None:
    """Packed rows get ``time_vs_dense``/``flops_vs_dense``: their fwd+bwd over the dense row's."""
    dense = {(r["config"], r["seq_len"], r["workspace"]): r for r in runs if r["mode"] == "dense" and "error" not in r}
    for r in runs:
        d = dense.get((r["config"], r["seq_len"], r["workspace"]))
        if r["mode"] == "packed" and d is not None and "error" not in r:
            r["time_vs_dense"] = (r["fwd_ms"] + r["bwd_ms"]) / (d["fwd_ms"] + d["bwd_ms"])
            r["flops_vs_dense"] = r["fwd_flops"] / d["fwd_flops"] if d["fwd_flops"] else None


def _kept_vs_fresh(runs: list[dict]) -> list[dict]:
    """Per run measured both ways: kept-arena / fresh-buffer fwd+bwd time and peak memory."""
    fresh = {(r["config"], r["mode"], r["seq_len"]): r for r in runs if r["workspace"] == "fresh" and "error" not in r}
    out = []
    for k in runs:
        f = fresh.get((k["config"], k["mode"], k["seq_len"]))
        if k["workspace"] != "kept" or "error" in k or f is None:
            continue
        row = {"config": k["config"], "mode": k["mode"], "seq_len": k["seq_len"], "local_tokens": k["local_tokens"],
               "fresh_ms": f["fwd_ms"] + f["bwd_ms"], "kept_ms": k["fwd_ms"] + k["bwd_ms"],
               "fresh_peak_bytes": f["peak_bytes"], "kept_peak_bytes": k["peak_bytes"],
               "arena_bytes": k["workspace_bytes"]}
        row["time_ratio"] = row["kept_ms"] / row["fresh_ms"]
        row["peak_ratio"] = (k["peak_bytes"] / f["peak_bytes"]) if k["peak_bytes"] and f["peak_bytes"] else None
        out.append(row)
    return out


def _max_len_row(kind: tuple, r: dict) -> dict:
    _, R, U, model = kind
    row = {"config": f"{R}x{U}", "ranks": R * U, "model": model}
    if "error" in r:
        row["error"] = r["error"]
        return row
    svr = r.get("stub_vs_real") or {}
    row.update(
        max_seq_len=r["max_seq_len"], max_local_tokens=r["max_local_tokens"], peak_bytes=r["peak_bytes"],
        limit_bytes=r["limit_bytes"], first_failing_seq_len=r["first_failing_seq_len"], complete=r["complete"],
        probes=len(r["probes"]), probe=r["search"]["probe"], stub_vs_real=svr.get("ratio"),
        layers=r["search"]["config"]["layers"] if model == "llama_layer" else None,
    )
    return row


def _text(report: dict, args: argparse.Namespace) -> str:
    env, p = report["environment"], report["problem"]
    head = (f"{env.get('device_name', env.get('device'))} (torch {env.get('torch')}): H={p['heads']} "
            f"Hkv={p['kv_heads']} D={p['head_dim']} {p['dtype']} {'causal' if p['causal'] else 'non-causal'}, "
            f"backend {p['backend']}, cp rank {p['cp_rank']}, median of {p['iters']}")
    parts = [head]
    if report["runs"]:
        cols = ["config", "mode", "workspace", "S_local", "S", "fwd ms", "bwd ms", "fwd TF/s", "bwd TF/s", "mono TF/s f/b",
                "eff fwd", "eff bwd", "eff f+b", "kernel share", "calls f/b", "peak GiB", "vs dense"]
        rows = []
        for r in report["runs"]:
            if "error" in r:
                rows.append([r["config"], r["mode"], r["workspace"], r["local_tokens"], r["seq_len"],
                             f"ERROR: {r['error'][:60]}"] + [None] * (len(cols) - 6))
                continue
            calls = r["kernel_calls"]
            rows.append([
                r["config"], r["mode"], r["workspace"], r["local_tokens"], r["seq_len"], f"{r['fwd_ms']:.2f}", f"{r['bwd_ms']:.2f}",
                _fmt(r["fwd_tflops"], ".1f"), _fmt(r["bwd_tflops"], ".1f"),
                None if r["monolithic_fwd_tflops"] is None else
                f"{r['monolithic_fwd_tflops']:.1f}/{r['monolithic_bwd_tflops']:.1f}",
                _fmt(r["efficiency_fwd"]), _fmt(r["efficiency_bwd"]), _fmt(r["efficiency"]),
                _fmt(r["kernel_share"], ".2f"),
                f"{calls['forward'] + calls['varlen_forward']}/{calls['backward'] + calls['varlen_backward']}",
                _fmt(None if r["peak_bytes"] is None else r["peak_bytes"] / GIB, ".2f"),
                _fmt(r.get("time_vs_dense"), ".2f"),
            ])
        parts += ["", table(cols, rows),
                  "eff = (rank FLOP/s) / (FLOP/s of one kernel call of equal pairs, rank's heads); kernel share = "
                  "kernel time / rank time; vs dense = packed fwd+bwd time / dense fwd+bwd time on the same tokens"]
    if report["kept_vs_fresh"]:
        cols = ["config", "mode", "S_local", "fresh ms", "kept ms", "kept/fresh time", "fresh peak GiB",
                "kept peak GiB", "arena GiB", "kept/fresh peak"]
        rows = [[r["config"], r["mode"], r["local_tokens"], f"{r['fresh_ms']:.2f}", f"{r['kept_ms']:.2f}",
                 f"{r['time_ratio']:.3f}", _fmt(None if r["fresh_peak_bytes"] is None else r["fresh_peak_bytes"] / GIB),
                 _fmt(None if r["kept_peak_bytes"] is None else r["kept_peak_bytes"] / GIB),
                 _fmt(None if r["arena_bytes"] is None else r["arena_bytes"] / GIB), _fmt(r["peak_ratio"])]
                for r in report["kept_vs_fresh"]]
        parts += ["", "kept arena (Workspace(keep=True)) vs fresh buffers per call (the default), fwd+bwd "
                  "medians; the kept peak counts the arena:", table(cols, rows)]
    if report["max_len"]:
        cols = ["config", "ranks", "model", "max S", "S_local", "peak GiB", "limit GiB", "first failing S",
                "probes", "probe", "stub/real peak"]
        rows = []
        for r in report["max_len"]:
            if "error" in r:
                rows.append([r["config"], r["ranks"], r["model"], f"ERROR: {r['error'][:60]}"] + [None] * 7)
                continue
            model = r["model"] if r["layers"] is None else f"{r['model']} x{r['layers']}"
            rows.append([
                r["config"], r["ranks"], model, r["max_seq_len"], r["max_local_tokens"],
                _fmt(None if r["peak_bytes"] is None else r["peak_bytes"] / GIB, ".2f"),
                _fmt(None if r["limit_bytes"] is None else r["limit_bytes"] / GIB, ".1f"),
                r["first_failing_seq_len"], f"{r['probes']}{'' if r['complete'] else ' (cut)'}", r["probe"],
                _fmt(r["stub_vs_real"]),
            ])
        parts += ["", "longest global sequence whose one-rank forward+backward fits:", table(cols, rows)]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
