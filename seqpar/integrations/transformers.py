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
kwarg or as ``module.is_causal``; ``position_ids`` arrives in ``kwargs``.

The model builds its mask with ``create_causal_mask``/``create_bidirectional_mask``, which look up
the mask function registered under the same name in ``AttentionMaskInterface``. Without one, a
custom implementation gets no mask at all -- a padding mask would be dropped silently -- and with
the ``sdpa`` one, the zig-zag ``position_ids`` of a shard (which jump between chunks) would be taken
for packed sequences and produce a block mask. :func:`register` therefore also registers a mask
function that builds nothing: it returns ``None`` (attention is then causal or not according to
``is_causal``, over the global sequence), accepts an all-ones 2-D mask, and rejects padding and
custom mask patterns. A 4-D mask passed in by the caller reaches the attention function as is: the
plain causal pattern (bool lower triangle, or additive ``0``/``-inf``) of a shard is read as
``causal=True``, an all-attend mask as ``causal=False``; any other mask is rejected.

Registration is global to the process (transformers keeps one class-level mapping); each call to
:func:`register` binds one ``ParallelState`` to one name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..state import ParallelState

__all__ = ["register", "attention_forward", "mask_function"]

# Names that transformers itself provides; registering over them would change every model.
_BUILTIN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
# Attention-modifying kwargs some models pass; seqpar computes plain softmax attention only.
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


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


def _check_positions(position_ids: Tensor, state: ParallelState) -> None:
    """Raise if ``position_ids`` cannot be this rank's ``shard_positions`` of a dense sequence."""
    if position_ids.shape[-1] == 0:
        return
    ok = (position_ids.diff(dim=-1) > 0).all()
    if state.cp_rank > 0:
        # A non-empty shard on cp_rank > 0 never starts at position 0 (Note [Sharding placement]).
        ok = ok & (position_ids[..., 0] != 0).all()
    if not bool(ok):
        raise ValueError(
            f"seqpar attention (cp rank {state.cp_rank} of {state.cp_size}): position_ids "
            f"{position_ids[..., :8].tolist()}... are not this rank's global positions; pass "
            "position_ids=seqpar.shard_positions(S, state)[None] with the sharded input_ids (packed "
            "sequences whose positions restart need seqpar.varlen_attention, not this integration)"
        )


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
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
        module: the attention module (``is_causal``, ``num_key_value_groups``, ``layer_idx`` are read).
        query: ``(batch, nheads, seqlen_local, headdim)``.
        key, value: ``(batch, nheads_kv, seqlen_local, headdim)``; ``nheads % nheads_kv == 0``.
        attention_mask: ``None`` (as :func:`mask_function` produces), or a 4-D mask of the plain
            causal / all-attend pattern over the shard (see Note [transformers attention on shards]).
        dropout: must be 0 (the model in eval mode, or ``attention_dropout=0``).
        scaling: softmax scale (default ``headdim ** -0.5``).
        is_causal: overrides ``module.is_causal`` (default ``True``) when given.
        kwargs: ``position_ids`` is checked on the first layer; unsupported attention
            modifiers (``sliding_window``, ``softcap``, sinks, ``position_bias``) must be ``None``.

    Returns:
        ``(out, None)`` with ``out`` ``(batch, seqlen_local, nheads, headdim)``, this rank's shard of
        exact attention over the global sequence.

    Raises:
        ValueError: a mask other than the plain causal / all-attend pattern; position_ids that are
            not global shard positions; head counts that disagree with ``num_key_value_groups``.
        NotImplementedError: dropout > 0, decoding with a KV cache, sliding windows, softcap, sinks
            or position biases.
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"seqpar attention: {name}={kwargs[name]!r} is not supported on sequence shards "
                "(seqpar computes plain softmax attention); use a model/config without it"
            )
    if dropout:
        raise NotImplementedError(
            f"seqpar attention: attention dropout {dropout} is not supported on sequence shards; set "
            "config.attention_dropout = 0.0 (or call model.eval())"
        )
    if key.shape[2] != query.shape[2]:
        raise NotImplementedError(
            f"seqpar attention: query has {query.shape[2]} tokens but key/value have {key.shape[2]}: "
            "decoding with a KV cache is not supported on sequence shards; call the model with "
            "use_cache=False"
        )
    groups = getattr(module, "num_key_value_groups", None)
    if groups is not None and query.shape[1] != key.shape[1] * groups:
        raise ValueError(
            f"seqpar attention: query has {query.shape[1]} heads, key {key.shape[1]}, but the module "
            f"says num_key_value_groups={groups}"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None:
        kind = _mask_kind(attention_mask, query.shape[2], key.shape[2])
        if kind is None:
            raise ValueError(
                f"seqpar attention: got an attention mask {tuple(attention_mask.shape)} "
                f"({attention_mask.dtype}) that is not a plain causal or all-attend pattern; padding "
                "and custom masks are not supported on sequence shards (pack sequences and use "
                "seqpar.varlen_attention, or drop padding)"
            )
        causal = kind
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, Tensor) and getattr(module, "layer_idx", 0) == 0:
        _check_positions(position_ids, state)

    from ..hybrid import attention

    out = attention(
        query, key, value, state, causal=bool(causal), softmax_scale=scaling, layout="bhsd", backend=backend
    )
    return out.transpose(1, 2).contiguous(), None


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> None:
    """transformers mask function for seqpar: builds no mask (attention follows ``is_causal``).

    Args:
        attention_mask: the model's 2-D ``(batch, seqlen)`` mask, or ``None``; must be all ones.
        use_vmap: set by transformers when the model overlays custom mask functions.

    Returns:
        ``None`` always.

    Raises:
        ValueError: a padding mask (any zero in ``attention_mask``).
        NotImplementedError: custom ``or``/``and`` mask functions (e.g. bidirectional image tokens).
    """
    if use_vmap:
        raise NotImplementedError(
            "seqpar attention: this model combines custom mask functions (or_mask_function/"
            "and_mask_function), which are not supported on sequence shards"
        )
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "seqpar attention: padding masks are not supported on sequence shards (the attention_mask "
            "has zeros); drop padding, or pack the sequences and use seqpar.varlen_attention"
        )
    return None


