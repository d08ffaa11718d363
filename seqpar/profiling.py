"""Moved to seqpar.tools.profiling; this alias is kept for existing imports."""

from .tools.profiling import (
    CollectiveRecorder,
    PeakMemory,
    PhaseTimer,
    StorageTracker,
    iteration_seconds,
    max_over_ranks,
    maxrss_bytes,
    median_seconds,
    sync,
)

__all__ = [
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
