"""``torch.compile`` support: seqpar's attention calls as custom operators.

Note [torch.compile]
~~~~~~~~~~~~~~~~~~~~
Dynamo cannot trace a seqpar call: it exchanges lengths with a collective whose result decides
Python control flow, posts point-to-point transfers (refused by dynamo: "P2P compilation is
disabled") and keeps host-side plans. So while compiling (``torch.compiler.is_compiling()``),
``seqpar.attention`` and ``seqpar.varlen_attention`` become one call of the custom operator
``seqpar::attention`` / ``seqpar::varlen_attention``, opaque to the compiler:

- the options are validated before any conversion, by the same ``seqpar.prepare`` function as
  in eager mode (``causal="False"`` or ``window=(2.7, 0)`` raise as they do there);
- the forward operator prepares the call as eager code does (``seqpar.prepare``: validation, the
  collective checks of Note [Global length]) and runs the one composition,
  ``seqpar.parallel.hybrid.hybrid_forward`` (Note [Hybrid composition]); it returns, next to the
  output, the residuals of its backward: the log-sum-exp of the ring (and of the replicated
  tokens), the placement it found and, with ``ParallelState(keep_head_shards=True)`` (read
  while tracing, so the graph is specialised on it), the Ulysses head shards, saved instead of
  q, k, v and the output (Note [Ulysses memory]). Their sizes depend on other ranks, so the fake (meta)
  implementation gives them data-dependent sizes; the output has the shape of ``q`` with v's
  head dim ``Dv`` as its last dim (:func:`_out_fake`; ``Dv != D`` for MLA);
- the backward operator, registered as the forward's autograd formula, rebuilds the call from
  those residuals (``seqpar.prepare.build_call``: no check, no collective) and runs
  ``hybrid_backward``. Eager and compiled calls run the same kernels in the same order.

The ``ParallelState`` reaches the operators as its ``handle`` (a string naming it in a registry of
live states in ``seqpar.state``: the compiler keeps a string constant, where an int would become
a symbolic int with several states or ``dynamic=True``); backends travel as their names. The compiled graph is specialised on the handle and
every option: another state, other options or (for packed batches given as a list) other
``seq_lens`` recompile; pass ``seq_lens`` as a tensor to avoid that. Outputs are contiguous in
the caller's layout. Double backward is not supported (as in eager).
"""

from __future__ import annotations

import dataclasses

from typing import Optional

import torch
from torch import Tensor

from .parallel.hybrid import Saved, hybrid_backward, hybrid_forward
from .checks import check_mask_options, check_scale
from .parallel.merge import accumulator_dtype
from .placement import Mask, MaskSlices
from .placement.sizes import check_seq_lens
from .prepare import (
    PreparedCall,
    backend_name,
    build_call,
    check_dense_options,
    prepare_dense,
    prepare_varlen,
    resolve_backend,
    to_bshd,
)
from .state import ParallelState, require_state, state_from_handle

__all__ = ["compiled_attention", "compiled_varlen_attention"]


def _lse_fake(like: Tensor) -> Tensor:
    """A ``[B, ?, ?]`` accumulator-dtype tensor: the ring's LSE, whose head and token counts
    depend on the other ranks."""
    ctx = torch.library.get_ctx()
    return like.new_empty((like.shape[0], ctx.new_dynamic_size(), ctx.new_dynamic_size()),
                          dtype=accumulator_dtype(like.dtype))


def _out_fake(q: Tensor, v: Tensor) -> Tensor:
    """The output of a call on ``q``: q's shape with v's head dim ``Dv`` last (the head dim is
    the last dim in every layout and in packed ``[T, H, D]`` tensors)."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _heads_fake(q: Tensor, k: Tensor, v: Tensor, keep: bool, packed: bool) -> tuple[Tensor, ...]:
    """The Ulysses head shards ``(q_u, k_u, v_u, out_u)`` a forward keeps (``[B, L, heads, D |
    Dv]``, ``B = 1`` when ``packed``, ``L`` and the head counts set by the other ranks), or four
    empty tensors."""
    if not keep:
        return tuple(q.new_empty(0) for _ in range(4))
    ctx = torch.library.get_ctx()
    B = 1 if packed else q.shape[0]
    L, h, hkv = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size()
    D, Dv = q.shape[-1], v.shape[-1]
    return q.new_empty((B, L, h, D)), q.new_empty((B, L, hkv, D)), q.new_empty((B, L, hkv, Dv)), q.new_empty((B, L, h, Dv))


def _keep_heads(call: PreparedCall, keep: bool) -> PreparedCall:
    """``call`` with its Ulysses setup's ``keep_head_shards`` as the compiled graph was traced
    with (``keep``), whatever the state says now."""
    uly = call.setup.ulysses
    if uly is None or uly.keep_head_shards == keep:
        return call
    setup = dataclasses.replace(call.setup, ulysses=dataclasses.replace(uly, keep_head_shards=keep))
    return dataclasses.replace(call, setup=setup)


def _kept(heads: tuple[Tensor, ...], like: Tensor) -> tuple[Tensor, ...]:
    """The head shards as operator outputs (contiguous, like the fake ones), or four empty tensors."""
    return tuple(h.contiguous() for h in heads) if heads else tuple(like.new_empty(0) for _ in range(4))


def _stand_in(like: Tensor, shape: list[int]) -> Tensor:
    """A ``shape`` tensor of ``like``'s dtype and device with no storage of its size (stride 0):
    the shape of an input the forward did not keep, for the backward's rebuilt call."""
    return like.new_empty((1,) * len(shape)).expand(shape)


