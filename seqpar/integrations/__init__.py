"""Integrations of seqpar with other libraries, each imported lazily by its own module.

- :mod:`seqpar.integrations.transformers`: a Hugging Face ``transformers`` attention
  implementation (``attn_implementation="seqpar"``).

Importing this package imports none of those libraries.
"""

__all__: list[str] = []
