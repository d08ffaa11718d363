"""transformers integration: models with attn_implementation="seqpar" on sequence shards.

Llama and BERT (plain causal / bidirectional), then the families of ``seqpar.tools.models.hf_configs``
(sliding windows, chunks, softcapping, sinks), each against the single-device model; then masks
seqpar must refuse rather than compute.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM  # noqa: E402

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import (  # noqa: E402
    RecognisedMask,
    attention_forward,
    cache_argument,
    recognise_mask_function,
    register,
)
from seqpar.tools.models import tiny_llama_config  # noqa: E402
from seqpar.tools.models.hf_configs import HF_FAMILIES, causal_lm_class, tiny_hf_config  # noqa: E402
from seqpar.placement import Mask  # noqa: E402
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402

pytestmark = pytest.mark.slow  # long multi-rank runs: not in the quick subset

VOCAB = 97


def _models(name: str):
    def cfg():  # one config per model: _from_config records the attn_implementation on it
        return tiny_llama_config(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )

    torch.manual_seed(0)
    ref = LlamaForCausalLM._from_config(cfg(), attn_implementation="sdpa")
    model = LlamaForCausalLM._from_config(cfg(), attn_implementation=name)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _llama_cases(ring, ulysses, seq_lens):
    state = ParallelState(ring, ulysses)
    ref_model, model = _models(register(state, name=f"seqpar-test-{ring}x{ulysses}"))
    out = []
    for seq_len in seq_lens:
        g = torch.Generator().manual_seed(seq_len)
        ids = torch.randint(0, VOCAB, (2, seq_len), generator=g)
        labels = shift_labels(ids)
        ref_logits = ref_model(input_ids=ids).logits
        ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        ref_grads = torch.autograd.grad(ref_loss, list(ref_model.parameters()))

        logits = model(input_ids=shard(ids, state), position_ids=shard_positions(seq_len, state)[None]).logits
        share = sharded_cross_entropy(logits, shard(labels, state), state)
        grads = torch.autograd.grad(share, list(model.parameters()))
        grad_err = 0.0
        for gr, r in zip(grads, ref_grads):
            gr = gr.clone()
            dist.all_reduce(gr, group=state.cp_group)
            grad_err = max(grad_err, (gr - r).abs().max().item())
        loss = share.detach().clone()
        dist.all_reduce(loss, group=state.cp_group)
        out.append(
            {
                "seq_len": seq_len,
                "logits": (logits - shard(ref_logits, state)).abs().max().item() if logits.numel() else 0.0,
                "grad": grad_err,
                "loss": abs(loss.item() - ref_loss.item()),
            }
        )
    return out


@pytest.mark.parametrize("ring,ulysses", [(2, 2), (4, 1), (1, 4)], ids=["hybrid", "ring", "ulysses"])
def test_llama_matches_single_device(pools, ring, ulysses):
    for per_rank in pools(4).run(_llama_cases, ring, ulysses, [61, 33]):
        for r in per_rank:
            assert r["logits"] < 2e-4, r
            assert r["grad"] < 2e-4, r
            assert r["loss"] < 1e-5, r


def _encoder_cases(ring, ulysses):
    """Bidirectional encoders in eval mode: BERT (module.is_causal False) and ModernBERT (sliding
    layers with a bidirectional window of 4 keys each side, global layers)."""
    from transformers import BertConfig, BertModel, ModernBertConfig, ModernBertModel

    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-test-enc-{ring}x{ulysses}")
    configs = {
        "bert": (BertModel, lambda: BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )),
        "modernbert": (ModernBertModel, lambda: ModernBertConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            local_attention=8, layer_types=["sliding_attention", "full_attention"], initializer_range=0.1,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        )),
    }
    out = {}
    for family, (cls, cfg) in configs.items():
        torch.manual_seed(0)
        ref = cls._from_config(cfg(), attn_implementation="sdpa").eval()
        model = cls._from_config(cfg(), attn_implementation=name).eval()
        model.load_state_dict(ref.state_dict())
        ids = torch.randint(3, 50, (2, 23), generator=torch.Generator().manual_seed(1))
        want = ref(input_ids=ids).last_hidden_state
        local = shard(ids, state)
        extra = {"token_type_ids": torch.zeros_like(local)} if family == "bert" else {}
        got = model(input_ids=local, position_ids=shard_positions(23, state)[None], **extra).last_hidden_state
        out[family] = (got - shard(want, state)).abs().max().item()
    return out


@pytest.mark.parametrize("ring,ulysses", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_bidirectional_encoders_match(pools, ring, ulysses):
    for per_family in pools(ring * ulysses).run(_encoder_cases, ring, ulysses):
        for family, err in per_family.items():
            assert err < 2e-5, (family, err)


# --- families with windows, chunks, softcapping and sinks (seqpar.tools.models.hf_configs) ---------------

# Single-device reference implementation: eager where transformers' sdpa refuses (softcap, sinks).
_REFERENCE = {"gemma2": "eager", "gpt_oss": "eager"}
# Odd lengths, several windows / chunks (8) long.
_SEQ_LENS = (37, 45)


def _flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params, allow_unused=True)  # unrouted experts get None
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def _family_cases(ring, ulysses, families, seq_lens):
    """Max logits / summed-gradient / loss errors per family against the single-device model."""
    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-test-{ring}x{ulysses}")
    out = {}
    for family in families:
        cls = causal_lm_class(family)
        torch.manual_seed(0)
        ref = cls._from_config(tiny_hf_config(family), attn_implementation=_REFERENCE.get(family, "sdpa"))
        model = cls._from_config(tiny_hf_config(family), attn_implementation=name)
        model.load_state_dict(ref.state_dict())
        ref.eval()  # Phi-MoE samples its routing in training mode
        model.eval()
        errors = {"logits": 0.0, "grad": 0.0, "loss": 0.0}
        for seq_len in seq_lens:
            ids = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
            labels = shift_labels(ids)
            ref_logits = ref(input_ids=ids).logits
            ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
            ref_grad = _flat_grad(ref_loss, list(ref.parameters()))

            positions = shard_positions(seq_len, state)[None]
            logits = model(input_ids=shard(ids, state), position_ids=positions).logits
            share = sharded_cross_entropy(logits, shard(labels, state), state)
            grad = _flat_grad(share, list(model.parameters()))
            dist.all_reduce(grad, group=state.cp_group)  # partial gradients sum to the true one
            loss = share.detach().clone()
            dist.all_reduce(loss, group=state.cp_group)
            errors["logits"] = max(errors["logits"], (logits - shard(ref_logits, state)).abs().max().item())
            errors["grad"] = max(errors["grad"], (grad - ref_grad).abs().max().item())
            errors["loss"] = max(errors["loss"], abs(loss.item() - ref_loss.item()))
        out[family] = errors
    return out


@pytest.mark.parametrize("ring,ulysses", [(2, 2), (1, 4), (3, 1)], ids=["2x2", "1x4", "3x1"])
def test_families_match_single_device(pools, ring, ulysses):
    per_rank = pools(ring * ulysses).run(_family_cases, ring, ulysses, HF_FAMILIES, _SEQ_LENS)
    for rank, families in enumerate(per_rank):
        for family, err in families.items():
            assert err["logits"] < 2e-4 and err["grad"] < 2e-4 and err["loss"] < 1e-5, (rank, family, err)


def _missing_positions(ring, ulysses):
    from seqpar.integrations.transformers import _check_positions

    state = ParallelState(ring, ulysses)
    msgs = []
    for pos in (torch.arange(10)[None], shard_positions(21, state)[None]):
        try:
            _check_positions(pos, state)  # no collective: safe to raise on one rank only
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_missing_position_ids_raise(pools):
    # Without position_ids the model uses arange(S_local) on every shard.
    (r0_default, r0_right), (r1_default, r1_right) = pools(2).run(_missing_positions, 1, 2)
    assert r0_default is None and r0_right is None and r1_right is None
    assert "shard_positions" in r1_default


def _temperature_tuning_refused(ring, ulysses):
    """Llama 4 NoPE layers with floor_scale below the sequence length: refused on every rank."""
    state = ParallelState(ring, ulysses)
    model = causal_lm_class("llama4")._from_config(
        tiny_hf_config("llama4", floor_scale=4), attn_implementation=register(state, name="seqpar-test-l4")
    )
    try:
        ids = shard(torch.randint(0, VOCAB, (1, 37)), state)
        model(input_ids=ids, position_ids=shard_positions(37, state)[None])
    except NotImplementedError as e:
        return str(e)
    return None


def test_llama4_temperature_tuning_beyond_floor_scale_refused(pools):
    for msg in pools(2).run(_temperature_tuning_refused, 2, 1):
        assert msg is not None and "attn_temperature_tuning" in msg and "floor_scale=4" in msg


def _one_rank_refuses(ring, ulysses):
    """Checks of one rank's own data that fail on some ranks only: every rank raises, none waits."""
    state = ParallelState(ring, ulysses)
    S = 37
    _, model = _models(register(state, name=f"seqpar-test-refuse-{ring}x{ulysses}"))
    ids = shard(torch.randint(0, VOCAB, (1, S)), state)
    right = shard_positions(S, state)[None]
    n = ids.shape[1]
    out = {}

    def attempt(name, **kwargs):
        try:
            model(input_ids=ids, **kwargs)
            out[name] = None
        except (ValueError, NotImplementedError) as e:
            out[name] = str(e)

    # Positions as if the sequence were split contiguously, on cp rank 1 only.
    contiguous = (torch.arange(n) + state.cp_rank * n)[None]
    attempt("positions", position_ids=contiguous if state.cp_rank == 1 else right)
    attempt("padding", position_ids=right,
            attention_mask=torch.ones(1, n, dtype=torch.long).index_fill_(1, torch.tensor([0]),
                                                                          int(state.cp_rank != 2)))
    attempt("fine", position_ids=right)
    # Llama 4: floor_scale refused only on the ranks holding the most tokens.
    lengths = [0] * state.cp_size
    dist.all_gather_object(lengths, n, group=state.cp_group)
    floor = state.cp_size * (min(lengths) + 2)
    l4 = causal_lm_class("llama4")._from_config(
        tiny_hf_config("llama4", floor_scale=floor), attn_implementation=f"seqpar-test-refuse-{ring}x{ulysses}"
    )
    try:
        l4(input_ids=ids, position_ids=right)
        out["llama4"] = None
    except (ValueError, NotImplementedError) as e:
        out["llama4"] = str(e)
    out["llama4_own"] = n > min(lengths)
    state.close()
    return out


