"""Transfer and staging buffers of attention calls: fresh per call, or one kept arena.

Note [Workspace]
~~~~~~~~~~~~~~~~
A collective or ring step needs buffers that live only inside one call: the staging copy of an
all-to-all, the K/V blocks received in a ring step, the gradients travelling back. They never
leave the call that requested them (nothing returned to a caller and nothing saved for backward
views one).

By default (``keep=False``) a :class:`Workspace` keeps nothing: :meth:`Workspace.get` returns a
fresh tensor, which is freed as soon as its last user drops it, so a call holds each buffer only
while it is live and nothing stays allocated between calls (memory the model's other layers, the
loss and the optimizer can use). It is the smaller footprint (``scripts/bench_memory.py``,
``docs/performance.md``); glibc and CUDA's caching allocator both reuse freed blocks of these
sizes. Whether the kept arena below wins time was not resolvable on the shared CPU machine the
figures come from; on an H200 it won none (kept / fresh time 0.998-1.015 at ring 8, Ulysses 8 and
2 x 4, 4k and 32k tokens per rank) and raised the Ulysses and hybrid peaks by 1.31-1.32x
(``scripts/bench_gpu_rank.py --workspace both``, ``docs/performance.md``).

With ``keep=True`` the buffers come from one arena per device, kept for later calls: inside a
:meth:`Workspace.scope` (``seqpar.parallel.hybrid`` opens one around each forward and each
backward) every request takes the next free bytes of the arena, and the arena is reused from its
start by the next scope, so roles that are never live together (forward and backward roles, one
layer's and the next's) share storage and the arena is as large as the largest scope asked for.
Within a scope a role asked for again gets its slice back (one live buffer per role, as the
ring's alternating slots rely on). A request that does not fit gets a fresh tensor and the arena grows to the scope's total when the
scope ends (the next call reuses it). Outside a scope ``get`` always returns a fresh tensor, so
code that calls the ring or the all-to-all directly never sees reused storage.

Calls on one workspace run one at a time (the order autograd and a training loop already impose
on one process; threads running attention concurrently need their own states).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

__all__ = ["Workspace"]

_ALIGN = 256  # bytes: every arena slice starts at a multiple (vectorised kernels, any dtype)


class Workspace:
    """Scratch buffers of the calls on one state: fresh per call, or one kept arena.

    Args:
        keep: keep one arena per device for later calls (Note [Workspace]); ``False``: every
            :meth:`get` is a fresh tensor and nothing is held between calls.

    ``get(role, shape, dtype, device)`` returns a ``shape`` tensor (contents undefined); ``nbytes``
    is the total kept; ``clear()`` frees it.
    """

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._arenas: dict[torch.device, torch.Tensor] = {}  # uint8, kept between scopes
        self._used: dict[torch.device, int] = {}  # bytes handed out in the open scope
        self._slices: dict[tuple[str, torch.device], tuple[int, int]] = {}  # role -> (start, bytes)
        self._depth = 0
        self._closed: str | None = None  # why scopes are refused (:meth:`close`)

    def scope(self) -> AbstractContextManager:
        """One call's forward or backward: arena slices handed out inside are released at its end
        (the outermost scope's), and the arena grows to what the scope asked for if it was short.
        Without ``keep`` a scope changes nothing (every buffer is fresh), so it is a no-op context.

        Raises:
            ValueError: the workspace was closed with its state (:meth:`close`).
        """
        if self._closed is not None:
            raise ValueError(self._closed)
        return self._scope() if self.keep else nullcontext(self)

    @contextmanager
    def _scope(self) -> Iterator[Workspace]:
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                used, self._used, self._slices = self._used, {}, {}
                for device, nbytes in used.items():
                    arena = self._arenas.get(device)
                    if self.keep and (arena is None or arena.numel() < nbytes):
                        self._arenas.pop(device, None)  # free the smaller one first
                        self._arenas[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``shape`` buffer of ``dtype`` for ``role`` (a name for readers and debugging)."""
        if not self.keep or self._depth == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        device = torch.device(device)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        start, size = self._slices.get((role, device), (0, -1))
        if size < nbytes:  # a role asked for again reuses its slice (one live buffer per role)
            start = self._used.get(device, 0)
            size = -(-nbytes // _ALIGN) * _ALIGN
            self._used[device] = start + size
            self._slices[(role, device)] = (start, size)
        end = start + nbytes
        arena = self._arenas.get(device)
        if arena is None or arena.numel() < end:
            return torch.empty(shape, dtype=dtype, device=device)  # the arena grows when the scope ends
        return arena[start:start + nbytes].view(dtype).view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a slice of a kept arena (not a fresh buffer that dies with its users)."""
        arena = self._arenas.get(t.device)
        return arena is not None and t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()

    @property
    def nbytes(self) -> int:
        """Bytes kept between calls (0 with ``keep=False``)."""
        return sum(t.numel() for t in self._arenas.values())

    def clear(self) -> None:
        """Free the kept arena (the next scopes allocate it again)."""
        self._arenas.clear()

    def close(self, reason: str) -> None:
        """Free the arena and refuse every later scope with ``ValueError(reason)``: the state that
        owns this workspace was closed, and every attention forward and backward on it opens a
        scope here before it communicates (Note [Closed states] in ``seqpar.state``)."""
        self.clear()
        self._closed = reason

    def __repr__(self) -> str:
        return f"Workspace(keep={self.keep}, {self.nbytes / 2**20:.1f} MiB kept)"
