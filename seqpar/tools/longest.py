"""One rank of a Llama-shaped decoder stack at long context: its peak memory per length.

Note [Longest-context measurement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``scripts/bench_longest.py`` calibrates and validates the memory model of
``seqpar.planner.memory`` (``docs/performance.md``, "Longest context: the memory model") with
this stack, run as ONE rank of a ring ``R`` x Ulysses ``U`` job over torch's fake process group
(``seqpar.tools.one_rank.fake_world``, Note [One-rank runs] in ``seqpar/tools/one_rank.py``): the
rank runs exactly its own code -- the same plan, kernels on the same shapes, staging copies,
workspace and saved tensors -- while collectives return at once.

The stack is what a long-context training step holds on one rank, built from seqpar's pieces:

- a frozen input embedding ``[V, hidden]`` (``train_embeddings=False``) or a trainable one;
- ``layers`` decoder layers, each under non-reentrant activation checkpointing: RMSNorm, q/k/v/o
  projections around ``seqpar.attention`` (causal, ``seq_len`` given so no call exchanges its
  length), RMSNorm, a SwiGLU MLP wrapped in ``seqpar.training.TiledTokenwise(mlp_chunks)``; no
  rotary embedding (element-wise temporaries only);
- a final RMSNorm and ``seqpar.training.linear_cross_entropy`` (tiled lm-head + loss; the
  ``[T, V]`` logits never exist) against random labels;
- optionally (CUDA only) the checkpointed layer inputs kept in pinned host memory by
  ``torch.autograd.graph.save_on_cpu`` (on the CPU the host *is* the device: refused).

One step is a forward and a backward (no optimizer step: optimizer state is static bytes that the
model counts from the parameter count), with every trainable parameter's gradient already
allocated (zeros), as in a step of gradient accumulation: the model counts the gradients as alive
throughout the step. The peak is ``seqpar.tools.profiling.PeakMemory``'s: on CUDA the allocator's
high-water mark; on the CPU, by default, ``AllocatorTracker``'s peak of the CPU allocator's blocks
allocated in the step (``torch.profiler``'s memory events: kernel scratch included) plus the bytes
alive before it (parameters, gradients, ids, labels). ``allocator=False`` reads
``StorageTracker``'s peak of tensor storage instead, as the shipped bf16 calibration did: it misses
kernel scratch, and its dispatch mode makes autograd sum gradients out of place (measured on the
Llama-8B-shaped layer in fp32, 4 x 1: 198,804 bytes per token against the allocator's 186,516,
the same intercept within 45 KB; ``docs/performance.md``). Each length runs on a fresh ``ParallelState``
(``checks="never"``), so its workspace is created, and counted, inside the step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .profiling import PeakMemory

__all__ = ["StackConfig", "StackRun", "build_stack", "measure_peak", "add_stack_arguments", "stack_arguments"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StackConfig:
    """One rank (``cp_rank``) of an ``R x U`` job running a Llama-shaped decoder stack.

    Attributes:
        ring, ulysses: ``R`` and ``U``.
        cp_rank: the rank this process plays.
        layers, hidden, heads, kv_heads, head_dim, ffn, vocab: the model's shape.
        dtype: parameters and activations (``"bfloat16"``, ``"float16"``, ``"float32"``).
        device: ``"cpu"`` or ``"cuda"``.
        mlp_chunks: ``TiledTokenwise`` chunks of the MLP.
        loss_chunk: tokens per chunk of the tiled loss (``None``: the library's default).
        train_embeddings: whether the embedding and lm-head weights take gradients.
        offload: keep the checkpointed layer inputs in host memory (CUDA only).
        keep_head_shards: ``ParallelState(keep_head_shards=True)`` (Note [Ulysses memory]).
        ring_comm: ``ParallelState(ring_comm=...)``, ``"p2p"`` or ``"p2p_serial"`` (Note [Serial
            ring]; the all-gather transport is not modelled by the memory model).
        seed: of the weights and inputs.
    """

    ring: int = 2
    ulysses: int = 2
    cp_rank: int = 0
    layers: int = 1
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 128256
    dtype: str = "bfloat16"
    device: str = "cpu"
    mlp_chunks: int = 8
    loss_chunk: int | None = None
    train_embeddings: bool = False
    offload: bool = False
    keep_head_shards: bool = False
    ring_comm: str = "p2p"
    seed: int = 0

    def __post_init__(self) -> None:
        where = "StackConfig"
        for name in ("ring", "ulysses", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                     "mlp_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
        if not 0 <= self.cp_rank < self.ring * self.ulysses:
            raise ValueError(f"{where}: cp_rank={self.cp_rank} is not a rank of {self.ring} x {self.ulysses} "
                             f"(valid: 0..{self.ring * self.ulysses - 1})")
        if self.heads % self.kv_heads:
            raise ValueError(f"{where}: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"{where}: dtype={self.dtype!r}; valid: {sorted(_DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"{where}: device={self.device!r}; valid: 'cpu', 'cuda'")
        if not isinstance(self.keep_head_shards, bool):
            raise ValueError(f"{where}: keep_head_shards must be True or False, got {self.keep_head_shards!r}")
        if self.ring_comm not in ("p2p", "p2p_serial"):
            raise ValueError(f"{where}: ring_comm={self.ring_comm!r}; valid: 'p2p', 'p2p_serial' (the memory "
                             "model does not model the all-gather transport)")
        if self.offload and self.device != "cuda":
            raise ValueError(f"{where}: offload=True moves activations from a CUDA device to the host; on the "
                             "CPU the host is the device (use device='cuda', or offload=False)")

    @property
    def torch_device(self) -> torch.device:
        """The device the stack runs on (``cuda:0`` for ``"cuda"``)."""
        return torch.device(self.device, 0) if self.device == "cuda" else torch.device("cpu")


# The command-line options of the stack's shape and split, as StackConfig's fields.
_SHAPE_OPTIONS = ("ring", "ulysses", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "dtype",
                  "device")


def add_stack_arguments(parser: argparse.ArgumentParser, *, layers: int) -> None:
    """Add ``--ring --ulysses --layers --hidden --heads --kv-heads --head-dim --ffn --vocab --dtype
    --device`` (Llama-8B-shaped defaults, ``layers`` decoder layers) to a script's parser; read them
    back with :func:`stack_arguments`."""
    parser.add_argument("--ring", type=int, default=2, help="ring size R")
    parser.add_argument("--ulysses", type=int, default=2, help="Ulysses size U")
    parser.add_argument("--layers", type=int, default=layers, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=4096, help="model width")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="K/V heads")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim")
    parser.add_argument("--ffn", type=int, default=14336, help="MLP intermediate width")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary size")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(_DTYPES), help="dtype")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device")


def stack_arguments(args: argparse.Namespace) -> dict:
    """The :class:`StackConfig` fields parsed from :func:`add_stack_arguments`' options."""
    return {name: getattr(args, name) for name in _SHAPE_OPTIONS}


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class _Layer(nn.Module):
    """A Llama-shaped decoder layer (no rotary embedding) under activation checkpointing."""

    def __init__(self, c: StackConfig, state, seq_len: int) -> None:
        super().__init__()
        from ..tiled import TiledTokenwise

        H, Hkv, D = c.heads, c.kv_heads, c.head_dim
        self.c, self.state, self.seq_len = c, state, seq_len
        self.norm1, self.norm2 = nn.RMSNorm(c.hidden), nn.RMSNorm(c.hidden)
        self.q = nn.Linear(c.hidden, H * D, bias=False)
        self.k = nn.Linear(c.hidden, Hkv * D, bias=False)
        self.v = nn.Linear(c.hidden, Hkv * D, bias=False)
        self.o = nn.Linear(H * D, c.hidden, bias=False)
        self.mlp = TiledTokenwise(_SwiGLU(c.hidden, c.ffn), c.mlp_chunks)

    def _forward(self, x: Tensor) -> Tensor:
        from ..attention import attention

        c = self.c
        B, S = x.shape[:2]
        h = self.norm1(x)
        q = self.q(h).view(B, S, c.heads, c.head_dim)
        k = self.k(h).view(B, S, c.kv_heads, c.head_dim)
        v = self.v(h).view(B, S, c.kv_heads, c.head_dim)
        a = attention(q, k, v, self.state, causal=True, seq_len=self.seq_len)
        x = x + self.o(a.reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self._forward, x, use_reentrant=False)


class _Stack(nn.Module):
    def __init__(self, c: StackConfig, state, seq_len: int) -> None:
        super().__init__()
        self.c, self.state = c, state
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList([_Layer(c, state, seq_len) for _ in range(c.layers)])
        self.norm = nn.RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for p in (self.embed.weight, self.lm_head.weight):
            p.requires_grad_(c.train_embeddings)

    def loss(self, ids: Tensor, labels: Tensor) -> Tensor:
        from ..training import linear_cross_entropy

        offload = (torch.autograd.graph.save_on_cpu(pin_memory=True) if self.c.offload
                   else contextlib.nullcontext())
        with offload:
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
        h = self.norm(x)
        return linear_cross_entropy(h, self.lm_head.weight, labels, self.state, chunk_size=self.c.loss_chunk)


@dataclass
class StackRun:
    """The stack of rank ``config.cp_rank`` built for ``local_tokens`` tokens, ready to step.

    Attributes:
        config: the ``StackConfig``.
        local_tokens: the rank's actual token count.
        seq_len: the global length, ``local_tokens * R * U`` as asked.
        param_bytes: the parameters' bytes.
        before_bytes: bytes alive before a step: parameters, their gradients, ids, labels.
    """

    config: StackConfig
    local_tokens: int
    seq_len: int
    param_bytes: int
    before_bytes: int
    _stack: nn.Module
    _ids: Tensor
    _labels: Tensor
    _state: object

    def parameters(self) -> list[nn.Parameter]:
        """The stack's parameters (their ``.grad`` allocated before the first step)."""
        return list(self._stack.parameters())

    def step(self) -> None:
        """One forward and backward (the gradients accumulate into the preallocated ones)."""
        self._stack.loss(self._ids, self._labels).backward()

    def close(self) -> None:
        """Close the ``ParallelState``; the stack's memory goes with the last reference."""
        self._state.close()


def build_stack(config: StackConfig, local_tokens: int) -> StackRun:
    """Build rank ``config.cp_rank``'s stack for ``local_tokens`` tokens per rank (a global length of
    ``local_tokens * R * U``; the rank's actual count is ``StackRun.local_tokens``), with every
    trainable parameter's gradient already allocated (zeros), as under gradient accumulation.

    ``torch.distributed`` must be initialised as that rank of ``R * U``
    (``seqpar.tools.one_rank.fake_world``). The caller closes the returned run.

    Raises:
        ValueError: a non-positive ``local_tokens``.
    """
    from ..placement import Placement
    from ..state import ParallelState

    if isinstance(local_tokens, bool) or not isinstance(local_tokens, int) or local_tokens < 1:
        raise ValueError(f"build_stack: local_tokens must be a positive int, got {local_tokens!r}")
    c = config
    device = c.torch_device
    seq_len = local_tokens * c.ring * c.ulysses
    n = Placement.dense(seq_len, c.ring, c.ulysses).shard_lengths[c.cp_rank]
    state = ParallelState(c.ring, c.ulysses, checks="never", keep_head_shards=c.keep_head_shards,
                          ring_comm=c.ring_comm)
    try:
        torch.manual_seed(c.seed)
        with torch.device(device):
            stack = _Stack(c, state, seq_len).to(_DTYPES[c.dtype])
        gen = torch.Generator(device=device).manual_seed(c.seed + 1)
        ids = torch.randint(0, c.vocab, (1, n), generator=gen, device=device)
        labels = torch.randint(0, c.vocab, (1, n), generator=gen, device=device)
        param_bytes = sum(p.numel() * p.element_size() for p in stack.parameters())
        # Every gradient exists before the step, as under gradient accumulation (the memory model's
        # "gradients" term is alive at both of its moments).
        for p in stack.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in stack.parameters() if p.grad is not None)
    except BaseException:
        state.close()
        raise
    return StackRun(c, n, seq_len, param_bytes, param_bytes + grad_bytes + ids.nbytes + labels.nbytes,
                    stack, ids, labels, state)


