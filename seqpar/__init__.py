"""seqpar: exact sequence/context parallelism for attention in PyTorch."""

from . import comm, mixing, placement, rng, training
from .attention import SequenceParallelAttention, attention, varlen_attention
from .placement.masks import MaskSlices
from .planner import plan  # seqpar.plan(cp_size, ...): the degree planner (seqpar.planner)
from .planner import longest_context  # seqpar.longest_context(ModelShape, ...): seqpar.planner.memory
from .sdpa import local_sdpa, parallel_sdpa
from .sharding import shard, shard_packed, shard_packed_positions, shard_positions, unshard, unshard_packed
from .state import ParallelState
from .verify import verify  # seqpar.verify(model, state, ...): the model self-check (docs/verify.md)

__version__ = "0.2.0"

__all__ = [
    "ParallelState",
    "comm",
    "placement",
    "shard",
    "unshard",
    "shard_positions",
    "shard_packed",
    "unshard_packed",
    "shard_packed_positions",
    "attention",
    "varlen_attention",
    "SequenceParallelAttention",
    "parallel_sdpa",
    "local_sdpa",
    "training",
    "rng",
    "plan",
    "MaskSlices",
    "longest_context",
    "verify",
]
