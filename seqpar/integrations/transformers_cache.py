"""A transformers ``Cache`` backed by seqpar's token-sharded KV cache (``docs/inference.md``).

Note [transformers cache on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' attention modules call ``cache.update(key, value, layer_idx)`` (the argument is
``past_key_values`` before transformers 5.24; Note [transformers cache argument] in
``seqpar.integrations.transformers_shared``) and hand what it returns to the registered attention function. :class:`SeqparCache.update` stores nothing
itself: it tags the returned key with ``(cache, layer_idx, sharded)`` and the attention function
of ``seqpar.integrations.transformers`` runs the layer through ``seqpar.inference.prefill``
(``sharded``: the first forward of a cache made with ``sharded_prefill=True``, with this rank's
shard of the prompt) or ``seqpar.inference.decode`` (every later forward: the same new tokens on
every rank), with the mask it recognised and the layer's softcap and sinks. A layer whose update
is not followed by seqpar attention (a model that computes attention itself) is caught at its next
update.

MLA models with a latent cache (DeepSeek V2/V3 and the other transformers modules with an
``expand_kv``) update the cache with the compressed latents and then derive the keys and values
from what the update returned: ``expand_kv`` up-projects every row on its own (a linear layer and
a broadcast of the rotary part). The update returns the new rows only, so the attention function
receives exactly the new rows' keys and values (all heads, ``Dv != D``), which the sharded cache
keeps as K/V rows. The tag does not survive that derivation, so the attention function finds the
layer by its pending update (:func:`derived_binding`: the same state, the module's
``layer_idx``, the same batch and new-token count). A module that derives keys from the update's
result without such a per-row expansion is not served (on one device the derivation would see
every cached row, here only the new ones): its next update raises. :func:`generate` forgets the
pending updates of its cache when it returns or raises (:meth:`SeqparCache.release`).

Sizes follow transformers' conventions in global tokens: ``get_seq_length`` is the global length
so far, so ``generate`` and the models number new tokens from it; ``get_mask_sizes`` reports
``(length + q_length, 0)``. Beam search's ``reorder_cache`` / ``batch_select_indices`` /
``batch_repeat_interleave`` act on the batch rows of every rank alike; ``crop`` (assisted
decoding) is refused.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..inference import KVCache
from ..inference.cache import LayerCache
from ..state import ParallelState, require_state
from .transformers_shared import cache_argument

__all__ = ["SeqparCache", "cache_binding", "derived_binding"]

_TAG = "_seqpar_cache"
# (state handle, layer_idx) -> the cache whose layer was updated and awaits its attention call
# (weak: a pending entry never keeps a cache alive). One forward runs at a time per state.
_PENDING: dict[tuple[str, int], weakref.ref] = {}


def cache_binding(key: Tensor) -> tuple[SeqparCache, int, bool] | None:
    """``(cache, layer_idx, sharded)`` if ``key`` came from :meth:`SeqparCache.update`, else ``None``."""
    return getattr(key, _TAG, None)


def derived_binding(
    module: torch.nn.Module, key: Tensor, value: Tensor, state: ParallelState,
) -> tuple[SeqparCache, int, bool] | None:
    """``(cache, layer_idx, sharded)`` for an attention call whose untagged ``key`` / ``value``
    ``(batch, nheads, T, headdim)`` an MLA module (one with ``expand_kv``) derived from the pending
    update of its layer (Note [transformers cache on shards]), else ``None``. A module deriving
    keys any other way is not served here: its next update raises, naming why."""
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int) or not callable(getattr(module, "expand_kv", None)):
        return None
    ref = _PENDING.get((state.handle, layer_idx))
    cache = ref() if ref is not None else None
    if cache is None or layer_idx >= len(cache.layers) or cache.layers[layer_idx].pending is None:
        return None
    batch, tokens, binding = cache.layers[layer_idx].pending
    if key.shape[0] != batch or key.shape[2] != tokens or value.shape[2] != tokens:
        return None
    return binding


class _Layer(CacheLayerMixin):
    """One layer of :class:`SeqparCache`: a view of the seqpar :class:`LayerCache`."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SeqparCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.pending: tuple | None = None  # an update whose attention has not run yet

    @property
    def rows(self) -> LayerCache:
        return self.owner.kv.layer(self.index)

    @property
    def sharded(self) -> bool:
        """Whether this layer's next forward is the sharded prefill."""
        return self.owner.sharded_prefill and self.rows.length == 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if self.pending:
            raise NotImplementedError(
                f"seqpar cache: layer {self.index} was updated twice without seqpar attention in between; the "
                "model transformed the cached keys or computed attention without transformers' attention "
                "interface, which a sharded KV cache cannot serve (docs/inference.md)"
            )
        self.is_initialized = True
        binding = (self.owner, self.index, self.sharded)
        # batch and new tokens of the update, which keys derived from its result must have
        self.pending = (key_states.shape[0], key_states.shape[-2], binding)
        _PENDING[(self.owner.state.handle, self.index)] = weakref.ref(self.owner)
        key = key_states.view_as(key_states)  # a fresh tensor object to carry the tag
        setattr(key, _TAG, binding)
        return key, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (query_length, 0) if self.sharded else (self.rows.length + query_length, 0)

    def get_seq_length(self) -> int:
        return self.rows.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("seqpar cache: reset is not supported; make a new SeqparCache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.rows.select_batch(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.rows.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.rows.repeat_batch(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(
                "seqpar cache: crop (assisted or speculative decoding) is not supported on a sharded KV cache"
            )

    def offload(self) -> None:
        raise NotImplementedError("seqpar cache: offloading is not supported (the cache is already sharded)")