def test_one_rank_refusals_raise_on_every_rank(pools):
    per_rank = pools(4).run(_one_rank_refuses, 2, 2)  # a rank left waiting fails within 30 s
    assert any(r["llama4_own"] for r in per_rank) and not all(r["llama4_own"] for r in per_rank)
    for rank, r in enumerate(per_rank):
        assert r["fine"] is None
        # Checked on the model's call (Note [transformers model checks]): the same error everywhere.
        for case, want in (("positions", "the position_ids of cp rank 1 "), ("padding", "of cp rank 2 has zeros")):
            assert r[case] is not None and want in r[case], (rank, case, r[case])
            assert r[case] == per_rank[0][case], (rank, case)
        want = "floor_scale" if r["llama4_own"] else "refused this call"
        assert r["llama4"] is not None and want in r["llama4"], (rank, r["llama4"])


# --- never silently wrong, round 3 (issue #19): checks of the model's own call ------------------


def _outcome(call):
    """``("ok", max error)`` or ``(exception type, message)``: what one rank saw."""
    try:
        return ("ok", call())
    except NotImplementedError as e:  # MaskUsedAsTensor included
        return ("NotImplementedError", str(e))
    except ValueError as e:
        return ("ValueError", str(e))


def _tiny_model(family: str, name: str):
    """``(reference, seqpar model)`` of ``family``, each with its own config, equal weights, in eval mode."""
    import transformers

    configs = {
        "llama": lambda: tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                                           num_key_value_heads=2, num_hidden_layers=2),
        "bert": lambda: transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=64),
        "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.0,
            resid_pdrop=0.0, embd_pdrop=0.0),
        "modernbert": lambda: transformers.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            local_attention=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
        "qwen2_vl_text": lambda: transformers.Qwen2VLTextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            max_position_embeddings=128),
        "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
        "mpt": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4),
        "doge": lambda: transformers.DogeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=64),
    }
    classes = {
        "llama": "LlamaForCausalLM", "bert": "BertModel", "gpt_bigcode": "GPTBigCodeModel",
        "modernbert": "ModernBertModel", "qwen2_vl_text": "Qwen2VLTextModel", "bloom": "BloomForCausalLM",
        "mpt": "MptForCausalLM", "doge": "DogeForCausalLM",
    }
    if family in HF_FAMILIES:
        cls, make = causal_lm_class(family), lambda: tiny_hf_config(family)
    else:
        cls, make = getattr(transformers, classes[family]), configs[family]
    torch.manual_seed(0)
    model = cls._from_config(make(), attn_implementation=name).eval()
    impl = {"bloom": "eager", "mpt": "eager"}.get(family, _REFERENCE.get(family, "sdpa"))  # no sdpa there
    ref = cls._from_config(make(), attn_implementation=impl)
    ref.load_state_dict(model.state_dict())
    return ref.eval(), model


