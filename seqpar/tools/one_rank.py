"""One rank of a ring x Ulysses run, alone in one process: its kernels, buffers and memory.

Note [One-rank runs]
~~~~~~~~~~~~~~~~~~~~
To measure what one GPU of an ``R x U`` job does without ``R * U`` GPUs, this module runs rank
``cp_rank`` of that job in a process of its own, over torch's *fake* process group
(``torch.testing._internal.distributed.fake_pg``: ``init_process_group("fake", store=FakeStore(),
rank=cp_rank, world_size=R * U)``). Every collective returns at once without a peer; in torch 2.13
the fake group also "hallucinates" data locally: ``all_to_all_single`` copies this rank's own
chunks into every output block and ``all_gather_*`` replicates the input, while point-to-point
receives leave their buffers untouched. So the rank runs exactly the code of a real run: the
same plan, the same kernel calls on the same shapes, the same staging copies, workspace buffers,
accumulators and saved tensors -- only the numbers are meaningless (received K/V hold whatever
the buffer held) and no time is spent waiting for the network.

What that measures, and what it does not:

- **time** of the rank's forward and backward: its compute (kernels, LSE merges, staging copies,
  launch gaps) with communication free; a real run adds the transfer time the ring's overlap
  does not hide and the all-to-all time. CUDA events on a GPU, ``perf_counter`` on the CPU;
  median of ``iters`` after ``warmup`` iterations;
- **FLOPs** of the rank, from the plan (``seqpar.placement.cost``, Note [Plan cost]): ``4 * D``
  per attended (query, key, head) triple forward, ``2.5x`` that backward (the flash-attn
  convention), so TFLOP/s count useful work only;
- **efficiency**: (rank FLOPs / rank time) / (monolithic FLOPs / monolithic time), where the
  monolithic reference is ONE call of the same backend's forward and backward on a dense block
  whose (causal, if the run is causal) pairs equal the rank's pairs per head, with the rank's
  heads. 1.0 means the rank's fragmented ring work runs as fast per FLOP as one big kernel;
- **memory**: ``torch.cuda.max_memory_allocated`` over one forward+backward on a GPU (all live
  tensors: inputs, workspace, the call's own), on the CPU ``seqpar.tools.profiling.StorageTracker``'s
  peak of storage created in the call plus the bytes alive before it;
- **kernel calls** and **collectives** (count and bytes) of one forward+backward, recorded by
  wrappers (the test suite checks the kernel calls against a real multi-rank gloo run).

Cross-rank checks must not read fake data: the states are built with ``checks="never"`` and the
calls pass ``seq_len`` (dense) or ``seq_lens`` (packed), so that no call exchanges its lengths
(Note [Global length] in ``seqpar.prepare``); the run records every all-gather and warns if
one happened.

``init_process_group`` is once per process, so :func:`run_one_rank` (and :func:`run_tasks`)
start a fresh Python process, send it the tasks as JSON and read one JSON line per finished
task; a child that dies or overruns its time is restarted for the tasks after the failed one.
``python -m seqpar.tools.one_rank --help`` is the command-line form.

Longest sequence (:class:`MaxLenSearch`): a probe runs one forward+backward at global length
``S`` and fails on ``torch.cuda.OutOfMemoryError`` (or, with ``memory_limit_bytes``, when the
measured peak exceeds it); lengths double until a probe fails, then bisect to ``granule``
tokens per rank. At the lengths that fill a GPU, a real forward+backward of one rank takes
minutes (quadratic FLOPs), so the default probe is ``"stub"``: the attention kernels are
replaced by allocations of their outputs plus their measured scratch -- each kernel method's
transient bytes above its outputs, fitted as ``c0 + a * Sq + b * Sk`` from real calls at three
small shapes on the same device -- and everything else (seqpar's buffers, copies, saved
tensors, the layer's matmuls) runs for real. The result reports the stub's peak next to the
real peak at a small length (``stub_vs_real``), which checks the model on the device.
``probe="real"`` runs the real kernels (exact, slow). Dense attention only.

``model="llama_layer"`` wraps the attention in a Llama-shaped decoder layer (RMSNorm, q/k/v/o
projections, SwiGLU MLP; no rotary embedding, which only adds elementwise temporaries) run
under activation checkpointing; ``layers=L`` additionally keeps ``L - 1`` layer inputs
``[B, S_local, hidden]`` alive, as the checkpoints of the other layers of an L-layer model
would be (their weights, the embeddings, logits and optimizer state are not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..placement.cost import kernel_flops, square_pairs
from .profiling import CollectiveRecorder, PeakMemory, PhaseTimer, sync

__all__ = [
    "OneRankConfig",
    "MaxLenSearch",
    "run_one_rank",
    "search_max_seq_len",
    "run_tasks",
    "measure",
    "max_seq_len",
    "fake_world",
    "mixed_doc_lens",
    "rank_work",
    "instrument",
]

_MARK = "SEQPAR_ONE_RANK "  # prefix of the child's result lines
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
Model = Literal["attention", "llama_layer"]


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class OneRankConfig:
    """One rank (``cp_rank``) of a ring ``R`` x Ulysses ``U`` run over ``seq_len`` global tokens.

    Attributes:
        ring, ulysses: ``R`` and ``U``; the job has ``R * U`` ranks.
        seq_len: global tokens ``S`` (packed: ``T``, the sum of ``doc_lens``).
        cp_rank: the rank this process plays (``ring_rank * U + ulysses_rank``).
        heads, kv_heads, head_dim, batch: ``H``, ``Hkv``, ``D``, ``B`` (packed: ``B = 1``).
        dtype: ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"float64"``.
        device: ``"cuda"``, ``"cpu"`` or ``"auto"`` (CUDA when available).
        causal: causal attention.
        varlen: packed documents (``seqpar.varlen_attention``) instead of one dense sequence.
        doc_lens: the packed documents' lengths; ``None``: :func:`mixed_doc_lens` of ``seq_len``.
        backend: the attention backend name (``"auto"``, ``"torch_flash"``, ``"cpu"``, ...).
        model: ``"attention"`` (the call alone) or ``"llama_layer"`` (module docstring).
        hidden, mlp, layers, checkpoint: the decoder layer's width (default ``heads *
            head_dim``), MLP width, the layer count whose inputs stay alive, and activation
            checkpointing (``llama_layer`` only).
        warmup, iters: untimed and timed forward+backward iterations.
        monolithic: also time the equal-FLOP single kernel call (efficiency).
        memory: measure peak memory in an extra iteration.
        threads: CPU threads (``torch.set_num_threads``); ``None`` leaves torch's default.
        keep_workspace: the state keeps one arena for later calls (``seqpar.comm.Workspace(keep=
            True)``, Note [Workspace]) instead of fresh buffers per call (the default).
        seed: of the random inputs (and of the default document lengths).
    """

    ring: int
    ulysses: int
    seq_len: int
    cp_rank: int = 0
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 1
    dtype: str = "bfloat16"
    device: str = "auto"
    causal: bool = True
    varlen: bool = False
    doc_lens: tuple[int, ...] | None = None
    backend: str = "auto"
    model: Model = "attention"
    hidden: int | None = None
    mlp: int = 14336
    layers: int = 1
    checkpoint: bool = True
    warmup: int = 1
    iters: int = 3
    monolithic: bool = True
    memory: bool = True
    threads: int | None = None
    keep_workspace: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.doc_lens is not None:
            object.__setattr__(self, "doc_lens", tuple(int(n) for n in self.doc_lens))
        self.validate()

    @property
    def cp_size(self) -> int:
        return self.ring * self.ulysses

    def validate(self) -> None:
        """Raises ``ValueError`` naming the bad field and its valid values."""
        where = "OneRankConfig"
        for name in ("ring", "ulysses", "seq_len", "heads", "kv_heads", "head_dim", "batch", "mlp", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"{where}: cp_rank={self.cp_rank} is not a rank of ring {self.ring} x ulysses {self.ulysses} "
                f"(valid: 0..{self.cp_size - 1})"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"{where}: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"{where}: dtype={self.dtype!r}; valid: {sorted(_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"{where}: device={self.device!r}; valid: 'auto', 'cpu', 'cuda'")
        if self.model not in ("attention", "llama_layer"):
            raise ValueError(f"{where}: model={self.model!r}; valid: 'attention', 'llama_layer'")
        if self.varlen and self.batch != 1:
            raise ValueError(f"{where}: packed (varlen) runs have batch 1, got batch={self.batch}")
        if self.varlen and self.model != "attention":
            raise ValueError(f"{where}: model={self.model!r} runs dense attention; use varlen=False")
        if self.doc_lens is not None:
            if not self.varlen:
                raise ValueError(f"{where}: doc_lens is for packed runs; set varlen=True")
            if sum(self.doc_lens) != self.seq_len or min(self.doc_lens, default=0) < 0:
                raise ValueError(
                    f"{where}: doc_lens must be non-negative and sum to seq_len={self.seq_len}, "
                    f"got {len(self.doc_lens)} lengths summing to {sum(self.doc_lens)}"
                )
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(f"{where}: need warmup >= 0 and iters >= 1, got {self.warmup}, {self.iters}")
        if self.hidden is not None and self.hidden < 1:
            raise ValueError(f"{where}: hidden must be positive, got {self.hidden}")

    def documents(self) -> tuple[int, ...]:
        """The packed documents' lengths (``doc_lens`` or the default mix)."""
        return self.doc_lens if self.doc_lens is not None else tuple(mixed_doc_lens(self.seq_len, self.seed))

    def label(self) -> str:
        mode = "packed" if self.varlen else "dense"
        return f"{self.ring}x{self.ulysses} {mode} S={self.seq_len} cp_rank={self.cp_rank}"

    @staticmethod
    def from_dict(d: dict) -> OneRankConfig:
        names = {f.name for f in dataclasses.fields(OneRankConfig)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"OneRankConfig: unknown fields {unknown}; valid: {sorted(names)}")
        return OneRankConfig(**d)


