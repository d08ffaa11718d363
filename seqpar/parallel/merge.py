"""Merging partial attention results by their log-sum-exp (LSE), and attention sinks.

Note [LSE merge]
~~~~~~~~~~~~~~~~
Attention of one query row over a key set ``K = K_a ∪ K_b`` (disjoint) can be assembled from
the results over each part. With ``lse_x = log sum_{j in K_x} exp(s_j)`` and ``out_x`` the
softmax-weighted mean of the values of ``K_x``::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Computed stably as ``lse = m + log1p(exp(min - m))`` with ``m = max(lse_a, lse_b)``, so every
exponent is ``<= 0``. An empty part has ``lse = -inf`` and contributes nothing; when both parts
are empty the row stays ``out = 0``, ``lse = -inf`` (no NaN: the shifts below replace ``-inf``
references by 0).

Accumulators are kept in fp32 (fp64 when the inputs are fp64) and cast to the input dtype once
at the end by the caller. Shapes follow the backends: ``out [*, S, H, D]`` with ``lse [*, H, S]``,
i.e. dense ``[B, S, H, D]`` / ``[B, H, S]`` and varlen ``[T, H, D]`` / ``[H, T]``.

Note [Attention sinks]
~~~~~~~~~~~~~~~~~~~~~~
A sink (gpt-oss ``s_aux``) is one extra logit ``z_h`` per head that joins every row's softmax
denominator and contributes no value: it is a part with ``lse = z_h`` and ``out = 0``, merged
last. The kernels' backward, given the final ``out`` and ``lse``, then yields exact dq/dk/dv, and
``d z_h = -sum_rows exp(z_h - lse) * <dout, out>`` (the sink's probability times the row's
``delta``, with a minus sign).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..backends.base import lse_dtype as accumulator_dtype
from ..comm import Group, reduce_

__all__ = ["accumulator_dtype", "new_accumulators", "merge_", "merge", "merge_over_group", "add_sinks", "sinks_grad"]


def new_accumulators(
    out_shape: Sequence[int], *, device: torch.device | str, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Empty accumulators: ``out`` zeros and ``lse`` filled with ``-inf``.

    Args:
        out_shape: ``(*, S, H, D)``, e.g. ``(B, S, H, D)`` dense or ``(T, H, D)`` varlen.
        device: where to allocate.
        dtype: dtype of the attention inputs; the accumulators use ``accumulator_dtype(dtype)``.

    Returns:
        ``(out_acc, lse_acc)``: ``out_acc`` of shape ``out_shape`` and ``lse_acc`` of shape
        ``(*, H, S)``, both in the accumulator dtype.
    """
    out_shape = tuple(out_shape)
    if len(out_shape) < 3:
        raise ValueError(f"out_shape must be (*, S, H, D) with at least 3 dims, got {out_shape}")
    acc = accumulator_dtype(dtype)
    *lead, s, h, _ = out_shape
    out_acc = torch.zeros(out_shape, device=device, dtype=acc)
    lse_acc = torch.full((*lead, h, s), float("-inf"), device=device, dtype=acc)
    return out_acc, lse_acc


def _check_pair(out: Tensor, lse: Tensor, what: str) -> None:
    if out.dim() < 3 or lse.dim() != out.dim() - 1:
        raise ValueError(
            f"{what}: out must be [*, S, H, D] and lse [*, H, S]; got out {tuple(out.shape)}, "
            f"lse {tuple(lse.shape)}"
        )
    *lead, s, h, _ = out.shape
    if tuple(lse.shape) != (*lead, h, s):
        raise ValueError(
            f"{what}: lse shape {tuple(lse.shape)} does not match out shape {tuple(out.shape)}; "
            f"expected {(*lead, h, s)}"
        )


