"""Autograd-aware collectives: the only part of seqpar that calls ``torch.distributed``.

``group=None`` means the default process group, or a single process when ``torch.distributed`` is
not initialised (every collective is then the identity).
"""

from ..placement.sizes import split_sizes
from .all_to_all import all_to_all, all_to_all_many, fused_all_to_all, fused_all_to_all_backward
from .collectives import all_gather, all_reduce, copy_to, gather, reduce_, reduce_scatter, split
from .group import (
    Group,
    check_dim,
    check_group,
    exchange_ints,
    group_rank,
    group_size,
    group_timeout,
    refuse_double_backward,
)
from .async_collectives import start_all_gather, start_reduce_scatter
from .p2p import Pending, post
from .workspace import Workspace

__all__ = [
    "split_sizes",
    "Group",
    "group_size",
    "group_rank",
    "group_timeout",
    "check_group",
    "check_dim",
    "exchange_ints",
    "refuse_double_backward",
    "all_to_all",
    "all_to_all_many",
    "fused_all_to_all",
    "fused_all_to_all_backward",
    "Workspace",
    "split",
    "gather",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "copy_to",
    "reduce_",
    "post",
    "Pending",
    "start_all_gather",
    "start_reduce_scatter",
]
