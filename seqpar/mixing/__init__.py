"""Token mixers beyond softmax attention, exact on token shards (``docs/hybrid-models.md``).

- :mod:`.headwise`: :func:`head_parallel`, any per-head mixer on whole sequences of some
  heads (Note [Head-parallel mixing]), and :class:`HeadShard`, what a rank mixes;
- :mod:`.conv`: :func:`causal_conv1d`, the short causal convolution of hybrid layers.
"""

from .conv import causal_conv1d, causal_conv1d_local
from .headwise import HeadShard, head_parallel

__all__ = ["head_parallel", "HeadShard", "causal_conv1d", "causal_conv1d_local"]
