"""The ``"flash_attn"`` backend: the optional ``flash-attn`` package (FA2) or FA3 on Hopper.

This is the only module that knows those packages' signatures, and it imports them lazily, on the
first call, never at import time. It uses the low-level ``_flash_attn_forward`` /
``_flash_attn_backward`` functions (dense and varlen) because only they let the backward take an
external ``out``/``lse``.

Their signatures changed across releases; the differences handled here, by parameter *name*:

- FA2 < 2.3: no window; 2.3-2.6.1: ``window_size=(left, right)``; >= 2.6.2:
  ``window_size_left``/``window_size_right``. ``softcap`` from 2.6, ``alibi_slopes`` from 2.4.
- FA2 forward returns 8 values before 2.6.2 (lse at index 5) and 4 from then on (lse at index 1).
- FA2 varlen lse is ``[nseq, H, max_seqlen_q]`` before 2.6 and packed ``[H, total_q]`` from 2.6.
- FA3 (``flash_attn_interface``) has one ``_flash_attn_forward``/``_flash_attn_backward`` for
  dense and varlen (``cu_seqlens_*`` None for dense), many optional tensor arguments (passed as
  None), ``window_size`` or ``window_size_left/right`` depending on the commit, returns
  ``(out, lse, ...)`` and a packed varlen lse. FA3 is used on compute capability 9.x only.

A parameter without a default that is not known here makes the package count as unavailable
(``available_backends()`` then omits ``"flash_attn"``) rather than being guessed.

Rows with no keys come back with ``lse = +inf`` (reported as ``-inf``, passed back as ``+inf``).
A value head dim ``Dv != D`` (MLA): FA2 needs one head dim for q, k and v, so all three are
zero-padded to ``max(D, Dv)`` rounded up to 8 and the results sliced back, exact (Note [Value
head dim] in ``base.py``); ``max(D, Dv) <= 256``. FA3 gets the same padding whatever ``(D, Dv)``
pairs a release supports natively (untested here: no GPU where this was written).
This module could not be run where it was written (no GPU); ``tests/test_backends.py`` checks it
against the float64 reference when CUDA and the package are present.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .base import (
    KernelBackend,
    Packing,
    Window,
    lse_for_backward,
    normalise_lse_,
    packed_lse_from_padded,
    pad_head_dim,
    padded_head_dim,
    padded_lse_from_packed,
    unpad_head_dim,
)

__all__ = ["FlashAttnBackend"]

_MAX_HEAD_DIM = 256
# FA3 optional tensor arguments that seqpar never uses; passed as None.
_FA3_UNUSED = frozenset({
    "k_new", "v_new", "qv", "out", "cu_seqlens_k_new", "seqused_q", "seqused_k", "sequed_q",
    "sequed_k", "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin",
    "seqlens_rotary", "q_descale", "k_descale", "v_descale", "scheduler_metadata",
})


@dataclass(frozen=True)
class _Api:
    """The functions of one installed flash-attn flavour and what they accept."""

    kind: Literal["fa2", "fa3"]
    version: str
    functions: dict[str, Callable[..., Any]]
    params: dict[str, frozenset[str]]
    packed_varlen_lse: bool

    def call(self, fn: str, **kwargs: Any) -> Any:
        """Call ``fn`` with the subset of ``kwargs`` it accepts (see the module docstring)."""
        names = self.params[fn]
        window = kwargs.pop("window", (-1, -1))
        if "window_size" in names:
            kwargs["window_size"] = window
        else:
            kwargs["window_size_left"], kwargs["window_size_right"] = window
        if self.kind == "fa3":
            kwargs.update({name: None for name in _FA3_UNUSED & names if name not in kwargs})
        return self.functions[fn](**{key: val for key, val in kwargs.items() if key in names})


def _signature_names(fn: Callable[..., Any]) -> tuple[frozenset[str], frozenset[str]]:
    """(all parameter names, names without a default) of ``fn`` (unwrapping torch custom ops)."""
    target = getattr(fn, "_init_fn", fn)
    params = list(inspect.signature(target).parameters.values())
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = {p.name for p in params if p.default is inspect.Parameter.empty}
    if any(p.kind in variadic for p in params):
        required.add("*")  # an opaque signature: never matches the known names
    return frozenset(p.name for p in params), frozenset(required)


# Arguments this module supplies to each function (beyond the FA3 unused ones).
_KNOWN = {
    "fwd": {"q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size",
            "window_size_left", "window_size_right", "softcap", "alibi_slopes",
            "return_softmax", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"},
    "bwd": {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
            "softmax_scale", "causal", "window_size", "window_size_left", "window_size_right",
            "softcap", "alibi_slopes", "deterministic", "rng_state", "cu_seqlens_q",
            "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"},
}


def _make_api(kind: Literal["fa2", "fa3"], module: Any, version: str, names: dict[str, str],
              packed_varlen_lse: bool) -> _Api | None:
    functions, params = {}, {}
    for role, attr in names.items():
        fn = getattr(module, attr, None)
        if fn is None:
            return None
        all_names, required = _signature_names(fn)
        known = _KNOWN["bwd" if "bwd" in role else "fwd"]
        if kind == "fa3":
            known = known | _FA3_UNUSED
        if not required <= known:
            return None  # a required argument this module does not know: do not guess
        functions[role], params[role] = fn, all_names
    return _Api(kind, version, functions, params, packed_varlen_lse)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def _load(prefer_fa3: bool) -> _Api | None:
    """The usable flash-attn API, imported on first use; None if neither is installed/usable."""
    if prefer_fa3:
        try:
            fa3 = importlib.import_module("flash_attn_interface")
        except ImportError:
            fa3 = None
        if fa3 is not None:
            api = _make_api(
                "fa3", fa3, str(getattr(fa3, "__version__", "3")),
                {"fwd": "_flash_attn_forward", "bwd": "_flash_attn_backward"},
                packed_varlen_lse=True,
            )
            if api is not None:
                return api
    try:
        package = importlib.import_module("flash_attn")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError:
        return None
    version = str(getattr(package, "__version__", "0"))
    if _version_tuple(version) < (2, 0):
        return None
    return _make_api(
        "fa2", interface, version,
        {"fwd": "_flash_attn_forward", "bwd": "_flash_attn_backward",
         "varlen_fwd": "_flash_attn_varlen_forward", "varlen_bwd": "_flash_attn_varlen_backward"},
        packed_varlen_lse=_version_tuple(version) >= (2, 6),
    )


def _api_for(device: torch.device) -> _Api | None:
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return _load(hopper)


def _lse_from_forward(result: Any) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of a forward's results (8 values in FA2 < 2.6.2, else out and lse first)."""
    if len(result) == 8:
        return result[0], result[5]
    return result[0], result[1]


