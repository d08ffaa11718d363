"""The longest context that fits: bytes per token per rank of a whole model, and the length.

Note [Memory model]
~~~~~~~~~~~~~~~~~~~
A training step's peak on one rank is reached at one of two **moments**, and the model prices
both and takes the larger: the **loss's** (the end of the tiled loss's backward, before any
layer's: the lm-head's fp32 gradient and one chunk of logits, next to the final hidden states) and
a **layer's** (one layer recomputed and back-propagating, once the loss's tensors are freed). Each
is a fixed part plus a part linear in the rank's ``T`` local tokens (``T = S / (R * U)`` for a
sequence of ``S`` tokens over ring ``R`` x Ulysses ``U``)::

    device(T) = reserve + max(layer.fixed + T * layer.per_token, loss.fixed + T * loss.per_token)
    host(T) = T * host_per_token

Adding the two (as this model did before) charged the lm-head's fp32 gradient, 2 GiB for
Llama-3-8B, to the layer's moment, where it is not alive (Note [Tiled token-wise work] in
``seqpar/tiled.py``).

**At both moments** (bytes per rank unless said; derived from the parameter count ``P``):

- parameters, gradients, optimizer state: ``P * (element size)``, ``P * grad_bytes``,
  ``P * optimizer_bytes_per_param`` (12: fp32 master weights and Adam's two moments), each divided
  by the ``dp * R * U`` ranks that shard it under ZeRO stage 3, 2 and 1 respectively (FSDP over
  the whole world, ``docs/howto-fsdp.md``); frozen embeddings take no gradient or optimizer state.
  Every gradient is counted as alive, as in a step of gradient accumulation (an upper estimate
  for a step that starts without gradients);
- per token: the checkpointed layer inputs, ``L * hidden * e``, **exact** (on the host with
  ``offload``: ``torch.autograd.graph.save_on_cpu`` around checkpointed layers,
  ``docs/long-context.md``; then the layer's moment holds one of them, the recomputed layer's
  input copied back: measured on an H200, offload lowered the slope of a 2-layer stack by
  ``hidden * e`` per token, not ``2 * hidden * e``), or without checkpointing every layer's saved
  activations (derived, not calibrated); the ids and labels (16 bytes);
- ``reserve``: **not measured here**, an input (CUDA context, NCCL buffers, allocator
  fragmentation).

**A layer's moment** adds, with ``e`` the element size, ``hidden``, ``H``, ``Hkv``, ``D``, ``F``
(FFN), ``V``, ``L`` layers:

- ZeRO-3's two gathered layers (the running one and the prefetched one) and the running layer's
  unsharded gradients;
- ``overhead``: **measured** (``Calibration.overhead_bytes``): what the measured fixed bytes of a
  layer's moment exceed the derived ones by. It holds what depends on where in the layer the peak
  falls, e.g. the weight gradients autograd sums over the MLP's chunks before adding them to
  ``.grad`` when the peak is in the MLP's backward (counted again by ZeRO-3's unsharded gradients:
  an upper estimate there);
- ONE layer's working set at the peak of its backward (recompute, then gradients), **derived
  then scaled by the measured** layer factor (``Calibration.factor_for(R, U)``): six hidden-sized tensors (norm
  outputs, the residual, incoming and outgoing gradients), the shard's q, k, v, out and their
  gradients, the log-sum-exps; with ``U > 1`` the head-sharded copies of q, k, v, out, dout and
  their staging (``U * ceil(H / U)`` query heads and ``U * kv`` K/V heads per local token, K/V
  heads replicated where ``Hkv < U``; the shard's own dout is freed once exchanged, Note [Dout
  exchanged first] in ``seqpar/parallel/hybrid.py``, but still counted here, so factors fitted
  before that change err high by at most ``H * D * e`` per token), the
  fp32 dq, dk, dv accumulators; with ``R > 1`` the ring's
  K/V and dK/dV slots (two of each) and the fp32 dK/dV sum; and the MLP's chunk (``5 * F * e /
  chunks``: its intermediates and one gradient);
- with ``keep_head_shards`` (``U > 1``), **exact**: the layer saves the head shards q_u, k_u,
  v_u, out_u (``U * (2 * h + 2 * kv)`` heads per local token) instead of the shard's q, k, v, out,
  while the output projection still saves the shard's out (with the default the call's saved out
  *is* that tensor): ``U * (2 * h + 2 * kv) - H - 2 * Hkv`` heads of ``D * e`` bytes more, one
  output (``H * D * e``) when ``Hkv`` is a multiple of ``U``. Measured on one rank of 1 x 4
  (Llama-8B-shaped layer, fp32): +16,384 bytes per token, exactly ``32 * 128 * 4``. The option
  trades these bytes for the backward's traffic; it never lengthens the context.

**The loss's moment** adds, **derived** whole, no measured overhead (the CPU measurements of
``tests/test_tiled.py`` and ``docs/performance.md`` match it within 0.3%):

- ZeRO-3's gathered lm-head weight (``V * hidden * e``);
- the tiled loss (``seqpar.training.linear_cross_entropy``): with a trained lm-head its fp32
  gradient accumulator ``[V, hidden]``, then the larger of one chunk's logits (fp32, and their cast
  for half dtypes: ``chunk * V * (4 + e)``) and the accumulator's cast to ``e`` after the loop;
  frozen, the chunk alone. Untiled, the lm-head's gradient in ``e`` and per token the ``[T, V]``
  fp32 logits, their gradient and a copy in the model's dtype;
- per token: the final norm's saved tensors (its input, the fp32 normalized input and, for half
  dtypes, the input's fp32 copy), its output (the loss's input) and that output's gradient:
  ``hidden * (3 * e + 4 + (4 if e < 4))`` bytes, plus 8 (the log-sum-exp and masks).

``layer_factor`` is how much of the layer's nominal working set is alive at once, measured by
``scripts/bench_longest.py`` on one rank of a Llama-8B-shaped stack (Note
[Longest-context measurement] in ``seqpar/tools/longest.py``): the slope of the measured peak over
``T`` (at lengths where a layer's moment is the peak) minus the exact per-token terms, over the
derived working set. How much is alive at once differs by the kind of split (ring, Ulysses,
hybrid: each holds a different subset of the derived terms at its peak), so a calibration may
carry one factor per kind (``Calibration.split_factors``; on one H200 0.78 for ring 8, 0.68 for
Ulysses 8, 0.65-0.70 for the hybrids of 8 ranks); one factor for every kind errs high by up to
11% on the kinds it was not measured on. The longest context is the largest ``T`` with ``device(T) <= device_bytes``
(and ``host(T) <= host_bytes`` when given); ``S = T * R * U``. ``docs/performance.md`` ("Longest
context: the memory model") has the calibration, the validation run and the predictions for
Llama-3-8B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..tiled import default_chunk_size

__all__ = ["ModelShape", "Calibration", "CPU_CALIBRATION", "GPU_CALIBRATION", "split_kind", "Moment", "MemoryPrediction",
           "longest_context", "calibrate_from_fit", "group_shapes"]

GiB = 2**30


def _positive(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape (Llama-style: RMSNorm, GQA attention, SwiGLU MLP).

    Attributes:
        layers: decoder layers ``L``.
        hidden: model width.
        heads, kv_heads, head_dim: ``H``, ``Hkv``, ``D`` (``H % Hkv == 0``).
        ffn: the MLP's intermediate width ``F``.
        vocab: vocabulary size ``V``.
        dtype: parameters and activations (``torch.bfloat16`` for mixed-precision training).
        tied_embeddings: whether the lm-head shares the input embedding.

    Raises:
        ValueError: a non-positive size, ``H`` not a multiple of ``Hkv``, a non-float dtype.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    dtype: torch.dtype = torch.bfloat16
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            _positive("ModelShape", name, getattr(self, name))
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"ModelShape: dtype must be a floating torch.dtype, got {self.dtype!r}")

    @classmethod
    def llama3_8b(cls, **overrides) -> ModelShape:
        """Llama-3-8B (and 3.1-8B): 32 layers, hidden 4096, 32 heads, 8 K/V heads of 128, FFN
        14336, vocabulary 128256, untied, bf16; ``overrides`` replace fields."""
        return cls(**{**dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                             vocab=128256), **overrides})

    @property
    def element_size(self) -> int:
        """Bytes of one parameter or activation element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_parameters(self) -> int:
        """Parameters of one layer: two norms, q/k/v/o projections, the SwiGLU MLP."""
        H, Hkv, D, h = self.heads, self.kv_heads, self.head_dim, self.hidden
        return 2 * h + h * H * D + 2 * h * Hkv * D + H * D * h + 3 * h * self.ffn

    @property
    def embedding_parameters(self) -> int:
        """The input embedding and the lm-head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def parameters(self) -> int:
        """All parameters ``P``: layers, embeddings, the final norm (8.03e9 for Llama-3-8B)."""
        return self.layers * self.layer_parameters + self.embedding_parameters + self.hidden


SPLIT_KINDS = ("ring", "ulysses", "hybrid")


def split_kind(ring: int, ulysses: int) -> str | None:
    """``"ring"`` (``R > 1, U = 1``), ``"ulysses"`` (``R = 1, U > 1``), ``"hybrid"`` (both > 1),
    or None for one rank: the kinds whose working sets :class:`Calibration` may scale apart."""
    if ring > 1:
        return "hybrid" if ulysses > 1 else "ring"
    return "ulysses" if ulysses > 1 else None


@dataclass(frozen=True)
class Calibration:
    """The measured constants of Note [Memory model].

    Attributes:
        layer_factor: measured / derived bytes of one layer's working set per token.
        overhead_bytes: measured fixed bytes minus derived fixed bytes (may be negative).
        source: where and how they were measured.
        split_factors: ``layer_factor`` measured for a kind of split (:func:`split_kind`:
            ``"ring"``, ``"ulysses"``, ``"hybrid"``), where it differs from ``layer_factor``:
            the derived working set sums what each kind may hold, and how much of it is alive at
            once differs by kind (on an H200: 0.78 ring 8, 0.68 Ulysses 8, 0.65 / 0.70 at 2 x 4 /
            4 x 2). A kind not listed uses ``layer_factor``.

    Raises:
        ValueError: a factor that is not a positive finite number, a ``split_factors`` kind other
            than ``"ring"``, ``"ulysses"``, ``"hybrid"``, or a kind named twice (the message
            shows the value).
    """

    layer_factor: float
    overhead_bytes: int
    source: str
    split_factors: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        def check(name: str, value: object) -> None:
            if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                    and value > 0):
                raise ValueError(f"Calibration: {name} must be a positive finite number, got {value!r}")

        check("layer_factor", self.layer_factor)
        kinds = [kind for kind, _ in self.split_factors]
        for kind, value in self.split_factors:
            if kind not in SPLIT_KINDS:
                raise ValueError(f"Calibration: split_factors kind {kind!r} is not one of {SPLIT_KINDS}")
            check(f"split_factors[{kind!r}]", value)
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"Calibration: split_factors names a kind twice: {kinds}")

    def factor_for(self, ring: int, ulysses: int) -> float:
        """The layer factor of an ``R x U`` split: its kind's measured one, else ``layer_factor``."""
        return dict(self.split_factors).get(split_kind(ring, ulysses), self.layer_factor)


