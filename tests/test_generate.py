"""seqpar.integrations.transformers.generate: full prompt in, ``model.generate``'s result out.

Greedy generation of 24 tokens from odd prompts (37, 101) with tiny random llama (GQA), mistral
(sliding window), gemma2 (softcap + window), gpt-oss (sinks) and qwen2 on ring x Ulysses 2x2,
4x1, 1x4 and 3x1: the tokens equal single-device ``model.generate``'s and the scores agree to
1e-4 in fp32. The 101-token prompt runs every family on every split, the 37-token one every
family on one split (``QUICK``); one pool per world size runs them. Then beam search, sampling, the model-level
``SeqparCache`` loop and the refusals.
"""

from __future__ import annotations

import copy
import re
import warnings
from datetime import timedelta

import pytest
import torch

pytest.importorskip("transformers")

from seqpar import ParallelState  # noqa: E402
from seqpar.integrations.transformers import SeqparCache, cache_argument, generate, register  # noqa: E402

VOCAB = 97
FAMILIES = ["llama", "mistral", "gemma2", "gpt_oss", "qwen2"]
SPLITS = [(2, 2), (4, 1), (1, 4), (3, 1)]
PROMPTS = [37, 101]
QUICK = {(2, 2): ["llama", "gemma2", "gpt_oss"], (3, 1): ["mistral", "qwen2"]}  # with the short prompt
TOL = 1e-4


def _config(family: str):
    if family == "llama":
        from seqpar.tools.models import tiny_llama_config

        return tiny_llama_config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.1,
        )
    from seqpar.tools.models.hf_configs import tiny_hf_config

    return tiny_hf_config(family, vocab_size=VOCAB)


