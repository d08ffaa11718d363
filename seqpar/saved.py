"""Saved tensors that a backward takes over and frees once it has used them.

Note [Saved tensors handed over]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Autograd frees a node's saved tensors when its backward *returns*. A Ulysses call without
``keep_head_shards`` saves its token shards of q, k, v and out, and its backward first exchanges
them to head shards (Note [Ulysses memory] in ``seqpar.parallel.ulysses``); from then on the
token shards are dead, but autograd would hold them through the kernels and the gradients'
all-to-all -- the peak of the backward. :class:`HandOver` lets the backward take them over:

- the autograd function is applied inside :class:`HandOver` (a context of saved-tensor hooks,
  ``torch.autograd.graph.saved_tensors_hooks``): each tensor it saves is packed into a holder of
  its data (a detached alias: no reference to the output's own autograd node, so no cycle);
- the backward unpacks them (``ctx.saved_tensors``), :meth:`HandOver.take` empties the holders,
  and the backward passes q, k, v and out on in a list that the exchange empties as it sends each
  one (``UlyssesSetup.to_heads_each``): each token shard is freed once sent, if nothing else holds
  it (with trained projections the output projection saves ``out`` itself, so only q, k and v
  go). The other saved tensors (LSEs, sinks) live on in the backward's own variables.

Its hooks stand aside -- the tensors stay with autograd, as without it -- whenever emptying
them could change a result or another tool's behaviour:

- other saved-tensor hooks are active at the forward (``torch.utils.checkpoint`` without
  reentrance, ``torch.autograd.graph.save_on_cpu``): those own the saved tensors;
- the graph is kept (``backward(retain_graph=True)``): a second backward needs them;
- this torch lacks either private entry point used here (checked once, at import).

Under other hooks the backward could still pass the tensors on without keeping references of
its own; non-reentrant checkpointing lets go of a recomputed tensor once it is unpacked, so the
token shards would go there too (measured on one rank of 1 x 4, four checkpointed layers of
``scripts/bench_memory.py``'s stack, Hkv = 2: peak 13.53 -> 11.03 token shards of x). It does
not, for now: with the attention moment that much lower, the peak of a checkpointed model is
another moment at short lengths and this one at long lengths, which bends the line that
``scripts/bench_longest.py`` fits and extrapolates (its tiny 2 x 2 validation ran over the line at
2.5 times the fitted lengths: ``docs/performance.md``, "Memory per rank"). The memory model has
to follow that change first.

Modifying a saved tensor in place between the forward and the backward raises, as autograd's own
check does (the versions are compared at unpacking).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HandOver"]

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


class _Holder:
    """One saved tensor's data and its version when saved; ``data`` None once taken."""

    __slots__ = ("data", "version", "shape")

    def __init__(self, t: Tensor) -> None:
        self.data: Tensor | None = t.detach()
        self.version = t._version
        self.shape = tuple(t.shape)


def _unpack(holder: _Holder) -> Tensor:
    if holder.data is None:
        raise RuntimeError(
            f"seqpar attention: a tensor saved for its backward (shape {holder.shape}) was already handed over "
            "to a backward; run the backward once, or pass retain_graph=True to keep the graph for another"
        )
    if holder.data._version != holder.version:
        raise RuntimeError(
            f"seqpar attention: a tensor saved for its backward (shape {holder.shape}) was modified by an "
            f"inplace operation (version {holder.version} at the forward, {holder.data._version} now); "
            "modify a copy instead"
        )
    return holder.data


class HandOver:
    """Saved-tensor hooks under which a custom autograd function is applied, so that its backward
    can take over what it saved (Note [Saved tensors handed over])::

        hand_over = HandOver()
        with hand_over:
            out = Function.apply(..., hand_over)   # the forward stores it on ctx
        # backward: q, k, v, out = ctx.saved_tensors; if ctx.hand_over.take(): pass them on in a
        # list the callee empties, holding no reference of its own

    Attributes:
        active: whether the hooks are in place (no other saved-tensor hooks at entry, and this
            torch has the entry points used); when False the context does nothing.
    """

    def __init__(self) -> None:
        self.holders: list[_Holder] = []
        self.active = _top_hooks is not None and _keep_graph is not None and _top_hooks(False) is None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack) if self.active else None

    def _pack(self, t: Tensor) -> _Holder:
        holder = _Holder(t)
        self.holders.append(holder)
        return holder

    def __enter__(self) -> HandOver:
        if self._hooks is not None:
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None  # one application only

    def take(self) -> bool:
        """Whether the backward now owns the tensors it unpacked: the holders are emptied, unless
        the graph is kept or nothing was held (then autograd keeps them, and this returns False)."""
        if not self.holders or _keep_graph():
            return False
        for holder in self.holders:
            holder.data = None
        return True
