"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5), exact on sequence shards.

Note [DeepSeek sparse attention on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A DSA layer (transformers 5.23: ``DeepseekV32Attention``, ``GlmMoeDsaAttention``) is MLA whose
keys are chosen per query by an indexer:

- the indexer (``DeepseekV32Indexer``, ``GlmMoeDsaIndexer``; run under ``torch.no_grad``, no
  loss of its own in 5.23) projects per token ``index_n_heads`` index queries (from the MLA's
  ``q_resid``), one index key ``k = k_norm(wk(x))`` and per-head weights ``w``; RoPE on the first
  ``qk_rope_head_dim`` channels of both (half-split for V3.2, interleaved for GLM); the score
  ``sum_h w[s, h] * relu(scale * q[s, h] . k[t])`` (float32) plus the causal mask; the top
  ``index_topk`` keys per query;
- the attention expands the latent (``kv_a_layernorm(c_kv)`` and the RoPE'd shared ``k_rot``,
  ``kv_lora_rank + qk_rope_head_dim`` channels per token) with ``kv_b_proj`` into per-head keys and
  values and attends to the selected keys only: transformers' eager and sdpa paths fold the
  selection into the mask, other implementations receive it as ``indices=``;
- GLM-5's ``"shared"`` layers (``config.indexer_types``) reuse the previous full layer's selection.

On shards everything per token stays on the shard: projections, norms, the queries' RoPE (with the
global positions' tables), index queries and weights. Two per-token tensors are read by every
later query: the latent and the index key. Both are all-gathered over the CP group into global
order (``seqpar.unshard``; its backward reduce-scatters the latent's gradient to the rank that owns
each token; the index key has none). Then every step of the one-device layer runs for the local
queries against all ``S`` keys: the scores, the causal mask of their global positions
(``shard_positions``), the top-k over the same keys in the same order (the same selection, ties
included), the expansion of the gathered latent, and transformers' sdpa attention over the keys
that are causal and selected. The selection holds global key indices, so GLM's shared layers
reuse it as it is.

The layer's own forward runs on the shard (Note [Rebound kernels]) with three of its inputs
replaced:

- ``past_key_values`` (``cache`` from transformers 5.24, Note [Renamed cache parameter]):
  :class:`_WholeSequence`, which takes the cache's place where the forward hands it the new
  tokens' latent (``update``; 5.24 adds the forward's kwargs, unused here) and index key
  (``update_indexer``) and reads back all keys: here, the whole sequence's;
- ``attention_mask``: the causal mask of the local queries over all keys, a bool
  ``[1, 1, S_local, S]`` tensor (the forward slices it for the indexer and passes it on), in place
  of seqpar's recognised mask, which must be plain causal;
- ``ALL_ATTENTION_FUNCTIONS`` (a global of its modeling module, rebound for this instance only):
  its ``get_interface`` returns :func:`_selected_attention`, which computes with transformers'
  sdpa function under the mask restricted to the ``indices=`` the forward passes.

With one rank the same path runs (every gather is the identity), so seqpar's implementation runs
these models on one device too. Decoding with a cache, packed batches, attention dropout and any
mask but the plain causal one are refused before any collective, from the call's arguments,
which every CP rank passes alike: every rank raises the same error.

Cost per rank and layer (docs/sparse-attention.md): the forward receives ``S - S_local`` tokens of
``kv_lora_rank + qk_rope_head_dim + index_head_dim`` elements and the backward reduce-scatters the
latent's part, against ``H * (qk_head_dim + v_head_dim)`` per token for gathering expanded keys and
values. Compute: the scores of the local queries against all ``S`` keys, as one device computes
them for those queries; the latent's expansion (``kv_b_proj``) runs on all ``S`` tokens on every
rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...comm import exchange_ints
from ...placement import Mask, Placement
from ...sharding import shard_positions, unshard
from ...state import ParallelState
from ..transformers_shared import RecognisedMask, binding
from . import register_adapter
from .gated_delta import PACKED_KWARGS  # the same packed-batch kwargs every adapter refuses
from .rebind import (
    cache_parameter, call_cache, checked_forward, original_kernels, parameter_name, rebind_forward, refuse_adapting,
    set_forward,
)

