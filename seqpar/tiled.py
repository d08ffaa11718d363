"""Token-wise work tiled over the sequence with recomputation: the lm-head loss and MLP-like modules.

Note [Tiled token-wise work]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Attention is not what limits the context a rank can hold: the logits of the language-model head
(``[T, V]``, ``V = 128256`` for Llama 3) and the MLP's intermediate (``~3.5 x`` the hidden states)
are. Both are token-wise -- each token's output depends on that token's input only -- so they can
run over chunks of tokens, one chunk's intermediates alive at a time, and be recomputed chunk by
chunk in backward:

- :func:`linear_cross_entropy_sum`: the projection ``hidden @ weight.T`` fused with the
  cross-entropy; forward keeps only each token's log-sum-exp (``T`` floats), backward recomputes
  one chunk's logits at a time. ``[T, V]`` logits never exist; the peak is ``chunk_size x V``.
  ``seqpar.training.linear_cross_entropy`` builds the CP loss share on it;
- :class:`TiledTokenwise`: any token-wise module over ``num_chunks`` chunks of the sequence, each
  under non-reentrant activation checkpointing, so its intermediates live for one chunk at a time
  in forward and in backward.

Both are exact: the same sums in another order (float64 tests compare them with the untiled
computation to rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["linear_cross_entropy_sum", "TiledTokenwise", "default_chunk_size"]


def default_chunk_size(num_tokens: int, vocab_size: int, *, budget_elements: int = 1 << 24) -> int:
    """Tokens per chunk so that one chunk's ``[chunk, V]`` fp32 logits hold at most
    ``budget_elements`` (64 MiB by default), at least 1 and at most ``num_tokens``."""
    return max(1, min(num_tokens, budget_elements // max(1, vocab_size)))


def _chunk_logits(h: Tensor, weight: Tensor) -> Tensor:
    """``[n, V]`` logits of one chunk, in at least float32."""
    logits = h @ weight.t()
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class _LinearCrossEntropySum(torch.autograd.Function):
    """Sum over valid tokens of ``cross_entropy(hidden @ weight.T, target)``, tiled (Note [Tiled
    token-wise work])."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, chunk_size: int, ignore_index: int) -> Tensor:
        T = hidden.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lse = torch.empty(T, dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        valid = target != ignore_index
        safe = target.masked_fill(~valid, 0)  # ignored labels (any int, also >= V) never index the vocab
        for a in range(0, T, chunk_size):
            b = min(T, a + chunk_size)
            logits = _chunk_logits(hidden[a:b], weight).to(acc)
            lse[a:b] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[a:b].unsqueeze(1)).squeeze(1)
            total += ((lse[a:b] - picked) * valid[a:b]).sum()
            del logits
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, target, lse = ctx.saved_tensors
        T, chunk = hidden.shape[0], ctx.chunk_size
        valid = target != ctx.ignore_index
        safe = target.masked_fill(~valid, 0)
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        for a in range(0, T, chunk):
            b = min(T, a + chunk)
            # d(lse - picked)/dlogits = softmax - onehot(target), zero on ignored tokens.
            g = _chunk_logits(hidden[a:b], weight).to(lse.dtype)  # a fresh [n, V]: updated in place
            g.sub_(lse[a:b, None]).exp_()
            rows = torch.arange(b - a, device=g.device)
            g[rows, safe[a:b]] -= 1.0
            g *= (valid[a:b] * grad).unsqueeze(1).to(g.dtype)
            if dh is not None:
                dh[a:b] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if dw is not None:
                # In place: ``dw += g.T @ h`` would allocate a second ``[V, hidden]`` product per chunk.
                dw.addmm_(g.t(), hidden[a:b].to(g.dtype))
            del g
        # No gradient for target, chunk_size, ignore_index.
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None


