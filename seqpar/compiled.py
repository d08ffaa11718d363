"""``torch.compile`` support: seqpar's attention calls as custom operators.

Note [torch.compile]
~~~~~~~~~~~~~~~~~~~~
Dynamo cannot trace a seqpar call: it exchanges lengths with a collective whose result decides
Python control flow, posts point-to-point transfers (refused by dynamo: "P2P compilation is
disabled") and keeps host-side plans. So while compiling (``torch.compiler.is_compiling()``),
``seqpar.attention`` and ``seqpar.varlen_attention`` become one call of the custom operator
``seqpar::attention`` / ``seqpar::varlen_attention``, opaque to the compiler:

- the forward operator runs the eager code path unchanged (validation, the collective checks of
  Note [Global length], the Ulysses all-to-alls and the ring) and returns, next to the output, the
  residuals of its backward: the log-sum-exp of the ring (and of the replicated tokens) and the
  placement it found. Their sizes depend on other ranks, so the fake (meta) implementation gives
  them data-dependent sizes; the output has the shape of ``q``;
- the backward operator, registered as the forward's autograd formula, rebuilds the call from
  those residuals without any collective check and runs the eager backward. Eager and compiled
  calls run the same kernels in the same order.

The ``ParallelState`` reaches the operators as its integer ``handle`` (a registry of live states
in ``seqpar.state``), backends as their names. The compiled graph is specialised on the handle and
every option: another state, other options or (for packed batches given as a list) other
``seq_lens`` recompile; pass ``seq_lens`` as a tensor to avoid that. Outputs are contiguous in
the caller's layout. Double backward is not supported (as in eager).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .attention import DenseCall, _to_bshd, prepare_dense, prepare_varlen
from .backends import KernelBackend
from .parallel.merge import accumulator_dtype
from .parallel.replicated import replicated_backward, replicated_forward
from .parallel.ring import ring_backward, ring_forward
from .parallel.ulysses import ulysses_ring_backward, ulysses_ring_forward
from .state import ParallelState, state_from_handle

__all__ = ["compiled_attention", "compiled_varlen_attention", "attention_forward", "attention_backward"]


# --- the composition, without autograd -------------------------------------------------------


def _hybrid_forward(call: DenseCall, q, k, v, sinks, extra_k, extra_v) -> tuple[Tensor, Tensor]:
    if call.state.ulysses_size == 1:
        return ring_forward(q, k, v, sinks, extra_k, extra_v, call.ring_run())
    return ulysses_ring_forward(q, k, v, sinks, extra_k, extra_v, call.ulysses_spec(), call.ring_run())


def _hybrid_backward(call: DenseCall, dout, q, k, v, sinks, extra_k, extra_v, out, lse):
    if call.state.ulysses_size == 1:
        return ring_backward(dout, q, k, v, sinks, extra_k, extra_v, out, lse, call.ring_run())
    return ulysses_ring_backward(
        dout, q, k, v, sinks, extra_k, extra_v, out, lse, call.ulysses_spec(), call.ring_run()
    )


def _text(x: Tensor, prefix: int, suffix: int) -> Tensor:
    """The replicated rows of a bshd tensor: the first ``prefix`` and last ``suffix``."""
    return torch.cat([x[:, :prefix], x[:, x.shape[1] - suffix:]], 1)


def attention_forward(call: DenseCall, sinks: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse_body, lse_text)`` of a prepared call (bshd ``out``; no autograd).

    ``lse_text`` is ``[B, H, prefix + suffix]`` (empty without replicated tokens).
    """
    qb, kb, vb, p, s = call.qb, call.kb, call.vb, call.prefix, call.suffix
    if not (p or s):
        out, lse = _hybrid_forward(call, qb, kb, vb, sinks, None, None)
        empty = qb.new_empty((qb.shape[0], qb.shape[2], 0), dtype=accumulator_dtype(qb.dtype))
        return out, lse, empty
    rows = slice(p, qb.shape[1] - s)
    text = [_text(t, p, s) for t in (qb, kb, vb)]
    body_out, lse_body = _hybrid_forward(call, qb[:, rows], kb[:, rows], vb[:, rows], sinks, text[1], text[2])
    text_out, lse_text = replicated_forward(*text, kb[:, rows], vb[:, rows], sinks, call.replicated_run())
    out = torch.cat([text_out[:, :p], body_out.to(text_out.dtype), text_out[:, p:]], 1)
    return out, lse_body, lse_text


