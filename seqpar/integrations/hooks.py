"""Forward-hook helpers shared by the integrations that make a model context-parallel in place.

- :class:`ContextHooks`: open a context manager (``seqpar.parallel_sdpa(state)``, ``local_sdpa()``)
  in a module's forward pre-hook and close it in an always-called forward hook;
- :func:`split_part` / :func:`gather_parts`: this rank's contiguous part of a full tensor along a
  dim (``split_sizes`` over the CP group) and the inverse all-gather, with partial gradients.

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

__all__ = ["ContextHooks", "gather_parts", "split_part"]


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
