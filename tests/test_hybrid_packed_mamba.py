"""Packed sequences through the Mamba2 (SSD) hybrids on sequence shards (issue #43).

Bamba, GraniteMoeHybrid, Nemotron-H, Zamba2 and Falcon-H1 built with ``attn_implementation=register(state,
mixing=...)`` take transformers' packed format (one row of concatenated sequences, ``input_ids`` and
restarting ``position_ids`` sharded by ``seqpar.shard_packed``, the global ``cu_seq_lens_q`` /
``cu_seq_lens_k`` / ``max_length_*``): the Mamba2 mixers run their conv and scan per sequence from zero
history and state (head-parallel, and state passing with the halo and the states stopping at every
sequence start), the attention layers ``seqpar.varlen_attention``. Three sequences of odd lengths
(11, 23, 7): float64 logits and CP-summed parameter gradients equal one device running each sequence
on its own, under ring x Ulysses 2 x 2 (quick), 3 x 1 and 1 x 4 (slow, every family, ``mixing="auto"``
too), and on one rank, where transformers' torch fallbacks would let the sequences leak into each other.

Refused with the same error on every rank, none left waiting (a short collective timeout): a packed
call of Jamba (its decoder layer does not hand the packed kwargs to its Mamba1 mixer) and of Mamba2
itself (no attention: no model check validates the boundaries), a padding mask next to packed
kwargs, and ``seq_idx`` without the boundaries; the model still runs after each refusal.

Both the one-device and the sharded models get the float64 versions of the SSD scan and
Nemotron-H's norm (``_hf.float64_state_space``): the torch fallbacks compute in float32.
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    LENS, build, each_world, float64_state_space, outcome, packed_call, packed_errors, packed_kwargs,
    packed_references, packed_sequences,
)

from seqpar import ParallelState, shard_packed, shard_packed_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install, mixing_modes  # noqa: E402

TOL = 1e-10  # float64
FLOAT32_PARAMS = ("A_log",)  # A = -exp(A_log.float()): per-rank partial sums of its gradient round differently
FLOAT32_TOL = 1e-6
FAMILIES = ("bamba", "granitemoehybrid", "nemotron_h", "zamba2", "falcon_h1")
# The quick runs: the plain mixer and Zamba2's (a "hybrid" layer holds it one level down) on 2 x 2, the
# plain mixer and Falcon-H1's variant on one rank; every family in the slow runs.
QUICK = ("bamba", "zamba2")
ONE_RANK = ("bamba", "falcon_h1")
MODES = ("head_parallel", "state_passing")


def _references(families):
    """Per family, one device running each sequence on its own (``_hf.packed_references``)."""
    with float64_state_space():
        return packed_references(families, build, FLOAT32_PARAMS)


def _errors(model, state: ParallelState, reference) -> dict[str, float]:
    return packed_errors(model, state, reference, FLOAT32_PARAMS)


def _refusals(state: ParallelState, name: str) -> dict[str, tuple[str, str]]:
    """``(exception type, message)`` of packed calls that must be refused on every rank."""
    model = build("bamba", name)
    ids, _ = packed_sequences()
    local, positions = shard_packed(ids, state, LENS, dim=1), shard_packed_positions(LENS, state)[None]
    seq_idx = shard_packed(torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))[None], state, LENS,
                           dim=1)
    mixer = model.model.layers[0].mamba
    mask = torch.ones(1, local.shape[1], dtype=torch.long)
    mask[0, -1] = 0
    hidden = torch.randn(1, local.shape[1], model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(state.cp_rank))
    mamba2 = build("mamba2", None)
    install(mamba2, state)
    calls = {
        # a packed call (which also installs the adapters the mixer call below reaches)
        "before": lambda: packed_call(model, state),
        # Jamba's decoder layers drop the kwargs before its Mamba1 mixer: named by the model check
        "jamba": lambda: packed_call(build("jamba", name), state),
        # Mamba2 without attention: no model check validates cu_seq_lens_q against the shards
        # (its backbone: Mamba2ForCausalLM itself drops the kwargs before the backbone)
        "mamba2": lambda: mamba2.backbone(input_ids=local, use_cache=False, **packed_kwargs()),
        # a padding mask reaching the mixer next to the boundaries, on cp rank 0 alone (transformers
        # hands a rank without padding None; the model's attention refuses padding first: a direct call)
        "mask": lambda: mixer(hidden, attention_mask=mask if state.cp_rank == 0 else None, **packed_kwargs()),
        # seq_idx (the Mamba kernels' packing) without the boundaries
        "seq_idx alone": lambda: model(input_ids=local, position_ids=positions, seq_idx=seq_idx),
        # and the model still runs after each refusal, seq_idx along with the boundaries too
        "after": lambda: packed_call(model, state, seq_idx=seq_idx),
    }
    with torch.no_grad():
        return {what: outcome(call) for what, call in calls.items()}


def _run(worlds, references, mixings, refusals: bool):
    """Per world ``(ring, ulysses)``: this rank's errors per (family, mixing), the modes its mixers
    ran, and the refusals."""

    def run(state, ring, ulysses):
        errors, ran = {}, {}
        for mixing in mixings:
            name = register(state, name=f"seqpar-test-packed-mamba-{mixing}-{ring}x{ulysses}", mixing=mixing)
            for family, reference in references.items():
                model = build(family, name)
                errors[family, mixing] = _errors(model, state, reference)
                ran[family, mixing] = {m.mode for m in mixing_modes(model).values()}
        refused = {}
        if refusals:
            refused = _refusals(state, register(state, name=f"seqpar-test-packed-mamba-no-{ring}x{ulysses}"))
        return errors, ran, refused

    with float64_state_space():
        return each_world(worlds, run)  # a rank left waiting fails


def _check_errors(where, errors):
    for key, err in errors.items():
        ok = err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL
        assert ok, (where, key, err)


def _check_refusals(where, refused, skip=()):
    want = {
        "before": ("ran", ""),
        "jamba": ("NotImplementedError", "JambaMambaMixer"),
        "mamba2": ("NotImplementedError", "Mamba2Mixer"),
        "mask": ("NotImplementedError", "padding attention_mask together with packed"),
        "seq_idx alone": ("ValueError", "without cu_seq_lens_q"),
        "after": ("ran", ""),
    }
    for what, (kind, text) in want.items():
        if what in skip:
            continue
        got_kind, message = refused[what]
        assert got_kind == kind and text in message, (where, what, refused[what])


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, ran, _) in zip(worlds, results):
            _check_errors((f"{ring}x{ulysses}", rank), errors)
            for (family, mixing), modes in ran.items():  # every adapted mixer ran the mode asked for
                want = set(MODES) if mixing == "auto" else {mixing}
                assert modes and modes <= want, (f"{ring}x{ulysses}", rank, family, mixing, modes)
    for w in range(len(worlds)):
        refused = per_rank[0][w][2]
        assert all(r[w][2] == refused for r in per_rank), worlds[w]  # the same outcome on every rank
        if refused:
            _check_refusals(worlds[w], refused)


@pytest.mark.slow
def test_packed_mamba_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references(QUICK), MODES, True)
    _check(worlds, per_rank)


@pytest.mark.slow  # every family, three mixings
@pytest.mark.parametrize("world", [(3, 1), (1, 4)], ids=["3x1", "1x4"])
def test_packed_mamba_exact_on_shards(pools, world):
    per_rank = pools(world[0] * world[1]).run(_run, [world], _references(FAMILIES), (*MODES, "auto"), False)
    _check([world], per_rank)


def test_packed_mamba_on_one_rank():
    """With one rank too: transformers' torch fallbacks of the conv and the SSD scan ignore the
    boundaries, so the adapter runs packed calls per sequence, in either mode (dense calls run the
    module as it is)."""
    state = ParallelState()
    references = _references(ONE_RANK)
    with float64_state_space():
        for mixing in MODES:
            name = register(state, name=f"seqpar-test-packed-mamba-one-rank-{mixing}", mixing=mixing)
            for family, reference in references.items():
                model = build(family, name)
                _check_errors(("1x1", 0), {(family, mixing): _errors(model, state, reference)})
                assert mixing_modes(model) == {}, family  # nothing ran on shards
        refused = _refusals(state, register(state, name="seqpar-test-packed-mamba-one-rank-refusals"))
    # Mamba2 without attention: on one rank it runs as transformers runs it (nothing is sharded)
    assert refused["mamba2"] == ("ran", ""), refused
    _check_refusals("1x1", refused, skip=("mamba2",))