class SeqparCache(Cache):
    """transformers ``Cache`` whose rows live in a seqpar :class:`~seqpar.inference.KVCache`
    (Note [transformers cache on shards]).

    Args:
        state: the parallel state (the same one ``register`` bound the model's implementation to).
        num_layers: the model's attention layers (``config.num_hidden_layers``).
        sharded_prefill: the first forward passes this rank's shard of the prompt
            (``seqpar.shard(ids, state)`` with ``shard_positions``); ``False``: every forward passes
            the same tokens on every rank (the prompt then is a chunked prefill).

    Raises:
        ValueError: a bad ``state`` or ``num_layers``.
    """

    def __init__(self, state: ParallelState, num_layers: int, *, sharded_prefill: bool = True) -> None:
        require_state(state, "SeqparCache")
        cache_argument("SeqparCache")  # a release that takes no cache argument seqpar knows is refused here
        self.kv = KVCache(state, num_layers)
        self.sharded_prefill = bool(sharded_prefill)
        super().__init__(layers=[_Layer(self, i) for i in range(num_layers)])

    @property
    def state(self) -> ParallelState:
        return self.kv.state

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"SeqparCache: layer {layer_idx} of a cache made for {len(self.layers)} layers; pass "
                "num_layers=config.num_hidden_layers"
            )
        return self.layers[layer_idx].update(key_states, value_states)

    def release(self) -> None:
        """Forget this cache's updates still awaiting attention (a forward that raised halfway), so
        that no later attention call of the same state takes them for its own."""
        for layer in self.layers:
            if layer.pending is not None and _PENDING.get((self.state.handle, layer.index), lambda: None)() is self:
                del _PENDING[(self.state.handle, layer.index)]
            layer.pending = None

    def served(self, layer_idx: int) -> None:
        """Called by the attention function once layer ``layer_idx`` ran on the cache."""
        self.layers[layer_idx].pending = None
        _PENDING.pop((self.state.handle, layer_idx), None)

    def crop(self, max_length: int) -> None:
        if max_length < 0 or max_length < self.get_seq_length():
            raise NotImplementedError(
                "seqpar cache: crop (assisted or speculative decoding) is not supported on a sharded KV cache"
            )

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds (``KVCache.nbytes``)."""
        return self.kv.nbytes
