"""Moved to seqpar.tools.models.dit; this alias is kept for existing imports."""

from ..tools.models.dit import DiTBlock, VideoDiT, patchify, unpatchify

__all__ = ["VideoDiT", "DiTBlock", "patchify", "unpatchify"]
