"""Which mode an adapted token mixer runs in on shards: head-parallel or state passing.

Note [Choosing the mixing mode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An adapter can make a mixer exact on shards in two ways (docs/hybrid-models.md):

- **head-parallel** (Note [Head-parallel mixing]): the mixer's per-token inputs go to whole
  sequences of ``H / N`` heads and its outputs come back, two all-to-alls. Each rank sends (and
  receives) about ``B * S_local * (C_in + C_out) * (N - 1) / N`` values per layer, linear in the
  length; the model's own kernel runs on whole sequences, bitwise as on one device. A rank past
  ``H`` gets no head and idles.
- **state passing** (Note [State passing]): every rank runs its own tokens and the ranks
  all-gather a few fixed-size summaries: each receives ``(N - 1) * pieces * B * (P + b)`` values
  (``P``, ``b`` a piece's transition and state, ``pieces`` 2 per sequence on a zig-zag ring, else
  1), plus a causal conv's ``K - 1`` token halo per piece; independent of ``S``. The recurrence
  runs about twice (summary, then the correction from the true initial state), and its rounding is
  not bitwise the one-device kernel's (pieces start where the shards do).

``mixing="auto"`` picks per call, the same on every rank (:func:`choose_mode`): state passing
when some rank would hold no head (``H < N``) or when its predicted bytes are fewer, else
head-parallel. The bytes compare at ``ceil(S / N)`` tokens per rank, ``S`` the global length (one
small exchange of local lengths when the head rule does not decide); ``B`` and the layer's sizes
are the same on every rank. Adapters without a state-passing form run head-parallel under
``"auto"``; asking them for ``"state_passing"`` is a ``ValueError`` when the adapters are
installed. The default is ``"head_parallel"``: the model's kernels bitwise, as on one device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...comm import exchange_ints
from ...mixing.state_passing import piece_counts
from ...state import ParallelState

__all__ = ["MODES", "MixerMode", "ModeChooser", "check_mixing", "choose_mode"]

MODES = ("auto", "head_parallel", "state_passing")
HEAD_PARALLEL, STATE_PASSING = "head_parallel", "state_passing"


def check_mixing(mixing: object, where: str) -> str:
    """``mixing`` if it names a mode; else ``ValueError`` listing the modes."""
    if not isinstance(mixing, str) or mixing not in MODES:
        raise ValueError(f"{where}: mixing must be one of {', '.join(map(repr, MODES))}, got {mixing!r}")
    return mixing


def choose_mode(heads: int, cp_size: int, head_parallel_bytes: int, state_passing_bytes: int) -> str:
    """The mode ``mixing="auto"`` runs (Note [Choosing the mixing mode]).

    Args:
        heads: ``H``, the heads the head-parallel mode splits over the ranks.
        cp_size: ``N``, the CP ranks.
        head_parallel_bytes, state_passing_bytes: the bytes each rank receives per layer call
            in either mode (:class:`MixerMode`).

    Returns:
        ``"state_passing"`` when ``heads < cp_size`` (some rank would hold no head) or its bytes
        are fewer, else ``"head_parallel"``.
    """
    if heads < cp_size or state_passing_bytes < head_parallel_bytes:
        return STATE_PASSING
    return HEAD_PARALLEL


@dataclass(frozen=True)
class MixerMode:
    """What one adapted mixer ran in its last call on shards (``mixing_modes``).

    Attributes:
        requested: the ``mixing`` it was installed with.
        mode: ``"head_parallel"`` or ``"state_passing"``.
        heads: ``H`` of the head-parallel split.
        cp_size: ``N``.
        tokens_per_rank: the local length the bytes are for (``ceil(S / N)`` where ``S`` was
            exchanged for ``"auto"``, else this rank's).
        head_parallel_bytes, state_passing_bytes: predicted bytes this rank receives in either
            mode for that call, forward (the backward moves the same again).
    """

    requested: str
    mode: str
    heads: int
    cp_size: int
    tokens_per_rank: int
    head_parallel_bytes: int
    state_passing_bytes: int


def pieces_per_rank(state: ParallelState) -> float:
    """Piece summaries a rank receives from each other rank per sequence, at most (the same on
    every rank): ``(total - fewest held) / (N - 1)`` over the placement of a long sequence.

    A piece is a run of consecutive tokens (Note [State passing]); the summaries travel in one
    uneven all-gather, so a rank receives every piece but its own. On a zig-zag ring each ring
    rank holds two chunks, cut over the Ulysses ranks: with an even Ulysses size every rank holds
    one piece, with an odd one the rank holding the cut between the chunks holds two."""
    return _pieces_received(state.ring_size, state.ulysses_size)


@functools.lru_cache(maxsize=None)
def _pieces_received(ring: int, ulysses: int) -> float:
    n = ring * ulysses
    if n == 1:
        return 0.0
    held = piece_counts((64 * n,), ring, ulysses)
    return (sum(held) - min(held)) / (n - 1)


class ModeChooser:
    """The mode one adapted module runs each call in, from its requested ``mixing``.

    ``pick`` gives ``(mode, seq_len)``: ``seq_len`` the global length where ``"auto"`` exchanged
    the local lengths to compare bytes (pass it on: the mode then needs no exchange of its own),
    else ``None``. The last call's :class:`MixerMode` is ``last``.
    """

    def __init__(self, state: ParallelState, mixing: str) -> None:
        self.state, self.requested = state, mixing
        self.last: MixerMode | None = None

    def pick(
        self, local: int, heads: int, head_parallel_per_token: int, state_passing_bytes: int, device: torch.device,
    ) -> tuple[str, int | None]:
        """Args: ``local``, this rank's tokens; ``head_parallel_per_token``, the bytes a token's
        inputs and outputs take (times the batch); ``state_passing_bytes``, this rank's bytes
        received in state-passing mode."""
        n = self.state.cp_size
        seq_len, tokens = None, local
        if self.requested == "auto" and heads >= n:  # the bytes decide: compare them at one length
            seq_len = sum(row[0] for row in exchange_ints([local], self.state.cp_group, device))
            tokens = math.ceil(seq_len / n)
        hp = tokens * head_parallel_per_token * (n - 1) // n
        state_passing_bytes = math.ceil(state_passing_bytes)
        mode = choose_mode(heads, n, hp, state_passing_bytes) if self.requested == "auto" else self.requested
        self.last = MixerMode(self.requested, mode, heads, n, tokens, hp, state_passing_bytes)
        return mode, seq_len