def register(state: ParallelState, name: str = "seqpar", *, backend: str = "auto") -> str:
    """Register seqpar attention over ``state`` with transformers under ``name``.

    Registers :func:`attention_forward` (bound to ``state``) in ``AttentionInterface`` and
    :func:`mask_function` in ``AttentionMaskInterface``, so that
    ``from_pretrained(..., attn_implementation=name)`` or ``_from_config(config,
    attn_implementation=name)`` runs every attention layer on sequence shards. Feed the model
    ``input_ids=seqpar.shard(ids, state)``, ``position_ids=seqpar.shard_positions(S, state)[None]``
    and ``use_cache=False``. Registering the same name again rebinds it.

    Args:
        state: the parallel state the tokens are sharded over.
        name: the ``attn_implementation`` name.
        backend: attention backend passed to ``seqpar.attention``.

    Returns:
        ``name``.

    Raises:
        ValueError: ``state`` is not a ParallelState, or ``name`` is empty or one of transformers'
            built-in implementations.
        ImportError: transformers is missing or older than 4.53.
    """
    if not isinstance(state, ParallelState):
        raise ValueError(f"register: state must be a seqpar.ParallelState, got {type(state).__name__}")
    if not isinstance(name, str) or not name or name in _BUILTIN or name.startswith("paged|"):
        raise ValueError(
            f"register: name must be a new attn_implementation name, got {name!r} (built-in names "
            f"{list(_BUILTIN)} cannot be replaced)"
        )
    attention_interface, mask_interface = _interfaces()

    def seqpar_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout,
            scaling,
            state=state,
            backend=backend,
            **kwargs,
        )

    attention_interface.register(name, seqpar_attention)
    mask_interface.register(name, mask_function)
    return name
