"""Packed sequences in transformers models on sequence shards (issue #43).

A model built with ``attn_implementation=register(state)`` takes transformers' packed format
(DataCollatorWithFlattening): one row of concatenated sequences, ``input_ids`` and ``position_ids``
(restarting per sequence) sharded by ``seqpar.shard_packed``, and the global ``cu_seq_lens_q`` /
``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``. Three sequences of odd lengths (11, 23, 7)
run exactly: float64 logits and CP-summed parameter gradients equal one device running each
sequence on its own (the sdpa model, results concatenated), for Qwen3-Next and Qwen3.5 (gated delta
nets: conv and rule per sequence, head-parallel and state passing; softmax attention by
``seqpar.varlen_attention``) and Llama (softmax only), under ring x Ulysses 2 x 2 (quick), 3 x 1 and
1 x 4 (slow, with OLMo Hybrid and ``mixing="auto"``), and on one rank.
Refused with the same error on every rank, none left waiting (a short collective timeout): boundaries
that differ on one rank, boundaries that do not place the ranks' token counts, restarting positions
without boundaries, and a model whose token mixers do not run packed batches (LFM2's short conv).
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    LENS, VOCAB, build, each_world, float64_delta_rule, outcome, packed_call, packed_errors, packed_kwargs,
    packed_references, packed_sequences,
)
from transformers import LlamaForCausalLM  # noqa: E402

from seqpar import ParallelState, shard_packed, shard_packed_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.tools.models import tiny_llama_config  # noqa: E402

TOL = 1e-10  # float64
# Parameters the modeling code takes through float32 (Qwen's RMSNorm weights, the decay's
# A_log.float()): per-rank partial sums of their gradients round differently (~1e-8).
FLOAT32_PARAMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "A_log")
FLOAT32_TOL = 1e-6
# 6 V heads reading 2 K heads of another head dim: K heads are cut between ranks.
GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4)
FAMILIES = {"qwen3_next": GATED_DELTA, "qwen3_5_text": GATED_DELTA, "olmo_hybrid": GATED_DELTA, "llama": {}}
QUICK = ("qwen3_next", "qwen3_5_text", "llama")
MIXERS = ("qwen3_next", "qwen3_5_text", "olmo_hybrid")


def _build(family: str, attn_implementation: str):
    if family == "llama":
        torch.manual_seed(0)  # a float64 model in eval mode, as _hf.build's
        config = tiny_llama_config(vocab_size=VOCAB)
        return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).to(torch.float64).eval()
    return build(family, attn_implementation, **FAMILIES.get(family, {}))


def _references(families):
    """Per family, one device running each sequence on its own (``_hf.packed_references``): the
    matmuls see about as many tokens as the packed batch's; the float32 islands run in float64."""
    with float64_delta_rule():
        return packed_references(families, _build, FLOAT32_PARAMS)


def _errors(model, state: ParallelState, reference) -> dict[str, float]:
    return packed_errors(model, state, reference, FLOAT32_PARAMS)


def _refusals(state: ParallelState, name: str) -> dict[str, tuple[str, str]]:
    """``(exception type, message)`` of packed calls that must be refused on every rank."""
    model = _build("qwen3_next", name)
    ids, _ = packed_sequences()
    local, positions = shard_packed(ids, state, LENS, dim=1), shard_packed_positions(LENS, state)[None]
    other = (11, 19, 11)  # the same total: only the boundaries differ
    calls = {
        # cp rank 0 alone passes other boundaries
        "one rank differs": lambda: model(
            input_ids=local, position_ids=positions, **packed_kwargs(other if state.cp_rank == 0 else LENS)),
        # boundaries of 42 tokens next to shards of 41
        "counts": lambda: model(input_ids=local, position_ids=positions, **packed_kwargs((11, 23, 8))),
        # restarting positions without boundaries
        "no boundaries": lambda: model(input_ids=local, position_ids=positions),
        # and the model still runs after each refusal
        "after": lambda: packed_call(model, state),
        # a token mixer that does not run packed batches
        "short conv": lambda: packed_call(_build("lfm2", name), state),
    }
    with torch.no_grad():
        return {what: outcome(call) for what, call in calls.items()}


def _run(worlds, references, mixings, refusals: bool):
    """Per world ``(ring, ulysses)``: this rank's errors per (family, mixing) and refusals."""

    def run(state, ring, ulysses):
        errors = {}
        for mixing in mixings:
            name = register(state, name=f"seqpar-test-packed-{mixing}-{ring}x{ulysses}", mixing=mixing)
            for family, reference in references.items():
                if family in MIXERS or mixing == mixings[0]:  # softmax-only models: one mixing
                    errors[family, mixing] = _errors(_build(family, name), state, reference)
        refused = _refusals(state, register(state, name=f"seqpar-test-packed-refusals-{ring}x{ulysses}")) \
            if refusals else {}
        return errors, refused

    with float64_delta_rule():
        return each_world(worlds, run)  # a rank left waiting fails


def _check_errors(where, errors):
    for key, err in errors.items():
        ok = err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL
        assert ok, (where, key, err)


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            _check_errors((f"{ring}x{ulysses}", rank), errors)
    for w in range(len(worlds)):
        refused = per_rank[0][w][1]
        assert all(r[w][1] == refused for r in per_rank), worlds[w]  # the same outcome on every rank
        if not refused:
            continue
        want = {
            "one rank differs": ("ValueError", "different cu_seq_lens_q"),
            "counts": ("ValueError", "places"),
            "no boundaries": ("ValueError", "position_ids"),
            "after": ("ran", ""),
            "short conv": ("NotImplementedError", "packed batches"),
        }
        for what, (kind, text) in want.items():
            got_kind, message = refused[what]
            assert got_kind == kind and text in message, (worlds[w], what, refused[what])
        # the counts refusal names the sizes
        assert "[11, 23, 8]" in refused["counts"][1] and "41" in refused["counts"][1], refused["counts"]


@pytest.mark.slow
def test_packed_families_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references(QUICK), ("head_parallel", "state_passing"), True)
    _check(worlds, per_rank)


@pytest.mark.slow  # ~1 min on 2 shared cores
@pytest.mark.parametrize("world", [(3, 1), (1, 4)], ids=["3x1", "1x4"])
def test_packed_families_exact_on_shards(pools, world):
    per_rank = pools(world[0] * world[1]).run(
        _run, [world], _references(FAMILIES), ("head_parallel", "state_passing", "auto"), False
    )
    _check([world], per_rank)


def test_packed_on_one_rank():
    """With one rank too: transformers' torch fallbacks of the gated delta net cannot keep packed
    sequences apart (its rule refuses cu_seqlens, its conv ignores them), so the adapter runs
    them per sequence, in either mode."""
    state = ParallelState()
    names = {m: register(state, name=f"seqpar-test-packed-one-rank-{m}", mixing=m)
             for m in ("head_parallel", "state_passing")}
    references = _references(("qwen3_next", "llama"))
    with float64_delta_rule():
        for mixing, name in names.items():
            for family, reference in references.items():
                _check_errors(("1x1", 0), {(family, mixing): _errors(_build(family, name), state, reference)})
        refused = _refusals(state, names["head_parallel"])
    assert refused["no boundaries"][0] == "ValueError" and "cu_seq_lens_q" in refused["no boundaries"][1], refused
    assert refused["counts"][0] == "ValueError" and "[11, 23, 8]" in refused["counts"][1], refused
    assert refused["after"] == ("ran", ""), refused
    assert refused["short conv"][0] == "NotImplementedError" and "packed batches" in refused["short conv"][1], refused
