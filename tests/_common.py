"""Shared test constants and helpers: dtypes by name, the float tolerances against float64
references, and the bytes a computation saves for its backward."""

import math

import pytest
import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Max abs error against a float64 reference, relative to the reference's magnitude; half types are
# judged by flash-attn's rule instead (error at most ~2x that of a same-dtype PyTorch computation).
TOL = {"float64": 1e-10, "float32": 1e-4}


def saved_bytes(fn) -> int:
    """Bytes of the storages autograd saves for backward while ``fn()`` runs, each storage once
    (views of one tensor count once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def quick_up_to(ranks: int, worlds) -> list:
    """``worlds`` (world sizes for one argument, or ``(ring, ulysses)`` tuples for two) for
    ``pytest.mark.parametrize``, those over ``ranks`` ranks marked ``slow``: the quick subset runs a
    matrix up to ``ranks`` ranks, the full suite all of it (on 2 cores, 4 and 8 ranks time-share and
    cost the most)."""
    out = []
    for w in worlds:
        values = w if isinstance(w, tuple) else (w,)
        out.append(pytest.param(*values, marks=pytest.mark.slow) if math.prod(values) > ranks else w)
    return out
