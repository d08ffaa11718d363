"""Random numbers that agree across a CP group (dropout masks, label dropping, diffusion noise and
timesteps, drop-path).

Note [Randomness under context parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ranks of a CP group hold shards of the *same* samples, so every random decision about a
sample -- whether its caption is dropped, its diffusion timestep, whether a block is skipped
(drop-path) -- must be the same on all of them, and a random tensor over tokens (dropout mask,
diffusion noise) must be the shard of one tensor over the global sequence. DP replicas hold
different samples and should draw differently. Two ways to get there:

- :func:`cp_generator` ``(state, seed)``: a new generator seeded from ``seed`` and ``dp_rank``:
  the same stream on every rank of a CP group, another on each DP replica; no communication;
- :func:`synchronize` / :func:`synchronized`: copy CP rank ``src``'s generator state to every
  rank of the CP group (one small all-reduce), for code that draws from torch's default
  generator; the context manager puts each rank's own state back on exit.

Then draw the *global* tensor and shard it::

    g = seqpar.rng.cp_generator(state, seed=step)
    t = torch.rand(B, generator=g)                                   # timesteps: same on CP ranks
    noise = seqpar.shard(torch.randn(B, S, C, generator=g), state)   # this rank's noise tokens
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .comm import group_rank, group_size, reduce_
from .placement.sizes import as_int
from .state import ParallelState, require_state

__all__ = ["cp_generator", "synchronize", "synchronized"]

# Distinct DP replicas get seeds this far apart (a prime well above any dp_size).
_DP_STRIDE = 1_000_003



def cp_generator(state: ParallelState, seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``seed`` that is the same on every rank of a CP group and differs
    between DP replicas (Note [Randomness under context parallelism]); no communication.

    Args:
        state: the parallel state (its ``dp_rank`` enters the seed).
        seed: a non-negative int, the same on every rank (e.g. the step number).
        device: the generator's device.

    Returns:
        A new ``torch.Generator`` seeded with ``seed * 1000003 + dp_rank`` (modulo ``2**63``).

    Raises:
        ValueError: a bad ``state`` or a negative / non-int ``seed``.
    """
    require_state(state, "seqpar.rng.cp_generator")
    seed = as_int(seed, "seed", "seqpar.rng.cp_generator")
    g = torch.Generator(device=device)
    g.manual_seed((seed * _DP_STRIDE + state.dp_rank) % (1 << 63))
    return g


def synchronize(
    state: ParallelState,
    generator: torch.Generator | None = None,
    *,
    src: int = 0,
    device: torch.device | str | None = None,
) -> torch.Generator:
    """Give ``generator`` CP rank ``src``'s state on every rank of ``state.cp_group``.

    Collective over the CP group (one all-reduce of the state bytes); DP replicas keep their own
    states.

    Args:
        state: the parallel state.
        generator: the generator to synchronise (default: torch's default CPU generator).
        src: the CP rank whose state every rank takes.
        device: where the all-reduce's buffer lives: a device the process group supports (CUDA
            for NCCL). Default: the generator's device.

    Returns:
        ``generator`` (the default one if ``None`` was given), now identical across the CP group.

    Raises:
        ValueError: a bad ``state`` or ``src``.
    """
    require_state(state, "seqpar.rng.synchronize")
    src = as_int(src, "src", "seqpar.rng.synchronize")
    if src >= state.cp_size:
        raise ValueError(f"seqpar.rng.synchronize: src={src} is not a CP rank; valid: 0..{state.cp_size - 1}")
    if generator is None:
        generator = torch.default_generator
    if group_size(state.cp_group) == 1:
        return generator
    own = generator.get_state()  # uint8 bytes, on the host
    value = own.to(device=generator.device if device is None else device, dtype=torch.int64)
    if group_rank(state.cp_group) != src:
        value.zero_()
    reduce_(value, state.cp_group, op="sum")  # only src contributes
    generator.set_state(value.to(device="cpu", dtype=torch.uint8))
    return generator


@contextlib.contextmanager
def synchronized(state: ParallelState, *, src: int = 0, cuda: bool | None = None) -> Iterator[None]:
    """Inside the block, torch's default generators are CP rank ``src``'s on every CP rank; on
    exit each rank's own states come back (as ``torch.random.fork_rng``).

    Args:
        state: the parallel state (collective over its CP group on entry).
        src: the CP rank whose states are used.
        cuda: also the current CUDA device's default generator, and the all-reduces run on that
            device (default: when CUDA is available; pass ``False`` for gloo groups of CPU
            tensors on a machine with GPUs).

    Raises:
        ValueError: a bad ``state`` or ``src``.
    """
    require_state(state, "seqpar.rng.synchronized")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    devices = [torch.cuda.current_device()] if cuda else []
    device = torch.device("cuda", devices[0]) if cuda else torch.device("cpu")
    with torch.random.fork_rng(devices=devices):
        synchronize(state, src=src, device=device)
        if cuda:
            synchronize(state, torch.cuda.default_generators[devices[0]], src=src, device=device)
        yield