class FlashAttnBackend(KernelBackend):
    """The ``flash_attn`` package (FA2 >= 2.0, or FA3 on Hopper); fp16/bf16 on CUDA."""

    name = "flash_attn"

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, *, window: bool = False, softcap: bool = False,
        alibi: bool = False,
    ) -> str | None:
        """``None`` if this backend runs on ``device``/``dtype``, else why not."""
        if alibi:
            return (
                "its kernel takes no per-block ALiBi bias on global positions; 'auto' picks 'reference' "
                "for alibi_slopes on CUDA (docs/masks.md)"
            )
        if device.type != "cuda":
            return f"it runs on CUDA only, not {device.type}"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"it supports float16 and bfloat16, not {dtype}"
        api = _api_for(device)
        if api is None:
            return "no usable flash_attn (2.x) or flash_attn_interface (FA3) package is installed"
        names = api.params["fwd"]
        if window and not names & {"window_size", "window_size_left"}:
            return f"flash-attn {api.version} has no sliding window (2.3 and later have)"
        if softcap and "softcap" not in names:
            return f"flash-attn {api.version} has no softcap (2.6 and later have)"
        return None

    @staticmethod
    def _api(device: torch.device, head_dim: int, head_dim_v: int) -> tuple[_Api, int]:
        """The API and the one head dim q, k, v are padded to (Note [Value head dim])."""
        api = _api_for(device)
        if api is None:
            raise ValueError(
                "backend 'flash_attn' needs the flash-attn package: pip install flash-attn"
            )
        if max(head_dim, head_dim_v) > _MAX_HEAD_DIM:
            raise ValueError(
                f"backend 'flash_attn' supports head dims up to {_MAX_HEAD_DIM}, got D={head_dim}, "
                f"Dv={head_dim_v}; use backend='reference'"
            )
        return api, padded_head_dim(head_dim, head_dim_v)

    def kernel_forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: Window, softcap: float
    ) -> tuple[Tensor, Tensor]:
        api, w = self._api(q.device, q.shape[-1], v.shape[-1])
        result = api.call(
            "fwd", q=pad_head_dim(q, width=w), k=pad_head_dim(k, width=w), v=pad_head_dim(v, width=w),
            dropout_p=0.0,
            softmax_scale=scale, causal=window == (-1, 0), window=window, softcap=softcap,
            alibi_slopes=None,
            return_softmax=False, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None,
        )
        out, lse = _lse_from_forward(result)
        return unpad_head_dim(out, v.shape[-1]), normalise_lse_(lse)

    def kernel_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        d = q.shape[-1]
        api, w = self._api(q.device, d, v.shape[-1])
        q_p, k_p, v_p = pad_head_dim(q, width=w), pad_head_dim(k, width=w), pad_head_dim(v, width=w)
        dq, dk, dv = torch.empty_like(q_p), torch.empty_like(k_p), torch.empty_like(v_p)
        api.call(
            "bwd", dout=pad_head_dim(dout.to(q.dtype), width=w).contiguous(), q=q_p, k=k_p, v=v_p,
            out=pad_head_dim(out.to(q.dtype), width=w).contiguous(),
            softmax_lse=lse_for_backward(lse, torch.float32), dq=dq, dk=dk, dv=dv,
            dropout_p=0.0, softmax_scale=scale, causal=window == (-1, 0), window=window,
            softcap=softcap, alibi_slopes=None,
            deterministic=False, rng_state=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None,
        )
        return unpad_head_dim(dq, d), unpad_head_dim(dk, d), unpad_head_dim(dv, v.shape[-1])

    def kernel_varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, scale: float, window: Window,
        softcap: float,
    ) -> tuple[Tensor, Tensor]:
        total_q = q.shape[0]
        api, w = self._api(q.device, q.shape[-1], v.shape[-1])
        cu_q = packing.cu_seqlens_q.to(torch.int32).contiguous()
        cu_k = packing.cu_seqlens_k.to(torch.int32).contiguous()
        max_seqlen_q, max_seqlen_k = packing.max_seqlen_q, packing.max_seqlen_k
        result = api.call(
            "fwd" if api.kind == "fa3" else "varlen_fwd",
            q=pad_head_dim(q, width=w), k=pad_head_dim(k, width=w), v=pad_head_dim(v, width=w),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
            causal=window == (-1, 0), window=window, softcap=softcap, alibi_slopes=None,
            return_softmax=False,
        )
        out, lse = _lse_from_forward(result)
        if lse.dim() == 3:  # FA2 < 2.6: [nseq, H, max_seqlen_q]
            lse = packed_lse_from_padded(lse, cu_q, total_q)
        return unpad_head_dim(out, v.shape[-1]), normalise_lse_(lse)

    def kernel_varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        d = q.shape[-1]
        api, w = self._api(q.device, d, v.shape[-1])
        cu_q = packing.cu_seqlens_q.to(torch.int32).contiguous()
        cu_k = packing.cu_seqlens_k.to(torch.int32).contiguous()
        max_seqlen_q, max_seqlen_k = packing.max_seqlen_q, packing.max_seqlen_k
        lse = lse_for_backward(lse, torch.float32)
        if not api.packed_varlen_lse:
            lse = padded_lse_from_packed(lse, cu_q, max_seqlen_q)
        q_p, k_p, v_p = pad_head_dim(q, width=w), pad_head_dim(k, width=w), pad_head_dim(v, width=w)
        dq, dk, dv = torch.empty_like(q_p), torch.empty_like(k_p), torch.empty_like(v_p)
        api.call(
            "bwd" if api.kind == "fa3" else "varlen_bwd",
            dout=pad_head_dim(dout.to(q.dtype), width=w).contiguous(), q=q_p, k=k_p, v=v_p,
            out=pad_head_dim(out.to(q.dtype), width=w).contiguous(), softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
            causal=window == (-1, 0), window=window, softcap=softcap, alibi_slopes=None,
            deterministic=False, rng_state=None,
        )
        return unpad_head_dim(dq, d), unpad_head_dim(dk, d), unpad_head_dim(dv, v.shape[-1])
