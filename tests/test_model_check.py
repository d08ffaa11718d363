"""The structural model check and the attention function's argument check of the transformers
integration (Note [transformers model checks], Note [transformers attention on shards]).

Every family whose layers mix tokens outside softmax attention (``HF_MIXER_FAMILIES``: linear
attention, state-space scans, short convolutions, recurrences, indexers and compressors that pick
keys) is refused on shards with a ``NotImplementedError`` naming the module, the same on every rank,
at ring 2 x Ulysses 2 and at a 3-rank ring; on one rank nothing is sharded and such models run.
Ordinary families are not refused. The attention function refuses arguments it does not honour
(an indexer's ``block_indices``) on one rank and on four, and a check that fails on one rank only
(a key count of its own) makes every rank raise. One pool per world with a short collective
timeout, so that a rank left waiting fails the test.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_guard import token_mixers  # noqa: E402
from seqpar.tools.models.hf_configs import HF_MIXER_FAMILIES, causal_lm_class, tiny_hf_config  # noqa: E402

VOCAB = 97
SEQ_LEN = 13

# The module each family's refusal names first, and why (config declaration or forward's calls);
# None: the family must run exactly.
FIRST_MIXER: dict[str, str | None] = {
    "qwen3_next": "model.layers.0.linear_attn (Qwen3NextGatedDeltaNet: config.layer_types[0] = 'linear_attention'",
    "qwen3_5_text": "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet: config.layer_types[0] = 'linear_attention'",
    "olmo_hybrid": "model.layers.0.linear_attn (OlmoHybridGatedDeltaNet: config.layer_types[0] = 'linear_attention'",
    "kimi_linear": "model.layers.0.self_attn (KimiLinearDeltaAttention: config.layer_types[0] = 'linear_attention'",
    "bailing_hybrid": "model.layers.0.self_attn (BailingHybridDeltaAttention: config.layer_types[0] = 'linear_attention'",
    "minimax": "model.layers.0.self_attn (MiniMaxLightningAttention: config.layer_types[0] = 'linear_attention')",
    "nemotron_h": "model.layers.0.mixer (NemotronHMamba2Mixer: config.layer_types[0] = 'linear_attention'",
    "granitemoehybrid": "model.layers.0.mamba (GraniteMoeHybridMambaLayer: config.layer_types[0]",
    "bamba": "model.layers.0.mamba (BambaMixer: config.layer_types[0] = 'linear_attention'",
    "zamba2": "model.layers.0.mamba (Zamba2MambaMixer: config.layer_types[0] = 'linear_attention'",
    "mamba2": "backbone.layers.0.mixer (Mamba2Mixer: config.layer_types[0] = 'linear_attention'",
    "falcon_h1": "model.layers.0.mamba (FalconH1Mixer: config.layer_types[0] = 'hybrid'",
    "jamba": "model.layers.0.mamba (JambaMambaMixer: config.layer_types[0] = 'linear_attention'",
    "lfm2": "model.layers.0.conv (Lfm2ShortConv: config.layer_types[0] = 'conv'",
    "lfm3": "model.layers.0.conv (Lfm3ShortConv: config.layer_types[0] = 'conv'",
    "recurrent_gemma": "model.layers.0.temporal_block (RecurrentGemmaRecurrentBlock: config.layer_types[0]",
    "xlstm": "backbone.blocks.0.mlstm_layer.mlstm_backend (xLSTMBackend: its forward calls cumsum)",
    "mamba": "backbone.layers.0.mixer (MambaMixer: config.layer_types[0] = 'linear_attention'",
    "deepseek_v4": None,  # runs exactly on shards (its adapter: docs/sparse-attention.md)
    "deepseek_v32": "model.layers.0.self_attn.indexer (DeepseekV32Indexer: config.layer_types[0] = 'indexed_attention')",
    "glm_moe_dsa": "model.layers.0.self_attn.indexer (GlmMoeDsaIndexer: config.layer_types[0] = 'indexed_attention')",
    "minimax_m3_vl": None,  # runs exactly on shards (its adapter: docs/sparse-attention.md)
}
# Ordinary families (rotary embeddings, MoE routers and experts, norms, MLPs): nothing to refuse.
ORDINARY = {
    "llama": dict(head_dim=8), "qwen2": dict(head_dim=8), "qwen3": dict(head_dim=8), "mistral": dict(head_dim=8),
    "gemma2": dict(head_dim=8), "gemma3_text": dict(head_dim=8), "phi3": dict(), "olmo2": dict(), "granite": dict(),
    "gpt_oss": dict(head_dim=8, num_local_experts=2, num_experts_per_tok=1),
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, moe_intermediate_size=16),
    "qwen3_moe": dict(head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16),
    "mixtral": dict(head_dim=8, num_local_experts=2, num_experts_per_tok=1),
}


def _ordinary(family: str, attn_implementation: str):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[family](**{
        **dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               attention_dropout=0.0, use_cache=False),
        **ORDINARY[family],
    })
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"
    ).to(torch.float64).eval()


class FancyMLP(torch.nn.Module):
    """An MLP by its name and its projections that also mixes tokens: a running sum over the
    sequence, in a helper function of the modeling code."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 64), torch.nn.Linear(64, hidden)

    def forward(self, x):
        h = F.silu(self.up(x))
        return self.down(h + _running_sum(h))