def _meta(call: PreparedCall) -> Tensor:
    """The placement a forward found: ``[S, has_free, free lengths (cp_size)]`` (int64, CPU)."""
    cp = call.state.cp_size
    free = list(call.free) if call.free is not None else [0] * cp
    return torch.tensor([call.seq_lens[0], int(call.free is not None), *free], dtype=torch.long)


def _slices_arg(slices: MaskSlices | None) -> list[int]:
    """Mask slices as the operators take them: ``[qs, qe, ks, ke, kind]`` per slice, flattened
    (kind 0 full, 1 causal); empty for no slices."""
    if slices is None:
        return []
    return [x for (a, b), (c, d), k in zip(slices.q_ranges, slices.k_ranges, slices.kinds)
            for x in (a, b, c, d, int(k == "causal"))]


def _slices_from(arg: list[int]) -> MaskSlices | None:
    if not arg:
        return None
    rows = [arg[i:i + 5] for i in range(0, len(arg), 5)]
    return MaskSlices([r[:2] for r in rows], [r[2:4] for r in rows], ["causal" if r[4] else "full" for r in rows])


def _rebuild(
    qb: Tensor, kb: Tensor, vb: Tensor, state: ParallelState, seq_lens: tuple[int, ...], free, causal: bool,
    window: list[int], chunk_size: Optional[int], softcap: float, scale: Optional[float], backend: str,
    prefix: int = 0, suffix: int = 0, slices: list[int] | None = None, alibi: Optional[Tensor] = None,
) -> PreparedCall:
    """The call a validated forward prepared, from its options and placement (no check, no collective)."""
    alibi = None if alibi is None else alibi.detach().to(torch.float64 if alibi.dtype == torch.float64 else torch.float32)
    mask = Mask(causal, tuple(window), chunk_size, _slices_from(slices or []), alibi is not None)
    mask = mask.normalised(max(seq_lens, default=0))
    resolved = resolve_backend(backend, qb, mask, softcap, "seqpar.compiled")
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    return build_call(qb, kb, vb, state, seq_lens, free, mask, resolved, scale, softcap, prefix, suffix, alibi)


# --- seqpar::attention -------------------------------------------------------------------------


@torch.library.custom_op("seqpar::attention", mutates_args=())
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], alibi: Optional[Tensor], handle: str, layout: str,
    causal: bool, window: list[int], chunk_size: Optional[int], softcap: float, scale: Optional[float],
    seq_len: Optional[int], backend: str, prefix: int, suffix: int, slices: list[int], keep: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    options = check_dense_options(
        causal=causal, softmax_scale=scale, layout=layout, seq_len=seq_len, window=tuple(window), softcap=softcap,
        chunk_size=chunk_size, replicated_prefix=prefix, replicated_suffix=suffix, mask=_slices_from(slices),
    )
    call = prepare_dense(q, k, v, state_from_handle(handle), options, backend, sinks, alibi_slopes=alibi)
    call = _keep_heads(call, keep)
    out, lse_body, lse_replicated, heads = hybrid_forward(call.setup, call.qb, call.kb, call.vb, sinks)
    return to_bshd(out, layout).contiguous(), lse_body, lse_replicated, _meta(call), *_kept(heads, q)


@_attention_op.register_fake
def _(q, k, v, sinks, alibi, handle, layout, causal, window, chunk_size, softcap, scale, seq_len, backend, prefix, suffix,
      slices, keep):
    B, H = to_bshd(q, layout).shape[0], to_bshd(q, layout).shape[2]
    lse_replicated = q.new_empty((B, H, prefix + suffix), dtype=accumulator_dtype(q.dtype))
    meta = torch.empty(2 + state_from_handle(handle).cp_size, dtype=torch.long, device="cpu")
    return _out_fake(q, v), _lse_fake(q), lse_replicated, meta, *_heads_fake(q, k, v, keep, False)


