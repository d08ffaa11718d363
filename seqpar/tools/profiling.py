"""Measure the time and the memory of an operation, on any device (benchmarks and tests).

Time: ``PhaseTimer``, ``iteration_seconds``, ``max_over_ranks``, ``median_seconds`` and ``sync``
live in :mod:`seqpar.planner.timing` (the planner's calibration measures with them) and are
re-exported here; every timing in ``seqpar.tools`` and ``scripts/`` goes through these.

Memory: ``StorageTracker`` is a ``TorchDispatchMode``: every ATen op run while it is active is
inspected, and each storage that an op's outputs bring into existence (not a view of, or an
in-place/out= write to, an input) is counted -- ``allocated`` sums them, ``current``/``peak``
follow the ones still alive (weak references), so ``peak`` is the high-water mark of tensor
memory created inside the block. Kernel scratch that never becomes a tensor is not seen, and the
mode changes what it measures a little: every tensor gets a Python object, under which autograd
sums the gradients of a tensor used several times out of place (one extra temporary per use).
Collectives that write into preallocated outputs allocate nothing of their own.
``AllocatorTracker`` reads the CPU allocator's own blocks from ``torch.profiler``'s memory events
instead: scratch included, nothing changed. ``PeakMemory`` picks a peak measure per device (the
CUDA allocator's, ``StorageTracker``'s, ``AllocatorTracker``'s or the resident set's) and is how
``seqpar.tools`` and ``scripts/`` read a peak; ``maxrss_bytes`` is the process's resident
high-water mark since it started.

Communication: ``CollectiveRecorder`` counts the ``torch.distributed`` collectives called while it
is active, and the bytes handed to them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..planner.timing import PhaseTimer, iteration_seconds, max_over_ranks, median_seconds, sync

__all__ = [
    "AllocatorTracker",
    "CollectiveRecorder",
    "PeakMemory",
    "PhaseTimer",
    "StorageTracker",
    "iteration_seconds",
    "max_over_ranks",
    "maxrss_bytes",
    "median_seconds",
    "sync",
]


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
        for key, (ref, nbytes) in list(self.live.items()):
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:  # freed
                self.current -= self.live.pop(key)[1]
            elif storage.nbytes() != nbytes:  # resized in place (a buffer released early, say)
                self.current += storage.nbytes() - nbytes
                self.live[key] = (ref, storage.nbytes())

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


class AllocatorTracker:
    """Bytes the CPU allocator hands out while active, read from ``torch.profiler``'s memory events.

    Every block PyTorch's CPU allocator (``c10``) allocates or frees while the profiler runs with
    ``profile_memory=True`` is an event; their running sum is the bytes allocated inside the block
    and still alive. Unlike :class:`StorageTracker` this sees a kernel's internal scratch too, and
    it adds nothing to the tensors it measures: a ``TorchDispatchMode`` gives every tensor a Python
    object, which (measured) makes autograd sum a weight's gradients from several uses out of
    place, a weight-sized temporary per use, where without the mode it adds in place. Frees of
    blocks allocated before the block are not reported (torch warns once), so the figures are of
    what the block allocated, as :class:`StorageTracker`'s.

    Only frees on threads the profiler follows (this one and its intra-op workers) are seen. A
    block whose last reference dies on another thread -- gloo's work threads, after an async
    collective -- stays counted as alive (measured: 2 gloo ranks, five all-to-alls and
    all-reduces of 1 MiB each, 4-8 MiB "alive" at exit and a peak 1.5-2x the true one). Use it
    where the process's own threads free what it allocates: one device, or one rank over the
    fake process group (``seqpar.tools.longest``), not under a real ``gloo`` group.

    Raises:
        ValueError: on entry, when the default process group is ``gloo`` (its frees would be lost).

    Attributes:
        allocated: total bytes of every allocation (freed or not).
        current: bytes allocated inside the block and alive at its exit.
        peak: the largest running total seen.

    Example::

        with AllocatorTracker() as mem:
            loss.backward()
        print(mem.peak)
    """

    def __init__(self) -> None:
        self.allocated = 0
        self.current = 0
        self.peak = 0
        self._profiler = None

    def __enter__(self) -> AllocatorTracker:
        from torch.profiler import ProfilerActivity, profile

        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            raise ValueError("AllocatorTracker: the default process group is gloo, whose work threads free "
                             "collective buffers where the profiler does not see it, so the peak would read "
                             "high; use StorageTracker (PeakMemory(device)) under gloo, or the fake process group")
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        prof, self._profiler = self._profiler, None
        prof.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return
        cpu = torch.autograd.DeviceType.CPU
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
        current = peak = allocated = 0
        for e in sorted(events, key=lambda e: e.start_ns()):  # stable: same-time events keep their order
            n = e.nbytes()
            allocated += max(n, 0)
            current += n
            peak = max(peak, current)
        self.allocated, self.current, self.peak = allocated, current, peak


def maxrss_bytes() -> int:
    """The resident-set high-water mark of this process since it started (``ru_maxrss``), in
    bytes (Unix)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _release_free_memory() -> None:
    """Make the resident set follow live allocations: map large blocks, return free pages to the OS.

    glibc raises its mmap threshold after the first large free and then keeps freed blocks
    resident for reuse, so the resident high-water mark would miss most allocations. We fix the
    threshold at 64 KiB (blocks above it are unmapped on free) and ``malloc_trim(0)`` the free
    pages already held, so every page a tensor touches after this counts (page granularity).

    Raises:
        OSError: without glibc (no libc found, or ``mallopt`` refused).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        raise OSError("libc not found")
    libc = ctypes.CDLL(name)
    m_mmap_threshold = -3
    if libc.mallopt(m_mmap_threshold, 64 * 1024) != 1:
        raise OSError("mallopt(M_MMAP_THRESHOLD) failed")
    libc.malloc_trim(0)


def _proc_status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(field)


class PeakMemory:
    """Peak bytes of memory allocated inside a ``with`` block, above the level at its start.

    What is measured depends on the device:

    * CUDA: the caching allocator's high-water mark (``torch.cuda.max_memory_allocated``), the
      device synchronised at both ends -- every tensor and workspace allocated through PyTorch.
    * CPU, by default: :class:`StorageTracker`'s ``peak`` -- storages created by ATen ops while
      they are alive; not a kernel's internal scratch.
    * CPU, ``allocator=True``: :class:`AllocatorTracker`'s ``peak`` -- every block of the CPU
      allocator, kernel scratch included, read from ``torch.profiler``'s memory events; unlike a
      dispatch mode it does not change how autograd sums gradients (long-context measurements).
    * CPU, ``resident=True`` (Linux, glibc): the resident-set high-water mark (``VmHWM``, reset
      through ``/proc/self/clear_refs``) minus the resident set at the start -- all memory the
      process touches (tensors, kernel scratch, other threads), at page granularity, after
      :func:`_release_free_memory`. ``peak`` is ``None`` where this cannot be measured.

    Attributes:
        peak: the bytes, set when the block exits normally (``None`` until then, or if unknown).
        start_bytes: CUDA: the bytes allocated when the block started (``peak`` is above them);
            ``None`` on the CPU.

    Example::

        with PeakMemory(device) as mem:
            step()
        print(mem.peak)
    """

    def __init__(self, device: torch.device, *, resident: bool = False, allocator: bool = False) -> None:
        if resident and allocator:
            raise ValueError("PeakMemory: resident=True and allocator=True are two measures; pick one")
        self.device, self.resident, self.allocator = torch.device(device), resident, allocator
        self.peak: int | None = None
        self.start_bytes: int | None = None
        self._base: int | None = None
        self._end: int | None = None
        self._tracker: StorageTracker | AllocatorTracker | None = None

    def held(self) -> int | None:
        """Bytes of what the block allocated that are still held: on CUDA those allocated at its
        exit above its start; on the CPU (``resident=False``) the storages it created that are
        alive now (``allocator=True``: alive at its exit). ``peak - held()`` is the block's
        transient memory. ``None`` for the resident set."""
        if self._tracker is not None:
            if isinstance(self._tracker, StorageTracker):
                self._tracker._sweep()  # drop the storages freed since its last op
            return self._tracker.current
        if self.device.type == "cuda" and self._end is not None and self._base is not None:
            return self._end - self._base
        return None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = self.start_bytes = torch.cuda.memory_allocated(self.device)
        elif self.resident:
            try:
                _release_free_memory()
                # Linux: writing 5 to clear_refs resets the resident-set high-water mark (VmHWM).
                Path("/proc/self/clear_refs").write_text("5")
                self._base = _proc_status("VmRSS")
            except OSError:
                self._base = None
        else:
            self._tracker = (AllocatorTracker() if self.allocator else StorageTracker()).__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return
        if self._tracker is not None:
            self.peak = self._tracker.peak
        elif self._base is None:
            self.peak = None
        elif self.device.type == "cuda":
            sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self._end = torch.cuda.memory_allocated(self.device)
        else:
            self.peak = _proc_status("VmHWM") - self._base


class CollectiveRecorder:
    """Counts the ``torch.distributed`` collectives called while active, and the bytes sent.

    The functions seqpar's ``comm`` package calls (``NAMES``) are replaced on the
    ``torch.distributed`` module for the block (seqpar looks them up at call time) and restored
    at exit. ``counts[name]``: calls of each function; ``bytes[name]``: bytes of the tensors it
    was handed to send (a flat collective's input, the first tensor otherwise; for
    ``batch_isend_irecv`` the sends only, whose number is ``counts["p2p_send_ops"]``).
    """

    NAMES = ("all_to_all_single", "batch_isend_irecv", "all_gather_single", "all_gather_into_tensor",
             "all_gather", "all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "barrier")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._saved: dict[str, Callable] = {}

    def _add(self, name: str, nbytes: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        self.bytes[name] = self.bytes.get(name, 0) + nbytes

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                sends = [op.tensor for op in ops if op.op is dist.isend]
                self._add(name, sum(t.numel() * t.element_size() for t in sends))
                self.counts["p2p_send_ops"] = self.counts.get("p2p_send_ops", 0) + len(sends)
            else:
                # The tensor sent: the input of the flat forms (second positional), else the first.
                t = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else (
                    args[0] if args and isinstance(args[0], torch.Tensor) else None)
                self._add(name, 0 if t is None else t.numel() * t.element_size())
            return fn(*args, **kwargs)

        return wrapped

    def __enter__(self) -> CollectiveRecorder:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}

    @property
    def gathers(self) -> int:
        """All-gather calls of any form."""
        return sum(self.counts.get(n, 0) for n in ("all_gather_single", "all_gather_into_tensor", "all_gather"))