def linear_cross_entropy_sum(
    hidden: Tensor, weight: Tensor, target: Tensor, *, chunk_size: int | None = None, ignore_index: int = -100
) -> Tensor:
    """``sum`` over tokens whose target is not ``ignore_index`` of ``cross_entropy(hidden @ weight.T,
    target)``, without ever holding the ``[T, V]`` logits (Note [Tiled token-wise work]).

    Local: no communication (``seqpar.training.linear_cross_entropy`` adds the CP count).

    Args:
        hidden: ``(T, hidden_size)`` floating.
        weight: ``(V, hidden_size)``, the lm-head weight, hidden's dtype.
        target: ``(T,)`` int64 class ids in ``[0, V)`` or ``ignore_index``.
        chunk_size: tokens per chunk; ``None``: :func:`default_chunk_size`.
        ignore_index: target value excluded from the sum.

    Returns:
        A scalar in float32 (float64 for float64 inputs); differentiable w.r.t. ``hidden`` and
        ``weight``.

    Raises:
        ValueError: mismatched shapes or dtypes, a non-positive ``chunk_size``, or a target out
            of ``[0, V)`` that is not ``ignore_index``.
    """
    where = "linear_cross_entropy"
    if not all(isinstance(t, Tensor) for t in (hidden, weight, target)):
        raise ValueError(f"{where}: hidden, weight and labels must be tensors")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{where}: hidden {tuple(hidden.shape)} must be (tokens, hidden_size) and weight "
            f"{tuple(weight.shape)} (vocab_size, hidden_size) with the same hidden_size"
        )
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise ValueError(f"{where}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one float dtype")
    if target.shape != hidden.shape[:1] or target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(
            f"{where}: labels {tuple(target.shape)} ({target.dtype}) must be integer class ids, one per token "
            f"of hidden {tuple(hidden.shape)}"
        )
    V = weight.shape[0]
    target = target.long()
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        raise ValueError(
            f"{where}: label {int(target[bad][0])} is outside [0, {V}) and not ignore_index={ignore_index}"
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], V)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{where}: chunk_size must be a positive int or None, got {chunk_size!r}")
    return _LinearCrossEntropySum.apply(hidden, weight, target, chunk_size, ignore_index)


class TiledTokenwise(nn.Module):
    """A token-wise module (an MLP, a norm) run over ``num_chunks`` chunks of the sequence with
    recomputation: peak intermediate memory ``/ num_chunks`` (Note [Tiled token-wise work]).

    The wrapped module must treat tokens independently (no attention, no sequence-wide
    statistics): ``module(x)[..., i, :]`` may depend on ``x[..., i, :]`` only. Random ops
    (dropout) see each chunk once in forward and replay the same numbers in backward
    (``torch.utils.checkpoint`` preserves the RNG state).

    Args:
        module: the token-wise module; its parameters stay its own (this wrapper adds none).
        num_chunks: chunks of the sequence dim (a positive int; more chunks than tokens just
            means one token per chunk).
        dim: the sequence (token) dim of the input, default ``-2`` (``(..., S, hidden)``).

    Raises:
        ValueError: a non-module ``module`` or a ``num_chunks`` that is not a positive int.
    """

    def __init__(self, module: nn.Module, num_chunks: int, *, dim: int = -2) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"TiledTokenwise: module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"TiledTokenwise: num_chunks must be a positive int, got {num_chunks!r}")
        self.module, self.num_chunks, self.dim = module, num_chunks, dim

    def forward(self, x: Tensor) -> Tensor:
        """``module(x)`` computed chunk by chunk along ``dim``; shape as ``module(x)``."""
        if self.num_chunks == 1 or x.shape[self.dim] <= 1:
            return self.module(x)
        chunks = x.tensor_split(min(self.num_chunks, x.shape[self.dim]), dim=self.dim)
        if not torch.is_grad_enabled():
            return torch.cat([self.module(c) for c in chunks], dim=self.dim)
        return torch.cat([checkpoint(self.module, c, use_reentrant=False) for c in chunks], dim=self.dim)

    def extra_repr(self) -> str:
        return f"num_chunks={self.num_chunks}, dim={self.dim}"