def _output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _round3_cases(ring, ulysses):
    """Every finding of issue #19 round 3 in the transformers integration, as seen by one rank."""
    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-test-r3-{ring}x{ulysses}")
    out = {}

    def exact(family, S, ref=None, model=None, **extra):
        if model is None:
            ref, model = _tiny_model(family, name)
        ids = torch.randint(3, VOCAB, (2, S), generator=torch.Generator().manual_seed(S))
        want = shard(_output(ref(input_ids=ids)), state)
        local = shard(ids, state)
        kwargs = {"position_ids": shard_positions(S, state)[None], **extra}
        return lambda: float((_output(model(input_ids=local, **kwargs)) - want).abs().max())

    # finding 3: a caller's 4-D mask, with one token per rank (1x1 blocks) and more
    for family, S in (("llama", 4), ("llama", 6), ("llama", 9), ("bert", 4), ("bert", 9)):
        _, model = _tiny_model(family, name)
        n = shard(torch.zeros(1, S), state).shape[1]
        block = torch.ones(n, n, dtype=torch.bool)
        block = (block.tril() if family == "llama" else block)[None, None]
        for kind, mask in (("bool", block), ("additive", torch.zeros(1, 1, n, n).masked_fill(~block, -1e9))):
            local = shard(torch.randint(3, VOCAB, (1, S)), state)
            out[f"3 {family} S={S} {kind}"] = _outcome(lambda: model(
                input_ids=local, position_ids=shard_positions(S, state)[None], attention_mask=mask))
    # finding 4: families that never pass position_ids to attention
    for family in ("bert", "gpt_bigcode", "modernbert", "qwen2_vl_text", "llama4"):
        ref, model = _tiny_model(family, name)
        local = shard(torch.randint(3, VOCAB, (2, 13)), state)
        n = local.shape[1]
        contiguous = (torch.arange(n) + state.cp_rank * n)[None]
        out[f"4 {family} none"] = _outcome(lambda: model(input_ids=local))
        out[f"4 {family} contiguous"] = _outcome(lambda: model(input_ids=local, position_ids=contiguous))
        out[f"4 {family} right"] = _outcome(exact(family, 13, ref, model))
    # finding 5: transformers' own loss; labels on every rank, or on the last rank only
    _, model = _tiny_model("llama", name)
    local = shard(torch.randint(3, VOCAB, (1, 13)), state)
    positions = shard_positions(13, state)[None]
    out["5 labels"] = _outcome(lambda: model(input_ids=local, position_ids=positions, labels=local))
    last = local if state.cp_rank == state.cp_size - 1 else None
    out["5 labels on one rank"] = _outcome(lambda: model(input_ids=local, position_ids=positions, labels=last))
    # finding 6: one config for the seqpar model and a reference built after it (on every rank, or rank 0)
    for where in ("every rank", "cp rank 0"):
        cfg = tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=name)
        if where == "every rank" or state.cp_rank == 0:
            LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        out[f"6 shared config, {where}"] = _outcome(lambda: model(input_ids=local, position_ids=positions))
    # finding 9: fewer tokens than CP ranks; one token per rank is exact
    for family in ("llama", "mistral", "gemma2"):
        out[f"9 {family} S=3"] = _outcome(exact(family, 3))
        out[f"9 {family} S={state.cp_size}"] = _outcome(exact(family, state.cp_size))
    # finding 11: a full-length 2-D attention_mask next to sharded ids (all ones: no padding)
    out["11 full-length mask"] = _outcome(exact("llama", 13, attention_mask=torch.ones(2, 13, dtype=torch.long)))
    out["11 sharded mask"] = _outcome(exact("llama", 13, attention_mask=shard(torch.ones(2, 13, dtype=torch.long), state)))
    # finding 12: models that compute attention themselves
    for family in ("bloom", "mpt", "doge"):
        _, model = _tiny_model(family, name)
        out[f"12 {family}"] = _outcome(lambda: model(input_ids=local, position_ids=positions))
    out["sanity llama"] = _outcome(exact("llama", 13))
    state.close()
    return out