def merge_(out_acc: Tensor, lse_acc: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """Merge one block result into the accumulators, in place (see Note [LSE merge]).

    Args:
        out_acc: ``[*, S, H, D]`` float32/float64 accumulator; may be a view into a larger buffer.
        lse_acc: ``[*, H, S]`` accumulator of the same dtype; may be a view.
        out_blk: ``[*, S, H, D]`` block output, any floating dtype (bf16 is upcast).
        lse_blk: ``[*, H, S]`` block LSE; ``-inf`` marks rows that saw no key.

    Raises:
        ValueError: if the shapes do not match or the accumulators are not float32/float64.
    """
    _check_pair(out_acc, lse_acc, "accumulator")
    _check_pair(out_blk, lse_blk, "block")
    if out_acc.shape != out_blk.shape:
        raise ValueError(
            f"block out shape {tuple(out_blk.shape)} != accumulator shape {tuple(out_acc.shape)}"
        )
    if out_acc.dtype not in (torch.float32, torch.float64) or lse_acc.dtype != out_acc.dtype:
        raise ValueError(
            f"accumulators must both be float32 or float64, got out {out_acc.dtype}, "
            f"lse {lse_acc.dtype}"
        )
    lse_b = lse_blk.to(lse_acc.dtype)
    hi = torch.maximum(lse_acc, lse_b)
    lo = torch.minimum(lse_acc, lse_b)
    # Where hi == -inf both sides are empty: shift by 0 so that lo - shift = -inf, not NaN.
    hi_shift = hi.masked_fill(hi == float("-inf"), 0.0)
    new_lse = hi + torch.log1p(torch.exp(lo - hi_shift))
    new_shift = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    w_acc = torch.exp(lse_acc - new_shift).transpose(-1, -2).unsqueeze(-1)  # [*, S, H, 1]
    w_blk = torch.exp(lse_b - new_shift).transpose(-1, -2).unsqueeze(-1)
    out_acc.mul_(w_acc).addcmul_(out_blk, w_blk)
    lse_acc.copy_(new_lse)


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Functional form of :func:`merge_`: the merged ``(out, lse)`` of two partial results.

    Args:
        out_a, out_b: ``[*, S, H, D]`` partial outputs (any floating dtype).
        lse_a, lse_b: ``[*, H, S]`` their LSEs.

    Returns:
        ``(out, lse)`` in ``accumulator_dtype`` of the wider input (fp64 if either is fp64).
    """
    acc = torch.promote_types(accumulator_dtype(out_a.dtype), accumulator_dtype(out_b.dtype))
    out = out_a.to(acc, copy=True)
    lse = lse_a.to(acc, copy=True)
    merge_(out, lse, out_b, lse_b)
    return out, lse


def merge_over_group(out: Tensor, lse: Tensor, group: Group) -> tuple[Tensor, Tensor]:
    """The merged ``(out [B, P, H, Dv], lse [B, H, P])`` of every rank's partial result over ``group``,
    in the accumulator dtype, the same bits on every rank (all-reduces hand every rank the same sum).

    Two all-reduces, whatever the group's size: the max LSE, then the weighted outputs and their
    weights ``exp(lse - max)`` in one flat buffer (an all-gather of every rank's part would grow
    with the group). Rows no rank saw stay ``out = 0``, ``lse = -inf``. No autograd: the callers
    write their backward from the final ``(out, lse)``."""
    acc = accumulator_dtype(out.dtype)
    lse = lse.to(acc)
    top = reduce_(lse.clone(), group, "max")
    top = top.masked_fill(top == float("-inf"), 0.0)
    weight = torch.exp(lse - top)  # [B, H, P]
    flat = torch.cat([(out.to(acc) * weight.transpose(1, 2).unsqueeze(-1)).flatten(), weight.flatten()])
    reduce_(flat, group, "sum")
    total = flat[out.numel():].view_as(weight)
    merged = flat[: out.numel()].view(out.shape) / total.clamp(min=torch.finfo(acc).tiny).transpose(1, 2).unsqueeze(-1)
    return merged, top + torch.log(total)


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Merge one sink logit per head into ``(out, lse)`` (Note [Attention sinks]).

    Args:
        out: ``[*, S, H, D]`` attention output over the keys (any floating dtype).
        lse: ``[*, H, S]`` its LSE (accumulator dtype; ``-inf`` for rows without keys).
        sinks: ``[H]`` logits.

    Returns:
        ``(out, lse)`` with the sinks in the denominators: ``out`` in ``out``'s dtype (scaled
        in the accumulator dtype), ``lse`` in the accumulator dtype.
    """
    z = sinks.to(lse.dtype).view(*([1] * (lse.dim() - 2)), -1, 1)  # [*, H, 1]
    new_lse = torch.logaddexp(lse, z.expand_as(lse))
    weight = torch.exp(lse - new_lse).transpose(-1, -2).unsqueeze(-1)  # [*, S, H, 1]
    return (out.to(lse.dtype) * weight).to(out.dtype), new_lse


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Gradient of the sink logits: ``-sum_rows exp(z - lse) * <dout, out>``, shaped like ``sinks``.

    Args:
        dout, out: ``[*, S, H, D]`` (the final output, sinks included).
        lse: ``[*, H, S]`` the final LSE, sinks included.
        sinks: ``[H]``.
    """
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(-1, -2)  # [*, H, S]
    z = sinks.to(acc).view(*([1] * (lse.dim() - 2)), -1, 1)
    grad = -(torch.exp(z - lse) * delta)
    return grad.sum(dim=[d for d in range(grad.dim()) if d != grad.dim() - 2]).to(sinks.dtype)

