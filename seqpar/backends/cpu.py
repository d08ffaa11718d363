"""The ``"cpu"`` backend: PyTorch's CPU flash-attention kernel.

Dense blocks call ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``) on
``[B, H, S, D]`` transposed views of the bshd inputs; GQA is native (``Hkv < H`` accepted).

Measured kernel quirks (torch 2.13) handled here:

- an empty sequence dim (``Sq == 0`` or ``Sk == 0``) crashes the process (SIGFPE): never called;
- a strided head dim (``stride(-1) != 1``) gives silently wrong results: such inputs are copied;
- q, k and v must share one head dim ("Q/K/V should have the same head size"): with a value head
  dim ``Dv != D`` (MLA) the narrower side -- v when ``Dv < D``, q and k when ``Dv > D`` -- is
  zero-padded to the wider one and the results sliced back, which is exact (Note [Value head dim]
  in ``base.py``) and costs the padded columns' FLOPs;
- ``is_causal`` is aligned top-left, and a fully masked row yields ``lse = 0``: the kernel gets
  ``is_causal`` only for square causal blocks, other windows get an additive mask, and rows that
  see no key are never given to it (dense) or are reset to ``out = 0, lse = -inf`` (varlen);
- the backward turns ``lse = -inf`` into NaN; ``-inf`` is passed as ``+inf`` (zero weight).

Note [CPU windows]
~~~~~~~~~~~~~~~~~~
The kernel has no window argument. A block whose window cuts some rows is computed in tiles of
query rows: each tile takes only the rows that see a key and only the key columns its rows see,
with an additive ``[rows, keys]`` mask (``-inf`` outside the window). A tile of ``T`` rows over a
band of width ``W`` computes ``T x (T + W)`` scores for ``T x W`` useful ones, so ``T`` is about
``W / 4`` (at least 64, and within a mask budget): work and mask memory follow the band, not
``Sq x Sk``. The backward adds each tile's gradients into its target as it goes: a dense block's
zero-filled dq, dk, dv, or, for a segment of a varlen call, the call's own gradients, so a
windowed segment holds no gradients of its own (measured, one rank of a 4-rank ring, S = 4096,
H = Hkv = 8, D = 32, window 255, fp32: the call's peak fell 8.53 -> 5.93 MiB). The kernel has no
softcap either:
``"auto"`` picks the ``reference`` backend for softcapped attention on CPU. ALiBi (Note [ALiBi
blocks] in ``base.py``) runs through the same tiles: the additive mask carries the bias, one plane
per head, so a block with ALiBi is always tiled (rows bounded by the mask budget).

Note [CPU varlen]
~~~~~~~~~~~~~~~~~
The kernel has no cumulative-length mode, and per call it costs a few microseconds plus Python
overhead, which dominates for short sequences. ``varlen_forward``/``varlen_backward`` therefore:

1. give each sequence with ``len_q * len_k * H * D >= _DIRECT_MIN_WORK`` (``H * D``: q's elements
   per token) its own dense call on views of the packed tensors (no copy, no wasted FLOPs);
2. put shorter sequences into buckets of similar ``(len_q, len_k)`` -- exact up to
   ``_EXACT_UP_TO`` tokens, then geometric with ratio ``_BUCKET_RATIO`` -- gather each bucket into
   one padded ``[n, M, H, D]`` batch and make one dense call for it, so padding wastes at most
   ``_BUCKET_RATIO`` per side. Padded keys are hidden by a ``[n, 1, 1, Mk]`` additive key mask
   (non-causal only: with the top-left causal mask a real query row never reaches a padded key).
   Padded query rows are computed and dropped; in the backward their lse is ``+inf`` so they
   contribute nothing to dk/dv.

Sequences with no query or no key are skipped (out 0, lse -inf, zero gradients).

The threshold counts the work of a call, heads included: it was 128 x 128 tokens whatever the
heads, which is right for one head of 64 (the same ``2**20``) but bucketed 100-token sequences
at 8 heads, whose gathers, padding and masks cost more than the calls they saved. Measured
(forward + backward, causal, fp32, median of interleaved rounds, old rule -> this one): H 1, D 64
unchanged (0.97-1.02x); H 2 0.88-1.01x; H 8, D 64 0.72-0.92x for 16-128-token sequences; H 32,
D 128 0.57-0.64x. Direct calls also gather nothing, so a bucket's copies of q, k, v, out and dout
no longer sit next to the backward's other buffers for such sequences.

In the backward a causal sequence of at least ``_SPLIT_CAUSAL_FROM`` tokens runs as three calls
on its halves (the two causal diagonals and the full block below them, the same FLOPs), each
adding into the call's gradients: the kernel's results, the only buffer a sequence adds beyond
the call's gradients, are then half a sequence's instead of a whole one's (a packed Ulysses
stack at 1 x 8, Hkv 2, whose longest sequence is half of the pack: 1.5 -> 0.75 x-shards at the
backward's peak, docs/performance.md). Measured on this CPU kernel, from 2,048 tokens the three
calls take 0.99-1.03x the time of one; halves of 512 tokens took 1.06-1.14x, hence the threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import (
    Alibi,
    KernelBackend,
    alibi_bias,
    Packing,
    Window,
    empty_forward,
    lse_dtype,
    lse_for_backward,
    pad_head_dim,
    row_key_bounds,
    unpad_head_dim,
)

__all__ = ["CpuFlashBackend"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# A causal sequence this long runs its backward in three calls on its halves (Note [CPU varlen]).
_SPLIT_CAUSAL_FROM = 2048
# A sequence whose len_q * len_k * H * D reaches this gets its own kernel call (see Note [CPU varlen]).
_DIRECT_MIN_WORK = 1 << 20  # 128 x 128 tokens at one head of 64
_EXACT_UP_TO = 8
_BUCKET_RATIO = 1.25
# Mask elements per tile of a windowed block (see Note [CPU windows]).
_MASK_ELEMENTS = 1 << 22


def _kernel_inputs(*xs: Tensor, width: int) -> list[Tensor]:
    """``[B, S, H, d]`` tensors as the kernel reads them: ``[B, H, S, width]`` views, the head dim
    contiguous and zero-padded to ``width`` where narrower (Note [Value head dim] in ``base.py``)."""
    return [pad_head_dim(x, 1, width=width).transpose(1, 2) for x in xs]


def _kernel_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One kernel call on bshd inputs with non-empty sequence dims -> bshd out ``[B, Sq, H, Dv]``,
    ``[B, H, Sq]`` lse. The kernel needs one head dim: with ``Dv != D`` the narrower of (q, k)
    and v is zero-padded to the wider, and the output sliced back to ``Dv`` (exact)."""
    q, scale = _positive_scale(q, scale)
    d_v = v.shape[-1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_kernel_inputs(q, k, v, width=max(q.shape[-1], d_v)),
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
    )
    return unpad_head_dim(out, d_v).transpose(1, 2), lse.contiguous()


