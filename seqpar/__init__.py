"""seqpar: exact sequence/context parallelism for attention in PyTorch."""

from . import comm, layout
from .sharding import shard, shard_packed, shard_positions, unshard, unshard_packed
from .state import ParallelState

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
]
