"""Input checks shared by the public attention entry points (``ValueError`` with the numbers)."""

from __future__ import annotations

import torch

__all__ = ["check_qkv", "check_gqa"]


def check_qkv(q: object, k: object, v: object, *, ndim: int, shape_doc: str, where: str) -> None:
    """Raise unless q, k, v are ``ndim``-dim tensors of one floating dtype on one device.

    Args:
        ndim: the number of dims every input must have.
        shape_doc: the expected layout for the message, e.g. ``"[B, S, H, D] (bshd)"``.
        where: the public function's name, prefixed to the message.

    Raises:
        ValueError: a non-tensor input, a wrong ndim, mixed or non-floating dtypes, mixed devices.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not (q.dim() == k.dim() == v.dim() == ndim):
        raise ValueError(
            f"{where}: q, k, v must be {ndim}-dim {shape_doc}, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(
            f"{where}: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them to one dtype"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_gqa(num_heads: int, num_kv_heads: int, where: str, context: str = "") -> None:
    """Raise unless ``num_heads`` is a positive multiple of ``num_kv_heads`` (GQA/MQA).

    Raises:
        ValueError: naming both counts and the valid ``Hkv`` values.
    """
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"{where}: {context}the H={num_heads} query heads must be a positive multiple of the "
            f"Hkv={num_kv_heads} key/value heads (GQA); use Hkv in {divisors}"
        )
