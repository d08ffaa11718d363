"""Moved to seqpar.tools.models.hf_configs; this alias is kept for existing imports."""

from ..tools.models.hf_configs import HF_FAMILIES, causal_lm_class, tiny_hf_config

__all__ = ["HF_FAMILIES", "causal_lm_class", "tiny_hf_config"]
