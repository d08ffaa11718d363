"""The public attention entry points: ``attention``, ``varlen_attention``, ``SequenceParallelAttention``.

Every public call validates its inputs once, here, then runs one composition, written once in
:func:`_hybrid`::

    this rank's shard [B, S_local, H, D]                      (layout converted by views)
      -> Ulysses all-to-all over state.ulysses_group          [B, S_ring_local, H_u, D]
      -> ring over state.ring_group (seqpar.parallel.ring)    exact over all tokens, any mask
      -> Ulysses all-to-all back                              [B, S_local, H, D]

Packed sequences are the same composition on a batch of one; replicated text tokens of joint
attention add local keys to the ring and a small merge over the CP group (Note [Replicated
tokens]). With ``R == 1`` the ring is one local step; with ``U == 1`` there is no all-to-all.

Note [Global length]
~~~~~~~~~~~~~~~~~~~~
The ring needs the global length ``S`` (the zig-zag chunk sizes) and the Ulysses all-to-all every
rank's length. A shard's own length does not determine ``S`` (``R=1, U=2``: a 3-token shard comes
from ``S = 5`` or ``S = 6``), and answering locally only when unique would call a collective on
some ranks and not others. So:

- ``seq_len=S`` given: every rank's length is the placement of ``S``;
- ``seq_len=None`` and ``cp_size > 1``: the lengths are exchanged (below); lengths that are the
  placement of their sum use it; other lengths are accepted when the attention does not depend on
  positions (non-causal, no window, no chunks -- e.g. image tokens split contiguously by a
  diffusers plan) and refused otherwise.

Checks (``ParallelState.checks``): the exchange is one all-gather over the CP group of a few ints
-- every rank's local length, whether it found a problem locally, and a signature of the call
(shapes, dtype, mask and score options, layout, ``seq_len``). Every rank checks the same rows, so
a mismatch raises the same ``ValueError`` on every rank instead of a wrong result, a gloo abort on
mismatched message sizes, or a hang in a later collective. It runs whenever ``seq_len`` is
``None`` (the lengths are needed), and with ``seq_len`` given when ``checks="always"`` or (the
default ``"auto"``) when the tensors are on the CPU, where it costs no host synchronisation. With
``seq_len`` given on an accelerator (``"auto"``), or ``checks="never"``, a call does no collective
beyond the attention's own traffic and no device-to-host copy: only this rank's length is checked,
and a rank that disagrees with its peers is not detected -- run once with ``checks="always"`` (or
``TORCH_DISTRIBUTED_DEBUG=DETAIL``) when something looks wrong (``docs/troubleshooting.md``).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from .backends import AttentionBackend, KernelBackend, get_backend
from .checks import check_gqa, check_mask_options, check_qkv, check_scale, check_sinks
from .comm import exchange_ints
from .parallel.replicated import ReplicatedRun, replicated_query_attention
from .parallel.ring import RingRun, ring_attention
from .parallel.ulysses import UlyssesSpec, ulysses_ring_attention
from .placement import Mask, Placement, RingPlan, ring_plan
from .placement.sizes import as_int, check_seq_lens
from .state import ParallelState

__all__ = [
    "attention", "varlen_attention", "SequenceParallelAttention", "Layout", "refuse_collectively", "DenseCall",
    "prepare_dense", "prepare_varlen",
]

Layout = Literal["bshd", "sbhd", "bhsd"]
_LAYOUTS: tuple[str, ...] = get_args(Layout)
_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


def _to_bshd(x: Tensor, layout: str) -> Tensor:
    """View ``x`` in ``layout`` as ``[B, S, H, D]`` (no copy); its own inverse."""
    if layout == "sbhd":
        return x.transpose(0, 1)
    if layout == "bhsd":
        return x.transpose(1, 2)
    return x


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@functools.lru_cache(maxsize=64)
def _cached_plan(
    seq_lens: tuple[int, ...], free: tuple[int, ...] | None, ring_size: int, ulysses_size: int,
    ring_rank: int, mask: Mask, varlen: bool,
) -> tuple[Placement, RingPlan]:
    """The placement and this ring rank's plan; pure, so repeated calls (every layer of a model,
    every step of a loop) reuse it."""
    placement = Placement(seq_lens, ring_size, ulysses_size, free)
    return placement, ring_plan(placement, ring_rank, mask, varlen=varlen)


@functools.lru_cache(maxsize=256)
def _dense_lengths(seq_len: int, ring_size: int, ulysses_size: int) -> tuple[int, ...]:
    """Every CP rank's token count of a dense sequence (cached: called on every layer)."""
    return Placement.dense(seq_len, ring_size, ulysses_size).shard_lengths


