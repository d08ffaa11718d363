"""Tiny random-init ``transformers`` causal LMs whose attention is more than plain causal.

For tests and examples of ``seqpar.integrations.transformers``: each family exercises a mask or
score modifier (checked against transformers 5.23)::

    family                class                    attention
    mistral               MistralForCausalLM       sliding window on every layer (kwarg)
    qwen2                 Qwen2ForCausalLM         layer 0 full, layer 1 sliding (use_sliding_window)
    qwen2_moe             Qwen2MoeForCausalLM      layer 0 sliding (module attribute only), MoE
    gemma2                Gemma2ForCausalLM        sliding/full, attn + final logit softcapping
    gemma3                Gemma3ForCausalLM        sliding/full (own RoPE per layer type)
    gemma3_bidirectional  Gemma3ForCausalLM        the same, bidirectional (window (W-1, W-1))
    gpt_oss               GptOssForCausalLM        sliding/full, sinks (s_aux), MoE
    phimoe                PhimoeForCausalLM        sliding window from the mask only, MoE
    llama4                Llama4ForCausalLM        chunked (RoPE) / full (NoPE) layers, MoE

Every config has 2 layers, hidden size 32, 4 query and 2 K/V heads of head dim 8, window or chunk
8, attention dropout 0, no KV cache, and weights initialised large enough (std 0.1) that scores
reach Gemma 2's softcaps (1.0).

Two more groups, with their own fields (not the ones above), for the family table of
docs/models.md: ``HF_MLA_FAMILIES``, key and value heads of different sizes (MLA), which run
exactly under ``register(state)``::

    family                class                         attention
    deepseek_v2           DeepseekV2ForCausalLM         MLA: q/kv LoRA, 3 heads, key dim 10, value dim 5
    deepseek_v3           DeepseekV3ForCausalLM         the same, interleaved RoPE
    mimo_v2_flash         MiMoV2FlashForCausalLM        6 heads, GQA 6/1 (full) and 6/2 + sinks (sliding 8),
                                                        key dim 8, value dim 4, value scale

Their MLPs are dense (``first_k_dense_replace=2``, ``mlp_layer_types``): the MoE routers of these
families compute their logits in float32, whose matrix products round differently for different
numbers of tokens, so a model on shards differs from the same model on one device by ~1e-8
outside attention; ``n_routed_experts`` etc. are set, for ``first_k_dense_replace=1`` (MoE).

and ``HF_REFUSED_FAMILIES``, families ``register(state)`` refuses (docs/models.md says why)::

    bloom                 BloomForCausalLM              ALiBi, computed in its own attention module
    mpt                   MptForCausalLM                ALiBi as a position bias, own attention module
    falcon_alibi          FalconForCausalLM             ALiBi (bfloat16 slopes), own attention module
    falcon_rope           FalconForCausalLM             RoPE, multi-query, own attention module (SDPA)
    falcon_new_alibi      FalconForCausalLM             new decoder architecture, ALiBi, GQA 4/2
    falcon_new_rope       FalconForCausalLM             new decoder architecture, RoPE, GQA 4/2
    gptj                  GPTJForCausalLM               partial interleaved RoPE, own attention module
    t5                    T5ForConditionalGeneration    relative position bias (encoder-decoder)

and ``HF_MIXER_FAMILIES``, families with layers that mix tokens outside softmax attention, which
``register(state)`` refuses on shards (``cp_size > 1``; the structural check of Note [transformers
model checks]) and runs on one rank; two layers, the first of them a mixer (where the family has
softmax layers, the second one is one)::

    qwen3_next, qwen3_5_text, olmo_hybrid   gated delta rule + causal conv1d
    kimi_linear, bailing_hybrid            Kimi delta attention + conv1d, MLA softmax
    minimax                                lightning attention (linear, per-head decay)
    nemotron_h, granitemoehybrid, bamba,   Mamba2 (SSD) + conv1d (falcon_h1: next to attention in
    zamba2, mamba2, falcon_h1              every layer)
    jamba, mamba                           Mamba1 selective scan + conv1d
    lfm2, lfm3                             gated short convolution
    qwen3_5_moe_text, lfm2_moe             the same mixers with MoE layers (listed last)
    recurrent_gemma                        RG-LRU + conv1d, sliding softmax
    xlstm                                  mLSTM (chunkwise)
    deepseek_v4                            compressed KV (heavily compressed attention)
    deepseek_v32, glm_moe_dsa              an indexer that selects keys (DeepSeek sparse attention)
    minimax_m3_vl                          MiniMax-M3's text model: an indexer selecting key blocks

MoE layers need ``experts_implementation="eager"`` in float64 (the grouped kernels take half and
float32 only). Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "HF_FAMILIES", "HF_MIXER_FAMILIES", "HF_MLA_FAMILIES", "HF_REFUSED_FAMILIES", "causal_lm_class", "tiny_hf_config",
]

_COMMON: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    attention_dropout=0.0,
    use_cache=False,
    max_position_embeddings=512,
    initializer_range=0.1,  # scores well away from 0, so softcaps and sinks matter
)

# family -> (model class, config class, fields beyond _COMMON)
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8)),
    "qwen2": (
        "Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            use_sliding_window=True, sliding_window=8, max_window_layers=1, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        ),
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            sliding_window=8, query_pre_attn_scalar=8, attn_logit_softcapping=1.0, final_logit_softcapping=1.0
        ),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(sliding_window=8, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"]),
    ),
    "gemma3_bidirectional": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            sliding_window=8, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"],
            use_bidirectional_attention=True,
        ),
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(
            sliding_window=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "phimoe": (
        "PhimoeForCausalLM", "PhimoeConfig", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)
    ),
    "llama4": (
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        dict(
            attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=4, num_experts_per_tok=1,
            intermediate_size_mlp=64,
        ),
    ),
}

HF_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)

_MLA: dict[str, Any] = dict(
    hidden_size=36, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=None, intermediate_size=48,
    q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
    first_k_dense_replace=2, n_group=1, topk_group=1,
    attention_dropout=0.0, use_cache=False, max_position_embeddings=512, initializer_range=0.1,
)
_FALCON: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0,
    use_cache=False, initializer_range=0.1,
)
# family -> (model class, config class, every field but vocab_size): no _COMMON, names differ.
_OWN: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", _MLA),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", _MLA),
    "mimo_v2_flash": (
        "MiMoV2FlashForCausalLM",
        "MiMoV2FlashConfig",
        dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=1, head_dim=8,
            v_head_dim=4, sliding_window=8, layer_types=["full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "dense"],
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            attention_dropout=0.0, use_cache=False, max_position_embeddings=512, initializer_range=0.1,
        ),
    ),
    "bloom": (
        "BloomForCausalLM", "BloomConfig",
        dict(hidden_size=32, n_layer=2, n_head=4, attention_dropout=0.0, hidden_dropout=0.0, use_cache=False,
             initializer_range=0.1),
    ),
    "mpt": (
        "MptForCausalLM", "MptConfig",
        dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=128, use_cache=False,
             initializer_range=0.1),
    ),
    "falcon_alibi": (
        "FalconForCausalLM", "FalconConfig",
        dict(_FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True),
    ),
    "falcon_rope": ("FalconForCausalLM", "FalconConfig", dict(_FALCON, alibi=False, multi_query=True)),
    "falcon_new_alibi": (
        "FalconForCausalLM", "FalconConfig",
        dict(_FALCON, alibi=True, new_decoder_architecture=True, num_kv_heads=2),
    ),
    "falcon_new_rope": (
        "FalconForCausalLM", "FalconConfig",
        dict(_FALCON, alibi=False, new_decoder_architecture=True, num_kv_heads=2),
    ),
    "gptj": (
        "GPTJForCausalLM", "GPTJConfig",
        dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_inner=64, n_positions=512, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
             resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, initializer_range=0.1),
    ),
    "t5": (
        "T5ForConditionalGeneration", "T5Config",
        dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0, use_cache=False,
             decoder_start_token_id=0),
    ),
}
# Families with token mixers outside softmax attention (linear attention, state-space scans, short
# convolutions, recurrences, indexers and compressors that pick keys): every field but vocab_size.
_MIXER_COMMON: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
    initializer_range=0.1,
)
_GATED_DELTA = dict(
    head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=8)
_LATENT = dict(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4)
_INDEXED = dict(_LATENT, q_lora_rank=12, index_topk=4, index_head_dim=8, index_n_heads=2, mlp_layer_types=["dense", "dense"],
                n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
_MIXERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        _GATED_DELTA, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", _GATED_DELTA),
    "olmo_hybrid": ("OlmoHybridForCausalLM", "OlmoHybridConfig", _GATED_DELTA),
    "kimi_linear": ("KimiLinearForCausalLM", "KimiLinearConfig", dict(
        _LATENT, q_lora_rank=12, linear_head_dim=8, linear_num_heads=4, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"])),
    "bailing_hybrid": ("BailingHybridForCausalLM", "BailingHybridConfig", dict(
        _LATENT, head_dim=8, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"])),
    "minimax": ("MiniMaxForCausalLM", "MiniMaxConfig", dict(
        head_dim=8, layer_types=["linear_attention", "full_attention"], num_local_experts=2, num_experts_per_tok=1,
        block_size=4)),
    # Nemotron-H names its Mamba2 sizes its own way (the _MAMBA2 names would be ignored: 128 heads of 64).
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", dict(
        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8, conv_kernel=4, expand=2, chunk_size=8,
        head_dim=8, layers_block_type=["mamba", "attention"])),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", dict(
        _MAMBA2, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
        shared_intermediate_size=64)),
    "bamba": ("BambaForCausalLM", "BambaConfig", dict(_MAMBA2, attn_layer_indices=[1])),
    "zamba2": ("Zamba2ForCausalLM", "Zamba2Config", dict(_MAMBA2, layers_block_type=["mamba", "hybrid"], num_mem_blocks=1)),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config", dict(
        num_heads=4, head_dim=16, n_groups=1, state_size=8, conv_kernel=4, expand=2, chunk_size=8)),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config", dict(_MAMBA2, head_dim=8, mamba_d_ssm=64)),
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
        mamba_d_state=4)),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(layer_types=["conv", "full_attention"])),
    "lfm3": ("Lfm3ForCausalLM", "Lfm3Config", dict(layer_types=["conv", "full_attention"])),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", dict(
        lru_width=32, block_types=["recurrent", "attention"], attention_window_size=8)),
    "xlstm": ("xLSTMForCausalLM", "xLSTMConfig", dict(embedding_dim=32, num_heads=2, num_blocks=2, chunk_size=8)),
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(state_size=4, expand=2, conv_kernel=4)),
    "deepseek_v4": ("DeepseekV4ForCausalLM", "DeepseekV4Config", dict(
        head_dim=8, partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=2,
        num_experts_per_tok=1, index_n_heads=2, index_head_dim=8)),
    "deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config", _INDEXED),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", _INDEXED),
    "minimax_m3_vl": ("MiniMaxM3VLForCausalLM", "MiniMaxM3VLTextConfig", dict(
        head_dim=8, layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "dense"],
        dense_intermediate_size=64, index_n_heads=2, index_head_dim=8, index_block_size=2, index_topk_blocks=2,
        index_local_blocks=1, rotary_dim=4)),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(
        _GATED_DELTA, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    "lfm2_moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig", dict(
        layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16)),
}
HF_MIXER_FAMILIES: tuple[str, ...] = tuple(_MIXERS)
HF_MLA_FAMILIES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3", "mimo_v2_flash")
HF_REFUSED_FAMILIES: tuple[str, ...] = tuple(f for f in _OWN if f not in HF_MLA_FAMILIES)


def _check_family(family: str) -> tuple[str, str, dict[str, Any]]:
    if family in _FAMILIES:
        return _FAMILIES[family]
    if family in _OWN:
        return _OWN[family]
    if family in _MIXERS:
        return _MIXERS[family]
    raise ValueError(
        f"unknown model family {family!r}; valid families: {list(HF_FAMILIES) + list(_OWN) + list(_MIXERS)}"
    )


def tiny_hf_config(family: str, *, vocab_size: int = 97, **overrides: Any):
    """A tiny config of ``family`` (see the module docstring); keyword arguments override fields.

    Returns:
        The family's ``transformers`` config (a fresh object per call: ``_from_config`` records
        the ``attn_implementation`` on it).

    Raises:
        ValueError: an unknown family.
        ImportError: transformers is not installed (``pip install seqpar[hf]``).
    """
    import transformers

    _, config_name, fields = _check_family(family)
    common = _COMMON if family in _FAMILIES else _MIXER_COMMON if family in _MIXERS else {}
    return getattr(transformers, config_name)(**{**common, **fields, "vocab_size": vocab_size, **overrides})


def causal_lm_class(family: str) -> type:
    """The ``...ForCausalLM`` class of ``family`` (``T5ForConditionalGeneration`` for ``t5``).

    Raises:
        ValueError: an unknown family.
    """
    import transformers

    return getattr(transformers, _check_family(family)[0])
