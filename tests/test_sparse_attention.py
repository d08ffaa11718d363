"""DeepSeek sparse attention exact on sequence shards: DeepSeek-V3.2 and GLM-5 (``deepseek_v32``,
``glm_moe_dsa``; Note [DeepSeek sparse attention on shards]).

Built with ``attn_implementation=register(state)``, both run on token shards with the indexer's
keys and the MLA latent gathered in global order: float64 logits and CP-summed parameter gradients
equal the one-device sdpa model's at an odd length (37) where the top-k (6) cuts, under ring x
Ulysses 2 x 2 (quick), 1 x 4, 4 x 1 and 3 x 1 (slow); GLM-5 with a full and a shared indexer
layer (the second reuses the first's selection). With one rank the same path is bitwise the sdpa
model. Decoding with a cache (a forward with use_cache=True, seqpar's generate) and packed batches
are refused with the same error on every rank, none left waiting (short collective timeout), and
seqpar.verify finds every module of a DeepSeek-V3.2 model exact on 2 x 2.
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    SEQ_LEN, build, cache_and_packed_refusals, check_cache_and_packed_refused, each_world, one_device, one_thread,
    shard_errors, token_ids,
)

from seqpar import ParallelState  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install  # noqa: E402
from seqpar.verify import verify  # noqa: E402

TOPK = 6  # of up to 37 keys: the selection cuts for every query after the sixth
TOL = 1e-10  # float64
FAMILIES = {
    "deepseek_v32": dict(index_topk=TOPK),
    "glm_moe_dsa": dict(index_topk=TOPK, indexer_types=["full", "shared"]),
}


def _build(family: str, attn_implementation: str, **overrides):
    return build(family, attn_implementation, **{**FAMILIES[family], **overrides})


def _references():
    """Per family, the one-device sdpa model's logits and loss gradients (computed once, here; the
    indexer's gradients, which it runs without, as zeros)."""
    with one_thread():
        return {family: one_device(_build(family, "sdpa"), token_ids(2, SEQ_LEN)) for family in FAMILIES}


def _errors(model, state: ParallelState, reference) -> dict[str, float]:
    """Max logits and CP-summed gradient errors (relative to max(1, |gradient|)) of a model on shards."""
    return shard_errors(model, state, token_ids(2, SEQ_LEN), reference, use_cache=False)


def _run(worlds, references, extras: bool):
    """Per world ``(ring, ulysses)``: this rank's errors per family and, with ``extras``, the
    refusals and seqpar.verify's verdict."""

    def run(state, ring, ulysses):
        name = register(state, name=f"seqpar-test-sparse-{ring}x{ulysses}")
        errors, refused = {}, {}
        for family, reference in references.items():
            model = _build(family, name)
            errors[family] = _errors(model, state, reference)
            if extras:
                refused[family] = cache_and_packed_refusals(model, state, token_ids(1, 1))
        if extras:
            report = verify(_build("deepseek_v32", name), state)
            refused["verify"] = (report.ok, report.verdict)
        return errors, refused

    return each_world(worlds, run, timeout_s=None)  # the pool's timeout


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            for family, err in errors.items():
                assert err["logits"] < TOL and err["grad"] < TOL, (f"{ring}x{ulysses}", rank, family, err)
    for w in range(len(worlds)):
        verdicts = [r[w][1].pop("verify", (True, "")) for r in per_rank]
        assert all(ok for ok, _ in verdicts), (worlds[w], verdicts[0])
        refusals = per_rank[0][w][1]
        for family, calls in refusals.items():
            check_cache_and_packed_refused(calls, (family,))
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


def test_top_k_cuts():
    """The references select: with every key kept, the same weights give other logits."""
    ids = token_ids(1, 5)
    with one_thread(), torch.no_grad():
        for family in FAMILIES:
            sparse = _build(family, "sdpa")(input_ids=ids).logits
            dense = _build(family, "sdpa", index_topk=SEQ_LEN)(input_ids=ids).logits
            assert (sparse - dense).abs().max().item() > 1e-3, family


@pytest.mark.slow
def test_sparse_attention_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references(), True)
    _check(worlds, per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_sparse_attention_exact_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, _references(), False)
    _check(worlds, per_rank)


def test_one_rank_is_the_sdpa_model():
    """With one rank seqpar's implementation runs these models (same path, every gather the
    identity): logits and gradients bitwise the sdpa model's up to float64 rounding."""
    state = ParallelState()
    name = register(state, name="seqpar-test-sparse-one")
    references = _references()
    with one_thread():
        for family, reference in references.items():
            err = _errors(_build(family, name), state, reference)
            assert err["logits"] < 1e-12 and err["grad"] < 1e-12, (family, err)
    # Any mixing mode takes the sparse layers (they gather keys: no head-parallel / state-passing
    # choice), mixing="state_passing" included.
    for family in references:
        assert install(_build(family, "sdpa"), state, mixing="state_passing"), family