@dataclass(frozen=True)
class MaxLenSearch:
    """The longest global length whose one-rank forward+backward fits (module docstring).

    Attributes:
        config: the rank to probe (its ``seq_len`` is ignored; dense attention only).
        probe: ``"stub"`` (kernels replaced by calibrated allocations) or ``"real"``.
        memory_limit_bytes: fail a probe whose peak exceeds this (on CUDA also caps the
            allocator with ``set_per_process_memory_fraction``); ``None``: the device's memory
            (on the CPU a limit is required).
        granule: resolution, in tokens per rank (``S`` moves in steps of ``granule * R * U``).
        start: first length probed, tokens per rank.
        max_probes: stop after this many probes (the result then says so).
        check_tokens: tokens per rank of the stub-versus-real peak check (``probe="stub"``).
    """

    config: OneRankConfig
    probe: Literal["stub", "real"] = "stub"
    memory_limit_bytes: int | None = None
    granule: int = 1024
    start: int = 8192
    max_probes: int = 40
    check_tokens: int = 4096

    def __post_init__(self) -> None:
        where = "MaxLenSearch"
        if self.probe not in ("stub", "real"):
            raise ValueError(f"{where}: probe={self.probe!r}; valid: 'stub', 'real'")
        if self.config.varlen:
            raise ValueError(f"{where}: the search runs dense attention; use a config with varlen=False")
        if self.granule < 1 or self.start < 1 or self.max_probes < 2 or self.check_tokens < 1:
            raise ValueError(f"{where}: need granule >= 1, start >= 1, max_probes >= 2, check_tokens >= 1")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise ValueError(f"{where}: memory_limit_bytes must be positive, got {self.memory_limit_bytes}")


