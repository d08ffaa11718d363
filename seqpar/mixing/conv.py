"""Causal depthwise convolution over token shards: the short convolution of hybrid layers.

Gated-delta, KDA, Mamba and short-convolution layers (LFM2) run a depthwise causal conv1d of
width ``K`` (3 to 7) over their channels before the mixer: token ``t`` of channel ``c`` reads
``x[t - K + 1 .. t, c]`` of its own sequence, zeros before the sequence starts. Channels are
independent, so this runs head-parallel (Note [Head-parallel mixing]) with every channel a head:
exact for any placement, packed sequences included, at the price of moving the whole shard (a
halo exchange of ``K - 1`` tokens per piece is the cheaper state-passing form). Inside, the
convolution is ``K`` shifted multiply-adds masked by the position within the sequence, so packed
sequences never read each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from ..state import ParallelState, require_state
from .headwise import HeadShard, head_parallel

__all__ = ["causal_conv1d", "causal_conv1d_local"]


def causal_conv1d_local(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, cu_seqlens: Tensor | None = None,
    activation: Literal["silu"] | None = None,
) -> Tensor:
    """Depthwise causal conv1d of whole sequences on one rank (no communication).

    Args:
        x: ``[B, S, C]``, or packed ``[T, C]`` with ``cu_seqlens``.
        weight: ``[C, K]`` (``nn.Conv1d(C, C, K, groups=C).weight[:, 0]``).
        bias: ``[C]`` or ``None``.
        cu_seqlens: ``[nseq + 1]`` boundaries of packed sequences in ``x``'s token dim.
        activation: ``"silu"`` applied after the bias, or ``None``.

    Returns:
        ``x``'s shape: ``out[t, c] = bias[c] + sum_k weight[c, k] * x[t - K + 1 + k, c]`` over the
        tokens of ``t``'s sequence.
    """
    packed = cu_seqlens is not None
    xs = x.unsqueeze(0) if packed else x  # [B, S, C]
    S, K = xs.shape[1], weight.shape[-1]
    pos = torch.arange(S, device=x.device)
    if packed:  # position within its own sequence
        starts = cu_seqlens[:-1].to(x.device)
        seq = torch.searchsorted(cu_seqlens[1:].to(x.device), pos, right=True)
        pos = pos - starts[seq]
    out = xs * weight[:, K - 1]
    for s in range(1, min(K, S + 1)):
        shifted = torch.nn.functional.pad(xs, (0, 0, s, 0))[:, :S]  # x[t - s], zeros before 0
        out = out + torch.where((pos >= s)[:, None], shifted, 0) * weight[:, K - 1 - s]
    if bias is not None:
        out = out + bias
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    return out.squeeze(0) if packed else out


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: ParallelState,
    *,
    activation: Literal["silu"] | None = None,
    seq_len: int | None = None,
    seq_lens: Sequence[int] | Tensor | None = None,
) -> Tensor:
    """Depthwise causal conv1d of token shards, exact over the whole sequence (head-parallel).

    Every CP rank passes its shard; each rank convolves whole sequences of some channels and the
    result comes back as its shard. The history of a token is the ``K - 1`` globally preceding
    tokens of its own sequence, whatever the placement. Differentiable: ``x``'s gradient is
    exact on its rank, ``weight``'s and ``bias``'s are partial (sum them over the CP group, as
    for every parameter).

    Args:
        x: ``[B, S_local, C]`` (``seqpar.shard``), or packed ``[T_local, C]``
            (``seqpar.shard_packed``) with ``seq_lens``.
        weight: ``[C, K]`` or ``nn.Conv1d``'s ``[C, 1, K]``; the same on every rank.
        bias: ``[C]`` or ``None``.
        state: the parallel state.
        activation: ``"silu"`` (applied after the bias, as the hybrid models do) or ``None``.
        seq_len, seq_lens: as for :func:`head_parallel`.

    Returns:
        ``x``'s shape and placement.

    Raises:
        ValueError: a weight or bias that does not match ``x``'s channels, an unknown activation,
            or any of :func:`head_parallel`'s errors.
    """
    where = "causal_conv1d"
    require_state(state, where)
    if not isinstance(x, Tensor) or x.ndim != (2 if seq_lens is not None else 3):
        layout = "[T_local, C] (packed)" if seq_lens is not None else "[B, S_local, C]"
        raise ValueError(f"{where}: x must be {layout}, got {getattr(x, 'shape', type(x).__name__)}")
    C = x.shape[-1]
    if not isinstance(weight, Tensor) or weight.ndim not in (2, 3) or weight.shape[0] != C or (
        weight.ndim == 3 and weight.shape[1] != 1
    ) or weight.shape[-1] < 1:
        raise ValueError(
            f"{where}: weight must be [C, K] or [C, 1, K] with C={C} channels of x, got "
            f"{tuple(getattr(weight, 'shape', ()))}"
        )
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (C,)):
        raise ValueError(f"{where}: bias must be [{C}] or None, got {tuple(getattr(bias, 'shape', ()))}")
    if activation not in (None, "silu"):
        raise ValueError(f"{where}: activation must be None or 'silu', got {activation!r}")
    w = weight.reshape(C, weight.shape[-1])

    def mix(shard: HeadShard, xc: Tensor) -> Tensor:
        b = None if bias is None else shard.narrow(bias)
        return causal_conv1d_local(xc, shard.narrow(w), b, shard.cu_seqlens, activation)

    return head_parallel(mix, [x], state, seq_len=seq_len, seq_lens=seq_lens)
