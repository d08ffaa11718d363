"""Moved to seqpar.tools.models.llama; this alias is kept for existing imports."""

from ..tools.models.llama import tiny_llama_config

__all__ = ["tiny_llama_config"]
