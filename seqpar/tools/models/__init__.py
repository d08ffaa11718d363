"""Tiny reference models for the scripts, tests and docs (not part of the attention API).

- :mod:`seqpar.tools.models.dit`: a small video diffusion transformer built from SDPA blocks, meant to
  run under ``seqpar.parallel_sdpa`` with no change.
- :mod:`seqpar.tools.models.llama`: a small Llama-style ``transformers`` config (imports transformers
  only when called).
- :mod:`seqpar.tools.models.pipelines`: tiny random diffusers pipelines (Flux, Wan) built in code,
  no download (imports diffusers only when called; import the module itself).
"""

from .dit import VideoDiT, patchify, unpatchify
from .llama import tiny_llama_config

__all__ = ["VideoDiT", "patchify", "unpatchify", "tiny_llama_config"]
