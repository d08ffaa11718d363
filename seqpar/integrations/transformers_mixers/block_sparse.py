"""MiniMax-M3's block-sparse attention, exact on sequence shards.

Note [MiniMax-M3 block-sparse attention on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A MiniMax-M3 text layer (transformers 5.23: ``MiniMaxM3VLAttention``) is GQA attention with
per-head q/k norms and partial RoPE. On the layers ``config.layer_types`` marks
``"minimax_m3_sparse"`` an indexer (``MiniMaxM3VLIndexer``) chooses, per query and per KV group,
which blocks of keys it attends to:

- per token ``index_n_heads`` index queries and one index key (projections, norms, RoPE on the
  first ``index_head_dim`` channels); the score of query ``s`` and key ``t`` is their float32 dot
  product, ``-inf`` where ``t`` is after the query's ``position_ids`` entry;
- the keys are cut into blocks of ``index_block_size`` key slots from slot 0 (the last block
  padded with ``-inf``), a block's score is the maximum of its keys'; the ``index_local_blocks``
  blocks ending with the query's own (``position_ids // index_block_size``) are forced in with
  ``+inf``; the top ``index_topk_blocks`` blocks are kept, ``-1`` for those scored ``-inf``;
- the layer hands ``block_indices=`` to the attention function; for ``"eager"`` and ``"sdpa"``
  it first folds them into the mask with the indexer's ``build_block_mask`` (the selected
  blocks, expanded to every head of their group, and the causal mask; additive, ``0`` / the
  dtype's minimum).

The gradient reaches the layer's keys and values through the attention only: the selection is a
top-k over indices (the indexer's own parameters get none, as on one device).

On shards everything per token stays on the shard: projections, norms, RoPE (the global
positions' tables), the index queries. Two per-token tensors are read by every later query: the
layer's keys and values (``[B, H_kv, S_local, head_dim]`` each, RoPE'd) and the index key. Both
are all-gathered over the CP group into global order (``seqpar.unshard``; the backward
reduce-scatters the keys' and values' gradients to the rank that owns each token). Then every
step of the one-device layer runs for the local queries against all ``S`` keys: the scores, the
causal mask of their global ``position_ids``, the blocks cut from global slot 0 (so a block
spans shards as it spans positions on one device), the max-pool, the forced local blocks of the
queries' global positions, the top-k over the same blocks in the same order (the same selection,
ties and ``-1`` sentinels included), the indexer's own ``build_block_mask`` and transformers'
sdpa attention under that mask, as the layer does on one device with ``attn_implementation=
"sdpa"``.

The layer's own forward runs on the shard (Note [Rebound kernels]), through
:func:`~.sparse.whole_sequence_forward`, with three of its inputs replaced:

- ``past_key_values`` (``cache`` from transformers 5.24, Note [Renamed cache parameter]):
  :class:`_WholeSequence`, which takes the cache's place where the forward hands it the shard's
  keys and values (``update``) and where the indexer hands it the shard's index key
  (``layers[layer_idx].update_index``), and gives back the whole sequence's;
- ``attention_mask``: the causal mask of the local queries over all ``S`` keys, a bool
  ``[1, 1, S_local, S]`` tensor (``build_block_mask`` ands it with the selected blocks), in
  place of seqpar's recognised mask, which must be plain causal;
- ``ALL_ATTENTION_FUNCTIONS`` (a global of its modeling module, rebound for this instance only):
  its ``get_interface`` returns :func:`_block_sparse_attention`, which builds the mask from
  ``block_indices`` with the indexer's ``build_block_mask`` and runs transformers' sdpa function.
  On shards the layer's ``_attn_implementation`` is seqpar's name, so the forward itself does not
  fold the selection into the mask: it hands the indices on, and this function folds them.

The model's dense layers (``"full_attention"``, no indexer) are left as they are: they pass
``block_indices=None`` and run through seqpar's attention. With one rank the same path runs on
the sparse layers (every gather is the identity), so seqpar's implementation runs the model on
one device too. Decoding with a cache, packed batches, attention dropout and any mask but the
plain causal one (padding included) are refused on the sparse layers before any collective, from
the call's arguments, which every CP rank passes alike: every rank raises the same error.

Cost per rank and sparse layer (docs/sparse-attention.md): the forward receives ``S - S_local``
tokens of ``2 H_kv head_dim + index_head_dim`` elements (the dense layers' ring attention moves the
``2 H_kv head_dim`` as well) and the backward reduce-scatters the keys' and values' part. Compute:
the index scores and the masked attention scores of the local queries against all ``S`` keys
(the modeling file's dense-masked path, 1/N of one device's).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...sharding import unshard
from ...state import ParallelState
from . import register_adapter
from .compressed import CLASSES as COMPRESSED_CLASSES
from .rebind import cache_parameter, checked_forward, original_kernels, rebind_forward, refuse_adapting
from .sparse import _CLASSES as SPARSE_CLASSES
from .sparse import _PASS_THROUGH_KWARGS, CallRefusal, whole_sequence_forward

__all__ = ["CLASSES", "block_sparse_layers", "sparse_attention_layers"]

CLASSES = ("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLAttention",)
_CACHE = cache_parameter("past_key_values")
_PARAMETERS = ("self", "hidden_states", "position_embeddings", "attention_mask", _CACHE)
# What the forward must read for the replaced inputs to be used as described in the Note.
_READS = ("ALL_ATTENTION_FUNCTIONS", "get_interface", "update", "indexer", "_attn_implementation")
_INDEXER_PARAMETERS = ("self", "hidden_states", "position_embeddings", _CACHE, "position_ids")
_INDEXER_READS = ("layers", "update_index", "block_size", "topk_blocks")
_BLOCK_MASK_PARAMETERS = ("self", "block_indices", "attention_mask", "key_length", "dtype", "device", "position_ids")
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"


class _WholeSequence:
    """Takes the cache's place in one call of a MiniMax-M3 sparse layer on shards (Note [MiniMax-M3
    block-sparse attention on shards]): what the forward and its indexer hand over for the shard's
    tokens comes back for all ``seq_len`` tokens, in global order."""

    def __init__(self, state: ParallelState, seq_len: int, layer_idx: int, name: str) -> None:
        self.state, self.seq_len, self.name = state, seq_len, name
        self.layers = {layer_idx: self}  # the indexer asks its layer's cache for update_index

    def update(self, key: Tensor, value: Tensor, layer_idx: int, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The keys and values ``[B, H_kv, S_local, head_dim]`` of the whole sequence (one
        all-gather; backward reduce-scatters). ``kwargs``: what transformers 5.24 hands a cache
        along (the layer's call kwargs), for a cache to store by; nothing here."""
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise _shape_error(self.name, f"hands its cache keys {tuple(key.shape)} and values {tuple(value.shape)}")
        whole = unshard(torch.cat([key, value], dim=-1), self.state, dim=2, size=self.seq_len)
        return whole.split([key.shape[-1], value.shape[-1]], dim=-1)

    def update_index(self, key: Tensor) -> Tensor:
        """The index keys ``[B, 1, S_local, index_head_dim]`` of the whole sequence."""
        if key.ndim != 4:
            raise _shape_error(self.name, f"hands its cache index keys {tuple(key.shape)}, not [B, 1, S, D]")
        return unshard(key, self.state, dim=2, size=self.seq_len)


