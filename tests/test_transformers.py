"""transformers integration: a Llama model with attn_implementation="seqpar" on sequence shards."""

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
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.models import tiny_llama_config  # noqa: E402
from seqpar.training import shift_labels, sharded_cross_entropy  # noqa: E402

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


def _bert_case(ring, ulysses):
    """A bidirectional encoder (module.is_causal False) in eval mode."""
    from transformers import BertConfig, BertModel

    state = ParallelState(ring, ulysses)

    def cfg():
        return BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )

    torch.manual_seed(0)
    ref = BertModel._from_config(cfg(), attn_implementation="sdpa").eval()
    model = BertModel._from_config(cfg(), attn_implementation=register(state, name="seqpar-test-bert")).eval()
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 50, (2, 23), generator=torch.Generator().manual_seed(1))
    want = ref(input_ids=ids).last_hidden_state
    local = shard(ids, state)
    got = model(
        input_ids=local, position_ids=shard_positions(23, state)[None], token_type_ids=torch.zeros_like(local)
    ).last_hidden_state
    return (got - shard(want, state)).abs().max().item()


def test_bidirectional_encoder_matches(pools):
    assert max(pools(4).run(_bert_case, 2, 2)) < 2e-5


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


def test_kv_cache_decoding_raises(single):
    _, model = single
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        with pytest.raises(NotImplementedError, match="use_cache=False"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


def test_dropout_raises():
    cfg = tiny_llama_config(vocab_size=VOCAB, attention_dropout=0.1)
    model = LlamaForCausalLM._from_config(
        cfg, attn_implementation=register(ParallelState(), name="seqpar-test-drop")
    )
    model.train()
    with pytest.raises(NotImplementedError, match="attention dropout 0.1"):
        model(input_ids=torch.randint(0, VOCAB, (1, 5)))


def test_register_rejects_builtin_names_and_bad_state():
    with pytest.raises(ValueError, match="built-in"):
        register(ParallelState(), name="sdpa")
    with pytest.raises(ValueError, match="ParallelState"):
        register(object())


def test_import_seqpar_does_not_import_transformers():
    code = (
        "import sys, seqpar, seqpar.training, seqpar.models, seqpar.integrations, seqpar.sdpa\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
