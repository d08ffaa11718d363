"""Refuse a parallel diffusers model called with different inputs on its CP ranks.

Note [Same inputs on every CP rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``parallelize`` (:mod:`seqpar.integrations.diffusers`) is "full in, full out": every CP rank
passes the same full inputs and keeps its own part of the tokens. In a pipeline call the
transformer's main input is latent noise the pipeline draws from the caller's generator, so a
generator seeded per rank (``seed + rank``, a habit from data parallelism) or an RNG consumed
differently on one rank gives each rank other latents: every rank would then split its own noise
and the image would be wrong, silently. So each call of the parallel model first compares a
sample of its tensor inputs over the CP group: for the first :data:`MAX_INPUTS` tensor arguments
(positional, then keyword in name order), the element count and :data:`SAMPLES` entries at fixed
evenly spaced positions, all in one small all-gather. Entries that differ by more than
``RTOL`` times the largest sampled magnitude of that input (plus a tiny absolute slack) make the
call raise ``ValueError`` on every rank (all see the same rows). The tolerance lets through the
last-bit differences of inputs that ranks compute themselves (a VAE-encoded image under
nondeterministic kernels); different noise differs by O(1). It is a sample: it catches different
noise or a different prompt, not a difference confined to unsampled entries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..comm import all_gather
from ..state import ParallelState

__all__ = ["MAX_INPUTS", "SAMPLES", "same_inputs_hook"]

_WHERE = "seqpar.integrations.diffusers"
MAX_INPUTS = 8  # tensor arguments compared per call
SAMPLES = 16  # entries compared per tensor
RTOL = 1e-2  # relative to the largest sampled magnitude of that input
_ATOL = 1e-6


def _inputs(args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + sorted(kwargs.items())
    return [(name, t) for name, t in named if isinstance(t, Tensor)][:MAX_INPUTS]


def _row(inputs: list[tuple[str, Tensor]]) -> Tensor:
    """``MAX_INPUTS x (1 + SAMPLES)`` float64: each input's element count and sampled entries."""
    row = torch.zeros(MAX_INPUTS, 1 + SAMPLES, dtype=torch.float64)
    for i, (_, t) in enumerate(inputs):
        flat = t.detach().reshape(-1)
        row[i, 0] = flat.numel()
        if flat.numel():
            at = torch.linspace(0, flat.numel() - 1, SAMPLES, device=flat.device).round().long()
            row[i, 1:] = flat[at].to(device="cpu", dtype=torch.float64)
    return row


def same_inputs_hook(state: ParallelState, model: nn.Module) -> Callable:
    """A forward pre-hook (``with_kwargs=True``) for ``model``: raise unless the CP ranks' inputs agree.

    Raises (from the hook, on every CP rank):
        ValueError: an input whose element count or sampled entries differ between CP ranks
            (Note [Same inputs on every CP rank]).
    """
    name = type(model).__name__

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = _inputs(args, kwargs)
        device = next((t.device for _, t in inputs), torch.device("cpu"))
        with torch.no_grad():
            row = _row(inputs).to(device)
            rows = all_gather(row[None], state.cp_group, 0, [1] * state.cp_size).cpu()
        first = rows[0]
        for r in range(1, state.cp_size):
            for i in range(MAX_INPUTS):  # every slot, so that every rank takes the same decision
                arg = inputs[i][0] if i < len(inputs) else f"tensor input {i}"
                if rows[r, i, 0] != first[i, 0]:
                    what = f"{int(first[i, 0])} elements on cp rank 0, {int(rows[r, i, 0])} on cp rank {r}"
                else:
                    diff = float((rows[r, i, 1:] - first[i, 1:]).abs().max())
                    if diff <= RTOL * float(first[i, 1:].abs().max()) + _ATOL:
                        continue
                    what = f"cp ranks 0 and {r} differ by {diff:.3g} at sampled entries"
                raise ValueError(
                    f"{_WHERE}: the CP ranks called {name} with different inputs ({arg}: {what}). "
                    "Every CP rank must pass the same full inputs; in a pipeline, give every CP rank a "
                    "generator with the same seed (with data parallelism: seed + state.dp_rank, not + rank) "
                    "and the same prompt (docs/howto-diffusers.md, 'A whole pipeline')"
                )

    return hook
