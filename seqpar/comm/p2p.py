"""Point-to-point transfers between ranks of a group, posted asynchronously.

``post`` starts sends and receives at once (one ``batch_isend_irecv``) and returns a handle whose
``wait`` blocks until all of them completed, so a caller can compute while data is in flight::

    pending = post(group, sends=[(dst, kv_rows)], recvs=[(src, kv_buffer)])
    ...compute on the current block...
    pending.wait()                      # kv_buffer is now filled

Peers are ranks *of the group*. Every send must be matched by a receive of the same shape and
dtype posted by the peer, in the same order per pair of ranks. Send tensors are kept alive until
``wait``; receive buffers must be contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .group import Group

__all__ = ["post", "Pending"]


class Pending:
    """Transfers in flight; :meth:`wait` completes them."""

    def __init__(self, requests: list, keep: list[torch.Tensor]) -> None:
        self._requests = requests
        self._keep = keep

    def wait(self) -> None:
        """Block until every posted send and receive has completed."""
        for request in self._requests:
            request.wait()
        self._requests, self._keep = [], []


def post(
    group: Group,
    sends: Sequence[tuple[int, torch.Tensor]] = (),
    recvs: Sequence[tuple[int, torch.Tensor]] = (),
) -> Pending:
    """Post ``sends`` (``(group rank, tensor)``) and ``recvs`` (``(group rank, buffer)``) at once.

    Empty tensors are skipped (the peer skips its matching empty one too).
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    _check_backend(group, [t for _, t in sends] + [t for _, t in recvs])
    keep = [t.contiguous() for _, t in sends]
    ops = []
    for (peer, _), t in zip(sends, keep):
        if t.numel():
            ops.append(dist.P2POp(dist.isend, t, ranks[peer] if ranks else peer, group=group))
    for peer, t in recvs:
        if not t.is_contiguous():
            raise ValueError(f"post: receive buffers must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, ranks[peer] if ranks else peer, group=group))
    return Pending(dist.batch_isend_irecv(ops) if ops else [], keep)


def _check_backend(group: Group, tensors: Sequence[torch.Tensor]) -> None:
    """``ValueError`` for CUDA tensors on a gloo group: gloo sends host memory only, and a device
    pointer handed to it fails inside gloo ("writev ... Bad address") on one rank while its peer sees
    the connection close. Every rank of a ring posts the same device type, so all raise here."""
    cuda = next((t for t in tensors if t.is_cuda), None)
    if cuda is None or dist.get_backend(group) != "gloo":
        return
    raise ValueError(
        f"seqpar ring: the process group's backend is gloo, which cannot send CUDA tensors point to point "
        f"(got {tuple(cuda.shape)} on {cuda.device}); initialise the group with NCCL for CUDA tensors "
        '(init_process_group("nccl")), or keep the tensors on the CPU'
    )
