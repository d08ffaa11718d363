"""A tiny Llama-style ``transformers`` config for tests and examples."""

from __future__ import annotations

from typing import Any

__all__ = ["tiny_llama_config"]


def tiny_llama_config(
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 8192,
    **overrides: Any,
):
    """A small ``transformers.LlamaConfig`` (GQA by default) for random-init models.

    Attention dropout is 0 and the KV cache is off (``use_cache=False``), as sequence-parallel
    training needs. Extra keyword arguments override any config field.

    Returns:
        ``transformers.LlamaConfig``.

    Raises:
        ImportError: transformers is not installed (``pip install seqpar[hf]``).
    """
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size if intermediate_size is not None else 2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)