# Measured by scripts/bench_longest.py on this project's CPU machine (bf16, one layer of a
# Llama-8B-shaped stack, MLP in 8 chunks, frozen embedding and lm-head; docs/performance.md,
# "Longest context: the memory model"), refitted to the two moments of Note [Memory model] from the
# same measured lines: the largest layer factor of the CP splits (4 x 1: slope 136,340 bytes per
# token; 2 x 2 and 1 x 4 read 0.60 and 0.67 with the contiguous Ulysses output) and the overhead of
# the 2 x 2 line (intercept 3,124,789,432 bytes), raised by the layer's gradients (436,232,192
# bytes) that run allocated during the step rather than before it (measured in fp32: allocating
# them first raises the line by their bytes and leaves the slope unchanged). Its peaks were read by
# StorageTracker; on the same layer in fp32 the CPU allocator (AllocatorTracker, now the script's
# default) reads the same intercept and a 6.6-9.9% lower slope, so the factor errs high.
CPU_CALIBRATION = Calibration(
    layer_factor=0.8145,
    overhead_bytes=587_210_936,
    source="scripts/bench_longest.py, CPU, bf16, 2 x 2 / 1 x 4 / 4 x 1, one Llama-8B-shaped layer (two moments)",
)

# Measured by scripts/bench_longest.py on one NVIDIA H200 (torch 2.11, CUDA 13.0, PyTorch's bundled
# FlashAttention; torch.cuda.max_memory_allocated): one rank of a 2-layer Llama-8B-shaped stack,
# bf16, MLP in 64 chunks, frozen embedding and lm-head, at 40,960 to 65,536 tokens per rank (five
# lengths, two of them off the 4,096-token grid), every gradient allocated before the step.
# layer_factor and the overhead: ring 8 x 1 (the fit with the checkpoints in host memory, offload,
# read the same factor and overhead to five digits). split_factors: the same stack at 1 x 8
# (0.63593; with offload the same), 2 x 4 (0.58761) and 4 x 2 (0.65962; 8 x 8 the same), refitted
# after Ulysses began exchanging dout first and freeing its own K/V early; their fitted overheads
# are within 3 MiB of ring 8's. "hybrid" is the larger of the two (a ring of 2 has no step whose
# transfers overlap the previous step's, so fewer ring buffers are alive), which errs high for a
# ring of 2. The model is within 0.05% of every peak of its split (docs/performance.md, "On a GPU").
GPU_CALIBRATION = Calibration(
    layer_factor=0.78272,
    overhead_bytes=69_849_186,
    source="scripts/bench_longest.py, one H200, bf16, 2 Llama-8B-shaped layers, MLP in 64 chunks: ring 8 x 1; "
           "split factors at 1 x 8, 2 x 4, 4 x 2",
    split_factors=(("ulysses", 0.63593), ("hybrid", 0.65962)),
)