def _expect_round3(case: str, got: tuple[str, object], cp_size: int) -> None:
    """What every rank must see for ``case`` of :func:`_round3_cases`."""
    kind, value = got
    finding, subject = case.split(" ", 1)
    refusals = {
        "3": ("ValueError", "4-D attention_mask"),
        "4": ("ValueError", "without position_ids" if subject.endswith("none") else "the position_ids of cp rank"),
        "5": ("NotImplementedError", "sharded_cross_entropy"),
        "6": ("ValueError", "its config now names 'sdpa'"),
        "9": ("ValueError", "holds none"),
        "11": ("ValueError", "a full-length mask next to sharded ids"),
        "12": ("NotImplementedError", "computes"),
    }
    exact = subject.endswith("right") or subject.endswith(f"S={cp_size}") or "sharded" in subject
    if case.startswith("sanity") or exact:
        assert kind == "ok" and value < 2e-5, (case, got)
    else:
        want_kind, want_text = refusals[finding]
        assert kind == want_kind and want_text in value, (case, got)
        if finding == "12":
            assert subject in value.lower(), (case, got)  # the message names the model


@pytest.mark.parametrize("ring,ulysses", [(2, 2), (1, 4), (4, 1)], ids=["2x2", "1x4", "4x1"])
def test_round3_findings_raise_the_same_error_on_every_rank_or_are_exact(pools, ring, ulysses):
    # one pool for the three splits, each registering its own attention name; a rank left waiting
    # fails the test at the pool's collective timeout instead of stalling it
    per_rank = pools(4).run(_round3_cases, ring, ulysses)
    for case in per_rank[0]:
        outcomes = [r[case] for r in per_rank]
        if outcomes[0][0] != "ok":
            assert all(o == outcomes[0] for o in outcomes), (case, outcomes)  # the same error everywhere
        for got in outcomes:
            _expect_round3(case, got, 4)