def attention_backward(
    call: DenseCall, dout: Tensor, sinks: Tensor | None, out: Tensor, lse_body: Tensor, lse_text: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dsinks)`` (bshd) of a prepared call from :func:`attention_forward`'s results."""
    qb, kb, vb, p, s = call.qb, call.kb, call.vb, call.prefix, call.suffix
    if not (p or s):
        dq, dk, dv, dsinks, _, _ = _hybrid_backward(call, dout, qb, kb, vb, sinks, None, None, out, lse_body)
        return dq, dk, dv, dsinks
    rows = slice(p, qb.shape[1] - s)
    text = [_text(t, p, s) for t in (qb, kb, vb)]
    dqb, dkb, dvb, dsb, dek, dev = _hybrid_backward(
        call, dout[:, rows], qb[:, rows], kb[:, rows], vb[:, rows], sinks, text[1], text[2], out[:, rows],
        lse_body,
    )
    dqt, dkt, dvt, dkl, dvl, dst = replicated_backward(
        _text(dout, p, s), *text, kb[:, rows], vb[:, rows], sinks, _text(out, p, s), lse_text,
        call.replicated_run(),
    )

    def whole(text_grad: Tensor, body_grad: Tensor) -> Tensor:
        return torch.cat([text_grad[:, :p], body_grad, text_grad[:, p:]], 1)

    dsinks = None if sinks is None else dsb + dst
    return whole(dqt, dqb), whole(dkt + dek, dkb + dkl), whole(dvt + dev, dvb + dvl), dsinks


# --- operators -------------------------------------------------------------------------------


def _backend_name(backend: object) -> str:
    if isinstance(backend, str):
        return backend
    if isinstance(backend, KernelBackend):
        return backend.name
    raise ValueError(
        f"seqpar.attention under torch.compile: backend must be a name or a seqpar backend, got "
        f"{type(backend).__name__}"
    )


def _lse_fake(like: Tensor) -> Tensor:
    """A ``[B, ?, ?]`` accumulator-dtype tensor: the ring's LSE, whose head and token counts
    depend on the other ranks."""
    ctx = torch.library.get_ctx()
    return like.new_empty((like.shape[0], ctx.new_dynamic_size(), ctx.new_dynamic_size()),
                          dtype=accumulator_dtype(like.dtype))


def _meta(call: DenseCall) -> Tensor:
    """The placement a forward found: ``[S, has_free, free lengths (cp_size)]`` (int64, CPU)."""
    cp = call.state.cp_size
    free = list(call.free) if call.free is not None else [0] * cp
    return torch.tensor([call.seq_lens[0], int(call.free is not None), *free], dtype=torch.long)


def _known(meta: Tensor) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    m = meta.tolist()
    return (m[0],), (tuple(m[2:]) if m[1] else None)


_DENSE_OPTIONS = ("handle", "layout", "causal", "window", "chunk_size", "softcap", "scale", "seq_len", "backend",
                  "prefix", "suffix")


def _prepare(q, k, v, sinks, handle, layout, causal, window, chunk_size, softcap, scale, seq_len, backend, prefix,
             suffix, known=None) -> DenseCall:
    return prepare_dense(
        q, k, v, state_from_handle(handle), causal=causal, softmax_scale=scale, layout=layout, backend=backend,
        seq_len=seq_len, window=tuple(window), softcap=softcap, sinks=sinks, chunk_size=chunk_size,
        replicated_prefix=prefix, replicated_suffix=suffix, known=known,
    )


@torch.library.custom_op("seqpar::attention", mutates_args=())
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], handle: int, layout: str, causal: bool,
    window: list[int], chunk_size: Optional[int], softcap: float, scale: Optional[float], seq_len: Optional[int],
    backend: str, prefix: int, suffix: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    call = _prepare(q, k, v, sinks, handle, layout, causal, window, chunk_size, softcap, scale, seq_len, backend,
                    prefix, suffix)
    out, lse_body, lse_text = attention_forward(call, sinks)
    return _to_bshd(out, layout).contiguous(), lse_body, lse_text, _meta(call)


@_attention_op.register_fake
def _(q, k, v, sinks, handle, layout, causal, window, chunk_size, softcap, scale, seq_len, backend, prefix, suffix):
    B, H = _to_bshd(q, layout).shape[0], _to_bshd(q, layout).shape[2]
    lse_text = q.new_empty((B, H, prefix + suffix), dtype=accumulator_dtype(q.dtype))
    meta = torch.empty(2 + state_from_handle(handle).cp_size, dtype=torch.long, device="cpu")
    return q.new_empty(q.shape), _lse_fake(q), lse_text, meta


