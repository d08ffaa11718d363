"""Model-level checks for ``attn_implementation=register(state)`` models (the transformers integration).

Note [transformers model checks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The attention function sees one layer's queries and keys; some mistakes are only visible on the
model's own call, and some models never call it at all:

- a model whose config object is shared with another model: ``from_config(config,
  attn_implementation="sdpa")`` for a reference switches this model back to plain per-rank
  attention, and seqpar is never called again;
- a model that computes attention itself (Bloom, MPT, ...: its modeling code never
  calls transformers' attention interface): seqpar's mask object reaches its arithmetic;
- ``labels=``: transformers' loss on a shard is a local mean with the next-token shift applied
  inside the shard;
- ``position_ids`` missing or wrong: models that never pass them to attention (BERT, GPT-BigCode,
  ModernBERT, Qwen2-VL text, Llama 4) number every shard from 0 unnoticed;
- a rank holding no token: transformers' own mask code fails there (``position_ids[:, -1]``)
  while the other ranks wait in seqpar's first collective;
- a full-length 2-D ``attention_mask`` next to sharded ids, padding, a 4-D mask;
- a hybrid model whose other layers mix tokens outside attention (Mamba mixers, gated delta nets,
  short convolutions, recurrences: Jamba, Bamba, Qwen3-Next, LFM2, ...): on shards each would see
  only its rank's tokens, so such models are refused (found by class name in the modeling code).

So :func:`seqpar.integrations.transformers.register` installs, once per process, a torch module
registration hook: when a ``PreTrainedModel`` whose config names a seqpar implementation gets its
first submodule (during its ``__init__``, so for ``from_config`` and ``from_pretrained`` alike), it
gets a forward pre-hook, :func:`check_call`. A model nested in another such model (``LlamaModel``
in ``LlamaForCausalLM``) hands its hook to the outer one, so one call is checked once.

:func:`check_call` looks at this rank's arguments, then (``cp_size > 1``) all-gathers one row of a
few ints per CP rank -- its token count, the first problem it found and a fingerprint of its
positions -- and every rank raises the same error for the first rank with a problem, or for
token counts or positions that are not seqpar's placement of their sum, before any rank runs the
model on its shard. Where the state has one rank, only the first two checks apply.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..comm import exchange_ints
from ..placement import Placement
from ..state import ParallelState

__all__ = ["Binding", "binding", "check_call", "fingerprint", "install"]

_GUARD = "_seqpar_guard"  # attribute of a checked model: (implementation name, hook handle)
# Implementation names a switched config may name, coded as ints for the exchange (0: another).
_KNOWN = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")

# Problem codes of one rank's call, in the order they are looked for.
SWITCHED, UNSUPPORTED, LABELS, NO_POSITION_PARAMETER, NO_POSITIONS, POSITIONS, EMPTY, FULL_LENGTH_MASK, PADDING, MASK_4D = range(1, 11)
SEQUENCE_MIXER = 11


@dataclass(frozen=True)
class Binding:
    """What :func:`~seqpar.integrations.transformers.register` bound a name to."""

    state: ParallelState
    backend: str


def binding(name: object) -> Binding | None:
    """The seqpar binding of attention implementation ``name``, or ``None`` if it is not seqpar's."""
    if not isinstance(name, str):
        return None
    from transformers import AttentionInterface

    return getattr(AttentionInterface().get(name), "_seqpar_binding", None)


def install(handles: list) -> None:
    """Install the module registration hook of Note [transformers model checks] (once: ``handles``
    holds its handle)."""
    if not handles:
        handles.append(torch.nn.modules.module.register_module_module_registration_hook(_on_register))


