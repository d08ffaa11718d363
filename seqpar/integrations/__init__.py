"""Integrations of seqpar with other libraries, each imported lazily by its own module.

- :mod:`seqpar.integrations.transformers`: a Hugging Face ``transformers`` attention
  implementation (``attn_implementation="seqpar"``).
- :mod:`seqpar.integrations.diffusers`: ``parallelize(model, state)`` for diffusers transformers,
  following the model's ``_cp_plan`` (``docs/howto-diffusers.md``).
- :mod:`seqpar.integrations.timm`: ``parallelize(model, state)`` for timm's ViT, DeiT and EVA
  models, prefix tokens replicated (``docs/howto-timm.md``).

Importing this package imports none of those libraries.
"""

__all__: list[str] = []
