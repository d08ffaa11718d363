"""State-space and Kimi-delta hybrids in both mixing modes: head-parallel and state passing (issue #43).

The Mamba2 (SSD) families -- Bamba, Nemotron-H, GraniteMoeHybrid, Zamba2, Falcon-H1 built with
``attn_implementation=register(state, mixing=...)``, and Mamba2 itself with ``install(model, state,
mixing=...)`` (no softmax attention) -- and the Kimi delta attention families (Kimi Linear, Bailing
hybrid) run on token shards in each mode: float64 logits and CP-summed parameter gradients equal
the one-device sdpa model's and each other's, at an odd length (37) under ring x Ulysses 2 x 2
(quick), 3 x 1 and 1 x 4 (slow). ``mixing_modes`` says what every adapted mixer ran; ``"auto"``
passes states where the ranks outnumber the heads (bitwise the state-passing mode's logits) and
runs head-parallel where its predicted bytes are fewer (bitwise the head-parallel mode's).
``"state_passing"`` for a model whose mixer has no such form is a ValueError on every rank.

The models keep float32 islands that round differently on a shard than on the whole sequence or
at another place in a buffer (the torch SSD and KDA kernels compute in float32; Nemotron-H's,
Kimi's and Bailing's norms and KDA's forget gates too), so both the one-device and the sharded
models get float64 versions of them (``_hf.float64_state_space``), written from their definitions
(token by token for the scans, with initial and final states: state passing starts pieces from
given states). What stays float32: ``A = -exp(A_log.float())`` of the Mamba2 mixers, whose
gradient is a float32 sum that per-piece partial sums round differently (within 1e-6, like
test_hybrid_modes.py's).
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    SEQ_LEN, VOCAB, build, check_modes, diff, each_world, float64_state_space, on_shards, one_device, outcome,
    token_ids,
)

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install, mixing_modes  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402

TOL = 1e-10  # float64
FLOAT32_TOL = 1e-6
# Bailing keeps float32 roundings inline in its modeling code (its attention output gate
# ``sigmoid(g_proj(x).float())``, its router's logits), not patched here: after a float64 op that
# differs in the last bit over another token count (some CPUs, e.g. AVX-512 Xeons), they flip.
# Measured on such a machine, head-parallel: logits 6.9e-9, gradients 3.0e-10.
FAMILY_TOL = {"bailing_hybrid": 1e-7}
MODES = ("head_parallel", "state_passing")
MAMBA2 = ("bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1", "mamba2")
KDA = ("kimi_linear", "bailing_hybrid")
MAMBA1 = ("jamba", "mamba")
FAMILIES = MAMBA2 + KDA + MAMBA1
NO_ATTENTION = ("mamba2", "mamba")  # no position_ids: install(model, state, mixing=...)
# 2 SSD heads (or KDA heads) over 4 ranks: two hold no head, so "auto" passes states.
FEW_HEADS = {
    "bamba": dict(mamba_n_heads=2, mamba_d_head=32),
    "kimi_linear": dict(linear_num_heads=2),
}
# Parameters the modeling code takes through float32 (A = -exp(A_log.float()); Mamba1's D.float()
# and dt_proj.bias.float()): their gradients are float32 sums that per-piece partial sums round differently.
FLOAT32_PARAMS = {family: ("A_log",) for family in MAMBA2 + KDA}
FLOAT32_PARAMS.update({family: ("A_log", ".D", "dt_proj.bias") for family in MAMBA1})
# 4 heads (Jamba: 64 channels) over 4 ranks, 37 tokens: the mode "auto" runs by the predicted bytes
# (10 tokens per rank; Mamba1's small state makes its summaries cheaper than the exchange)
BYTES = {"bamba": "head_parallel", "kimi_linear": "head_parallel", "jamba": "state_passing"}
# The quick run: every adapter path once (register and install, Falcon-H1's variant, KDA, Mamba1);
# the others on 2 x 2 and all of them on 3 x 1 and 1 x 4 in the slow runs.
QUICK = ("bamba", "falcon_h1", "mamba2", "kimi_linear", "jamba")


# --- one model, one device or sharded ---------------------------------------------------------------


def _build(family: str, attn_implementation: str, **overrides):
    return build(family, None if family in NO_ATTENTION else attn_implementation, **overrides)


def _key(family, overrides):
    return family if not overrides else f"{family}-few"


def _references(cases):
    """Per ``(family, overrides)``, the one-device model's logits and loss gradients."""
    ids, out = token_ids(2, SEQ_LEN), {}
    with float64_state_space():
        for family, overrides in cases:
            ref = _build(family, "eager" if family in NO_ATTENTION else "sdpa", **overrides)
            out[_key(family, overrides)] = one_device(ref, ids, FLOAT32_PARAMS[family])
    return out


def _model(family: str, state: ParallelState, names: dict[str, str], mode: str, **overrides):
    """The model as users run it on shards in ``mode``, and the call kwargs it needs."""
    if family in NO_ATTENTION:
        model = _build(family, "eager", **overrides)
        install(model, state, mixing=mode)
        return model, {}
    return _build(family, names[mode], **overrides), {"position_ids": shard_positions(SEQ_LEN, state)[None]}


