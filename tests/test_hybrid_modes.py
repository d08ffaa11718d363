"""Hybrid transformers families in both mixing modes: head-parallel and state passing (issue #43).

Qwen3-Next, Qwen3.5 and OLMo Hybrid (gated delta rule + causal conv1d), MiniMax (lightning
attention) and LFM2 (gated short convolution: in state-passing mode its conv's halo) built with
``attn_implementation=register(state, mixing=...)`` run on token shards in each mode: float64
logits and CP-summed parameter gradients equal the one-device sdpa model's and each other's, at an
odd length (37) under ring x Ulysses 2 x 2 (quick), 3 x 1 and 1 x 4 (slow). ``mixing="auto"``
runs state passing where the ranks outnumber the heads (bitwise the state-passing mode's logits,
exact) and head-parallel where its bytes are fewer; ``seqpar...transformers_mixers.mixing_modes``
says which ran. A bad mode name, and state passing for a mixer without it (xLSTM's mLSTM), are a
ValueError on every rank.

transformers' torch fallback of the gated delta rule computes in float32 whatever the model's
dtype, so one-device float64 models are only float32-exact there; these tests give the modeling
files a float64 kernel of the same rule (``_hf.delta_rule_float64``, written from its definition,
token by token), which
the one-device model and both modes then run. MiniMax is built with float64 as the default dtype,
so that its decay buffers are float64 (built in float32 they carry float32 rounding that the
state-passing form, which computes the decays itself, does not).
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    SEQ_LEN, VOCAB, build, check_modes, diff, each_world, float64_delta_rule, on_shards, one_device, outcome,
    token_ids,
)

from seqpar import shard  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import choose_mode, install, mixing_modes  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402

TOL = 1e-10  # float64
# Computed by the modeling code through float32 (Qwen's RMSNorm weights, the decay's A_log.float()):
# their gradients are float32 sums over tokens, which per-rank partial sums round differently.
FLOAT32_PARAMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "A_log")
FLOAT32_TOL = 1e-6
# 6 V heads of dim 4 reading 2 K heads of dim 8: K heads are cut between ranks head-parallel.
GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4)
FAMILIES = {  # name: (model_type, config overrides)
    "qwen3_next": ("qwen3_next", GATED_DELTA),
    "qwen3_5_text": ("qwen3_5_text", GATED_DELTA),
    "olmo_hybrid": ("olmo_hybrid", GATED_DELTA),
    "minimax": ("minimax", {}),  # 4 heads, block size 4: blocks cut across shards
    "lfm2": ("lfm2", {}),
}
# 2 V heads reading 1 K head: over 4 ranks two hold no head, so "auto" passes states.
FEW_HEADS = ("qwen3_next", dict(GATED_DELTA, linear_num_key_heads=1, linear_num_value_heads=2))
MODES = ("head_parallel", "state_passing")


def _float64_models():
    """float64 default dtype (MiniMax's decay buffers), the float64 delta rule in the modeling
    files (read by the one-device forward and by the adapters when they install), one torch thread."""
    return float64_delta_rule(default_dtype=torch.float64)


def _build(family, attn_implementation: str):
    model_type, overrides = FAMILIES[family] if isinstance(family, str) else family
    return build(model_type, attn_implementation, **overrides)


def _references(families):
    """Per family, the one-device sdpa model's logits and loss gradients."""
    ids, out = token_ids(2, SEQ_LEN), {}
    with _float64_models():
        for family in families:
            ref = one_device(_build(family, "sdpa"), ids, FLOAT32_PARAMS)
            out[family if isinstance(family, str) else "few_heads"] = ref
    return out


def _sharded(model, state):
    """This rank's logits and CP-summed gradients."""
    return on_shards(model, state, token_ids(2, SEQ_LEN), FLOAT32_PARAMS)


def _run(worlds, references, auto: bool):
    """Per world: {(family, mode): errors against one device}, {family: state passing vs
    head-parallel}, and (with ``auto``) what "auto" ran and the bad-mode refusals."""

    def run(state, ring, ulysses):
        names = {m: register(state, name=f"seqpar-test-modes-{m}-{ring}x{ulysses}", mixing=m) for m in MODES}
        errors, between, ran = {}, {}, {}
        for family in (f for f in references if f != "few_heads"):
            local_ref = (shard(references[family][0], state), references[family][1])
            results = {}
            for mode in MODES:
                model = _build(family, names[mode])
                results[mode] = _sharded(model, state)
                errors[family, mode] = diff(results[mode], local_ref)
                ran[family, mode] = {m.mode for m in mixing_modes(model).values()}
            between[family] = diff(results["state_passing"], results["head_parallel"])
        extra = _auto_and_refusals(state, names, references, ring, ulysses) if auto else {}
        return errors, between, ran, extra

    with _float64_models():
        return each_world(worlds, run, timeout_s=None)  # the pool's timeout


def _auto_and_refusals(state, names, references, ring, ulysses):
    auto = register(state, name=f"seqpar-test-modes-auto-{ring}x{ulysses}", mixing="auto")
    out = {}
    # fewer heads than ranks: "auto" passes states, bitwise the state-passing mode, exact
    few = {}
    for name in (auto, names["state_passing"]):
        model = _build(FEW_HEADS, name)
        few[name] = (_sharded(model, state), mixing_modes(model))
    ref = references["few_heads"]
    out["few_heads_error"] = diff(few[auto][0], (shard(ref[0], state), ref[1]))
    out["few_heads_same_as_state_passing"] = torch.equal(few[auto][0][0], few[names["state_passing"]][0][0])
    out["few_heads_ran"] = {p: (m.mode, m.heads) for p, m in few[auto][1].items()}
    # 6 heads over 4 ranks at 37 tokens: head-parallel moves fewer bytes, and "auto" runs it
    model = _build("qwen3_next", auto)
    logits = _sharded(model, state)[0]
    plain = _sharded(_build("qwen3_next", names["head_parallel"]), state)[0]
    modes = mixing_modes(model)
    out["bytes_ran"] = {
        (m.mode, m.tokens_per_rank, m.head_parallel_bytes < m.state_passing_bytes) for m in modes.values()
    }
    out["bytes_same_as_head_parallel"] = torch.equal(logits, plain)
    # bad modes: the same ValueError on every rank
    out["bad_register"] = outcome(lambda: register(state, name="seqpar-test-modes-bad", mixing="ring"))
    out["bad_install"] = outcome(lambda: install(_build("lfm2", "sdpa"), state, mixing="state-passing"))
    torch.manual_seed(0)
    xlstm = causal_lm_class("xlstm")._from_config(tiny_hf_config("xlstm", vocab_size=VOCAB))
    out["no_state_passing"] = outcome(lambda: install(xlstm, state, mixing="state_passing"))
    out["mamba_auto"] = outcome(lambda: install(xlstm, state, mixing="auto"))
    return out


def _check_auto(per_rank):
    extras = [results[0][3] for results in per_rank]
    for rank, extra in enumerate(extras):
        err = extra["few_heads_error"]
        assert err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL, (rank, err)
        assert extra["few_heads_same_as_state_passing"], rank
        assert set(extra["few_heads_ran"].values()) == {("state_passing", 2)}, (rank, extra["few_heads_ran"])
        assert extra["bytes_ran"] == {("head_parallel", 10, True)}, (rank, extra["bytes_ran"])
        assert extra["bytes_same_as_head_parallel"], rank
    first = extras[0]
    assert first["bad_register"][0] == "ValueError" and "'ring'" in first["bad_register"][1], first["bad_register"]
    assert "'auto', 'head_parallel', 'state_passing'" in first["bad_install"][1], first["bad_install"]
    kind, message = first["no_state_passing"]
    assert kind == "ValueError" and "xLSTMBackend" in message and "'head_parallel' only" in message, message
    assert first["mamba_auto"] == ("ran", ""), first["mamba_auto"]  # auto: head-parallel where that is all
    for key in ("bad_register", "bad_install", "no_state_passing"):
        assert all(extra[key] == first[key] for extra in extras), key  # the same error on every rank


@pytest.mark.slow
def test_modes_exact_and_equal_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references([*FAMILIES, FEW_HEADS]), True)
    check_modes(worlds, per_rank, TOL, FLOAT32_TOL)
    _check_auto(per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [[(3, 1)], [(1, 4)]], ids=["3x1", "1x4"])
def test_modes_exact_and_equal_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, _references(FAMILIES), False)
    check_modes(worlds, per_rank, TOL, FLOAT32_TOL)


def test_choose_mode_rule():
    """The "auto" rule: state passing when a rank would hold no head or its bytes are fewer."""
    assert choose_mode(heads=2, cp_size=4, head_parallel_bytes=1, state_passing_bytes=10**9) == "state_passing"
    assert choose_mode(heads=8, cp_size=4, head_parallel_bytes=10**6, state_passing_bytes=10**5) == "state_passing"
    assert choose_mode(heads=8, cp_size=4, head_parallel_bytes=10**5, state_passing_bytes=10**6) == "head_parallel"
    assert choose_mode(heads=4, cp_size=4, head_parallel_bytes=10, state_passing_bytes=10) == "head_parallel"
