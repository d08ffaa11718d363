"""Run ``torch.nn.functional.scaled_dot_product_attention`` on sequence shards.

``parallel_sdpa(state)`` makes every ``F.scaled_dot_product_attention`` call of the current thread
compute exact full-sequence attention over ``state`` (``seqpar.attention(..., layout="bhsd")``),
so a ViT / video DiT written against SDPA runs context-parallel once its tokens are sharded::

    tokens = seqpar.shard(model.embed(video), state)        # [B, S_local, C]
    with seqpar.parallel_sdpa(state):
        tokens = model.blocks(tokens)                        # every SDPA call is now global
    out = seqpar.unshard(tokens, state, size=S)

Note [SDPA patch]
~~~~~~~~~~~~~~~~~
The patch is the one piece of process-wide state in seqpar and is kept as small as possible:

- ``torch.nn.functional.scaled_dot_product_attention`` is replaced by ``_dispatch`` while at
  least one ``parallel_sdpa`` context is open in *any* thread (a reference count under a lock);
  the exact original object is put back when the count returns to zero, also on exceptions.
- Which state a call uses is **thread-local**: each thread has its own stack of active entries.
  A thread with no open context (or whose innermost entry is :func:`local_sdpa`) gets the original
  SDPA, so other threads are never affected. Contexts nest; the innermost wins.

What the patch reaches and what it refuses (``docs/howto-dit.md`` has the table):

- ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``: reached through SDPA with
  ``need_weights=False``; while a context is open the native fused fast path
  (``torch.backends.mha``) is switched off process-wide, so eval/inference mode goes through
  SDPA too; ``need_weights=True`` (attention weights over a sharded sequence) is refused;
- a thread started while a context is open calls SDPA without a context of its own: refused
  (open ``parallel_sdpa`` or ``local_sdpa`` in that thread); threads that existed before are
  untouched;
- ``torch.utils.checkpoint(..., use_reentrant=True)``: its recomputation would run wherever the
  backward runs, usually outside the context, as plain local attention -- refused at the
  forward; use ``use_reentrant=False`` with
  ``context_fn=lambda: (contextlib.nullcontext(), seqpar.parallel_sdpa(state))``;
- contexts nest and may be exited in any order (each exit removes its own entry).

Not reached (no error is possible, the call never comes through SDPA): names bound before the
patch, e.g. ``from torch.nn.functional import scaled_dot_product_attention`` at import time, or
``torch._C._nn.scaled_dot_product_attention`` (call :func:`scaled_dot_product_attention` of this
module there instead); attention written as explicit matmuls + softmax (e.g. timm with
``fused_attn=False``); graphs already captured by ``torch.compile`` / ``torch.jit``.

Every SDPA call under the context is treated as **self-attention over sequence shards**: q, k and
v must all be this rank's shards of the same global sequence. Cross-attention to replicated
context (text tokens) is local per rank -- run it inside :func:`local_sdpa`; calls whose query and
key lengths differ are rejected rather than guessed (on every rank, when the call checks
collectively, so that a rank whose lengths happen to match does not go on alone). A cross-attention
whose context length equals the local length on *every* rank cannot be told from self-attention
by shapes: such calls must be wrapped in :func:`local_sdpa`. Joint attention over replicated text tokens
concatenated with sharded image tokens (Flux, SD3) is exact with ``replicated_prefix`` /
``replicated_suffix`` (Note [Replicated tokens]). A boolean ``attn_mask`` over the *global* sequence
whose rows each attend one key range (block-causal frames, a prefix-LM prompt) runs exactly as
:class:`~seqpar.MaskSlices`; any other mask is refused (use ``is_causal``, or ``seqpar.attention``
with ``window`` / ``chunk_size`` / ``mask``).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from .placement.masks import MaskSlices
from .placement.sizes import as_int
from .state import ParallelState, require_state

__all__ = ["parallel_sdpa", "local_sdpa", "scaled_dot_product_attention"]

# See Note [SDPA patch]: the patch bookkeeping (install count, original function) and the
# per-thread stacks of active states (``None`` = plain SDPA, as in ``local_sdpa``).
_LOCK = threading.Lock()
_PATCH: dict[str, object] = {"count": 0, "original": None, "mha": None, "fastpath": None, "threads": {}}
_THREAD = threading.local()


@dataclass(frozen=True)
class _Entry:
    """One open ``parallel_sdpa`` context: the options its SDPA calls run with."""

    state: ParallelState
    seq_len: int | None
    backend: str
    replicated_prefix: int
    replicated_suffix: int
    token: object = field(default_factory=object, compare=False)


def _stack() -> list[tuple[object, _Entry | None]]:
    """This thread's open contexts, innermost last: ``(slot mark, entry)``, entry ``None`` for
    :func:`local_sdpa` (plain SDPA)."""
    stack = getattr(_THREAD, "stack", None)
    if stack is None:
        stack = _THREAD.stack = []
    return stack


def _original_sdpa():
    return _PATCH["original"]


def _global_mask(
    attn_mask: Tensor, query: Tensor, is_causal: bool, seq_len: int | None, state: ParallelState
) -> tuple[MaskSlices, int]:
    """``(slices, S)`` of a boolean ``attn_mask`` over the global sequence of ``S`` tokens."""
    where = "parallel_sdpa"
    if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
        got = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
        raise ValueError(
            f"{where}: attn_mask must be a boolean mask over the global sequence, got {got}; an additive "
            "float mask cannot be checked to be a pattern seqpar runs exactly: pass a bool mask, "
            "is_causal=True, or seqpar.attention with window= / chunk_size= / mask=seqpar.MaskSlices(...)"
        )
    if is_causal:
        raise ValueError(f"{where}: attn_mask and is_causal=True together (SDPA refuses them too)")
    if attn_mask.dim() < 2 or attn_mask.shape[-1] != attn_mask.shape[-2]:
        raise ValueError(f"{where}: attn_mask {tuple(attn_mask.shape)} must end in a square (S, S) over the global sequence")
    S, s_q = attn_mask.shape[-1], query.shape[-2]
    if state.cp_size > 1 and S == s_q:
        raise ValueError(
            f"{where}: attn_mask is ({S}, {S}), the size of this rank's {s_q} local tokens; on sequence "
            "shards the mask must cover the global sequence (S x S, the same on every rank)"
        )
    if seq_len is not None and seq_len != S:
        raise ValueError(f"{where}: attn_mask covers {S} tokens but seq_len={seq_len}")
    flat = attn_mask.reshape(-1, S, S)
    if flat.shape[0] > 1 and not bool((flat == flat[:1]).all()):
        raise ValueError(
            f"{where}: attn_mask {tuple(attn_mask.shape)} differs between batch rows or heads; only one "
            "mask for the whole call runs on shards"
        )
    return MaskSlices.from_bool(flat[0], where=where), S


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    state: ParallelState,
    seq_len: int | None = None,
    backend: str = "auto",
    replicated_prefix: int = 0,
    replicated_suffix: int = 0,
) -> Tensor:
    """``F.scaled_dot_product_attention`` with the same arguments, on sequence shards over ``state``.

    Args:
        query: ``(..., H, S_local, D)``, this rank's shard of the query sequence (``seqpar.shard``
            along the sequence dim of the tokens the projections ran on).
        key: ``(..., Hkv, S_local, D)``, the shard of the same global sequence.
        value: ``(..., Hkv, S_local, Dv)``.
        attn_mask: ``None``, or a boolean mask over the *global* sequence, ``(S, S)`` (leading
            dims of one, or identical for every batch row and head), whose rows each attend one
            contiguous key range: block-causal video frames, a prefix-LM prompt, causal staircases.
            It runs exactly as :class:`~seqpar.MaskSlices` (``MaskSlices.from_bool``); any other
            mask raises (``docs/masks.md``).
        dropout_p: must be ``0.0`` (SDPA applies dropout whenever ``dropout_p > 0``, even in
            eval mode; dropout is not supported on shards).
        is_causal: causal over the *global* sequence (as SDPA on the unsharded sequence).
        scale: softmax scale, default ``D ** -0.5``.
        enable_gqa: as in SDPA; required when ``Hkv != H`` (``H % Hkv == 0``).
        state: the parallel state the shards live on.
        seq_len: the global length of the sharded tokens if known (saves ``seqpar.attention``
            one small collective per call); ``None`` lets it find out.
        backend: attention backend for ``seqpar.attention``.
        replicated_prefix, replicated_suffix: leading / trailing tokens of q, k, v that are the
            same on every rank (joint attention's text), as in ``seqpar.attention``.

    Returns:
        ``(..., H, S_local, Dv)``: this rank's shard of SDPA over the full sequence, in the
        input dtype. Gradients follow seqpar's partial-gradient convention.

    Raises:
        ValueError: an ``attn_mask`` that is not such a global boolean mask; ``enable_gqa=False``
            with ``Hkv != H``;
            ``H % Hkv != 0``; fewer than 3 dims; leading dims or query/key lengths that differ
            (cross-attention to replicated context belongs in :func:`local_sdpa`).
        NotImplementedError: ``dropout_p > 0``.
    """
    slices = None
    if attn_mask is not None:
        slices, seq_len = _global_mask(attn_mask, query, is_causal, seq_len, state)
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"parallel_sdpa: dropout_p={dropout_p} is not supported on sequence shards; set the "
            "attention dropout to 0 (SDPA applies dropout whenever dropout_p > 0, even in eval mode)"
        )
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "parallel_sdpa: expected query/key/value of shape (..., heads, seq, head_dim) with the "
            f"same number of dims, got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    lead = query.shape[:-3]
    if key.shape[:-3] != lead or value.shape[:-3] != lead:
        raise ValueError(
            f"parallel_sdpa: leading (batch) dims differ: query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}; broadcasting is not supported"
        )
    heads, s_q = query.shape[-3], query.shape[-2]
    heads_kv, s_k = key.shape[-3], key.shape[-2]
    if s_q != s_k or value.shape[-2] != s_k:
        from .attention import refuse_collectively

        refuse_collectively(state, query.device, seq_len, ValueError(
            f"parallel_sdpa: query has {s_q} local tokens but key/value have {s_k}/"
            f"{value.shape[-2]}; under parallel_sdpa every SDPA call is self-attention over "
            "sequence shards. Cross-attention to replicated context is exact per rank: run it "
            "inside seqpar.sdpa.local_sdpa()"
        ))
    if heads_kv != heads:
        if not enable_gqa:
            raise ValueError(
                f"parallel_sdpa: query has {heads} heads but key/value have {heads_kv}; pass "
                "enable_gqa=True for grouped-query attention (as SDPA requires)"
            )
        if heads_kv == 0 or heads % heads_kv != 0:
            raise ValueError(
                f"parallel_sdpa: {heads} query heads are not a multiple of {heads_kv} key/value heads"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])

    from .attention import attention  # lazy: keeps this module importable on its own

    # Fold the leading dims into one batch dim (SDPA's 3-D form (H, S, D) becomes batch 1).
    q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    out = attention(
        q,
        k,
        v,
        state,
        causal=bool(is_causal),
        softmax_scale=scale,
        layout="bhsd",
        backend=backend,
        seq_len=seq_len,
        replicated_prefix=replicated_prefix,
        replicated_suffix=replicated_suffix,
        mask=slices,
    )
    return out.reshape(*lead, *out.shape[1:])


def _dispatch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The patched ``F.scaled_dot_product_attention``: seqpar for this thread's active state."""
    stack = _stack()
    top = stack[-1][1] if stack else None
    if not stack:
        _refuse_new_thread()
    if top is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and _in_reentrant_checkpoint():
        raise RuntimeError(
            "parallel_sdpa: scaled_dot_product_attention inside torch.utils.checkpoint(..., "
            "use_reentrant=True): the backward would recompute it wherever backward runs, usually "
            "outside this context, as plain per-rank attention. Use use_reentrant=False with "
            "context_fn=lambda: (contextlib.nullcontext(), seqpar.parallel_sdpa(state))"
        )
    if top is None:
        kwargs = {"scale": scale} if scale is not None else {}
        if enable_gqa:
            kwargs["enable_gqa"] = True
        return _original_sdpa()(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs
        )
    stack.append((None, None))  # an SDPA call made by seqpar itself must not recurse into seqpar
    try:
        return scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            state=top.state,
            seq_len=top.seq_len,
            backend=top.backend,
            replicated_prefix=top.replicated_prefix,
            replicated_suffix=top.replicated_suffix,
        )
    finally:
        stack.pop()