def _kernel_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One backward kernel call on bshd inputs; ``lse`` must come from :func:`lse_for_backward`.
    Pads as :func:`_kernel_forward` (``dout`` and ``out`` like v) and returns the gradients in
    their inputs' head dims."""
    given = scale
    q, scale = _positive_scale(q, scale)
    d, d_v = q.shape[-1], v.shape[-1]
    padded = _kernel_inputs(dout.to(q.dtype), q, k, v, out.to(q.dtype), width=max(d, d_v))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *padded,
        lse,
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
    )
    del padded
    if given < 0:
        dq = dq.neg_()
    elif given == 0:
        dq = dq.zero_()
    return (unpad_head_dim(dq, d).transpose(1, 2), unpad_head_dim(dk, d).transpose(1, 2),
            unpad_head_dim(dv, d_v).transpose(1, 2))


def _positive_scale(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """``(q', s')`` with ``s' > 0`` and ``s' * q' == scale * q``.

    The CPU kernel scales after applying its causal ``-inf``, so a scale ``<= 0`` turns masked
    scores into ``+inf`` or NaN. Scores depend only on ``scale * q``: negate ``q`` for a negative
    scale and zero it for a zero scale (the caller fixes ``dq`` back).
    """
    if scale > 0:
        return q, scale
    if scale < 0:
        return q.neg(), -scale
    return torch.zeros_like(q), 1.0


@dataclass(frozen=True)
class _Side:
    """Where one side (q or k) of a bucket's ``[n, M]`` padded batch lives in the packed tensor.

    ``index`` ``[n * M]`` holds packed token indices (padding points at the sequence's first
    token), ``valid`` ``[n * M]`` marks real tokens, ``start`` is set when the batch is one
    contiguous run of packed tokens without padding (a view then replaces the gather).
    """

    n: int
    width: int
    index: Tensor
    valid: Tensor
    start: int | None

    @staticmethod
    def build(starts: Tensor, lens: Tensor) -> _Side:
        width = int(lens.max())
        pos = torch.arange(width)
        valid = pos < lens[:, None]
        index = (starts[:, None] + torch.where(valid, pos, 0)).flatten()
        first = int(index[0])
        run = bool(valid.all()) and bool(
            (index == torch.arange(first, first + index.numel())).all()
        )
        return _Side(len(lens), width, index, valid.flatten(), first if run else None)

    def take(self, x: Tensor) -> Tensor:
        """``x [T, H, D]`` -> this side's padded batch ``[n, M, H, D]``."""
        if self.start is not None:
            rows = x[self.start:self.start + self.n * self.width]
            return rows.unflatten(0, (self.n, self.width))
        index = self.index.to(x.device)
        return x.index_select(0, index).unflatten(0, (self.n, self.width))

    def put(self, dst: Tensor, src: Tensor, dim: int = 0, add: bool = False) -> None:
        """Write (or ``add``) the real tokens of ``src`` (padded batch flattened along ``dim``)
        into ``dst``."""
        if self.start is not None:
            target = dst.narrow(dim, self.start, self.n * self.width)
            target.add_(src) if add else target.copy_(src)
            return
        keep = self.valid.to(dst.device)
        index, values = self.index.to(dst.device)[keep], src[(slice(None),) * dim + (keep,)]
        dst.index_add_(dim, index, values.to(dst.dtype)) if add else dst.index_copy_(dim, index, values)


@dataclass(frozen=True)
class _Bucket:
    """Sequences batched into one padded kernel call (see Note [CPU varlen])."""

    q: _Side
    k: _Side
    lens_q: Tensor  # int64 [n]
    lens_k: Tensor

    def mask(self, window: Window, dtype: torch.dtype, device: torch.device) -> tuple[bool, Tensor | None, Tensor | None]:
        """``(is_causal, additive mask, rows without keys)`` for the padded batch.

        ``is_causal`` (top-left) only when every sequence is square and the window is plain
        causal; padded keys and windows otherwise go into a ``[n, 1, Mq, Mk]`` (or key-only
        ``[n, 1, 1, Mk]``) mask. ``rows without keys`` is bool ``[n, Mq]`` or None.
        """
        square = bool((self.lens_q == self.lens_k).all())
        if window == (-1, 0) and square:
            return True, None, None  # a real query row never reaches a padded key
        key_ok = self.k.valid.view(self.k.n, 1, self.k.width)  # [n, 1, Mk]
        if window == (-1, -1):
            if bool(self.k.valid.all()):
                return False, None, None
            hidden = ~key_ok.view(self.k.n, 1, 1, self.k.width)
            return False, torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf")).to(device), None
        left, right = window
        i = torch.arange(self.q.width)[None, :, None] + (self.lens_k - self.lens_q)[:, None, None]
        j = torch.arange(self.k.width)[None, None, :]
        ok = key_ok & (self.q.valid.view(self.q.n, self.q.width, 1))
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        no_key = ~ok.any(-1)  # [n, Mq]
        mask = torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, float("-inf"))
        return False, mask[:, None].to(device), no_key.to(device)