def _check_state(state: object, where: str) -> None:
    if not isinstance(state, ParallelState):
        raise ValueError(
            f"{where}: state must be a seqpar.ParallelState, got {type(state).__name__}; build one "
            "with seqpar.ParallelState(ring_size=..., ulysses_size=...)"
        )
    state.check_usable(where)


def _resolve_backend(backend: object, q: Tensor, mask: Mask, softcap: float, where: str) -> KernelBackend:
    window = mask.window != (-1, -1)
    if isinstance(backend, str):
        try:
            return get_backend(backend, q.device, q.dtype, window=window, softcap=softcap > 0)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not isinstance(backend, KernelBackend):
        raise ValueError(
            f"{where}: backend must be a backend name (e.g. 'auto') or a seqpar KernelBackend, got "
            f"{type(backend).__name__}"
        )
    reason = backend.unsupported_reason(q.device, q.dtype, window=window, softcap=softcap > 0)
    if reason is not None:
        raise ValueError(f"{where}: backend {backend.name!r} cannot run this call: {reason}")
    return backend


def _hybrid(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, placement: Placement, plan: RingPlan,
    backend: KernelBackend, scale: float, softcap: float, sinks: Tensor | None,
    extra_k: Tensor | None, extra_v: Tensor | None,
) -> Tensor:
    """Ulysses over ``state.ulysses_group`` around the ring over ``state.ring_group`` (bshd)."""
    run = RingRun(state.ring_group, plan, backend, scale, softcap, state.workspace)
    if state.ulysses_size == 1:
        return ring_attention(q, k, v, run, sinks=sinks, extra_k=extra_k, extra_v=extra_v)
    spec = UlyssesSpec.build(
        state.ulysses_group, placement.ulysses_sizes(state.ring_rank), q.shape[2], k.shape[2], state.workspace
    )
    return ulysses_ring_attention(q, k, v, spec, run, sinks=sinks, extra_k=extra_k, extra_v=extra_v)


_REFUSED = 2  # the problem code of a rank that refuses the call (refuse_collectively)
_DENSE_SIGNATURE = 17  # ints in the signature of seqpar.attention (see attention())


def refuse_collectively(state: ParallelState, device: torch.device, seq_len: int | None, error: Exception) -> None:
    """Raise ``error`` on this rank, and make the CP ranks' concurrent ``seqpar.attention`` call
    raise too, instead of waiting for this rank.

    For checks that can fail on one rank only, made where every rank is about to call
    ``seqpar.attention`` (an integration's per-rank check, say): when that call checks
    collectively (Note [Global length]), this rank joins its exchange with a refusal. Otherwise
    (``seq_len`` given on an accelerator, ``checks="never"``) it can only raise here.

    Raises:
        ``error``, always.
    """
    if collective_checks(state, device, seq_len is not None):
        exchange_ints([0, _REFUSED, *([-1] * _DENSE_SIGNATURE)], state.cp_group, device)
    raise error


def collective_checks(state: ParallelState, device: torch.device, lengths_known: bool) -> bool:
    """Whether this call checks agreement with one all-gather over the CP group (``state.checks``)."""
    if state.cp_size == 1:
        return False
    if state.checks == "always" or not lengths_known:
        return True
    return state.checks == "auto" and device.type == "cpu"


