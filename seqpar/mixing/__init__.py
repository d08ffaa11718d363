"""Token mixers beyond softmax attention, exact on token shards (``docs/hybrid-models.md``).

- :mod:`.headwise`: :func:`head_parallel`, any per-head mixer on whole sequences of some
  heads (Note [Head-parallel mixing]), and :class:`HeadShard`, what a rank mixes;
- :mod:`.conv`: :func:`causal_conv1d`, the short causal convolution of hybrid layers;
- :mod:`.state_passing`: :func:`state_passing`, linear recurrences with fixed-size piece
  summaries exchanged (Note [State passing]), its ready :class:`Recurrence` adapters, the same
  adapters head-parallel (:func:`recurrence_head_parallel`) and :func:`causal_conv1d_halo`.
"""

from .conv import causal_conv1d, causal_conv1d_local
from .headwise import HeadShard, head_parallel
from .state_passing import (
    GatedDeltaRule,
    Recurrence,
    ScalarDecayAttention,
    SelectiveScan,
    Summary,
    causal_conv1d_halo,
    recurrence_head_parallel,
    state_passing,
)

__all__ = [
    "head_parallel", "HeadShard", "causal_conv1d", "causal_conv1d_local",
    "state_passing", "recurrence_head_parallel", "causal_conv1d_halo",
    "Recurrence", "Summary", "GatedDeltaRule", "ScalarDecayAttention", "SelectiveScan",
]