@dataclass(frozen=True)
class _Plan:
    direct: list[tuple[int, int, int, int]]  # (start_q, len_q, start_k, len_k)
    buckets: list[_Bucket]

    def covers_all(self, total_q: int, total_k: int) -> bool:
        """Whether one direct kernel call on the whole buffers is the result."""
        return not self.buckets and self.direct == [(0, total_q, 0, total_k)]


def _bucket_ids(lens: Tensor) -> Tensor:
    """Bucket index of each length: exact up to _EXACT_UP_TO, then geometric."""
    geo = _EXACT_UP_TO + torch.ceil(
        torch.log(lens.double().clamp(min=1) / _EXACT_UP_TO) / math.log(_BUCKET_RATIO) - 1e-9
    ).long()
    return torch.where(lens <= _EXACT_UP_TO, lens, geo)


def _plan_for(packing: Packing, q: Tensor) -> _Plan:
    """The plan of a varlen call on ``q`` ``[total_q, H, D]``: work counted with q's ``H * D``
    elements per token (Note [CPU varlen])."""
    return _plan(*packing.host_lens(), q.shape[1] * q.shape[2])


def _plan(lens_q: list[int], lens_k: list[int], row_elements: int) -> _Plan:
    """Split the sequences into direct calls and padded buckets (host-side index maths)."""
    lq = torch.tensor(lens_q, dtype=torch.int64)
    lk = torch.tensor(lens_k, dtype=torch.int64)
    start_q = torch.cumsum(lq, 0) - lq
    start_k = torch.cumsum(lk, 0) - lk
    active = (lq > 0) & (lk > 0)
    direct_mask = active & (lq * lk * row_elements >= _DIRECT_MIN_WORK)
    small = torch.nonzero(active & ~direct_mask).flatten()
    direct_ids = torch.nonzero(direct_mask).flatten().tolist()
    buckets: list[_Bucket] = []
    if small.numel():
        key = _bucket_ids(lq[small]) * (1 << 32) + _bucket_ids(lk[small])
        _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
        members = small[torch.argsort(inverse, stable=True)].split(counts.tolist())
        for sel in members:
            if sel.numel() == 1:
                direct_ids.append(int(sel))
                continue
            buckets.append(
                _Bucket(_Side.build(start_q[sel], lq[sel]), _Side.build(start_k[sel], lk[sel]), lq[sel], lk[sel])
            )
    direct = [
        (int(start_q[i]), lens_q[i], int(start_k[i]), lens_k[i]) for i in sorted(direct_ids)
    ]
    return _Plan(direct=direct, buckets=buckets)


