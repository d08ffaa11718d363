"""Ring point-to-point transport: send to the next rank, receive from the previous one.

The ring is the rank order of ``group``: rank ``r`` sends to ``(r + 1) % N`` and receives from
``(r - 1) % N``. Transfers are posted asynchronously (``batch_isend_irecv``) so that a caller can
compute on the current block while the next one is in flight::

    ex = RingExchange(group)
    ex.start(send=[k, v], recv=[k_next, v_next])   # post
    ...compute with k, v...                       # overlap
    ex.wait()                                      # k_next, v_next are now filled
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._group import Group, group_rank, group_size

__all__ = ["RingExchange"]


class RingExchange:
    """Asynchronous neighbour exchange along the ring of ``group``.

    Args:
        group: the ring's process group (``None``: default group, or one process).

    Receive buffers must have the shapes the previous rank sends (sizes may differ per rank,
    e.g. uneven zig-zag chunks); send tensors are made contiguous if needed and kept alive
    until :meth:`wait`.
    """

    def __init__(self, group: Group) -> None:
        self.group = group
        self.size = group_size(group)
        self.rank = group_rank(group)
        self._reqs: list = []
        self._keep: list[torch.Tensor] = []
        if self.size > 1:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.size))
            self.next_rank = ranks[(self.rank + 1) % self.size]  # global ranks, as P2POp wants
            self.prev_rank = ranks[(self.rank - 1) % self.size]

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
        """Post the sends of ``send`` to the next rank and receives into ``recv`` from the previous."""
        assert not self._reqs, "RingExchange.start called twice without wait()"
        if self.size == 1:
            for s, r in zip(send, recv):
                r.copy_(s)
            return
        ops = []
        self._keep = [t.contiguous() for t in send]
        for t in self._keep:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, self.next_rank, group=self.group))
        for t in recv:
            assert t.is_contiguous(), "receive buffers must be contiguous"
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, self.prev_rank, group=self.group))
        if ops:
            self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        """Block until the posted transfers have completed."""
        for req in self._reqs:
            req.wait()
        self._reqs = []
        self._keep = []
