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

Note [Decode agreement]
~~~~~~~~~~~~~~~~~~~~~~~
Every rank computes a partial result with *its own* arguments and the merge trusts that they are
the same everywhere: a rank with another window, softcap, scale or sinks returns, merged on every
rank, attention under no mask at all; another number of new tokens sends the merge's all-gather
messages of other sizes (gloo aborts that process, the others wait). So before the cache changes
or any rank attends, :func:`decode` and :func:`prefill` exchange one row of ints over the CP group
-- the tensors' shapes and dtypes, the layer and the cache's length, every option (causal, window,
chunk size, the bits of the scale and softcap, a hash of the sink logits' and ALiBi slopes'
values) and whether this rank's own checks failed -- and every rank reads the same rows: ranks that
differ raise the same ``ValueError`` everywhere, naming the first differing rank and the values;
a rank whose own check failed raises its error and the others say which rank refused. A prefill
adds its shard length, checked against the first layer's placement. When the exchange runs
follows ``state.checks`` as in Note [Global length] (``seqpar/prepare.py``): on the CPU and with
``checks="always"``; on an accelerator with ``"auto"`` a decode step adds no collective and no host
synchronisation and only this rank's own checks run (the first layer's prefill exchanges its
lengths anyway, with the row). The q, k, v *values* are not compared: they come out of each rank's
own model run, whose last bits may differ without being wrong.
"""

from __future__ import annotations

import hashlib
import numbers
import struct

import torch
from torch import Tensor

from ..checks import check_alibi_slopes, check_mask_options, check_scale
from ..comm import exchange_ints
from ..parallel.merge import accumulator_dtype, add_sinks, merge_over_group
from ..placement import Mask, Placement
from ..prepare import collective_checks
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
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


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_UNSET = -2  # a field whose value this rank could not read as ints (its own check says why)
_OK, _REFUSED = 0, 1


def _shape(x: object, seq_dim: int | None = None) -> list[int]:
    """``[ndim, d0, d1, d2, d3]`` of a tensor (``-1`` for missing dims and for ``seq_dim``)."""
    if not isinstance(x, Tensor):
        return [_UNSET] * 5
    dims = [-1 if i == seq_dim else n for i, n in enumerate(x.shape[:4])]
    return [x.dim(), *dims, *([-1] * (4 - len(dims)))]


def _dtype(x: object) -> int:
    return _DTYPES.index(x.dtype) + 1 if isinstance(x, Tensor) and x.dtype in _DTYPES else _UNSET


def _int(x: object) -> int:
    return int(x) if isinstance(x, numbers.Integral) else _UNSET


def _real_bits(x: object) -> int:
    """The bits of a float option (so -0.0, NaN and every rounding count as different values)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return _UNSET
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _values_hash(x: object) -> int:
    """A 62-bit hash of a small tensor's values (sinks, ALiBi slopes); ``-1`` for ``None``. Exact
    bits, not a sum: parameters are the same bits on every rank or are different parameters."""
    if x is None:
        return -1
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        return _UNSET
    data = x.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def _option_fields(
    q: object, causal: object, window: object, chunk_size: object, softmax_scale: object, softcap: object,
    sinks: object, alibi_slopes: object,
) -> list[tuple[str, str, list[int]]]:
    """``(name, kind, ints)`` of the options every CP rank must share (Note [Decode agreement])."""
    if softmax_scale is None and isinstance(q, Tensor) and q.dim() == 4 and q.shape[-1] > 0:
        softmax_scale = q.shape[-1] ** -0.5  # the default: a rank passing it explicitly agrees
    ok_window = isinstance(window, (tuple, list)) and len(window) == 2
    return [
        ("causal", "bool", [int(causal) if isinstance(causal, bool) else _UNSET]),
        ("window", "tuple", [_int(w) for w in window] if ok_window else [_UNSET, _UNSET]),
        ("chunk_size", "optional", [-1 if chunk_size is None else _int(chunk_size)]),
        ("softmax_scale", "float", [_real_bits(softmax_scale)]),
        ("softcap", "float", [_real_bits(softcap)]),
        ("sinks", "hash", [_values_hash(sinks)]),
        ("alibi_slopes", "hash", [_values_hash(alibi_slopes)]),
    ]