def _pair(family: str, name: str):
    """(single-device sdpa model, seqpar model) with the same weights, each with its own config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation=name).eval()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _prompt(batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))


_GREEDY = dict(max_new_tokens=24, do_sample=False, output_scores=True, return_dict_in_generate=True,
               pad_token_id=0, eos_token_id=None)


def _rank_greedy(ring: int, ulysses: int, cases: list[tuple[str, int]]) -> list[dict]:
    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-generate-{ring}x{ulysses}")
    results = []
    for family, length in cases:
        ref, model = _pair(family, name)
        ids = _prompt(2 if family == "llama" else 1, length)
        with torch.no_grad():
            want = ref.generate(ids, **_GREEDY)
            got = generate(model, ids, state, **_GREEDY)
        results.append({
            "case": (family, length), "tokens": got.sequences.tolist(), "want": want.sequences.tolist(),
            "scores": max((a - b).abs().max().item() for a, b in zip(got.scores, want.scores)),
        })
    return results


def _check(results_per_rank: list[list[dict]], split) -> None:
    for rank, results in enumerate(results_per_rank):
        for r in results:
            assert r["tokens"] == r["want"], f"{split} rank {rank} {r['case']}: tokens differ"
            assert r["scores"] <= TOL, f"{split} rank {rank} {r['case']}: scores off by {r['scores']}"


@pytest.mark.parametrize("split", list(QUICK))
@pytest.mark.slow
def test_greedy_generate_matches_single_device_quick(pools, split):
    ring, ulysses = split
    cases = [(f, PROMPTS[0]) for f in QUICK[split]]
    _check(pools(ring * ulysses).run(_rank_greedy, ring, ulysses, cases), split)


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
def test_greedy_generate_matches_single_device_full_matrix(pools, split):
    ring, ulysses = split
    # The long prompt for every family on every split; the short one on the split QUICK runs it on.
    cases = [(f, PROMPTS[1]) for f in FAMILIES]
    _check(pools(ring * ulysses).run(_rank_greedy, ring, ulysses, cases), split)


def _rank_search(ring: int, ulysses: int) -> dict:
    """Beam search and sampling (same seed on every rank: rank 0's generator is used)."""
    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-search-{ring}x{ulysses}")
    ref, model = _pair("mistral", name)
    ids = _prompt(1, 29)
    beam = dict(max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    sample = dict(max_new_tokens=12, do_sample=True, top_k=20, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = {"beam": generate(model, ids, state, **beam).tolist(), "beam_want": ref.generate(ids, **beam).tolist()}
        torch.manual_seed(1234 + state.cp_rank)  # different per rank: generate must still agree
        out["sample"] = generate(model, ids, state, **sample).tolist()
        torch.manual_seed(1234)
        out["sample_want"] = ref.generate(ids, **sample).tolist()
    return out


@pytest.mark.slow
def test_beam_search_and_sampling(pools):
    results = pools(4).run(_rank_search, 2, 2)
    for r in results:
        assert r["beam"] == r["beam_want"]
        assert r["sample"] == results[0]["sample"]  # identical on every CP rank
    assert results[0]["sample"] == results[0]["sample_want"]  # rank 0's generator drew them


def _rank_own_loop(ring: int, ulysses: int) -> float:
    """model(...) with a SeqparCache in a hand-written greedy loop, against the full forward."""
    from seqpar import shard, shard_positions

    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-loop-{ring}x{ulysses}")
    ref, model = _pair("gemma2", name)
    ids = _prompt(1, 41)
    cache = SeqparCache(state, model.config.num_hidden_layers)
    # the installed release's cache keyword (`cache` from transformers 5.24, `past_key_values` before);
    # odd steps pass the old name, which 5.24 still accepts (with a FutureWarning)
    names = [cache_argument("test"), "past_key_values"]
    err = 0.0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(input_ids=shard(ids, state), position_ids=shard_positions(41, state)[None], use_cache=True,
              **{names[0]: cache})
        for step in range(6):
            nxt = ids[:, -1:] if step == 0 else nxt
            if step == 0:  # the prompt's last token again is not allowed: feed a fresh token
                nxt = torch.tensor([[5]])
            logits = model(input_ids=nxt, use_cache=True, **{names[step % 2]: cache}).logits
            ids = torch.cat([ids, nxt], 1)
            want = ref(input_ids=ids).logits[:, -1:]
            err = max(err, (logits - want).abs().max().item())
            nxt = logits[:, -1:].argmax(-1)
    return err


@pytest.mark.slow
def test_model_forward_with_seqpar_cache(pools):
    for err in pools(3).run(_rank_own_loop, 3, 1):
        assert err <= TOL


def test_refusals_name_the_option():
    state = ParallelState()
    name = register(state, name="seqpar-generate-refusals")
    _, model = _pair("llama", name)
    ids = _prompt(1, 9)
    with pytest.raises(NotImplementedError, match="assistant_model"):
        generate(model, ids, state, assistant_model=copy.deepcopy(model))
    with pytest.raises(NotImplementedError, match="cache_implementation"):
        generate(model, ids, state, cache_implementation="static")
    for cache_name in ("cache", "past_key_values"):  # either name of the cache argument (5.24 renamed it)
        with pytest.raises(NotImplementedError, match=f"{cache_name} is not supported"):
            generate(model, ids, state, **{cache_name: SeqparCache(state, 2)})
    with pytest.raises(ValueError, match="padding"):
        generate(model, ids, state, attention_mask=torch.tensor([[0] + [1] * 8]))
    other = ParallelState()
    with pytest.raises(ValueError, match="not a name register"):
        generate(model, ids, other, max_new_tokens=2)


# --- issue 42: stopping decided once per CP group, use_cache, beams from any config, MLA -----------

_F64 = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


def _pair64(family: str, name: str):
    ref, model = _pair(family, name)
    return ref.double(), model.double()


def _rank_stopping(ring: int, ulysses: int) -> dict:
    """Stopping rules whose answer differs per rank (a clock, a rank-dependent criterion): every
    rank must stop at the same step and return the same tokens; a criterion raising on one rank
    must raise on every rank."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AfterNewTokens(StoppingCriteria):
        def __init__(self, prompt: int, n: int) -> None:
            self.prompt, self.n = prompt, n

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.prompt >= self.n, dtype=torch.bool)

    class RaisesOnRankOne(StoppingCriteria):
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def __call__(self, input_ids, scores, **kwargs):
            if self.rank == 1:
                raise ValueError("criterion failed on purpose")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    state = ParallelState(ring, ulysses, timeout=timedelta(seconds=30))  # a rank left waiting fails fast
    name = register(state, name=f"seqpar-stop-{ring}x{ulysses}")
    ref, model = _pair64("llama", name)
    ids = _prompt(2, 23)
    rank = state.cp_rank
    out = {}
    with torch.no_grad():
        # rank r stops after 3 + r new tokens: the group stops after 3 (the first rank to say so)
        criteria = StoppingCriteriaList([AfterNewTokens(ids.shape[1], 3 + rank)])
        out["custom"] = generate(model, ids, state, stopping_criteria=criteria, **_F64).tolist()
        out["custom_want"] = ref.generate(ids, **{**_F64, "max_new_tokens": 3}).tolist()
        # max_time=0 on the last rank only (its clock always says stop): one new token everywhere
        timed = dict(max_time=0.0) if rank == state.cp_size - 1 else {}
        out["timed"] = generate(model, ids, state, **timed, **_F64).tolist()
        out["timed_want"] = ref.generate(ids, **{**_F64, "max_new_tokens": 1}).tolist()
        try:
            generate(model, ids, state, stopping_criteria=StoppingCriteriaList([RaisesOnRankOne(rank)]), **_F64)
            out["raised"] = None
        except (ValueError, RuntimeError) as e:
            out["raised"] = type(e).__name__
        # afterwards the model generates normally (nothing left behind by the failed call)
        out["after"] = generate(model, ids, state, **_F64).tolist()
        out["after_want"] = ref.generate(ids, **_F64).tolist()
    return out


@pytest.mark.slow
def test_stopping_is_decided_once_for_the_cp_group(pools):
    results = pools(4).run(_rank_stopping, 2, 2)
    for rank, r in enumerate(results):
        assert r["custom"] == r["custom_want"] == results[0]["custom"], f"rank {rank}"
        assert r["timed"] == r["timed_want"] == results[0]["timed"], f"rank {rank}"
        assert r["after"] == r["after_want"], f"rank {rank}"
    assert [r["raised"] for r in results] == ["RuntimeError", "ValueError", "RuntimeError", "RuntimeError"]


def _rank_generation_configs(ring: int, ulysses: int) -> dict:
    """use_cache=True, beam search set through num_beams=, a GenerationConfig and
    model.generation_config, and the refusal of use_cache=False on one rank only."""
    from transformers import GenerationConfig

    state = ParallelState(ring, ulysses, timeout=timedelta(seconds=30))  # a rank left waiting fails fast
    name = register(state, name=f"seqpar-configs-{ring}x{ulysses}")
    ref, model = _pair64("mistral", name)
    ids = _prompt(1, 31)  # a prompt whose 2-beam search differs from greedy search
    out = {}
    with torch.no_grad():
        out["use_cache"] = generate(model, ids, state, use_cache=True, **_F64).tolist()
        out["greedy_want"] = ref.generate(ids, **_F64).tolist()
        beam = dict(_F64, num_beams=2, num_return_sequences=2)
        out["beam_kwarg"] = generate(model, ids, state, **beam).tolist()
        out["beam_want"] = ref.generate(ids, **beam).tolist()
        out["beam_config"] = generate(model, ids, state, generation_config=GenerationConfig(**beam)).tolist()
        model.generation_config.num_beams = ref.generation_config.num_beams = 2
        out["beam_model"] = generate(model, ids, state, **_F64).tolist()
        out["beam_model_want"] = ref.generate(ids, **_F64).tolist()
        model.generation_config.num_beams = ref.generation_config.num_beams = 1
        try:  # one rank asks for no cache: every rank refuses, none waits
            generate(model, ids, state, **({"use_cache": False} if state.cp_rank == 2 else {}), **_F64)
            out["no_cache"] = None
        except (ValueError, NotImplementedError) as e:
            out["no_cache"] = str(e)
    return out


@pytest.mark.slow
def test_use_cache_and_beam_search_from_any_generation_config(pools):
    results = pools(4).run(_rank_generation_configs, 2, 2)
    for rank, r in enumerate(results):
        assert r["use_cache"] == r["greedy_want"], f"rank {rank}"
        assert r["beam_kwarg"] == r["beam_config"] == r["beam_want"], f"rank {rank}"
        assert r["beam_model"] == r["beam_model_want"], f"rank {rank}"
        assert r["beam_model"] != r["greedy_want"], "the prompt must tell beam search from greedy search"
        want = "use_cache=False is not supported" if rank == 2 else "CP rank\\(s\\) \\[2\\] refused"
        assert r["no_cache"] is not None and re.search(want, r["no_cache"]), f"rank {rank}: {r['no_cache']}"


def _rank_mla(ring: int, ulysses: int, families: list[str]) -> dict:
    """DeepSeek V2/V3 (latent KV cache, expanded per row): greedy tokens of one device in float64,
    batch 2 and a beam search."""
    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-mla-{ring}x{ulysses}")
    out = {}
    for family in families:
        ref, model = _pair64(family, name)
        ids = _prompt(2, 31)
        with torch.no_grad():
            out[family] = (generate(model, ids, state, **_F64).tolist(), ref.generate(ids, **_F64).tolist())
            beam = dict(_F64, num_beams=2)
            out[family + "_beam"] = (generate(model, ids, state, **beam).tolist(), ref.generate(ids, **beam).tolist())
    return out


@pytest.mark.slow
def test_deepseek_mla_generate_matches_single_device(pools):
    for rank, r in enumerate(pools(4).run(_rank_mla, 2, 2, ["deepseek_v2", "deepseek_v3"])):
        for case, (got, want) in r.items():
            assert got == want, f"rank {rank} {case}"


def test_use_cache_keyword_one_rank():
    state = ParallelState()
    name = register(state, name="seqpar-generate-use-cache")
    ref, model = _pair64("deepseek_v2", name)
    ids = _prompt(1, 9)
    with torch.no_grad():
        assert torch.equal(generate(model, ids, state, use_cache=True, **_F64), ref.generate(ids, **_F64))
    with pytest.raises(NotImplementedError, match="use_cache=False"):
        generate(model, ids, state, use_cache=False, **_F64)