def test_round3_single_process():
    """One rank: labels= and no position_ids are fine (exact); a switched config, models that
    compute attention themselves and the 2-D full-length mask are still refused."""
    state = ParallelState()
    name = register(state, name="seqpar-test-r3-single")
    ref, model = _tiny_model("llama", name)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=ids, labels=ids)
    got = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    cfg = tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)
    shared = LlamaForCausalLM._from_config(cfg, attn_implementation=name)
    LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    with pytest.raises(ValueError, match="built with attn_implementation='seqpar-test-r3-single', but its config now names 'eager'"):
        shared(input_ids=ids)
    for family, match in (("bloom", "BloomForCausalLM computes attention itself"),
                          ("mpt", "MptForCausalLM computes attention itself"),
                          ("doge", "the doge model computes with its attention mask itself")):
        with pytest.raises(NotImplementedError, match=match):
            _tiny_model(family, name)[1](input_ids=ids)


def test_full_length_mask_message_from_the_mask_function():
    """The mask function itself (a model without seqpar's call checks) names the full-length
    2-D mask instead of blaming a KV cache."""
    from transformers.masking_utils import create_causal_mask

    config = tiny_hf_config("mistral", sliding_window=None)
    config._attn_implementation = register(ParallelState(), name="seqpar-test-fullmask")
    with pytest.raises(ValueError, match="has 20 tokens per row but this rank holds 11 tokens"):
        create_causal_mask(config, torch.zeros(2, 11, 32), torch.ones(2, 20, dtype=torch.long), None)


# --- single process (size-1 state) -------------------------------------------------------------


@pytest.fixture(scope="module")
def single():
    return _models(register(ParallelState(), name="seqpar-test-single"))


