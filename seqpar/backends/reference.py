"""Plain-math attention: the differentiable ground truth and the ``"reference"`` backend.

``reference_attention`` / ``reference_varlen_attention`` are the single-device ground truth used
across the project's tests (run them in float64). They are ordinary autograd code in the input
dtype, so in bf16 they also serve as the "same-dtype PyTorch implementation" of flash-attn's
accuracy rule. They take every mask and score option seqpar has (Note [Masks] in
``seqpar.placement.masks``): causal, window, chunk_size, softcap and sinks.

``ReferenceBackend`` implements the backend protocol with explicit forward/backward formulas in the
accumulator dtype (fp32, or fp64 for fp64 inputs), on any device and dtype, with windows,
softcap and any value head dim ``Dv`` (no padding; Note [Value head dim] in ``base.py``). It
processes query rows in tiles so that the score matrix it materialises stays below
about ``_TILE_ELEMENTS`` elements: it is the exact fallback for options a flash kernel lacks
(softcap on the CPU kernel, say), not a fast path.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ..placement.masks import Mask, MaskSlices
from .base import (
    Alibi, KernelBackend, Packing, Window, alibi_bias, check_dense, empty_forward, lse_dtype, row_key_bounds,
)

__all__ = ["reference_attention", "reference_varlen_attention", "ReferenceBackend"]

# Scores per tile (batch x heads x rows x keys) in ReferenceBackend.
_TILE_ELEMENTS = 1 << 24


def _expand_kv_heads(x: Tensor, heads: int) -> Tensor:
    """``[B, S, Hkv, D] -> [B, S, heads, D]`` by repeating each kv head ``heads // Hkv`` times."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def _cap(scores: Tensor, softcap: float) -> Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    mask: MaskSlices | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention in plain differentiable torch ops, in the dtype of the inputs.

    Query row ``i`` has position ``i + Sk - Sq`` and key ``j`` position ``j`` (bottom-right
    alignment, the usual self-attention when ``Sq == Sk``); the mask is Note [Masks] on those
    positions.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k: ``(batch, seqlen_k, nheads_kv, headdim)``; kv heads are repeated for GQA/MQA.
        v: ``(batch, seqlen_k, nheads_kv, headdim_v)``; ``headdim_v`` may differ from
            ``headdim`` (MLA).
        causal, window, chunk_size: the mask (Note [Masks]).
        scale: softmax scale, default ``headdim ** -0.5``.
        softcap: scores become ``softcap * tanh(scores / softcap)`` when ``> 0``.
        sinks: ``(nheads,)`` logits joining every row's softmax denominator.
        return_lse: also return the log-sum-exp (sinks included).
        mask: a :class:`~seqpar.placement.MaskSlices` on the positions (instead of ``causal``,
            ``window``, ``chunk_size``).
        alibi_slopes: ``(nheads,)``: ``-slope * |p_i - p_j|`` added to the (capped) scores.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim_v)``; with ``return_lse`` also
        ``lse`` ``(batch, nheads, seqlen_q)`` in the accumulator dtype (``-inf`` for rows that
        see no key and no sink; their output is 0).
    """
    check_dense(q, k, v)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    b, sq, heads, _ = q.shape
    sk = k.shape[1]
    k, v = _expand_kv_heads(k, heads), _expand_kv_heads(v, heads)
    scores = _cap(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale, softcap)
    pos_q = torch.arange(sq, device=q.device) + (sk - sq)
    pos_k = torch.arange(sk, device=q.device)
    if alibi_slopes is not None:
        dist = (pos_q[:, None] - pos_k[None, :]).abs().to(scores.dtype)
        scores = scores - alibi_slopes.to(scores.dtype).view(1, heads, 1, 1) * dist
    if mask is not None:
        if causal or window != (-1, -1) or chunk_size is not None:
            raise ValueError("reference_attention: pass either mask= or causal/window/chunk_size")
        allowed = mask.allows(pos_q, pos_k)
    else:
        allowed = Mask(causal, window, chunk_size).allows(pos_q, pos_k)
    allowed = allowed.expand(b, heads, sq, sk)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(b, heads, sq, 1)
        scores = torch.cat([scores, sink], -1)
        allowed = torch.cat([allowed, torch.ones_like(allowed[..., :1])], -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Rows that see nothing: softmax over zeros (finite), multiplied by 0 -> out 0, gradient 0.
    any_key = allowed.any(-1, keepdim=True)
    scores = torch.where(any_key, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * any_key
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores.to(lse_dtype(q.dtype)), dim=-1)
    return out, lse.masked_fill(~any_key[..., 0], float("-inf"))


def reference_varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_lens: list[int],
    *,
    seq_lens_k: list[int] | None = None,
    return_lse: bool = False,
    **options,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-diagonal attention over packed sequences, one :func:`reference_attention` per sequence.

    Args:
        q: ``(total_q, nheads, headdim)`` with ``total_q == sum(seq_lens)``.
        k: ``(total_k, nheads_kv, headdim)``; v: ``(total_k, nheads_kv, headdim_v)``.
        seq_lens: query length of each sequence (zeros allowed).
        seq_lens_k: key lengths per sequence when they differ from ``seq_lens``.
        return_lse: also return the log-sum-exp.
        options: ``causal``, ``scale``, ``window``, ``chunk_size``, ``softcap``, ``sinks`` as in
            :func:`reference_attention`, per sequence (positions restart in every sequence).

    Returns:
        ``out`` ``(total_q, nheads, headdim_v)``; with ``return_lse`` also ``lse``
        ``(nheads, total_q)``.

    Raises:
        ValueError: if the lengths do not add up to the token counts.
    """
    lens_k = list(seq_lens) if seq_lens_k is None else list(seq_lens_k)
    if len(lens_k) != len(seq_lens):
        raise ValueError(f"{len(seq_lens)} query lengths but {len(lens_k)} key lengths")
    if sum(seq_lens) != q.shape[0] or sum(lens_k) != k.shape[0]:
        raise ValueError(
            f"seq_lens sum to {sum(seq_lens)} (q has {q.shape[0]} tokens) and key lengths to "
            f"{sum(lens_k)} (k has {k.shape[0]} tokens)"
        )
    outs, lses = [], []
    for qs, ks, vs in zip(q.split(list(seq_lens)), k.split(lens_k), v.split(lens_k), strict=True):
        out, lse = reference_attention(qs[None], ks[None], vs[None], return_lse=True, **options)
        outs.append(out[0])
        lses.append(lse[0])
    if outs:
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    else:
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = q.new_zeros((q.shape[1], 0), dtype=lse_dtype(q.dtype))
    return (out, lse) if return_lse else out