def measure_peak(config: StackConfig, local_tokens: int, *, allocator: bool = True) -> dict:
    """One forward+backward of rank ``config.cp_rank`` with ``local_tokens`` tokens; its peak bytes.

    ``torch.distributed`` must be initialised as that rank of ``R * U``
    (``seqpar.tools.one_rank.fake_world``). The global length is ``local_tokens * R * U``, which
    gives every rank ``local_tokens`` tokens when ``2 * R`` divides it (the rank's actual count is
    returned). On the CPU ``allocator`` picks the measure (Note [Longest-context measurement]):
    the CPU allocator's blocks (default) or ``StorageTracker``'s tensor storage.

    Returns:
        ``local_tokens``, ``seq_len``, ``peak_bytes`` (before + in-step peak), ``before_bytes``
        (parameters, their gradients, ids, labels), ``in_step_peak_bytes``, ``param_bytes``, ``seconds``,
        ``measured_by``, ``config``.

    Raises:
        ValueError: a non-positive ``local_tokens``.
    """
    device = config.torch_device
    run = build_stack(config, local_tokens)
    try:
        before = run.before_bytes
        gc.collect()
        t0 = time.perf_counter()
        with PeakMemory(device, allocator=allocator) as mem:  # allocator: the CPU measure (CUDA reads its own)
            run.step()
        seconds = time.perf_counter() - t0
        if device.type == "cuda":
            before = mem.start_bytes
            by = "torch.cuda.max_memory_allocated"
        else:
            by = (("AllocatorTracker (CPU allocator, torch.profiler)" if allocator else "StorageTracker")
                  + " peak + bytes alive before the step")
        return {"local_tokens": run.local_tokens, "seq_len": run.seq_len, "peak_bytes": before + mem.peak,
                "before_bytes": before, "in_step_peak_bytes": mem.peak, "param_bytes": run.param_bytes,
                "seconds": seconds, "measured_by": by, "config": asdict(config)}
    finally:
        run.close()
        del run
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