def test_size_one_state_equals_sdpa_and_causal_mask_recognised(single):
    ref, model = single
    ids = torch.randint(0, VOCAB, (2, 13))
    want = ref(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    # An all-ones 2-D mask is no padding: accepted.
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, want, atol=1e-5, rtol=1e-5
    )
    # A 4-D plain causal mask (bool or additive) is read as causal=True.
    tril = torch.ones(13, 13, dtype=torch.bool).tril()[None, None].expand(2, 1, 13, 13)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=tril).logits, want, atol=1e-5, rtol=1e-5)
    additive = torch.zeros(2, 1, 13, 13).masked_fill(~tril, torch.finfo(torch.float32).min)
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=additive).logits, want, atol=1e-5, rtol=1e-5
    )


def test_padding_and_custom_masks_raise(single):
    _, model = single
    ids = torch.randint(0, VOCAB, (2, 9))
    pad = torch.ones_like(ids)
    pad[0, :3] = 0
    with pytest.raises(ValueError, match="padding masks are not supported"):
        model(input_ids=ids, attention_mask=pad)
    band = torch.ones(9, 9, dtype=torch.bool).tril().triu(-2)[None, None]
    with pytest.raises(ValueError, match="not a plain causal or all-attend pattern"):
        model(input_ids=ids, attention_mask=band)


def test_restarting_positions_raise(single):
    _, model = single
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    # Increasing but with a gap: transformers would take two packed sequences, seqpar one.
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 10, 11, 12]]))


def test_kv_cache_decoding_raises(single):
    _, model = single
    ids = torch.randint(0, VOCAB, (1, 6))
    name = cache_argument("test")  # the output field and keyword: `cache` from transformers 5.24
    with torch.no_grad():
        cache = getattr(model(input_ids=ids, use_cache=True), name)
        with pytest.raises(NotImplementedError, match="use_cache=False"):
            model(input_ids=ids[:, :1], use_cache=True, **{name: cache})


def test_seqpar_cache_under_a_keyword_the_model_does_not_take_is_refused(single):
    """Before transformers 5.24 ``cache=`` is not the models' cache argument: a SeqparCache passed so
    reaches the attention function unused (the model decodes over its own cache), which refuses it."""
    from seqpar.integrations.transformers_cache import SeqparCache

    if cache_argument("test") == "cache":
        pytest.skip("transformers >= 5.24 takes the cache as cache= and still accepts past_key_values=")
    _, model = single
    cache = SeqparCache(ParallelState(), model.config.num_hidden_layers)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="passes cache=SeqparCache"):
        model(input_ids=torch.randint(0, VOCAB, (1, 6)), cache=cache, use_cache=True)


def test_dropout_raises():
    cfg = tiny_llama_config(vocab_size=VOCAB, attention_dropout=0.1)
    model = LlamaForCausalLM._from_config(
        cfg, attn_implementation=register(ParallelState(), name="seqpar-test-drop")
    )
    model.train()
    with pytest.raises(NotImplementedError, match="attention dropout 0.1"):
        model(input_ids=torch.randint(0, VOCAB, (1, 5)))


# --- recognising transformers' mask functions (single process) ---------------------------------


def _transformers_masks():
    from transformers import masking_utils as mu
    from transformers.models.gemma3.modeling_gemma3 import _bidirectional_window_overlay

    no_padding = torch.zeros(2, dtype=torch.long)
    return [
        # (mask function, local_size, use_vmap, expected Mask)
        (mu.causal_mask_function, None, False, Mask(True)),
        (mu.bidirectional_mask_function, None, False, Mask(False)),
        (mu.sliding_window_causal_mask_function(5), 5, False, Mask(True, (4, -1))),
        (mu.sliding_window_bidirectional_mask_function(5), 5, False, Mask(False, (5, 5))),
        (mu.chunked_causal_mask_function(6, no_padding), 6, False, Mask(True, chunk_size=6)),
        # Gemma 3 with use_bidirectional_attention: causal window OR |q - k| < W, evaluated with vmap.
        (mu.or_masks(mu.sliding_window_causal_mask_function(5), _bidirectional_window_overlay(5)), 5, True,
         Mask(False, (4, 4))),
        (mu.or_masks(mu.causal_mask_function, lambda *args: torch.tensor(True)), None, True, Mask(False)),
    ]


