"""Plain-math attention: the differentiable reference functions and the ``"reference"`` backend.

``reference_attention`` / ``reference_varlen_attention`` are the single-device ground truth used
across the project's tests (run them in float64). They are ordinary autograd code in the input
dtype, so in bf16 they also serve as the "same-dtype PyTorch implementation" of flash-attn's
accuracy rule.

``ReferenceBackend`` implements the backend protocol with explicit forward/backward formulas in the
accumulator dtype (fp32, or fp64 for fp64 inputs). It runs on any device and dtype but materialises
the ``[B, H, Sq, Sk]`` score matrix, so it is meant for tests and small problems.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ..merge import accumulator_dtype
from .base import KernelBackend, Packing, check_dense, empty_forward, lse_for_backward

__all__ = ["reference_attention", "reference_varlen_attention", "ReferenceBackend"]


def _expand_kv_heads(x: Tensor, heads: int) -> Tensor:
    """``[B, S, Hkv, D] -> [B, S, heads, D]`` by repeating each kv head ``heads // Hkv`` times."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def _causal_mask(sq: int, sk: int, device: torch.device) -> Tensor:
    """Bool ``[sq, sk]``, True where a key lies after its query (diagonal aligned, top-left)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention in plain differentiable torch ops, in the dtype of the inputs.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; kv heads are repeated for GQA/MQA.
        causal: mask keys after their query; requires ``seqlen_q == seqlen_k``.
        scale: softmax scale, default ``headdim ** -0.5``.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)``; with ``return_lse`` also
        ``lse`` ``(batch, nheads, seqlen_q)`` in ``accumulator_dtype(q.dtype)``. Rows without keys
        (``seqlen_k == 0``) give ``out = 0`` and ``lse = -inf``.

    Raises:
        ValueError: on malformed shapes, or causal with ``seqlen_q != seqlen_k``.
    """
    if causal and q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal reference attention needs seqlen_q == seqlen_k, got {q.shape[1]} and "
            f"{k.shape[1]}"
        )
    check_dense(q, k, v, causal)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    heads = q.shape[2]
    k = _expand_kv_heads(k, heads)
    v = _expand_kv_heads(v, heads)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        scores = scores.masked_fill(_causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # an empty key dim gives out = 0, lse = -inf below
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores.to(accumulator_dtype(q.dtype)), dim=-1)
    return out, lse


def reference_varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_lens: list[int],
    *,
    causal: bool = False,
    scale: float | None = None,
    seq_lens_k: list[int] | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-diagonal attention over packed sequences, one :func:`reference_attention` per sequence.

    Args:
        q: ``(total_q, nheads, headdim)`` with ``total_q == sum(seq_lens)``.
        k, v: ``(total_k, nheads_kv, headdim)``.
        seq_lens: query length of each sequence (zeros allowed).
        causal: per-sequence causal mask; requires equal q and k lengths.
        scale: softmax scale, default ``headdim ** -0.5``.
        seq_lens_k: key lengths per sequence when they differ from ``seq_lens``.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` ``(total_q, nheads, headdim)``; with ``return_lse`` also ``lse``
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
    for qs, ks, vs in zip(
        q.split(list(seq_lens)), k.split(lens_k), v.split(lens_k), strict=True
    ):
        out, lse = reference_attention(
            qs[None], ks[None], vs[None], causal=causal, scale=scale, return_lse=True
        )
        outs.append(out[0])
        lses.append(lse[0])
    if outs:
        out = torch.cat(outs)
        lse = torch.cat(lses, dim=1)
    else:
        out = q.new_zeros(q.shape)
        lse = q.new_zeros((q.shape[1], 0), dtype=accumulator_dtype(q.dtype))
    return (out, lse) if return_lse else out


class ReferenceBackend(KernelBackend):
    """Explicit-formula attention in fp32/fp64 on any device; O(Sq * Sk) memory per head."""

    name = "reference"
    host_lengths = True  # one dense call per sequence

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """``None`` if this backend runs on ``device``/``dtype``, else why not."""
        if not dtype.is_floating_point:
            return f"dtype {dtype} is not a floating-point type"
        return None

    def _forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """Explicit formulas in the accumulator dtype."""
        acc = accumulator_dtype(q.dtype)
        heads = q.shape[2]
        qf = q.to(acc)
        kf, vf = _expand_kv_heads(k.to(acc), heads), _expand_kv_heads(v.to(acc), heads)
        scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
        if causal:
            scores.masked_fill_(_causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]
        probs = torch.exp(scores - lse_for_backward(lse, acc).unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
        return out.to(q.dtype), lse

    def _backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Explicit formulas in the accumulator dtype, reading the given ``out`` and ``lse``."""
        acc = accumulator_dtype(q.dtype)
        b, sk, hkv, d = k.shape
        heads = q.shape[2]
        qf = q.to(acc)
        kf, vf = _expand_kv_heads(k.to(acc), heads), _expand_kv_heads(v.to(acc), heads)
        dof, of = dout.to(acc), out.to(q.dtype).to(acc)
        scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
        if causal:
            scores.masked_fill_(_causal_mask(q.shape[1], sk, q.device), float("-inf"))
        probs = torch.exp(scores - lse_for_backward(lse, acc).unsqueeze(-1))  # [B, H, Sq, Sk]
        dv = torch.einsum("bhqk,bqhd->bkhd", probs, dof)
        dprobs = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
        delta = (dof * of).sum(-1).transpose(1, 2)  # [B, H, Sq]
        dscores = probs * (dprobs - delta.unsqueeze(-1))
        dq = torch.einsum("bhqk,bkhd->bqhd", dscores, kf) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", dscores, qf) * scale
        group = heads // hkv
        dk = dk.view(b, sk, hkv, group, d).sum(3)
        dv = dv.view(b, sk, hkv, group, d).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """One dense call per sequence."""
        lens_q, lens_k = packing.host_lens()
        out, lse = empty_forward(q, (q.shape[1], q.shape[0]))
        starts_q = [0, *itertools.accumulate(lens_q)]
        starts_k = [0, *itertools.accumulate(lens_k)]
        for lq, lk, sq, sk in zip(lens_q, lens_k, starts_q, starts_k):
            if lq == 0 or lk == 0:
                continue
            o, l = self._forward(
                q[None, sq:sq + lq], k[None, sk:sk + lk], v[None, sk:sk + lk], causal=causal,
                scale=scale,
            )
            out[sq:sq + lq] = o[0]
            lse[:, sq:sq + lq] = l[0]
        return out, lse

    def _varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One dense call per sequence."""
        lens_q, lens_k = packing.host_lens()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        starts_q = [0, *itertools.accumulate(lens_q)]
        starts_k = [0, *itertools.accumulate(lens_k)]
        for lq, lk, sq, sk in zip(lens_q, lens_k, starts_q, starts_k):
            if lq == 0 or lk == 0:
                continue
            g = self._backward(
                dout[None, sq:sq + lq], q[None, sq:sq + lq], k[None, sk:sk + lk],
                v[None, sk:sk + lk], out[None, sq:sq + lq], lse[None, :, sq:sq + lq],
                causal=causal, scale=scale,
            )
            dq[sq:sq + lq] = g[0][0]
            dk[sk:sk + lk] = g[1][0]
            dv[sk:sk + lk] = g[2][0]
        return dq, dk, dv
