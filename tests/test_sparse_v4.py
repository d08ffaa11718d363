"""DeepSeek-V4's compressed attention exact on sequence shards (``deepseek_v4``; Note [DeepSeek-V4
compressed attention on shards]).

Built with ``attn_implementation=register(state)``, a DeepSeek-V4 model with one layer of each kind
(sliding window, compressed sparse attention with its indexer, heavily compressed attention) runs
on token shards: float64 logits and CP-summed parameter gradients equal the one-device eager
model's (to the model's own float32 rounding: TOL) at an odd length (41) where the sliding window
(6), both compression rates (4 and 8: the last window is cut) and the indexer's top-k (3 of 10
entries) all cut, under ring x Ulysses 2 x 2 (quick), 1 x 4, 4 x 1 and 3 x 1 (slow); also at 5
tokens with rates of 2 on 2 x 2, where ranks hold one token (the heavily compressed layer then
builds no block bias of its own). With one rank the same path is the eager model to 1e-12.
Decoding with a cache (a forward with use_cache=True, seqpar's generate) and packed batches are
refused with the same error on every rank, none left waiting (short collective timeout), and
seqpar.verify finds every module exact on 2 x 2.
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import (  # noqa: E402
    build, cache_and_packed_refusals, check_cache_and_packed_refused, each_world, one_device, one_thread, shard_errors,
    token_ids,
)

from seqpar import ParallelState  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.verify import verify  # noqa: E402

# float64, but the model keeps float32 islands: its hyper-connections (mHC) project in float32
# (``.float()``), its norms and RoPE round through float32, the compressors' softmax runs in float32.
# A float32 product over S_local rows may round otherwise than over S rows, and gradient sums over
# tokens are split across ranks: a model of sliding layers only, which no adapter touches, differs
# by 1.3e-8 (gradients) on 2 x 2, this one by up to 2e-7 (measured). A wrong window, entry or
# selection moves the logits by more than 1e-3 (test_every_part_cuts).
TOL = 1e-6
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
_TINY = dict(
    num_hidden_layers=3, layer_types=LAYERS, mlp_layer_types=["moe"] * 3, n_routed_experts=2, num_experts_per_tok=1,
    q_lora_rank=16, o_groups=2, o_lora_rank=8, hc_mult=2, index_n_heads=2, index_head_dim=8, partial_rotary_factor=0.5,
)
# case: (sequence length, config fields)
CASES = {
    # 41 = 10 * 4 + 1 = 5 * 8 + 1: both compressors drop a remainder; top-3 of up to 10 entries
    "windows": (41, dict(_TINY, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                         sliding_window=6, index_topk=3)),
    # 5 tokens on 4 ranks: three ranks hold one token each
    "one_token": (5, dict(_TINY, compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 2},
                          sliding_window=2, index_topk=1)),
}


def _nonzero_sinks(model):
    with torch.no_grad():  # nonzero sinks and compressor position biases (initialised to zero), so both count
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))


def _build(case: str, attn_implementation: str, **overrides):
    return build("deepseek_v4", attn_implementation, init=_nonzero_sinks, **{**CASES[case][1], **overrides})


def _ids(case: str, batch: int, seed: int):
    return token_ids(batch, seed, CASES[case][0])


def _references(cases=tuple(CASES)):
    """Per case, the one-device eager model's logits and loss gradients (computed once, here; the
    indexer's gradients, which only selects, as zeros)."""
    with one_thread():
        return {case: one_device(_build(case, "eager"), _ids(case, 2, 7)) for case in cases}


def _errors(model, case: str, state: ParallelState, reference) -> dict[str, float]:
    """Max logits and CP-summed gradient errors (relative to max(1, |gradient|)) of a model on shards."""
    return shard_errors(model, state, _ids(case, 2, 7), reference, use_cache=False)


def _run(worlds, references, extras: bool):
    """Per world ``(ring, ulysses)``: this rank's errors per case and, with ``extras``, the
    refusals and seqpar.verify's verdict."""

    def run(state, ring, ulysses):
        name = register(state, name=f"seqpar-test-v4-{ring}x{ulysses}")
        errors, refused = {}, {}
        for case, reference in references.items():
            errors[case] = _errors(_build(case, name), case, state, reference)
        if extras:
            refused = cache_and_packed_refusals(_build("windows", name), state, _ids("windows", 1, 1))
            report = verify(_build("windows", name), state, _ids("windows", 1, 3))
            refused["verify"] = (report.ok, report.verdict)
        return errors, refused

    return each_world(worlds, run, timeout_s=None)  # the pool's timeout


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            for case, err in errors.items():
                assert err["logits"] < TOL and err["grad"] < TOL, (f"{ring}x{ulysses}", rank, case, err)
    for w in range(len(worlds)):
        verdicts = [r[w][1].pop("verify", (True, "")) for r in per_rank]
        assert all(ok for ok, _ in verdicts), (worlds[w], verdicts[0])
        refusals = per_rank[0][w][1]
        check_cache_and_packed_refused(refusals)
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


def test_every_part_cuts():
    """The references depend on each part: another top-k, window, sinks or compression rate
    gives other logits (so exactness on shards is not exactness of a model that ignores it)."""
    ids = _ids("windows", 1, 5)
    rates = dict(CASES["windows"][1]["compress_rates"])
    with one_thread(), torch.no_grad():
        base = _build("windows", "eager")(input_ids=ids).logits
        for change in (dict(index_topk=10), dict(sliding_window=41),
                       dict(compress_rates={**rates, "heavily_compressed_attention": 4})):
            other = _build("windows", "eager", **change)(input_ids=ids).logits
            assert (base - other).abs().max().item() > 1e-3, change


@pytest.mark.slow
def test_compressed_attention_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references(), True)
    _check(worlds, per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_compressed_attention_exact_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, _references(), False)
    _check(worlds, per_rank)


def test_one_rank_is_the_eager_model():
    """With one rank seqpar's implementation runs the model (same path, every gather the
    identity): logits and gradients the eager model's up to float64 rounding."""
    state = ParallelState()
    name = register(state, name="seqpar-test-v4-one")
    references = _references()
    with one_thread():
        for case, reference in references.items():
            err = _errors(_build(case, name), case, state, reference)
            assert err["logits"] < 1e-12 and err["grad"] < 1e-12, (case, err)
