"""Autograd-aware collectives: the only part of seqpar that calls ``torch.distributed``.

``group=None`` means the default process group, or a single process when ``torch.distributed`` is
not initialised (every collective is then the identity).
"""

from ..layout import split_sizes
from ._group import group_rank, group_size
from .all_to_all import all_to_all, all_to_all_many
from .collectives import all_gather, all_reduce, copy_to, gather, reduce_scatter, split

__all__ = [
    "split_sizes",
    "group_size",
    "group_rank",
    "all_to_all",
    "all_to_all_many",
    "split",
    "gather",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "copy_to",
]
