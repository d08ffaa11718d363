"""Hugging Face ``transformers`` attention implementation running on sequence shards.

::

    from seqpar.integrations.transformers import register

    name = register(state)                                   # "seqpar"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    ids = seqpar.shard(input_ids, state)                     # [B, S_local]
    pos = seqpar.shard_positions(S, state)[None]             # [1, S_local], global positions
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits   # [B, S_local, V]

Note [transformers attention on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers (checked against 5.23) calls the registered attention function per layer as
``fn(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)`` with query
``[B, H, S, D]``, key/value ``[B, Hkv, S, D]`` (GQA is *not* expanded; ``module.num_key_value_groups
= H // Hkv``), and expects ``([B, S, H, D], attn_weights_or_None)`` back. ``is_causal`` arrives as a
kwarg or as ``module.is_causal``; most models pass ``position_ids`` in ``kwargs`` (BERT, GPT-BigCode,
ModernBERT, Qwen2-VL text and Llama 4 do not: positions are checked on the model's call, below).
Score modifiers arrive as kwargs: ``sliding_window=W`` (Mistral, Qwen2, Gemma 2/3, gpt-oss; also
``module.sliding_window`` on Qwen2-MoE's sliding layers), ``softcap`` (Gemma 2's
``attn_logit_softcapping``) and ``s_aux`` (gpt-oss sinks, a ``[H]`` parameter). Phi-MoE and Llama 4
pass no window or chunk kwarg: their sliding or chunked layers are known from the mask only.

The model builds its masks with ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
``create_chunked_causal_mask`` / ``create_bidirectional_mask``, which call the mask function
registered under the same name in ``AttentionMaskInterface`` with a ``mask_function(batch_idx,
head_idx, q_idx, kv_idx) -> bool`` describing the pattern, and hand its return value to every layer
of that type as ``attention_mask``. :func:`mask_function` recognises that pattern on global
positions (Note [Recognising transformers masks]) and returns a :class:`RecognisedMask`; the
attention function runs ``seqpar.attention`` with that mask, the softcap and the sinks, after
checking that the kwargs agree with it. Any other kwarg is either a known pass-through that does
not change attention (``use_cache``, ``output_attentions``, ...: ``_PASS_THROUGH_KWARGS``) or, when
not ``None``, refused on every rank: ignoring it would compute another attention than the model's
(an indexer's ``block_indices`` or ``indices`` from a sparse layer that has no adapter: key selection).
transformers' conventions, which seqpar follows exactly:

- ``sliding_window=W`` (``sliding_window_overlay``: ``kv_idx > q_idx - W``): a query sees itself
  and the ``W - 1`` keys before it, seqpar ``window=(W - 1, 0)`` with ``causal=True``. flash-attn's
  integration passes ``window_size=(W - 1, W - 1)``, so a non-causal layer with ``sliding_window=W``
  means ``window=(W - 1, W - 1)`` (Gemma 3's bidirectional overlay, ``|q - k| < W``); transformers'
  ``sliding_window_bidirectional_overlay`` (``|q - k| <= W``) is ``(W, W)`` and disagrees with it.
- ``attention_chunk_size=C`` (``chunked_overlay``): ``q // C == k // C``, seqpar ``chunk_size=C``.
- ``softcap=c``: ``c * tanh(s / c)`` of the scaled scores; ``s_aux``: sink logits per query head.

Two things transformers derives from the shard's own tokens are undone or refused here:

- zig-zag ``position_ids`` jump between chunks, so transformers takes them for packed sequences and
  wraps the mask function to keep tokens within one run of consecutive positions. The mask function
  unwraps exactly that wrapper (after checking that the positions are this rank's
  ``shard_positions``): the runs are pieces of one global sequence;
- Llama 4 scales the queries of its NoPE layers by ``torch.arange`` over the *local* tokens
  (``attn_temperature_tuning``). That equals the global positions' scale only while every position
  is below ``floor_scale - 1``; longer sequences are refused. Each rank decides from its own length,
  without communication, from the bound ``S < cp_size * (S_local + 2)``, so a sequence less than
  about ``2 * cp_size`` tokens shorter than ``floor_scale`` may be refused on some ranks too.

Such checks look at one rank's own data (its positions, its padding mask, its length) and can fail
on some ranks only; a failing rank joins the first layer's length exchange with a refusal
(``seqpar.attention.refuse_collectively``), so every CP rank raises instead of waiting.

A 4-D mask passed in by the caller skips the mask function and reaches the attention function as
is. On shards (``cp_size > 1``) it is refused: a shard's block cannot say how tokens attend across
shards (with one token per rank every block is ``[[True]]``, causal and all-attend alike; a causal
block is also that of a sliding window wider than the shard). On one rank the plain causal pattern
(bool lower triangle, or additive ``0``/``-inf``) is read as ``causal=True``, an all-attend mask as
``causal=False``, anything else rejected. Padding masks, full-length 2-D masks next to sharded ids,
dropout, KV caches and position biases are refused; packed-batch kwargs run with the global
boundaries (Note [Packed sequences in transformers models]).

The global length is not known to a rank without communication (Note [Global length] in
``seqpar.attention``), so every layer passes ``seq_len=None`` when ``cp_size > 1`` and
``seqpar.attention`` exchanges a few ints per call.

Models built with a seqpar name also have their own call checked, once per forward, before any
rank runs the model on its shard (Note [transformers model checks] in
``seqpar.integrations.transformers_guard``: one small all-gather over the CP group): a config
switched to another implementation by a model sharing it, a model that computes attention itself
(Bloom, MPT, ...), modules that mix tokens outside attention (hybrid and sparse-attention models,
found from structure), ``labels=`` (transformers' loss on a shard is a local mean with a wrong shift at
the shard edges: use ``seqpar.training.sharded_cross_entropy``), missing or wrong ``position_ids``
(BERT, GPT-BigCode, ModernBERT, Qwen2-VL text and Llama 4 never pass them to attention), a rank
holding no token, full-length, padding and 4-D masks. Every CP rank raises the same error.

Registration is global to the process (transformers keeps one class-level mapping); each call to
:func:`register` binds one ``ParallelState`` to one name.

Note [Recognising transformers masks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The mask function transformers passes is a Python callable, built from ``causal_mask_function``,
``bidirectional_mask_function``, the sliding-window and chunk overlays, ``and_masks``/``or_masks``
and any model-specific overlay. Instead of naming the pieces, :func:`recognise_mask_function`
evaluates the callable (with transformers' own ``sdpa_mask``, so ``use_vmap`` callables get vmap
semantics) on *global* positions ``0 .. L-1`` -- every key, for a few query rows: the first 8
positions, the last 2, 8 evenly spaced ones, and the three around each of the first three
multiples of ``local_size`` (the window or chunk size transformers passes along). ``L`` covers the
whole global sequence (``S < cp_size * (S_local + 2)`` for the placement of Note [Sharding
placement]) and at least ``2 * local_size + 2`` positions, so a window or chunk edge is always
inside it; with ``cp_size == 1``, ``L = S``. Every row must be one run of keys containing the
query itself; the window sides are read off the runs, the chunk size is ``local_size`` or the gcd
of the runs' starts, and a candidate ``Mask(causal, window, chunk_size)`` is accepted only if
``Mask.allows`` gives every probed row exactly the observed run. Anything else raises
``NotImplementedError``: masks that depend on token data (image or block ids, padding, packing
not made by transformers from zig-zag positions) index tensors sized to the shard and cannot be
evaluated on global positions; other patterns (global tokens, dilation) are no window or chunk.

The evaluation runs on the host under :class:`_OnHost` (tensors the callable holds are copied to
the CPU, so an out-of-range index raises instead of asserting on a device), once per mask type
and forward -- about ``20 * L`` mask entries, some milliseconds at ``L = 10**5`` -- and the
attention layers only read the result. Recognition is exact for transformers' own mask functions
(their parameters are identified, then checked on the probed rows); a custom pattern that agrees
with a window or chunk mask on every probed row but not elsewhere would be missed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..placement import Mask, Placement
from ..state import ParallelState, require_state
from .transformers_guard import fingerprint, install
from .transformers_mixers.modes import check_mixing
from .transformers_packed import PACKED_KWARGS, packed_lengths
from .transformers_shared import (
    Binding, MaskUsedAsTensor, RecognisedMask, _describe, binding, cache_argument, four_d_mask_message,
    full_length_mask_message,
)

__all__ = [
    "MaskUsedAsTensor", "RecognisedMask", "SeqparCache", "attention_forward", "generate", "mask_function",
    "recognise_mask_function", "register",
]

# generate() options that a sharded KV cache cannot serve, and why.
_GENERATE_REFUSED = {
    "past_key_values": "generate makes its own seqpar cache; call the model yourself to pass one",
    "cache": "generate makes its own seqpar cache; call the model yourself to pass one",
    "cache_implementation": "the cache is seqpar's sharded cache",
    "assistant_model": "assisted decoding crops the cache",
    "prompt_lookup_num_tokens": "prompt lookup decoding crops the cache",
    "inputs_embeds": "pass input_ids (the full prompt)",
    "synced_gpus": "CP ranks already step together",
}

# Names that transformers itself provides; registering over them would change every model.
_BUILTIN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
# Kwargs of the attention function (besides attention_mask, dropout, scaling, is_causal) that seqpar
# honours: read by attention_forward / _layer_mask.
_HONOURED_KWARGS = frozenset({"position_ids", "sliding_window", "softcap", "s_aux", "sinks"})
# Kwargs models pass along that do not change what attention computes: transformers' per-call
# options (TransformersKwargs), the cache (served through key._seqpar_cache, or refused by the key
# length), RoPE tables already applied to q and k, and layer bookkeeping. Not ``cache``: no model of
# transformers 5.24 (which takes the cache under that name) hands it on to attention, and before 5.24
# a ``cache=`` reaching attention is one the model did not use (its own cache took the keys), refused.
_PASS_THROUGH_KWARGS = frozenset({
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "use_cache",
    "cache_position", "num_items_in_batch", "past_key_values", "past_key_value", "position_embeddings",
    "layer_idx", "deterministic", "logits_to_keep",
})
# Kwargs that change attention in ways seqpar does not compute on dense shards, and what they are.
# Any other kwarg that is not None is refused too (Note [transformers attention on shards]).
_UNSUPPORTED_KWARGS = {
    "position_bias": "position biases (T5-style relative attention)",
    "indices": "keys selected per query by an indexer (DeepSeek sparse attention)",
    "block_indices": "key blocks selected per query by an indexer (block-sparse attention)",
}
_ABSENT = object()
# The module registration hook that gives seqpar models their checks (installed by the first
# register; Note [transformers model checks] in seqpar.integrations.transformers_guard).
_MODEL_CHECKS: list = []


def _interfaces():
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - depends on the installed version
        raise ImportError(
            "seqpar.integrations.transformers needs transformers >= 4.53 (AttentionInterface and "
            f"AttentionMaskInterface); install seqpar[hf] ({e})"
        ) from e
    return AttentionInterface, AttentionMaskInterface


# --- recognising a transformers mask function (Note [Recognising transformers masks]) -----------


def _to_host(x: object) -> object:
    if isinstance(x, Tensor):
        return x.cpu() if x.device.type != "cpu" else x
    if isinstance(x, (list, tuple)) and any(isinstance(v, (Tensor, list, tuple)) for v in x):
        items = [_to_host(v) for v in x]
        return items if isinstance(x, list) else tuple(items)
    return x


class _OnHost(TorchFunctionMode):
    """Run every torch call on CPU copies of its tensor arguments (indices, masks, ids)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*_to_host(tuple(args)), **{k: _to_host(v) for k, v in (kwargs or {}).items()})


