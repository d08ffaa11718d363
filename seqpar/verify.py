"""``seqpar.verify``: run a model once on shards and once whole, and compare it module by module.

::

    report = seqpar.verify(model, state)               # a transformers model built with register(state)
    report = seqpar.verify(vit_blocks, state, tokens)  # an SDPA module, tokens [B, S, C] (full)

Note [Model self-check]
~~~~~~~~~~~~~~~~~~~~~~~
seqpar computes attention exactly; everything around it is the model's own code, and a layer that
mixes tokens outside attention (a convolution over tokens, a scan, a cumulative sum, a pooled
statistic) sees only its rank's tokens on shards and is silently wrong. ``verify`` finds such a
layer by running the model twice on every CP rank, on the same short full input (one exchange of
checksums first makes sure every rank holds that input and the same weights):

- **sharded**, the way users run it: the input sharded with ``seqpar.shard`` and, for transformers,
  ``position_ids=seqpar.shard_positions(S, state)[None]`` and the model's seqpar attention; an SDPA
  module under ``seqpar.parallel_sdpa(state)``;
- **reference**, on the full input with plain attention (transformers' ``"sdpa"``, or ``"eager"``
  for a model without it; plain SDPA), with the model check suspended for that call.

Forward pre-hooks and hooks on every submodule record each call's tensor inputs and outputs, and
tensor hooks their gradients. A tensor of the sharded run is compared with the same tokens of the
reference's: the dims whose size differs are sequence dims (``S_local`` against ``S``, or ``k``
times each for flattened batches), indexed by the rank's global positions; a tensor of the same
shape in both runs (a pooled or replicated value) is compared whole. An odd default length (37)
makes ``S_local != S`` on every split. Calls are matched by module path and call number.

The loss is a fixed random projection ``sum(out * P)`` of every floating output; on shards each rank
takes the share of its own tokens (a whole output counts ``1 / cp_size`` per rank), so, by the
partial-gradient convention (``docs/conventions.md``), a parameter's true gradient is the sum over
the CP group of the per-rank gradients, and a sharded activation's gradient is the full gradient at
the rank's tokens. Gradients of tensors compared whole are partial and are not compared.

The verdict names the first module, in the order calls finish (a module after its submodules),
whose output differs on some rank while its inputs agree there: the error starts inside it (in its
own code, if its submodules agree). With every forward exact it names the first module in backward
order whose input or parameter gradients differ while its output gradients agree. Each rank's
errors are all-gathered over the CP group, so every rank returns or raises the same verdict.
Both runs use the model in eval mode (no dropout) and, by default, in float64, so that the
tolerance separates rounding from a wrong algorithm; the model's dtypes and modes come back after.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .comm import all_gather, exchange_ints, reduce_
from .placement import Placement
from .sdpa import parallel_sdpa
from .sharding import shard, shard_positions
from .state import ParallelState, require_state

__all__ = ["verify", "VerifyReport", "ModuleCheck", "VerificationError"]

DEFAULT_SEQ_LEN = 37  # odd: no CP split gives a rank S / 2 or the full length
# Max abs error allowed, relative to max(1, the reference's magnitude), by the run's dtype. Not
# float64's rounding: models keep float32 islands in a float64 run (RMSNorm and RoPE in float32,
# eager attention's softmax in float32, complex64 rotations), whose rounding differs between a shard
# and the full sequence by ~1e-7 relative (Gemma 2 / 3, DeepSeek-V2, measured), a little more after
# a few layers; a layer that is wrong on shards is off by ~1e-2 to 1.
_TOL = {torch.float64: 1e-5, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class VerificationError(RuntimeError):
    """A model whose sharded run differs from its one-device run; ``report`` has every module."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(report.verdict)
        self.report = report