_CHECKPOINT_FORWARD = getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None)


def _in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint``'s reentrant forward."""
    code = getattr(_CHECKPOINT_FORWARD, "__code__", None)
    frame = sys._getframe(2)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _refuse_new_thread() -> None:
    """Raise if this thread started while a context was open in another thread (it would silently
    get plain per-rank attention on sequence shards)."""
    me = threading.get_ident()
    with _LOCK:
        started_inside = any(me not in alive for alive in _PATCH["threads"].values())
    if started_inside:
        raise RuntimeError(
            "parallel_sdpa: scaled_dot_product_attention called from a thread started while a "
            "parallel_sdpa context was open in another thread; contexts are per thread, so this call "
            "would be plain per-rank attention. Open seqpar.parallel_sdpa(state) in this thread (or "
            "seqpar.local_sdpa() for attention that is not over the sharded sequence)"
        )


def _patched_mha_forward(*args, **kwargs):
    """``F.multi_head_attention_forward`` while patched: refuse attention weights on shards."""
    stack = _stack()
    need_weights = args[15] if len(args) > 15 else kwargs.get("need_weights", True)  # its 16th parameter
    if stack and stack[-1][1] is not None and need_weights:
        raise NotImplementedError(
            "parallel_sdpa: nn.MultiheadAttention with need_weights=True (its default) computes "
            "attention weights over the local shard only; call it with need_weights=False, which "
            "runs scaled_dot_product_attention over the global sequence"
        )
    return _PATCH["mha"](*args, **kwargs)


