"""Measure the tensor memory an operation allocates, on any device (benchmarks and tests).

``StorageTracker`` is a ``TorchDispatchMode``: every ATen op run while it is active is inspected,
and each storage that an op's outputs bring into existence (not a view of, or an in-place/out=
write to, an input) is counted -- ``allocated`` sums them, ``current``/``peak`` follow the ones
still alive (weak references), so ``peak`` is the high-water mark of tensor memory created inside
the block. Kernel scratch that never becomes a tensor is not seen. Collectives that write into
preallocated outputs allocate nothing of their own.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StorageTracker"]


class StorageTracker(TorchDispatchMode):
    """Bytes of tensor storage created while active.

    Attributes:
        allocated: total bytes of every new storage (freed or not).
        current: bytes of new storages still alive.
        peak: the largest ``current`` seen.

    Example::

        with StorageTracker() as mem:
            y = all_to_all(x, group, 2, 1)
        assert mem.allocated <= 2 * x.nbytes
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.allocated = 0
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        inputs = {
            t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in inputs:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.allocated += storage.nbytes()
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out