def _on_register(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """Module registration hook: check seqpar models; a checked model nested in another hands over."""
    if not hasattr(module, "config"):
        return
    _guard(module)
    inner = getattr(submodule, _GUARD, None)
    if inner is not None and getattr(module, _GUARD, None) is not None:
        inner[1].remove()
        object.__setattr__(submodule, _GUARD, None)


def _guard(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    if getattr(model, _GUARD, None) is not None or not isinstance(model, PreTrainedModel):
        return
    name = getattr(model.config, "_attn_implementation", None)
    if binding(name) is None:
        return
    _refuse_attention_class_table(model, name)
    handle = model.register_forward_pre_hook(functools.partial(check_call, name=name), with_kwargs=True)
    object.__setattr__(model, _GUARD, (name, handle))


# --- one call -------------------------------------------------------------------------------------


@functools.cache
def _parameters(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    """``(positional parameter names after self, every named parameter)`` of ``cls.forward``."""
    params = inspect.signature(cls.forward).parameters
    positional = tuple(n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return positional[1:], frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD)


def _argument(model: nn.Module, args: tuple, kwargs: dict[str, Any], name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    positional, _ = _parameters(type(model))
    i = positional.index(name) if name in positional else len(args)
    return args[i] if i < len(args) else None


@functools.cache
def _computes_attention_itself(cls: type) -> bool:
    """Whether ``cls``'s modeling code defines attention modules but never calls transformers'
    attention interface (``ALL_ATTENTION_FUNCTIONS``): Bloom, MPT, ...
    transformers' own heuristic (``_can_set_attn_implementation``), except that code that cannot
    be read counts as calling it (a mask used as a tensor still raises, ``MaskUsedAsTensor``)."""
    try:
        code = inspect.getsource(sys.modules[cls.__module__])
    except (KeyError, OSError, TypeError):
        return False
    defines = re.search(r"^class \w*Attention\w*\(nn\.Module\):", code, re.MULTILINE) is not None
    return defines and "ALL_ATTENTION_FUNCTIONS" not in code


def _refuse_attention_class_table(model: nn.Module, name: str) -> None:
    """Refuse, while it is built, a model that computes attention itself and picks its attention
    class from a table keyed by implementation name (Falcon's ``FALCON_ATTENTION_CLASSES``, GPT-J's
    ``GPTJ_ATTENTION_CLASSES``): its build would otherwise fail with a ``KeyError`` naming ``name``.

    Raises:
        NotImplementedError: on every rank alike (no communication), naming the model and the table.
    """
    cls = type(model)
    code = getattr(sys.modules.get(cls.__module__), "__dict__", {})
    tables = [k for k, v in code.items() if k.endswith("_ATTENTION_CLASSES") and isinstance(v, dict) and name not in v]
    if tables and _computes_attention_itself(cls):
        raise NotImplementedError(
            f"seqpar: {cls.__name__} computes attention itself instead of calling transformers' attention "
            f"interface (it picks its attention module from {tables[0]}, which has no {name!r}), so "
            "seqpar cannot run it on sequence shards; build it with attn_implementation='eager' or "
            "'sdpa' on one device. The families seqpar runs are in docs/models.md"
        )


# Layers that mix tokens along the sequence without transformers' attention interface: state-space
# (Mamba), gated delta rules and linear attention, short causal convolutions, recurrences, RWKV.
_SEQUENCE_MIXER = re.compile(
    r"^class (\w*(?:Mamba|Mixer|GatedDeltaNet|DeltaNet|LinearAttention|ShortConv|Rwkv|RecurrentBlock|Rglru"
    r"|xLSTM|Mlstm|Slstm)\w*)\(", re.MULTILINE,
)


@functools.cache
def _sequence_mixer(cls: type) -> str | None:
    """The first class of ``cls``'s modeling code that mixes tokens outside attention (a Mamba mixer,
    a gated delta net, a short convolution, ...), or None. On sequence shards such a layer would see
    only this rank's tokens: hybrid models (Jamba, Bamba, Qwen3-Next, LFM2, ...) are refused."""
    try:
        code = inspect.getsource(sys.modules[cls.__module__])
    except (KeyError, OSError, TypeError):
        return None
    found = _SEQUENCE_MIXER.search(code)
    return found.group(1) if found else None


@functools.lru_cache(maxsize=64)
def _placement_fingerprints(total: int, ring_size: int, ulysses_size: int) -> tuple[int, ...]:
    """The position fingerprint of every CP rank's shard of ``total`` tokens."""
    placement = Placement.dense(total, ring_size, ulysses_size)
    return tuple(_fingerprint(placement.global_index(c)) for c in range(ring_size * ulysses_size))


@dataclass(frozen=True)
class _Call:
    """What one rank's call looks like: ``row`` is what it tells the other CP ranks."""

    n: int  # tokens (input_ids or inputs_embeds), -1 if neither is given
    code: int  # first problem found on this rank, 0 for none
    details: tuple[int, int]  # numbers for the message of that problem
    positions: int  # fingerprint of the positions, 0 without them
    device: torch.device

    @property
    def row(self) -> list[int]:
        return [self.n, self.code, *self.details, self.positions]


def _fingerprint(positions: Tensor) -> int:
    """An int that differs, with overwhelming probability, between different position rows: the
    sum of a non-linear 64-bit mix of every (index, position) pair, on the positions' device.

    Not a weighted sum: a moment linear in the positions lets other rows match ([1, 0, 1, 4] and
    [0, 1, 2, 3] have the same ``sum((p + 1) * (i + 1))``); int64 arithmetic wraps, which the mix wants.
    """
    p = positions.reshape(-1).long()
    h = p * 0x5851F42D4C957F2D + torch.arange(p.numel(), device=p.device) * 0x14057B7EF767814F + 1
    h = h ^ (h >> 31)
    h = h * 0x2545F4914F6CDD1D
    h = h ^ (h >> 29)
    return int(h.sum())


fingerprint = _fingerprint


def _decoding(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The ``SeqparCache`` of a call that passes new tokens on every rank (not a sharded prefill), or None."""
    from .transformers_cache import SeqparCache

    cache = _argument(model, args, kwargs, "past_key_values")
    if isinstance(cache, SeqparCache) and not (cache.layers and cache.layers[0].sharded):
        return cache
    return None


def _check_decoding(model: nn.Module, args: tuple, kwargs: dict[str, Any], state: ParallelState, cache: Any) -> None:
    """A call with new tokens on every CP rank (Note [transformers cache on shards]): the same tokens
    and positions on every rank, no padding or 4-D mask, every rank raising alike."""
    ids = _argument(model, args, kwargs, "input_ids")
    embeds = _argument(model, args, kwargs, "inputs_embeds")
    tokens = ids if isinstance(ids, Tensor) else embeds if isinstance(embeds, Tensor) else None
    if tokens is None:
        return
    positions = _argument(model, args, kwargs, "position_ids")
    mask = _argument(model, args, kwargs, "attention_mask")
    code = 0
    if isinstance(mask, Tensor) and mask.dim() == 4:
        code = MASK_4D
    elif isinstance(mask, Tensor) and mask.dim() == 2 and not bool(mask.all()):
        code = PADDING
    row = [
        int(tokens.shape[0]), int(tokens.shape[1]), code, _fingerprint(tokens.detach().float().mul(1024).long()
                                                                     if tokens.is_floating_point() else tokens),
        _fingerprint(positions) if isinstance(positions, Tensor) else 0,
    ]
    rows = exchange_ints(row, state.cp_group, tokens.device) if state.cp_size > 1 else [row]
    where = f"seqpar ({type(model).__name__}, decoding with a SeqparCache of {cache.get_seq_length()} tokens)"
    if any(r[2] for r in rows):
        r = next(i for i, r in enumerate(rows) if r[2])
        what = "a 4-D attention_mask" if rows[r][2] == MASK_4D else "a padding attention_mask (zeros)"
        raise ValueError(f"{where}: cp rank {r} passed {what}; pass none, or all ones")
    if any(r != rows[0] for r in rows):
        raise ValueError(
            f"{where}: the CP ranks passed different new tokens or positions ((batch, tokens, -, ids, positions) "
            f"fingerprints {rows}); after the sharded prefill every rank passes the same new tokens"
        )


def _inspect(model: nn.Module, name: str, args: tuple, kwargs: dict[str, Any], state: ParallelState) -> _Call:
    """This rank's :class:`_Call` (no communication)."""
    ids = _argument(model, args, kwargs, "input_ids")
    embeds = _argument(model, args, kwargs, "inputs_embeds")
    tokens = ids if isinstance(ids, Tensor) else embeds if isinstance(embeds, Tensor) else None
    n = -1 if tokens is None else int(tokens.shape[-1] if tokens is ids else tokens.shape[1])
    device = tokens.device if tokens is not None else next(model.parameters(), torch.zeros(())).device
    current = getattr(model.config, "_attn_implementation", None)

    def call(code: int, details: tuple[int, int] = (0, 0), positions: int = 0) -> _Call:
        return _Call(n, code, details, positions, device)

    if current != name:
        return call(SWITCHED, (_KNOWN.index(current) + 1 if current in _KNOWN else 0, 0))
    if _computes_attention_itself(type(model)):
        return call(UNSUPPORTED)
    if state.cp_size == 1:
        return call(0)
    if _sequence_mixer(type(model)) is not None:
        return call(SEQUENCE_MIXER)
    if _argument(model, args, kwargs, "labels") is not None:
        return call(LABELS)
    if n == 0:
        return call(EMPTY)
    mask = _argument(model, args, kwargs, "attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 4:
        return call(MASK_4D, tuple(mask.shape[-2:]))
    if isinstance(mask, Tensor) and mask.dim() == 2 and n >= 0 and mask.shape[-1] != n:
        return call(FULL_LENGTH_MASK, (int(mask.shape[-1]), 0))
    if isinstance(mask, Tensor) and mask.dim() == 2 and not bool(mask.all()):
        return call(PADDING)
    if "position_ids" not in _parameters(type(model))[1]:
        return call(NO_POSITION_PARAMETER)
    positions = _argument(model, args, kwargs, "position_ids")
    if not isinstance(positions, Tensor):
        return call(NO_POSITIONS)
    rows = positions.detach().reshape(-1, positions.shape[-1])
    if (n >= 0 and rows.shape[-1] != n) or not bool((rows == rows[:1]).all()):
        return call(POSITIONS, (int(rows.shape[-1]), -1))
    first = (int(rows[0, 0]), int(rows[0, -1])) if rows.numel() else (-1, -1)
    return call(0, first, _fingerprint(rows[0]))


def check_call(model: nn.Module, args: tuple, kwargs: dict[str, Any], *, name: str) -> None:
    """Forward pre-hook of a seqpar model (Note [transformers model checks]): raise the same error
    on every CP rank if any rank's call cannot run exactly on shards.

    Raises:
        ValueError: a switched config, missing or wrong ``position_ids``, a rank without tokens,
            token counts that are not seqpar's placement, a full-length, padding or 4-D mask.
        NotImplementedError: ``labels=``, a model that does not call the attention interface, or
            whose forward takes no ``position_ids``.
    """
    bound = binding(name)
    if bound is None:  # the name was registered again, by someone else
        return
    state = bound.state
    cache = _decoding(model, args, kwargs) if state.cp_size > 1 else None
    if cache is not None and getattr(model.config, "_attn_implementation", None) == name:
        if _sequence_mixer(type(model)) is None and not _computes_attention_itself(type(model)):
            _check_decoding(model, args, kwargs, state, cache)
            return
    mine = _inspect(model, name, args, kwargs, state)
    if state.cp_size == 1:
        if mine.code:
            raise _error(model, name, state, [mine.row], 0)
        return
    rows = exchange_ints(mine.row, state.cp_group, mine.device)
    culprit = next((r for r, row in enumerate(rows) if row[1]), None)
    if culprit is not None:
        raise _error(model, name, state, rows, culprit)
    _check_placement(model, state, rows)


def _check_placement(model: nn.Module, state: ParallelState, rows: list[list[int]]) -> None:
    """Token counts and positions that are seqpar's placement of their sum (every rank alike)."""
    lengths = [row[0] for row in rows]
    if min(lengths) < 0:
        return
    total = sum(lengths)
    placement = Placement.dense(total, state.ring_size, state.ulysses_size)
    where = f"seqpar ({type(model).__name__}, ring {state.ring_size} x ulysses {state.ulysses_size})"
    if list(placement.shard_lengths) != lengths:
        raise ValueError(
            f"{where}: the CP ranks hold {lengths} tokens, not seqpar's placement of their {total} tokens "
            f"({list(placement.shard_lengths)}); shard the inputs with input_ids=seqpar.shard(input_ids, state)"
        )
    for r, (row, want) in enumerate(zip(rows, _placement_fingerprints(total, state.ring_size, state.ulysses_size))):
        if row[4] != want:
            raise ValueError(
                f"{where}: the position_ids of cp rank {r} ({row[2]}..{row[3]}) are not its global "
                f"positions seqpar.shard_positions({total}, state) for the {total} tokens the CP ranks "
                f"hold ({lengths}); pass position_ids=seqpar.shard_positions({total}, state)[None]"
            )


def _shortest(state: ParallelState, total: int) -> int:
    """The shortest sequence of at least ``total`` tokens that gives every CP rank a token."""
    length = max(total, state.cp_size)
    while 0 in Placement.dense(length, state.ring_size, state.ulysses_size).shard_lengths:
        length += 1
    return length


def _error(model: nn.Module, name: str, state: ParallelState, rows: list[list[int]], r: int) -> Exception:
    """The error of cp rank ``r``'s problem, worded from ``rows`` alone (the same on every rank)."""
    from .transformers import four_d_mask_message, full_length_mask_message

    cls = type(model).__name__
    n, code, a, b, _ = rows[r]
    lengths = [row[0] for row in rows]
    at = f" (cp rank {r} of {state.cp_size})" if state.cp_size > 1 else ""
    messages: dict[int, Callable[[], Exception]] = {
        SWITCHED: lambda: ValueError(
            f"seqpar: this {cls} was built with attn_implementation={name!r}, but its config now names "
            f"{repr(_KNOWN[a - 1]) if a else 'another implementation'}{at}: a config object shared with "
            "another model (e.g. a reference built with from_config(config, attn_implementation='sdpa')) "
            "switched it, and its attention would run per rank on the shards, without seqpar. Give every "
            "model its own config (copy.deepcopy(config)), or build this model again"
        ),
        UNSUPPORTED: lambda: NotImplementedError(
            f"seqpar: {cls} computes attention itself instead of calling transformers' attention "
            f"interface (its modeling code never calls ALL_ATTENTION_FUNCTIONS), so "
            f"attn_implementation={name!r} never reaches its attention layers and seqpar cannot run it "
            "on sequence shards; the families seqpar runs are in docs/models.md"
        ),
        SEQUENCE_MIXER: lambda: NotImplementedError(
            f"seqpar: {cls} has layers that mix tokens outside attention ({_sequence_mixer(type(model))}: "
            "a state-space, linear-attention, convolution or recurrent layer); on sequence shards each "
            "would see only its rank's tokens, so seqpar cannot run it over "
            f"{state.cp_size} CP ranks (its attention layers alone would be exact)"
        ),
        LABELS: lambda: NotImplementedError(
            f"seqpar: {cls} was called with labels= on sequence shards{at}: transformers' loss would "
            "be the mean over this rank's tokens with the next-token shift applied inside the shard, "
            "which loses the targets at the shard edges and weights the ranks wrongly. Call the model "
            "without labels and compute the loss share from the logits: "
            "seqpar.training.sharded_cross_entropy(logits, seqpar.shard(seqpar.training.shift_labels("
            "input_ids), state), state)"
        ),
        NO_POSITION_PARAMETER: lambda: NotImplementedError(
            f"seqpar: {cls}.forward takes no position_ids, so on sequence shards it would number every "
            "rank's tokens from 0 instead of their global positions; seqpar cannot run it over "
            f"{state.cp_size} CP ranks"
        ),
        NO_POSITIONS: lambda: ValueError(
            f"seqpar: {cls} was called without position_ids on sequence shards{at}; transformers would "
            "number every rank's tokens from 0 instead of their global positions (silently wrong "
            "outputs on every rank but the first). Pass position_ids=seqpar.shard_positions(S, "
            "state)[None] with input_ids=seqpar.shard(input_ids, state)"
        ),
        POSITIONS: lambda: ValueError(
            f"seqpar: the position_ids of cp rank {r} have {a} positions per row, for {n} tokens, or "
            "rows that differ; pass position_ids=seqpar.shard_positions(S, state)[None] (one row, "
            "broadcast over the batch) with input_ids=seqpar.shard(input_ids, state)"
        ),
        EMPTY: lambda: ValueError(
            f"seqpar: the CP ranks hold {lengths} tokens (cp_rank order): cp rank {r} holds none, and "
            f"transformers cannot run {cls} on no token (its mask code reads the last position) while "
            f"the other ranks would wait for it. A sequence of {sum(lengths)} tokens is too short for "
            f"ring {state.ring_size} x ulysses {state.ulysses_size}: use at least "
            f"{_shortest(state, sum(lengths))} tokens, or fewer CP ranks"
        ),
        FULL_LENGTH_MASK: lambda: ValueError(f"cp rank {r}: {full_length_mask_message(a, n)}"),
        PADDING: lambda: ValueError(
            f"seqpar attention: padding masks are not supported on sequence shards (the attention_mask "
            f"of cp rank {r} has zeros); drop padding, or pack the sequences and use seqpar.varlen_attention"
        ),
        MASK_4D: lambda: ValueError(f"cp rank {r}: {four_d_mask_message(f'(..., {a}, {b})', n, state.cp_size)}"),
    }
    return messages[code]()
