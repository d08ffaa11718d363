"""Prefill into a token-sharded KV cache and decode over it (``docs/inference.md``).

Note [Decoding over shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`prefill` runs the prompt exactly as training does (``seqpar.attention`` on shards) and
keeps each rank's own K/V rows (Note [Sharded KV cache] in ``seqpar.inference.cache``).

:func:`decode` takes a block of ``T >= 1`` new tokens whose q, k, v are the same on every CP
rank (the model runs the new tokens on every rank): the block's K/V rows are appended first, each
kept by one rank, then every rank attends all ``T`` queries over its own rows, with the mask on
global positions (``Mask.allows``, Note [Masks]: the block sees the cache and itself causally),
giving a partial ``(out, lse)``. One all-gather over the CP group of ``out`` and ``lse`` (fp32,
``B * T * H * (Dv + 1)`` values per rank: independent of the cache length) and a merge in
``cp_rank`` order (Note [LSE merge]) give the exact result, bit for bit the same on every rank;
sink logits join the denominators once, after the merge (Note [Attention sinks]). Rows that no
future query can see are dropped after the block (windows and chunks).

The local part is plain matrix maths in fp32 (fp64 for fp64 inputs), query heads grouped over
their K/V head (GQA without copies), over the keys a window can reach only (rows are sorted by
position), in query tiles that bound the score matrix. It is what a decode step is: memory bound
on reading the rows; a block of many tokens (chunked prefill) is split in tiles of queries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import check_alibi_slopes, check_mask_options
from ..comm import all_gather, exchange_ints
from ..parallel.merge import accumulator_dtype, add_sinks, merge_
from ..placement import Mask, Placement
from .cache import KVCache, keep_from

__all__ = ["attend_rows", "decode", "prefill"]

_SCORES_PER_TILE = 1 << 24  # score entries per query tile of the local attention


def _mask(causal: object, window: object, chunk_size: object, softcap: object, where: str) -> Mask:
    """The cache's mask, with the options checked as ``seqpar.attention`` checks them
    (``seqpar.checks.check_mask_options``); a KV cache serves causal attention only."""
    if causal is False:
        raise NotImplementedError(
            f"{where}: causal=False; a KV cache serves causal attention only (a new token would change "
            "the outputs of every earlier one under a bidirectional mask); use seqpar.attention"
        )
    causal, window, chunk_size, _ = check_mask_options(causal, window, chunk_size, softcap, where)
    return Mask(causal, window, chunk_size)




def _check_block(q: Tensor, k: Tensor, v: Tensor, where: str) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{where}: q, k, v must be (batch, tokens, heads, headdim); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, t, h, d = q.shape
    if k.shape[:2] != (b, t) or v.shape[:3] != k.shape[:3] or k.shape[-1] != d:
        raise ValueError(
            f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree: k must be "
            f"({b}, {t}, Hkv, {d}) and v ({b}, {t}, Hkv, Dv)"
        )
    if k.shape[2] == 0 or h % k.shape[2]:
        raise ValueError(
            f"{where}: {h} query heads are not a multiple of the {k.shape[2]} K/V heads (GQA needs H % Hkv == 0)"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"{where}: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def attend_rows(
    q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor, mask: Mask, *, scale: float, softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of queries over a set of K/V rows, masked on global positions; no communication.

    Args:
        q: ``(batch, T, nheads, headdim)``.
        q_pos: int64 ``(T,)`` global positions of the queries.
        k: ``(batch, rows, nheads_kv, headdim)``; ``nheads % nheads_kv == 0``.
        v: ``(batch, rows, nheads_kv, headdim_v)``.
        k_pos: int64 ``(rows,)`` global positions of the rows, increasing.
        mask: which (query, key) positions attend (Note [Masks]).
        scale: softmax scale.
        softcap: ``c * tanh(s / c)`` of the scaled scores when ``> 0``.
        alibi_slopes: ``(nheads,)``: ``-slope * |q_pos - k_pos|`` added to the (capped) scores.

    Returns:
        ``(out, lse)``: ``(batch, T, nheads, headdim_v)`` and ``(batch, nheads, T)`` in the
        accumulator dtype (fp32, fp64 for fp64 inputs); rows that see no key give ``out = 0`` and
        ``lse = -inf``.
    """
    b, t, h, _ = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    g = h // hkv
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(b, t, h, dv, dtype=acc, device=q.device)
    lse = torch.full((b, h, t), float("-inf"), dtype=acc, device=q.device)
    if t == 0 or k.shape[1] == 0:
        return out, lse
    lo, _ = mask.band
    first = int(q_pos.min()) + lo if lo is not None else None
    if first is not None and mask.chunk_size is None:  # rows are sorted: skip those no query can reach
        begin = int(torch.searchsorted(k_pos, torch.tensor(first, device=k_pos.device)))
        k, v, k_pos = k[:, begin:], v[:, begin:], k_pos[begin:]
    n = k.shape[1]
    if n == 0:
        return out, lse
    kf = k.to(acc).permute(0, 2, 3, 1)  # [B, Hkv, D, n]
    vf = v.to(acc).transpose(1, 2)  # [B, Hkv, n, Dv]
    tile = max(1, _SCORES_PER_TILE // max(1, b * h * n))
    for s in range(0, t, tile):
        e = min(t, s + tile)
        qf = q[:, s:e].to(acc).reshape(b, e - s, hkv, g, -1).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, t, D]
        scores = (qf.reshape(b, hkv, g * (e - s), -1) @ kf).mul_(scale)  # [B, Hkv, G*t, n]
        if softcap > 0:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        scores = scores.view(b, hkv, g, e - s, n)
        if alibi_slopes is not None:
            dist = (q_pos[s:e, None] - k_pos[None, :]).abs().to(acc)  # [t, n]
            scores.sub_(alibi_slopes.to(acc).view(1, hkv, g, 1, 1) * dist)
        allowed = mask.allows(q_pos[s:e], k_pos)  # [t, n]
        scores.masked_fill_(~allowed, float("-inf"))
        tile_lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G, t]
        shift = tile_lse.masked_fill(tile_lse == float("-inf"), 0.0)
        p = torch.exp(scores - shift[..., None])
        tile_out = p.view(b, hkv, g * (e - s), n) @ vf  # [B, Hkv, G*t, Dv]
        out[:, s:e] = tile_out.view(b, hkv, g, e - s, dv).permute(0, 3, 1, 2, 4).reshape(b, e - s, h, dv)
        lse[:, :, s:e] = tile_lse.reshape(b, h, e - s)
    return out, lse


