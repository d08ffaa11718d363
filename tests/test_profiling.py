"""The CPU memory measures of seqpar.tools.profiling: what each sees, and what each changes."""

import pytest
import torch
import torch.nn.functional as F

from seqpar.tools.profiling import AllocatorTracker, PeakMemory, StorageTracker

MiB = 2**20


def test_allocator_tracker_follows_allocations_and_frees():
    with AllocatorTracker() as mem:
        a = torch.empty(MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(4096, dtype=torch.uint8)
    assert mem.peak == 3 * MiB
    assert mem.current == 2 * MiB + 4096
    assert mem.allocated == 3 * MiB + 4096
    del b, c


def test_allocator_tracker_does_not_change_how_autograd_sums_gradients():
    """A weight used four times: autograd sums its gradients in place (two weight-sized tensors
    at once) unless a dispatch mode is active, under which every sum is out of place (three)."""
    torch.manual_seed(0)
    w = torch.randn(1024, 1024, requires_grad=True)
    xs = [torch.randn(4, 1024) for _ in range(4)]
    peaks = {}
    for tracker in (StorageTracker, AllocatorTracker):
        w.grad = None
        with tracker() as mem:
            sum((x @ w).sum() for x in xs).backward()
        peaks[tracker.__name__] = mem.peak
    assert 2 * w.nbytes <= peaks["AllocatorTracker"] < 2 * w.nbytes + 64 * 1024, peaks
    assert peaks["StorageTracker"] >= 3 * w.nbytes, peaks


def test_allocator_tracker_sees_kernel_scratch():
    """The CPU flash kernel's internal buffers never become tensors: only the allocator sees them."""
    q, k, v = (torch.randn(1, 8, 2048, 64) for _ in range(3))
    peaks = {}
    for tracker in (StorageTracker, AllocatorTracker):
        with tracker() as mem:
            out = F.scaled_dot_product_attention(q, k, v)
        peaks[tracker.__name__] = mem.peak
    assert peaks["StorageTracker"] >= out.nbytes
    assert peaks["AllocatorTracker"] > peaks["StorageTracker"], peaks


def test_peak_memory_allocator_option():
    with PeakMemory(torch.device("cpu"), allocator=True) as mem:
        x = torch.empty(MiB, dtype=torch.uint8)
    assert mem.peak == MiB and mem.held() == MiB
    del x
    with pytest.raises(ValueError, match="pick one"):
        PeakMemory(torch.device("cpu"), allocator=True, resident=True)


def _allocator_tracker_under_gloo() -> str:
    try:
        with AllocatorTracker():
            pass
    except ValueError as e:
        return str(e)
    return ""


def test_allocator_tracker_refuses_gloo(pools):
    """gloo's work threads drop the last reference to a collective's buffers, and those frees are
    not reported: measured, 2 ranks, five 1 MiB all-to-alls and all-reduces read 4-8 MiB alive at
    exit and a peak 1.5-2x the true one. So it refuses rather than read high."""
    for message in pools(2).run(_allocator_tracker_under_gloo):
        assert "gloo" in message and "StorageTracker" in message