def test_transformers_mask_functions_recognised():
    from transformers import masking_utils as mu

    for fn, hint, use_vmap, want in _transformers_masks():
        for grid in (64, 301):  # positions beyond the window/chunk, odd and several chunks long
            got = recognise_mask_function(fn, batch_size=2, grid=grid, hint=hint, use_vmap=use_vmap)
            assert got == want, (fn, grid, got, want)
            # Every (query, key) pair of the grid agrees with the recognised mask.
            full = mu.sdpa_mask(
                1, grid, grid, mask_function=fn, allow_is_causal_skip=False, use_vmap=use_vmap
            )
            pos = torch.arange(grid)
            assert torch.equal(full[0, 0], got.allows(pos, pos)), (fn, grid)


def test_packed_sequence_wrapper_unwrapped():
    from transformers import masking_utils as mu

    from seqpar.integrations.transformers import _unwrap_packing

    base = mu.sliding_window_causal_mask_function(5)
    positions = torch.tensor([[0, 1, 2, 7, 8]])  # ring rank 0 of S = 9 over R = 2: jumps
    runs = mu.find_packed_sequence_indices(positions)
    remap = mu.remap_positions_for_packed_sequence(base, positions)
    wrappers = [mu.and_masks(mu.packed_sequence_mask_function(runs), remap),  # transformers <= 5.23
                mu.and_masks(remap, mu.packed_sequence_mask_function(runs))]  # 5.24
    if hasattr(mu, "packed_sequence_compatibility_function"):  # the installed version's own helper
        wrappers.append(mu.packed_sequence_compatibility_function(base, positions, runs))
    for wrapped in wrappers:
        got, got_positions = _unwrap_packing(wrapped)
        assert got is base and got_positions is positions
    got, got_positions = _unwrap_packing(base)
    assert got is base and got_positions is None
    # Not the packing wrapper: two remaps, or a third mask alongside.
    for other in (mu.and_masks(remap, remap), mu.and_masks(remap, mu.packed_sequence_mask_function(runs), base)):
        got, got_positions = _unwrap_packing(other)
        assert got is other and got_positions is None


def test_unrecognised_mask_functions_refused():
    from transformers import masking_utils as mu

    cases = {
        "streaming sink token": mu.or_masks(
            mu.sliding_window_causal_mask_function(4), lambda b, h, q, k: k == 0
        ),
        "global first query": mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q == 0),
        "dilated": mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: (q - k) % 2 == 0),
        "no diagonal": lambda b, h, q, k: k < q,
        # Block (image) ids sized to the 20 local tokens cannot be read at global positions.
        "block ids": mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.full((2, 20), -1))),
    }
    for what, fn in cases.items():
        with pytest.raises(NotImplementedError, match="seqpar attention: transformers' mask function"):
            recognise_mask_function(fn, batch_size=2, grid=64, use_vmap=what != "no diagonal")
    # Different patterns in different batch rows (per-sample masks).
    per_row = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: b == 1)
    with pytest.raises(NotImplementedError, match="differs between batch rows"):
        recognise_mask_function(per_row, batch_size=2, grid=64, use_vmap=True)