def _exchange(
    local: int, problem: int, signature: Callable[[], list[int]], names: str, state: ParallelState,
    device: torch.device, where: str, expected: str = "its share of the call",
) -> list[int]:
    """Every CP rank's ``local`` length, after checking that all ranks share ``signature()`` and
    that none reported a ``problem`` (nonzero; ``expected`` says what was expected). Every rank
    raises the same ``ValueError``."""
    rows = exchange_ints([local, problem, *signature()], state.cp_group, device)
    refused = [c for c, row in enumerate(rows) if row[1] == _REFUSED]
    if refused:
        raise ValueError(
            f"{where}: cp rank {refused[0]} refused this call (its own error says why); every rank "
            "raises so that none waits for it"
        )
    sigs = [row[2:] for row in rows]
    bad = [c for c, sig in enumerate(sigs) if sig != sigs[0]]
    if bad:
        raise ValueError(
            f"{where}: the CP ranks disagree on the call: cp rank 0 has {names} = {sigs[0]}, cp "
            f"rank {bad[0]} has {sigs[bad[0]]}; every rank must pass shards of the same tensors "
            "with the same options"
        )
    got = [row[0] for row in rows]
    flagged = [c for c, row in enumerate(rows) if row[1]]
    if flagged:
        raise ValueError(
            f"{where}: cp rank {flagged[0]} holds {got[flagged[0]]} tokens, but {expected} (tokens "
            f"per cp rank: {got}); shard inputs with seqpar.shard / seqpar.shard_packed and pass "
            "the global length the shards come from"
        )
    return got