class GatedMLP(torch.nn.Module):
    """Another innocent name: a depthwise causal convolution over the sequence, as a functional call."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 64), torch.nn.Linear(64, hidden)
        self.taps = torch.nn.Parameter(torch.randn(64, 1, 3))

    def forward(self, x):
        h = F.silu(self.up(x)).transpose(1, 2)
        return self.down(F.conv1d(F.pad(h, (2, 0)), self.taps, groups=64).transpose(1, 2))


def _running_sum(h):  # a helper of the modeling code: the check follows the call
    return h.cumsum(1)


MLPS = {"FancyMLP": (FancyMLP, "cumsum"), "GatedMLP": (GatedMLP, "conv1d")}


def _fancy_llama(mlp: str, name: str):
    model = _ordinary("llama", name)
    model.model.layers[1].mlp = MLPS[mlp][0](32).to(torch.float64)  # after the build: the check sees it
    return model


def _call(state: ParallelState, build, reference=None) -> tuple[str, str]:
    """``(exception type, message)`` of one model's sharded call on this rank, or ``("exact", "")``
    / ``("wrong", error)`` if it ran: its logits against ``reference``'s (one device, float64)."""
    ids = torch.randint(3, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    try:
        model = build()
        with torch.no_grad():
            got = model(input_ids=shard(ids, state), position_ids=shard_positions(SEQ_LEN, state)[None],
                        use_cache=False).logits
    except Exception as e:  # noqa: BLE001 - the test asserts the type and message
        return (type(e).__name__, str(e))
    with torch.no_grad():
        err = (got - shard(reference().to(torch.float64).eval()(input_ids=ids).logits, state)).abs().max().item()
    return ("exact", "") if err < 1e-6 else ("wrong", f"logits off by {err:.3g}")


def _mixer_model(family: str, name: str):
    """The tiny float64 model of ``family`` (seed 0: the same weights for every implementation)."""
    torch.manual_seed(0)
    model = causal_lm_class(family)._from_config(
        tiny_hf_config(family, vocab_size=VOCAB), attn_implementation=name, experts_implementation="eager")
    return model.to(torch.float64).eval()


def _mixer_reference(family: str):
    try:
        return _mixer_model(family, "sdpa")
    except ValueError:  # no sdpa (no attention at all, or sinks): eager
        return _mixer_model(family, "eager")


def _rank_refusals(ring: int, ulysses: int) -> dict[str, tuple[str, str]]:
    state = ParallelState(ring, ulysses)
    name = register(state, name=f"seqpar-test-model-check-{ring}x{ulysses}")
    out = {}
    try:
        for family in HF_MIXER_FAMILIES:
            out[family] = _call(state, lambda: _mixer_model(family, name), lambda: _mixer_reference(family))
        for mlp in MLPS:
            out[mlp] = _call(state, lambda: _fancy_llama(mlp, name))
        out["llama"] = _call(state, lambda: _ordinary("llama", name), lambda: _ordinary("llama", "sdpa"))
    finally:
        state.close()
    return out


def _check_refusals(per_rank: list[dict[str, tuple[str, str]]]) -> None:
    """Every mixer family refused (naming its first mixer, where the mixers are the reason) or exact,
    where seqpar runs its mixers on shards (docs/hybrid-models.md): never silently wrong, and the
    same on every rank."""
    first = per_rank[0]
    for family, want in FIRST_MIXER.items():
        kind, message = first[family]
        assert kind in ("exact", "NotImplementedError") if want else kind == "exact", (family, kind, message)
        if "mix tokens outside attention" in message:  # other refusals: mixers handled, something else not
            assert want in message, (family, message)
    for mlp, (_, call) in MLPS.items():
        kind, message = first[mlp]
        assert kind == "NotImplementedError", (mlp, kind, message)
        assert f"model.layers.1.mlp ({mlp}: its forward calls {call}). Over " in message, message
    assert first["llama"] == ("exact", "")
    for rank, results in enumerate(per_rank):  # every rank raised the same error: none waited
        assert results == first, rank


@pytest.mark.slow
def test_mixer_families_and_unhonoured_arguments_refused_on_every_rank_2x2(pools):
    pool = pools(4)  # a rank left waiting fails within the timeout
    per_rank = pool.run(_rank_refusals, 2, 2)
    attention = pool.run(_rank_attention_refusals, 2, 2)
    _check_refusals(per_rank)
    _check_attention_refusals(attention)


@pytest.mark.slow  # another spawn of three ranks: ~30 s on 2 shared cores
def test_mixer_families_refused_on_every_rank_3_ranks(pools):
    per_rank = pools(3).run(_rank_refusals, 3, 1)
    _check_refusals(per_rank)


def test_structural_check_finds_no_mixer_in_ordinary_families_which_run_exactly_on_one_rank():
    """Rotary embeddings, MoE routers and experts, norms and MLPs are not token mixers; each family
    runs under seqpar's name on one rank and equals its sdpa model in float64."""
    name = register(ParallelState(), name="seqpar-test-model-check-ordinary")
    ids = torch.randint(3, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    for family in ORDINARY:
        model = _ordinary(family, name)
        assert token_mixers(model) == [], family
        # Gemma 2 and gpt-oss have no sdpa; their eager takes the softmax in float32.
        eager = family in ("gemma2", "gpt_oss")
        ref, tol = (_ordinary(family, "eager"), 1e-6) if eager else (_ordinary(family, "sdpa"), 1e-10)
        got = model(input_ids=ids, position_ids=torch.arange(SEQ_LEN)[None]).logits
        assert (got - ref(input_ids=ids).logits).abs().max().item() < tol, family


def test_mixer_families_run_on_one_rank():
    """With one rank nothing is sharded: hybrid models are allowed, and equal their sdpa model
    (families whose tiny build runs on CPU in float64; the others are refused for arguments below)."""
    name = register(ParallelState(), name="seqpar-test-model-check-one")
    ids = torch.randint(3, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    for family in ("qwen3_next", "minimax", "lfm2", "jamba"):
        torch.manual_seed(0)
        model = causal_lm_class(family)._from_config(
            tiny_hf_config(family, vocab_size=VOCAB), attn_implementation=name, experts_implementation="eager")
        torch.manual_seed(0)
        ref = causal_lm_class(family)._from_config(
            tiny_hf_config(family, vocab_size=VOCAB), attn_implementation="sdpa", experts_implementation="eager")
        model, ref = model.to(torch.float64).eval(), ref.to(torch.float64).eval()
        got = model(input_ids=ids, position_ids=torch.arange(SEQ_LEN)[None]).logits
        assert (got - ref(input_ids=ids).logits).abs().max().item() < 1e-10, family


def test_custom_mixer_is_found_whatever_its_name():
    """A class named like an MLP that sums or convolves over tokens is found from what it calls,
    also when it replaces a layer's MLP after the model was built."""
    name = register(ParallelState(), name="seqpar-test-model-check-fancy")
    for mlp, (_, call) in MLPS.items():
        mixers = token_mixers(_fancy_llama(mlp, name))
        assert [str(m) for m in mixers] == [f"model.layers.1.mlp ({mlp}: its forward calls {call})"]


# --- the attention function's arguments ---------------------------------------------------------------


def test_block_indices_refused_on_one_rank():
    """A layer that hands its block-sparse selection (block_indices=) to seqpar's attention function:
    dense attention would be wrong on one rank already, so the argument is refused. (MiniMax-M3's
    sparse layers fold it into their mask through their adapter: tests/test_sparse_minimax_m3.py.)"""
    from transformers import AttentionInterface

    fn = AttentionInterface()[register(ParallelState(), name="seqpar-test-model-check-m3")]
    q, kv = torch.randn(1, 4, SEQ_LEN, 8, dtype=torch.float64), torch.randn(1, 2, SEQ_LEN, 8, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="block_indices is given, but key blocks selected per query"):
        fn(_Attention(), q, kv, kv, None, position_ids=torch.arange(SEQ_LEN)[None],
           block_indices=torch.zeros(1, 2, SEQ_LEN, 2, dtype=torch.long))


class _Attention(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2
    layer_idx = 0


def _rank_attention_refusals(ring: int, ulysses: int) -> dict[str, tuple[str, str]]:
    """The registered function called as a model's layer would: an unknown argument on every rank,
    an indexer's block selection, and a key count that differs on one rank only (a layer that
    builds keys from its own shard, as DeepSeek-V4's compressor does)."""
    from transformers import AttentionInterface

    state = ParallelState(ring, ulysses)
    fn = AttentionInterface()[register(state, name=f"seqpar-test-model-check-kwargs-{ring}x{ulysses}")]
    n = shard_positions(SEQ_LEN, state).numel()
    positions = shard_positions(SEQ_LEN, state)[None]
    q, kv = torch.randn(1, 4, n, 8, dtype=torch.float64), torch.randn(1, 2, n, 8, dtype=torch.float64)
    cases = {
        "unknown": lambda: fn(_Attention(), q, kv, kv, None, position_ids=positions, fancy_bias=torch.ones(3)),
        "block_indices": lambda: fn(_Attention(), q, kv, kv, None, position_ids=positions,
                                    block_indices=torch.zeros(1, 2, n, 2, dtype=torch.long)),
        "uneven_keys": lambda: fn(_Attention(), q, torch.cat([kv, kv[:, :, :1]], 2) if state.cp_rank == 1 else kv,
                                  torch.cat([kv, kv[:, :, :1]], 2) if state.cp_rank == 1 else kv, None,
                                  position_ids=positions),
        "fine": lambda: fn(_Attention(), q, kv, kv, None, position_ids=positions, use_cache=False,
                           output_attentions=False, cache_position=None),
    }
    out = {}
    for case, call in cases.items():
        try:
            call()
            out[case] = ("ran", "")
        except Exception as e:  # noqa: BLE001 - the test asserts the type and message
            out[case] = (type(e).__name__, str(e))
    state.close()
    return out


def _check_attention_refusals(per_rank: list[dict[str, tuple[str, str]]]) -> None:
    """Unknown arguments and block selections refused alike on every rank; a key count that differs
    on rank 1 only raises there, and every other rank's attention raises instead of waiting."""
    for rank, out in enumerate(per_rank):
        assert out["unknown"][0] == "NotImplementedError" and "fancy_bias=<tensor (3,)" in out["unknown"][1], rank
        assert out["block_indices"] == per_rank[0]["block_indices"], rank
        assert "block_indices is given" in out["block_indices"][1], rank
        assert out["fine"] == ("ran", ""), (rank, out["fine"])
        kind, message = out["uneven_keys"]
        if rank == 1:
            assert kind == "NotImplementedError" and "key/value have" in message, message
        else:  # the others' first seqpar.attention raised instead of waiting for rank 1
            assert kind == "ValueError" and "cp rank 1 refused this call" in message, (rank, message)
