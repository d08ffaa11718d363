"""Packed batches (transformers' flattened rows) in the transformers integration.

Note [Packed sequences in transformers models]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' packed format (``DataCollatorWithFlattening``) is one row of concatenated
sequences: ``input_ids`` ``[1, T]``, ``position_ids`` restarting at 0 in every sequence, and the
flash-attn kwargs ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``[nseq + 1]`` int boundaries),
``max_length_q`` / ``max_length_k`` and, for Mamba2 models, ``seq_idx`` (``[1, T]``: each token's
sequence). A model hands these kwargs unchanged from its forward to every decoder layer and on to
the layer's attention and mixer modules. On shards every rank passes its ``seqpar.shard_packed``
share of ``input_ids``, ``position_ids`` (and ``seq_idx``), and the *global* boundaries, the same
on every rank, so that every layer knows the whole batch's sequences:

- the model check (Note [transformers model checks]) carries :func:`packed_call`'s row in its one
  exchange: every CP rank must pass packed kwargs or none; models with a token mixer that does not
  run packed batches are refused (from structure, the same on every rank); the boundaries must be
  the same on every rank (a fingerprint), well formed, and place exactly each rank's token count
  with its positions within each sequence (``shard_packed_positions``). Every rank raises the same
  error, before any layer runs;
- the attention function runs ``seqpar.varlen_attention`` with those lengths and the layer's mask
  (causal, window, chunk: within each sequence), softcap and sinks. Restarting positions make
  transformers wrap the mask function for packed sequences (one run per stretch of consecutive
  positions); on a shard the runs are pieces of sequences, so seqpar unwraps the wrapper and marks
  the mask ``packed``: the positions were checked against the boundaries by the model check. A
  ``packed`` mask without ``cu_seq_lens_q`` is refused (positions that are neither global
  positions nor a declared packing);
- the gated delta nets run their conv and rule per sequence (Note [Gated delta net on shards]),
  and the Mamba2 mixers their conv and SSD scan (Note [Mamba adapters]), on one rank too:
  transformers' torch fallbacks ignore the boundaries (a token would read the previous
  sequence's conv history and recurrent state).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..placement import Placement
from ..state import ParallelState
from .transformers_mixers import install
from .transformers_mixers.gated_delta import runs_packed
from .transformers_shared import _describe

__all__ = ["PACKED_KWARGS", "PackedCall", "packed_call", "packed_lengths"]

# transformers' packed-batch kwargs (DataCollatorWithFlattening): honoured together, with the
# global cu_seq_lens_q (Note [Packed sequences in transformers models]); refused anywhere else.
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_PACKED_OK, _PACKED_BAD, _PACKED_BATCH, _PACKED_NO_POSITIONS, _PACKED_POSITIONS, _PACKED_SEQ_IDX = range(6)


def _ints(value: object, name: str, where: str) -> list[int]:
    """A 1-D int tensor or list as a list of ints; ValueError otherwise."""
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(
                f"{where}: {name} must be a 1-D integer tensor [nseq + 1], got {value.dtype} {tuple(value.shape)}"
            )
        return [int(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value]
    raise ValueError(f"{where}: {name} must be a 1-D integer tensor [nseq + 1], got {_describe(value)}")


def packed_lengths(kwargs: dict[str, Any], batch: int, where: str) -> tuple[int, ...]:
    """The global sequence lengths of a packed call's kwargs (``cu_seq_lens_q`` given).

    Raises:
        ValueError: boundaries that do not start at 0 or decrease, ``cu_seq_lens_k`` other than
            ``cu_seq_lens_q`` (self-attention), ``max_length_q`` / ``max_length_k`` below the
            longest sequence, a batch of more than one row.
    """
    cu = _ints(kwargs["cu_seq_lens_q"], "cu_seq_lens_q", where)
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(
            f"{where}: cu_seq_lens_q {cu[:8]}{'...' if len(cu) > 8 else ''} are not cumulative sequence "
            "boundaries (0 first, never decreasing); pass [0, len_0, len_0 + len_1, ...] of the whole batch"
        )
    seq_lens = tuple(b - a for a, b in zip(cu, cu[1:]))
    if kwargs.get("cu_seq_lens_k") is not None and _ints(kwargs["cu_seq_lens_k"], "cu_seq_lens_k", where) != cu:
        raise ValueError(
            f"{where}: cu_seq_lens_k differs from cu_seq_lens_q; packed self-attention has the same "
            "boundaries for queries and keys"
        )
    longest = max(seq_lens, default=0)
    for name in ("max_length_q", "max_length_k"):
        value = kwargs.get(name)
        if value is not None and int(value) < longest:
            raise ValueError(
                f"{where}: {name}={int(value)} but the longest sequence of cu_seq_lens_q has {longest} tokens"
            )
    if batch != 1:
        raise ValueError(
            f"{where}: a packed batch is one row [1, T_local] (transformers' DataCollatorWithFlattening), "
            f"got {batch} rows"
        )
    return seq_lens


def _crc(values: object) -> int:
    return zlib.crc32(repr(values).encode())


@dataclass(frozen=True)
class PackedCall:
    """One rank's packed-batch kwargs of a model call, for the model check (Note [Packed
    sequences in transformers models]). ``row`` is what it tells the other CP ranks."""

    given: bool  # any of PACKED_KWARGS passed
    digest: int  # fingerprint of the boundaries and length bounds (the same on every rank)
    problem: int  # this rank's first problem (_PACKED_*)
    seq_lens: tuple[int, ...] | None  # from cu_seq_lens_q, when well formed
    message: str | None  # a problem with the boundaries themselves (every rank words it alike)
    detail: int = 0

    @property
    def row(self) -> list[int]:
        return [int(self.given), self.digest, self.problem, self.detail]

    def agree(self, rows: list[list[int]], lengths: list[int], model: torch.nn.Module, state: ParallelState,
              mixers: list, mixing: str) -> bool:
        """Whether the call is packed, after every CP rank checked it alike from ``rows`` (every
        rank's :attr:`row`), ``lengths`` (every rank's token count) and ``mixers`` (the model's
        token mixers, found from structure: ``path`` each).

        Raises:
            ValueError: some ranks packed and some not, boundaries that differ between ranks or
                are malformed, token counts, positions or ``seq_idx`` that are not ``shard_packed``'s.
            NotImplementedError: a token mixer that does not run packed batches, named.
            The same on every CP rank.
        """
        given = [c for c, row in enumerate(rows) if row[0]]
        if not given:
            return False
        where = f"seqpar ({type(model).__name__}, packed batch)"
        if len(given) != len(rows):
            raise ValueError(
                f"{where}: cp ranks {given} passed packed-batch kwargs ({', '.join(PACKED_KWARGS)}) and cp ranks "
                f"{[c for c in range(len(rows)) if c not in given]} did not; every rank passes the same global "
                "cu_seq_lens_q / cu_seq_lens_k with its shard_packed share of input_ids and position_ids"
            )
        _refuse_packed_mixers(model, state, mixers, mixing, where)
        if any(row[1] != rows[0][1] for row in rows):
            raise ValueError(
                f"{where}: the CP ranks passed different cu_seq_lens_q / cu_seq_lens_k / max_length_q / "
                f"max_length_k (fingerprints {[row[1] for row in rows]}); pass the boundaries of the whole "
                "batch, the same on every rank (not each rank's own tokens)"
            )
        if self.message is not None:  # the same boundaries everywhere: every rank found this
            raise ValueError(self.message)
        wide = next((c for c, row in enumerate(rows) if row[2] == _PACKED_BATCH), None)
        if wide is not None:
            raise ValueError(
                f"{where}: cp rank {wide} passed {rows[wide][3]} rows; a packed batch is one row [1, T_local] "
                "(transformers' DataCollatorWithFlattening)"
            )
        lens = self.seq_lens or ()
        want = list(Placement(lens, state.ring_size, state.ulysses_size).shard_lengths)
        if lengths != want:
            shown = list(lens[:8]) + (["..."] if len(lens) > 8 else [])
            raise ValueError(
                f"{where}: the CP ranks hold {lengths} tokens (total {sum(lengths)}), but cu_seq_lens_q "
                f"(seq_lens {shown}, total {sum(lens)}) over ring {state.ring_size} x ulysses "
                f"{state.ulysses_size} places {want}; pass input_ids=seqpar.shard_packed(ids, state, seq_lens, "
                "dim=1) (and position_ids likewise) with the global cu_seq_lens_q"
            )
        bad = next((c for c, row in enumerate(rows) if row[2]), None)
        if bad is None:
            return True
        code = rows[bad][2]
        if code == _PACKED_NO_POSITIONS:
            raise ValueError(
                f"{where}: cp rank {bad} passed no position_ids; packed sequences need their positions within "
                "each sequence: position_ids=seqpar.shard_packed_positions(seq_lens, state)[None]"
            )
        what = "position_ids" if code == _PACKED_POSITIONS else "seq_idx"
        fix = ("position_ids=seqpar.shard_packed_positions(seq_lens, state)[None]" if code == _PACKED_POSITIONS
               else "seq_idx sharded by seqpar.shard_packed like input_ids")
        raise ValueError(
            f"{where}: the {what} of cp rank {bad} are not its share of the sequences cu_seq_lens_q describes; "
            f"pass {fix}"
        )


def packed_call(get: Callable[[str], Any], state: ParallelState) -> PackedCall:
    """This rank's :class:`PackedCall` (no communication): ``get(name)`` reads an argument of the
    model call (``None`` if not passed)."""
    given = {k: v for k in PACKED_KWARGS if (v := get(k)) is not None}
    if not given:
        return PackedCall(False, 0, _PACKED_OK, None, None)
    digest = _crc([(k, v.tolist() if isinstance(v, Tensor) else v) for k, v in given.items() if k != "seq_idx"])
    where = "seqpar (packed batch)"
    if "cu_seq_lens_q" not in given:
        return PackedCall(True, digest, _PACKED_BAD, None, (
            f"{where}: {', '.join(given)} given without cu_seq_lens_q; packed batches on sequence shards take the "
            "global cu_seq_lens_q (and cu_seq_lens_k) of the whole batch"))
    ids, embeds = get("input_ids"), get("inputs_embeds")
    tokens = ids if isinstance(ids, Tensor) else embeds if isinstance(embeds, Tensor) else None
    batch = 1 if tokens is None else int(tokens.shape[0])
    try:
        seq_lens = packed_lengths(given, 1, where)
    except ValueError as e:
        return PackedCall(True, digest, _PACKED_BAD, None, str(e))
    if batch != 1:
        return PackedCall(True, digest, _PACKED_BATCH, seq_lens, None, batch)
    placement = Placement(seq_lens, state.ring_size, state.ulysses_size)
    if tokens is None or tokens.shape[1] != placement.shard_lengths[state.cp_rank]:
        return PackedCall(True, digest, _PACKED_OK, seq_lens, None)  # the counts are compared by agree()
    seq, pos = placement.local_tokens(state.cp_rank)
    positions = get("position_ids")
    if not isinstance(positions, Tensor):
        return PackedCall(True, digest, _PACKED_NO_POSITIONS, seq_lens, None)
    rows = positions.detach().reshape(-1, positions.shape[-1])
    if rows.shape[-1] != pos.numel() or not bool((rows.cpu() == pos).all()):
        return PackedCall(True, digest, _PACKED_POSITIONS, seq_lens, None)
    seq_idx = given.get("seq_idx")
    if seq_idx is not None and (
        not isinstance(seq_idx, Tensor) or seq_idx.shape[-1] != seq.numel()
        or not bool((seq_idx.detach().reshape(-1, seq.numel()).cpu() == seq).all())
    ):
        return PackedCall(True, digest, _PACKED_SEQ_IDX, seq_lens, None)
    return PackedCall(True, digest, _PACKED_OK, seq_lens, None)


def _refuse_packed_mixers(model: torch.nn.Module, state: ParallelState, mixers: list, mixing: str, where: str) -> None:
    """Refuse a packed call of a model with a token mixer that does not run packed batches (from
    structure: the same on every rank). With one rank the adapters are installed here (there is no
    model check that installs them): transformers' own kernels would let sequences leak."""
    if not mixers:
        return
    if state.cp_size == 1:
        install(model, state, mixing)
    modules = dict(model.named_modules())
    refused = [
        m for m in mixers
        if not any(runs_packed(modules[p], state) for p in ancestors(m.path) if p in modules)
    ]
    if refused:
        shown = "; ".join(map(str, refused[:4])) + (f"; and {len(refused) - 4} more" if len(refused) > 4 else "")
        raise NotImplementedError(
            f"{where}: packed batches (cu_seq_lens_q) are not supported for {shown}: seqpar runs packed sequences "
            "through softmax attention, the gated delta nets (Qwen3-Next, Qwen3.5, OLMo Hybrid) and the Mamba2 "
            "mixers (Bamba, Granite 4, Nemotron-H, Zamba2, Falcon-H1) only. "
            "Pass one sequence per row, with position_ids=seqpar.shard_positions(S, state)[None]"
        )


def ancestors(path: str) -> list[str]:
    """``path`` and the paths of the modules holding it ("a.b.c": "a.b.c", "a.b", "a", "")."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