def _effective_window(sq: int, sk: int, window: Window) -> Window:
    """``window`` with sides that cut no row of a ``sq x sk`` block made ``-1``."""
    left, right = window
    if left >= sk - 1:  # the last row's lower bound sk - 1 - left is <= 0
        left = -1
    if right >= sq - 1:  # the first row's upper bound sk - sq + right is >= sk - 1
        right = -1
    return left, right


def _one_call(sq: int, sk: int, window: Window, alibi: Alibi | None = None) -> bool:
    """Whether a ``sq x sk`` block with the effective ``window`` is one plain kernel call (full, or
    causal on a square block); otherwise it runs in tiles (Note [CPU windows])."""
    return alibi is None and (window == (-1, -1) or (window == (-1, 0) and sq == sk))


def _band_tiles(sq: int, sk: int, window: Window, heads: int = 1):
    """``(rows, cols, mask rows/keys bool)`` per tile of rows that see a key (Note [CPU windows]);
    ``heads``: the additive mask has one plane per head (ALiBi), so tiles are that much smaller."""
    lower, upper = row_key_bounds(sq, sk, window)
    live = torch.nonzero(lower <= upper).flatten()
    if live.numel() == 0:
        return
    first, last = int(live[0]), int(live[-1]) + 1  # bounds are monotone: live rows are a range
    width = int((upper[first:last] - lower[first:last]).max()) + 1
    # A tile of T rows computes T x (T + width) scores for T x width attended ones: T near a
    # quarter of the band keeps 80% of the work useful, within the mask budget.
    rows = max(64, min(width // 4, _MASK_ELEMENTS // (width * heads)))
    if heads > 1:  # ALiBi on a block without a window: tiles only bound the bias's memory
        rows = max(16, min(last - first, _MASK_ELEMENTS // (width * heads)))
    for i0 in range(first, last, rows):
        i1 = min(last, i0 + rows)
        j0, j1 = int(lower[i0]), int(upper[i1 - 1]) + 1
        cols = torch.arange(j0, j1)
        ok = (cols[None, :] >= lower[i0:i1, None]) & (cols[None, :] <= upper[i0:i1, None])
        yield slice(i0, i1), slice(j0, j1), ok


def _additive(
    ok: Tensor, dtype: torch.dtype, device: torch.device, alibi: Alibi | None = None,
    rows: slice | None = None, cols: slice | None = None,
) -> Tensor:
    """The kernel's additive mask: ``-inf`` outside ``ok`` (``[1, 1, rows, keys]``), plus the ALiBi
    bias of those rows and keys when given (``[1, H, rows, keys]``, Note [ALiBi blocks])."""
    if alibi is None:
        return torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, float("-inf")).to(device)[None, None]
    return alibi_bias(alibi, rows, cols, dtype, device).masked_fill_(~ok.to(device), float("-inf"))


def _blocks_backward_into(
    grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, scale: float, blocks,
) -> None:
    """Add the gradients of kernel calls on blocks of a ``[B, S, H, d]`` call into ``grads = (dq,
    dk, dv)`` (any dtype the results add into), one call at a time. ``blocks`` yields ``(rows,
    cols, causal, additive mask or None)``, each mask made as it is reached; ``lse`` as the
    kernel reads it."""
    dq, dk, dv = grads
    with torch.no_grad():  # in-place sums into views; the kernels are not differentiable anyway
        for rows, cols, causal, mask in blocks:
            g_q, g_k, g_v = _kernel_backward(
                dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[..., rows].contiguous(),
                causal, scale, mask,
            )
            dq[:, rows] += g_q
            dk[:, cols] += g_k
            dv[:, cols] += g_v
            del g_q, g_k, g_v, mask


def _band_backward_into(
    grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, scale: float, window: Window, alibi: Alibi | None,
) -> None:
    """Add a tiled block's gradients (Note [CPU windows]) into ``grads = (dq, dk, dv)``
    (``[B, S, H, d]``, any dtype the results add into) tile by tile; ``window`` already
    effective, ``lse`` as the kernel reads it. No block-sized buffer of its own: a segment of a
    varlen call adds straight into the call's gradients (Note [CPU varlen])."""
    tiles = _band_tiles(q.shape[1], k.shape[1], window, q.shape[2] if alibi is not None else 1)
    blocks = ((rows, cols, False, _additive(ok, q.dtype, q.device, alibi, rows, cols)) for rows, cols, ok in tiles)
    _blocks_backward_into(grads, dout, q, k, v, out, lse, scale, blocks)


def _causal_halves_backward_into(
    grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, scale: float,
) -> None:
    """Add a causal square block's gradients into ``grads = (dq, dk, dv)`` (``[B, S, H, d]``) in
    three calls on its halves (Note [CPU varlen]): rows ``[0, h)`` on keys ``[0, h)`` causal, rows
    ``[h, S)`` on keys ``[0, h)`` in full and on ``[h, S)`` causal; ``lse`` as the kernel reads it."""
    h = q.shape[1] // 2
    low, high = slice(0, h), slice(h, q.shape[1])
    blocks = ((rows, cols, causal, None) for rows, cols, causal in ((low, low, True), (high, low, False),
                                                                     (high, high, True)))
    _blocks_backward_into(grads, dout, q, k, v, out, lse, scale, blocks)


class CpuFlashBackend(KernelBackend):
    """PyTorch's CPU flash-attention kernel; float32/float64/bfloat16/float16; windows by masks."""

    name = "cpu"
    host_lengths = True  # the plan (Note [CPU varlen]) is host index maths
    backward_expands_kv_heads = False  # PyTorch's CPU kernel adds each query head into its K/V head

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, *, window: bool = False, softcap: bool = False,
        alibi: bool = False,
    ) -> str | None:
        """``None`` if this backend runs on ``device``/``dtype``, else why not."""
        if device.type != "cpu":
            return f"it runs on CPU only, not {device.type}"
        if dtype not in _DTYPES:
            return f"the CPU kernel supports {[str(d) for d in _DTYPES]}, not {dtype}"
        if softcap:
            return "the CPU flash kernel has no softcap; use backend='reference' (what 'auto' picks)"
        return None

    def kernel_forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: Window, softcap: float,
        alibi: Alibi | None = None,
    ) -> tuple[Tensor, Tensor]:
        sq, sk = q.shape[1], k.shape[1]
        window = _effective_window(sq, sk, window)
        if _one_call(sq, sk, window, alibi):
            return _kernel_forward(q, k, v, window == (-1, 0), scale)
        b, _, h, _ = q.shape
        out, lse = empty_forward(q, (b, h, sq), v.shape[-1])
        for rows, cols, ok in _band_tiles(sq, sk, window, h if alibi is not None else 1):
            o, l = _kernel_forward(
                q[:, rows], k[:, cols], v[:, cols], False, scale, _additive(ok, q.dtype, q.device, alibi, rows, cols)
            )
            out[:, rows] = o
            lse[..., rows] = l
        return out, lse

    def kernel_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        scale: float, window: Window, softcap: float, alibi: Alibi | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        sq, sk = q.shape[1], k.shape[1]
        window = _effective_window(sq, sk, window)
        lse = lse_for_backward(lse, lse_dtype(q.dtype))
        if _one_call(sq, sk, window, alibi):
            return _kernel_backward(dout, q, k, v, out, lse, window == (-1, 0), scale)
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        _band_backward_into(grads, dout, q, k, v, out, lse, scale, window, alibi)
        return grads

    def kernel_varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, *, scale: float, window: Window,
        softcap: float,
    ) -> tuple[Tensor, Tensor]:
        """See Note [CPU varlen]."""
        total_q, h, _ = q.shape
        plan = _plan_for(packing, q)
        if plan.covers_all(total_q, k.shape[0]):  # one call, no copy into a packed buffer
            o, l = self.kernel_forward(q[None], k[None], v[None], scale=scale, window=window, softcap=softcap)
            return o[0], l[0]
        out, lse = empty_forward(q, (h, total_q), v.shape[-1])
        for s_q, l_q, s_k, l_k in plan.direct:
            o, l = self.kernel_forward(
                q[None, s_q:s_q + l_q], k[None, s_k:s_k + l_k], v[None, s_k:s_k + l_k],
                scale=scale, window=window, softcap=softcap,
            )
            out[s_q:s_q + l_q] = o[0]
            lse[:, s_q:s_q + l_q] = l[0]
        for bucket in plan.buckets:
            causal, mask, no_key = bucket.mask(window, q.dtype, q.device)
            o, l = _kernel_forward(
                bucket.q.take(q), bucket.k.take(k), bucket.k.take(v), causal, scale, mask
            )
            if no_key is not None:  # the kernel reports lse = 0 for fully masked rows
                o = o.masked_fill(no_key[:, :, None, None], 0.0)
                l = l.masked_fill(no_key[:, None, :], float("-inf"))
            bucket.q.put(out, o.flatten(0, 1))
            bucket.q.put(lse, l.transpose(0, 1).flatten(1, 2), dim=1)
        return out, lse

    def kernel_varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """See Note [CPU varlen]."""
        plan = _plan_for(packing, q)
        if plan.covers_all(q.shape[0], k.shape[0]):  # one call, no copy into packed buffers
            grads = self.kernel_backward(
                dout[None], q[None], k[None], v[None], out[None], lse[None], scale=scale,
                window=window, softcap=softcap,
            )
            return tuple(g[0] for g in grads)
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        self._varlen_backward(plan, grads, dout, q, k, v, out, lse, scale, window, accumulate=False)
        return grads

    def kernel_varlen_backward_into(
        self, grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
        out: Tensor, lse: Tensor, packing: Packing, *, scale: float, window: Window, softcap: float,
    ) -> None:
        """Adds each sequence's (or bucket's) gradients into ``grads`` as it goes."""
        plan = _plan_for(packing, q)
        self._varlen_backward(plan, grads, dout, q, k, v, out, lse, scale, window, accumulate=True)

    def _varlen_backward(
        self, plan: _Plan, grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, k: Tensor,
        v: Tensor, out: Tensor, lse: Tensor, scale: float, window: Window, accumulate: bool,
    ) -> None:
        dq, dk, dv = grads
        for s_q, l_q, s_k, l_k in plan.direct:
            sl_q, sl_k = slice(s_q, s_q + l_q), slice(s_k, s_k + l_k)
            band = _effective_window(l_q, l_k, window)
            one_call = _one_call(l_q, l_k, band)
            if not one_call or (band == (-1, 0) and l_q >= _SPLIT_CAUSAL_FROM):  # causal one call: l_q == l_k
                # In blocks (band tiles, or causal halves) that add into the call's gradients
                # (zeros unless accumulating).
                views = (
                    (dq[None, sl_q], dk[None, sl_k], dv[None, sl_k]), dout[None, sl_q], q[None, sl_q],
                    k[None, sl_k], v[None, sl_k], out[None, sl_q],
                    lse_for_backward(lse[None, :, sl_q], lse_dtype(q.dtype)), scale,
                )
                if one_call:
                    _causal_halves_backward_into(*views)
                else:
                    _band_backward_into(*views, band, None)
                continue
            g_q, g_k, g_v = self.kernel_backward(
                dout[None, sl_q], q[None, sl_q], k[None, sl_k], v[None, sl_k],
                out[None, sl_q], lse[None, :, sl_q], scale=scale, window=window, softcap=0.0,
            )
            if accumulate:
                dq[sl_q] += g_q[0]
                dk[sl_k] += g_k[0]
                dv[sl_k] += g_v[0]
            else:
                dq[sl_q] = g_q[0]
                dk[sl_k] = g_k[0]
                dv[sl_k] = g_v[0]
            del g_q, g_k, g_v
        if not plan.buckets:
            return
        lse = lse_for_backward(lse, lse_dtype(q.dtype))  # [H, Tq]
        for bucket in plan.buckets:
            n, width = bucket.q.n, bucket.q.width
            lse_b = bucket.q.take(lse.t()).permute(0, 2, 1)  # [n, H, M]
            if bucket.q.start is None:  # padded query rows: +inf, they contribute nothing
                hidden = ~bucket.q.valid.to(q.device).view(n, 1, width)
                lse_b = lse_b.masked_fill(hidden, float("inf"))
            causal, mask, _ = bucket.mask(window, q.dtype, q.device)
            g_q, g_k, g_v = _kernel_backward(
                bucket.q.take(dout), bucket.q.take(q), bucket.k.take(k), bucket.k.take(v),
                bucket.q.take(out), lse_b.contiguous(), causal, scale, mask,
            )
            bucket.q.put(dq, g_q.flatten(0, 1), add=accumulate)
            bucket.k.put(dk, g_k.flatten(0, 1), add=accumulate)
            bucket.k.put(dv, g_v.flatten(0, 1), add=accumulate)