def _dense_placement(
    local: int, state: ParallelState, seq_len: object, mask: Mask, signature: Callable[[], list[int]],
    names: str, device: torch.device, where: str,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``(seq_lens, free_lengths)`` of the sharded tokens, per Note [Global length]."""
    R, U, me = state.ring_size, state.ulysses_size, state.cp_rank
    collective = collective_checks(state, device, seq_len is not None)
    if seq_len is not None:
        seq_len = as_int(seq_len, "seq_len", where)
        want = _dense_lengths(seq_len, R, U)
        if collective:  # a wrong length raises on every rank, not only here
            expected = f"seq_len={seq_len} over ring {R} x ulysses {U} places {list(want)}"
            _exchange(local, int(local != want[me]), signature, names, state, device, where, expected)
        elif local != want[me]:
            raise ValueError(
                f"{where}: cp rank {me} holds {local} tokens, but seq_len={seq_len} over ring {R} x "
                f"ulysses {U} places {want[me]} there (all ranks: {list(want)}); shard inputs with "
                "seqpar.shard(x, state, dim=<sequence dim>) or pass the right seq_len"
            )
        return (seq_len,), None
    if state.cp_size == 1:
        return (local,), None
    got = _exchange(local, 0, signature, names, state, device, where)
    total = sum(got)
    want = list(_dense_lengths(total, R, U))
    if got == want:
        return (total,), None
    if mask.is_full:
        return (total,), tuple(got)
    raise ValueError(
        f"{where}: the CP ranks hold {got} tokens (cp_rank order), not the placement of their "
        f"{total} tokens over ring {R} x ulysses {U} ({want}); {mask.describe()} attention depends "
        "on token positions, so shard inputs with seqpar.shard(x, state, dim=<sequence dim>)"
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: Layout = "bshd",
    backend: str | AttentionBackend = "auto",
    seq_len: int | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk_size: int | None = None,
    replicated_prefix: int = 0,
    replicated_suffix: int = 0,
) -> Tensor:
    """Exact attention over the whole sequence, computed from and returned as local shards.

    Every CP rank passes its shard of q, k, v as placed by Note [Sharding placement]
    (``seqpar.shard``): zig-zag chunks across the ring, contiguous pieces across Ulysses. The
    result is this rank's shard of full-sequence attention (module docstring; masks per Note
    [Masks], see the ``docs/masks.md`` page). Differentiable; gradients are partial: sharded
    inputs get their full gradient on their own rank, replicated ones (sinks, replicated tokens)
    a share per rank that sums over the CP group to the true gradient.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)`` in ``"bshd"``, ``(seqlen_local, batch,
            nheads, headdim)`` in ``"sbhd"``, ``(batch, nheads, seqlen_local, headdim)`` in
            ``"bhsd"``; any strides.
        k, v: the same with ``nheads_kv`` heads, ``nheads % nheads_kv == 0`` (GQA/MQA).
        state: the ``ParallelState`` whose ``ulysses_group`` and ``ring_group`` are used.
        causal: causal attention in global token positions.
        softmax_scale: default ``headdim ** -0.5``.
        layout: ``"bshd"`` (flash-attn), ``"sbhd"`` (Megatron) or ``"bhsd"`` (SDPA).
        backend: a name for ``seqpar.backends.get_backend`` (``"auto"``, ``"reference"``,
            ``"cpu"``, ``"torch_flash"``, ``"flash_attn"``, ...) or a backend object.
        seq_len: the global length ``S`` of the sharded tokens if known; ``None`` derives it
            with one small collective (Note [Global length]). The same on every rank.
        window: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right`` (global
            positions; ``-1`` unbounded; with ``causal`` the right side is 0).
        softcap: ``c > 0`` turns scores (after scaling) into ``c * tanh(scores / c)``.
        sinks: ``(nheads,)`` logits added to every row's softmax denominator (no value).
        chunk_size: ``C``: query ``i`` sees only keys ``j`` with ``i // C == j // C``.
        replicated_prefix, replicated_suffix: the first / last ``T`` tokens of q, k, v are the
            same on every CP rank (text of joint attention; non-causal only); the rest is this
            rank's shard. The output keeps that layout, the replicated rows identical on every rank.

    Returns:
        This rank's output shard in ``layout``, with q's shape and dtype. With ``ulysses_size >
        1`` it may be non-contiguous (use ``reshape`` rather than ``view`` to merge heads).

    Raises:
        ValueError: non-tensor inputs or state; q, k, v of different dtypes or devices, not
            4-dim, or with mismatched batch/length/head dim; ``H`` not a multiple of ``Hkv``; an
            unknown layout; a backend that is unknown or cannot run these options; bad option
            values (a window contradicting ``causal``, replicated tokens with a causal, windowed
            or chunked mask, more replicated tokens than local ones); a local length that is not
            this rank's share of ``seq_len``; CP ranks that disagree on shapes or options, or hold
            lengths that are not the placement of a position-dependent mask (raised on every rank
            whenever the call checks collectively, Note [Global length]).
    """
    if torch.compiler.is_compiling():  # one opaque custom op (Note [torch.compile] in seqpar.compiled)
        from .compiled import compiled_attention

        return compiled_attention(
            q, k, v, state, causal=causal, softmax_scale=softmax_scale, layout=layout, backend=backend,
            seq_len=seq_len, window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
            replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix,
        )
    call = prepare_dense(
        q, k, v, state, causal=causal, softmax_scale=softmax_scale, layout=layout, backend=backend,
        seq_len=seq_len, window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
        replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix,
    )
    qb, kb, vb, S, prefix, suffix = call.qb, call.kb, call.vb, call.qb.shape[1], call.prefix, call.suffix
    args = (state, call.placement, call.plan, call.backend, call.scale, call.softcap, sinks)
    if not (prefix or suffix):
        return _to_bshd(_hybrid(qb, kb, vb, *args, None, None), layout)
    rows = slice(prefix, S - suffix)
    text = [torch.cat([t[:, :prefix], t[:, S - suffix:]], 1) for t in (qb, kb, vb)]
    body_out = _hybrid(qb[:, rows], kb[:, rows], vb[:, rows], *args, text[1], text[2])
    text_out = replicated_query_attention(*text, kb[:, rows], vb[:, rows], call.replicated_run(), sinks=sinks)
    out = torch.cat([text_out[:, :prefix], body_out, text_out[:, prefix:]], 1)
    return _to_bshd(out, layout)


@dataclass(frozen=True, eq=False)
class DenseCall:
    """A validated :func:`attention` call: bshd views of the inputs and everything host-side."""

    qb: Tensor
    kb: Tensor
    vb: Tensor
    state: ParallelState
    placement: Placement
    plan: RingPlan
    backend: KernelBackend
    scale: float
    softcap: float
    prefix: int
    suffix: int
    seq_lens: tuple[int, ...]
    free: tuple[int, ...] | None

    def ring_run(self) -> RingRun:
        return RingRun(self.state.ring_group, self.plan, self.backend, self.scale, self.softcap, self.state.workspace)

    def ulysses_spec(self) -> UlyssesSpec:
        s = self.state
        return UlyssesSpec.build(
            s.ulysses_group, self.placement.ulysses_sizes(s.ring_rank), self.qb.shape[2], self.kb.shape[2],
            s.workspace,
        )

    def replicated_run(self) -> ReplicatedRun:
        return ReplicatedRun(self.state.cp_group, self.backend, self.scale, self.softcap)


def prepare_dense(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, *, causal: bool, softmax_scale: float | None,
    layout: str, backend: object, seq_len: int | None, window: tuple[int, int], softcap: float,
    sinks: Tensor | None, chunk_size: int | None, replicated_prefix: int, replicated_suffix: int,
    known: tuple[tuple[int, ...], tuple[int, ...] | None] | None = None,
) -> DenseCall:
    """Validate an :func:`attention` call and place its tokens (raises as :func:`attention` does).

    ``known``: the ``(seq_lens, free)`` an earlier, validated forward found; then no collective
    runs (the backward of ``seqpar.compiled``).
    """
    where = "seqpar.attention"
    _check_state(state, where)
    causal, window, chunk_size, softcap = check_mask_options(causal, window, chunk_size, softcap, where)
    check_scale(softmax_scale, where)
    if layout not in _LAYOUTS:
        raise ValueError(f"{where}: unknown layout {layout!r}; valid layouts: {list(_LAYOUTS)}")
    check_qkv(q, k, v, ndim=4, shape_doc=f"in layout {layout!r} ({', '.join(layout)})", where=where)
    qb, kb, vb = (_to_bshd(t, layout) for t in (q, k, v))
    (B, S, H, D), (Bk, Sk, Hkv, Dk) = qb.shape, kb.shape
    def shapes() -> str:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (layout {layout!r})"

    if (Bk, Sk) != (B, S) or Dk != D or vb.shape != kb.shape:
        raise ValueError(
            f"{where}: {shapes()}: k and v must have q's batch size B={B}, local length S={S} and "
            f"head dim D={D}, and the same shape as each other"
        )
    if D < 1:
        raise ValueError(f"{where}: {shapes()}: the head dim must be positive, got D={D}")
    if H % Hkv:
        check_gqa(H, Hkv, where, context=f"{shapes()}: ")
    check_sinks(sinks, H, q, where)
    prefix = as_int(replicated_prefix, "replicated_prefix", where)
    suffix = as_int(replicated_suffix, "replicated_suffix", where)
    mask = Mask(causal, window, chunk_size)
    if prefix or suffix:
        if not mask.is_full:
            raise ValueError(
                f"{where}: replicated_prefix/replicated_suffix (joint attention) need non-causal "
                f"attention without window or chunks, got {mask.describe()}"
            )
        if prefix + suffix > S:
            raise ValueError(
                f"{where}: replicated_prefix={prefix} + replicated_suffix={suffix} exceed the {S} "
                "local tokens; q, k, v hold the replicated tokens and then this rank's shard"
            )
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)

    def signature() -> list[int]:
        sig = [
            B, H, Hkv, D, vb.shape[-1], _DTYPE_CODES.get(q.dtype, 0), int(causal), *window,
            -1 if chunk_size is None else chunk_size, prefix, suffix, int(sinks is not None),
            _bits(scale), _bits(softcap), _LAYOUTS.index(layout), -1 if seq_len is None else int(seq_len),
        ]
        assert len(sig) == _DENSE_SIGNATURE  # refuse_collectively sends rows of this length
        return sig

    names = "(B, H, Hkv, D, Dv, dtype, causal, window, chunk_size, prefix, suffix, sinks, scale, softcap, layout, seq_len)"
    body = S - prefix - suffix
    if known is None:
        seq_lens, free = _dense_placement(body, state, seq_len, mask, signature, names, q.device, where)
    else:
        seq_lens, free = known
    mask = mask.normalised(seq_lens[0])
    backend = _resolve_backend(backend, q, mask, softcap, where)
    placement, plan = _cached_plan(seq_lens, free, state.ring_size, state.ulysses_size, state.ring_rank, mask, B == 1)
    return DenseCall(qb, kb, vb, state, placement, plan, backend, scale, softcap, prefix, suffix, seq_lens, free)


def _seq_lens_fingerprint(lens: tuple[int, ...]) -> list[int]:
    """Three ints that differ, with overwhelming probability, between different ``seq_lens``."""
    t = torch.tensor(lens, dtype=torch.long)
    weights = torch.arange(1, len(lens) + 1, dtype=torch.long) * 2654435761 % (1 << 31)
    return [len(lens), int(t.sum()), int((t * weights).sum() % (1 << 61))]


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    seq_lens: Sequence[int] | Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Exact attention over packed variable-length sequences sharded with ``shard_packed``.

    Tokens attend only within their own sequence (block-diagonal), with the mask of Note [Masks]
    on positions counted within each sequence::

        seq_lens = [3, 2]           causal            non-causal
                          k: a a a b b         a a a b b
                      q a    x . . . .         x x x . .
                        a    x x . . .         x x x . .
                        a    x x x . .         x x x . .
                        b    . . . x .         . . . x x
                        b    . . . x x         . . . x x

    Equal to ``shard_packed(attention_of_each_sequence(full_q, full_k, full_v), state,
    seq_lens)``. The placement is Note [Sharding placement]: each sequence zig-zagged over the
    ring on its own, the remainders rotated so that many short sequences spread evenly; the
    ring-local concatenation split contiguously over Ulysses. The Ulysses all-to-all regroups
    heads, then the ring runs a few varlen kernel calls per step (Note [Ring blocks]).
    Collective over ``state.cp_group``: every CP rank must call it with the same ``seq_lens``
    and options. Whether that is checked with an exchange of a few ints over the CP group (which
    makes every rank raise the same error) follows ``state.checks`` as in Note [Global length]
    (``seq_lens`` play the role of ``seq_len``: on an accelerator with ``"auto"``, only this rank's
    count is checked). The plan is built on the host from ``seq_lens`` once per distinct batch and
    reused.

    Args:
        q: ``(T_local, nheads, headdim)``, this rank's packed tokens (``shard_packed``, dim 0).
        k, v: ``(T_local, nheads_kv, headdim)`` with ``nheads % nheads_kv == 0``.
        state: the parallel state.
        seq_lens: global lengths of the packed sequences (non-negative ints, list or tensor),
            summing to the global token count ``T``; the same on every CP rank.
        causal, window, chunk_size: the mask within each sequence (Note [Masks]).
        softmax_scale: default ``headdim ** -0.5``.
        backend: a backend name or object.
        softcap: ``c > 0`` caps scores to ``c * tanh(s / c)``.
        sinks: ``(nheads,)`` sink logits.

    Returns:
        ``(T_local, nheads, headdim)`` in q's dtype (with ``U > 1`` non-contiguous). Gradients
        are partial (the sum over the CP group is the true gradient of replicated tensors).

    Raises:
        ValueError: non-3-dim tensors, mismatched dtypes/devices/head dims, ``nheads`` not a
            multiple of ``nheads_kv``, negative or non-int lengths, bad options, and -- raised on
            every CP rank -- ``seq_lens`` that do not place exactly each rank's token count there
            or that differ between ranks, and ranks that disagree on shapes or options.
    """
    if torch.compiler.is_compiling():  # one opaque custom op (Note [torch.compile] in seqpar.compiled)
        from .compiled import compiled_varlen_attention

        return compiled_varlen_attention(
            q, k, v, state, seq_lens, causal=causal, softmax_scale=softmax_scale, backend=backend,
            window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
        )
    call = prepare_varlen(
        q, k, v, state, seq_lens, causal=causal, softmax_scale=softmax_scale, backend=backend,
        window=window, softcap=softcap, sinks=sinks, chunk_size=chunk_size,
    )
    args = (state, call.placement, call.plan, call.backend, call.scale, call.softcap, sinks)
    return _hybrid(call.qb, call.kb, call.vb, *args, None, None)[0]


