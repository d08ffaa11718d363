"""Near-even splits and validated integer inputs: the arithmetic every placement rule uses."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

__all__ = ["split_sizes", "offsets", "is_int", "as_int", "check_seq_lens"]


def is_int(x: object) -> bool:
    """An integer that is not a bool: a Python int, or a numpy or other ``numbers.Integral`` scalar."""
    return type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Integral))


def as_int(value: object, name: str, where: str, *, minimum: int = 0) -> int:
    """``value`` as a Python int (numpy and torch integer scalars accepted).

    Raises:
        ValueError: a bool, a non-integer, or a value below ``minimum``, naming ``name``.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if not is_int(value) or value < minimum:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{where}: {name} must be {kind}, got {value!r}")
    return int(value)


def split_sizes(n: int, parts: int) -> list[int]:
    """Near-even split of ``n`` elements into ``parts`` parts.

    The first ``n % parts`` parts get one extra element:
    ``split_sizes(10, 4) == [3, 3, 2, 2]``, ``split_sizes(3, 4) == [1, 1, 1, 0]``.

    Raises:
        ValueError: if ``n < 0`` or ``parts < 1``.
    """
    n = as_int(n, "n", "split_sizes")
    parts = as_int(parts, "parts", "split_sizes", minimum=1)
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: ``offsets([3, 3, 2]) == [0, 3, 6, 8]`` (length ``len(sizes) + 1``)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def check_seq_lens(seq_lens: Sequence[int] | torch.Tensor, where: str = "seq_lens") -> tuple[int, ...]:
    """Packed sequence lengths as a tuple of non-negative ints (lists, tuples, tensors, numpy).

    Raises:
        ValueError: a negative or non-integer length, naming its index.
    """
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1 or seq_lens.is_floating_point():
            raise ValueError(f"{where}: seq_lens must be a 1-D integer tensor, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
        seq_lens = seq_lens.tolist()
    elif isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence) and not hasattr(seq_lens, "__iter__"):
        raise ValueError(f"{where}: seq_lens must be a sequence of ints, got {type(seq_lens).__name__}")
    out = []
    for i, n in enumerate(seq_lens):
        if not is_int(n) or n < 0:
            raise ValueError(f"{where}: seq_lens[{i}] = {n!r}: every sequence length must be a non-negative int")
        out.append(int(n))
    return tuple(out)
