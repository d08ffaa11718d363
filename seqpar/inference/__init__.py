"""Long-context inference over CP ranks: a token-sharded KV cache, prefill and decode (``docs/inference.md``).

::

    cache = seqpar.inference.KVCache(state, num_layers)
    out = seqpar.inference.prefill(q, k, v, cache, layer, causal=True)   # the prompt's shards
    out = seqpar.inference.decode(q, k, v, cache, layer, causal=True)    # new tokens, on every rank

Note [Sharded KV cache] (``seqpar.inference.cache``) and Note [Decoding over shards]
(``seqpar.inference.decode``) explain the layout and the exchange.
"""

from .cache import KVCache, LayerCache, keep_from
from .decode import attend_rows, decode, prefill

__all__ = ["KVCache", "LayerCache", "attend_rows", "decode", "keep_from", "prefill"]