def prepare_varlen(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, seq_lens: Sequence[int] | Tensor, *,
    causal: bool, softmax_scale: float | None, backend: object, window: tuple[int, int], softcap: float,
    sinks: Tensor | None, chunk_size: int | None, known: bool = False,
) -> DenseCall:
    """Validate a :func:`varlen_attention` call and place its tokens (raises as it does); with
    ``known`` (a backward after a validated forward) no collective runs. The call's tensors are
    the packed ones with a batch dim of one."""

    where = "seqpar.varlen_attention"
    _check_state(state, where)
    causal, window, chunk_size, softcap = check_mask_options(causal, window, chunk_size, softcap, where)
    check_scale(softmax_scale, where)
    check_qkv(q, k, v, ndim=3, shape_doc="[T_local, heads, head_dim] as produced by seqpar.shard_packed", where=where)
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, H, D], "
            "[T, Hkv, D], [T, Hkv, D] with the same T and D"
        )
    T, H, D = q.shape
    Hkv = k.shape[1]
    check_gqa(H, Hkv, where)
    check_sinks(sinks, H, q, where)
    lens = check_seq_lens(seq_lens, where)
    R, U = state.ring_size, state.ulysses_size
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    mask = Mask(causal, window, chunk_size).normalised(max(lens, default=0))
    placement, plan = _cached_plan(lens, None, R, U, state.ring_rank, mask, True)
    want = placement.shard_lengths

    def signature() -> list[int]:
        return [
            *_seq_lens_fingerprint(lens), H, Hkv, D, v.shape[-1], _DTYPE_CODES.get(q.dtype, 0),
            int(causal), *window, -1 if chunk_size is None else chunk_size, int(sinks is not None),
            _bits(scale), _bits(softcap),
        ]

    names = "(seq_lens fingerprint, H, Hkv, D, Dv, dtype, causal, window, chunk_size, sinks, scale, softcap)"
    if known:
        got = list(want)
    elif collective_checks(state, q.device, lengths_known=True):
        got = _exchange(T, 0, signature, names, state, q.device, where)
    else:  # only this rank's count can be checked without communication
        got = [want[c] if c != state.cp_rank else T for c in range(state.cp_size)]
    if got != list(want):
        bad = next(c for c, (g, w) in enumerate(zip(got, want)) if g != w)
        raise ValueError(
            f"{where}: seq_lens (sum {sum(lens)}, {len(lens)} sequences) place {want[bad]} tokens "
            f"on cp rank {bad} of ring {R} x ulysses {U} (placement {list(want)}), but it holds "
            f"{got[bad]} (tokens per cp rank: {got}); pass the global seq_lens of the packed batch "
            "and shard q, k, v with seqpar.shard_packed"
        )
    backend = _resolve_backend(backend, q, mask, softcap, where)
    return DenseCall(q[None], k[None], v[None], state, placement, plan, backend, scale, softcap, 0, 0, lens, None)