@dataclass(frozen=True)
class ModuleCheck:
    """One module's comparison, over all its calls and every CP rank.

    ``forward_error`` / ``grad_error``: max abs error of its outputs / of its input, output and
    (CP-summed) parameter gradients against the reference, ``nan`` where nothing was compared.
    ``ranks``: the CP ranks where its output differs (beyond the tolerance); where every module's
    output agrees, where its gradients differ (all of them for a summed parameter gradient).
    ``note``: what was not compared, and why.
    """

    path: str
    forward_error: float
    grad_error: float
    ranks: tuple[int, ...]
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.ranks


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found: ``modules`` in the order their first calls finished, and the
    first module where the sharded run departs from the reference (``None`` when it agrees)."""

    where: str
    tol: float
    modules: tuple[ModuleCheck, ...]
    culprit: ModuleCheck | None
    verdict: str

    @property
    def ok(self) -> bool:
        return self.culprit is None

    def __str__(self) -> str:
        width = max([len(m.path) for m in self.modules] + [6])
        lines = [f"seqpar.verify: {self.where}, tolerance {self.tol:g} x max(1, |reference|)",
                 f"  {'module':<{width}}  {'forward':>9}  {'grad':>9}  differs on"]
        for m in self.modules:
            mark = ">" if m is self.culprit else " "
            ranks = f"ranks {_ranges(m.ranks)}" if m.ranks else ""
            note = f"  ({m.note})" if m.note else ""
            row = f"{m.path:<{width}}  {_num(m.forward_error):>9}  {_num(m.grad_error):>9}"
            lines.append(f"{mark} {row}  {ranks}{note}")
        lines.append(self.verdict)
        return "\n".join(lines)


# --- the two ways of running a model ----------------------------------------------------------------


class _Runner(Protocol):
    """How one kind of model runs on shards and whole (the same full input on every rank)."""

    seq_len: int

    def reference(self, model: nn.Module) -> Any: ...

    def sharded(self, model: nn.Module) -> Any: ...

    def leaves(self) -> list[Tensor]: ...  # inputs that get gradients (besides the parameters)


@dataclass
class _TransformersRunner:
    """A model built with ``attn_implementation=register(state)``: ``input_ids`` ``[B, S]``."""

    input_ids: Tensor
    state: ParallelState

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def reference(self, model: nn.Module) -> Any:
        from .integrations.transformers_guard import suspended

        positions = torch.arange(self.seq_len, device=self.input_ids.device)[None]
        with suspended(model), _plain_attention(model):
            return model(input_ids=self.input_ids, position_ids=positions, use_cache=False)

    def sharded(self, model: nn.Module) -> Any:
        positions = shard_positions(self.seq_len, self.state, device=self.input_ids.device)[None]
        return model(input_ids=shard(self.input_ids, self.state), position_ids=positions, use_cache=False)

    def leaves(self) -> list[Tensor]:
        return []


@dataclass
class _SdpaRunner:
    """A module calling ``F.scaled_dot_product_attention`` on token shards, sequence along ``seq_dim``."""

    inputs: Tensor
    state: ParallelState
    seq_dim: int
    _leaf: Tensor | None = None

    @property
    def seq_len(self) -> int:
        return self.inputs.shape[self.seq_dim]

    def _fresh(self) -> Tensor:
        x = self.inputs.detach().clone()
        self._leaf = x.requires_grad_() if x.is_floating_point() else None
        return x

    def reference(self, model: nn.Module) -> Any:
        return model(self._fresh())

    def sharded(self, model: nn.Module) -> Any:
        x = self._fresh()
        with parallel_sdpa(self.state):
            return model(shard(x, self.state, dim=self.seq_dim))

    def leaves(self) -> list[Tensor]:
        return [] if self._leaf is None else [self._leaf]


def _plain_attention_name(model: nn.Module) -> str:
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


@contextlib.contextmanager
def _plain_attention(model: nn.Module) -> Iterator[None]:
    """Switch a transformers model (and its sub-configs) to plain attention; restore every config."""
    configs: dict[int, Any] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        config = todo.pop()
        if config is None or id(config) in configs or not hasattr(config, "_attn_implementation_internal"):
            continue
        configs[id(config)] = (config, config._attn_implementation_internal)
        todo.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))
    plain = _plain_attention_name(model)
    try:
        model.set_attn_implementation(plain)
        if model.config._attn_implementation != plain:  # transformers only warns
            raise ValueError(
                f"seqpar.verify: {type(model).__name__} cannot switch its attention implementation to {plain!r} "
                "for the one-device reference run (transformers: it does not use the attention interface)"
            )
        yield
    finally:
        for config, name in configs.values():
            config._attn_implementation_internal = name


def _runner(model: nn.Module, state: ParallelState, inputs: Tensor | None, seq_dim: int) -> _Runner:
    """The runner of ``model``'s kind, with its inputs checked (no communication)."""
    where = "seqpar.verify"
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from .integrations.transformers_guard import binding

        name = getattr(model.config, "_attn_implementation", None)
        bound = binding(name)
        if bound is None:
            raise ValueError(
                f"{where}: this {type(model).__name__} was built with attn_implementation={name!r}, not "
                "seqpar's; build it with attn_implementation=seqpar.integrations.transformers.register(state)"
            )
        if bound.state is not state:
            raise ValueError(
                f"{where}: this {type(model).__name__}'s attention {name!r} was registered with another "
                "ParallelState; pass that state, or register(state) with this one and build the model again"
            )
        if inputs is None:
            vocab = int(getattr(model.config, "vocab_size", None) or getattr(model.get_text_config(), "vocab_size"))
            device = next(model.parameters()).device
            inputs = torch.randint(0, vocab, (1, DEFAULT_SEQ_LEN), generator=torch.Generator().manual_seed(0))
            inputs = inputs.to(device)
        if not isinstance(inputs, Tensor) or inputs.dim() != 2 or inputs.is_floating_point():
            got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"{where}: a transformers model takes input_ids [B, S] (integers, full length), got {got}")
        return _TransformersRunner(inputs, state)
    if not isinstance(inputs, Tensor):
        raise ValueError(
            f"{where}: {type(model).__name__} is not a transformers model built with register(state), so "
            "verify runs it under seqpar.parallel_sdpa(state): pass its full input, e.g. tokens [B, S, C] "
            f"with seq_dim=1 (got inputs={type(inputs).__name__})"
        )
    if not -inputs.dim() <= seq_dim < inputs.dim():
        raise ValueError(f"{where}: seq_dim={seq_dim} is out of range for inputs {tuple(inputs.shape)}")
    return _SdpaRunner(inputs, state, seq_dim % inputs.dim())


