"""DeepSeek-V4's compressed attention, exact on sequence shards.

Note [DeepSeek-V4 compressed attention on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A DeepSeek-V4 attention layer (transformers 5.23: ``DeepseekV4Attention``) is multi-query
attention with one shared key = value head ``kv [B, 1, S, D]``, per-head sinks and a sliding
window; its ``config.layer_types`` entry adds long-range keys:

- ``"sliding_attention"``: nothing more;
- ``"heavily_compressed_attention"`` (HCA, ``DeepseekV4HCACompressor``): every complete window of
  ``m'`` tokens (global positions ``[w m', (w + 1) m')``) becomes one entry, a softmax-gated sum
  of the window's ``kv_proj`` rows (gates ``gate_proj + position_bias``), normalised and RoPE'd
  at position ``w m'``; query ``p`` sees entry ``w`` if ``w < (p + 1) // m'``;
- ``"compressed_sparse_attention"`` (CSA, ``DeepseekV4CSACompressor``): windows of ``m`` tokens,
  entry ``w`` gated over window ``w``'s second half-channels and window ``w - 1``'s first (window
  0's first half: weight 0), and a lightning indexer (``DeepseekV4Indexer``) with its own such
  compressor at ``index_head_dim`` that scores each query (from its ``q_residual`` and hidden
  state) against the compressed index keys and keeps the top ``index_topk`` causal entries.

The layer appends the entries to its keys and the compressor's ``block_bias`` (causality and the
selection, ``-inf`` elsewhere) to its tensor mask, and runs the modeling file's eager attention
with sinks (transformers ships V4 eager-only). Without a cache the compressor takes the complete
windows of the call's tokens from position 0 and drops the remainder.

On shards the layer's own forward runs on the shard (Note [Rebound kernels]) with three inputs
replaced, so that every step sees what it sees on one device:

- ``past_key_values`` (``cache`` from transformers 5.24, Note [Renamed cache parameter]):
  :class:`_WholeSequence`. The forward hands it the shard's ``kv`` (``update``) and gets the whole
  sequence's; the compressors ask its ``layers[layer_idx]`` for the windows to compress
  (``store_compression_weights``) and get the whole sequence's ``kv_proj`` / ``gate_proj`` rows
  cut to complete windows from global position 0 (first window at 0), as the stateless path
  cuts them; ``update_overlap_state`` answers "no previous call" (window 0's first half keeps
  weight 0, as without a cache) and ``update_compressor_states`` hands the entries back. Each is
  one all-gather into global order (``seqpar.unshard``; its backward reduce-scatters the gradient
  to the rank that owns each token). So the entries are the one-device entries, in full, on
  every rank; the indexer scores the local queries (their ``q_residual``, hidden states and global
  ``position_ids``) against all of them, masks, and takes the top-k over the same entries in the
  same order; the block bias follows the local queries' global positions.
- ``attention_mask``: the sliding-window causal mask of the local queries' global positions over
  all ``S`` raw keys, as the eager one-device mask writes it (``0`` / the dtype's minimum,
  ``[B, 1, S_local, S]``), in place of seqpar's recognised mask; the layer appends its block bias.
  HCA builds no block bias for a call of one query (one token on this rank): then the mask handed
  in already covers the entries, by the compressor's rule, and the layer appends nothing.
- ``ALL_ATTENTION_FUNCTIONS`` (rebound for this instance only): its ``get_interface`` returns the
  modeling file's ``eager_attention_forward``, sinks included.

Sliding-only layers need none of this: they run as they are, through seqpar's attention
(window and sinks on shards). Decoding with a cache, packed batches, attention dropout and any mask
but the model's sliding-window causal one are refused on every layer, before any collective, from
the call's arguments, which every CP rank passes alike: every rank raises the same error. With one
rank the same path runs (every gather is the identity).

Cost per rank and layer (docs/sparse-attention.md): the forward receives ``S - S_local`` tokens of
``D`` (``kv``) plus the compressor's ``kv_proj`` and ``gate_proj`` rows (``2 D`` for HCA, ``4 D``
for CSA) plus the indexer's (``4 index_head_dim``, CSA); the backward reduce-scatters all but the
indexer's (the top-k passes no gradient). Compute: every rank compresses all ``S`` tokens (as one
device does) and scores its queries against all ``S`` raw keys and all entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...sharding import unshard
from ...state import ParallelState
from . import register_adapter
from .rebind import cache_parameter, checked_forward, original_kernels, rebind_forward, refuse_adapting
from .sparse import CallRefusal, whole_sequence_forward

__all__ = ["CLASSES"]

CLASSES = ("transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Attention",)
_CACHE = cache_parameter("past_key_values")
_PARAMETERS = ("self", "hidden_states", "position_embeddings", "position_ids", "attention_mask", _CACHE)
# What the forward must read for the replaced inputs to be used as described in the Note.
_READS = ("ALL_ATTENTION_FUNCTIONS", "get_interface", "update", "compressor", "layer_idx")
_COMPRESSOR_PARAMETERS = ("self", "hidden_states", "q_residual", "position_ids", _CACHE, "layer_idx")
_COMPRESSOR_READS = ("layers", "store_compression_weights", "update_compressor_states")
_EAGER = "eager_attention_forward"
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
_HCA = "heavily_compressed_attention"


class _WholeSequence:
    """Takes the cache's place in one call of a DeepSeek-V4 compressed layer on shards (Note
    [DeepSeek-V4 compressed attention on shards]): what the forward and its compressors hand
    over for the shard's tokens comes back for all ``seq_len`` tokens, in global order."""

    def __init__(self, state: ParallelState, seq_len: int, layer_idx: int, rates: dict[str, int], name: str) -> None:
        self.state, self.seq_len, self.name = state, seq_len, name
        self.layers = {layer_idx: _WholeWindows(self, rates)}

    def gather(self, x: Tensor, dim: int) -> Tensor:
        return unshard(x, self.state, dim=dim, size=self.seq_len)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The shared key = value head ``[B, 1, S_local, D]`` of the whole sequence (one all-gather).
        ``kwargs``: what transformers 5.24 hands a cache along; nothing here."""
        if key.ndim != 4:
            raise _shape_error(self.name, f"hands its cache keys {tuple(key.shape)}, not [B, 1, S, D]")
        whole = self.gather(key, 2)
        return whole, (whole if value is key else self.gather(value, 2))


class _WholeWindows:
    """Takes the cache layer's place for a compressor (``"compressor"``) and its indexer (``"indexer"``)."""

    def __init__(self, cache: _WholeSequence, rates: dict[str, int]) -> None:
        self.cache, self.rates = cache, rates

    def store_compression_weights(self, name: str, kv: Tensor, gate: Tensor) -> tuple[Tensor, Tensor, int]:
        """The whole sequence's ``kv`` and ``gate`` rows ``[B, S_local, C]`` cut to complete windows
        of global positions (``[B, (S // m) * m, C]``), and the first window's position, 0."""
        if kv.ndim != 3 or gate.shape[:2] != kv.shape[:2] or name not in self.rates:
            raise _shape_error(
                self.cache.name, f"hands its cache {name!r} windows {tuple(kv.shape)} and {tuple(gate.shape)}"
            )
        whole = self.cache.gather(torch.cat([kv, gate], dim=-1), 1)  # one all-gather for both
        usable = (self.cache.seq_len // self.rates[name]) * self.rates[name]
        kv, gate = whole[:, :usable].split([kv.shape[-1], gate.shape[-1]], dim=-1)
        return kv, gate, 0

    def update_overlap_state(self, name: str, chunk_kv: Tensor, chunk_gate: Tensor, head_dim: int) -> tuple[None, None]:
        """No previous call: window 0's first half keeps softmax weight 0, as without a cache."""
        return None, None

    def update_compressor_states(self, name: str, compressed: Tensor) -> Tensor:
        """All entries are this call's."""
        return compressed


def _shape_error(name: str, what: str) -> NotImplementedError:
    import transformers

    return NotImplementedError(
        f"seqpar: {name}'s forward {what}; its adapter was written against transformers 5.23 and 5.24 "
        f"(installed: {transformers.__version__}). Run the model with attn_implementation='eager' on one "
        "device, or report the version"
    )


class _EagerInterface:
    """Stands in for ``ALL_ATTENTION_FUNCTIONS`` in a compressed layer's rebound forward."""

    def __init__(self, eager: Callable) -> None:
        self.eager = eager

    def get_interface(self, name: str, default: Callable) -> Callable:
        return self.eager


_REFUSE = CallRefusal(
    "DeepSeek-V4 compressed attention", "the compressors' windows and entries would have to be cached per rank",
    decode="on one device with attn_implementation='eager'", window=lambda module: module.sliding_window,
)


def _layer_mask(module: nn.Module, positions: Tensor, seq_len: int, batch: int, dtype: torch.dtype) -> Tensor:
    """The additive mask ``[B, 1, S_local, S (+ entries)]`` of the local queries at global
    ``positions`` over all raw keys, ``0`` where seen, the dtype's minimum elsewhere (as the eager
    one-device mask). For an HCA layer called with one query, the entries' columns by the
    compressor's rule too (it builds no block bias then: Note [DeepSeek-V4 compressed attention
    on shards])."""
    keys = torch.arange(seq_len, device=positions.device)
    seen = _REFUSE.expected(module, seq_len).allows(positions, keys)  # the sliding window the call was checked for
    if module.layer_type == _HCA and positions.numel() == 1:
        rate = module.compressor.compress_rate
        entries = torch.arange(seq_len // rate, device=positions.device)
        seen = torch.cat([seen, entries[None, :] < (positions[:, None] + 1) // rate], dim=-1)
    low = torch.finfo(dtype).min
    mask = torch.zeros(seen.shape, dtype=dtype, device=positions.device).masked_fill(~seen, low)
    return mask.expand(batch, 1, *seen.shape)  # a batch dim: the layer concatenates its [B, 1, ...] block bias


def _check_compressor(module: nn.Module) -> dict[str, int]:
    """The compression rate per name the compressor (and its indexer) hand the cache, after
    checking that their forwards read the cache as the Note describes."""
    compressor = module.compressor
    indexer = getattr(compressor, "indexer", None)  # CSA's; HCA has none and no overlapping windows
    reads = _COMPRESSOR_READS if indexer is None else (*_COMPRESSOR_READS, "update_overlap_state")
    rates = {"compressor": int(compressor.compress_rate)}
    for part, key in ((compressor, "compressor"), (indexer, "indexer")):
        if part is not None:
            checked_forward(type(part), _COMPRESSOR_PARAMETERS, reads)
            rates[key] = int(part.compress_rate)
    return rates


def _install(module: nn.Module, state: ParallelState) -> None:
    cls = type(module)
    eager = original_kernels(module, (_EAGER,), _PARAMETERS)[_EAGER]
    checked_forward(cls, _PARAMETERS, _READS)
    if not isinstance(getattr(module, "sliding_window", None), int) or not isinstance(
        getattr(module, "layer_type", None), str
    ):
        raise refuse_adapting(cls, "it has no int sliding_window or str layer_type")
    rates = _check_compressor(module) if getattr(module, "compressor", None) is not None else {}
    rebound = rebind_forward(module, {_INTERFACE: _EagerInterface(eager)})

    def prepare(self: nn.Module, arguments: dict[str, Any], hidden: Tensor, seq_len: int, positions: Tensor) -> object:
        arguments["attention_mask"] = _layer_mask(self, positions, seq_len, hidden.shape[0], hidden.dtype)
        return _WholeSequence(state, seq_len, self.layer_idx, rates, type(self).__name__)

    # sliding-only layers: seqpar's attention runs them (window, sinks) after the same refusals
    whole_sequence_forward(module, state, rebound, _REFUSE, None if module.compressor is None else prepare)


for _qualname in CLASSES:
    register_adapter(_qualname, modes=None)(_install)  # a gather, not a mixing mode: any mixing runs it