@torch.library.custom_op("seqpar::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], out: Tensor, lse_body: Tensor,
    lse_text: Tensor, meta: Tensor, handle: int, layout: str, causal: bool, window: list[int],
    chunk_size: Optional[int], softcap: float, scale: Optional[float], seq_len: Optional[int], backend: str,
    prefix: int, suffix: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    call = _prepare(q, k, v, sinks, handle, layout, causal, window, chunk_size, softcap, scale, seq_len, backend,
                    prefix, suffix, known=_known(meta))
    dq, dk, dv, dsinks = attention_backward(
        call, _to_bshd(dout, layout), sinks, _to_bshd(out, layout), lse_body, lse_text
    )
    grads = [_to_bshd(g, layout).contiguous() for g in (dq, dk, dv)]
    return (*grads, dsinks if dsinks is not None else q.new_zeros(0))


@_attention_backward_op.register_fake
def _(dout, q, k, v, sinks, out, lse_body, lse_text, meta, *options):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_zeros(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_attention(ctx, inputs, output) -> None:
    q, k, v, sinks, *options = inputs
    out, lse_body, lse_text, meta = output
    ctx.save_for_backward(q, k, v, sinks, out, lse_body, lse_text, meta)
    ctx.options = options
    ctx.mark_non_differentiable(lse_body, lse_text, meta)


def _attention_grad(ctx, dout, *_):
    q, k, v, sinks, out, lse_body, lse_text, meta = ctx.saved_tensors
    dq, dk, dv, dsinks = _attention_backward_op(
        dout.contiguous(), q, k, v, sinks, out, lse_body, lse_text, meta, *ctx.options
    )
    return (dq, dk, dv, dsinks if sinks is not None else None, *([None] * len(ctx.options)))


_attention_op.register_autograd(_attention_grad, setup_context=_setup_attention)


@torch.library.custom_op("seqpar::varlen_attention", mutates_args=())
def _varlen_op(
    q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], seq_lens: Tensor, handle: int, causal: bool,
    window: list[int], chunk_size: Optional[int], softcap: float, scale: Optional[float], backend: str,
) -> tuple[Tensor, Tensor]:
    call = prepare_varlen(
        q, k, v, state_from_handle(handle), seq_lens, causal=causal, softmax_scale=scale, backend=backend,
        window=tuple(window), softcap=softcap, sinks=sinks, chunk_size=chunk_size,
    )
    out, lse = _hybrid_forward(call, call.qb, call.kb, call.vb, sinks, None, None)
    return out[0].contiguous(), lse


@_varlen_op.register_fake
def _(q, k, v, sinks, seq_lens, handle, causal, window, chunk_size, softcap, scale, backend):
    return q.new_empty(q.shape), _lse_fake(q[None])


@torch.library.custom_op("seqpar::varlen_attention_backward", mutates_args=())
def _varlen_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], out: Tensor, lse: Tensor,
    seq_lens: Tensor, handle: int, causal: bool, window: list[int], chunk_size: Optional[int], softcap: float,
    scale: Optional[float], backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    call = prepare_varlen(
        q, k, v, state_from_handle(handle), seq_lens, causal=causal, softmax_scale=scale, backend=backend,
        window=tuple(window), softcap=softcap, sinks=sinks, chunk_size=chunk_size, known=True,
    )
    dq, dk, dv, dsinks, _, _ = _hybrid_backward(
        call, dout[None], call.qb, call.kb, call.vb, sinks, None, None, out[None], lse
    )
    return dq[0].contiguous(), dk[0].contiguous(), dv[0].contiguous(), (
        dsinks if dsinks is not None else q.new_zeros(0)
    )


@_varlen_backward_op.register_fake
def _(dout, q, k, v, sinks, out, lse, seq_lens, *options):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_zeros(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_varlen(ctx, inputs, output) -> None:
    q, k, v, sinks, seq_lens, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, seq_lens)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _varlen_grad(ctx, dout, _):
    q, k, v, sinks, out, lse, seq_lens = ctx.saved_tensors
    dq, dk, dv, dsinks = _varlen_backward_op(dout.contiguous(), q, k, v, sinks, out, lse, seq_lens, *ctx.options)
    return (dq, dk, dv, dsinks if sinks is not None else None, None, *([None] * len(ctx.options)))


_varlen_op.register_autograd(_varlen_grad, setup_context=_setup_varlen)


# --- the entry points seqpar.attention / seqpar.varlen_attention use while compiling ---------


def compiled_attention(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, *, causal: bool, softmax_scale: float | None,
    layout: str, backend: object, seq_len: int | None, window: tuple[int, int], softcap: float,
    sinks: Tensor | None, chunk_size: int | None, replicated_prefix: int, replicated_suffix: int,
) -> Tensor:
    """:func:`seqpar.attention` as the ``seqpar::attention`` operator (Note [torch.compile])."""
    if not isinstance(state, ParallelState):
        raise ValueError(f"seqpar.attention: state must be a seqpar.ParallelState, got {type(state).__name__}")
    out, _, _, _ = _attention_op(
        q, k, v, sinks, state.handle, layout, bool(causal), [int(w) for w in window], chunk_size, float(softcap),
        None if softmax_scale is None else float(softmax_scale), seq_len, _backend_name(backend),
        int(replicated_prefix), int(replicated_suffix),
    )
    return out


def compiled_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, seq_lens: object, *, causal: bool,
    softmax_scale: float | None, backend: object, window: tuple[int, int], softcap: float,
    sinks: Tensor | None, chunk_size: int | None,
) -> Tensor:
    """:func:`seqpar.varlen_attention` as the ``seqpar::varlen_attention`` operator."""
    if not isinstance(state, ParallelState):
        raise ValueError(
            f"seqpar.varlen_attention: state must be a seqpar.ParallelState, got {type(state).__name__}"
        )
    lens = seq_lens if isinstance(seq_lens, Tensor) else torch.tensor(list(seq_lens), dtype=torch.long)
    out, _ = _varlen_op(
        q, k, v, sinks, lens, state.handle, bool(causal), [int(w) for w in window], chunk_size, float(softcap),
        None if softmax_scale is None else float(softmax_scale), _backend_name(backend),
    )
    return out
