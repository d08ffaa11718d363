"""Attention kernel backends behind one protocol (see ``base.py`` for the contract).

===================  ===============================================  ======================
name                 kernel                                           device / dtypes
===================  ===============================================  ======================
``reference``        plain math, explicit formulas (tests, small)     any / any float
``cpu``              ``aten._scaled_dot_product_flash_attention_*``   CPU / f32 f64 bf16 f16
``torch_flash``      PyTorch's bundled FlashAttention-2               CUDA sm80+ / f16 bf16
``torch_efficient``  PyTorch's CUTLASS memory-efficient kernel        CUDA / f32 f16 bf16
``flash_attn``       the ``flash-attn`` package (FA2; FA3 on Hopper)  CUDA / f16 bf16
===================  ===============================================  ======================

``"auto"`` picks the first backend in this order that can run the device, dtype and mask
features (window, softcap) of the call: CPU -> ``cpu``, ``reference``; CUDA fp16/bf16 ->
``flash_attn`` (if installed), ``torch_flash``, ``torch_efficient``, ``reference``; CUDA fp32 ->
``torch_efficient``, ``reference``; anything else (CUDA fp64, other devices) -> ``reference``.
So softcapped attention runs the ``reference`` math on CPU (the CPU kernel has no softcap) and on
CUDA without ``flash-attn``; an explicitly named backend that cannot run the call is refused.
"""

from __future__ import annotations

import functools

import torch

from .base import AttentionBackend, KernelBackend
from .cpu import CpuFlashBackend
from .flash_attn import FlashAttnBackend
from .reference import ReferenceBackend, reference_attention, reference_varlen_attention
from .torch_cuda import TorchEfficientBackend, TorchFlashBackend

__all__ = [
    "AttentionBackend",
    "KernelBackend",
    "get_backend",
    "available_backends",
    "reference_attention",
    "reference_varlen_attention",
]

# The registry of backend classes, by name.
_BACKENDS: dict[str, type] = {
    cls.name: cls
    for cls in (
        ReferenceBackend,
        CpuFlashBackend,
        TorchFlashBackend,
        TorchEfficientBackend,
        FlashAttnBackend,
    )
}

# "auto" preference order per (device type, dtype class); the first that can run wins.
_AUTO_ORDER: dict[tuple[str, str], tuple[str, ...]] = {
    ("cpu", "any"): ("cpu", "reference"),
    ("cuda", "half"): ("flash_attn", "torch_flash", "torch_efficient", "reference"),
    ("cuda", "any"): ("torch_efficient", "reference"),
}


def _runnable(
    device: torch.device, dtype: torch.dtype, window: bool = False, softcap: bool = False, alibi: bool = False
) -> list[str]:
    return [
        n for n, cls in _BACKENDS.items()
        if cls.unsupported_reason(device, dtype, window=window, softcap=softcap, alibi=alibi) is None
    ]


def available_backends(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> list[str]:
    """Names of the backends that can run here.

    Args:
        device: restrict to backends that run on this device (default: any device of this
            machine, i.e. CPU and, when present, the current CUDA device).
        dtype: restrict to backends supporting this dtype (default: any of fp32/fp16/bf16/fp64).

    Returns:
        Backend names in registry order (``"auto"`` is not listed; it is always accepted).
    """
    devices = [torch.device(device)] if device is not None else [torch.device("cpu")]
    if device is None and torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    dtypes = [dtype] if dtype is not None else [
        torch.float32, torch.float16, torch.bfloat16, torch.float64
    ]
    found = {n for dev in devices for dt in dtypes for n in _runnable(dev, dt)}
    return [n for n in _BACKENDS if n in found]


def _resolve_auto(device: torch.device, dtype: torch.dtype, window: bool, softcap: bool, alibi: bool) -> str:
    kind = "half" if dtype in (torch.float16, torch.bfloat16) else "any"
    order = _AUTO_ORDER.get((device.type, kind)) or _AUTO_ORDER.get((device.type, "any"))
    for name in order or ("reference",):
        if _BACKENDS[name].unsupported_reason(device, dtype, window=window, softcap=softcap, alibi=alibi) is None:
            return name
    return "reference"


def get_backend(
    name: str, device: torch.device | str, dtype: torch.dtype, *, window: bool = False,
    softcap: bool = False, alibi: bool = False,
) -> KernelBackend:
    """The attention backend ``name`` for inputs on ``device`` with ``dtype``.

    Args:
        name: a registered backend name or ``"auto"`` (see the module docstring).
        device: the device of q/k/v.
        dtype: the dtype of q/k/v.
        window: the calls will use sliding windows (beyond plain causal).
        softcap: the calls will use logit softcapping.
        alibi: the calls will add an ALiBi bias (Note [ALiBi blocks] in ``base.py``).

    Returns:
        A stateless backend object implementing :class:`AttentionBackend`.

    Raises:
        ValueError: if ``name`` is unknown, or that backend cannot run on ``device``/``dtype``
            with these features; the message lists the valid choices.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return _get_backend(name, device, dtype, window, softcap, alibi)


@functools.lru_cache(maxsize=128)
def _get_backend(
    name: str, device: torch.device, dtype: torch.dtype, window: bool, softcap: bool, alibi: bool = False
) -> KernelBackend:
    """Cached :func:`get_backend` (backends are stateless)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if name == "auto":
        name = _resolve_auto(device, dtype, window, softcap, alibi)
    cls = _BACKENDS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown attention backend {name!r} (device={device}, dtype={dtype}); "
            f"valid choices: {['auto', *_BACKENDS]}"
        )
    reason = cls.unsupported_reason(device, dtype, window=window, softcap=softcap, alibi=alibi)
    if reason is not None:
        raise ValueError(
            f"attention backend {name!r} cannot run on device={device} with dtype={dtype}: "
            f"{reason}; valid choices here: {['auto', *_runnable(device, dtype, window, softcap, alibi)]}"
        )
    return cls()