@torch.library.custom_op("seqpar::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor], sinks: Optional[Tensor],
    alibi: Optional[Tensor], out: Optional[Tensor], lse_body: Tensor, lse_replicated: Tensor, meta: Tensor,
    heads: list[Tensor], shapes: list[int], handle: str, layout: str, causal: bool, window: list[int],
    chunk_size: Optional[int], softcap: float, scale: Optional[float], seq_len: Optional[int], backend: str,
    prefix: int, suffix: int, slices: list[int], keep: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # keep: q, k, v, out were not kept (the head shards were); ``shapes`` are q's, k's, v's.
    m = meta.tolist()
    given = (q, k, v) if not keep else [_stand_in(dout, shapes[i:i + 4]) for i in (0, 4, 8)]
    qb, kb, vb = (to_bshd(t, layout) for t in given)
    call = _rebuild(qb, kb, vb, state_from_handle(handle), (m[0],), tuple(m[2:]) if m[1] else None, causal, window,
                    chunk_size, softcap, scale, backend, prefix, suffix, slices, alibi)
    call = _keep_heads(call, keep)
    if keep:
        saved = Saved([], (qb.shape, kb.shape, vb.shape), lse_body, lse_replicated, tuple(heads))
    else:
        saved = Saved.of(qb, kb, vb, to_bshd(out, layout), lse_body, lse_replicated)
    dq, dk, dv, dsinks = hybrid_backward(call.setup, to_bshd(dout, layout), saved, sinks)
    grads = [to_bshd(g, layout).contiguous() for g in (dq, dk, dv)]
    return (*grads, dsinks if dsinks is not None else dout.new_zeros(0))


@_attention_backward_op.register_fake
def _(dout, q, k, v, sinks, alibi, out, lse_body, lse_replicated, meta, heads, shapes, *options):
    dsinks = torch.empty_like(sinks) if sinks is not None else dout.new_zeros(0)
    return tuple(dout.new_empty(shapes[i:i + 4]) for i in (0, 4, 8)) + (dsinks,)


def _setup_attention(ctx, inputs, output) -> None:
    q, k, v, sinks, alibi, *options = inputs
    out, lse_body, lse_replicated, meta, *heads = output
    keep = options[-1]
    tokens = (None,) * 4 if keep else (q, k, v, out)
    ctx.save_for_backward(*tokens, sinks, alibi, lse_body, lse_replicated, meta, *(heads if keep else ()))
    ctx.shapes = [*q.shape, *k.shape, *v.shape]
    ctx.options = options
    ctx.mark_non_differentiable(lse_body, lse_replicated, meta, *heads)


def _attention_grad(ctx, dout, *_):
    q, k, v, out, sinks, alibi, lse_body, lse_replicated, meta, *heads = ctx.saved_tensors
    dq, dk, dv, dsinks = _attention_backward_op(
        dout.contiguous(), q, k, v, sinks, alibi, out, lse_body, lse_replicated, meta, heads, ctx.shapes,
        *ctx.options
    )
    # No gradient for the ALiBi slopes (constants, docs/masks.md) nor for the options.
    return (dq, dk, dv, dsinks if sinks is not None else None, None, *([None] * len(ctx.options)))


_attention_op.register_autograd(_attention_grad, setup_context=_setup_attention)


# --- seqpar::varlen_attention ------------------------------------------------------------------


@torch.library.custom_op("seqpar::varlen_attention", mutates_args=())
def _varlen_op(
    q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], seq_lens: Tensor, handle: str, causal: bool,
    window: list[int], chunk_size: Optional[int], softcap: float, scale: Optional[float], backend: str, keep: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    call = prepare_varlen(
        q, k, v, state_from_handle(handle), seq_lens, causal=causal, softmax_scale=scale, backend=backend,
        window=tuple(window), softcap=softcap, sinks=sinks, chunk_size=chunk_size,
    )
    call = _keep_heads(call, keep)
    out, lse, _, heads = hybrid_forward(call.setup, call.qb, call.kb, call.vb, sinks)
    return out[0].contiguous(), lse, *_kept(heads, q)


@_varlen_op.register_fake
def _(q, k, v, sinks, seq_lens, handle, causal, window, chunk_size, softcap, scale, backend, keep):
    return _out_fake(q, v), _lse_fake(q[None]), *_heads_fake(q, k, v, keep, True)


@torch.library.custom_op("seqpar::varlen_attention_backward", mutates_args=())
def _varlen_backward_op(
    dout: Tensor, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor], sinks: Optional[Tensor],
    out: Optional[Tensor], lse: Tensor, seq_lens: Tensor, heads: list[Tensor], shapes: list[int], handle: str,
    causal: bool, window: list[int], chunk_size: Optional[int], softcap: float, scale: Optional[float], backend: str,
    keep: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # keep: as in seqpar::attention_backward; ``shapes`` are q's, k's, v's ([T, heads, dim] each).
    given = (q, k, v) if not keep else [_stand_in(dout, shapes[i:i + 3]) for i in (0, 3, 6)]
    call = _rebuild(*(t[None] for t in given), state_from_handle(handle), tuple(seq_lens.tolist()), None, causal,
                    window, chunk_size, softcap, scale, backend)
    call = _keep_heads(call, keep)
    empty = lse.new_empty((1, dout.shape[1], 0))
    if keep:
        saved = Saved([], (call.qb.shape, call.kb.shape, call.vb.shape), lse, empty, tuple(heads))
    else:
        saved = Saved.of(call.qb, call.kb, call.vb, out[None], lse, empty)
    dq, dk, dv, dsinks = hybrid_backward(call.setup, dout[None], saved, sinks)
    return dq[0].contiguous(), dk[0].contiguous(), dv[0].contiguous(), (
        dsinks if dsinks is not None else dout.new_zeros(0)
    )


@_varlen_backward_op.register_fake
def _(dout, q, k, v, sinks, out, lse, seq_lens, heads, shapes, *options):
    dsinks = torch.empty_like(sinks) if sinks is not None else dout.new_zeros(0)
    return tuple(dout.new_empty(shapes[i:i + 3]) for i in (0, 3, 6)) + (dsinks,)


def _setup_varlen(ctx, inputs, output) -> None:
    q, k, v, sinks, seq_lens, *options = inputs
    out, lse, *heads = output
    keep = options[-1]
    tokens = (None,) * 4 if keep else (q, k, v, out)
    ctx.save_for_backward(*tokens, sinks, lse, seq_lens, *(heads if keep else ()))
    ctx.shapes = [*q.shape, *k.shape, *v.shape]
    ctx.options = options
    ctx.mark_non_differentiable(lse, *heads)


def _varlen_grad(ctx, dout, *_):
    q, k, v, out, sinks, lse, seq_lens, *heads = ctx.saved_tensors
    dq, dk, dv, dsinks = _varlen_backward_op(
        dout.contiguous(), q, k, v, sinks, out, lse, seq_lens, heads, ctx.shapes, *ctx.options
    )
    return (dq, dk, dv, dsinks if sinks is not None else None, None, *([None] * len(ctx.options)))


_varlen_op.register_autograd(_varlen_grad, setup_context=_setup_varlen)


# --- the entry points seqpar.attention / seqpar.varlen_attention use while compiling ---------


def compiled_attention(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, *, causal: object, softmax_scale: object,
    layout: object, backend: object, seq_len: object, window: object, softcap: object,
    sinks: Tensor | None, chunk_size: object, replicated_prefix: object, replicated_suffix: object,
    mask: object = None, alibi_slopes: Tensor | None = None,
) -> Tensor:
    """:func:`seqpar.attention` as the ``seqpar::attention`` operator (Note [torch.compile]).

    Raises:
        ValueError: as :func:`seqpar.attention`, for options before any conversion.
    """
    require_state(state, "seqpar.attention")
    o = check_dense_options(
        causal=causal, softmax_scale=softmax_scale, layout=layout, seq_len=seq_len, window=window, softcap=softcap,
        chunk_size=chunk_size, replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix, mask=mask,
    )
    keep = state.keep_head_shards and state.ulysses_size > 1 and not (o.prefix or o.suffix)
    out, *_ = _attention_op(
        q, k, v, sinks, alibi_slopes, state.handle, o.layout, o.causal, list(o.window), o.chunk_size, o.softcap,
        o.softmax_scale, o.seq_len, backend_name(backend, "seqpar.attention"), o.prefix, o.suffix,
        _slices_arg(o.slices), keep,
    )
    return out


def compiled_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, seq_lens: object, *, causal: object,
    softmax_scale: object, backend: object, window: object, softcap: object, sinks: Tensor | None,
    chunk_size: object,
) -> Tensor:
    """:func:`seqpar.varlen_attention` as the ``seqpar::varlen_attention`` operator.

    Raises:
        ValueError: as :func:`seqpar.varlen_attention`, for options before any conversion.
    """
    where = "seqpar.varlen_attention"
    require_state(state, where)
    causal, window, chunk_size, softcap = check_mask_options(causal, window, chunk_size, softcap, where)
    check_scale(softmax_scale, where)
    lens = seq_lens if isinstance(seq_lens, Tensor) else torch.tensor(list(check_seq_lens(seq_lens, where)),
                                                                       dtype=torch.long)
    out, *_ = _varlen_op(
        q, k, v, sinks, lens, state.handle, causal, list(window), chunk_size, softcap,
        None if softmax_scale is None else float(softmax_scale), backend_name(backend, where),
        state.keep_head_shards and state.ulysses_size > 1,
    )
    return out
