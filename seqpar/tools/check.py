"""``python -m seqpar check``: every mode on this cluster's ranks, checked against one device.

Run it on the nodes of a long job before the job, with the job's launcher::

    python -m torch.distributed.run --nproc-per-node 8 -m seqpar check     # NCCL on GPUs, gloo on CPU
    python -m seqpar check --world-size 4                                  # 4 local CPU ranks

Every mode runs forward and backward on the same seeded inputs: the ring with each K/V transport
(``p2p``, ``p2p_serial``, ``allgather``), Ulysses, every ring x Ulysses factorisation of the CP
size, packed sequences (``varlen_attention``), sliding-window and sink masks, ``head_groups=2``,
and a hybrid model's mixers (a gated delta rule head-parallel and by state passing, a causal conv
both ways). Every rank computes the single-device result of the whole inputs itself -- float64
on CPU, float32 on GPUs -- and compares its shard of the output and of dq, dk, dv with it. A mode
is exact when every error is within the dtype's tolerance (``TOLERANCE``, relative to the
largest reference value, at least 1). Times are the median of ``--iters`` forward+backward calls
(the slowest rank's), after the compared call. Then the all-to-all and point-to-point bandwidth
over the group at two message sizes, and a recommended ``ParallelState``: the fastest exact
state mode measured, next to ``seqpar.plan``'s choice for the same shape with the measured links.

Rank 0 prints a table (``--json PATH`` writes the report too); the exit code is 1 when a mode is
not exact or failed, on every rank. The references hold ``S x S`` scores per head: keep
``--seq-len`` at a few thousand tokens (the default); the check is about exactness and links,
``seqpar.plan`` answers for the job's length.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .demo import _DTYPES, _max_err

__all__ = ["add_arguments", "help_description", "run", "compare", "judge", "format_report", "TOLERANCE", "modes"]

# Largest error allowed, relative to max(1, max |reference|), per dtype of the distributed run. The
# reference is float64 (CPU) or float32 (GPU); float32 runs merge in fp32 (DESIGN: ~1e-4), half
# types get flash-attn's order of error at these lengths.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}

# Message bytes per rank of the bandwidth measurements, per device type: a latency-bound size
# and a bandwidth-bound one.
_MESSAGE_BYTES = {"cpu": (64 << 10, 4 << 20), "cuda": (1 << 20, 256 << 20)}


@dataclass
class Config:
    """What every rank runs (picklable: it travels to local ranks)."""

    cp: int | None
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str | None
    device: str
    seed: int
    iters: int
    message_bytes: tuple[int, ...] | None
    timeout_s: float
    only: tuple[str, ...] = ()


def help_description() -> str:
    """This module's docstring as ``--help`` shows it."""
    from .report import plain

    return plain(__doc__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the check's options to ``parser``."""
    parser.add_argument("--world-size", type=int, default=4,
                        help="local CPU ranks to spawn when not started by torchrun (default 4)")
    parser.add_argument("--cp", type=int, default=None,
                        help="CP size to check, dividing the world size (default: the world size; the rest is DP)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="global tokens (default 4096 on GPUs, 512 on CPU; the reference holds S x S scores)")
    parser.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv, dividing H (default 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dim D (default 128 on GPUs, 32 on CPU)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="dtype of the distributed run (default bfloat16 on GPUs, float32 on CPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="under torchrun: cuda:LOCAL_RANK with NCCL when CUDA is available (auto), or gloo "
                        "on CPU; local ranks always run on CPU (default auto)")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per mode, median taken (default 3)")
    parser.add_argument("--message-kib", type=str, default=None,
                        help="bandwidth message sizes per rank in KiB, comma-separated (default 64,4096 on CPU, "
                        "1024,262144 on GPUs)")
    parser.add_argument("--only", metavar="WORDS", default=None,
                        help="run only the modes whose name contains one of these comma-separated words, e.g. "
                        "ring,ulysses (default: every mode)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective waits before the mode fails (default 300)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON to PATH")


# --- the modes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One checked configuration: a state (``ring x ulysses``, K/V transport) and what runs on it.

    ``kind``: ``"dense"`` (``seqpar.attention``, with ``mask``: ``"causal"``, ``"window"`` or
    ``"sinks"``), ``"packed"`` (``varlen_attention``), ``"gdn_heads"`` / ``"gdn_states"`` (a gated
    delta rule head-parallel / by state passing), ``"conv_heads"`` / ``"conv_halo"`` (a causal conv
    head-parallel / with a halo). ``state_mode``: the mode only chooses a state (a candidate for the
    recommendation).
    """

    name: str
    ring: int
    ulysses: int
    ring_comm: str = "p2p"
    kind: str = "dense"
    mask: str = "causal"
    head_groups: int = 1
    state_mode: bool = False

    def constructor(self) -> str:
        args = [f"ring_size={self.ring}", f"ulysses_size={self.ulysses}"]
        if self.ring > 1 and self.ring_comm != "p2p":
            args.append(f"ring_comm={self.ring_comm!r}")
        return f"ParallelState({', '.join(args)})"


def modes(cp: int, heads: int) -> list[Mode]:
    """Every mode checked on a CP group of ``cp`` ranks with ``heads`` query heads: the ring with
    each transport, Ulysses, every hybrid factorisation, then masks, packing, head groups and the
    mixers on the most square hybrid (the ring alone when ``cp`` is prime)."""
    out: list[Mode] = []
    if cp == 1:
        return [Mode("one rank", 1, 1, state_mode=True)]
    for comm in ("p2p", "p2p_serial", "allgather"):
        out.append(Mode(f"ring {comm}", cp, 1, comm, state_mode=True))
    out.append(Mode("ulysses", 1, cp, state_mode=True))
    hybrids = [(r, cp // r) for r in range(2, cp) if cp % r == 0]
    out += [Mode(f"hybrid {r}x{u}", r, u, state_mode=True) for r, u in hybrids]
    r, u = min(hybrids, key=lambda f: abs(f[0] - f[1])) if hybrids else (cp, 1)
    on = f"{r}x{u}"
    out += [
        Mode(f"packed {on}", r, u, kind="packed"),
        Mode(f"window {on}", r, u, mask="window"),
        Mode(f"sinks {on}", r, u, mask="sinks"),
    ]
    if heads >= 2:
        out.append(Mode(f"head_groups=2 {on}", r, u, head_groups=2))
    out += [
        Mode(f"gated delta, head-parallel {on}", r, u, kind="gdn_heads"),
        Mode(f"gated delta, state passing {on}", r, u, kind="gdn_states"),
        Mode(f"causal conv, head-parallel {on}", r, u, kind="conv_heads"),
        Mode(f"causal conv, halo {on}", r, u, kind="conv_halo"),
    ]
    return out


def _selected(cfg: Config) -> list[Mode]:
    """The modes ``--only`` keeps (every mode without it)."""
    every = modes(cfg.cp, cfg.heads)
    return [m for m in every if not cfg.only or any(w in m.name for w in cfg.only)]


def _doc_lens(seq_len: int) -> list[int]:
    """Three packed documents of uneven lengths summing to ``seq_len``."""
    a, b = seq_len // 2 + 1, seq_len // 3
    return [a, b, seq_len - a - b]


def _window(seq_len: int) -> tuple[int, int]:
    return (max(1, seq_len // 5), 0)


def _reference_attention(q, k, v, *, causal: bool, window=(-1, -1), sinks=None, doc_lens=None):
    """Plain softmax attention of whole sequences, ``[B, S, H, D]`` (or packed ``[T, H, D]`` with
    ``doc_lens``): scores, the mask in global positions, the sinks as an extra column."""
    packed = doc_lens is not None
    if packed:
        q, k, v = (t[None] for t in (q, k, v))
    S, H = q.shape[1], q.shape[2]
    rep = H // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    i = torch.arange(S, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    if packed:
        doc = torch.repeat_interleave(torch.arange(len(doc_lens), device=q.device),
                                      torch.tensor(doc_lens, device=q.device))
        start = torch.cumsum(torch.tensor([0, *doc_lens[:-1]], device=q.device), 0)[doc]
        allowed = doc[:, None] == doc[None, :]
        i, j = i - start[:, None], j - start[None, :]  # positions within each document
    else:
        allowed = torch.ones(S, S, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype)[None, :, None, None].expand(scores.shape[0], H, S, 1)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    return out[0] if packed else out


def _inputs(mode: Mode, cfg: Config, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The whole inputs of ``mode``, seeded, drawn in float64 on the CPU (the same numbers on every
    rank and device), then in ``dtype`` on ``device``: ``x`` the differentiable ones, ``extra`` the
    constants (sinks), ``dout`` the output gradient."""
    g = torch.Generator().manual_seed(cfg.seed)
    S, H, Hkv, D = cfg.seq_len, cfg.heads, cfg.kv_heads, cfg.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if mode.kind in ("dense", "packed"):
        lead = (S,) if mode.kind == "packed" else (1, S)
        x = {"q": randn(*lead, H, D), "k": randn(*lead, Hkv, D), "v": randn(*lead, Hkv, D)}
        dout = randn(*lead, H, D)
        extra = {"sinks": randn(H)} if mode.mask == "sinks" else {}
    elif mode.kind.startswith("gdn"):
        dk = min(D, 32)  # the chunked rule solves Dk x Dk systems: keep them small
        x = {"q": randn(1, S, Hkv, dk), "k": randn(1, S, Hkv, dk), "v": randn(1, S, H, dk),
             "g": -torch.rand(1, S, H, generator=g, dtype=torch.float64) * 0.5,  # log decay <= 0
             "beta": torch.rand(1, S, H, generator=g, dtype=torch.float64)}
        extra = {}
        dout = randn(1, S, H, dk)
    else:  # conv: channels H * 4, kernel 4 (the hybrid models' short conv)
        C = H * 4
        x = {"x": randn(1, S, C)}
        extra = {"weight": randn(C, 4) * 0.5, "bias": randn(C)}
        dout = randn(1, S, C)
    move = lambda d: {name: t.to(device, dtype) for name, t in d.items()}  # noqa: E731
    return {"x": move(x), "extra": move(extra), "dout": dout.to(device, dtype)}


def _forward(mode: Mode, state, x: dict, extra: dict, seq_len: int):
    """``mode``'s parallel (``state`` of several ranks) or single-device (size-1 state) output."""
    import seqpar
    from seqpar import mixing

    if mode.kind == "dense":
        window = _window(seq_len) if mode.mask == "window" else (-1, -1)
        return seqpar.attention(x["q"], x["k"], x["v"], state, causal=True, window=window,
                                sinks=extra.get("sinks"), head_groups=mode.head_groups, seq_len=seq_len)
    if mode.kind == "packed":
        return seqpar.varlen_attention(x["q"], x["k"], x["v"], state, _doc_lens(seq_len), causal=True)
    if mode.kind.startswith("gdn"):
        rule = mixing.GatedDeltaRule(use_qk_l2norm=True, chunk_size=16)
        inputs = [x["q"], x["k"], x["v"], x["g"], x["beta"]]
        if mode.kind == "gdn_heads":
            return mixing.recurrence_head_parallel(rule, inputs, state, seq_len=seq_len)[0]
        return mixing.state_passing(rule, inputs, state, seq_len=seq_len)[0][0]
    conv = mixing.causal_conv1d if mode.kind == "conv_heads" else mixing.causal_conv1d_halo
    return conv(x["x"], extra["weight"], extra["bias"], state, activation="silu", seq_len=seq_len)


def _reference(mode: Mode, cfg: Config, device: torch.device) -> dict[str, torch.Tensor]:
    """``mode`` on one device over the whole inputs, float64 on CPU and float32 on GPUs: the output
    and the gradients of the differentiable inputs (``d`` + name)."""
    from seqpar import mixing

    dtype = torch.float64 if device.type == "cpu" else torch.float32
    data = _inputs(mode, cfg, dtype, device)
    x = {name: t.requires_grad_(True) for name, t in data["x"].items()}
    extra = data["extra"]
    if mode.kind in ("dense", "packed"):
        out = _reference_attention(
            x["q"], x["k"], x["v"], causal=True, window=_window(cfg.seq_len) if mode.mask == "window" else (-1, -1),
            sinks=extra.get("sinks"), doc_lens=_doc_lens(cfg.seq_len) if mode.kind == "packed" else None,
        )
    elif mode.kind.startswith("gdn"):  # the rule's own kernel on the whole sequence
        rule = mixing.GatedDeltaRule(use_qk_l2norm=True, chunk_size=16)
        out = rule.kernel([x["q"], x["k"], x["v"], x["g"], x["beta"]], None)[0][0]
    else:
        out = mixing.causal_conv1d_local(x["x"], extra["weight"], extra["bias"], activation="silu")
    out.backward(data["dout"])
    return {"out": out.detach(), **{f"d{name}": t.grad for name, t in x.items()}}


def compare(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], scales: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """``(errors, scales)`` for :func:`judge`: the max absolute error of each tensor of ``got`` against
    the same-named one of ``ref``, and each reference's max absolute value (``scales``: given when
    ``ref`` holds only this rank's shard and the scale is the whole tensor's)."""
    errors = {name: _max_err(got[name], r) for name, r in ref.items()}
    if scales is None:
        scales = {name: r.abs().max().item() if r.numel() else 0.0 for name, r in ref.items()}
    return errors, scales


def judge(errors: dict[str, float], scales: dict[str, float], dtype: torch.dtype) -> tuple[bool, float]:
    """Whether a mode is exact: ``(ok, worst)`` where ``worst`` is the largest ``error / tolerance``
    over the compared tensors (``<= 1``: within tolerance). ``errors``: max absolute error per
    tensor; ``scales``: max absolute reference value per tensor; the tolerance of a tensor is
    ``TOLERANCE[dtype] * max(1, scale)``. A NaN error, or none at all, is not exact."""
    if not errors:
        return False, math.inf
    worst = 0.0
    for name, err in errors.items():
        ratio = err / (TOLERANCE[dtype] * max(1.0, scales.get(name, 1.0)))
        worst = math.inf if math.isnan(ratio) else max(worst, ratio)
    return worst <= 1.0, worst


def _shard(x: torch.Tensor, mode: Mode, state, seq_len: int) -> torch.Tensor:
    import seqpar

    if mode.kind == "packed":
        return seqpar.shard_packed(x, state, _doc_lens(seq_len))
    return seqpar.shard(x, state)


def _run_mode(mode: Mode, cfg: Config, device: torch.device, dtype: torch.dtype) -> dict:
    """Run ``mode`` on every rank: compare the first call with the reference, then time ``iters``
    more. A collective over the default group."""
    import seqpar
    from datetime import timedelta

    from .profiling import median_seconds

    ref = _reference(mode, cfg, device)
    with seqpar.ParallelState(mode.ring, mode.ulysses, ring_comm=mode.ring_comm,
                              timeout=timedelta(seconds=cfg.timeout_s)) as state:
        data = _inputs(mode, cfg, dtype, device)
        x = {name: _shard(t, mode, state, cfg.seq_len).requires_grad_(True) for name, t in data["x"].items()}
        dout = _shard(data["dout"], mode, state, cfg.seq_len)

        def call():
            for t in x.values():
                t.grad = None
            out = _forward(mode, state, x, data["extra"], cfg.seq_len)
            out.backward(dout)
            return out

        out = call()
        got = {"out": out.detach(), **{f"d{name}": t.grad for name, t in x.items()}}
        errors, scales = compare(got, {name: _shard(r, mode, state, cfg.seq_len) for name, r in ref.items()},
                                 {name: r.abs().max().item() if r.numel() else 0.0 for name, r in ref.items()})
        seconds = median_seconds(call, cfg.iters, device, warmup=0)
    return {"errors": errors, "scales": scales, "ms": 1e3 * seconds}


def _bandwidth(device: torch.device, sizes: tuple[int, ...], iters: int, ranks_per_node: int) -> dict:
    """Bytes per second and seconds per call of an all-to-all over the whole group
    (``seqpar.comm.all_to_all``; bytes: what a rank sends to the others) and of a ring step
    (``seqpar.comm.post``: send to the next rank, receive from the previous one, inside a node;
    across nodes too when the group spans several), at each message size per rank."""
    import torch.distributed as dist

    from seqpar.comm import all_to_all, post

    from .profiling import median_seconds

    N, me = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[dict]] = {"all_to_all": [], "p2p": []}
    if N == 1:
        return out
    peers = {}
    first, local = me - me % ranks_per_node, min(ranks_per_node, N)
    if local > 1:
        peers["p2p"] = (first + (me - first + 1) % local, first + (me - first - 1) % local)
    if N > ranks_per_node:
        out["p2p_inter_node"] = []
        peers["p2p_inter_node"] = ((me + ranks_per_node) % N, (me - ranks_per_node) % N)
    for nbytes in sizes:
        n = max(N, nbytes // 4 // N * N)  # fp32 elements, a multiple of N
        x = torch.ones(n, device=device)
        sent = 4 * (n - n // N)
        parts = x.view(N, n // N)  # row j goes to rank j
        s = median_seconds(lambda: all_to_all(parts, None, 0, 1), iters, device)
        out["all_to_all"].append({"bytes": 4 * n, "sent_bytes": sent, "seconds": s, "bytes_per_s": sent / s})
        for link, (dst, src) in peers.items():
            buf = torch.empty_like(x)
            s = median_seconds(lambda: post(None, [(dst, x)], [(src, buf)]).wait(), iters, device)
            out[link].append({"bytes": 4 * n, "seconds": s, "bytes_per_s": 4 * n / s})
        del x
    return out


def _plan(cfg: Config, dtype: torch.dtype, device: torch.device, links: dict, ranks_per_node: int) -> dict | None:
    """``seqpar.plan`` for the checked shape with the preset cost model of the device type, its links
    replaced by the measured ones (latency: the small message's time; bandwidth: the large one's)."""
    from seqpar.planner import CostModel, Link, plan

    def link(rows: list[dict]) -> Link | None:
        if not rows:
            return None
        latency = rows[0]["seconds"] if len(rows) > 1 else 0.0  # one size: all of it counted as bandwidth
        return Link(latency, max(r["bytes_per_s"] for r in rows))

    cost = CostModel.preset("h100" if device.type == "cuda" else "cpu")
    a2a, p2p, inter = link(links["all_to_all"]), link(links["p2p"]), link(links.get("p2p_inter_node", []))
    spans = cfg.cp > ranks_per_node
    changes = {}
    if a2a:
        changes["ulysses_inter" if spans else "ulysses_intra"] = a2a
    if p2p:
        changes["ring_intra"] = p2p
    if inter:
        changes["ring_inter"] = inter
    cost = replace(cost, name=f"{cost.name} with the measured links", **changes)
    choice = plan(cfg.cp, seq_len=cfg.seq_len, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                  causal=True, dtype=dtype, ranks_per_node=min(ranks_per_node, cfg.cp), cost=cost)
    from seqpar.__main__ import _state_arguments

    return {"label": choice.chosen.label(), "constructor": f"ParallelState({_state_arguments(choice.chosen)})",
            "predicted_ms": 1e3 * choice.chosen.time_s, "cost_model": cost.name}


def _rank_main(cfg: Config, ranks_per_node: int) -> dict:
    """Everything one rank does; every rank returns the same report (the mode rows are gathered)."""
    import torch.distributed as dist

    from .bench import _torchrun_device

    device = _torchrun_device(cfg.device) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = _DTYPES[cfg.dtype]
    world = dist.get_world_size()
    rows = []
    for mode in _selected(cfg):
        row = {"mode": mode.name, "state": mode.constructor(), "ring": mode.ring, "ulysses": mode.ulysses,
               "kind": mode.kind, "state_mode": mode.state_mode}
        try:
            row.update(_run_mode(mode, cfg, device, dtype))
            problem = ""
        except Exception as e:  # noqa: BLE001 - reported as this mode's failure; the next modes still run
            problem = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        # Every rank's errors: the mode's verdict is the worst rank's, the same everywhere.
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"problem": problem, "errors": row.get("errors"), "scales": row.get("scales")})
        failed = [f"rank {r}: {g['problem']}" for r, g in enumerate(gathered) if g["problem"]]
        if failed:
            row.update(ok=False, worst=math.inf, errors={}, problem="; ".join(failed[:2]))
        else:
            names = gathered[0]["errors"]
            row["errors"] = {n: max(g["errors"][n] for g in gathered) for n in names}
            row["scales"] = {n: max(g["scales"][n] for g in gathered) for n in names}
            row["ok"], row["worst"] = judge(row["errors"], row["scales"], dtype)
        rows.append(row)
        _say(f"{mode.name}: {'exact' if row['ok'] else 'NOT EXACT' if not failed else 'FAILED'}")
    sizes = cfg.message_bytes or _MESSAGE_BYTES.get(device.type, _MESSAGE_BYTES["cpu"])
    links = _bandwidth(device, sizes, cfg.iters, ranks_per_node)
    try:
        planned = _plan(cfg, dtype, device, links, ranks_per_node)
    except ValueError as e:
        planned = {"error": str(e)}
    from .bench import time_sharing_warning, usable_cores

    notes = [time_sharing_warning(ranks_per_node, usable_cores(), device.type)]
    return {"rows": rows, "bandwidth": links, "plan": planned, "device": str(device.type),
            "backend": dist.get_backend(), "world": world, "notes": [n for n in notes if n]}


def _say(text: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"seqpar check: {text}", file=sys.stderr, flush=True)


def _config(args: argparse.Namespace, gpus: bool, world: int) -> Config:
    def fail(msg: str):
        raise SystemExit(f"seqpar check: {msg}")

    cp = args.cp or world
    if cp < 1 or world % cp:
        fail(f"--cp {args.cp} must be a positive divisor of the {world} ranks (e.g. one of "
             f"{[d for d in range(1, world + 1) if world % d == 0]})")
    seq_len = args.seq_len or (4096 if gpus else 512)
    head_dim = args.head_dim or (128 if gpus else 32)
    for name, value in (("seq-len", seq_len), ("heads", args.heads), ("kv-heads", args.kv_heads),
                        ("head-dim", head_dim), ("iters", args.iters)):
        if value < 1:
            fail(f"--{name} must be >= 1, got {value}")
    if args.heads % args.kv_heads:
        fail(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if seq_len < 4 * cp:
        fail(f"--seq-len {seq_len} is too short for {cp} CP ranks: use at least {4 * cp} (4 tokens per rank, so "
             "that every packed document and zig-zag chunk has some)")
    sizes = None
    if args.message_kib:
        try:
            sizes = tuple(max(1, round(float(s) * 1024)) for s in args.message_kib.split(","))
        except ValueError:
            fail(f"--message-kib: expected sizes like 64,4096, got {args.message_kib!r}")
    cfg = Config(cp, seq_len, args.heads, args.kv_heads, head_dim, args.dtype or ("bfloat16" if gpus else "float32"),
                 args.device, args.seed, args.iters, sizes, args.timeout,
                 tuple(w.strip() for w in (args.only or "").split(",") if w.strip()))
    if not _selected(cfg):
        fail(f"--only {args.only!r} matches none of the modes: {[m.name for m in modes(cp, args.heads)]}")
    return cfg


def _report(result: dict, cfg: Config, wall_s: float) -> dict:
    """The JSON report: the configuration, every mode, the links and the recommendation."""
    rows = result["rows"]
    exact_states = [r for r in rows if r["state_mode"] and r["ok"]]
    fastest = min(exact_states, key=lambda r: r["ms"]) if exact_states else None
    return {
        "config": asdict(cfg),
        "world": result["world"],
        "backend": result["backend"],
        "device": result["device"],
        "ok": all(r["ok"] for r in rows),
        "modes": rows,
        "bandwidth": result["bandwidth"],
        "recommendation": {
            "measured": None if fastest is None else {"mode": fastest["mode"], "constructor": fastest["state"],
                                                      "ms": fastest["ms"]},
            "planner": result["plan"],
        },
        "notes": result.get("notes", []),
        "tolerance": {str(k).removeprefix("torch."): v for k, v in TOLERANCE.items()},
        "wall_s": wall_s,
    }


def _gbps(x: float) -> str:
    return f"{x / 1e9:.3g} GB/s"


def _size(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"


def format_report(report: dict) -> str:
    """The table rank 0 prints."""
    from .report import table

    cfg = report["config"]
    lines = [
        f"seqpar check: {report['world']} ranks ({report['backend']}, {report['device']}), CP {cfg['cp']} "
        f"(DP {report['world'] // cfg['cp']}), S={cfg['seq_len']} H={cfg['heads']} Hkv={cfg['kv_heads']} "
        f"D={cfg['head_dim']}, {cfg['dtype']} against one device in "
        f"{'float64' if report['device'] == 'cpu' else 'float32'}",
    ]
    cols = ("mode", "ring x uly", "|out err|", "|dq err|", "|dk err|", "|dv err|", "err/tol", "ms/call", "")
    body = []
    for r in report["modes"]:
        e = r["errors"]
        grads = [e.get(n) for n in ("dq", "dk", "dv")] if "dq" in e else [e.get("dx"), None, None]
        fmt = lambda v: None if v is None else f"{v:.1e}"  # noqa: E731
        verdict = "exact" if r["ok"] else ("FAILED" if r.get("problem") else "NOT EXACT")
        body.append((r["mode"], f"{r['ring']} x {r['ulysses']}", fmt(e.get("out")),
                     *(fmt(g) for g in grads), f"{r['worst']:.2g}", None if "ms" not in r else f"{r['ms']:.1f}",
                     verdict))
    lines.append(table(cols, body))
    for r in report["modes"]:
        if r.get("problem"):
            lines.append(f"  {r['mode']}: {r['problem']}")
    lines.append("conv modes: |dq err| is the error of dx; gated delta: also dg, dbeta in err/tol. ms/call: "
                 "forward+backward, median of "
                 f"{cfg['iters']} call(s), slowest rank; err/tol <= 1 is exact (tolerance "
                 f"{report['tolerance'][cfg['dtype']]:g} x max(1, max |reference|) for {cfg['dtype']})")
    bw = report["bandwidth"]
    for link, what in (("all_to_all", "all-to-all over the group"), ("p2p", "ring step p2p, inside a node"),
                       ("p2p_inter_node", "ring step p2p, across nodes")):
        if bw.get(link):
            lines.append(f"{what}: " + ", ".join(
                f"{_gbps(m['bytes_per_s'])} at {_size(m['bytes'])} ({1e3 * m['seconds']:.2f} ms)" for m in bw[link]))
    rec = report["recommendation"]
    if rec["measured"]:
        m = rec["measured"]
        lines.append(f"recommended: seqpar.{m['constructor']} -- the fastest exact mode measured ({m['mode']}, "
                     f"{m['ms']:.1f} ms/call)")
    planner = rec["planner"] or {}
    if "constructor" in planner:
        lines.append(f"seqpar.plan for this shape ({planner['cost_model']}): seqpar.{planner['constructor']}, "
                     f"{planner['label']}, predicted {planner['predicted_ms']:.2f} ms/layer; for the job's own "
                     "length: python -m seqpar info --seq-len ...")
    elif planner:
        lines.append(f"seqpar.plan: {planner['error']}")
    lines += report["notes"]
    n_bad = sum(not r["ok"] for r in report["modes"])
    lines.append(f"check: {'OK' if report['ok'] else 'FAILED'} -- {len(report['modes']) - n_bad} of "
                 f"{len(report['modes'])} modes exact; wall {report['wall_s']:.1f}s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the check on this torchrun job's ranks, or on ``--world-size`` local CPU ranks; print the
    table on rank 0 (and write ``--json``). Returns 0 when every mode is exact, else 1."""
    from .bench import Ranks, under_torchrun
    from .report import origin

    torchrun = under_torchrun()
    if torchrun:
        import os

        world = int(os.environ["WORLD_SIZE"])
        gpus = args.device != "cpu" and torch.cuda.is_available()
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        if args.world_size < 1:
            raise SystemExit(f"seqpar check: --world-size must be >= 1, got {args.world_size}")
        world, gpus, ranks_per_node = args.world_size, False, args.world_size
    cfg = _config(args, gpus, world)
    start = time.perf_counter()
    with Ranks(world, device="cuda" if gpus else "cpu", timeout_s=cfg.timeout_s + 60) as ranks:
        if ranks.rank == 0:
            print(f"seqpar check: {origin()}", file=sys.stderr, flush=True)
            if not torchrun:
                _say(f"starting {world} local CPU ranks (each imports torch: seconds)")
        results = ranks.run(_rank_main, cfg, ranks_per_node)
        rank = ranks.rank
    report = _report(results[0], cfg, time.perf_counter() - start)
    if rank == 0:
        print(format_report(report), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
            print(f"wrote {args.json}")
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m seqpar.tools.check``."""
    from .report import HelpFormatter

    parser = argparse.ArgumentParser(prog="python -m seqpar check", description=help_description(),
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
