"""Scratch buffers reused across calls: staging copies and transfer buffers that never leave a call.

Note [Workspace]
~~~~~~~~~~~~~~~~
A collective or ring step needs buffers that live only inside one call: the staging copy of an
all-to-all, the K/V blocks received in a ring step, the gradients travelling back. Allocating
them afresh in every call costs page faults on CPU (large blocks go back to the OS when freed)
and caching-allocator churn on CUDA; holding them in a :class:`Workspace` costs their bytes once,
shared by every call (every layer of a model) that runs on the same ``ParallelState``.

Rules that keep this safe: a workspace buffer never escapes the call that requested it (nothing
returned to a caller and nothing saved for backward views it), one role name per live buffer,
and calls on one workspace run one at a time (the order autograd and a training loop already
impose on one process; threads running attention concurrently need their own states).
"""

from __future__ import annotations

import torch

__all__ = ["Workspace"]


class Workspace:
    """Named flat buffers, grown to the largest size asked for and reused afterwards.

    ``get(role, shape, dtype, device)`` returns a ``shape`` view of the buffer of ``role``
    (contents undefined); ``nbytes`` is the total held; ``clear()`` frees everything.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        key = (role, dtype, torch.device(device))
        flat = self._buffers.get(key)
        if flat is None or flat.numel() < numel:
            self._buffers.pop(key, None)  # free the smaller one first
            flat = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by every buffer."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def clear(self) -> None:
        """Free every buffer (the next calls allocate them again)."""
        self._buffers.clear()

    def __repr__(self) -> str:
        return f"Workspace({len(self._buffers)} buffers, {self.nbytes / 2**20:.1f} MiB)"
