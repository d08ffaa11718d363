"""What the modules of the transformers integration share; it imports none of them (their layering:
docs/architecture.md): the mask object the attention layers receive (:class:`RecognisedMask`),
the refusals of a caller's mask that the attention function and the model check both word, the
name transformers takes the KV cache under (Note [transformers cache argument]) and what
``register`` bound an attention implementation name to (:func:`binding`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

from torch import Tensor

from ..placement import Mask
from ..state import ParallelState

__all__ = [
    "CACHE_ARGUMENTS", "Binding", "MaskUsedAsTensor", "RecognisedMask", "binding", "cache_argument",
    "four_d_mask_message", "full_length_mask_message",
]


class MaskUsedAsTensor(NotImplementedError, AttributeError):
    """A model computed with seqpar's :class:`RecognisedMask` as if it were a mask tensor.

    Also an ``AttributeError``, so that ``hasattr(mask, ...)`` / ``getattr(mask, ..., default)``
    probes keep answering "no" instead of raising.
    """


@dataclass(frozen=True)
class RecognisedMask:
    """What :func:`mask_function` hands transformers, and transformers hands every layer.

    Not a tensor: a model that computes attention (or anything) from the mask itself instead of
    handing it to transformers' attention interface gets :class:`MaskUsedAsTensor` naming the
    model at its first arithmetic, indexing or tensor attribute on it (Bloom, MPT, Doge, ...:
    Note [transformers model checks] in ``seqpar.integrations.transformers_guard``).

    Attributes:
        mask: the pattern in global positions, normalised for ``grid`` positions.
        grid: how many global positions were probed (at least the global sequence length).
        model: the model type the mask was built for (from its config), for messages.
        packed: transformers wrapped the pattern for packed sequences (positions that restart,
            not this rank's global positions): ``mask`` holds within each sequence, and the
            layers need the call's ``cu_seq_lens_q`` (Note [Packed sequences in transformers models]).
    """

    mask: Mask
    grid: int
    model: str = field(default="", compare=False, repr=False)
    packed: bool = False

    def _misuse(self, what: str) -> MaskUsedAsTensor:
        model = self.model or "this"
        return MaskUsedAsTensor(
            f"seqpar attention: the {model} model computes with its attention mask itself ({what}) "
            "instead of handing it to transformers' attention interface, so seqpar, which recognises "
            "the mask on global positions and builds no tensor, cannot run it on sequence shards; "
            "use a model family that calls the attention interface (docs/models.md)"
        )

    def __getattr__(self, name: str) -> NoReturn:  # only for names the dataclass does not have
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._misuse(f"it reads attention_mask.{name}")

    def __getitem__(self, index: object) -> NoReturn:
        raise self._misuse("it indexes the mask")

    def _arithmetic(self, other: object = None) -> NoReturn:
        raise self._misuse("it adds, multiplies or compares the mask")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arithmetic
    __truediv__ = __rtruediv__ = __and__ = __rand__ = __or__ = __ror__ = __invert__ = _arithmetic
    __lt__ = __le__ = __gt__ = __ge__ = _arithmetic


def four_d_mask_message(shape: str, n: int, cp_size: int) -> str:
    """Why a caller's 4-D ``attention_mask`` (of shape ``shape``) is refused on shards (``cp_size > 1``)."""
    return (
        f"seqpar attention: got a 4-D attention_mask of shape {shape} over this rank's {n} tokens; on "
        f"sequence shards ({cp_size} CP ranks) a mask over one shard cannot say how tokens attend "
        "across shards (a 1x1 block is both causal and all-attend, a causal block is also that of a "
        "sliding window wider than the shard), so it would be read wrongly. Pass no attention_mask: "
        "the model builds its causal, bidirectional, sliding-window or chunked mask itself, and "
        "seqpar recognises it on global positions"
    )


def full_length_mask_message(mask_len: int, n: int) -> str:
    """Why a 2-D ``attention_mask`` longer than the shard is refused."""
    return (
        f"seqpar attention: the 2-D attention_mask has {mask_len} tokens per row but this rank holds "
        f"{n} tokens of input_ids: a full-length mask next to sharded ids. Shard it like the ids "
        "(attention_mask=seqpar.shard(attention_mask, state)), or pass none (all ones is no mask)"
    )


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"


# Note [transformers cache argument]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers 5.24 renamed the KV cache argument of the models, ``generate`` and the mask builders
# from ``past_key_values`` to ``cache`` (the old name still works there, with a FutureWarning, and
# model outputs carry ``.cache``). Everything else SeqparCache relies on is unchanged: layers call
# ``update(key, value, layer_idx, ...)`` and hand the result to the attention function, and
# ``generate`` slices the prompt by ``get_seq_length``. seqpar passes the cache under the name the
# installed release's generation API takes (its signature, read here and nowhere else) and reads a
# model call's cache under either name (:data:`CACHE_ARGUMENTS`).
CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(where: str) -> str:
    """The keyword under which the installed transformers passes the KV cache to models and
    ``generate``: ``"cache"`` (5.24 on) or ``"past_key_values"`` (before); Note [transformers cache
    argument].

    Raises:
        NotImplementedError: a release whose generation API takes neither (named with the version).
    """
    import inspect

    import transformers
    from transformers.generation.utils import GenerationMixin

    # inspect.signature follows the __wrapped__ of transformers' deprecate_kwarg decorators
    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    name = next((n for n in CACHE_ARGUMENTS if n in parameters), None)
    if name is None:
        raise NotImplementedError(
            f"{where}: transformers {transformers.__version__} takes the KV cache under neither of "
            f"{list(CACHE_ARGUMENTS)} (GenerationMixin.prepare_inputs_for_generation has {list(parameters)}), "
            "so seqpar's sharded KV cache cannot be handed to it; install a release seqpar supports "
            "(pip install -e \".[hf]\"), or prefill with seqpar.inference (docs/inference.md)"
        )
    return name


@dataclass(frozen=True)
class Binding:
    """What :func:`~seqpar.integrations.transformers.register` bound a name to."""

    state: ParallelState
    backend: str
    mixing: str = "head_parallel"  # how token mixers run on shards (transformers_mixers.install)


def binding(name: object) -> Binding | None:
    """The seqpar binding of attention implementation ``name``, or ``None`` if it is not seqpar's."""
    if not isinstance(name, str):
        return None
    from transformers import AttentionInterface

    return getattr(AttentionInterface().get(name), "_seqpar_binding", None)
