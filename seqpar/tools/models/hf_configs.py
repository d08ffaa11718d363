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
reach Gemma 2's softcaps (1.0). Imports transformers only when called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HF_FAMILIES", "causal_lm_class", "tiny_hf_config"]

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


def _check_family(family: str) -> tuple[str, str, dict[str, Any]]:
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid families: {list(HF_FAMILIES)}")
    return _FAMILIES[family]


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
    return getattr(transformers, config_name)(**{**_COMMON, **fields, "vocab_size": vocab_size, **overrides})


def causal_lm_class(family: str) -> type:
    """The ``...ForCausalLM`` class of ``family``.

    Raises:
        ValueError: an unknown family.
    """
    import transformers

    return getattr(transformers, _check_family(family)[0])