class ReferenceBackend(KernelBackend):
    """Explicit-formula attention in fp32/fp64 on any device, tiled over query rows."""

    name = "reference"
    host_lengths = True  # one dense call per sequence

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, *, window: bool = False, softcap: bool = False,
        alibi: bool = False,
    ) -> str | None:
        """``None`` if this backend runs on ``device``/``dtype``, else why not (any feature)."""
        if not dtype.is_floating_point:
            return f"dtype {dtype} is not a floating-point type"
        return None

    @staticmethod
    def _tiles(q: Tensor, k: Tensor, window: Window):
        """``(rows, key range, allowed [rows, keys])`` per tile of query rows that see a key.

        The index maths runs on the host (no device synchronisation); only ``allowed`` is
        copied to the device.
        """
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        lower, upper = row_key_bounds(sq, sk, window)
        rows = max(1, _TILE_ELEMENTS // max(1, b * h * sk))
        for i0 in range(0, sq, rows):
            i1 = min(sq, i0 + rows)
            lo, hi = lower[i0:i1], upper[i0:i1]
            if bool((lo > hi).all()):
                continue
            j0, j1 = int(lo.min()), int(hi.max()) + 1
            cols = torch.arange(j0, j1)
            allowed = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
            yield slice(i0, i1), slice(j0, j1), allowed.to(q.device)

    @staticmethod
    def _scores(q: Tensor, k: Tensor, scale: float, softcap: float) -> tuple[Tensor, Tensor | None]:
        """Capped scores ``[B, H, rows, keys]`` and ``tanh`` of the uncapped ones (for backward)."""
        raw = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if softcap <= 0:
            return raw, None
        t = torch.tanh(raw / softcap)
        return softcap * t, t

    def kernel_forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: Window, softcap: float,
        alibi: Alibi | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Explicit formulas in the accumulator dtype, tile by tile of query rows (ALiBi: Note
        [ALiBi blocks] in ``base.py``)."""
        acc = lse_dtype(q.dtype)
        b, sq, heads, _ = q.shape
        out, lse = empty_forward(q, (b, heads, sq), v.shape[-1])
        kf, vf = _expand_kv_heads(k.to(acc), heads), _expand_kv_heads(v.to(acc), heads)
        for rows, cols, allowed in self._tiles(q, k, window):
            scores, _ = self._scores(q[:, rows].to(acc), kf[:, cols], scale, softcap)
            if alibi is not None:
                scores = scores + alibi_bias(alibi, rows, cols, acc, q.device)
            scores = scores.masked_fill(~allowed, float("-inf"))
            tile_lse = torch.logsumexp(scores, dim=-1)  # [B, H, rows]
            safe = tile_lse.masked_fill(tile_lse == float("-inf"), float("inf"))
            probs = torch.exp(scores - safe.unsqueeze(-1))
            out[:, rows] = torch.einsum("bhqk,bkhd->bqhd", probs, vf[:, cols]).to(q.dtype)
            lse[..., rows] = tile_lse
        return out, lse

    def kernel_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        scale: float, window: Window, softcap: float, alibi: Alibi | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Explicit formulas in the accumulator dtype, reading the given ``out`` and ``lse``."""
        acc = lse_dtype(q.dtype)
        b, sk, hkv, d = k.shape
        heads, dv_dim = q.shape[2], v.shape[-1]
        kf, vf = _expand_kv_heads(k.to(acc), heads), _expand_kv_heads(v.to(acc), heads)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(kf.shape, dtype=acc, device=q.device)
        dv = torch.zeros(vf.shape, dtype=acc, device=q.device)
        for rows, cols, allowed in self._tiles(q, k, window):
            qf, dof = q[:, rows].to(acc), dout[:, rows].to(acc)
            of = out[:, rows].to(q.dtype).to(acc)
            scores, tanh = self._scores(qf, kf[:, cols], scale, softcap)
            if alibi is not None:
                scores = scores + alibi_bias(alibi, rows, cols, acc, q.device)
            scores = scores.masked_fill(~allowed, float("-inf"))
            row_lse = lse[..., rows].to(acc)
            row_lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))
            probs = torch.exp(scores - row_lse.unsqueeze(-1))  # [B, H, rows, keys]
            dv[:, cols] += torch.einsum("bhqk,bqhd->bkhd", probs, dof)
            dprobs = torch.einsum("bqhd,bkhd->bhqk", dof, vf[:, cols])
            delta = (dof * of).sum(-1).transpose(1, 2)  # [B, H, rows]
            dscores = probs * (dprobs - delta.unsqueeze(-1))
            if tanh is not None:
                dscores = dscores * (1 - tanh * tanh)
            dq[:, rows] = torch.einsum("bhqk,bkhd->bqhd", dscores, kf[:, cols]) * scale
            dk[:, cols] += torch.einsum("bhqk,bqhd->bkhd", dscores, qf) * scale
        group = heads // hkv
        dk = dk.view(b, sk, hkv, group, d).sum(3)
        dv = dv.view(b, sk, hkv, group, dv_dim).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def kernel_varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, scale: float, window: Window,
        softcap: float,
    ) -> tuple[Tensor, Tensor]:
        """One dense call per sequence."""
        lens_q, lens_k = packing.host_lens()
        out, lse = empty_forward(q, (q.shape[1], q.shape[0]), v.shape[-1])
        starts_q = [0, *itertools.accumulate(lens_q)]
        starts_k = [0, *itertools.accumulate(lens_k)]
        for lq, lk, sq, sk in zip(lens_q, lens_k, starts_q, starts_k):
            if lq == 0 or lk == 0:
                continue
            o, l = self.kernel_forward(
                q[None, sq:sq + lq], k[None, sk:sk + lk], v[None, sk:sk + lk], scale=scale,
                window=window, softcap=softcap,
            )
            out[sq:sq + lq] = o[0]
            lse[:, sq:sq + lq] = l[0]
        return out, lse

    def kernel_varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One dense call per sequence."""
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        self.kernel_varlen_backward_into(
            grads, dout, q, k, v, out, lse, packing, scale=scale, window=window, softcap=softcap
        )
        return grads

    def kernel_varlen_backward_into(
        self, grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
        out: Tensor, lse: Tensor, packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> None:
        """One dense call per sequence, added into ``grads`` as it goes."""
        lens_q, lens_k = packing.host_lens()
        dq, dk, dv = grads
        starts_q = [0, *itertools.accumulate(lens_q)]
        starts_k = [0, *itertools.accumulate(lens_k)]
        for lq, lk, sq, sk in zip(lens_q, lens_k, starts_q, starts_k):
            if lq == 0 or lk == 0:
                continue
            g = self.kernel_backward(
                dout[None, sq:sq + lq], q[None, sq:sq + lq], k[None, sk:sk + lk],
                v[None, sk:sk + lk], out[None, sq:sq + lq], lse[None, :, sq:sq + lq],
                scale=scale, window=window, softcap=softcap,
            )
            dq[sq:sq + lq] += g[0][0]
            dk[sk:sk + lk] += g[1][0]
            dv[sk:sk + lk] += g[2][0]
