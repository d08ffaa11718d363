"""Hybrid transformers families exact on sequence shards: gated delta nets and short convolutions.

Qwen3-Next, Qwen3.5 (text, and its MoE), OLMo Hybrid (gated delta rule + causal conv1d) and LFM2,
LFM2-MoE, LFM3 (gated short convolution) built with ``attn_implementation=register(state)`` run
on token shards with their mixers head-parallel (seqpar.integrations.transformers_mixers): float64
logits and CP-summed parameter gradients equal the one-device sdpa model's, at an odd length (37)
under ring x Ulysses 2 x 2 (quick), 1 x 4, 4 x 1, 3 x 1 and 1 x 3 (slow). The gated delta nets have
6 V heads reading 2 K heads of another head dim, so K heads are cut between ranks.
Decoding with a cache (a forward with use_cache=True, seqpar's generate) and packed batches (for
the short convolutions; the gated delta nets run them, tests/test_hybrid_packed.py, and refuse these
per-rank boundaries) are refused with the same error on every rank, none left waiting (short
collective timeout), and
seqpar.verify finds every module of an LFM2 and a Qwen3-Next model exact on 2 x 2. With one rank nothing changes.
The gated delta nets' float32 islands (transformers' torch rule, their norms) run in float64 in both
models (``_hf.float64_delta_rule``): on some CPUs a float64 elementwise op over another token count
differs in the last bit, and a float32 rounding after it can flip (~1e-7).
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    SEQ_LEN, build, cache_and_packed_refusals, each_world, float64_delta_rule, one_device, one_thread, shard_errors,
    token_ids,
)

from seqpar import ParallelState  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install  # noqa: E402
from seqpar.verify import verify  # noqa: E402

TOL = 1e-10  # float64
# Parameters the modeling code itself takes through float32 (Qwen's RMSNorm weights, the decay's
# A_log.float()): their gradients are float32 sums over tokens, so per-rank partial sums round
# differently from one sum (~1e-8). Everything else, the mixers' own weights included, is float64.
FLOAT32_PARAMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "A_log")
FLOAT32_TOL = 1e-6
# 6 V heads of dim 4 reading 2 K heads of dim 8: over 4 ranks (V heads split 2, 2, 1, 1) cp rank 1
# reads both K heads, each of which other ranks read too.
GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4)
# Families that run packed batches (tests/test_hybrid_packed.py): a packed call with each rank's own
# boundaries is a ValueError there, a NotImplementedError elsewhere.
PACKED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
FAMILIES = {
    "qwen3_next": GATED_DELTA,
    "qwen3_5_text": GATED_DELTA,
    "qwen3_5_moe_text": {},  # 2 V heads and 2 K heads: over 3 or 4 ranks, some rank has no head
    "olmo_hybrid": GATED_DELTA,
    "lfm2": {},
    "lfm2_moe": {},
    "lfm3": {},  # conv width 7: histories cross zig-zag chunks of 37 / 6 tokens
}


def _build(family: str, attn_implementation: str):
    return build(family, attn_implementation, **FAMILIES[family])


def _references(families):
    """Per family, the one-device sdpa model's logits and loss gradients (computed once, here)."""
    tokens = token_ids(2, SEQ_LEN)
    with float64_delta_rule():
        return {family: one_device(_build(family, "sdpa"), tokens, FLOAT32_PARAMS) for family in families}


def _run(worlds, references, refusals: bool):
    """Per world ``(ring, ulysses)``: this rank's errors and refusals per family."""

    def run(state, ring, ulysses):
        name = register(state, name=f"seqpar-test-hybrid-{ring}x{ulysses}")
        errs, refused = {}, {}
        for family, reference in references.items():
            model = _build(family, name)
            errs[family] = shard_errors(model, state, token_ids(2, SEQ_LEN), reference, FLOAT32_PARAMS)
            if refusals:
                refused[family] = cache_and_packed_refusals(model, state, token_ids(1, 1))
        if refusals:  # and seqpar's own self-check finds every module of both kinds of model exact
            # (the gated delta net's norms see [B * S * H, D] rows: a flattened sequence dim)
            refused["verify"] = all(verify(_build(f, name), state, token_ids(1, 3)).ok for f in ("lfm2", "qwen3_next"))
        return errs, refused

    with float64_delta_rule():
        return each_world(worlds, run)


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            for family, err in errors.items():
                where = (f"{ring}x{ulysses}", rank, family)
                assert err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL, (where, err)
    for w in range(len(worlds)):
        assert all(r[w][1].pop("verify", True) is True for r in per_rank), worlds[w]
        refusals = per_rank[0][w][1]
        for family, calls in refusals.items():
            for what, (kind, message) in calls.items():
                if what == "packed" and family in PACKED:  # runs packed batches: these boundaries are wrong
                    assert kind == "ValueError" and "cu_seq_lens_q" in message, (family, what, kind, message)
                    continue
                want = "packed batches" if what == "packed" else "does not support a cache"
                assert kind == "NotImplementedError" and want in message, (family, what, kind, message)
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


@pytest.mark.slow
def test_hybrid_families_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references(FAMILIES), True)
    _check(worlds, per_rank)


@pytest.mark.slow  # ~1 min on 2 shared cores: 7 families, 4 worlds
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1), (1, 3)]], ids=["1x4+4x1", "3x1+1x3"])
def test_hybrid_families_exact_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, _references(FAMILIES), False)
    _check(worlds, per_rank)


def test_one_rank_changes_nothing():
    """With cp_size 1 the adapters leave every mixer as it is: bitwise the same outputs."""
    state = ParallelState()
    ids = token_ids(2, 2)
    with one_thread():
        for family in FAMILIES:
            model = _build(family, "sdpa")
            before = model(input_ids=ids).logits
            assert install(model, state), family  # the family's mixers have an adapter
            assert torch.equal(model(input_ids=ids).logits, before), family