class _BlockSparseInterface:
    """Stands in for ``ALL_ATTENTION_FUNCTIONS`` in a sparse layer's rebound forward."""

    def __init__(self, sdpa: Callable) -> None:
        self.sdpa = sdpa

    def get_interface(self, name: str, default: Callable) -> Callable:
        sdpa = self.sdpa

        def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
                      **kwargs: Any) -> tuple[Tensor, Any]:
            return _block_sparse_attention(sdpa, module, query, key, value, attention_mask, **kwargs)

        return attention


def _block_sparse_attention(
    sdpa: Callable, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
    dropout: float = 0.0, scaling: float | None = None, block_indices: Tensor | None = None, **kwargs: Any,
) -> tuple[Tensor, Any]:
    """transformers' sdpa attention of ``query [B, H, S_local, D]`` over ``key, value [B, H_kv, S,
    D]`` under the mask the indexer's ``build_block_mask`` makes of ``block_indices [B, H_idx,
    S_local, topk]`` (global block numbers, ``-1`` unused) and ``attention_mask [1, 1, S_local, S]``
    (causal), as the layer masks it on one device for ``"eager"`` / ``"sdpa"``."""
    name = type(module).__name__
    batch, _, n, _ = query.shape
    if block_indices is None or block_indices.ndim != 4 or (block_indices.shape[0], block_indices.shape[2]) != (batch, n):
        got = None if block_indices is None else tuple(block_indices.shape)
        raise _shape_error(name, f"passes its attention block_indices={got} for {batch} x {n} queries")
    mask = module.indexer.build_block_mask(
        block_indices, attention_mask, key.shape[2], query.dtype, query.device, kwargs.get("position_ids")
    )
    return sdpa(module, query, key, value, mask, dropout=dropout, scaling=scaling)