@dataclass(frozen=True)
class Moment:
    """What one rank holds at one moment of a training step (Note [Memory model]): ``fixed``
    bytes per rank and ``per_token`` bytes per local token, term by term.

    ``short`` names fixed terms that shrink for short sequences: ``{name: (n, bytes_per_token,
    floor)}`` is ``max(min(T, n) * bytes_per_token, floor)`` at ``T`` tokens (the tiled loss's
    chunk holds ``min(T, chunk)`` tokens); ``fixed[name]`` is its value for ``T >= n``.
    """

    fixed: dict[str, float]
    per_token: dict[str, float]
    short: dict[str, tuple[int, float, float]] = field(default_factory=dict)

    @property
    def fixed_bytes(self) -> float:
        """The sum of the fixed terms (bytes per rank)."""
        return sum(self.fixed.values())

    @property
    def bytes_per_token(self) -> float:
        """The sum of the per-token terms (bytes per local token)."""
        return sum(self.per_token.values())

    def bytes_at(self, local_tokens: int) -> float:
        """Bytes of this moment at ``local_tokens`` tokens per rank (reserve excluded)."""
        total = self.fixed_bytes + local_tokens * self.bytes_per_token
        for name, (n, per_token, floor) in self.short.items():
            total += max(min(local_tokens, n) * per_token, floor) - self.fixed[name]
        return total