def _install(entry: _Entry | None) -> None:
    with _LOCK:
        if _PATCH["count"] == 0:
            current = F.scaled_dot_product_attention
            if current is not _dispatch:  # (a stale _dispatch may have been put back by others)
                _PATCH["original"] = current
            F.scaled_dot_product_attention = _dispatch
            if F.multi_head_attention_forward is not _patched_mha_forward:
                _PATCH["mha"] = F.multi_head_attention_forward
            F.multi_head_attention_forward = _patched_mha_forward
            # The native fused MHA / encoder-layer path bypasses SDPA (eval and inference mode).
            _PATCH["fastpath"] = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _PATCH["count"] += 1
        if entry is not None:
            _PATCH["threads"][id(entry.token)] = {t.ident for t in threading.enumerate()}


def _uninstall(entry: _Entry | None) -> None:
    with _LOCK:
        _PATCH["count"] -= 1
        if entry is not None:
            _PATCH["threads"].pop(id(entry.token), None)
        # Restore only our own patch: if someone patched on top of it, leave theirs. ``_dispatch``
        # keeps forwarding to the original when no context is active, so a stale copy is harmless.
        if _PATCH["count"] == 0:
            if F.scaled_dot_product_attention is _dispatch:
                F.scaled_dot_product_attention = _PATCH["original"]
            if F.multi_head_attention_forward is _patched_mha_forward:
                F.multi_head_attention_forward = _PATCH["mha"]
            torch.backends.mha.set_fastpath_enabled(_PATCH["fastpath"])