def _closure(fn: object) -> dict[str, object]:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return {} if code is None else {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _is_transformers(fn: object, qualname: str) -> bool:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return module == "transformers.masking_utils" and name == qualname


def _unwrap_packing(fn: Callable) -> tuple[Callable, Tensor | None]:
    """``(base, position_ids)`` if ``fn`` is transformers' packed-sequence wrapper of ``base``.

    The wrapper is ``and_masks`` of ``packed_sequence_mask_function(runs)`` and
    ``remap_positions_for_packed_sequence(base, position_ids)``, in either order (transformers up
    to 5.23 puts the runs first, 5.24 the remapped base first); anything else is returned as
    ``(fn, None)``.
    """
    if not _is_transformers(fn, "and_masks.<locals>.and_mask"):
        return fn, None
    parts = _closure(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return fn, None
    runs = [p for p in parts if _is_transformers(p, "packed_sequence_mask_function.<locals>.inner_mask")]
    remap = [p for p in parts if _is_transformers(p, "remap_positions_for_packed_sequence.<locals>.inner_mask")]
    if len(runs) == 1 and len(remap) == 1:
        inner = _closure(remap[0])
        if callable(inner.get("mask_function")) and isinstance(inner.get("position_ids"), Tensor):
            return inner["mask_function"], inner["position_ids"]
    return fn, None


def _probe_rows(grid: int, hint: int | None) -> Tensor:
    """Sorted query positions in ``[0, grid)`` to evaluate (Note [Recognising transformers masks])."""
    rows = [torch.arange(8), grid - 1 - torch.arange(2), torch.linspace(0, grid - 1, 8).long()]
    if hint is not None and hint > 0:
        rows.append((torch.arange(1, 4)[:, None] * hint + torch.arange(-1, 2)).flatten())
    q = torch.cat(rows)
    return torch.unique(q[(q >= 0) & (q < grid)])


def _evaluate(fn: Callable, batch_size: int, rows: Tensor, grid: int, use_vmap: bool):
    """Yield ``(block, mask)``: ``fn`` at query positions ``block`` (a piece of ``rows``) and keys
    ``0..grid-1``, as bool ``[batch, len(block), grid]``, in blocks of at most 2**24 entries."""
    from transformers.masking_utils import sdpa_mask

    per_block = max(1, min(8, 2**24 // (batch_size * grid)))
    breaks = (torch.nonzero(rows.diff() != 1).flatten() + 1).tolist()
    for run in torch.tensor_split(rows, breaks):
        for block in run.split(per_block):
            with torch.no_grad(), _OnHost():
                m = sdpa_mask(
                    batch_size=batch_size, q_length=len(block), kv_length=grid, q_offset=int(block[0]),
                    kv_offset=0, mask_function=fn, attention_mask=None, allow_is_causal_skip=False,
                    allow_is_bidirectional_skip=False, use_vmap=use_vmap, device="cpu",
                )
            yield block, torch.as_tensor(m, dtype=torch.bool).expand(batch_size, 1, len(block), grid)[:, 0]


def _row_runs(fn: Callable, batch_size: int, rows: Tensor, grid: int, use_vmap: bool) -> tuple[Tensor, ...]:
    """``(first, last, count)`` of the keys each query row attends, int64 ``[len(rows)]`` each.

    Raises:
        NotImplementedError: ``fn`` cannot be evaluated there, or differs between batch rows.
    """
    name = getattr(fn, "__qualname__", type(fn).__name__)
    blocks = _evaluate(fn, batch_size, rows, grid, use_vmap)
    first, last, count = [], [], []
    while True:
        try:
            _, m = next(blocks)
        except StopIteration:
            break
        except Exception as e:  # any failure means: not a function of global positions
            raise NotImplementedError(
                f"seqpar attention: transformers' mask function {name} cannot be evaluated on global "
                f"positions 0..{grid - 1} ({type(e).__name__}: {e}); masks that depend on token data "
                "(image or block ids, padding, packed sequences) are not supported on sequence shards"
            ) from e
        if batch_size > 1 and not bool((m == m[:1]).all()):
            raise NotImplementedError(
                f"seqpar attention: transformers' mask function {name} differs between batch rows "
                "(per-sample masks such as padding or image tokens are not supported on sequence shards)"
            )
        m = m[0].to(torch.uint8)
        first.append(m.argmax(1))
        last.append(grid - 1 - m.flip(1).argmax(1))
        count.append(m.sum(1))
    return torch.cat(first), torch.cat(last), torch.cat(count)


def _refuse(fn: Callable, row: int, batch_size: int, grid: int, use_vmap: bool, why: str) -> NoReturn:
    _, m = next(_evaluate(fn, batch_size, torch.tensor([row]), grid, use_vmap))
    keys = torch.nonzero(m[0, 0]).flatten().tolist()
    shown = ", ".join(map(str, keys[:12])) + (", ..." if len(keys) > 12 else "")
    raise NotImplementedError(
        f"seqpar attention: transformers' mask function {getattr(fn, '__qualname__', type(fn).__name__)} "
        f"is not a causal, bidirectional, sliding-window or chunked pattern: query position {row} "
        f"attends keys [{shown}] ({len(keys)} keys); {why}"
    )


def recognise_mask_function(
    fn: Callable, *, batch_size: int, grid: int, hint: int | None = None, use_vmap: bool = False
) -> Mask:
    """The ``Mask`` a transformers mask function describes on global positions ``0 .. grid-1``.

    See Note [Recognising transformers masks].

    Args:
        fn: ``(batch_idx, head_idx, q_idx, kv_idx) -> bool``, as transformers builds it.
        batch_size: batch rows to evaluate (the pattern must be the same in all of them).
        grid: global positions to probe; at least the global sequence length.
        hint: transformers' ``local_size`` (the sliding window or chunk size), if it passed one.
        use_vmap: evaluate with ``torch.vmap`` (transformers' flag for custom mask functions).

    Returns:
        ``Mask(causal, window, chunk_size)``, normalised for ``grid`` positions.

    Raises:
        ValueError: ``grid`` or ``batch_size`` below 1.
        NotImplementedError: the pattern depends on token data, differs between batch rows, or
            is not a causal/bidirectional, sliding-window or chunked mask.
    """
    if grid < 1 or batch_size < 1:
        raise ValueError(f"recognise_mask_function: grid={grid} and batch_size={batch_size} must be >= 1")
    rows = _probe_rows(grid, hint)
    lo, hi, count = _row_runs(fn, batch_size, rows, grid, use_vmap)
    bad = (count == 0) | (count != hi - lo + 1) | (lo > rows) | (hi < rows)
    if bool(bad.any()):
        row = int(rows[torch.nonzero(bad)[0, 0]])
        why = "seqpar needs every query to attend one run of keys around itself"
        _refuse(fn, row, batch_size, grid, use_vmap, why)
    causal = bool((hi <= rows).all())
    lefts = (-1, int((rows - lo).max()))
    rights = (-1,) if causal else (-1, int((hi - rows).max()))
    starts = lo[lo > 0]  # chunk starts, if chunked: multiples of the chunk size
    chunks = [None, *([int(hint)] if hint else []), *([math.gcd(*starts.tolist())] if len(starts) else [])]
    # Every row is one run [lo, hi], and so is every row of a Mask: they are equal iff the Mask
    # allows both ends and neither key just outside.
    edges = torch.stack([lo, hi, lo - 1, hi + 1], 1)
    want = torch.tensor([True, True, False, False]).expand_as(edges)
    outside = (edges < 0) | (edges >= grid)
    for chunk in chunks:
        for left in lefts:
            for right in rights:
                mask = Mask(causal, (left, right), chunk).normalised(grid)
                if bool(((mask.allows(rows[:, None], edges)[:, 0] == want) | outside).all()):
                    return mask
    # Name a row that the closest window-only candidate gets wrong.
    guess = Mask(causal, (lefts[1], rights[-1])).normalised(grid).allows(rows[:, None], edges)[:, 0]
    wrong = ((guess != want) & ~outside).any(1)
    row = int(rows[torch.nonzero(wrong)[0, 0]]) if bool(wrong.any()) else int(rows[-1])
    _refuse(fn, row, batch_size, grid, use_vmap, "no window and chunk size give these runs of keys")


# --- checks ------------------------------------------------------------------------------------


def _mask_kind(mask: Tensor, q_len: int, kv_len: int) -> bool | None:
    """``True`` for a plain causal pattern, ``False`` for all-attend, ``None`` for anything else."""
    if mask.shape[-2:] != (q_len, kv_len):
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        return None  # additive mask with real biases
    if bool(allowed.all()):
        return False
    tril = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    if bool((allowed == tril).all()):
        return True
    return None


def _are_shard_positions(position_ids: Tensor, state: ParallelState) -> bool:
    """Whether every row of ``position_ids`` is ``shard_positions(S, state)`` for some ``S``.

    One device-to-host copy; no collective. The candidates for ``S`` are the few lengths whose
    placement gives this rank as many tokens as it holds.
    """
    n = position_ids.shape[-1]
    if n == 0:
        return True
    rows = position_ids.detach().reshape(-1, n).cpu()
    cp = state.cp_size
    for seq_len in range(max(int(rows.max()) + 1, cp * (n - 2) + 1, 0), cp * (n + 2)):
        placement = Placement.dense(seq_len, state.ring_size, state.ulysses_size)
        if placement.shard_lengths[state.cp_rank] == n and bool(
            (rows == placement.global_index(state.cp_rank)).all()
        ):
            return True
    return False


def _check_positions(position_ids: Tensor, state: ParallelState) -> None:
    """Raise unless every row of ``position_ids`` is ``shard_positions(S, state)`` for some ``S``
    (no collective: safe to raise on one rank only)."""
    if not _are_shard_positions(position_ids, state):
        raise ValueError(_positions_message(position_ids, state))


def _positions_message(position_ids: Tensor | None, state: ParallelState) -> str:
    shown = "" if not isinstance(position_ids, Tensor) else (
        " " + str(position_ids.detach().reshape(-1, position_ids.shape[-1])[0, :8].cpu().tolist()) + "...")
    return (
        f"seqpar attention (cp rank {state.cp_rank} of {state.cp_size}): position_ids"
        f"{shown} are not this rank's global positions of any sequence and no "
        "cu_seq_lens_q was passed; pass position_ids=seqpar.shard_positions(S, state)[None] with the "
        "sharded input_ids, or, for packed sequences whose positions restart, the global "
        "cu_seq_lens_q / cu_seq_lens_k with input_ids and position_ids sharded by seqpar.shard_packed "
        "(docs/hybrid-models.md, \"Packed sequences\")"
    )


def _declared_window(module: torch.nn.Module, kwargs: dict[str, Any], causal: bool) -> tuple[int, int] | None:
    """The window the layer's ``sliding_window`` kwarg (or attribute) asks for; ``None`` if silent."""
    width = kwargs.get("sliding_window", getattr(module, "sliding_window", _ABSENT))
    if width is _ABSENT:
        return None
    if not width:  # None, or Qwen2-MoE's 0 for "no window"
        return (-1, -1)
    width = int(width)
    return (width - 1, 0) if causal else (width - 1, width - 1)


def _layer_mask(
    module: torch.nn.Module, attention_mask: object, is_causal: bool | None, kwargs: dict[str, Any], n: int,
    state: ParallelState,
) -> Mask:
    """The layer's mask in global positions, from the mask function's result and the kwargs."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _declared_window(module, kwargs, causal)
    if attention_mask is None:
        return Mask(causal, window or (-1, -1))
    if isinstance(attention_mask, RecognisedMask):
        got = attention_mask.mask
        if got.causal != causal:
            raise ValueError(
                f"seqpar attention: the model's mask is {got.describe()} but the layer says "
                f"is_causal={causal}; transformers' attention implementations disagree on such a "
                "layer, so seqpar refuses it"
            )
        if window is not None and Mask(causal, window, got.chunk_size).normalised(attention_mask.grid) != got:
            width = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
            raise ValueError(
                f"seqpar attention: the model's mask is {got.describe()} but the layer passes "
                f"sliding_window={width!r} (window {window}); transformers' attention "
                "implementations disagree on such a layer, so seqpar refuses it"
            )
        return got
    if not isinstance(attention_mask, Tensor):
        raise ValueError(
            f"seqpar attention: got an attention mask of type {type(attention_mask).__name__}; expected "
            "the mask seqpar's registered mask function builds, None, or a 4-D tensor"
        )
    if state.cp_size > 1:
        raise ValueError(four_d_mask_message(str(tuple(attention_mask.shape)), n, state.cp_size))
    kind = _mask_kind(attention_mask, n, n)
    if kind is None:
        raise ValueError(
            f"seqpar attention: got an attention mask {tuple(attention_mask.shape)} "
            f"({attention_mask.dtype}) that is not a plain causal or all-attend pattern; padding "
            "and custom masks are not supported on sequence shards (pack sequences and use "
            "seqpar.varlen_attention, or drop padding)"
        )
    if window not in (None, (-1, -1)):
        raise ValueError(
            f"seqpar attention: a 4-D attention mask was passed to a layer with a sliding window "
            f"{window}; pass no attention_mask so that the model builds its own masks"
        )
    return Mask(kind)


def _sinks(kwargs: dict[str, Any]) -> Tensor | None:
    given = {k: kwargs[k] for k in ("s_aux", "sinks") if kwargs.get(k) is not None}
    if len(given) > 1:
        raise ValueError("seqpar attention: got both s_aux and sinks; pass one tensor of sink logits")
    return next(iter(given.values()), None)


def _check_temperature_tuning(module: torch.nn.Module, n: int, state: ParallelState) -> None:
    """Llama 4 NoPE layers scale queries by local ``arange`` positions (Note [transformers ...])."""
    tuned = getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
    if state.cp_size == 1 or not tuned:
        return
    floor_scale = int(module.floor_scale)
    # S < cp_size * (n + 2) (Note [Recognising transformers masks]): below floor_scale every scale
    # is 1, for local and global positions alike. Decided from n alone, without communication.
    if state.cp_size * (n + 2) > floor_scale:
        raise NotImplementedError(
            f"seqpar attention: layer {getattr(module, 'layer_idx', '?')} applies Llama 4's "
            "attn_temperature_tuning, which scales queries by torch.arange over the local tokens "
            f"instead of their global positions; that is exact on shards only for sequences shorter "
            f"than floor_scale={floor_scale} tokens, and this rank holds {n} of up to "
            f"{state.cp_size * (n + 2) - 1}; use shorter sequences (or attn_temperature_tuning=False "
            "where the model allows it)"
        )


def _check_kwargs(kwargs: dict[str, Any], dropout: float, packed: bool = False) -> None:
    """Refuse attention dropout and every kwarg seqpar does not honour (``_UNSUPPORTED_KWARGS``, and
    any name outside ``_HONOURED_KWARGS`` / ``_PASS_THROUGH_KWARGS``) that is not None: ignoring one
    would compute another attention than the model's (an indexer's ``block_indices`` select key
    blocks; dense attention would be wrong on one rank already; the sparse adapters consume them). ``packed``: the packed-batch
    kwargs are honoured (``cu_seq_lens_q`` given, no cache); otherwise they are refused."""
    for name in sorted(kwargs):
        if kwargs[name] is None or name in _HONOURED_KWARGS or name in _PASS_THROUGH_KWARGS:
            continue
        if name in PACKED_KWARGS:
            if packed:
                continue
            raise NotImplementedError(
                f"seqpar attention: {name} is given "
                + ("with seqpar's KV cache, which does not serve packed batches"
                   if kwargs.get("cu_seq_lens_q") is not None else "without cu_seq_lens_q")
                + "; packed batches on sequence shards take the global cu_seq_lens_q (and cu_seq_lens_k) "
                "with input_ids and position_ids sharded by seqpar.shard_packed, and use_cache=False"
            )
        what = _UNSUPPORTED_KWARGS.get(name)
        if what is not None:
            raise NotImplementedError(f"seqpar attention: {name} is given, but {what} is not supported on sequence shards")
        raise NotImplementedError(
            f"seqpar attention: the model passes {name}={_describe(kwargs[name])} to the attention function, "
            "which seqpar does not honour; computing plain attention without it could give another "
            f"result than the model's, so it is refused. Arguments seqpar honours: {sorted(_HONOURED_KWARGS)}"
        )
    if dropout:
        raise NotImplementedError(
            f"seqpar attention: attention dropout {dropout} is not supported on sequence shards; set "
            "config.attention_dropout = 0.0 (or call model.eval())"
        )


@contextlib.contextmanager
def _refusing_together(state: ParallelState, device: torch.device) -> Iterator[None]:
    """Checks on one rank's own data: a failure also makes the other CP ranks' next
    ``seqpar.attention`` call (the first layer's, which exchanges lengths) raise, instead of
    leaving them waiting for this rank until the process group's timeout."""
    from ..attention import refuse_collectively

    try:
        yield
    except (ValueError, NotImplementedError) as error:
        refuse_collectively(state, device, None, error)


# --- transformers entry points --------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: RecognisedMask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    state: ParallelState,
    backend: str = "auto",
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function over sequence shards (bound to a state by :func:`register`).

    Args:
        module: the attention module (``is_causal``, ``num_key_value_groups``, ``layer_idx``,
            ``sliding_window`` and Llama 4's temperature-tuning attributes are read).
        query: ``(batch, nheads, seqlen_local, headdim)``.
        key, value: ``(batch, nheads_kv, seqlen_local, headdim)``; ``nheads % nheads_kv == 0``.
        attention_mask: the :class:`RecognisedMask` of :func:`mask_function`, ``None`` (then
            ``is_causal`` and ``sliding_window`` decide), or, with ``cp_size == 1`` only, a 4-D mask
            of the plain causal / all-attend pattern (Note [transformers attention on shards]).
        dropout: must be 0 (the model in eval mode, or ``attention_dropout=0``).
        scaling: softmax scale (default ``headdim ** -0.5``).
        is_causal: overrides ``module.is_causal`` (default ``True``) when given.
        kwargs: ``sliding_window`` (int or ``None``), ``softcap`` (float or ``None``), ``s_aux``
            or ``sinks`` (``(nheads,)``), ``position_ids`` (checked on the first layer), a packed
            batch's ``cu_seq_lens_q`` (global ``[nseq + 1]`` boundaries, the same on every rank),
            ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k`` and ``seq_idx`` (Note [Packed
            sequences in transformers models]), and transformers' pass-through options
            (``use_cache``, ``output_attentions``, ...); any other kwarg (position biases, an
            indexer's ``indices`` or ``block_indices``, anything unknown) must be ``None``.

    Returns:
        ``(out, None)`` with ``out`` ``(batch, seqlen_local, nheads, headdim)``, this rank's shard of
        exact attention over the global sequence (packed: ``(1, T_local, nheads, headdim)``, each
        token attending within its own sequence, by ``seqpar.varlen_attention``).

    Raises:
        ValueError: a 4-D mask over shards (``cp_size > 1``: a shard's block cannot say how
            tokens attend across shards), or on one rank other than the plain causal / all-attend
            pattern; a mask that disagrees with ``is_causal`` or ``sliding_window``; position_ids
            that are not global shard positions (without ``cu_seq_lens_q``); malformed packed
            boundaries, or ones that do not place this rank's tokens; head counts that disagree
            with ``num_key_value_groups``.
        NotImplementedError: dropout > 0, decoding with a KV cache, a kwarg seqpar does not honour
            (named in the message), or Llama 4 temperature tuning on sequences of ``floor_scale``
            tokens or more.

    With ``cp_size > 1`` a check that fails on this rank makes the other CP ranks' attention call
    of the same layer raise too (``seqpar.attention.refuse_collectively``): no rank is left waiting.
    """
    n = query.shape[2]
    cached = _served_by_cache(module, key, value, state)  # Note [transformers cache on shards]
    if cached is not None:  # the same call on every rank: a refusal raises on all of them
        _check_kwargs(kwargs, dropout)
        return _cache_attention(module, query, key, value, attention_mask, scaling, is_causal, state, backend, cached, kwargs)
    position_ids = kwargs.get("position_ids")
    packed = kwargs.get("cu_seq_lens_q") is not None  # Note [Packed sequences in transformers models]
    seq_lens: tuple[int, ...] = ()
    # Every check here may fail on some ranks only (a layer that builds keys from its shard, as
    # DeepSeek-V4's compressor does, gets other key counts on other ranks): all of them run inside
    # the shared refusal, so that the other ranks' first seqpar.attention raises too.
    with _refusing_together(state, query.device):
        _check_kwargs(kwargs, dropout, packed)
        if key.shape[2] != n:
            raise NotImplementedError(
                f"seqpar attention: query has {n} tokens but key/value have {key.shape[2]}: "
                "decoding with transformers' own KV cache is not supported on sequence shards; call the model "
                "with use_cache=False, or decode with seqpar's cache: seqpar.integrations.transformers.generate "
                "or pass SeqparCache(state, num_layers) as the model's cache (cache=, past_key_values= before "
                "transformers 5.24; docs/inference.md)"
            )
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None and query.shape[1] != key.shape[1] * groups:
            raise ValueError(
                f"seqpar attention: query has {query.shape[1]} heads, key {key.shape[1]}, but the module "
                f"says num_key_value_groups={groups}"
            )
        mask = _layer_mask(module, attention_mask, is_causal, kwargs, n, state)
        if packed:  # the model check compared the positions with the boundaries
            seq_lens = packed_lengths(kwargs, query.shape[0], "seqpar attention")
        elif isinstance(attention_mask, RecognisedMask) and attention_mask.packed:
            raise ValueError(_positions_message(position_ids, state))
        elif isinstance(position_ids, Tensor) and getattr(module, "layer_idx", 0) == 0:
            _check_positions(position_ids, state)
        _check_temperature_tuning(module, n, state)

    from ..attention import attention, varlen_attention

    if packed:  # [1, H, T_local, D] -> [T_local, H, D]; varlen_attention checks the counts on every rank
        out = varlen_attention(
            *(t[0].transpose(0, 1) for t in (query, key, value)), state, seq_lens,
            causal=mask.causal, window=mask.window, chunk_size=mask.chunk_size,
            softcap=float(kwargs.get("softcap") or 0.0), sinks=_sinks(kwargs),
            softmax_scale=scaling, backend=backend,
        )
        return out.unsqueeze(0), None
    out = attention(
        query, key, value, state,
        causal=mask.causal, window=mask.window, chunk_size=mask.chunk_size,
        softcap=float(kwargs.get("softcap") or 0.0), sinks=_sinks(kwargs),
        softmax_scale=scaling, layout="bhsd", backend=backend,
        seq_len=n if state.cp_size == 1 else None,
    )
    return out.transpose(1, 2).contiguous(), None


def _cache_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: object,
    scaling: float | None, is_causal: bool | None, state: ParallelState, backend: str, cached: tuple,
    kwargs: dict[str, Any],
) -> tuple[Tensor, None]:
    """A layer served by a ``SeqparCache`` (Note [transformers cache on shards]): the sharded prefill
    or a block of new tokens (the same on every rank), through ``seqpar.inference``."""
    from ..inference import decode, prefill

    cache, layer_idx, sharded = cached
    if cache.state is not state:
        raise ValueError(
            f"seqpar attention: layer {layer_idx} got a SeqparCache made for another ParallelState than the one "
            "this attention implementation was registered with; make the cache with the same state"
        )
    n = query.shape[2]
    mask = _layer_mask(module, attention_mask, is_causal, kwargs, n, state)
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, Tensor) and layer_idx == 0:
        if sharded:
            _check_positions(position_ids, state)
        else:
            first = cache.kv.layer(0).length
            want = torch.arange(first, first + n, device=position_ids.device)
            if position_ids.shape[-1] != n or not bool((position_ids.reshape(-1, n) == want).all()):
                raise ValueError(
                    f"seqpar attention: new tokens at position_ids {position_ids.reshape(-1, n)[0, :8].tolist()}... "
                    f"but the cache holds {first} tokens, so they are at {first}..{first + n - 1}"
                )
    if sharded:  # new tokens carry global positions: Llama 4's query scaling is exact for them
        _check_temperature_tuning(module, n, state)
    options = dict(
        causal=mask.causal, window=mask.window, chunk_size=mask.chunk_size,
        softcap=float(kwargs.get("softcap") or 0.0), sinks=_sinks(kwargs), softmax_scale=scaling,
    )
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if sharded:
        out = prefill(q, k, v, cache.kv, layer_idx, backend=backend, **options)
    else:
        out = decode(q, k, v, cache.kv, layer_idx, **options)
    cache.served(layer_idx)
    return out.contiguous(), None


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    local_size: int | None = None,
    *,
    state: ParallelState,
    **kwargs: Any,
) -> RecognisedMask:
    """transformers mask function for seqpar: recognises the pattern, builds no tensor.

    Args:
        batch_size, q_length, kv_length, q_offset, kv_offset: as transformers passes them;
            ``q_length`` is the local shard length and must equal ``kv_length`` (no cache).
        mask_function: transformers' ``(batch_idx, head_idx, q_idx, kv_idx) -> bool`` pattern
            (default: causal).
        attention_mask: the model's 2-D ``(batch, seqlen_local)`` mask, or ``None``; must be all
            ones.
        use_vmap: set by transformers for custom mask functions (evaluated with ``torch.vmap``).
        local_size: the sliding window or chunk size, which transformers passes for those masks.
        state: the parallel state the tokens are sharded over (bound by :func:`register`).

    Returns:
        A :class:`RecognisedMask` (Note [Recognising transformers masks]).

    Raises:
        ValueError: a padding mask (any zero in ``attention_mask``); a 2-D ``attention_mask``
            longer than the shard (a full-length mask next to sharded ids). Position_ids of a
            packed wrapper that are not this rank's global positions mark the mask ``packed``:
            the layers refuse it without ``cu_seq_lens_q``.
        NotImplementedError: a KV cache or cross-attention (``kv_length != q_length``, offsets);
            a pattern that depends on token data or is no causal/window/chunk mask.
    """
    offsets = (q_offset, kv_offset)
    device = attention_mask.device if isinstance(attention_mask, Tensor) else torch.device("cpu")
    if (
        all(isinstance(o, int) for o in offsets) and (q_offset or kv_length != q_length)
        and kv_offset == 0 and kv_length == q_offset + q_length
    ):  # new tokens after a cache (the same on every rank): Note [transformers cache on shards]
        return _cached_mask(batch_size, q_length, kv_length, mask_function, attention_mask, use_vmap, local_size, kwargs)
    if (
        isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 and attention_mask.shape[-1] != q_length
        and kv_length == attention_mask.shape[-1] and offsets == (0, 0)
    ):  # transformers takes kv_length from the mask when there is no cache
        with _refusing_together(state, device):
            raise ValueError(full_length_mask_message(attention_mask.shape[-1], q_length))
    if kv_length != q_length or not all(isinstance(o, int) for o in offsets) or any(offsets):
        raise NotImplementedError(
            f"seqpar attention: a mask for {q_length} queries over {kv_length} keys (offsets "
            f"{q_offset}, {kv_offset}): decoding with a KV cache and cross-attention are not "
            "supported on sequence shards; call the model with use_cache=False"
        )
    if mask_function is None:
        from transformers.masking_utils import causal_mask_function as mask_function
    base, position_ids = _unwrap_packing(mask_function)
    with _refusing_together(state, device):
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError(
                "seqpar attention: padding masks are not supported on sequence shards (the "
                "attention_mask has zeros); drop padding, or pack the sequences and use "
                "seqpar.varlen_attention"
            )
        # Positions that are not this rank's global positions are packed sequences (or a mistake):
        # the layers decide with the call's cu_seq_lens_q, which the mask function does not get.
        packed = position_ids is not None and not _are_shard_positions(position_ids, state)
        if state.cp_size == 1:
            grid = max(q_length, 2)  # two positions tell causal from bidirectional
        else:
            grid = max(state.cp_size * (q_length + 2), 2 * local_size + 2 if local_size else 0)
        hint = int(local_size) if local_size else None
        # A mask that cannot be recognised may be refused on some ranks only (whether transformers
        # sees "packed" position ids depends on the shard): the refusal is shared.
        mask = recognise_mask_function(base, batch_size=batch_size, grid=grid, hint=hint, use_vmap=use_vmap)
    return RecognisedMask(mask, grid, getattr(kwargs.get("config"), "model_type", "") or "", packed)


def _cached_mask(
    batch_size: int, q_length: int, kv_length: int, fn: Callable | None, attention_mask: Tensor | None,
    use_vmap: bool, local_size: int | None, kwargs: dict[str, Any],
) -> RecognisedMask:
    """The mask of ``q_length`` new tokens after ``kv_length - q_length`` cached ones, recognised on
    global positions ``0 .. kv_length - 1`` (every rank sees the same sizes: no refusal can differ)."""
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "seqpar attention: padding masks are not supported with seqpar's KV cache (the attention_mask has "
            "zeros); generate one prompt per batch row of equal length, without padding"
        )
    if fn is None:
        from transformers.masking_utils import causal_mask_function as fn
    base, packed = _unwrap_packing(fn)
    if packed is not None:
        raise NotImplementedError(
            "seqpar attention: packed sequences (position_ids that restart) are not supported with seqpar's KV cache"
        )
    grid = max(kv_length, 2 * int(local_size) + 2 if local_size else 0, 2)
    hint = int(local_size) if local_size else None
    mask = recognise_mask_function(base, batch_size=batch_size, grid=grid, hint=hint, use_vmap=use_vmap)
    return RecognisedMask(mask, grid, getattr(kwargs.get("config"), "model_type", "") or "")


def register(state: ParallelState, name: str = "seqpar", *, backend: str = "auto", mixing: str = "head_parallel") -> str:
    """Register seqpar attention over ``state`` with transformers under ``name``.

    Registers :func:`attention_forward` and :func:`mask_function` (both bound to ``state``) in
    ``AttentionInterface`` and ``AttentionMaskInterface``, so that
    ``from_pretrained(..., attn_implementation=name)`` or ``_from_config(config,
    attn_implementation=name)`` runs every attention layer on sequence shards. Feed the model
    ``input_ids=seqpar.shard(ids, state)``, ``position_ids=seqpar.shard_positions(S, state)[None]``
    and ``use_cache=False``, no ``labels``. Registering the same name again rebinds it.

    The first call also installs (once per process) the hook that gives every model built with
    a seqpar name a check of its own calls (Note [transformers model checks] in
    ``seqpar.integrations.transformers_guard``); give each model its own config object.

    Args:
        state: the parallel state the tokens are sharded over.
        name: the ``attn_implementation`` name.
        backend: attention backend passed to ``seqpar.attention``.
        mixing: how hybrid layers' token mixers run on shards: ``"head_parallel"``,
            ``"state_passing"`` or ``"auto"`` (``seqpar.integrations.transformers_mixers.install``;
            docs/hybrid-models.md, "Choosing the mode").

    Returns:
        ``name``.

    Raises:
        ValueError: ``state`` is not a ParallelState, ``name`` is empty or one of transformers'
            built-in implementations, or ``mixing`` names no mode.
        ImportError: transformers is missing or older than 4.53.
    """
    require_state(state, "register")
    if not isinstance(name, str) or not name or name in _BUILTIN or name.startswith("paged|"):
        raise ValueError(
            f"register: name must be a new attn_implementation name, got {name!r} (built-in names "
            f"{list(_BUILTIN)} cannot be replaced)"
        )
    check_mixing(mixing, "register")
    attention_interface, mask_interface = _interfaces()

    def seqpar_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return attention_forward(
            module, query, key, value, attention_mask, dropout, scaling,
            state=state, backend=backend, **kwargs,
        )

    def seqpar_mask(*args, **kwargs):
        return mask_function(*args, state=state, **kwargs)

    seqpar_attention._seqpar_binding = Binding(state, backend, mixing)  # models built for `name` find their state
    attention_interface.register(name, seqpar_attention)
    mask_interface.register(name, seqpar_mask)
    install(_MODEL_CHECKS)
    return name


def __getattr__(name: str):  # SeqparCache imports transformers: loaded on first use
    if name == "SeqparCache":
        from .transformers_cache import SeqparCache

        return SeqparCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _prompt_fingerprints(input_ids: Tensor, expand: int, limit: int) -> list[int]:
    """What every CP rank must agree on before the prefill: the prompt (batch, length and a
    fingerprint of its ids), the effective batch expansion (beams / returned sequences) and the
    length limit (``max_new_tokens``, else ``max_length``), which decide the shapes and the number
    of every later collective."""
    return [int(input_ids.shape[0]), int(input_ids.shape[-1]), fingerprint(input_ids), expand, limit]


def _effective_config(model: torch.nn.Module, generate_kwargs: dict[str, Any]) -> Any:
    """The generation config ``model.generate`` will use for these kwargs, found the way it finds it:
    kwargs over ``generation_config=`` over ``model.generation_config`` over the global defaults
    (transformers' own ``_prepare_generation_config``, a copy; nothing of the model changes)."""
    kwargs = dict(generate_kwargs)
    given = kwargs.pop("generation_config", None)
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is None:  # pragma: no cover - every GenerationMixin of the supported releases has it
        raise NotImplementedError(
            f"seqpar generate: {type(model).__name__} has no _prepare_generation_config, so the effective "
            "generation config (beams, stopping) cannot be read the way its generate reads it"
        )
    return prepare(given, **kwargs)[0]


@functools.cache
def _agreed_criteria_class() -> type:
    """``StoppingCriteriaList`` whose answer is agreed by the CP group (Note [Stopping on shards])."""
    from transformers import StoppingCriteriaList

    from ..comm import exchange_ints

    class AgreedStoppingCriteria(StoppingCriteriaList):
        """The same criteria; every call ORs the per-row answers of the CP ranks (one all-gather of
        ``1 + batch`` ints), and a criterion that raised on one rank raises on every rank."""

        state: ParallelState

        def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
            error: BaseException | None = None
            try:
                done = [int(d) for d in super().__call__(input_ids, scores, **kwargs).tolist()]
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                error, done = e, [0] * input_ids.shape[0]
            rows = exchange_ints([int(error is not None), *done], self.state.cp_group, input_ids.device)
            failed = [c for c, row in enumerate(rows) if row[0]]
            if error is not None:
                raise error
            if failed:
                raise RuntimeError(
                    f"seqpar generate: a stopping criterion raised on CP rank(s) {failed} (their traceback has "
                    "the error); this rank stops with them"
                )
            agreed = [max(column) for column in zip(*(row[1:] for row in rows))]
            return torch.tensor(agreed, dtype=torch.bool, device=input_ids.device)

    return AgreedStoppingCriteria


@contextlib.contextmanager
def _stopping_agreed(model: torch.nn.Module, state: ParallelState) -> Iterator[None]:
    """Inside the block, the stopping criteria ``model.generate`` builds (its own and the caller's)
    answer as one for the CP group.

    Note [Stopping on shards]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    Every CP rank runs transformers' decoding loop, and every step of it is a collective (each
    attention layer merges the shards' partial outputs), so every rank must take the same number
    of steps and finish the same rows. Stopping criteria may answer differently per rank:
    ``max_time`` reads each rank's clock, a custom criterion may read anything. So after each
    step the per-row answers of the CP ranks are all-gathered (``1 + batch`` ints, the first
    saying whether the criteria raised) and OR-ed: a row stops when any rank's criteria say so
    (for ``max_time``, the earliest clock, so no rank runs past its limit), and a criterion that
    raised on one rank raises on every rank. transformers assembles the list in
    ``_get_stopping_criteria`` and reads its members (the length limit, the EOS criterion)
    elsewhere, so the list is replaced by one of the same members whose call is agreed: the
    method is shadowed on this model instance for the call and the shadow removed on exit."""
    if state.cp_size == 1:
        yield
        return
    build = getattr(model, "_get_stopping_criteria", None)
    if build is None:  # pragma: no cover - every GenerationMixin of the supported releases has it
        raise NotImplementedError(
            f"seqpar generate: {type(model).__name__} has no _get_stopping_criteria, so its stopping criteria "
            "cannot be agreed by the CP ranks"
        )
    agreed_class = _agreed_criteria_class()

    def agreed(*args: Any, **kwargs: Any) -> Any:
        criteria = agreed_class(build(*args, **kwargs))
        criteria.state = state
        return criteria

    shadowed = model.__dict__.get("_get_stopping_criteria", _ABSENT)
    model.__dict__["_get_stopping_criteria"] = agreed
    try:
        yield
    finally:
        if shadowed is _ABSENT:
            model.__dict__.pop("_get_stopping_criteria", None)
        else:
            model.__dict__["_get_stopping_criteria"] = shadowed


def _served_by_cache(module: torch.nn.Module, key: Tensor, value: Tensor, state: ParallelState) -> tuple | None:
    """``(cache, layer_idx, sharded)`` if this attention call serves a ``SeqparCache`` layer, else None:
    ``key`` came from the cache's update (tagged), or the module derived its keys and values from
    what the update returned (MLA's latent cache; Note [transformers cache on shards])."""
    tagged = getattr(key, "_seqpar_cache", None)
    if tagged is not None:
        return tagged
    cache_module = sys.modules.get(__name__ + "_cache")  # not loaded: no SeqparCache exists
    return None if cache_module is None else cache_module.derived_binding(module, key, value, state)


def generate(model: torch.nn.Module, input_ids: Tensor, state: ParallelState, **generate_kwargs: Any) -> Any:
    """``model.generate`` over the CP ranks of ``state``, with the prompt's KV cache sharded over them.

    Every CP rank passes the *full* prompt and gets what ``model.generate`` returns on one device:
    the prompt but its last token is prefilled on shards (``seqpar.shard``; a prompt too short to
    give every rank a token is prefilled as one block instead), then transformers' own ``generate``
    runs on every rank -- logits processors, greedy, beam search, sampling -- while every
    attention layer decodes over ``SeqparCache``'s shards (Note [transformers cache on shards];
    ``docs/inference.md``). Sampling draws the same tokens on every CP rank: the default generators
    are CP rank 0's for the call (``seqpar.rng.synchronized``). Stopping is decided once for the CP
    group: a row stops when the stopping criteria of any CP rank say so (``max_time``, a custom
    criterion that reads a clock; Note [Stopping on shards]).

    Args:
        model: a causal LM built with ``attn_implementation=register(state)``.
        input_ids: ``(batch, seqlen)`` int64, the same on every CP rank; no padding.
        state: the parallel state ``register`` bound the model's implementation to.
        generate_kwargs: passed to ``model.generate`` (``max_new_tokens``, ``do_sample``,
            ``num_beams``, ``generation_config``, ``stopping_criteria``, ``output_scores``,
            ``return_dict_in_generate``, ...). Beams and returned sequences are read from the
            effective generation config, as ``model.generate`` reads them (kwargs over
            ``generation_config`` over ``model.generation_config``). ``use_cache=True`` is
            accepted (it is what seqpar does).

    Returns:
        What ``model.generate`` returns (the same on every CP rank).

    Raises:
        ValueError: a model not built for ``state``'s implementation, prompts or generation
            settings (beams, length limit) that differ between CP ranks, a padding ``attention_mask``.
        NotImplementedError: options a sharded cache cannot serve (``cache`` / ``past_key_values``,
            ``cache_implementation``, ``assistant_model``, ``prompt_lookup_num_tokens``,
            ``inputs_embeds``, ``synced_gpus``, ``use_cache=False``), named in the message.
        Every check that can fail on one rank only fails on every CP rank.
    """
    from ..comm import exchange_ints
    from ..rng import synchronized
    from ..sharding import shard, shard_positions
    from .transformers_cache import SeqparCache  # imports transformers itself: loaded on first use

    require_state(state, "seqpar.integrations.transformers.generate")
    cache_name = cache_argument("seqpar generate")
    generate_kwargs = dict(generate_kwargs)
    error: Exception | None = None
    row = [0, 0, 0, 0, 0]
    try:
        config, expand = _check_generate(model, input_ids, state, generate_kwargs)
        limit = config.max_new_tokens if config.max_new_tokens is not None else config.max_length
        row = _prompt_fingerprints(input_ids, expand, int(limit or 0))
    except (ValueError, NotImplementedError) as e:  # raised on every CP rank, below
        error = e
    if state.cp_size > 1:
        device = input_ids.device if isinstance(input_ids, Tensor) else torch.device("cpu")
        rows = exchange_ints([int(error is not None), *row], state.cp_group, device)
        failed = [c for c, r in enumerate(rows) if r[0]]
        if error is None and failed:
            error = ValueError(
                f"seqpar generate: CP rank(s) {failed} refused the call (their error names the reason); "
                "every CP rank stops with them"
            )
        elif error is None and any(r != rows[0] for r in rows):
            error = ValueError(
                "seqpar generate: the CP ranks passed different prompts or generation settings (batch, "
                f"length, prompt fingerprint, beams or returned sequences, length limit: {[r[1:] for r in rows]}); "
                "pass the same full prompt and the same generate arguments on every CP rank"
            )
    if error is not None:
        raise error
    layers = int(getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                         "num_hidden_layers"))
    prompt = input_ids.shape[-1] - 1
    placement_ok = prompt >= 1 and min(
        Placement.dense(prompt, state.ring_size, state.ulysses_size).shard_lengths
    ) >= 1
    cache = SeqparCache(state, layers, sharded_prefill=placement_ok)
    try:
        with torch.no_grad():
            if placement_ok:
                model(
                    input_ids=shard(input_ids[:, :prompt], state),
                    position_ids=shard_positions(prompt, state, device=input_ids.device)[None],
                    use_cache=True, **{cache_name: cache},
                )
        if expand > 1:  # generate repeats input_ids for beams / returned sequences but not a cache it is given
            cache.kv.repeat(expand)
        given = generate_kwargs.get("generation_config")
        if given is not None:  # use_cache set on (a copy of) the config: no kwargs next to it
            given = copy.deepcopy(given)
            given.use_cache = True
            generate_kwargs["generation_config"] = given
        else:
            generate_kwargs["use_cache"] = True
        with synchronized(state, cuda=input_ids.device.type == "cuda"), _stopping_agreed(model, state):
            return model.generate(input_ids, **{cache_name: cache}, **generate_kwargs)
    finally:
        cache.release()


def _check_generate(
    model: torch.nn.Module, input_ids: Tensor, state: ParallelState, generate_kwargs: dict[str, Any],
) -> tuple[Any, int]:
    """This rank's checks of a :func:`generate` call (no communication); removes ``use_cache`` from
    ``generate_kwargs``. Returns the effective generation config and how many rows
    ``model.generate`` makes of each prompt (``max(num_beams, num_return_sequences)``)."""
    refused = sorted(k for k in generate_kwargs if k in _GENERATE_REFUSED)
    if refused:
        raise NotImplementedError(
            "seqpar generate: " + "; ".join(f"{k} is not supported ({_GENERATE_REFUSED[k]})" for k in refused)
        )
    use_cache = generate_kwargs.pop("use_cache", None)
    given = generate_kwargs.get("generation_config")
    if use_cache is False or (use_cache is None and getattr(given, "use_cache", True) is False):
        raise NotImplementedError(
            "seqpar generate: use_cache=False is not supported: generate decodes over seqpar's sharded KV cache "
            "(without a cache every step would run the whole sequence again); leave use_cache out or pass "
            "use_cache=True -- the tokens are the same"
        )
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    bound = binding(name)
    if bound is None or bound.state is not state:
        raise ValueError(
            f"seqpar generate: the model's attn_implementation is {name!r}, not a name register(state) bound "
            "to this state; build the model with attn_implementation=register(state)"
        )
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[-1] < 1:
        raise ValueError(
            f"seqpar generate: input_ids must be a (batch, seqlen) tensor with seqlen >= 1, got "
            f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    mask = generate_kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and not bool(mask.all()):
        raise ValueError("seqpar generate: the attention_mask has zeros (padding), which a sharded cache does not serve")
    effective = _effective_config(model, generate_kwargs)
    expand = max(int(effective.num_beams or 1), int(effective.num_return_sequences or 1))
    return effective, expand