def _tensor_fields(q: object, k: object, v: object, seq_dim: int | None = None) -> list[tuple[str, str, list[int]]]:
    return [
        *((f"{n} shape", "shape", _shape(t, seq_dim)) for n, t in (("q", q), ("k", k), ("v", v))),
        ("dtypes (q, k, v)", "dtypes", [_dtype(q), _dtype(k), _dtype(v)]),
    ]


def _show(kind: str, ints: list[int]) -> str:
    if any(i == _UNSET for i in ints):
        return "<invalid>"
    if kind == "shape":
        ndim, dims = ints[0], ints[1:]
        return "(" + ", ".join("S_local" if d == -1 and i < ndim else str(d) for i, d in enumerate(dims[:ndim])) + (
            ", ..." if ndim > 4 else "") + ")"
    if kind == "dtypes":
        return "(" + ", ".join(str(_DTYPES[i - 1]).replace("torch.", "") for i in ints) + ")"
    if kind == "float":
        return repr(struct.unpack("<d", struct.pack("<q", ints[0]))[0])
    if kind == "bool":
        return str(bool(ints[0]))
    if kind == "hash":
        return "None" if ints[0] == -1 else f"values hash {ints[0]:#x}"
    if kind == "tuple":
        return str(tuple(ints))
    if kind == "optional":
        return "None" if ints[0] == -1 else str(ints[0])
    return str(ints[0])


def _agree(
    state, device: torch.device, where: str, error: Exception | None, fields: list[tuple[str, str, list[int]]],
    what: str, local: int = 0,
) -> list[int]:
    """Exchange ``[local, verdict, *fields]`` over the CP group (Note [Decode agreement]); raise the
    same ``ValueError`` on every rank when the fields differ, this rank's ``error`` on itself and a
    refusal naming its rank on the others when a rank's own check failed. Returns every rank's
    ``local`` (``cp_rank`` order)."""
    row = [local, _OK if error is None else _REFUSED, *(i for _, _, ints in fields for i in ints)]
    rows = exchange_ints(row, state.cp_group, device)
    first = next((c for c, r in enumerate(rows) if r[2:] != rows[0][2:]), None)
    if first is not None:
        diffs, at = [], 2
        for name, kind, ints in fields:
            mine, theirs = rows[0][at:at + len(ints)], rows[first][at:at + len(ints)]
            if mine != theirs:
                diffs.append(f"{name} {_show(kind, mine)} on cp rank 0 but {_show(kind, theirs)} on cp rank {first}")
            at += len(ints)
        raise ValueError(
            f"{where}: the CP ranks disagree on the call: {'; '.join(diffs)}; {what} (raised on every CP rank)"
        )
    if error is not None:
        raise error
    refused = [c for c, r in enumerate(rows) if r[1] != _OK]
    if refused:
        raise ValueError(
            f"{where}: cp rank {refused[0]} refused this call (its own error says why); every rank raises so "
            "that none waits for it"
        )
    return [r[0] for r in rows]


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


def _options(q: Tensor, softmax_scale: float | None, sinks: Tensor | None, where: str) -> float:
    h, d = q.shape[2], q.shape[3]
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.shape[0] != h):
        got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"{where}: sinks must be ({h},), one logit per query head, got {got}")
    check_scale(softmax_scale, where)
    return d ** -0.5 if softmax_scale is None else float(softmax_scale)