def mixed_doc_lens(total: int, seed: int = 0, shortest: int = 128, longest: int | None = None) -> list[int]:
    """Deterministic document lengths summing to ``total``: log-uniform between ``shortest`` and
    ``longest`` (default ``max(shortest, total // 4)``), the last one taking the remainder."""
    rng = random.Random(seed)
    longest = max(shortest, total // 4) if longest is None else longest
    out: list[int] = []
    left = total
    while left > 0:
        n = int(math.exp(rng.uniform(math.log(shortest), math.log(max(shortest, longest)))))
        n = min(max(1, n), left)
        out.append(n)
        left -= n
    return out


# ---------------------------------------------------------------------------------------------
# Plan figures (host maths)


def rank_work(config: OneRankConfig) -> dict:
    """The rank's share of the work: tokens, heads and attended pairs, and its FLOPs.

    ``pairs`` counts (query, key, head) triples of the rank's query heads over its ring-local
    queries, times the batch; forward FLOPs are ``4 * D * pairs``, backward ``2.5x`` that
    (``seqpar.placement.cost.plan_costs``, Note [Plan cost]).
    """
    from ..placement import Mask, Placement
    from ..placement.cost import plan_costs
    from ..placement.heads import head_assignments

    R, U = config.ring, config.ulysses
    if config.varlen:
        docs = config.documents()
        placement = Placement.packed(docs, R, U)
        mask = Mask(config.causal).normalised(max(docs, default=0))
    else:
        placement = Placement.dense(config.seq_len, R, U)
        mask = Mask(config.causal).normalised(config.seq_len)
    costs = plan_costs(placement, mask, config.heads, config.kv_heads, config.head_dim, batch=config.batch,
                       element_size=_DTYPES[config.dtype].itemsize)
    heads = head_assignments(config.heads, config.kv_heads, U)[config.cp_rank % U]
    mine = costs[config.cp_rank]
    pairs = [c.pairs for c in costs]
    return {
        "local_tokens": placement.shard_lengths[config.cp_rank],
        "ring_local_tokens": placement.ring_lengths[config.cp_rank // U],
        "heads": heads.q_len,
        "kernel_kv_heads": heads.kernel_kv_heads if heads.q_len else 0,
        "pairs": mine.pairs,
        "fwd_flops": mine.fwd_flops,
        "bwd_flops": mine.bwd_flops,
        "pairs_max_over_mean": max(pairs) * len(pairs) / max(1, sum(pairs)),
    }


# ---------------------------------------------------------------------------------------------
# The fake world


@contextmanager
def fake_world(world_size: int, rank: int, device: torch.device | None = None) -> Iterator[None]:
    """``torch.distributed`` initialised with torch's fake process group as rank ``rank`` of
    ``world_size`` for the block (Note [One-rank runs]); destroyed at exit.

    Raises:
        RuntimeError: a process group is already initialised, or this torch has no fake group.
    """
    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is already initialised in this process")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # pragma: no cover - torch without the fake group
        raise RuntimeError(f"fake_world: this torch ({torch.__version__}) has no fake process group: {e}") from e
    if device is not None and device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # a bare "cuda" keeps the current device (torch 2.11 refuses it here)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Instrumented and stub backends


_KINDS = ("forward", "backward", "varlen_forward", "varlen_backward")


def instrument(inner, device: torch.device, scratch: dict | None = None):
    """A backend of ``inner``'s class that counts (and times) its top-level kernel calls.

    Attributes of the result: ``counts`` (calls per kind: ``forward``, ``backward``,
    ``varlen_forward``, ``varlen_backward``; a varlen backward "into" counts as a varlen
    backward; nested calls, e.g. the CPU varlen path's dense calls, count once), ``calls`` (the
    forward calls' shapes: ``("dense", q shape, k shape, window)`` or ``("varlen", q shape, k
    shape, packing, window)``), ``seconds()`` (kernel time per kind since the last ``reset()``;
    CUDA events on a GPU), ``total_seconds()`` and ``reset()``.

    ``scratch`` (the stub probe of Note [One-rank runs]): instead of running a kernel, allocate
    its outputs (``torch.empty``) and, for a moment, its transient bytes ``c0 + a * Sq + b * Sk``
    with ``scratch[kind] = (c0, a, b)``.
    """
    base = type(inner)

    class Instrumented(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.counts = dict.fromkeys(_KINDS, 0)
            self.calls: list[tuple] = []
            self._elapsed = dict.fromkeys(_KINDS, 0.0)
            self._events: list[tuple[str, Any, Any]] = []
            self._depth = 0

        def reset(self) -> None:
            self.seconds()
            self.counts = dict.fromkeys(_KINDS, 0)
            self.calls = []
            self._elapsed = dict.fromkeys(_KINDS, 0.0)

        def total_seconds(self) -> float:
            return sum(self.seconds().values())

        def seconds(self) -> dict[str, float]:
            if self._events:
                torch.cuda.synchronize(device)
                for kind, start, end in self._events:
                    self._elapsed[kind] += start.elapsed_time(end) / 1e3
                self._events = []
            return dict(self._elapsed)

        def _call(self, kind: str, fn: Callable[[], Any], stub: Callable[[], Any], sq: int, sk: int) -> Any:
            self._depth += 1
            try:
                if self._depth > 1:
                    return fn()
                self.counts[kind] += 1
                if scratch is not None:
                    c0, a, b = scratch.get(kind, (0, 0, 0))
                    transient = int(c0 + a * sq + b * sk)
                    if transient > 0:  # allocated next to the outputs, then freed: the kernel's peak
                        tmp = torch.empty(transient, dtype=torch.uint8, device=device)
                        del tmp
                    return stub()
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = fn()
                    end.record()
                    self._events.append((kind, start, end))
                    return out
                t0 = time.perf_counter()
                out = fn()
                self._elapsed[kind] += time.perf_counter() - t0
                return out
            finally:
                self._depth -= 1

        def kernel_forward(self, q, k, v, **kw):
            if self._depth == 0:
                self.calls.append(("dense", tuple(q.shape), tuple(k.shape), kw["window"]))

            def stub():
                B, S, H, _ = q.shape
                return q.new_empty((B, S, H, v.shape[-1])), torch.empty((B, H, S), dtype=_lse(q), device=q.device)

            return self._call("forward", lambda: base.kernel_forward(self, q, k, v, **kw), stub,
                              q.shape[0] * q.shape[1], k.shape[0] * k.shape[1])

        def kernel_backward(self, dout, q, k, v, out, lse, **kw):
            return self._call("backward", lambda: base.kernel_backward(self, dout, q, k, v, out, lse, **kw),
                              lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
                              q.shape[0] * q.shape[1], k.shape[0] * k.shape[1])

        def kernel_varlen_forward(self, q, k, v, packing, **kw):
            if self._depth == 0:
                self.calls.append(("varlen", tuple(q.shape), tuple(k.shape), packing, kw["window"]))

            def stub():
                T, H, _ = q.shape
                return q.new_empty((T, H, v.shape[-1])), torch.empty((H, T), dtype=_lse(q), device=q.device)

            return self._call("varlen_forward", lambda: base.kernel_varlen_forward(self, q, k, v, packing, **kw),
                              stub, q.shape[0], k.shape[0])

        def kernel_varlen_backward(self, dout, q, k, v, out, lse, packing, **kw):
            return self._call(
                "varlen_backward", lambda: base.kernel_varlen_backward(self, dout, q, k, v, out, lse, packing, **kw),
                lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)), q.shape[0], k.shape[0],
            )

        def kernel_varlen_backward_into(self, grads, dout, q, k, v, out, lse, packing, **kw):
            return self._call(
                "varlen_backward",
                lambda: base.kernel_varlen_backward_into(self, grads, dout, q, k, v, out, lse, packing, **kw),
                lambda: None, q.shape[0], k.shape[0],
            )

    Instrumented.__name__ = Instrumented.__qualname__ = f"Instrumented{base.__name__}"
    return Instrumented()


def _is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the device running out of memory (also when autograd re-raised it)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def _lse(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Measuring one rank (in a process whose fake world is initialised)


def _device(config: OneRankConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("OneRankConfig: device='cuda' but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _DecoderLayer(nn.Module):
    """A Llama-shaped decoder layer around ``seqpar.attention`` (no rotary embedding)."""

    def __init__(self, config: OneRankConfig, state, backend) -> None:
        super().__init__()
        hidden = config.hidden or config.heads * config.head_dim
        H, Hkv, D = config.heads, config.kv_heads, config.head_dim
        self.config, self.state, self.backend = config, state, backend
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, H * D, bias=False)
        self.k = nn.Linear(hidden, Hkv * D, bias=False)
        self.v = nn.Linear(hidden, Hkv * D, bias=False)
        self.o = nn.Linear(H * D, hidden, bias=False)
        self.gate = nn.Linear(hidden, config.mlp, bias=False)
        self.up = nn.Linear(hidden, config.mlp, bias=False)
        self.down = nn.Linear(config.mlp, hidden, bias=False)

    def _forward(self, x: Tensor) -> Tensor:
        c = self.config
        B, S = x.shape[:2]
        h = self.norm1(x)
        q = self.q(h).view(B, S, c.heads, c.head_dim)
        k = self.k(h).view(B, S, c.kv_heads, c.head_dim)
        v = self.v(h).view(B, S, c.kv_heads, c.head_dim)
        from ..attention import attention

        a = attention(q, k, v, self.state, causal=c.causal, seq_len=c.seq_len, backend=self.backend)
        x = x + self.o(a.reshape(B, S, -1))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    def forward(self, x: Tensor) -> Tensor:
        if self.config.checkpoint:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class _Rank:
    """The tensors and the step of one rank (inputs on the device, backend instrumented)."""

    def __init__(self, config: OneRankConfig, device: torch.device, state, backend) -> None:
        from ..placement import Placement

        self.config, self.device, self.state, self.backend = config, device, state, backend
        dtype = _DTYPES[config.dtype]
        gen = torch.Generator(device=device).manual_seed(config.seed * 7919 + config.cp_rank)
        R, U, c = config.ring, config.ulysses, config.cp_rank

        def rand(*shape: int) -> Tensor:
            return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

        self.extra: list[Tensor] = []
        self.layer: _DecoderLayer | None = None
        if config.varlen:
            self.docs = config.documents()
            n = Placement.packed(self.docs, R, U).shard_lengths[c]
            shapes = [(n, config.heads), (n, config.kv_heads), (n, config.kv_heads), (n, config.heads)]
            self.inputs = [rand(*s, config.head_dim) for s in shapes]
        else:
            n = Placement.dense(config.seq_len, R, U).shard_lengths[c]
            if config.model == "llama_layer":
                hidden = config.hidden or config.heads * config.head_dim
                torch.manual_seed(config.seed)
                with torch.device(device):
                    self.layer = _DecoderLayer(config, state, backend).to(dtype=dtype)
                self.inputs = [rand(config.batch, n, hidden), rand(config.batch, n, hidden)]
                # The checkpoints of the model's other layers (Note [One-rank runs]).
                self.extra = [rand(config.batch, n, hidden) for _ in range(config.layers - 1)]
            else:
                B = config.batch
                shapes = [(B, n, config.heads), (B, n, config.kv_heads), (B, n, config.kv_heads), (B, n, config.heads)]
                self.inputs = [rand(*s, config.head_dim) for s in shapes]
        self.local_tokens = n
        self.leaves = self.inputs[:-1]
        for t in self.leaves:
            t.requires_grad_()

    def forward(self) -> Tensor:
        from ..attention import attention, varlen_attention

        c = self.config
        for t in self.leaves:
            t.grad = None
        if self.layer is not None:
            return self.layer(self.leaves[0])
        q, k, v = self.leaves
        if c.varlen:
            return varlen_attention(q, k, v, self.state, self.docs, causal=c.causal, backend=self.backend)
        return attention(q, k, v, self.state, causal=c.causal, seq_len=c.seq_len, backend=self.backend)

    def step(self) -> None:
        self.forward().backward(self.inputs[-1])

    def live_bytes(self) -> int:
        """Bytes alive outside a call: inputs, other layers' inputs, parameters, workspace."""
        n = sum(t.numel() * t.element_size() for t in [*self.inputs, *self.extra])
        if self.layer is not None:
            n += sum(p.numel() * p.element_size() for p in self.layer.parameters())
        return n + self.state.workspace.nbytes


def _median_ms(values: Sequence[float]) -> float:
    return 1e3 * statistics.median(values)


def _timed(rank: _Rank, iters: int) -> dict[str, list[float]]:
    """Per iteration: forward and backward seconds (device time), their kernel seconds (the
    instrumented backend's) and the wall seconds of the whole iteration."""
    device, backend = rank.device, rank.backend
    out: dict[str, list[float]] = {"fwd": [], "bwd": [], "kernel_fwd": [], "kernel_bwd": [], "wall": []}

    def kernel_split() -> tuple[float, float]:
        s = backend.seconds()
        return s["forward"] + s["varlen_forward"], s["backward"] + s["varlen_backward"]

    timer = PhaseTimer(device, events=True)  # CUDA events on a GPU, perf_counter on the CPU
    for _ in range(iters):
        sync(device)
        k0 = kernel_split()
        t0 = time.perf_counter()
        timer.start()
        y = rank.forward()
        timer.mark()
        y.backward(rank.inputs[-1])
        fwd, bwd = timer.stop()
        out["wall"].append(time.perf_counter() - t0)
        k1 = kernel_split()
        out["fwd"].append(fwd)
        out["bwd"].append(bwd)
        out["kernel_fwd"].append(k1[0] - k0[0])
        out["kernel_bwd"].append(k1[1] - k0[1])
        del y
    return out


def _peak_memory(rank: _Rank) -> dict:
    """Peak bytes over one forward+backward (see Note [One-rank runs])."""
    device = rank.device
    gc.collect()
    before = None if device.type == "cuda" else rank.live_bytes()
    with PeakMemory(device) as mem:
        rank.step()
    if device.type == "cuda":
        before = mem.start_bytes
        return {"peak_bytes": before + mem.peak, "in_call_peak_bytes": mem.peak, "before_call_bytes": before,
                "measured_by": "torch.cuda.max_memory_allocated"}
    return {"peak_bytes": before + mem.peak, "in_call_peak_bytes": mem.peak, "before_call_bytes": before,
            "measured_by": "seqpar.tools.profiling.StorageTracker (+ bytes alive before the call)"}


def _monolithic(config: OneRankConfig, work: dict, inner, device: torch.device) -> dict | None:
    """One dense call of ``inner`` (forward + backward) with the rank's heads and its pairs."""
    if not work["pairs"] or not work["heads"]:
        return None
    B, H, Hkv, D = config.batch, work["heads"], work["kernel_kv_heads"], config.head_dim
    per_head = work["pairs"] // (B * H)
    # The block whose pairs match (square_pairs: causal s (s + 1) / 2, non-causal s^2).
    s = max(1, round((math.sqrt(8 * per_head + 1) - 1) / 2)) if config.causal else max(1, round(math.sqrt(per_head)))
    pairs = B * H * square_pairs(s, config.causal)
    dtype = _DTYPES[config.dtype]
    gen = torch.Generator(device=device).manual_seed(1)

    def rand(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, k, v, dout = rand(B, s, H, D), rand(B, s, Hkv, D), rand(B, s, Hkv, D), rand(B, s, H, D)
    scale = D ** -0.5
    fwd, bwd = [], []
    timer = PhaseTimer(device, events=True)
    for i in range(config.warmup + config.iters):
        sync(device)
        timer.start()
        out, lse = inner.forward(q, k, v, causal=config.causal, scale=scale)
        timer.mark()
        inner.backward(dout, q, k, v, out, lse, causal=config.causal, scale=scale)
        f, b = timer.stop()
        if i >= config.warmup:
            fwd.append(f)
            bwd.append(b)
        del out, lse
    return {"seq_len": s, "heads": H, "kv_heads": Hkv, "pairs": pairs, "fwd_flops": kernel_flops(pairs, D),
            "bwd_flops": kernel_flops(pairs, D, backward=True), "fwd_ms": _median_ms(fwd), "bwd_ms": _median_ms(bwd)}


def _environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device), "device_name": "cpu", "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory,
                   capability=list(torch.cuda.get_device_capability(device)))
    return env


def _new_state(config: OneRankConfig):
    from ..comm.workspace import Workspace
    from ..state import ParallelState

    state = ParallelState(config.ring, config.ulysses, checks="never")
    state.workspace = Workspace(keep=config.keep_workspace)
    return state


def _resolve_inner(config: OneRankConfig, device: torch.device):
    from ..backends import get_backend

    return get_backend(config.backend, device, _DTYPES[config.dtype])


def measure(config: OneRankConfig) -> dict:
    """Measure rank ``config.cp_rank`` in this process (Note [One-rank runs]).

    ``torch.distributed`` must be initialised as that rank of ``R * U`` (:func:`fake_world`);
    :func:`run_one_rank` does all of it in a fresh process.

    Returns:
        A JSON-able dict: ``config``, ``environment``, ``work`` (:func:`rank_work`), times
        (``fwd_ms``, ``bwd_ms``: medians; ``*_all``: every iteration; ``wall_ms``), kernel time
        and ``kernel_calls`` per kind, ``comm`` (collective counts and bytes), TFLOP/s,
        ``monolithic`` and ``efficiency_*``, ``memory`` and ``warnings``; with ``oom: True``
        (and no figures) when the device ran out of memory.
    """
    if threads := config.threads:
        torch.set_num_threads(threads)
    device = _device(config)
    work = rank_work(config)
    result: dict[str, Any] = {"config": asdict(config), "environment": _environment(device), "work": work,
                              "oom": False, "warnings": []}
    if device.type == "cpu":
        result["warnings"].append("measured on the CPU: these are not GPU figures")
    state = _new_state(config)
    inner = _resolve_inner(config, device)
    backend = instrument(inner, device)
    result["backend"] = inner.name
    rank = None
    try:
        rank = _Rank(config, device, state, backend)
        with CollectiveRecorder() as comm:
            rank.step()  # the first warm-up iteration: workspace, caches; records calls and traffic
        result["kernel_calls"] = dict(backend.counts)
        result["comm"] = {"counts": comm.counts, "bytes": comm.bytes}
        if comm.gathers:
            result["warnings"].append(
                f"{comm.gathers} all-gather(s) ran in the call: a cross-rank check read fake data (seq_len "
                "missing or checks not 'never'); the run is not one rank's"
            )
        for _ in range(max(0, config.warmup - 1)):
            rank.step()
        backend.reset()
        t = _timed(rank, config.iters)
        result.update(
            fwd_ms=_median_ms(t["fwd"]), bwd_ms=_median_ms(t["bwd"]), wall_ms=_median_ms(t["wall"]),
            fwd_ms_all=[1e3 * x for x in t["fwd"]], bwd_ms_all=[1e3 * x for x in t["bwd"]],
            kernel_fwd_ms=_median_ms(t["kernel_fwd"]), kernel_bwd_ms=_median_ms(t["kernel_bwd"]),
            # Kernel time / rank time of the same iterations (robust to an outlier iteration).
            kernel_share=sum(t["kernel_fwd"] + t["kernel_bwd"]) / sum(t["fwd"] + t["bwd"]),
            local_tokens=rank.local_tokens,
        )
        if config.model == "attention":
            result["fwd_tflops"] = work["fwd_flops"] / (result["fwd_ms"] / 1e3) / 1e12
            result["bwd_tflops"] = work["bwd_flops"] / (result["bwd_ms"] / 1e3) / 1e12
        if config.memory:
            result["memory"] = {**_peak_memory(rank), "workspace_bytes": state.workspace.nbytes}
        del rank
        rank = None
        state.workspace.clear()
        gc.collect()
        if config.monolithic and config.model == "attention":
            mono = _monolithic(config, work, inner, device)
            result["monolithic"] = mono
            if mono is not None:
                def eff(kind: str) -> float:
                    ours = work[f"{kind}_flops"] / result[f"{kind}_ms"]
                    return ours / (mono[f"{kind}_flops"] / mono[f"{kind}_ms"])

                result["efficiency_fwd"] = eff("fwd")
                result["efficiency_bwd"] = eff("bwd")
                total = (work["fwd_flops"] + work["bwd_flops"]) / (result["fwd_ms"] + result["bwd_ms"])
                mono_total = (mono["fwd_flops"] + mono["bwd_flops"]) / (mono["fwd_ms"] + mono["bwd_ms"])
                result["efficiency"] = total / mono_total
    except RuntimeError as e:
        if not _is_oom(e):
            raise
        result["oom"] = True
        result["error"] = f"out of memory: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    finally:
        del rank
        state.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------
# The longest sequence that fits


def _transient(fn: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """``(peak bytes above the start minus bytes still held at the end, fn's result)``."""
    with PeakMemory(device) as mem:
        out = fn()
    gc.collect()
    return max(0, mem.peak - mem.held()), out


def calibrate_scratch(config: OneRankConfig, device: torch.device, tokens: int = 2048) -> dict:
    """Transient bytes of the backend's dense kernel methods above their outputs, fitted as
    ``c0 + a * Sq + b * Sk`` from real calls at ``(n, n)``, ``(2n, n)``, ``(n, 2n)`` with the
    rank's heads (:func:`instrument`'s ``scratch``)."""
    work = rank_work(config)
    inner = _resolve_inner(config, device)
    H = max(1, work["heads"])
    Hkv = max(1, work["kernel_kv_heads"])
    B, D, dtype = config.batch, config.head_dim, _DTYPES[config.dtype]
    scale = D ** -0.5
    n = tokens
    samples: dict[str, list[tuple[int, int, int]]] = {"forward": [], "backward": []}
    for sq, sk in ((n, n), (2 * n, n), (n, 2 * n)):
        q = torch.randn(B, sq, H, D, device=device, dtype=dtype)
        k = torch.randn(B, sk, Hkv, D, device=device, dtype=dtype)
        v = torch.randn(B, sk, Hkv, D, device=device, dtype=dtype)
        dout = torch.randn(B, sq, H, D, device=device, dtype=dtype)
        kw = {"scale": scale, "window": (-1, -1), "softcap": 0.0}
        inner.kernel_forward(q, k, v, **kw)  # warm-up (lazy initialisation, workspaces)
        fwd_extra, (out, lse) = _transient(lambda: inner.kernel_forward(q, k, v, **kw), device)
        inner.kernel_backward(dout, q, k, v, out, lse, **kw)
        bwd_extra, _ = _transient(lambda: inner.kernel_backward(dout, q, k, v, out, lse, **kw), device)
        samples["forward"].append((B * sq, B * sk, fwd_extra))
        samples["backward"].append((B * sq, B * sk, bwd_extra))
        q = k = v = dout = out = lse = None  # freed before the next, larger sample
    fit = {}
    for kind, pts in samples.items():
        (q1, k1, y1), (q2, _, y2), (_, k3, y3) = pts
        a = (y2 - y1) / (q2 - q1)
        b = (y3 - y1) / (k3 - k1)
        c0 = y1 - a * q1 - b * k1
        fit[kind] = (max(0.0, c0), max(0.0, a), max(0.0, b))
    fit["varlen_forward"], fit["varlen_backward"] = fit["forward"], fit["backward"]
    return {"fit": fit, "samples": samples, "tokens": n}


def max_seq_len(search: MaxLenSearch) -> dict:
    """The longest global length whose one-rank forward+backward fits (in this process, whose
    fake world is initialised as the rank; :func:`search_max_seq_len` spawns one).

    Returns:
        ``max_seq_len`` (global ``S``; 0 if not even the smallest probe fits), ``max_local_tokens``,
        ``peak_bytes`` at that length, ``first_failing_seq_len``, every probe, ``calibration``
        and ``stub_vs_real`` for the stub probe, ``limit_bytes``, ``complete`` (False when
        ``max_probes`` ran out).

    Raises:
        ValueError: on the CPU without ``memory_limit_bytes``.
    """
    config = search.config
    if config.threads:
        torch.set_num_threads(config.threads)
    device = _device(config)
    if device.type == "cpu" and search.memory_limit_bytes is None:
        raise ValueError("MaxLenSearch: on the CPU a memory_limit_bytes is required (nothing runs out of memory)")
    limit = search.memory_limit_bytes
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # what earlier tasks of this process cached
        if limit is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    try:
        return _search(search, device, limit)
    finally:
        if device.type == "cuda" and limit is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def _search(search: MaxLenSearch, device: torch.device, limit: int | None) -> dict:
    """:func:`max_seq_len` after the device is prepared."""
    config = search.config
    result: dict[str, Any] = {"search": {**asdict(search), "config": asdict(config)},
                              "environment": _environment(device), "probes": [], "warnings": []}
    if device.type == "cpu":
        result["warnings"].append("measured on the CPU against a given limit: not a GPU figure")
    scratch = None
    if search.probe == "stub":
        calibration = calibrate_scratch(config, device)
        scratch = calibration["fit"]
        result["calibration"] = calibration
    state = _new_state(config)
    inner = _resolve_inner(config, device)
    unit = config.cp_size

    def probe(local: int, kernels=scratch) -> tuple[bool, int | None]:
        seq_len = local * unit
        cfg = dataclasses.replace(config, seq_len=seq_len, varlen=False, doc_lens=None)
        backend = instrument(inner, device, scratch=kernels)
        rank = None
        try:
            rank = _Rank(cfg, device, state, backend)
            peak = _peak_memory(rank)["peak_bytes"]
            fits = limit is None or peak <= limit
            return fits, peak
        except RuntimeError as e:
            if not _is_oom(e):
                raise
            return False, None
        finally:
            del rank
            state.workspace.clear()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def record(local: int) -> bool:
        t0 = time.perf_counter()
        fits, peak = probe(local)
        result["probes"].append({"seq_len": local * unit, "local_tokens": local, "fits": fits,
                                 "peak_bytes": peak, "seconds": time.perf_counter() - t0})
        return fits

    g = search.granule
    lo, hi = 0, None  # lo: largest fitting multiple of g (0: none yet); hi: smallest failing one
    k = max(1, search.start // g)
    complete = True
    while hi is None:
        if len(result["probes"]) >= search.max_probes:
            complete = False
            break
        if record(k * g):
            lo, k = k, 2 * k
        else:
            hi = k
    if hi is not None and lo == 0:  # even the first probe failed: bisect below it
        lo_k = 0
        while hi - lo_k > 1 and len(result["probes"]) < search.max_probes:
            mid = (lo_k + hi) // 2
            if record(mid * g):
                lo_k = mid
            else:
                hi = mid
        lo = lo_k
    while hi is not None and hi - lo > 1:
        if len(result["probes"]) >= search.max_probes:
            complete = False
            break
        mid = (lo + hi) // 2
        if record(mid * g):
            lo = mid
        else:
            hi = mid
    best = next((p for p in reversed(result["probes"]) if p["fits"] and p["local_tokens"] == lo * g), None)
    result.update(
        max_local_tokens=lo * g, max_seq_len=lo * g * unit, peak_bytes=None if best is None else best["peak_bytes"],
        first_failing_seq_len=None if hi is None else hi * g * unit, complete=complete,
        limit_bytes=limit if limit is not None else (
            torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None),
    )
    if search.probe == "stub":
        # The stub's peak against the real kernels' at a small length: checks the model here.
        small = search.check_tokens
        stub_fits, stub_peak = probe(small)
        real_fits, real_peak = probe(small, kernels=None)
        result["stub_vs_real"] = {
            "local_tokens": small, "stub_peak_bytes": stub_peak, "real_peak_bytes": real_peak,
            "ratio": stub_peak / real_peak if stub_peak and real_peak else None,
        }
    state.close()
    return result


# ---------------------------------------------------------------------------------------------
# Tasks in a fresh process


Task = OneRankConfig | MaxLenSearch


def _encode(task: Task) -> dict:
    if isinstance(task, MaxLenSearch):
        return {"kind": "search", **asdict(task)}
    return {"kind": "measure", "config": asdict(task)}


def _decode(d: dict) -> Task:
    d = dict(d)
    kind = d.pop("kind")
    config = OneRankConfig.from_dict(d.pop("config"))
    if kind == "search":
        return MaxLenSearch(config=config, **d)
    return config


def _child(tasks: list[dict]) -> None:
    """Run encoded tasks in this process, one result line each (``_MARK`` + JSON)."""
    current: tuple[int, int, str] | None = None
    stack = None
    try:
        for i, encoded in enumerate(tasks):
            task = _decode(encoded)
            config = task.config if isinstance(task, MaxLenSearch) else task
            device = _device(config)
            key = (config.cp_size, config.cp_rank, device.type)
            if key != current:
                if stack is not None:
                    stack.__exit__(None, None, None)
                stack = fake_world(config.cp_size, config.cp_rank, device)
                stack.__enter__()
                current = key
            t0 = time.perf_counter()
            try:
                out = max_seq_len(task) if isinstance(task, MaxLenSearch) else measure(task)
            except Exception as e:  # noqa: BLE001 - reported as the task's result
                out = {"error": f"{type(e).__name__}: {e}"}
            out["task_index"] = i
            out["seconds"] = time.perf_counter() - t0
            print(_MARK + json.dumps(out, separators=(",", ":")), flush=True)
    finally:
        if stack is not None:
            stack.__exit__(None, None, None)


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def run_tasks(
    tasks: Sequence[Task], *, timeout_s: float | None = None, python: str | None = None,
    on_start: Callable[[int], None] | None = None,
) -> list[dict]:
    """Run one-rank measurements and searches in fresh processes; one result per task, in order.

    All tasks go to one child process (its fake world is re-initialised when ``R * U`` or the
    rank changes). A task that raises gives ``{"error": ...}``; a child that dies or runs a
    task longer than ``timeout_s`` is killed, that task gets ``{"error": ...}``, and a new child
    runs the tasks after it.

    Args:
        tasks: :class:`OneRankConfig` (measure) and :class:`MaxLenSearch` objects.
        timeout_s: limit per task (``None``: none).
        python: the interpreter (default: this one).
        on_start: called with a task's index when the child starts it (e.g. a progress line); the
            child starts task ``i + 1`` when task ``i`` has answered.
    """
    encoded = [_encode(t) for t in tasks]
    results: list[dict | None] = [None] * len(encoded)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))}
    start = 0
    while start < len(encoded):
        proc = subprocess.Popen(
            [python or sys.executable, "-m", "seqpar.tools.one_rank", "--child"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        lines: queue.Queue = queue.Queue()
        err: list[str] = []

        def pump(stream, sink) -> None:
            for line in stream:
                sink(line)
            if stream is proc.stdout:
                lines.put(None)

        threads = [threading.Thread(target=pump, args=(proc.stdout, lines.put), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, err.append), daemon=True)]
        for t in threads:
            t.start()
        proc.stdin.write(json.dumps(encoded[start:]))
        proc.stdin.close()
        index, announced = start, start - 1
        while index < len(encoded):
            if on_start is not None and announced < index:
                on_start(index)
                announced = index
            try:
                line = lines.get(timeout=timeout_s)
            except queue.Empty:
                proc.kill()
                results[index] = {"error": f"timeout: no result within {timeout_s} s", "task": encoded[index]}
                index += 1
                break
            if line is None:  # the child exited
                proc.wait()
                tail = "".join(err[-20:]).strip()
                results[index] = {"error": f"the child process exited (code {proc.returncode}) during this task: "
                                  f"{tail[-2000:]}", "task": encoded[index]}
                index += 1
                break
            if line.startswith(_MARK):
                out = json.loads(line[len(_MARK):])
                results[start + out.pop("task_index")] = out
                index += 1
        else:
            proc.wait()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in threads:
            t.join(timeout=5)
        start = index
    return [r if r is not None else {"error": "no result"} for r in results]


def run_one_rank(config: OneRankConfig, *, timeout_s: float | None = None) -> dict:
    """:func:`measure` of ``config`` in a fresh process (see :func:`run_tasks`)."""
    return run_tasks([config], timeout_s=timeout_s)[0]


def search_max_seq_len(search: MaxLenSearch, *, timeout_s: float | None = None) -> dict:
    """:func:`max_seq_len` of ``search`` in a fresh process (see :func:`run_tasks`)."""
    return run_tasks([search], timeout_s=timeout_s)[0]


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m seqpar.tools.one_rank",
        description="Run one rank of a ring x Ulysses job alone (fake process group) and print its "
        "figures as JSON. See the module docstring (Note [One-rank runs]).",
    )
    p.add_argument("--ring", type=int, default=1, help="ring size R (default 1)")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses size U (default 1)")
    p.add_argument("--cp-rank", type=int, default=0, help="the rank to run (default 0)")
    p.add_argument("--seq-len", type=int, default=32768, help="global tokens S (default 32768)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--varlen", action="store_true", help="packed documents of mixed lengths")
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", default="attention", choices=("attention", "llama_layer"))
    p.add_argument("--layers", type=int, default=1, help="llama_layer: layer inputs kept alive (default 1)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--max-len", action="store_true", help="search the longest S that fits instead")
    p.add_argument("--probe", default="stub", choices=("stub", "real"), help="--max-len probe (default stub)")
    p.add_argument("--memory-limit-gib", type=float, default=None, help="--max-len: limit (required on the CPU)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.child:
        _child(json.loads(sys.stdin.read()))
        return
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        config = OneRankConfig(
            ring=args.ring, ulysses=args.ulysses, seq_len=args.seq_len, cp_rank=args.cp_rank, heads=args.heads,
            kv_heads=args.kv_heads, head_dim=args.head_dim, batch=args.batch,
            dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"), device=device,
            causal=args.causal, varlen=args.varlen, backend=args.backend, model=args.model, layers=args.layers,
            warmup=args.warmup, iters=args.iters,
        )
        limit = None if args.memory_limit_gib is None else int(args.memory_limit_gib * 2**30)
        task: Task = MaxLenSearch(config, probe=args.probe, memory_limit_bytes=limit) if args.max_len else config
    except ValueError as e:
        raise SystemExit(f"python -m seqpar.tools.one_rank: {e}") from None
    with fake_world(config.cp_size, config.cp_rank, _device(config)):
        out = max_seq_len(task) if isinstance(task, MaxLenSearch) else measure(task)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
