"""Preparing one attention call: validation at the door, then the placement and plan of its tokens.

Every public attention entry (eager ``seqpar.attention`` / ``seqpar.varlen_attention`` and their
``torch.compile`` operators) validates here, once, and receives a :class:`PreparedCall`: bshd views
of q, k, v and the :class:`~seqpar.parallel.hybrid.HybridSetup` that
``seqpar.parallel.hybrid`` runs. The layers below trust it.

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
(shapes, dtype, mask and score options, layout, ``seq_len``; for packed calls a hash of all of
``seq_lens``). Every rank checks the same rows, so a mismatch raises the same ``ValueError`` on
every rank instead of a wrong result, a gloo abort on mismatched message sizes, or a hang in a
later collective. It runs whenever ``seq_len`` is ``None`` (the lengths are needed), and with
``seq_len`` given when ``checks="always"`` or (the default ``"auto"``) when the tensors are on the
CPU, where it costs no host synchronisation. With ``seq_len`` given on an accelerator
(``"auto"``), or ``checks="never"``, a call does no collective beyond the attention's own traffic
and no device-to-host copy: only this rank's length is checked, and a rank that disagrees with its
peers is not detected -- run once with ``checks="always"`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``)
when something looks wrong (``docs/troubleshooting.md``).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from .backends import KernelBackend, get_backend
from .checks import (
    check_alibi_slopes, check_gqa, check_mask_options, check_mask_slices, check_qkv, check_scale, check_sinks,
    check_value_shape,
)
from .comm import exchange_ints
from .parallel.allgather import AllGatherSetup
from .parallel.hybrid import HybridSetup
from .parallel.replicated import ReplicatedSetup
from .parallel.ring import RingSetup
from .parallel.ulysses import UlyssesSetup
from .placement import Mask, MaskSlices, Placement, RingPlan, ring_plan
from .placement.gather import GatherPlan, gather_plan
from .placement.sizes import as_int, check_seq_lens
from .state import ParallelState, RingComm, require_state

__all__ = [
    "Layout", "LAYOUTS", "to_bshd", "DenseOptions", "PreparedCall", "check_dense_options", "prepare_dense",
    "prepare_varlen", "build_call", "check_head_groups", "resolve_backend", "check_slices_fit", "backend_name", "refuse_collectively", "collective_checks",
]

Layout = Literal["bshd", "sbhd", "bhsd"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


def to_bshd(x: Tensor, layout: str) -> Tensor:
    """View ``x`` in ``layout`` as ``[B, S, H, D]`` (no copy); its own inverse."""
    if layout == "sbhd":
        return x.transpose(0, 1)
    if layout == "bhsd":
        return x.transpose(1, 2)
    return x


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


_RING_COMM_NAMES = "[" + " / ".join(f"{i} {name}" for i, name in enumerate(get_args(RingComm))) + "]"


def _ring_comm_code(state: ParallelState) -> int:
    """The state's K/V transport as an int of the call signature: the transports order their
    transfers differently, so ranks that disagree would pair the wrong messages."""
    return get_args(RingComm).index(state.ring_comm)


@dataclass(frozen=True)
class DenseOptions:
    """The validated, normalised options of a :func:`seqpar.attention` call (everything but tensors
    and the state). Built by :func:`check_dense_options`, the same for eager and compiled calls."""

    causal: bool
    window: tuple[int, int]
    chunk_size: int | None
    softcap: float
    softmax_scale: float | None
    layout: str
    prefix: int
    suffix: int
    seq_len: int | None
    slices: MaskSlices | None = None
    head_groups: int | str = 1


def check_dense_options(
    *, causal: object, softmax_scale: object, layout: object, seq_len: object, window: object, softcap: object,
    chunk_size: object, replicated_prefix: object, replicated_suffix: object, where: str = "seqpar.attention",
    mask: object = None, head_groups: object = 1,
) -> DenseOptions:
    """Validate the non-tensor options of :func:`seqpar.attention` before any conversion.

    Raises:
        ValueError: a non-bool ``causal`` (numpy bools count as bools), a bad window, chunk size,
            softcap or scale, an unknown layout, a non-int ``seq_len`` or replicated count.
    """
    causal, window, chunk_size, softcap = check_mask_options(causal, window, chunk_size, softcap, where)
    slices = check_mask_slices(mask, causal, window, chunk_size, where)
    check_scale(softmax_scale, where)
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{where}: unknown layout {layout!r}; valid layouts: {list(LAYOUTS)}")
    prefix = as_int(replicated_prefix, "replicated_prefix", where)
    suffix = as_int(replicated_suffix, "replicated_suffix", where)
    if (prefix or suffix) and not Mask(causal, window, chunk_size, slices).is_full:
        raise ValueError(
            f"{where}: replicated_prefix/replicated_suffix (joint attention) need non-causal "
            f"attention without window, chunks or mask slices, got {Mask(causal, window, chunk_size, slices).describe()}"
        )
    return DenseOptions(
        causal, window, chunk_size, softcap, None if softmax_scale is None else float(softmax_scale), layout,
        prefix, suffix, None if seq_len is None else as_int(seq_len, "seq_len", where), slices,
        check_head_groups(head_groups, where),
    )


def check_head_groups(head_groups: object, where: str) -> int | str:
    """``head_groups`` as an int >= 1, or ``"auto"`` (resolved from the call's shapes once the
    ranks agree on them; whether the call has that many query heads is checked then too:
    ``seqpar.attention``'s Note [Head groups])."""
    if isinstance(head_groups, str) and head_groups == "auto":
        return "auto"
    return as_int(head_groups, "head_groups (1: all heads in one exchange; or 'auto')", where, minimum=1)


def _head_groups_code(head_groups: int | str) -> int:
    """``head_groups`` in a call's signature: the count, 0 for ``"auto"`` (which every rank then
    resolves from the same agreed shapes)."""
    return 0 if head_groups == "auto" else head_groups


@dataclass(frozen=True, eq=False)
class PreparedCall:
    """A validated call: bshd views of its inputs and everything host-side.

    Attributes:
        qb, kb, vb: ``[B, S_local, H, D]`` / ``[B, S_local, Hkv, D]`` / ``[B, S_local, Hkv, Dv]``
            views (packed: ``B = 1``); ``Dv`` may differ from ``D`` (MLA).
        setup: what :func:`seqpar.parallel.hybrid.hybrid_forward` needs besides tensors.
        seq_lens: the global length(s) of the sharded tokens; free: every CP rank's length when
            the tokens are not placed by the placement rule (position-free attention), else None.
    """

    qb: Tensor
    kb: Tensor
    vb: Tensor
    state: ParallelState
    setup: HybridSetup
    seq_lens: tuple[int, ...]
    free: tuple[int, ...] | None


@functools.lru_cache(maxsize=64)
def _cached_plan(
    seq_lens: tuple[int, ...], free: tuple[int, ...] | None, ring_size: int, ulysses_size: int,
    ring_rank: int, mask: Mask, varlen: bool,
) -> tuple[Placement, RingPlan]:
    """The placement and this ring rank's plan; pure, so repeated calls (every layer of a model,
    every step of a loop) reuse it."""
    placement = Placement(seq_lens, ring_size, ulysses_size, free)
    return placement, ring_plan(placement, ring_rank, mask, varlen=varlen)


@functools.lru_cache(maxsize=64)
def _cached_gather(
    seq_lens: tuple[int, ...], free: tuple[int, ...] | None, ring_size: int, ulysses_size: int,
    ring_rank: int, mask: Mask, varlen: bool,
) -> GatherPlan:
    """This ring rank's all-gather layout (Note [All-gather K/V]), from every ring rank's plan."""
    plans = [_cached_plan(seq_lens, free, ring_size, ulysses_size, j, mask, varlen)[1] for j in range(ring_size)]
    return gather_plan(plans, ring_rank)


@functools.lru_cache(maxsize=256)
def _dense_lengths(seq_len: int, ring_size: int, ulysses_size: int) -> tuple[int, ...]:
    """Every CP rank's token count of a dense sequence (cached: called on every layer)."""
    return Placement.dense(seq_len, ring_size, ulysses_size).shard_lengths


def resolve_backend(backend: object, q: Tensor, mask: Mask, softcap: float, where: str) -> KernelBackend:
    """The kernel backend for a backend argument (a name or an object) and the call's options.

    Raises:
        ValueError: an unknown name, a non-backend object, or a backend that cannot run the call.
    """
    # Mask slices make blocks with one-sided windows (Note [Mask slices]).
    window = mask.window != (-1, -1) or mask.slices is not None
    if isinstance(backend, str):
        try:
            return get_backend(backend, q.device, q.dtype, window=window, softcap=softcap > 0, alibi=mask.alibi)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not isinstance(backend, KernelBackend):
        raise ValueError(
            f"{where}: backend must be a backend name (e.g. 'auto') or a seqpar KernelBackend, got "
            f"{type(backend).__name__}"
        )
    reason = backend.unsupported_reason(q.device, q.dtype, window=window, softcap=softcap > 0, alibi=mask.alibi)
    if reason is not None:
        raise ValueError(f"{where}: backend {backend.name!r} cannot run this call: {reason}")
    return backend


def build_call(
    qb: Tensor, kb: Tensor, vb: Tensor, state: ParallelState, seq_lens: tuple[int, ...],
    free: tuple[int, ...] | None, mask: Mask, backend: KernelBackend, scale: float, softcap: float,
    prefix: int = 0, suffix: int = 0, alibi: Tensor | None = None,
) -> PreparedCall:
    """The :class:`PreparedCall` of validated bshd tensors and a known placement (no checks, no
    collective): the last step of :func:`prepare_dense` / :func:`prepare_varlen`, and how the
    compiled backward rebuilds its forward's call. ``mask`` is already normalised for the longest
    sequence (``Mask.normalised(max(seq_lens))``), as the backend was resolved for it; ``alibi``:
    the checked ``[H]`` slopes when ``mask.alibi``."""
    R, U = state.ring_size, state.ulysses_size
    placement, plan = _cached_plan(seq_lens, free, R, U, state.ring_rank, mask, qb.shape[0] == 1)
    if mask.alibi != (alibi is not None):
        raise RuntimeError("seqpar internal error: ALiBi slopes and the mask's alibi flag disagree")
    ring = RingSetup(
        state.ring_group, plan, backend, scale, softcap, state.workspace, alibi=alibi,
        overlap=state.ring_comm != "p2p_serial",
    )
    if state.ring_comm == "allgather" and R > 1:
        gather = _cached_gather(seq_lens, free, R, U, state.ring_rank, mask, qb.shape[0] == 1)
        ring = AllGatherSetup(ring, gather)
    ulysses = None
    if U > 1:
        ulysses = UlyssesSetup.build(
            state.ulysses_group, placement.ulysses_sizes(state.ring_rank), qb.shape[2], kb.shape[2], state.workspace,
            state.keep_head_shards,
        )
    replicated = ReplicatedSetup(state.cp_group, backend, scale, softcap) if prefix or suffix else None
    return PreparedCall(qb, kb, vb, state, HybridSetup(ring, ulysses, replicated, prefix, suffix), seq_lens, free)


_REFUSED = 2  # the problem code of a rank that refuses the call (refuse_collectively)
_DENSE_SIGNATURE = 21  # ints in the signature of a dense call (see prepare_dense); shorter ones are padded


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


def _exchange_lengths(
    local: int, problem: int, signature: Callable[[], list[int]], names: str, state: ParallelState,
    device: torch.device, where: str, expected: str = "its share of the call",
) -> list[int]:
    """Every CP rank's ``local`` length, after checking that all ranks share ``signature()`` and
    that none reported a ``problem`` (nonzero; ``expected`` says what was expected). Every rank
    raises the same ``ValueError``."""
    sig = signature()
    if len(sig) > _DENSE_SIGNATURE:
        raise RuntimeError(f"seqpar internal error: a call signature has {len(sig)} ints, more than {_DENSE_SIGNATURE}")
    # Every exchange sends rows of one length (refuse_collectively's too), whatever the call.
    sig = [*sig, *([-1] * (_DENSE_SIGNATURE - len(sig)))]
    rows = exchange_ints([local, problem, *sig], state.cp_group, device)
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
    local: int, state: ParallelState, seq_len: int | None, mask: Mask, signature: Callable[[], list[int]],
    names: str, device: torch.device, where: str,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``(seq_lens, free_lengths)`` of the sharded tokens, per Note [Global length]."""
    R, U, me = state.ring_size, state.ulysses_size, state.cp_rank
    collective = collective_checks(state, device, seq_len is not None)
    if seq_len is not None:
        want = _dense_lengths(seq_len, R, U)
        if collective:  # a wrong length raises on every rank, not only here
            expected = f"seq_len={seq_len} over ring {R} x ulysses {U} places {list(want)}"
            _exchange_lengths(local, int(local != want[me]), signature, names, state, device, where, expected)
        elif local != want[me]:
            raise ValueError(
                f"{where}: cp rank {me} holds {local} tokens, but seq_len={seq_len} over ring {R} x "
                f"ulysses {U} places {want[me]} there (all ranks: {list(want)}); shard inputs with "
                "seqpar.shard(x, state, dim=<sequence dim>) or pass the right seq_len"
            )
        return (seq_len,), None
    if state.cp_size == 1:
        return (local,), None
    got = _exchange_lengths(local, 0, signature, names, state, device, where)
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


def _slopes_digest(slopes: Tensor | None) -> int:
    """A 62-bit hash of the ALiBi slopes' values (-1 without), so ranks given other slopes disagree."""
    if slopes is None:
        return -1
    data = slopes.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def prepare_dense(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, options: DenseOptions, backend: object,
    sinks: Tensor | None, where: str = "seqpar.attention", alibi_slopes: object = None,
) -> PreparedCall:
    """Validate the tensors of an :func:`seqpar.attention` call whose ``options`` are validated
    (:func:`check_dense_options`) and place its tokens (raises as :func:`seqpar.attention` does)."""
    require_state(state, where)
    o = options
    check_qkv(q, k, v, ndim=4, shape_doc=f"in layout {o.layout!r} ({', '.join(o.layout)})", where=where)
    qb, kb, vb = (to_bshd(t, o.layout) for t in (q, k, v))
    (B, S, H, D), (Bk, Sk, Hkv, Dk) = qb.shape, kb.shape

    def shapes() -> str:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (layout {o.layout!r})"

    if (Bk, Sk) != (B, S) or Dk != D:
        raise ValueError(
            f"{where}: {shapes()}: k must have q's batch size B={B}, local length S={S} and head "
            f"dim D={D} (k has B={Bk}, S={Sk}, D={Dk})"
        )
    if D < 1:
        raise ValueError(f"{where}: {shapes()}: the head dim must be positive, got D={D}")
    context = lambda: f"{shapes()}: "  # noqa: E731 -- built only when a check raises
    check_value_shape(kb.shape, vb.shape, "(B, S_local, Hkv)", where, context=context)
    check_gqa(H, Hkv, where, context=context)
    check_sinks(sinks, H, q, where)
    slopes = check_alibi_slopes(alibi_slopes, H, q, where)
    if slopes is not None and (o.prefix or o.suffix):
        raise ValueError(
            f"{where}: alibi_slopes with replicated_prefix/replicated_suffix: replicated tokens have "
            "no global position, so the ALiBi distance is undefined"
        )
    if o.prefix + o.suffix > S:
        raise ValueError(
            f"{where}: replicated_prefix={o.prefix} + replicated_suffix={o.suffix} exceed the {S} "
            "local tokens; q, k, v hold the replicated tokens and then this rank's shard"
        )
    scale = D ** -0.5 if o.softmax_scale is None else o.softmax_scale

    def signature() -> list[int]:
        return [
            B, H, Hkv, D, vb.shape[-1], _DTYPE_CODES.get(q.dtype, 0), int(o.causal), *o.window,
            -1 if o.chunk_size is None else o.chunk_size, o.prefix, o.suffix, int(sinks is not None),
            _bits(scale), _bits(o.softcap), LAYOUTS.index(o.layout), -1 if o.seq_len is None else o.seq_len,
            -1 if o.slices is None else o.slices.digest(), _slopes_digest(slopes), _head_groups_code(o.head_groups),
            _ring_comm_code(state),
        ]

    names = (
        "(B, H, Hkv, D, Dv, dtype, causal, window, chunk_size, prefix, suffix, sinks, scale, softcap, layout, "
        f"seq_len, mask slices hash, ALiBi slopes hash, head_groups (0: 'auto'), ring_comm {_RING_COMM_NAMES})"
    )
    mask = Mask(o.causal, o.window, o.chunk_size, o.slices, slopes is not None)
    body = S - o.prefix - o.suffix
    seq_lens, free = _dense_placement(body, state, o.seq_len, mask, signature, names, q.device, where)
    if o.slices is not None:
        check_slices_fit(o.slices, seq_lens[0], where)
    mask = mask.normalised(seq_lens[0])
    resolved = resolve_backend(backend, q, mask, o.softcap, where)
    return build_call(qb, kb, vb, state, seq_lens, free, mask, resolved, scale, o.softcap, o.prefix, o.suffix, slopes)


def check_slices_fit(slices: MaskSlices, seq_len: int, where: str) -> None:
    """Raise unless every slice lies within the ``seq_len`` positions of the sequence."""
    q_end, k_end = slices.extent
    if max(q_end, k_end) > seq_len:
        raise ValueError(
            f"{where}: the mask slices reach query position {q_end - 1} and key position {k_end - 1}, "
            f"but the sequence has {seq_len} tokens; build the slices for the global length "
            f"(e.g. MaskSlices.block_causal(frame sizes summing to {seq_len}))"
        )


def _seq_lens_digest(lens: tuple[int, ...]) -> list[int]:
    """``[count, sum, h1, h2]``: two 62-bit words of a BLAKE2 hash of every length, so ranks
    whose ``seq_lens`` differ anywhere disagree (no weighted moment that other lists can match)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(lens)}q", *lens), digest_size=16).digest()
    mask = (1 << 62) - 1
    return [len(lens), sum(lens), int.from_bytes(digest[:8], "little") & mask, int.from_bytes(digest[8:], "little") & mask]


def _looks_cumulative(lens: tuple[int, ...]) -> bool:
    """Whether ``lens`` reads like cumulative offsets (``cu_seqlens``) rather than lengths."""
    return len(lens) >= 2 and lens[0] == 0 and all(a <= b for a, b in zip(lens, lens[1:]))


def prepare_varlen(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, seq_lens: Sequence[int] | Tensor, *,
    causal: object, softmax_scale: object, backend: object, window: object, softcap: object,
    sinks: Tensor | None, chunk_size: object, where: str = "seqpar.varlen_attention", head_groups: object = 1,
) -> PreparedCall:
    """Validate a :func:`seqpar.varlen_attention` call and place its tokens (raises as it does).
    The call's tensors are the packed ones with a batch dim of one."""
    require_state(state, where)
    causal, window, chunk_size, softcap = check_mask_options(causal, window, chunk_size, softcap, where)
    check_scale(softmax_scale, where)
    head_groups = check_head_groups(head_groups, where)
    check_qkv(q, k, v, ndim=3, shape_doc="[T_local, heads, head_dim] as produced by seqpar.shard_packed", where=where)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, H, D], "
            "[T, Hkv, D], [T, Hkv, Dv] with the same T and D (Dv may differ from D)"
        )
    check_value_shape(k.shape, v.shape, "(T_local, Hkv)", where,
                      context=lambda: f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: ")
    T, H, D = q.shape
    Hkv = k.shape[1]
    check_gqa(H, Hkv, where)
    check_sinks(sinks, H, q, where)
    lens = check_seq_lens(seq_lens, where)
    R, U = state.ring_size, state.ulysses_size
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    mask = Mask(causal, window, chunk_size).normalised(max(lens, default=0))
    want = _cached_plan(lens, None, R, U, state.ring_rank, mask, True)[0].shard_lengths

    def signature() -> list[int]:
        return [
            *_seq_lens_digest(lens), H, Hkv, D, v.shape[-1], _DTYPE_CODES.get(q.dtype, 0),
            int(causal), *window, -1 if chunk_size is None else chunk_size, int(sinks is not None),
            _bits(scale), _bits(softcap), _head_groups_code(head_groups), _ring_comm_code(state),
        ]

    names = (
        "(seq_lens fingerprint: count, sum, hash x2; H, Hkv, D, Dv, dtype, causal, window, chunk_size, sinks, "
        f"scale, softcap, head_groups (0: 'auto'), ring_comm {_RING_COMM_NAMES})"
    )
    if collective_checks(state, q.device, lengths_known=True):
        got = _exchange_lengths(T, 0, signature, names, state, q.device, where)
    else:  # only this rank's count can be checked without communication
        got = [want[c] if c != state.cp_rank else T for c in range(state.cp_size)]
    if got != list(want):
        bad = next(c for c, (g, w) in enumerate(zip(got, want)) if g != w)
        hint = (
            f"; seq_lens {list(lens[:6])}{'...' if len(lens) > 6 else ''} look like cumulative offsets "
            "(cu_seqlens): pass the lengths, e.g. torch.diff(cu_seqlens)"
            if _looks_cumulative(lens) else ""
        )
        raise ValueError(
            f"{where}: seq_lens (sum {sum(lens)}, {len(lens)} sequences) place {want[bad]} tokens "
            f"on cp rank {bad} of ring {R} x ulysses {U} (placement {list(want)}), but it holds "
            f"{got[bad]} (tokens per cp rank: {got}); pass the global seq_lens of the packed batch "
            f"and shard q, k, v with seqpar.shard_packed{hint}"
        )
    resolved = resolve_backend(backend, q, mask, softcap, where)
    return build_call(q[None], k[None], v[None], state, lens, None, mask, resolved, scale, softcap)


def backend_name(backend: object, where: str) -> str:
    """A backend argument as the name the compiled operators take."""
    if isinstance(backend, str):
        return backend
    if isinstance(backend, KernelBackend):
        return backend.name
    raise ValueError(
        f"{where} under torch.compile: backend must be a name or a seqpar backend, got {type(backend).__name__}"
    )