@contextlib.contextmanager
def _push(entry: _Entry | None) -> Iterator[None]:
    _install(entry)
    stack = _stack()
    mark = object()  # this context's own slot: exits in any order remove only their own entry
    stack.append((mark, entry))
    try:
        yield
    finally:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is mark:
                del stack[i]
                break
        _uninstall(entry)


def parallel_sdpa(
    state: ParallelState,
    *,
    seq_len: int | None = None,
    backend: str = "auto",
    replicated_prefix: int = 0,
    replicated_suffix: int = 0,
) -> contextlib.AbstractContextManager[None]:
    """Context manager: ``F.scaled_dot_product_attention`` runs over sequence shards of ``state``.

    Inside the context (in this thread), ``F.scaled_dot_product_attention(q, k, v, is_causal=...,
    scale=..., enable_gqa=...)`` on ``[B, H, S_local, D]`` shards returns this rank's shard of the
    exact attention over the global sequence (see :func:`scaled_dot_product_attention` for the
    accepted arguments). Outside, SDPA is untouched; contexts nest (innermost wins) and the
    original function is restored exactly on exit, also on exceptions. See Note [SDPA patch] for
    thread-safety and what the patch does not reach.

    Args:
        state: the parallel state the token shards live on (``seqpar.shard`` placement).
        seq_len: the global length of every sharded sequence attended under the context, if
            known: saves one small collective per SDPA call (a call on another length raises).
        backend: attention backend passed to ``seqpar.attention``.
        replicated_prefix, replicated_suffix: every SDPA call under the context is joint
            attention whose first / last tokens are replicated on every rank (the text tokens of
            Flux / SD3 blocks, concatenated before or after the sharded image tokens).

    Raises:
        ValueError: if ``state`` is not a ``ParallelState``. Calls under the context raise
            ``ValueError`` / ``NotImplementedError`` for masks, dropout and mismatched shapes.

    Example::

        x = seqpar.shard(tokens, state)          # [B, S_local, C]
        with seqpar.parallel_sdpa(state):
            y = vit_blocks(x)
        loss_share = (y * seqpar.shard(target, state)).sum()
    """
    require_state(state, "parallel_sdpa")
    if seq_len is not None:
        seq_len = as_int(seq_len, "seq_len", "parallel_sdpa")
    prefix = as_int(replicated_prefix, "replicated_prefix", "parallel_sdpa")
    suffix = as_int(replicated_suffix, "replicated_suffix", "parallel_sdpa")
    return _push(_Entry(state, seq_len, backend, prefix, suffix))


def local_sdpa() -> contextlib.AbstractContextManager[None]:
    """Context manager: plain (per-rank) SDPA inside an open :func:`parallel_sdpa` context.

    Use it for attention that is not over the sharded sequence, e.g. cross-attention of image
    tokens (sharded queries) to replicated text tokens, which is exact per rank: each rank's
    gradient of the replicated keys/values is partial and sums over the CP group, as seqpar's
    gradient convention requires.
    """
    return _push(None)