def _merge_over_group(out: Tensor, lse: Tensor, state, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """Exact merge of every CP rank's partial ``(out, lse)``, in ``cp_rank`` order (the same bits on
    every rank); sinks added once."""
    if state.cp_size > 1:
        b, t, h, dv = out.shape
        flat = torch.cat([out.reshape(b, -1), lse.reshape(b, -1)], dim=1)[None]  # [1, B, t*h*(dv+1)]
        parts = all_gather(flat, state.cp_group, 0, [1] * state.cp_size)  # [N, B, ...]
        out_all = parts[..., : t * h * dv].reshape(state.cp_size, b, t, h, dv)
        lse_all = parts[..., t * h * dv:].reshape(state.cp_size, b, h, t)
        out, lse = out_all[0].clone(), lse_all[0].clone()
        for r in range(1, state.cp_size):
            merge_(out, lse, out_all[r], lse_all[r])
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out, lse


def _options(q: Tensor, softmax_scale: float | None, sinks: Tensor | None, where: str) -> float:
    h, d = q.shape[2], q.shape[3]
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != h):
        raise ValueError(f"{where}: sinks must be ({h},), one logit per query head, got {tuple(sinks.shape)}")
    return d ** -0.5 if softmax_scale is None else float(softmax_scale)


def prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KVCache,
    layer: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Exact attention over the prompt's shards (as ``seqpar.attention``), keeping this rank's K/V rows.

    Every CP rank passes its shard (``seqpar.shard``, any prompt length). The first layer's call
    exchanges the shard lengths once (one small all-gather); later layers reuse them.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``.
        k: ``(batch, seqlen_local, nheads_kv, headdim)``.
        v: ``(batch, seqlen_local, nheads_kv, headdim_v)``.
        cache: the :class:`~seqpar.inference.KVCache` (empty for ``layer``).
        layer: the layer index.
        causal, softmax_scale, window, softcap, sinks, chunk_size: as ``seqpar.attention``;
            ``causal`` must be ``True``.
        alibi_slopes: ``(nheads,)`` ALiBi slopes (as ``seqpar.attention``; no gradient).
        backend: the kernel backend of ``seqpar.attention``.

    Returns:
        ``(batch, seqlen_local, nheads, headdim_v)``: this rank's shard of the output.

    Raises:
        ValueError: bad shapes or options, a non-empty layer, shard lengths that are not seqpar's
            placement of their sum.
        NotImplementedError: ``causal=False``.
    """
    where = "seqpar.inference.prefill"
    mask = _mask(causal, window, chunk_size, softcap, where)
    state = cache.state
    rows = cache.layer(layer)
    if rows.length:
        raise ValueError(
            f"{where}: layer {layer} already holds {rows.length} tokens; a prefill fills an empty cache, "
            "later tokens go through seqpar.inference.decode"
        )
    placement = cache.prefill_placement
    n = q.shape[1]
    if placement is None:
        lengths = [row[0] for row in exchange_ints([n], state.cp_group, q.device)]
        placement = Placement.dense(sum(lengths), state.ring_size, state.ulysses_size)
        if list(placement.shard_lengths) != lengths:
            raise ValueError(
                f"{where}: the CP ranks hold {lengths} tokens, not seqpar's placement of their {sum(lengths)} "
                f"tokens ({list(placement.shard_lengths)}); shard the prompt with seqpar.shard(x, state)"
            )
        cache.prefill_placement = placement
    elif placement.shard_lengths[state.cp_rank] != n:
        raise ValueError(
            f"{where}: layer {layer} got {n} tokens on cp rank {state.cp_rank}, but the prefill of the first "
            f"layer placed {placement.shard_lengths[state.cp_rank]} of {placement.total} here"
        )
    from ..attention import attention

    out = attention(
        q, k, v, state, causal=True, softmax_scale=softmax_scale, window=mask.window, softcap=softcap,
        sinks=sinks, chunk_size=chunk_size, backend=backend, seq_len=placement.total, alibi_slopes=alibi_slopes,
    )
    rows.store_prefill(k, v, placement.global_index(state.cp_rank), placement)
    rows.drop_before(keep_from(mask.normalised(placement.total), placement.total - 1))  # same on every rank
    return out


def decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KVCache,
    layer: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Attention of ``T`` new tokens over the sharded cache and, causally, over themselves
    (Note [Decoding over shards]); the tokens' K/V rows join the cache.

    Every CP rank passes the same q, k, v (the new tokens, at the positions that follow the
    cache: ``cache.layer(layer).length`` onwards). ``T = 1`` is a decode step, a larger block a
    chunked prefill or the next turn of a conversation; an empty cache is fine.

    Args:
        q: ``(batch, T, nheads, headdim)``, the same on every CP rank.
        k: ``(batch, T, nheads_kv, headdim)``.
        v: ``(batch, T, nheads_kv, headdim_v)``.
        cache: the :class:`~seqpar.inference.KVCache`.
        layer: the layer index.
        causal, softmax_scale, window, softcap, sinks, chunk_size: as ``seqpar.attention``;
            ``causal`` must be ``True``.
        alibi_slopes: ``(nheads,)`` ALiBi slopes on global positions (as ``seqpar.attention``).

    Returns:
        ``(batch, T, nheads, headdim_v)`` in q's dtype, the same on every CP rank.

    Raises:
        ValueError: bad shapes or options; rows that do not match the cached ones.
        NotImplementedError: ``causal=False``.
    """
    where = "seqpar.inference.decode"
    mask = _mask(causal, window, chunk_size, softcap, where)
    _check_block(q, k, v, where)
    scale = _options(q, softmax_scale, sinks, where)
    slopes = check_alibi_slopes(alibi_slopes, q.shape[2], q, where)
    rows = cache.layer(layer)
    first = rows.length
    rows.append(k, v)
    t = q.shape[1]
    q_pos = torch.arange(first, first + t, device=q.device)
    if rows.keys is None:
        out, lse = attend_rows(q, q_pos, k[:, :0], v[:, :0], q_pos[:0], mask, scale=scale, softcap=softcap)
    else:
        out, lse = attend_rows(
            q, q_pos, rows.keys, rows.values, rows.positions, mask, scale=scale, softcap=softcap, alibi_slopes=slopes
        )
    out, _ = _merge_over_group(out, lse, cache.state, sinks)
    rows.drop_before(keep_from(mask.normalised(first + t), first + t - 1))
    return out.to(q.dtype)