def _shape_error(name: str, what: str) -> NotImplementedError:
    import transformers

    return NotImplementedError(
        f"seqpar: {name}'s forward {what}; its adapter was written against transformers 5.23 "
        f"(installed: {transformers.__version__}). Run the model with attn_implementation='sdpa' on one "
        "device, or report the version"
    )


_REFUSE = CallRefusal(
    "MiniMax-M3 block-sparse attention",
    "the indexer's keys and the layer's keys and values would have to be cached per rank",
    # The layer's forward reads the queries' positions from its kwargs (the decoder layer passes them).
    honoured=_PASS_THROUGH_KWARGS | {"position_ids"},
    mask_note=": a padding mask would move the key blocks, which the indexer cuts from slot 0",
)


def _install(module: nn.Module, state: ParallelState) -> None:
    cls = type(module)
    original_kernels(module, (), _PARAMETERS)  # the instance's forward is the class's, of the expected shape
    checked_forward(cls, _PARAMETERS, _READS)
    indexer = getattr(module, "indexer", None)
    if indexer is None:  # a "full_attention" layer: plain GQA, through seqpar's attention as it is
        return
    checked_forward(type(indexer), _INDEXER_PARAMETERS, _INDEXER_READS)
    builder = inspect.getattr_static(type(indexer), "build_block_mask", None)
    if not callable(builder) or list(inspect.signature(builder).parameters) != list(_BLOCK_MASK_PARAMETERS):
        raise refuse_adapting(cls, f"its indexer has no build_block_mask{_BLOCK_MASK_PARAMETERS[1:]}")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rebound = rebind_forward(module, {_INTERFACE: _BlockSparseInterface(sdpa_attention_forward)})

    def prepare(self: nn.Module, arguments: dict[str, Any], hidden: Tensor, seq_len: int, positions: Tensor) -> object:
        causal = positions[:, None] >= torch.arange(seq_len, device=hidden.device)[None, :]
        arguments["attention_mask"] = causal[None, None]
        extra = arguments.setdefault("kwargs", {})
        if extra.get("position_ids") is None:  # the forward would number the queries from S - S_local
            extra["position_ids"] = positions[None]
        return _WholeSequence(state, seq_len, self.layer_idx, type(self).__name__)

    whole_sequence_forward(module, state, rebound, _REFUSE, prepare)


for _qualname in CLASSES:
    register_adapter(_qualname, modes=None)(_install)  # a gather, not a mixing mode: any mixing runs it


def block_sparse_layers(model: nn.Module) -> list[str]:
    """The paths of ``model``'s MiniMax-M3 layers with an indexer (the ones this module adapts)."""
    return [
        p for p, m in model.named_modules()
        if f"{type(m).__module__}.{type(m).__qualname__}" in CLASSES and getattr(m, "indexer", None) is not None
    ]


def sparse_attention_layers(model: nn.Module) -> list[str]:
    """The paths of ``model``'s layers whose adapter gathers key-side tensors, which they need on
    one rank too: DeepSeek sparse attention (:mod:`.sparse`), DeepSeek-V4's compressed attention
    (:mod:`.compressed`) and MiniMax-M3's block-sparse layers (this module; all hand their attention
    a mask tensor of their own). Here because this module and :mod:`.compressed` build on
    :mod:`.sparse`."""
    classes = (*SPARSE_CLASSES, *COMPRESSED_CLASSES)
    paths = [p for p, m in model.named_modules() if f"{type(m).__module__}.{type(m).__qualname__}" in classes]
    return paths + block_sparse_layers(model)
