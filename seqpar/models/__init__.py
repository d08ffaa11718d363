"""Moved to seqpar.tools.models; this alias is kept for existing imports."""

from ..tools.models import VideoDiT, patchify, tiny_llama_config, unpatchify

__all__ = ["VideoDiT", "patchify", "unpatchify", "tiny_llama_config"]
