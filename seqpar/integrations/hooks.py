"""Forward-hook helpers shared by the integrations that make a model context-parallel in place.

- :class:`ContextHooks`: open a context manager (``seqpar.parallel_sdpa(state)``, ``local_sdpa()``)
  in a module's forward pre-hook and close it in an always-called forward hook;
- :func:`split_part` / :func:`gather_parts`: this rank's contiguous part of a full tensor along a
  dim (``split_sizes`` over the CP group) and the inverse all-gather, with partial gradients;
- :func:`refuse_empty_parts`: the check that every CP rank gets at least one token of a split.

Used by :mod:`seqpar.integrations.diffusers` and :mod:`seqpar.integrations.timm`; imports neither
library.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..comm import all_gather
from ..placement.sizes import offsets, split_sizes
from ..state import ParallelState

__all__ = ["ContextHooks", "gather_parts", "refuse_empty_parts", "split_part"]


class ContextHooks:
    """Open a context manager in a forward pre-hook and close it in an always-called forward hook.

    Args:
        make: builds a fresh context manager per forward call.

    Contexts are kept per thread, innermost last, so nested or re-entrant forwards each close
    their own. ``register(module)`` installs both hooks and returns their handles.
    """

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]) -> None:
        self._make = make
        self._open = threading.local()

    def enter(self, module: nn.Module, args: tuple) -> None:
        cm = self._make()
        cm.__enter__()
        stack = getattr(self._open, "stack", None)
        if stack is None:
            stack = self._open.stack = []
        stack.append(cm)

    def exit(self, module: nn.Module, args: tuple, output: object) -> None:
        stack = getattr(self._open, "stack", None)
        if stack:
            stack.pop().__exit__(None, None, None)

    def register(self, module: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        return [
            module.register_forward_pre_hook(self.enter),
            module.register_forward_hook(self.exit, always_call=True),
        ]


def split_part(x: Tensor, state: ParallelState, dim: int) -> Tensor:
    """This rank's contiguous part of ``x`` along ``dim`` (``split_sizes`` over the CP group).

    Backward puts this rank's gradient into zeros (a ``narrow``; no communication), so per-rank
    gradients of ``x`` sum over the CP group to its gradient.
    """
    sizes = split_sizes(x.shape[dim], state.cp_size)
    return x.narrow(dim, offsets(sizes)[state.cp_rank], sizes[state.cp_rank])


def gather_parts(x: Tensor, state: ParallelState, dim: int) -> Tensor:
    """All CP ranks' parts of ``x`` along ``dim``, in ``cp_rank`` order (any part sizes).

    Backward reduce-scatters: this rank's part of the gradient summed over the CP group.
    """
    if state.cp_size == 1:
        return x
    return all_gather(x, state.cp_group, dim)


def refuse_empty_parts(length: int, state: ParallelState, where: str, what: str) -> None:
    """Raise ``ValueError`` if splitting ``length`` tokens over the CP group leaves a rank without one.

    A model's code on a rank with no token at all fails in ways seqpar cannot repair (a reshape of
    zero elements with ``-1``, an index ``[-1]``), while the other ranks go on into a collective
    and wait for it. The decision depends on the full length only, which every CP rank sees, so
    every rank raises the same error before any of them runs the model on its part.

    Args:
        length: the number of tokens being split (the full tensor's size along the split dim).
        state: the parallel state whose CP group splits them.
        where: the message prefix (the integration).
        what: what is being split (``"input 'hidden_states' of ''"``).
    """
    if state.cp_size > 1 and length < state.cp_size:
        sizes = split_sizes(length, state.cp_size)
        raise ValueError(
            f"{where}: {what}: {length} tokens, fewer than the {state.cp_size} CP ranks (tokens per "
            f"cp rank: {sizes}), so cp rank {sizes.index(0)} would run the model on no token, which "
            f"the model's code does not support; use at least {state.cp_size} tokens, or a "
            f"ParallelState whose cp_size is at most {length}"
        )
