"""seqpar: exact sequence/context parallelism for attention in PyTorch."""

from . import comm, layout, training
from .hybrid import SequenceParallelAttention, attention
from .sdpa import local_sdpa, parallel_sdpa
from .sharding import shard, shard_packed, shard_positions, unshard, unshard_packed
from .state import ParallelState
from .varlen import varlen_attention

__version__ = "0.1.0"

__all__ = [
    "ParallelState",
    "comm",
    "layout",
    "shard",
    "unshard",
    "shard_positions",
    "shard_packed",
    "unshard_packed",
    "attention",
    "varlen_attention",
    "SequenceParallelAttention",
    "parallel_sdpa",
    "local_sdpa",
    "training",
]