# --- recording one run -------------------------------------------------------------------------------


@dataclass
class _Call:
    """One call of one module: its tensor inputs and outputs (labelled), and their gradients."""

    path: str
    number: int  # 0 for its first call
    start: int  # calls started before it (with its place in the finished order: which calls nest)
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor] = field(default_factory=dict)
    input_grads: dict[str, Tensor] = field(default_factory=dict)
    output_grads: dict[str, Tensor] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return self.path, self.number


def _labelled(obj: Any, label: str = "", depth: int = 0) -> Iterator[tuple[str, Tensor]]:
    """Every tensor in ``obj`` (nested tuples, lists and dicts, e.g. a ``ModelOutput``) with its path."""
    if isinstance(obj, Tensor):
        yield label, obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from _labelled(x, f"{label}.{i}" if label else str(i), depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for k, x in obj.items():
            yield from _labelled(x, f"{label}.{k}" if label else str(k), depth + 1)


class _Recorder:
    """Hooks on every submodule of ``model`` that record one run's calls in the order they finish."""

    def __init__(self, model: nn.Module, root: str) -> None:
        self.calls: list[_Call] = []
        self._open: list[_Call] = []
        self._counts: dict[str, int] = {}
        self._started = 0
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            path = name or root
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre, path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(functools.partial(self._post, path)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _keep(self, tensors: Iterator[tuple[str, Tensor]], values: dict[str, Tensor], grads: dict[str, Tensor]) -> None:
        for label, t in tensors:
            values[label] = t.detach().clone()
            if t.requires_grad and torch.is_grad_enabled():
                t.register_hook(functools.partial(_store, grads, label))

    def _pre(self, path: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        number = self._counts.get(path, 0)
        self._counts[path] = number + 1
        call = _Call(path, number, self._started, {})
        self._started += 1
        self._keep(_labelled((args, kwargs)), call.inputs, call.input_grads)
        self._open.append(call)

    def _post(self, path: str, module: nn.Module, args: tuple, output: Any) -> None:
        call = self._open.pop()
        self._keep(_labelled(output), call.outputs, call.output_grads)
        self.calls.append(call)


def _store(grads: dict[str, Tensor], label: str, grad: Tensor) -> None:
    grads[label] = grad.detach().clone()


@contextlib.contextmanager
def _prepared(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``model`` in eval mode and, unless ``dtype`` is None, its floating parameters and buffers in
    ``dtype`` (in place: the same Parameter objects); modes and dtypes restored on exit."""
    modes = [(m, m.training) for m in model.modules()]
    tensors = [*model.parameters(), *model.buffers()]
    dtypes = [(t, t.dtype) for t in tensors if dtype is not None and t.is_floating_point() and t.dtype != dtype]
    model.eval()
    try:
        for t, _ in dtypes:
            t.data = t.data.to(dtype)
        yield
    finally:
        for t, old in dtypes:
            t.data = t.data.to(old)
        for m, training in modes:
            m.training = training


# --- comparing ------------------------------------------------------------------------------------------


def _local(full: Tensor, shape: torch.Size, positions: Tensor, seq_len: int) -> Tensor | None:
    """The rank's tokens of ``full`` (a reference tensor) in the layout of a sharded tensor of
    ``shape``: dims of size ``k * S_local`` against ``k * S`` are sequence dims (``[k, S]``
    flattened, tokens inner), indexed by ``positions``; ``None`` if the shapes are no shard of one
    another."""
    return next(_locals(full, shape, positions, seq_len, inner_factors=False), None)


def _locals(full: Tensor, shape: torch.Size, positions: Tensor, seq_len: int, *, inner_factors: bool = True):
    """Every reading of :func:`_local`: a dim of ``k * S`` elements may also hold ``[k_out, S,
    k_in]`` flattened (``k_out * k_in = k``: ``[B, S, H, D]`` reshaped to ``[B * S * H, D]`` by a
    per-head norm), which the sizes alone cannot tell apart; each factorisation is one reading."""
    if full.dim() != len(shape):
        return
    n = positions.numel()
    readings = [full]
    for d, (a, b) in enumerate(zip(shape, full.shape)):
        if a == b:
            continue
        if b % seq_len or a != b // seq_len * n:
            return
        k = b // seq_len
        inner = [i for i in range(1, k + 1) if k % i == 0] if inner_factors else [1]
        index = positions.to(full.device)
        readings = [
            r.unflatten(d, (k // i, seq_len, i)).index_select(d + 1, index).flatten(d, d + 2)
            for r in readings for i in inner
        ]
    yield from readings


def _error(sharded: Tensor, reference: Tensor) -> tuple[float, float]:
    """``(max abs error, max abs reference)`` in float64; NaN in both places, or the same infinity
    (a mask's ``-inf``, DeepSeek-V4's block bias), counts as equal."""
    a, b = (torch.view_as_real(t.detach()) if t.is_complex() else t.detach() for t in (sharded, reference))
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return 0.0, 0.0
    diff = (a - b).abs()
    same = (a.isnan() & b.isnan()) | (a.isinf() & (a == b))
    diff = torch.where(same, torch.zeros_like(diff), diff).nan_to_num(nan=math.inf)
    return float(diff.max()), float(b.abs().nan_to_num(nan=0.0).max())


@dataclass
class _Compared:
    """One comparison's outcome on this rank: worst error, whether any exceeded the tolerance."""

    error: float = math.nan
    bad: bool = False
    unmatched: int = 0  # tensors whose shapes are no shard of the reference's: not compared

    def add(self, error: float, scale: float, tol: float) -> None:
        self.error = error if math.isnan(self.error) else max(self.error, error)
        self.bad = self.bad or not error <= tol * max(1.0, scale)


def _compare(sharded: dict[str, Tensor], reference: dict[str, Tensor], positions: Tensor, seq_len: int,
             tol: float, whole: bool) -> _Compared:
    """Compare the labelled tensors both runs have; ``whole``: also those of the same shape
    (values; gradients of such tensors are partial and are left out)."""
    out = _Compared()
    for label, ref in reference.items():
        mine = sharded.get(label)
        if mine is None:
            continue
        readings = list(_locals(ref, mine.shape, positions, seq_len))
        if not readings:
            out.unmatched += 1
        elif mine.shape != ref.shape or whole or positions.numel() == seq_len:
            # The reading that agrees best: a wrong result does not match every token layout.
            out.add(*min((_error(mine, local) for local in readings), key=lambda e: e[0]), tol)
    return out


# Row of one call on one rank, all-gathered over the CP group (bad flags as 0/1, errors NaN if none).
_CALLED, _IN_BAD, _OUT, _OUT_BAD, _OGRAD, _OGRAD_BAD, _IGRAD, _IGRAD_BAD, _UNMATCHED = range(9)
_COLUMNS = 9


def _row(call: _Call | None, ref: _Call, positions: Tensor, seq_len: int, tol: float) -> list[float]:
    if call is None:
        return [0.0, 0.0, math.nan, 0.0, math.nan, 0.0, math.nan, 0.0, 0.0]
    args = (positions, seq_len, tol)
    inputs = _compare(call.inputs, ref.inputs, *args, whole=True)
    outputs = _compare(call.outputs, ref.outputs, *args, whole=True)
    ograds = _compare(call.output_grads, ref.output_grads, *args, whole=False)
    igrads = _compare(call.input_grads, ref.input_grads, *args, whole=False)
    unmatched = inputs.unmatched + outputs.unmatched + ograds.unmatched + igrads.unmatched
    return [1.0, float(inputs.bad), outputs.error, float(outputs.bad), ograds.error, float(ograds.bad),
            igrads.error, float(igrads.bad), float(unmatched)]


def _projection_loss(output: Any, shapes: dict[str, torch.Size], positions: Tensor, seq_len: int,
                     cp_size: int, left_out: list[str]) -> Tensor | None:
    """``sum(out * P)`` over the floating outputs, ``P`` fixed random of the reference shape; on
    shards this rank's share (its tokens of ``P``; a whole output ``/ cp_size``). The labels of
    outputs that are no shard of the reference's go to ``left_out``."""
    loss = None
    for i, (label, t) in enumerate(_labelled(output)):
        if not (t.is_floating_point() and t.requires_grad and label in shapes):
            continue
        p = torch.randn(shapes[label], generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64)
        local = _local(p.to(t.device), t.shape, positions, seq_len)
        if local is None:
            left_out.append(label)
            continue
        share = (t * local.to(t.dtype)).sum()
        if t.shape == shapes[label] and positions.numel() != seq_len:
            share = share / cp_size
        loss = share if loss is None else loss + share
    return loss


def _grads(loss: Tensor | None, params: list[Tensor], leaves: list[Tensor]) -> list[Tensor | None]:
    """Gradients of ``loss`` for ``params`` (tensor hooks fire on the way); Nones without a loss."""
    targets = [*params, *leaves]
    if loss is None or not targets:
        return [None] * len(params)
    return list(torch.autograd.grad(loss, targets, allow_unused=True))[: len(params)]


# --- the check ------------------------------------------------------------------------------------------


def _ranges(ranks: tuple[int, ...]) -> str:
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _num(x: float) -> str:
    return "-" if math.isnan(x) else "0" if x == 0 else f"{x:.2g}"


def _crc(t: Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _check_alike(model: nn.Module, runner: _Runner, state: ParallelState, device: torch.device) -> None:
    """The same full input and the same weights on every CP rank, and a token for each (every rank
    alike). Weights that differ between ranks (a model built without a common seed) make attention
    mix different keys and values into each rank's tokens: an error that is not the model's code."""
    x = runner.inputs if isinstance(runner, _SdpaRunner) else runner.input_ids
    tensors = [*model.named_parameters(), *model.named_buffers()]
    crcs = [_crc(t) for _, t in tensors]
    row = [x.numel(), runner.seq_len, _crc(x), len(crcs), zlib.crc32(str(crcs).encode())]
    rows = exchange_ints(row, state.cp_group, device)
    if any(r[:3] != rows[0][:3] for r in rows):
        bad = [r for r, rw in enumerate(rows) if rw[:3] != rows[0][:3]]
        raise ValueError(
            f"seqpar.verify: the inputs of cp ranks {bad} differ from cp rank 0's ((elements, length, crc32) "
            f"per cp rank: {[rw[:3] for rw in rows]}); pass the same full input on every rank (seed the "
            "generator alike)"
        )
    if any(r[3:] != rows[0][3:] for r in rows):
        bad = [r for r, rw in enumerate(rows) if rw[3:] != rows[0][3:]]
        first = ""
        if all(r[3] == rows[0][3] for r in rows):  # the same tensors: name the first that differs
            every = exchange_ints(crcs, state.cp_group, device)
            i = next(i for i in range(len(crcs)) if any(c[i] != every[0][i] for c in every))
            first = f" (the first: {tensors[i][0]})"
        raise ValueError(
            f"seqpar.verify: the parameters or buffers of cp ranks {bad} differ from cp rank 0's{first}; every "
            "CP rank needs the same weights: seed alike before building the model (torch.manual_seed), load "
            "the same checkpoint, or broadcast the weights from one rank"
        )

    def lengths(n: int) -> list[int]:
        return list(Placement.dense(n, state.ring_size, state.ulysses_size).shard_lengths)

    if 0 in lengths(runner.seq_len):
        shortest = max(runner.seq_len, state.cp_size)
        while 0 in lengths(shortest):
            shortest += 1
        raise ValueError(
            f"seqpar.verify: {runner.seq_len} tokens give the CP ranks {lengths(runner.seq_len)} tokens; every "
            f"rank needs one: use at least {shortest} tokens (the default is {DEFAULT_SEQ_LEN})"
        )


def _sharded_run(model: nn.Module, runner: _Runner, root: str, backward: Callable[[Any], list[Tensor | None]],
                 params: list[Tensor]) -> tuple[list[_Call], list[Tensor | None], BaseException | None]:
    """The recorded calls and parameter gradients of the sharded run, or the exception it raised."""
    recorder = _Recorder(model, root)
    try:
        return recorder.calls, backward(runner.sharded(model)), None
    except Exception as e:  # noqa: BLE001 - reported collectively by the caller
        return recorder.calls, [None] * len(params), e
    finally:
        recorder.close()


def verify(
    model: nn.Module,
    state: ParallelState,
    inputs: Tensor | None = None,
    *,
    seq_dim: int = 1,
    dtype: torch.dtype | None = torch.float64,
    tol: float | None = None,
    strict: bool = True,
) -> VerifyReport:
    """Run ``model`` once on sequence shards and once whole, and compare every module's outputs and
    gradients (Note [Model self-check]). A collective: call it on every rank of the CP group.

    Two kinds of model:

    - a transformers model built with ``attn_implementation=seqpar.integrations.transformers.
      register(state)``: ``inputs`` are ``input_ids`` ``[B, S]`` (default: 37 random tokens); verify
      shards them and passes ``position_ids``; the reference runs with ``"sdpa"`` (or ``"eager"``);
    - any other module whose attention calls ``F.scaled_dot_product_attention`` on token shards
      (a ViT / DiT block stack): ``inputs`` ``[..., S, ...]`` with the sequence along ``seq_dim``;
      the sharded run is under ``seqpar.parallel_sdpa(state)``, the reference without it.

    Args:
        model: the model, built for sharded runs. Its weights are used by both runs; its dtypes,
            train/eval modes, attention implementation and ``.grad`` come back unchanged.
        state: the parallel state the model runs over.
        inputs: the **full** input, the same on every CP rank; a short odd length keeps it cheap.
        seq_dim: the sequence dim of ``inputs`` (SDPA modules).
        dtype: the floating dtype both runs use (float64 by default; ``None`` keeps the model's).
        tol: max abs error relative to ``max(1, |reference|)``; default by ``dtype`` (1e-5 for float64).
        strict: raise :class:`VerificationError` when a module differs (else return the report).

    Returns:
        A :class:`VerifyReport` (``print`` it for the per-module table), the same on every rank.

    Raises:
        VerificationError: (``strict``) naming the first module whose sharded result differs, e.g.
            ``model.layers.1.mixer: max error 1.9 on ranks 1-3``, on every rank.
        ValueError: inputs that differ between CP ranks or give a rank no token, a transformers
            model not built with ``register(state)`` (every rank alike).
        Exception: whatever the model raises on shards (the model check's refusals are raised on
            every rank); a rank whose sharded run failed after the model's collectives makes the
            others raise too, naming it.
    """
    require_state(state, "seqpar.verify")
    runner = _runner(model, state, inputs, seq_dim)
    if isinstance(runner, _SdpaRunner) and dtype is not None and runner.inputs.is_floating_point():
        runner.inputs = runner.inputs.to(dtype)
    device = next(model.parameters(), runner.inputs if isinstance(runner, _SdpaRunner) else runner.input_ids).device
    _check_alike(model, runner, state, device)
    seq_len = runner.seq_len
    positions = shard_positions(seq_len, state)
    root = type(model).__name__
    run_dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tol = _TOL.get(run_dtype, 1e-4) if tol is None else float(tol)
    left_out: list[str] = []  # outputs of the sharded run not in the loss

    with _prepared(model, dtype), torch.enable_grad():
        params = [p for p in model.parameters() if p.requires_grad]
        full = torch.arange(seq_len)
        recorder = _Recorder(model, root)
        try:
            output = runner.reference(model)
            shapes = {label: t.shape for label, t in _labelled(output)}
            ref_grads = _grads(_projection_loss(output, shapes, full, seq_len, 1, []), params, runner.leaves())
        finally:
            recorder.close()
        reference = recorder.calls
        del output

        def backward(out: Any) -> list[Tensor | None]:
            loss = _projection_loss(out, shapes, positions, seq_len, state.cp_size, left_out)
            return _grads(loss, params, runner.leaves())

        calls, grads, failure = _sharded_run(model, runner, root, backward, params)

    rows = exchange_ints([len(reference), int(failure is not None), len(left_out)], state.cp_group, device)
    failed = [r for r, row in enumerate(rows) if row[1]]
    if failed:
        if failure is not None:
            raise failure
        raise RuntimeError(
            f"seqpar.verify: the sharded run failed on cp ranks {_ranges(tuple(failed))} (see their error)"
        )
    if any(row[0] != rows[0][0] for row in rows):
        raise ValueError(
            f"seqpar.verify: the reference run made {[row[0] for row in rows]} module calls on the CP ranks; "
            "the model must run alike on every rank (same input, no randomness in eval mode)"
        )

    # Parameter gradients: the sum over the CP group against the reference, by owning module.
    with torch.no_grad():
        flat = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        summed = reduce_(torch.cat([g.reshape(-1).double() for g in flat]), state.cp_group) if flat else None
    param_error: dict[str, _Compared] = {}
    owner = {id(p): (name or root) for name, m in model.named_modules() for p in m.parameters(recurse=False)}
    offset = 0
    for p, g_ref in zip(params, ref_grads):
        n = p.numel()
        got = summed[offset:offset + n].view(p.shape)
        offset += n
        ref = torch.zeros_like(got) if g_ref is None else g_ref
        param_error.setdefault(owner.get(id(p), root), _Compared()).add(*_error(got, ref), tol)

    mine = {c.key: c for c in calls}
    table = torch.tensor(
        [_row(mine.get(ref.key), ref, positions, seq_len, tol) for ref in reference], dtype=torch.float64,
        device=device,
    ).reshape(len(reference), _COLUMNS)
    with torch.no_grad():
        table = all_gather(table[None], state.cp_group, dim=0)  # [cp, calls, columns]
    left_out_on = tuple(r for r, row in enumerate(rows) if row[2])
    return _report(model, state, reference, table.cpu(), param_error, left_out_on, tol, run_dtype, seq_len, strict)


def _report(model: nn.Module, state: ParallelState, reference: list[_Call], table: Tensor,
            param_error: dict[str, _Compared], left_out_on: tuple[int, ...], tol: float, dtype: torch.dtype,
            seq_len: int, strict: bool) -> VerifyReport:
    """The verdict from every rank's rows (``table`` ``[cp, calls, columns]``) and what every rank
    told (``left_out_on``: the ranks with outputs left out of the loss): the same on every rank."""
    out_bad, in_bad = table[..., _OUT_BAD] > 0, table[..., _IN_BAD] > 0  # [cp, calls]
    ograd_bad, igrad_bad = table[..., _OGRAD_BAD] > 0, table[..., _IGRAD_BAD] > 0
    n = len(reference)

    def ranks(bad: Tensor) -> tuple[int, ...]:
        return tuple(int(r) for r in torch.nonzero(bad).flatten())

    def own_params_bad(i: int) -> bool:
        own = param_error.get(reference[i].path) if reference[i].number == 0 else None
        return own is not None and own.bad

    # Forward: the first call (in finishing order) whose output differs where its inputs agree.
    starts = (out_bad & ~in_bad).any(0)
    first = next((i for i in range(n) if starts[i]), next((i for i in range(n) if out_bad[:, i].any()), None))

    # Backward, with every output exact: a call whose input (or own parameter) gradients differ
    # where its output gradients agree; the first in backward order (the last to finish), then, as
    # long as a call nested in it is one too, that one (a module whose submodule's backward is wrong
    # has wrong input gradients itself).
    last = None
    if first is None:
        candidates = [i for i in range(n) if (igrad_bad[:, i] & ~ograd_bad[:, i]).any()
                      or (own_params_bad(i) and not ograd_bad[:, i].any())]
        if candidates:
            last = max(candidates)
            while inner := [j for j in candidates if j < last and reference[j].start > reference[last].start]:
                last = max(inner)
        else:  # every gradient error comes with a wrong output gradient: the last to finish
            last = max((i for i in range(n) if (ograd_bad[:, i] | igrad_bad[:, i]).any() or own_params_bad(i)),
                       default=None)

    # Per module (at its first call's place), over its calls and the ranks.
    calls_of: dict[str, list[int]] = {}
    for i, call in enumerate(reference):
        calls_of.setdefault(call.path, []).append(i)
    modules, by_call = [], {}
    for path, idx in calls_of.items():
        rows = table[:, idx]
        fwd = float(rows[..., _OUT].nan_to_num(nan=-1.0).max())
        grad = float(rows[..., [_OGRAD, _IGRAD]].nan_to_num(nan=-1.0).max())
        own = param_error.get(path)
        if own is not None and not math.isnan(own.error):
            grad = max(grad, own.error)
        # Where the output differs; with every output exact, where the gradients differ (once an
        # output differs, every gradient differs: they say nothing then).
        differ = set(ranks(out_bad[:, idx].any(1)))
        if first is None:
            differ |= set(ranks((ograd_bad | igrad_bad)[:, idx].any(1)))
            if own is not None and own.bad:
                differ |= set(range(state.cp_size))  # a summed gradient: no single rank to blame
        said = []
        if missing := ranks((rows[..., _CALLED] == 0).any(1)):
            said.append(f"not called on ranks {_ranges(missing)}")
        if unmatched := ranks((rows[..., _UNMATCHED] > 0).any(1)):
            said.append(f"tensors not compared on ranks {_ranges(unmatched)}: no shard of the reference's shape")
        check = ModuleCheck(path, fwd if fwd >= 0 else math.nan, grad if grad >= 0 else math.nan,
                            tuple(sorted(differ)), "; ".join(said))
        modules.append(check)
        by_call.update(dict.fromkeys(idx, check))

    where = (f"{type(model).__name__} on ring {state.ring_size} x ulysses {state.ulysses_size}, "
             f"{seq_len} tokens, {str(dtype).removeprefix('torch.')}")
    culprit, verdict = None, f"seqpar.verify: {where}: every module agrees with the one-device run"
    if left_out_on:
        verdict += (f" (outputs left out of the loss on ranks {_ranges(left_out_on)}: no shard of the "
                    "reference's shape)")
    if first is not None:
        culprit, call = by_call[first], reference[first]
        error = float(table[:, first, _OUT].nan_to_num(nan=0.0).max())
        root = reference[-1].path  # the model's own call finishes last
        nested = any(c is not call and (call.path == root or c.path.startswith(call.path + ".")) for c in reference)
        hint = " (in its own forward: its submodules agree)" if nested and starts[first] else ""
        label = call.path + (f" (call {call.number + 1})" if call.number else "")
        verdict = (
            f"seqpar.verify: {label}: max error {error:.2g} on ranks {_ranges(ranks(out_bad[:, first]))}{hint}, "
            f"the first module whose sharded output differs from the same tokens of the one-device run ({where}). "
            "A layer that mixes tokens outside attention (a convolution, scan or cumulative sum over tokens, "
            "pooling) sees only its rank's tokens on shards; see docs/verify.md"
        )
    elif last is not None:
        culprit, call = by_call[last], reference[last]
        if igrad_bad[:, last].any():
            error = float(table[:, last, _IGRAD].nan_to_num(nan=0.0).max())
            what = f"input gradients off by {error:.2g} on ranks {_ranges(ranks(igrad_bad[:, last]))}"
        else:
            what = f"parameter gradients (summed over the CP group) off by {param_error[call.path].error:.2g}"
        verdict = (
            f"seqpar.verify: {call.path}: every forward output agrees, but its {what}, the first module in "
            f"backward order whose gradients differ from the one-device run ({where}); a custom backward, or a "
            "gradient that is not partial (docs/conventions.md), differs there"
        )
    report = VerifyReport(where, tol, tuple(modules), culprit, verdict)
    if strict and not report.ok:
        raise VerificationError(report)
    return report
