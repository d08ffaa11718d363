"""Integrations of seqpar with other libraries, each imported lazily by its own module.

- :mod:`seqpar.integrations.transformers`: a Hugging Face ``transformers`` attention
  implementation (``attn_implementation="seqpar"``).
- :mod:`seqpar.integrations.diffusers`: ``parallelize(model, state)`` for diffusers transformers,
  following the model's ``_cp_plan`` (``docs/howto-diffusers.md``).
- :mod:`seqpar.integrations.timm`: ``parallelize(model, state)`` for timm's ViT, DeiT and EVA
  models, prefix tokens replicated (``docs/howto-timm.md``).

Shared pieces: :mod:`seqpar.integrations.hooks` (``ContextHooks``, the contiguous split and gather
of the diffusers and timm hooks) and :mod:`seqpar.integrations.transformers_guard` (the checks of
every call of a transformers model built with a seqpar ``attn_implementation``).

Importing this package imports none of those libraries.
"""

__all__: list[str] = []