def _sharded(family, model, extra, state: ParallelState):
    """This rank's logits and CP-summed gradients."""
    return on_shards(model, state, token_ids(2, SEQ_LEN), FLOAT32_PARAMS[family], positions=False, **extra)


# --- the runs ---------------------------------------------------------------------------------------


def _run(worlds, families, references, auto: bool):
    """Per world: {(family, mode): errors against one device}, {family: state passing vs
    head-parallel}, {(family, mode): modes the adapted mixers ran}, and (with ``auto``) what
    "auto" ran and the refusal."""

    def run(state, ring, ulysses):
        names = {m: register(state, name=f"seqpar-test-ssm-{m}-{ring}x{ulysses}", mixing=m) for m in MODES}
        errors, between, ran = {}, {}, {}
        for family in families:
            local_ref = (shard(references[family][0], state), references[family][1])
            results = {}
            for mode in MODES:
                model, extra = _model(family, state, names, mode)
                results[mode] = _sharded(family, model, extra, state)
                errors[family, mode] = diff(results[mode], local_ref)
                ran[family, mode] = {m.mode for m in mixing_modes(model).values()}
            between[family] = diff(results["state_passing"], results["head_parallel"])
        extra = _auto_and_refusal(state, names, references, ring, ulysses) if auto else {}
        return errors, between, ran, extra

    with float64_state_space():
        return each_world(worlds, run)  # a rank left waiting fails


def _auto_and_refusal(state, names, references, ring, ulysses):
    names = {**names, "auto": register(state, name=f"seqpar-test-ssm-auto-{ring}x{ulysses}", mixing="auto")}
    out = {}
    for family, overrides in FEW_HEADS.items():  # fewer heads than ranks: "auto" passes states
        runs = {}
        for mode in ("auto", "state_passing"):
            model, extra = _model(family, state, names, mode, **overrides)
            runs[mode] = (_sharded(family, model, extra, state), mixing_modes(model))
        ref = references[_key(family, overrides)]
        out[family, "few_error"] = diff(runs["auto"][0], (shard(ref[0], state), ref[1]))
        out[family, "few_same"] = torch.equal(runs["auto"][0][0], runs["state_passing"][0][0])
        out[family, "few_ran"] = {(m.mode, m.heads) for m in runs["auto"][1].values()}
    for family, expected in BYTES.items():  # enough heads: the predicted bytes decide
        runs = {}
        for mode in ("auto", expected):
            model, extra = _model(family, state, names, mode)
            runs[mode] = (_sharded(family, model, extra, state), mixing_modes(model))
        out[family, "bytes_ran"] = {
            (m.mode, m.tokens_per_rank, m.head_parallel_bytes < m.state_passing_bytes) for m in runs["auto"][1].values()
        }
        out[family, "bytes_same"] = torch.equal(runs["auto"][0][0], runs[expected][0][0])
    # a mixer with no state-passing form (xLSTM's mLSTM backend): named, the same ValueError on every rank
    xlstm = causal_lm_class("xlstm")._from_config(tiny_hf_config("xlstm", vocab_size=VOCAB))
    out["refused"] = outcome(lambda: install(xlstm, state, mixing="state_passing"))
    return out


def _check_auto(per_rank):
    extras = [results[0][3] for results in per_rank]
    for rank, extra in enumerate(extras):
        for family in FEW_HEADS:
            err = extra[family, "few_error"]
            assert err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL, (rank, family, err)
            assert extra[family, "few_same"], (rank, family)
            assert extra[family, "few_ran"] == {("state_passing", 2)}, (rank, family, extra[family, "few_ran"])
        for family, expected in BYTES.items():
            ran = extra[family, "bytes_ran"]
            assert ran == {(expected, 10, expected == "head_parallel")}, (rank, family, ran)
            assert extra[family, "bytes_same"], (rank, family)
    kind, message = extras[0]["refused"]
    assert kind == "ValueError" and "xLSTMBackend" in message, message
    assert "'head_parallel' only" in message, message
    assert all(extra["refused"] == extras[0]["refused"] for extra in extras)  # the same error on every rank


@pytest.mark.slow
def test_ssm_modes_exact_and_equal_2x2(pools):
    worlds = [(2, 2)]
    cases = [(f, {}) for f in QUICK] + list(FEW_HEADS.items())
    per_rank = pools(4).run(_run, worlds, QUICK, _references(cases), True)
    check_modes(worlds, per_rank, TOL, FLOAT32_TOL, FAMILY_TOL)
    _check_auto(per_rank)


@pytest.mark.slow
@pytest.mark.parametrize(
    "worlds, families",
    [([(2, 2)], tuple(f for f in FAMILIES if f not in QUICK)), ([(3, 1)], FAMILIES), ([(1, 4)], FAMILIES)],
    ids=["2x2-rest", "3x1", "1x4"],
)
def test_ssm_modes_exact_and_equal_on_shards(pools, worlds, families):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, families, _references([(f, {}) for f in families]), False)
    check_modes(worlds, per_rank, TOL, FLOAT32_TOL, FAMILY_TOL)
