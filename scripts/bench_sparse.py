"""Benchmark DeepSeek sparse attention on shards: bytes per rank per layer, and time against one device.

Two parts, on ``--world`` ranks (ring ``--ring`` x Ulysses ``world / ring``), with tiny random
transformers models (``seqpar.tools.models.hf_configs``) built with ``attn_implementation=
register(state)`` (docs/sparse-attention.md):

* **bytes per rank per layer** of one forward and backward at ``--lengths`` tokens: every
  ``torch.distributed`` collective of the model call is counted (``CollectiveRecorder``; the model
  check's few ints included) and turned into the bytes a rank sends over a ring of ``N`` ranks
  (an all-gather forwards ``N - 1`` parts of its input's size, a reduce-scatter or all-to-all
  ``(N - 1) / N`` of its input, an all-reduce twice that), the largest over ranks, divided by the
  model's layers. Next to it: the formula of docs/sparse-attention.md for the indexed path
  (the latent and the index key all-gathered, the latent's gradient reduce-scattered) and for
  gathering the expanded keys and values instead (what dense CP would move for the same layer), and
  the same two formulas at DeepSeek-V3.2's own sizes (``--real-len`` tokens over ``--real-cp``
  ranks, bf16).
* **time** of one forward and backward of the sharded model against one device (rank 0 alone on the
  whole sequence, the others waiting) at ``--time-len`` tokens. Slowest rank's median of ``--iters``.

Output: the two tables, notes, then the report as one JSON line (last line); ``--json PATH`` also
writes it to a file.

Run:
    python scripts/bench_sparse.py                        # 4 gloo ranks on the CPU, ~1 minute on 2 cores
    python scripts/bench_sparse.py --lengths 128,512,2048 --time-len 512
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from seqpar import ParallelState, shard, shard_positions
from seqpar.tools.bench import Ranks, few_iterations_warning, time_sharing_warning, usable_cores
from seqpar.tools.profiling import CollectiveRecorder, iteration_seconds, max_over_ranks
from seqpar.tools.report import add_output_arguments, emit, progress, script_parser, table

VOCAB = 97
# DeepSeek-V3.2's attention sizes (its published config): 128 heads, MLA latent 512 + RoPE 64,
# q/k head dim 128 + 64, v head dim 128, indexer head dim 128.
REAL = dict(num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, index_head_dim=128)


def per_layer_bytes(config, seq_len: int, cp: int, elem: int) -> dict[str, float]:
    """Bytes one rank sends per layer, forward + backward, by docs/sparse-attention.md's formulas.

    Indexed path: the forward all-gathers ``kv_lora_rank + qk_rope_head_dim + index_head_dim``
    values per token, the backward reduce-scatters the latent's ``kv_lora_rank + qk_rope_head_dim``
    (the index key has no gradient). Dense CP's gather of the expanded keys and values moves
    ``H * (qk_nope + qk_rope + v_head_dim)`` per token each way. A rank sends its own
    ``S / cp`` tokens to each of the ``cp - 1`` others (all-gather) and receives as much back in the
    backward's reduce-scatter: ``(cp - 1) / cp * S`` tokens per direction.
    """
    get = (lambda k: config[k]) if isinstance(config, dict) else (lambda k: getattr(config, k))
    tokens = (cp - 1) / cp * seq_len
    latent = get("kv_lora_rank") + get("qk_rope_head_dim")
    indexed = tokens * (latent + get("index_head_dim") + latent) * elem
    heads = get("num_attention_heads") * (get("qk_nope_head_dim") + get("qk_rope_head_dim") + get("v_head_dim"))
    return {"indexed": indexed, "full_kv": 2 * tokens * heads * elem}


def wire_bytes(rec: CollectiveRecorder, n: int) -> float:
    """Bytes one rank sends for the collectives ``rec`` counted, over a ring of ``n`` ranks (the
    recorder holds what each call was handed: an all-gather's local part, a reduce-scatter's
    whole input)."""
    per = {"all_gather_single": n - 1, "all_gather_into_tensor": n - 1, "all_gather": n - 1,
           "reduce_scatter_single": (n - 1) / n, "reduce_scatter_tensor": (n - 1) / n,
           "all_to_all_single": (n - 1) / n, "all_reduce": 2 * (n - 1) / n, "batch_isend_irecv": 1.0}
    return sum(b * per.get(name, 1.0) for name, b in rec.bytes.items())


def _build(family: str, attn: str, topk: int):
    from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config

    torch.manual_seed(0)
    extra = dict(indexer_types=["full", "shared"]) if family == "glm_moe_dsa" else {}
    config = tiny_hf_config(family, vocab_size=VOCAB, index_topk=topk, **extra)
    return causal_lm_class(family)._from_config(config, attn_implementation=attn, experts_implementation="eager").eval()


def _step(model, ids: torch.Tensor, state: ParallelState | None) -> None:
    """One forward and backward: sharded with ``state``, else the whole sequence on this process."""
    if state is None:
        logits = model(input_ids=ids, use_cache=False).logits
    else:
        S = ids.shape[1]
        logits = model(input_ids=shard(ids, state), position_ids=shard_positions(S, state)[None], use_cache=False).logits
    logits.float().square().mean().backward()


def _ids(S: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(S))


def bench(args: argparse.Namespace) -> dict:
    from seqpar.integrations.transformers import register

    torch.set_num_threads(1)
    world = dist.get_world_size()
    state = ParallelState(args.ring, world // args.ring)
    name = register(state, name="seqpar-bench-sparse")
    cpu = torch.device("cpu")
    rows, times = [], []
    try:
        for family in args.families:
            model = _build(family, name, args.topk)
            layers = model.config.num_hidden_layers
            for S in args.lengths:
                progress("bench_sparse", f"bytes: {family} S={S}")
                with CollectiveRecorder() as rec:
                    _step(model, _ids(S), state)
                sent = max_over_ranks([wire_bytes(rec, state.cp_size)], cpu)[0]
                formula = per_layer_bytes(model.config, S, state.cp_size, 4)
                rows.append({"family": family, "seq_len": S, "measured_bytes": sent / layers,
                             "indexed_bytes": formula["indexed"], "full_kv_bytes": formula["full_kv"]})
            progress("bench_sparse", f"time: {family} S={args.time_len}")
            ids = _ids(args.time_len)
            if dist.get_rank() == 0:
                one = _build(family, "sdpa", args.topk)
                t_one = statistics.median(iteration_seconds(lambda: _step(one, ids, None), args.iters, cpu, barrier=False))
            else:
                t_one = 0.0
            dist.barrier()
            t_cp = statistics.median(iteration_seconds(lambda: _step(model, ids, state), args.iters, cpu))
            t_one, t_cp = max_over_ranks([t_one, t_cp], cpu)
            times.append({"family": family, "seq_len": args.time_len, "one_device_s": t_one, "sharded_s": t_cp})
    finally:
        state.close()
    return {"bytes": rows, "times": times}


def _report(result: dict, world: int, args: argparse.Namespace, ranks_per_node: int) -> None:
    kib = [[r["family"], r["seq_len"], f"{r['measured_bytes'] / 1024:.1f}", f"{r['indexed_bytes'] / 1024:.1f}",
            f"{r['full_kv_bytes'] / 1024:.1f}", f"{r['full_kv_bytes'] / max(r['measured_bytes'], 1):.1f}"]
           for r in result["bytes"]]
    real = per_layer_bytes(REAL, args.real_len, args.real_cp, 2)
    tm = [[r["family"], r["seq_len"], f"{r['one_device_s'] * 1e3:.1f}", f"{r['sharded_s'] * 1e3:.1f}",
           f"{r['one_device_s'] / r['sharded_s']:.2f}"] for r in result["times"]]
    ulysses = world // args.ring
    text = "\n".join([
        f"DeepSeek sparse attention over ring {args.ring} x ulysses {ulysses} ({world} gloo ranks, fp32, tiny models, "
        f"top-k {args.topk})",
        "bytes sent per rank per layer (forward + backward, largest over ranks); formulas: docs/sparse-attention.md",
        table(["family", "S", "measured KiB", "indexed formula KiB", "full K/V formula KiB", "full K/V / measured"], kib),
        "",
        f"DeepSeek-V3.2 sizes, bf16, S {args.real_len}, cp {args.real_cp}: indexed {real['indexed'] / 2**20:.1f} MiB, "
        f"full K/V {real['full_kv'] / 2**20:.1f} MiB per rank per layer ({real['full_kv'] / real['indexed']:.0f}x)",
        "",
        f"one forward + backward, ms (slowest rank's median of {args.iters}); speedup = one device / sharded",
        table(["family", "S", "one device", "sharded", "speedup"], tm),
    ])
    notes = [
        time_sharing_warning(ranks_per_node, usable_cores(), "cpu"),
        few_iterations_warning(args.iters),
        "glm_moe_dsa's shared layers reuse the previous layer's selection and gather no index key: "
        "its measured bytes sit below the formula, which counts one per layer",
        "the sharded compute is the modeling file's dense-masked path over all S keys for the local queries "
        "(docs/sparse-attention.md): the time shows the transport, not a sparse kernel",
    ]
    report = {"world_size": world, "ring_size": args.ring, "ulysses_size": ulysses, "topk": args.topk,
              "iters": args.iters, "cpu_cores": usable_cores(),
              "real": {"seq_len": args.real_len, "cp": args.real_cp, "indexed_bytes": real["indexed"],
                       "full_kv_bytes": real["full_kv"]}, **result}
    emit(report, text, notes, args.json)


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--world", type=int, default=4, help="local gloo ranks to spawn (ignored under torchrun)")
    p.add_argument("--ring", type=int, default=2, help="ring size; Ulysses gets world / ring")
    p.add_argument("--families", default="deepseek_v32,glm_moe_dsa", help="model types, comma-separated")
    p.add_argument("--lengths", default="128,512,2048", help="sequence lengths of the bytes sweep")
    p.add_argument("--time-len", type=int, default=512, help="tokens of the timed step")
    p.add_argument("--topk", type=int, default=16, help="the indexer's top-k")
    p.add_argument("--iters", type=int, default=3, help="timed steps; the median is reported")
    p.add_argument("--real-len", type=int, default=131072, help="tokens of the DeepSeek-V3.2-sized formula row")
    p.add_argument("--real-cp", type=int, default=8, help="CP ranks of the DeepSeek-V3.2-sized formula row")
    add_output_arguments(p, "unused")
    args = p.parse_args()
    args.lengths = [int(v) for v in args.lengths.split(",")]
    args.families = args.families.split(",")
    if args.world % args.ring:
        raise SystemExit(f"--ring {args.ring} must divide --world {args.world}")
    with Ranks(args.world, timeout_s=900) as ranks:
        result = ranks.run(bench, args)[0]
        if ranks.rank == 0:
            _report(result, ranks.world, args, ranks.ranks_per_node)


if __name__ == "__main__":
    main()