@dataclass(frozen=True)
class MemoryPrediction:
    """What :func:`longest_context` predicts for one rank (Note [Memory model]).

    Attributes:
        model: the shape.
        ring, ulysses, dp: ``R``, ``U`` and the data-parallel replicas.
        device_bytes, reserve_bytes, host_bytes: the inputs (``host_bytes`` ``None``: unbounded).
        bytes_per_token_per_rank: device bytes per local token at the moment that sets the limit.
        host_bytes_per_token_per_rank: host bytes per local token (offloaded checkpoints).
        fixed_bytes_per_rank: device bytes independent of the length at that moment, ``reserve``
            excluded.
        longest_local_tokens: the largest ``T`` that fits (0 if none).
        longest_tokens: the longest sequence ``S = T * R * U``.
        limited_by: ``"device"`` or ``"host"`` memory.
        limited_by_moment: ``"layer"`` (a layer's recompute and backward) or ``"loss"`` (the
            loss's backward): the moment whose device bytes reach ``device_bytes`` first.
        moments: ``{"layer": Moment, "loss": Moment}``, every term of both.
        options: the training options the prediction assumed.
        calibration: the measured constants used.
    """

    model: ModelShape
    ring: int
    ulysses: int
    dp: int
    device_bytes: int
    reserve_bytes: int
    host_bytes: int | None
    bytes_per_token_per_rank: float
    host_bytes_per_token_per_rank: float
    fixed_bytes_per_rank: float
    longest_local_tokens: int
    longest_tokens: int
    limited_by: str
    limited_by_moment: str
    moments: dict[str, Moment] = field(repr=False)
    options: dict[str, object] = field(repr=False)
    calibration: Calibration = field(repr=False)

    @property
    def per_token(self) -> dict[str, float]:
        """The per-token terms of the moment that sets the limit."""
        return dict(self.moments[self.limited_by_moment].per_token)

    @property
    def fixed(self) -> dict[str, float]:
        """The fixed terms of the moment that sets the limit."""
        return dict(self.moments[self.limited_by_moment].fixed)

    @property
    def breakdown(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{moment: {"per_token": ..., "fixed": ...}}``: every term of both moments by name."""
        return {name: {"per_token": dict(m.per_token), "fixed": dict(m.fixed)} for name, m in self.moments.items()}

    def moment_at(self, local_tokens: int) -> str:
        """The moment (``"layer"`` or ``"loss"``) that holds the most at ``local_tokens`` tokens."""
        return max(self.moments, key=lambda name: self.moments[name].bytes_at(local_tokens))

    def device_bytes_at(self, local_tokens: int) -> float:
        """Predicted peak device bytes of the rank at ``local_tokens`` tokens: the larger moment,
        reserve included."""
        return self.reserve_bytes + self.moments[self.moment_at(local_tokens)].bytes_at(local_tokens)

    def table(self) -> str:
        """Both moments' terms and the result as a readable table."""
        names = list(self.moments)
        lines = [f"{self.ring} x {self.ulysses} (dp {self.dp}), device {self.device_bytes / GiB:.1f} GiB:",
                 f"  {'per token (bytes/local token)':<44}" + "".join(f"{n + ' moment':>14}" for n in names)]

        def rows(kind: str, scale: float, fmt: str) -> None:
            keys = list(dict.fromkeys(k for m in self.moments.values() for k in getattr(m, kind)))
            keys.sort(key=lambda k: k == "overhead (measured)")  # last, after every derived term
            for k in keys:
                cells = [getattr(self.moments[n], kind).get(k) for n in names]
                lines.append(f"  {k:<44}" + "".join(f"{'--':>14}" if c is None else f"{c / scale:>14{fmt}}"
                                                    for c in cells))

        rows("per_token", 1, ",.0f")
        lines.append(f"  {'  sum':<44}" + "".join(f"{self.moments[n].bytes_per_token:>14,.0f}" for n in names))
        lines.append(f"  {'fixed (GiB per rank)':<44}")
        rows("fixed", GiB, ".3f")
        lines.append(f"  {'  sum':<44}" + "".join(f"{self.moments[n].fixed_bytes / GiB:>14.3f}" for n in names))
        lines.append(f"  {'reserve (not measured; an input)':<44}{self.reserve_bytes / GiB:>14.3f}")
        lines.append(f"  longest: {self.longest_local_tokens:,} tokens per rank, {self.longest_tokens:,} tokens "
                     f"(limited by {self.limited_by} memory at the {self.limited_by_moment}'s moment)")
        return "\n".join(lines)


def _ulysses_heads(model: ModelShape, ulysses: int) -> tuple[int, int]:
    """The busiest Ulysses rank's query heads and kernel K/V heads (``head_assignments``)."""
    from ..placement.heads import head_assignments

    assignments = head_assignments(model.heads, model.kv_heads, ulysses)
    return max(a.q_len for a in assignments), max(a.kernel_kv_heads for a in assignments)


def _layer_saved(model: ModelShape, ulysses: int, mlp_chunks: int, keep_head_shards: bool = False) -> float:
    """Bytes per local token one layer's forward saves for backward (no checkpointing): the
    shard's q, k, v, out and the log-sum-exp, or with ``keep_head_shards`` (``U > 1``) the
    shard's out (the output projection's input) and the head shards q_u, k_u, v_u, out_u."""
    e, D, U = model.element_size, model.head_dim, ulysses
    H, Hkv = model.heads, model.kv_heads
    saved = e * 4 * model.hidden
    if U > 1:
        h, kv = _ulysses_heads(model, U)
        saved += 4 * U * h  # the log-sum-exp of this rank's heads over all U * T tokens
        if keep_head_shards:
            saved += e * (H * D + U * (2 * h + 2 * kv) * D)
        else:
            saved += e * (2 * H + 2 * Hkv) * D
    else:
        saved += e * (2 * H + 2 * Hkv) * D + 4 * H
    if mlp_chunks == 1:
        saved += 4 * model.ffn * e  # gate, up, activation, product
    return saved


def _kept_head_shards(model: ModelShape, ulysses: int) -> int:
    """Bytes per local token a checkpointed layer holds more with ``keep_head_shards``: the head
    shards q_u, k_u, v_u, out_u saved instead of the shard's q, k, v, out, whose out the output
    projection saves anyway (Note [Memory model])."""
    h, kv = _ulysses_heads(model, ulysses)
    return model.element_size * (ulysses * (2 * h + 2 * kv) - model.heads - 2 * model.kv_heads) * model.head_dim


def group_shapes(num_heads: int, num_kv_heads: int, head_groups: int) -> list[tuple[int, int, bool]]:
    """Each of ``head_groups`` groups of query heads as ``seqpar.attention`` runs it (Note [Head
    groups] in ``seqpar/attention.py``): ``(query heads, K/V heads, expanded)``, the query heads by
    ``split_sizes(H, G)``; a group carries the K/V heads its query heads read, or one K/V head per
    query head (``expanded``) where they read them unevenly. The memory model and the planner
    (``seqpar.planner.predict``) both count groups from this list."""
    from ..placement.sizes import split_sizes

    rep, start, shapes = num_heads // num_kv_heads, 0, []
    for size in split_sizes(num_heads, head_groups):
        reads = [q // rep for q in range(start, start + size)]
        even = len({reads.count(j) for j in set(reads)}) == 1
        shapes.append((size, len(set(reads)) if even else size, not even))
        start += size
    return shapes


def _group_heads(model: ModelShape, ulysses: int, head_groups: int) -> tuple[int, int]:
    """The busiest rank's query heads and kernel K/V heads in the largest of ``head_groups``
    groups of query heads (:func:`group_shapes`)."""
    from ..placement.heads import head_assignments

    if head_groups == 1:
        return _ulysses_heads(model, ulysses) if ulysses > 1 else (model.heads, model.kv_heads)
    h = kv = 0
    for size, n_kv, _ in group_shapes(model.heads, model.kv_heads, head_groups):
        for a in head_assignments(size, n_kv, ulysses):
            h, kv = max(h, a.q_len), max(kv, a.kernel_kv_heads)
    return h, kv


def _layer_working_set(model: ModelShape, ring: int, ulysses: int, mlp_chunks: int, head_groups: int = 1) -> float:
    """Derived bytes per local token of ONE layer's backward (Note [Memory model]), unscaled.
    With ``head_groups`` the head-sharded copies, the accumulators and the ring's slots are the
    largest group's; the shard's tensors, their gradients and the LSEs are the call's."""
    e, D, R, U = model.element_size, model.head_dim, ring, ulysses
    H, Hkv = model.heads, model.kv_heads
    w = e * 6 * model.hidden  # norm outputs, residual, incoming / outgoing gradients
    w += e * 2 * (2 * H + 2 * Hkv) * D  # q, k, v, out of the shard and their gradients
    w += 4 * H  # log-sum-exps
    h, kv = _group_heads(model, U, head_groups)
    if U > 1:
        w += e * 2 * U * (3 * h + 2 * kv) * D + 4 * U * h  # head-sharded q, k, v, out, dout + staging
    w += 4 * U * (h + 2 * kv) * D  # fp32 dq, dk, dv accumulators
    if R > 1:
        w += e * 2 * 2 * 2 * U * kv * D  # two K/V slots and two dK/dV slots
        w += 4 * 2 * U * kv * D  # dK/dV summed in fp32
    w += e * 5 * model.ffn / mlp_chunks  # one MLP chunk: 4 intermediates and a gradient
    return w


def longest_context(
    model: ModelShape,
    *,
    ring: int = 1,
    ulysses: int = 1,
    dp: int = 1,
    device_bytes: int,
    reserve_bytes: int = 2 * GiB,
    host_bytes: int | None = None,
    checkpointing: bool = True,
    offload: bool = False,
    tiled_loss: bool = True,
    loss_chunk_tokens: int | None = None,
    tiled_mlp_chunks: int = 1,
    keep_head_shards: bool = False,
    head_groups: int = 1,
    zero_stage: int = 3,
    grad_bytes: int | None = None,
    optimizer_bytes_per_param: int = 12,
    train_embeddings: bool = True,
    calibration: Calibration | None = None,
) -> MemoryPrediction:
    """The longest sequence one CP group of ``R * U`` ranks trains on, and the bytes behind it.

    Note [Memory model] is the reference; ``docs/planner.md`` shows calls. Host arithmetic only.

    Args:
        model: the shape (:meth:`ModelShape.llama3_8b` for Llama-3-8B).
        ring, ulysses: ``R`` and ``U`` of the CP group.
        dp: data-parallel replicas (they only shard the ZeRO state: ``dp * R * U`` ranks).
        device_bytes: memory of one device (e.g. ``80 * 10**9`` for an 80 GB H100).
        reserve_bytes: device bytes set aside for what is not modelled (CUDA context, NCCL
            buffers, allocator fragmentation); an assumption, not a measurement.
        host_bytes: host memory available per rank for offloaded activations (``None``: no limit).
        checkpointing: activation checkpointing per layer.
        offload: checkpointed layer inputs in host memory (needs ``checkpointing``).
        tiled_loss: ``linear_cross_entropy`` (no ``[T, V]`` logits) instead of a plain loss.
        loss_chunk_tokens: its tokens per chunk (``None``: its default, ``2**24 // V``).
        tiled_mlp_chunks: ``TiledTokenwise`` chunks of the MLP (1: untiled).
        keep_head_shards: ``ParallelState(keep_head_shards=True)`` (``U > 1``): every layer saves
            the Ulysses head shards q_u, k_u, v_u, out_u instead of the shard's q, k, v, out, while
            the output projection still saves the shard's out: at least one output per token
            more (more with ``Hkv < U``), checkpointed or not. Less traffic, never more context.
        head_groups: the attention calls' ``head_groups`` (Note [Head groups] in
            ``seqpar/attention.py``): the layer's head-sharded copies, fp32 accumulators and ring
            slots are those of the largest group of query heads (``split_sizes(H, G)``); the
            shard's q, k, v, out, their gradients and every saved tensor are not. 1: all heads.
        zero_stage: 0 (replicated), 1 (optimizer sharded), 2 (+ gradients), 3 (+ parameters;
            FSDP), over the ``dp * R * U`` ranks.
        grad_bytes: bytes per gradient element (``None``: the model's element size).
        optimizer_bytes_per_param: optimizer state per trainable parameter (12: fp32 master weights
            and Adam's moments; 0 for a forward+backward without an optimizer).
        train_embeddings: whether the embedding and lm-head take gradients and optimizer state.
        calibration: the measured constants (default :data:`CPU_CALIBRATION`;
            :data:`GPU_CALIBRATION` is one H200's, measured at ring 8).

    Returns:
        :class:`MemoryPrediction`: ``bytes_per_token_per_rank``, ``fixed_bytes_per_rank`` and
        ``limited_by_moment`` of the moment that sets the limit, ``longest_tokens``, every
        moment's terms (``moments``).

    Raises:
        ValueError: a non-positive size, an unknown ZeRO stage, ``offload`` without
            ``checkpointing``, or a ``device_bytes`` below the fixed bytes (the message names them).
    """
    where = "longest_context"
    if not isinstance(model, ModelShape):
        raise ValueError(f"{where}: model must be a ModelShape (e.g. ModelShape.llama3_8b()), got {type(model).__name__}")
    for name, value in (("ring", ring), ("ulysses", ulysses), ("dp", dp), ("device_bytes", device_bytes),
                        ("tiled_mlp_chunks", tiled_mlp_chunks), ("head_groups", head_groups)):
        _positive(where, name, value)
    if head_groups > model.heads:
        raise ValueError(f"{where}: head_groups={head_groups} is more than the model's {model.heads} query heads; "
                         f"use head_groups <= {model.heads}")
    for name, value in (("reserve_bytes", reserve_bytes), ("optimizer_bytes_per_param", optimizer_bytes_per_param)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {name} must be a non-negative int, got {value!r}")
    if host_bytes is not None:
        _positive(where, "host_bytes", host_bytes)
    if loss_chunk_tokens is not None:
        _positive(where, "loss_chunk_tokens", loss_chunk_tokens)
    if grad_bytes is not None:
        _positive(where, "grad_bytes", grad_bytes)
    if not isinstance(keep_head_shards, bool):
        raise ValueError(f"{where}: keep_head_shards must be True or False, got {keep_head_shards!r}")
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"{where}: zero_stage={zero_stage!r}; valid: 0, 1, 2, 3")
    if offload and not checkpointing:
        raise ValueError(f"{where}: offload=True keeps the checkpointed layer inputs on the host; "
                         "set checkpointing=True (or offload=False)")
    cal = calibration if calibration is not None else CPU_CALIBRATION
    if not isinstance(cal, Calibration):
        raise ValueError(f"{where}: calibration must be a Calibration, got {type(cal).__name__}")

    e, hid, V, R, U = model.element_size, model.hidden, model.vocab, ring, ulysses
    g = model.element_size if grad_bytes is None else grad_bytes
    world = dp * R * U

    # Alive at both moments: the sharded training state, the checkpoints, the ids and labels.
    P = model.parameters
    trainable = P if train_embeddings else P - model.embedding_parameters
    common_fixed: dict[str, float] = {
        "parameters": P * e / (world if zero_stage >= 3 else 1),
        "gradients": trainable * g / (world if zero_stage >= 2 else 1),
        "optimizer state": trainable * optimizer_bytes_per_param / (world if zero_stage >= 1 else 1),
    }
    common_per_token: dict[str, float] = {}
    host_per_token = 0.0
    if checkpointing:
        ckpt = float(model.layers * hid * e)
        if offload:
            host_per_token += ckpt
            common_per_token["layer inputs (checkpoints)"] = 0.0
        else:
            common_per_token["layer inputs (checkpoints)"] = ckpt
    else:
        common_per_token["saved activations, every layer"] = model.layers * _layer_saved(
            model, U, tiled_mlp_chunks, keep_head_shards)
    common_per_token["ids and labels (int64)"] = 16.0

    # The layer's moment: one layer recomputes and back-propagates.
    layer_fixed = dict(common_fixed)
    if zero_stage == 3 and world > 1:
        # The running layer and the prefetched one, and the running layer's unsharded gradients
        # (reduce-scattered once its backward ends).
        layer = model.layer_parameters
        layer_fixed["ZeRO-3 gathered layers"] = float(2 * layer * e + layer * g)
    # The measured overhead is a layer's: the loss's moment is derived whole (Note [Memory model]).
    layer_fixed["overhead (measured)"] = float(cal.overhead_bytes)
    layer_per_token = dict(common_per_token)
    if offload:  # the recomputed layer's input, copied back to the device (offload needs checkpointing)
        layer_per_token["running layer's input (copied back)"] = float(hid * e)
    layer_per_token["one layer's working set (x layer_factor)"] = (
        cal.factor_for(R, U) * _layer_working_set(model, R, U, tiled_mlp_chunks, head_groups))
    if checkpointing and keep_head_shards and U > 1:
        layer_per_token["kept head shards (keep_head_shards)"] = float(_kept_head_shards(model, U))

    # The loss's moment: the end of the loss's backward, before any layer's.
    loss_fixed = dict(common_fixed)
    if zero_stage == 3 and world > 1:
        loss_fixed["ZeRO-3 gathered lm-head"] = float(V * hid * e)
    acc = max(4, e)  # the tiled loss computes logits and accumulates dW in at least fp32
    cast = e if e < 4 else 0  # ... and casts to the model's dtype
    short: dict[str, tuple[int, float, float]] = {}
    if tiled_loss:
        # The library's default chunk for a sequence longer than one chunk (``short`` covers shorter).
        chunk = loss_chunk_tokens if loss_chunk_tokens is not None else default_chunk_size(1 << 62, V)
        if train_embeddings:
            loss_fixed["lm-head gradient (fp32 accumulator)"] = float(V * hid * acc)
            # One chunk's logits (and their cast) in the loop, or dW's cast after it: never both.
            name, floor = "loss chunk, or dW's cast after it", float(V * hid * cast)
        else:
            name, floor = "loss chunk", 0.0
        loss_fixed[name] = max(float(chunk * V * (acc + cast)), floor)
        short[name] = (chunk, float(V * (acc + cast)), floor)  # a shorter sequence is one shorter chunk
    elif train_embeddings:
        loss_fixed["lm-head gradient"] = float(V * hid * e)
    loss_per_token = dict(common_per_token)
    # nn.RMSNorm saves its input, the normalized input (in fp32) and, for half dtypes, the input's
    # fp32 copy; the loss saves the norm's output; its gradient; the lse and masks (8 bytes).
    final = hid * (3 * e + 4 + (4 if e < 4 else 0)) + 8
    if not tiled_loss:
        final += V * (4 + 4 + e)  # fp32 logits, their gradient, a copy in the model's dtype
    loss_per_token["final norm + loss inputs, their gradient"] = float(final)

    moments = {
        "layer": Moment(fixed=layer_fixed, per_token=layer_per_token),
        "loss": Moment(fixed=loss_fixed, per_token=loss_per_token, short=short),
    }
    budget = device_bytes - reserve_bytes
    fits = {}
    for name, m in moments.items():
        free = budget - m.fixed_bytes
        if free < m.bytes_per_token:
            raise ValueError(
                f"{where}: nothing fits: at the {name}'s moment the fixed bytes per rank "
                f"({m.fixed_bytes / GiB:.2f} GiB: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in m.fixed.items())
                + f") plus reserve_bytes ({reserve_bytes / GiB:.2f} GiB) leave {max(free, 0) / GiB:.2f} GiB of "
                f"device_bytes={device_bytes / GiB:.2f} GiB; shard more (zero_stage=3, more ranks) or use a larger "
                "device"
            )
        fits[name] = int(free // m.bytes_per_token)
    moment = min(fits, key=lambda name: (fits[name], name != "layer"))
    local, limited_by = fits[moment], "device"
    if host_bytes is not None and host_per_token > 0 and host_bytes // host_per_token < local:
        local, limited_by = int(host_bytes // host_per_token), "host"
    options = dict(checkpointing=checkpointing, offload=offload, tiled_loss=tiled_loss,
                   loss_chunk_tokens=loss_chunk_tokens, tiled_mlp_chunks=tiled_mlp_chunks,
                   keep_head_shards=keep_head_shards and U > 1, head_groups=head_groups, zero_stage=zero_stage,
                   grad_bytes=g, optimizer_bytes_per_param=optimizer_bytes_per_param,
                   train_embeddings=train_embeddings)
    return MemoryPrediction(
        model=model, ring=R, ulysses=U, dp=dp, device_bytes=device_bytes, reserve_bytes=reserve_bytes,
        host_bytes=host_bytes, bytes_per_token_per_rank=moments[moment].bytes_per_token,
        host_bytes_per_token_per_rank=host_per_token, fixed_bytes_per_rank=moments[moment].fixed_bytes,
        longest_local_tokens=local, longest_tokens=local * R * U, limited_by=limited_by,
        limited_by_moment=moment, moments=moments, options=options, calibration=cal,
    )


def derived(model: ModelShape, **options) -> MemoryPrediction:
    """:func:`longest_context` with the working set unscaled, no measured overhead and no
    reserve on an unbounded device: the derived terms of both moments (``options``: its other
    arguments)."""
    return longest_context(model, **{**options, "reserve_bytes": 0, "device_bytes": 1 << 62,
                                     "calibration": Calibration(1.0, 0, "derived")})


def calibrate_from_fit(
    slope: float, intercept: float, model: ModelShape, *, source: str, fit_tokens: tuple[int, ...] = (),
    **options
) -> Calibration:
    """The :class:`Calibration` that makes :func:`longest_context`'s layer moment reproduce a
    measured line.

    ``slope`` (bytes per local token) and ``intercept`` (bytes) come from a least-squares fit of
    measured peaks over local tokens (``scripts/bench_longest.py``); ``options`` are the
    :func:`longest_context` arguments of the measured run (``reserve_bytes`` is taken as 0). The
    line must be the layer's moment: with ``fit_tokens`` (the measured lengths) given, a length at
    which the calibrated model puts the peak at the loss's moment is refused.

    Raises:
        ValueError: a slope at or below the layer moment's exact per-token terms (no working set
            left to scale), or a fitted length where the loss's moment is the peak.
    """
    base = derived(model, **options)
    layer = base.moments["layer"]
    ws = layer.per_token["one layer's working set (x layer_factor)"]
    exact = layer.bytes_per_token - ws
    if slope <= exact:
        raise ValueError(f"calibrate_from_fit: the measured slope {slope:,.0f} B/token is not above the layer "
                         f"moment's exact per-token terms ({exact:,.0f} B/token); the run does not match the options")
    cal = Calibration(layer_factor=(slope - exact) / ws, overhead_bytes=round(intercept - layer.fixed_bytes),
                      source=source)
    loss = base.moments["loss"]
    for t in fit_tokens:
        at_loss = loss.bytes_at(t)
        at_layer = intercept + t * slope
        if at_loss > at_layer:
            raise ValueError(
                f"calibrate_from_fit: at {t:,} tokens per rank the model puts the peak at the loss's moment "
                f"({at_loss / GiB:.3f} GiB derived, against the fitted layer line's {at_layer / GiB:.3f} GiB), so "
                "the fit does not measure a layer's working set; fit at longer lengths (or with frozen embeddings)"
            )
    return cal
