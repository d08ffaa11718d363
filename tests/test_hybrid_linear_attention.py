"""Hybrid transformers families exact on sequence shards: linear attention and RG-LRU.

MiniMax (lightning attention: linear attention with a per-head decay, in blocks), Kimi Linear and
Bailing hybrid (Kimi delta attention: a per-channel-decay delta rule after a causal conv1d; their
softmax layers are MLA) and RecurrentGemma (conv1d + RG-LRU scan next to sliding-window softmax
attention) built with ``attn_implementation=register(state)``, and xLSTM (mLSTM, no attention:
``install(model, state)``), run on token shards with their mixers head-parallel
(seqpar.integrations.transformers_mixers.linear_attention, .recurrent): logits and CP-summed
parameter gradients equal the one-device sdpa model's, at an odd length (37) under ring x Ulysses
2 x 2 (quick), 1 x 4, 4 x 1 and 3 x 1 (slow). MiniMax's block size 4 cuts blocks across shards;
4 linear heads over 3 ranks split 2, 1, 1; xLSTM's 2 heads leave ranks without a head. Decoding
with a cache and packed batches are refused with the same error on every rank, none left waiting
(short collective timeout).
"""

import pytest
import torch

pytest.importorskip("transformers")

from _hf import SEQ_LEN, build, each_world, one_device, outcome, shard_errors, token_ids  # noqa: E402

import seqpar  # noqa: E402
from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import generate, register  # noqa: E402
from seqpar.integrations.transformers_mixers import install  # noqa: E402

# Max error of logits and gradients, relative to max(1, the reference's magnitude). MiniMax runs in
# float64 throughout: rounding only. Kimi Linear and Bailing compute their decay gate, the KDA rule
# and the gated output norm in float32 (on purpose, as flash-linear-attention does), and PyTorch's
# vectorised float32 exp / sigmoid round a buffer's tail elements differently from its body, so a
# token's value depends, at float32's last bit, on where it sits in its rank's buffer (measured:
# 1.2e-7 on one rank of 2 x 2). RecurrentGemma's RMSNorms run in float32 (their weights' gradients
# are float32 sums over tokens, ~3e-9 apart when summed per rank) and its scan accumulates in
# float32. A wrong mixer on shards is off by 1e-2 or more.
TOL = {"minimax": 1e-10, "kimi_linear": 1e-6, "bailing_hybrid": 1e-6, "recurrent_gemma": 1e-6, "xlstm": 1e-10}
FAMILIES = list(TOL)
NO_ATTENTION = ("xlstm",)  # no softmax attention, no position_ids: install(model, state), not register


def _build(family: str, attn_implementation: str, **overrides):
    return build(family, None if family in NO_ATTENTION else attn_implementation, **overrides)


def _sharded(model, family: str, state: ParallelState, ids, **kwargs):
    """``model`` called on this rank's shard of ``ids``."""
    if family in NO_ATTENTION:
        install(model, state)
        return model(input_ids=shard(ids, state), **kwargs)
    return model(input_ids=shard(ids, state), position_ids=shard_positions(ids.shape[1], state)[None], **kwargs)


def _errors(state: ParallelState, name: str, families) -> dict[str, dict[str, float]]:
    """Relative max logits and CP-summed gradient errors of each family against one device."""
    ids = token_ids(2, SEQ_LEN, low=0)
    out = {}
    for family in families:
        ref, model = one_device(_build(family, "sdpa"), ids), _build(family, name)
        if family in NO_ATTENTION:
            install(model, state)
        attention = family not in NO_ATTENTION
        out[family] = shard_errors(model, state, ids, ref, relative_logits=True, positions=attention)
    return out


def _refusals(state: ParallelState, name: str, families) -> dict[tuple[str, str], tuple[str, str]]:
    """``(exception type, message)`` of calls this step refuses: a cache (a forward with
    use_cache=True; seqpar's generate), packed-batch kwargs."""
    ids = token_ids(1, 1)
    cu = torch.tensor([0, shard(ids, state).shape[1]])
    calls = {"cache": dict(use_cache=True), "packed": dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu), "generate": None}
    out = {}
    for family in families:
        model = _build(family, name)
        # xLSTM: no packed batches on one device either; its chunked inference (eval, a shard longer
        # than max_inference_chunksize) carries states: with 9, 2 x 2's shards of 10, 9, 9, 9 tokens
        # take it on cp rank 0 only, and every rank must still raise.
        todo = {"cache": calls["cache"], "chunked": {}} if family in NO_ATTENTION else calls
        for what, kwargs in todo.items():
            if what == "chunked":
                model = _build(family, name, max_inference_chunksize=9)
            with torch.no_grad():
                if kwargs is None:
                    out[family, what] = outcome(lambda: generate(model, ids, state, max_new_tokens=2, do_sample=False))
                else:
                    out[family, what] = outcome(lambda: _sharded(model, family, state, ids, **kwargs))
    return out


def _verified(state: ParallelState, name: str) -> tuple[bool, str]:
    """seqpar.verify's verdict on MiniMax: every module exact on shards."""
    report = seqpar.verify(_build("minimax", name), state)
    return report.ok, str(report)


def _run(worlds, families, checks: bool):
    """Per world ``(ring, ulysses)``: this rank's errors (and refusals, verify's verdict)."""

    def run(state, ring, ulysses):
        name = register(state, name=f"seqpar-test-linear-attention-{ring}x{ulysses}")
        extra = (_refusals(state, name, families), _verified(state, name)) if checks else ({}, (True, ""))
        return (_errors(state, name, families), *extra)

    return each_world(worlds, run)


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _, (ok, report)) in zip(worlds, results):
            assert ok, (f"{ring}x{ulysses}", rank, report)
            for family, err in errors.items():
                where = (f"{ring}x{ulysses}", rank, family, err)
                assert err["logits"] < TOL[family] and err["grad"] < TOL[family], where
    for w in range(len(worlds)):
        refusals = per_rank[0][w][1]
        for (family, what), (kind, message) in refusals.items():
            if (family, what) == ("minimax", "generate"):  # MiniMax's model refuses any cache but its own
                assert kind == "ValueError" and "MiniMax uses cache of its own" in message, (kind, message)
                continue
            assert kind == "NotImplementedError", (family, what, kind, message)
            want = "packed batches" if what == "packed" else "does not support a cache"
            want = "takes no initial states" if family in NO_ATTENTION else want
            assert want in message, (family, what, message)
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


@pytest.mark.slow
def test_linear_attention_families_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, FAMILIES, True)
    _check(worlds, per_rank)


@pytest.mark.slow  # ~1 min on 2 shared cores: 3 families, 3 worlds
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_linear_attention_families_exact_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, FAMILIES, False)
    _check(worlds, per_rank)


def test_one_rank_changes_nothing():
    """With cp_size 1 the adapters leave every mixer as it is: bitwise the same outputs."""
    state = ParallelState()
    ids = token_ids(2, 2)
    for family in FAMILIES:
        model = _build(family, "sdpa")
        before = model(input_ids=ids).logits
        assert install(model, state), family  # the family's mixers have an adapter
        assert torch.equal(model(input_ids=ids).logits, before), family