__all__: list[str] = []

_CLASSES = (
    "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention",
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention",
)
_CACHE = cache_parameter("past_key_values")
_PARAMETERS = ("self", "hidden_states", "position_embeddings", "attention_mask", _CACHE, "position_ids")
# What the forward must read for the replaced inputs to be used as described in the Note.
_READS = ("ALL_ATTENTION_FUNCTIONS", "get_interface", "update", "indexer", "kv_lora_rank")
_INDEXER_PARAMETERS = (
    "self", "hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids", _CACHE,
)
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
# Kwargs the layer's forward hands on to attention that do not change what it computes; any other
# that is not None is refused (it would be dropped here).
_PASS_THROUGH_KWARGS = frozenset({
    "use_cache", "output_attentions", "output_hidden_states", "output_router_logits", "return_dict",
    "cache_position", "num_items_in_batch", "logits_to_keep",
})


class _WholeSequence:
    """Takes the cache's place in one call of a DSA layer on shards (Note [DeepSeek sparse attention
    on shards]): what the forward hands over for the shard's tokens comes back for all ``seq_len``
    tokens, in global order."""

    def __init__(self, state: ParallelState, seq_len: int, name: str) -> None:
        self.state, self.seq_len, self.name = state, seq_len, name

    def update(self, key_pass: Tensor, key_rot: Tensor, layer_idx: int, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The latent ``[B, 1, S_local, kv_lora_rank]`` and ``k_rot [B, 1, S_local, rope]`` of the
        whole sequence (one all-gather; backward reduce-scatters). ``kwargs``: what transformers
        5.24 hands a cache along (the layer's call kwargs), for a cache to store by; nothing here."""
        if key_pass.ndim != 4 or key_rot.ndim != 4 or key_pass.shape[:3] != key_rot.shape[:3]:
            raise _shape_error(self.name, f"hands its cache latents {tuple(key_pass.shape)} and {tuple(key_rot.shape)}")
        whole = unshard(torch.cat([key_pass, key_rot], dim=-1), self.state, dim=2, size=self.seq_len)
        return whole.split([key_pass.shape[-1], key_rot.shape[-1]], dim=-1)

    def update_indexer(self, key: Tensor, layer_idx: int) -> Tensor:
        """The index keys ``[B, S_local, index_head_dim]`` of the whole sequence."""
        if key.ndim != 3:
            raise _shape_error(self.name, f"hands its cache index keys {tuple(key.shape)}, not [B, S, D]")
        return unshard(key, self.state, dim=1, size=self.seq_len)


class _SelectedInterface:
    """Stands in for ``ALL_ATTENTION_FUNCTIONS`` in a DSA layer's rebound forward."""

    def get_interface(self, name: str, default: Callable) -> Callable:
        return _selected_attention


_SELECTED = _SelectedInterface()


def _selected_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
    dropout: float = 0.0, scaling: float | None = None, indices: Tensor | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' sdpa attention of ``query [B, H, S_local, D]`` over ``key, value [B, H, S, D]``
    restricted to ``attention_mask [1, 1, S_local, S]`` (causal) and the selected ``indices [B,
    S_local, topk]`` (global key positions), as the model's eager / sdpa path masks it on one device."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = type(module).__name__
    if indices is None or indices.ndim != 3 or indices.shape[1] != query.shape[2]:
        got = None if indices is None else tuple(indices.shape)
        raise _shape_error(name, f"passes its attention indices={got} for {query.shape[2]} queries")
    batch, _, n, _ = query.shape
    selected = torch.zeros(batch, 1, n, key.shape[2], dtype=torch.bool, device=query.device)
    selected.scatter_(-1, indices.long().unsqueeze(1), True)
    keep = attention_mask & selected
    return sdpa_attention_forward(module, query, key, value, keep, dropout=dropout, scaling=scaling)


def _shape_error(name: str, what: str) -> NotImplementedError:
    import transformers

    return NotImplementedError(
        f"seqpar: {name}'s forward {what}; its adapter was written against transformers 5.23 and 5.24 "
        f"(installed: {transformers.__version__}). Run the model with attn_implementation='sdpa' on one "
        "device, or report the version"
    )


@dataclass(frozen=True)
class CallRefusal:
    """What a whole-sequence adapter (this module, :mod:`.compressed`, :mod:`.block_sparse`)
    refuses per call, from the call's arguments alone (the same on every rank): a cache, packed-
    batch kwargs, a kwarg outside ``honoured`` that is not None, attention dropout in training, a
    mask other than the model's causal one (sliding when ``window`` gives the layer's window).

    Attributes:
        what: the attention's name in the messages.
        cached: why a cache cannot be honoured on shards.
        decode: how to decode instead.
        honoured: the kwargs the adapter runs as the layer would.
        window: the layer's sliding window (``None``: plain causal).
        mask_note: why another mask is refused, appended to that message.
    """

    what: str
    cached: str
    decode: str = "with attn_implementation='sdpa'"
    honoured: frozenset[str] = _PASS_THROUGH_KWARGS
    window: Callable[[nn.Module], int] | None = None
    mask_note: str = ""

    def expected(self, module: nn.Module, grid: int) -> Mask:
        """The mask the layer's call must carry, on ``grid`` positions."""
        if self.window is None:
            return Mask(causal=True)
        return Mask(causal=True, window=(self.window(module) - 1, -1)).normalised(grid)

    def __call__(self, module: nn.Module, cache: object, cache_name: str, mask: object, kwargs: dict[str, Any]) -> None:
        """Raises:
            NotImplementedError: any of the above, naming the layer and the way out.
        """
        name = type(module).__name__
        if cache is not None:
            raise NotImplementedError(
                f"seqpar: {name} ({self.what}) with seqpar's attention does not support a cache "
                f"({cache_name}={type(cache).__name__}): {self.cached}. Call the model with use_cache=False; "
                f"decode {self.decode}"
            )
        packed = [k for k in PACKED_KWARGS if kwargs.get(k) is not None]
        if packed:
            raise NotImplementedError(
                f"seqpar: {name} ({self.what}) does not support packed batches ({', '.join(packed)}) on sequence "
                "shards; pass one sequence per row with position_ids=seqpar.shard_positions(S, state)[None]"
            )
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in self.honoured)
        if unknown:
            raise NotImplementedError(
                f"seqpar: {name} ({self.what}) is called with {', '.join(unknown)}, which its adapter does not "
                "honour on sequence shards; call it without"
            )
        if module.training and module.attention_dropout:
            raise NotImplementedError(
                f"seqpar: {name}: attention dropout {module.attention_dropout} is not supported on sequence "
                "shards; set config.attention_dropout = 0.0 (or call model.eval())"
            )
        if not isinstance(mask, RecognisedMask) or mask.packed or mask.mask != self.expected(module, mask.grid):
            got = mask.mask if isinstance(mask, RecognisedMask) else type(mask).__name__
            kind = "plain" if self.window is None else "sliding-window"
            size = "" if self.window is None else f" (window {self.window(module)})"
            raise NotImplementedError(
                f"seqpar: {name} ({self.what}) runs the {kind} causal mask built by the model{size}, got {got}; "
                f"pass no attention_mask (or all ones){self.mask_note}"
            )


_REFUSE = CallRefusal(
    "DeepSeek sparse attention", "the indexer's keys and the latent would have to be cached per rank",
)


def _global_length(n: int, state: ParallelState, device: torch.device, what: str) -> int:
    """The sequence length whose placement gives this rank ``n`` tokens (one small exchange).

    Raises:
        ValueError: token counts that are not seqpar's placement of their sum (every rank alike).
    """
    if state.cp_size == 1:
        return n
    lengths = [row[0] for row in exchange_ints([n], state.cp_group, device)]
    total = sum(lengths)
    want = list(Placement.dense(total, state.ring_size, state.ulysses_size).shard_lengths)
    if lengths != want:
        raise ValueError(
            f"seqpar: {what}: the CP ranks hold {lengths} tokens, not seqpar's placement of "
            f"their {total} tokens ({want}); shard the inputs with input_ids=seqpar.shard(input_ids, state)"
        )
    return total


def _install(module: nn.Module, state: ParallelState) -> None:
    cls = type(module)
    original_kernels(module, (), _PARAMETERS)  # the instance's forward is the class's, of the expected shape
    checked_forward(cls, _PARAMETERS, _READS)
    indexer = getattr(module, "indexer", None)  # None on GLM-5's shared layers
    if indexer is not None:
        checked_forward(type(indexer), _INDEXER_PARAMETERS, ("update_indexer",))
    if not callable(inspect.getattr_static(cls, "expand_kv", None)):
        raise refuse_adapting(cls, "it has no expand_kv (the latent's expansion)")
    rebound = rebind_forward(module, {_INTERFACE: _SELECTED})

    def prepare(self: nn.Module, arguments: dict[str, Any], hidden: Tensor, seq_len: int, positions: Tensor) -> object:
        causal = positions[:, None] >= torch.arange(seq_len, device=hidden.device)[None, :]
        arguments["attention_mask"] = causal[None, None]
        return _WholeSequence(state, seq_len, type(self).__name__)

    whole_sequence_forward(module, state, rebound, _REFUSE, prepare)


def whole_sequence_forward(
    module: nn.Module, state: ParallelState, rebound: Callable[..., Any],
    refuse: CallRefusal, prepare: Callable[..., object] | None,
) -> None:
    """Set ``module``'s forward: the layer's own (``rebound``) on the shard, its cache replaced by a
    whole-sequence stand-in (Note [DeepSeek sparse attention on shards]; DeepSeek-V4's compressed
    attention, :mod:`.compressed`, does the same).

    Per call, while the model is bound to ``state``: ``refuse(self, cache, cache_name, mask,
    kwargs)`` (before any collective), the global length (one small exchange), then
    ``prepare(self, arguments, hidden_states, seq_len, positions)`` rewrites the call's arguments
    (the mask) and returns the stand-in cache. With ``prepare=None`` the class's forward runs after
    the refusals (no exchange). Bound to plain attention (``seqpar.verify``'s reference), the
    class's forward runs.
    """
    cls = type(module)
    cache_name = parameter_name(cls, _CACHE)  # where the forward takes the cache (written below)
    original = cls.forward
    signature = inspect.signature(original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = binding(getattr(self.config, "_attn_implementation", None))
        if bound is None or bound.state is not state:  # switched to plain attention (seqpar.verify's reference)
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        arguments = call.arguments
        mask, extra = arguments.get("attention_mask"), arguments.get("kwargs", {})
        refuse(self, *call_cache(arguments, _CACHE), mask, extra)
        if prepare is None:
            return original(self, *args, **kwargs)
        hidden = arguments["hidden_states"]
        seq_len = _global_length(hidden.shape[1], state, hidden.device, refuse.what)
        arguments[cache_name] = prepare(self, arguments, hidden, seq_len, shard_positions(seq_len, state, device=hidden.device))
        for other in _CACHE:  # None here (a cache is refused above); deprecate_kwarg would warn of both names
            if other != cache_name:
                extra.pop(other, None)
        return rebound(*call.args, **call.kwargs)

    set_forward(module, forward)


for _qualname in _CLASSES:
    register_adapter(_qualname, modes=None)(_install)  # a gather, not a mixing mode: any mixing runs it