def test_model_with_custom_or_padding_mask_raises():
    from transformers.masking_utils import create_causal_mask

    config = tiny_hf_config("mistral", sliding_window=None)
    config._attn_implementation = register(ParallelState(), name="seqpar-test-custom")
    embeds = torch.zeros(2, 11, 32)
    assert create_causal_mask(config, embeds, None, None) == RecognisedMask(Mask(True), 11)
    with pytest.raises(NotImplementedError, match="not a causal, bidirectional"):
        create_causal_mask(config, embeds, None, None, or_mask_function=lambda b, h, q, k: q == 0)
    image = torch.full((2, 11), -1)
    image[:, 3:6] = 0  # tokens 3..5 attend each other bidirectionally
    with pytest.raises(NotImplementedError, match="seqpar attention: transformers' mask function"):
        create_causal_mask(config, embeds, None, None, block_sequence_ids=image)
    pad = torch.ones(2, 11, dtype=torch.long)
    pad[1, :2] = 0
    with pytest.raises(ValueError, match="padding masks are not supported"):
        create_causal_mask(config, embeds, pad, None)


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def test_mask_and_kwargs_that_disagree_raise():
    qkv = [torch.randn(1, h, 9, 8) for h in (4, 2, 2)]
    state = ParallelState()
    window = RecognisedMask(Mask(True, (7, -1)), 9)
    with pytest.raises(ValueError, match="sliding_window=4"):
        attention_forward(_Attn(), *qkv, window, state=state, sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window=None"):
        attention_forward(_Attn(), *qkv, window, state=state, sliding_window=None)
    with pytest.raises(ValueError, match="is_causal=False"):
        attention_forward(_Attn(), *qkv, RecognisedMask(Mask(True), 9), is_causal=False, state=state)
    tril = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with pytest.raises(ValueError, match="sliding window"):
        attention_forward(_Attn(), *qkv, tril, state=state, sliding_window=4)
    # Agreeing: a window of 8 keys is window (7, 0); softcap and sinks pass through.
    out, _ = attention_forward(_Attn(), *qkv, window, state=state, sliding_window=8, softcap=3.0,
                               s_aux=torch.zeros(4))
    assert out.shape == (1, 9, 4, 8)


def test_tiny_families_exercise_their_features():
    """Turning a family's window / chunk / softcap / bidirectionality off changes its logits, so
    test_families_match_single_device compares something."""
    off = {
        "mistral": [dict(sliding_window=None)],
        "qwen2": [dict(use_sliding_window=False)],
        "qwen2_moe": [dict(use_sliding_window=False)],
        "gemma2": [
            dict(sliding_window=4096), dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None)
        ],
        "gemma3": [dict(sliding_window=4096)],
        "gemma3_bidirectional": [dict(sliding_window=4096), dict(use_bidirectional_attention=False)],
        "gpt_oss": [dict(sliding_window=4096)],
        "phimoe": [dict(sliding_window=None)],
        "llama4": [dict(attention_chunk_size=4096)],
    }
    assert set(off) == set(HF_FAMILIES)
    ids = torch.randint(0, VOCAB, (1, 37), generator=torch.Generator().manual_seed(0))

    def logits(family, **overrides):
        torch.manual_seed(0)
        impl = _REFERENCE.get(family, "sdpa")
        config = tiny_hf_config(family, **overrides)
        model = causal_lm_class(family)._from_config(config, attn_implementation=impl)
        return model.eval(), model(input_ids=ids).logits

    for family, variants in off.items():
        model, want = logits(family)
        for overrides in variants:
            assert (logits(family, **overrides)[1] - want).abs().max() > 1e-3, (family, overrides)
        if family == "gpt_oss":  # the sinks matter too
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.add_(3.0)
            assert (model(input_ids=ids).logits - want).abs().max() > 1e-3


def test_register_rejects_builtin_names_and_bad_state():
    with pytest.raises(ValueError, match="built-in"):
        register(ParallelState(), name="sdpa")
    with pytest.raises(ValueError, match="ParallelState"):
        register(object())


def test_import_seqpar_does_not_import_transformers():
    code = (
        "import sys, seqpar, seqpar.training, seqpar.tools.models, seqpar.integrations, seqpar.sdpa\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# --- hybrid models: layers that mix tokens outside attention ----------------------------------------


# Hybrid models (Jamba, Qwen3-Next, LFM2, ...): exact through seqpar.integrations.transformers_mixers or refused
# on every rank by the structural check -- tests/test_model_check.py and tests/test_hybrid_*.py.


def test_cache_argument_is_the_one_the_installed_models_take():
    """transformers 5.24 renamed the cache argument ``past_key_values`` to ``cache``: seqpar hands its
    cache under the name the installed release's models take."""
    import inspect

    from transformers import LlamaModel

    name = cache_argument("test")
    assert name in inspect.signature(LlamaModel.forward).parameters
    assert name in inspect.signature(LlamaForCausalLM.forward).parameters


def test_kv_cache_refuses_a_transformers_without_a_known_cache_argument(monkeypatch):
    """A release whose generation API takes the cache under a name seqpar does not know: SeqparCache
    and generate say so (naming the version) instead of failing inside the model."""
    from transformers.generation.utils import GenerationMixin

    from seqpar.integrations import transformers as integration
    from seqpar.integrations.transformers_cache import SeqparCache

    def renamed(self, input_ids, kv_cache=None, **kwargs):
        return {}

    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", renamed)
    with pytest.raises(NotImplementedError, match=r"neither of \['cache', 'past_key_values'\].*kv_cache"):
        SeqparCache(ParallelState(), 2)
    with pytest.raises(NotImplementedError, match="seqpar generate: transformers .* takes the KV cache under neither"):
        integration.generate(torch.nn.Linear(1, 1), torch.zeros(1, 3, dtype=torch.long), ParallelState())