def _cache_state(cache: object, where: str):
    """The CP state of ``cache`` (raised here only: without a cache there is no group to tell)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"{where}: cache must be a seqpar.inference.KVCache, got {type(cache).__name__}")
    return cache.state


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
    exchanges the shard lengths once (one small all-gather, which also checks that the ranks
    agree: Note [Decode agreement]); later layers reuse them and check as ``seqpar.attention``
    does (``state.checks``).

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
            placement of their sum (or, after the first layer, not the first layer's); CP ranks
            that disagree on shapes (but the shard length), dtypes, options, the layer or the
            cache's state, raised on every CP rank (Note [Decode agreement]).
        NotImplementedError: ``causal=False`` (on every CP rank when all pass it).
    """
    where = "seqpar.inference.prefill"
    state = _cache_state(cache, where)
    device = q.device if isinstance(q, Tensor) else torch.device("cpu")
    placement = cache.prefill_placement
    error, rows = None, None
    try:  # this rank's own checks; their verdict joins the exchange (Note [Decode agreement])
        rows = cache.layer(layer)
        mask = _mask(causal, window, chunk_size, softcap, where)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(
                    f"{where}: {name} must be a (batch, seqlen_local, heads, headdim) tensor, got "
                    f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
                )
        if rows.length:
            raise ValueError(
                f"{where}: layer {layer} already holds {rows.length} tokens; a prefill fills an empty cache, "
                "later tokens go through seqpar.inference.decode"
            )
    except (ValueError, NotImplementedError) as e:
        error = e
    n = q.shape[1] if error is None else _UNSET
    lengths = None
    # The first layer exchanges the shard lengths anyway; the row carries the agreement check.
    if state.cp_size > 1 and (placement is None or collective_checks(state, device, lengths_known=True)):
        fields = [
            *_tensor_fields(q, k, v, seq_dim=1),
            *_option_fields(q, causal, window, chunk_size, softmax_scale, softcap, sinks, alibi_slopes),
            ("layer", "int", [_int(layer)]),
            ("tokens already in the layer", "int", [_UNSET if rows is None else rows.length]),
            ("prompt placed by an earlier layer", "bool", [int(placement is not None)]),
        ]
        what = (
            "every CP rank passes its shard of the same prompt (one batch, heads, head dims and dtype) with the "
            "same layer and options, into a cache filled by the same calls"
        )
        lengths = _agree(state, device, where, error, fields, what, local=n)
    elif error is not None:
        raise error
    if placement is None:
        lengths = lengths or [n]
        placement = Placement.dense(sum(lengths), state.ring_size, state.ulysses_size)
        if list(placement.shard_lengths) != lengths:
            raise ValueError(
                f"{where}: the CP ranks hold {lengths} tokens, not seqpar's placement of their {sum(lengths)} "
                f"tokens ({list(placement.shard_lengths)}); shard the prompt with seqpar.shard(x, state)"
            )
        cache.prefill_placement = placement
    else:
        want = list(placement.shard_lengths)
        got = lengths or [n if c == state.cp_rank else w for c, w in enumerate(want)]  # only this rank's, unchecked
        bad = next((c for c, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if bad is not None:
            raise ValueError(
                f"{where}: layer {layer} got {got[bad]} tokens on cp rank {bad}, but the prefill of the first "
                f"layer placed {want[bad]} of {placement.total} there (tokens per cp rank: {want}); every layer "
                "prefills the same prompt's shards"
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
        ValueError: bad shapes or options; rows that do not match the cached ones; CP ranks that
            disagree on the shapes (the number of new tokens ``T`` too), dtypes, options (causal,
            window, chunk size, scale, softcap, sink and slope values), the layer or the cache's
            length: raised on every CP rank before the cache changes, where the call checks
            collectively (Note [Decode agreement]; on the CPU or with ``checks="always"``).
        NotImplementedError: ``causal=False`` (on every CP rank when all pass it).
    """
    where = "seqpar.inference.decode"
    state = _cache_state(cache, where)
    device = q.device if isinstance(q, Tensor) else torch.device("cpu")
    error, rows = None, None
    try:  # this rank's own checks; their verdict joins the exchange (Note [Decode agreement])
        rows = cache.layer(layer)
        mask = _mask(causal, window, chunk_size, softcap, where)
        _check_block(q, k, v, where)
        scale = _options(q, softmax_scale, sinks, where)
        slopes = check_alibi_slopes(alibi_slopes, q.shape[2], q, where)
        rows.check_rows(k, v)
    except (ValueError, NotImplementedError) as e:
        error = e
    if collective_checks(state, device, lengths_known=True):  # before the cache changes
        fields = [
            *_tensor_fields(q, k, v),
            *_option_fields(q, causal, window, chunk_size, softmax_scale, softcap, sinks, alibi_slopes),
            ("layer", "int", [_int(layer)]),
            ("cache length", "int", [_UNSET if rows is None else rows.length]),
            ("first position kept", "int", [_UNSET if rows is None else rows.start]),
        ]
        what = (
            "every CP rank passes the same new tokens (q, k, v shapes and dtypes), layer and options, to a "
            "cache filled by the same calls"
        )
        _agree(state, device, where, error, fields, what)
    elif error is not None:
        raise error
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
    if cache.state.cp_size > 1:
        out, lse = merge_over_group(out, lse, cache.state.cp_group)
    if sinks is not None:
        out, _ = add_sinks(out, lse, sinks)
    rows.drop_before(keep_from(mask.normalised(first + t), first + t - 1))
    return out.to(q.dtype)