class SequenceParallelAttention(nn.Module):
    """``nn.Module`` form of :func:`attention` with fixed options (it has no parameters).

    Args:
        state, causal, softmax_scale, layout, backend, window, softcap, chunk_size,
        replicated_prefix, replicated_suffix: as in :func:`attention`. Sinks are a tensor input
        (usually a parameter of the surrounding module): pass them to :meth:`forward`.

    Raises:
        ValueError: for a non-``ParallelState`` state, an unknown layout, or bad options; backend
            names are resolved (and an unknown one rejected) on the first call, when the device
            and dtype are known.
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        causal: bool = False,
        softmax_scale: float | None = None,
        layout: Layout = "bshd",
        backend: str | AttentionBackend = "auto",
        window: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        chunk_size: int | None = None,
        replicated_prefix: int = 0,
        replicated_suffix: int = 0,
    ) -> None:
        super().__init__()
        where = "SequenceParallelAttention"
        _check_state(state, where)
        check_mask_options(causal, window, chunk_size, softcap, where)
        check_scale(softmax_scale, where)
        if layout not in _LAYOUTS:
            raise ValueError(f"{where}: unknown layout {layout!r}; valid layouts: {list(_LAYOUTS)}")
        if not isinstance(backend, (str, AttentionBackend)):
            raise ValueError(f"{where}: backend must be a name or a backend, got {type(backend).__name__}")
        self.state = state
        self.options = dict(
            causal=causal, softmax_scale=softmax_scale, layout=layout, backend=backend,
            window=tuple(window), softcap=softcap, chunk_size=chunk_size,
            replicated_prefix=replicated_prefix, replicated_suffix=replicated_suffix,
        )

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, seq_len: int | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        """:func:`attention` of the local shards ``q, k, v`` (shapes per ``layout``)."""
        return attention(q, k, v, self.state, seq_len=seq_len, sinks=sinks, **self.options)

    def extra_repr(self) -> str:
        opts = {k: (v if isinstance(v, (str, int, float, bool, tuple, type(None))) else type(v).__name__)
                for k, v in self.options.items()}
        return f"{self.state!r}, " + ", ".join(f"{k}={v!r}" for k, v in opts.items())
