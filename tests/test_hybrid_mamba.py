"""Mamba families on sequence shards (issue #43 item 3; Note [Mamba adapters]).

Mamba2 (SSD) + conv1d: Bamba, Nemotron-H, GraniteMoeHybrid, Zamba2, Falcon-H1 (Mamba next to
attention in every layer) built with ``attn_implementation=register(state)``, and Mamba2 itself;
Mamba1 (selective scan) + conv1d: Jamba (``register``) and Mamba. Mamba and Mamba2 have no softmax
attention (their forward takes no ``position_ids``, which the model check asks for), so they run
with the adapters installed directly (``transformers_mixers.install(model, state)``).

Float64 logits and CP-summed parameter gradients against the one-device model. The models keep
float32 islands that round differently on a shard than on the whole sequence (the torch SSD and
selective scans convert to float32 inside, and so reduce some gradients over heads or tokens in
float32; Nemotron-H's RMSNorm multiplies its weight in float32): both models get float64 versions
of those (``_hf.float64_state_space``), so that the comparison to 1e-10 isolates what seqpar does. The
models' own float32 kernels are checked too, to float32 rounding. Refusals (a cache, a forward
that differs from the one read) raise the same error on every rank; no rank is left waiting.
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    SEQ_LEN, build, each_world, float64_state_space, one_device, outcome, shard_errors, token_ids,
)

import seqpar  # noqa: E402
from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install  # noqa: E402

TOL = 1e-10  # float64
TOL_FLOAT32 = 1e-5  # the models' own float32 kernels: rounding ~1e-7; a wrong mixer is off by ~1e-2
HYBRID = ("bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1", "jamba")  # register(state)
PLAIN = ("mamba2", "mamba")  # no softmax attention: install(model, state)


# --- one family on one split ----------------------------------------------------------------------


def _sharded_model(family: str, state: ParallelState, name: str):
    """The model as users run it on shards, and the extra call kwargs it needs."""
    if family in PLAIN:
        model = build(family, "eager")
        install(model, state)
        return model, {}
    return build(family, name), {"position_ids": shard_positions(SEQ_LEN, state)[None]}


def _errors(family: str, state: ParallelState, name: str, mask: bool = False) -> dict[str, float]:
    """Max logits and summed-gradient errors (relative to max(1, |gradient|)) against the one-device
    model (``mask``: a padding mask, left padding on row 0, for the families that take one on shards)."""
    ids = token_ids(2, SEQ_LEN, low=0)
    full_mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    full_mask[0, :5] = 0
    extra_ref = {"attention_mask": full_mask} if mask else {}
    ref_model = build(family, "eager" if family in PLAIN else "sdpa")  # sdpa: a float64 softmax
    ref = one_device(ref_model, ids, **extra_ref)

    model, extra = _sharded_model(family, state, name)
    if mask:
        extra["attention_mask"] = shard(full_mask, state)
    return shard_errors(model, state, ids, ref, positions=False, **extra)


def _with_cache(family: str, state: ParallelState, name: str) -> tuple[str, str]:
    ids = token_ids(1, 3, low=0)
    model, extra = _sharded_model(family, state, name)
    return outcome(lambda: model(input_ids=shard(ids, state), use_cache=True, **extra))


def _full_length_mask(family: str, state: ParallelState, name: str) -> tuple[str, str]:
    """A full-length mask next to sharded ids (transformers' Mamba2Model would cut it to the shard's
    length): refused, not misapplied."""
    ids = token_ids(1, 4, low=0)
    mask = torch.ones(1, SEQ_LEN, dtype=torch.long)
    mask[0, :3] = 0
    model, extra = _sharded_model(family, state, name)
    return outcome(lambda: model(input_ids=shard(ids, state), attention_mask=mask, **extra))


def _changed_forward(state: ParallelState, name: str) -> tuple[str, str]:
    """A BambaMixer whose forward is not the one the adapter was read against."""
    from transformers.models.bamba import modeling_bamba

    original = modeling_bamba.BambaMixer.forward

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return original(self, hidden_states * 2, cache_params, attention_mask, **kwargs)

    modeling_bamba.BambaMixer.forward = forward
    try:
        model = build("bamba", name)
        ids = shard(torch.zeros(1, SEQ_LEN, dtype=torch.long), state)
        return outcome(lambda: model(input_ids=ids, position_ids=shard_positions(SEQ_LEN, state)[None]))
    finally:
        modeling_bamba.BambaMixer.forward = original


def _run(worlds, families, quick: bool):
    """Per world ``(ring, ulysses)``: this rank's errors (float64 islands), and on the quick run
    the float32 kernels' errors, the refusals and ``seqpar.verify``'s verdict."""

    def run(state, ring, ulysses):
        name = register(state, name=f"seqpar-test-mamba-{ring}x{ulysses}")
        with float64_state_space():
            errors = {f: _errors(f, state, name) for f in families}
            if quick:
                errors.update({f"{f}+mask": _errors(f, state, name, mask=True) for f in PLAIN})
        result = {"errors": errors}
        if quick:
            result["float32"] = {f: _errors(f, state, name) for f in ("bamba", "jamba")}
            result["cache"] = {f: _with_cache(f, state, name) for f in families}
            result["changed"] = _changed_forward(state, name)
            result["full_mask"] = {f: _full_length_mask(f, state, name) for f in PLAIN}
            report = seqpar.verify(build("bamba", name), state, strict=False)
            result["verify"] = (report.ok, report.verdict)
        return result

    return each_world(worlds, run, timeout_s=90)  # a rank left waiting fails


def _check(worlds, per_rank, quick: bool):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), result in zip(worlds, results):
            where = (f"{ring}x{ulysses}", rank)
            for family, err in result["errors"].items():
                assert err["logits"] < TOL and err["grad"] < TOL, (where, family, err)
            if not quick:
                continue
            for family, err in result["float32"].items():
                assert err["logits"] < TOL_FLOAT32 and err["grad"] < TOL_FLOAT32, (where, family, err)
            for family, (kind, message) in result["cache"].items():
                assert kind == "NotImplementedError" and "cache" in message, (where, family, kind, message)
            for family, (kind, message) in result["full_mask"].items():
                want = f"attention_mask of {SEQ_LEN} tokens"
                assert kind == "ValueError" and want in message, (where, family, message)
            kind, message = result["changed"]
            assert kind == "NotImplementedError" and "BambaMixer" in message and "5.23" in message, (where, message)
            assert result["verify"][0], (where, result["verify"][1])
    if quick:  # the same error on every rank
        for w in range(len(worlds)):
            for key in ("cache", "changed", "full_mask"):
                assert all(r[w][key] == per_rank[0][w][key] for r in per_rank), (worlds[w], key)


def test_one_rank_unchanged():
    """With one CP rank the adapters change nothing: the model's own forward runs."""
    ids = token_ids(2, 0, low=0)
    for family in ("bamba", "jamba"):
        model, fresh = build(family, "sdpa"), build(family, "sdpa")
        assert install(model, ParallelState())  # the mixers are found and adapted
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits), family


@pytest.mark.slow
def test_mamba_families_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, HYBRID + PLAIN, True)
    _check(worlds, per_rank, True)


@pytest.mark.slow  # several minutes on 2 shared cores: 8 families, 3 more splits
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_mamba_families_on_splits(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, HYBRID + PLAIN, False)
    _check(worlds, per_rank, False)
