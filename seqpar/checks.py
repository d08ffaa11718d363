"""Input checks shared by the public attention entry points (``ValueError`` with the numbers)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Union

import torch

from .placement.sizes import is_int

__all__ = ["check_qkv", "check_value_shape", "check_gqa", "check_mask_options", "check_scale", "check_sinks"]


# A message prefix, or a function building it: the checks call it only when they raise, so a
# call that passes builds no string (they run on every attention call).
Context = Union[str, Callable[[], str]]


def _text(context: Context) -> str:
    return context if isinstance(context, str) else context()


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


def check_value_shape(
    k_shape: tuple[int, ...], v_shape: tuple[int, ...], dims: str, where: str, context: Context = ""
) -> None:
    """Raise unless v agrees with k on every dim but the last and has a head dim ``Dv >= 1``.

    The value head dim may differ from the query/key head dim (MLA: DeepSeek-V2/V3, Kimi), so
    only ``k_shape[:-1] == v_shape[:-1]`` is required.

    Args:
        k_shape, v_shape: ``[..., Hkv, D]`` and ``[..., Hkv, Dv]`` (bshd or packed ``[T, Hkv, .]``).
        dims: the names of the leading dims for the message, e.g. ``"(B, S_local, Hkv)"``.
        where, context: prefixed to the message (``context`` may be a function building it,
            called only when the check fails).

    Raises:
        ValueError: naming both shapes, the dims that must agree and the fix.
    """
    k_shape, v_shape = tuple(k_shape), tuple(v_shape)
    if k_shape[:-1] != v_shape[:-1]:
        raise ValueError(
            f"{where}: {_text(context)}k and v must agree on {dims} = {k_shape[:-1]}, got v with "
            f"{v_shape[:-1]}; only the value head dim (the last dim, Dv) may differ from k's (MLA). "
            "Pass k and v of the same tokens and key/value heads"
        )
    if v_shape[-1] < 1:
        raise ValueError(f"{where}: {_text(context)}the value head dim must be positive, got Dv={v_shape[-1]}")


def check_gqa(num_heads: int, num_kv_heads: int, where: str, context: Context = "") -> None:
    """Raise unless ``num_heads`` is a positive multiple of ``num_kv_heads`` (GQA/MQA);
    ``context`` as in :func:`check_value_shape`.

    Raises:
        ValueError: naming both counts and the valid ``Hkv`` values.
    """
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"{where}: {_text(context)}the H={num_heads} query heads must be a positive multiple of the "
            f"Hkv={num_kv_heads} key/value heads (GQA); use Hkv in {divisors}"
        )


def check_mask_options(
    causal: object, window: object, chunk_size: object, softcap: object, where: str
) -> tuple[bool, tuple[int, int], int | None, float]:
    """Validate ``causal``, ``window``, ``chunk_size`` and ``softcap``; return them normalised.

    Raises:
        ValueError: a non-bool ``causal`` (numpy bools too); a window that is not two ints >= -1 or that asks for
            keys after the query with ``causal=True``; a non-positive ``chunk_size``; a negative
            or non-finite ``softcap``.
    """
    if not isinstance(causal, bool):
        # Named by type for anything but plain values: under torch.compile a numpy bool is traced
        # as a tensor, whose repr cannot be taken; eager and compiled calls raise the same way.
        shown = (repr(causal) if isinstance(causal, (str, int, float, type(None)))
                 else f"{type(causal).__module__}.{type(causal).__name__}")
        raise ValueError(f"{where}: causal must be True or False, got {shown}")
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(not is_int(w) or w < -1 for w in window)
    ):
        raise ValueError(
            f"{where}: window must be (left, right) with ints >= -1 (-1 = unbounded), got {window!r}"
        )
    left, right = int(window[0]), int(window[1])
    if causal and right > 0:
        raise ValueError(
            f"{where}: window={window!r} lets queries see {right} later keys, which contradicts "
            "causal=True; pass window=(left, 0) (or -1) for causal sliding-window attention"
        )
    if chunk_size is not None and (not is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"{where}: chunk_size must be a positive int or None, got {chunk_size!r}")
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, numbers.Real)
        or not -math.inf < softcap < math.inf  # finite (NaN fails too); no math.isfinite: traceable
        or softcap < 0
    ):
        raise ValueError(f"{where}: softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    return causal, (left, right), None if chunk_size is None else int(chunk_size), float(softcap)


def check_scale(softmax_scale: object, where: str) -> None:
    """Raise unless ``softmax_scale`` is ``None`` or a finite real number."""
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
        or not -math.inf < softmax_scale < math.inf
    ):
        raise ValueError(
            f"{where}: softmax_scale must be a finite float or None (D ** -0.5), got {softmax_scale!r}"
        )


def _check_per_head(x: object, name: str, unit: str, num_heads: int, like: torch.Tensor, where: str) -> None:
    """Raise unless ``x`` is a floating ``[H]`` tensor (one ``unit`` per query head) on ``like``'s device."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise ValueError(f"{where}: {name} must be a floating tensor of {num_heads} {unit}s, got {x!r:.80}")
    if tuple(x.shape) != (num_heads,):
        raise ValueError(
            f"{where}: {name} must have one {unit} per query head, shape ({num_heads},), got {tuple(x.shape)}"
        )
    if x.device != like.device:
        raise ValueError(f"{where}: {name} are on {x.device} but q is on {like.device}")


def check_sinks(sinks: object, num_heads: int, like: torch.Tensor, where: str) -> None:
    """Raise unless ``sinks`` is ``None`` or a floating ``[H]`` tensor on ``like``'s device."""
    if sinks is not None:
        _check_per_head(sinks, "sinks", "logit", num_heads, like, where)


def check_alibi_slopes(slopes: object, num_heads: int, like: torch.Tensor, where: str) -> torch.Tensor | None:
    """``None``, or ``slopes`` as a detached float32 ``[H]`` tensor on ``like``'s device (float64
    slopes stay float64).

    ALiBi slopes are constants of the model (Bloom, MPT, Falcon-ALiBi): no gradient flows to them
    (``docs/masks.md``).

    Raises:
        ValueError: not a floating tensor of shape ``(H,)`` with finite values.
    """
    if slopes is None:
        return None
    _check_per_head(slopes, "alibi_slopes", "slope", num_heads, like, where)
    if slopes.device.type == "cpu" and not bool(torch.isfinite(slopes).all()):
        raise ValueError(f"{where}: alibi_slopes must be finite, got {slopes.tolist()}")
    return slopes.detach().to(torch.float64 if slopes.dtype == torch.float64 else torch.float32)


def check_mask_slices(mask: object, causal: bool, window: tuple[int, int], chunk_size: int | None, where: str):
    """``mask`` if it is None or a :class:`~seqpar.placement.MaskSlices` not combined with the band options.

    Raises:
        ValueError: another type, or ``mask`` together with ``causal``, ``window`` or ``chunk_size``.
    """
    from .placement.masks import MaskSlices

    if mask is None:
        return None
    if not isinstance(mask, MaskSlices):
        raise ValueError(
            f"{where}: mask must be a seqpar.MaskSlices (or None), got {type(mask).__name__}; causal, "
            "sliding-window and chunked attention are the causal=, window= and chunk_size= options"
        )
    if causal or window != (-1, -1) or chunk_size is not None:
        raise ValueError(
            f"{where}: mask= replaces causal/window/chunk_size; got mask with causal={causal}, "
            f"window={window}, chunk_size={chunk_size} (express them as slices, or drop mask=)"
        )
    return mask
