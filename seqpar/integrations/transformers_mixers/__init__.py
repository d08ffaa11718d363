"""Adapters that run transformers' token mixers exactly on sequence shards (docs/hybrid-models.md).

Note [transformers token-mixer adapters]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A hybrid model's linear-attention, state-space and convolution layers would see only their rank's
tokens on shards. An adapter makes one module type exact there: installed on a module instance, it
routes the module's sequence mixing through :mod:`seqpar.mixing` (head-parallel or state passing)
while the module's token-wise parts (projections, norms, gates) run on the shard as before.

The model check (Note [transformers model checks]) calls :func:`install` on a seqpar model before
it looks for token mixers; a module carrying an installed adapter (:func:`handled`) bound to the
call's state is not a mixer to refuse. Everything no adapter claims is still refused, on every rank.

Adapters are registered per class by its qualified name (``"transformers.models.qwen3_next.
modeling_qwen3_next.Qwen3NextGatedDeltaNet"``), so no modeling module is imported to register one.

The adapters of the recurrences with a state-passing form (gated delta nets, MiniMax lightning
attention) and the short convolutions (whose state-passing form is the conv's halo) run either
mode; ``install(model, state, mixing=...)`` picks (Note [Choosing the mixing mode] in
:mod:`.modes`), and :func:`mixing_modes` says what each ran.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from ...state import ParallelState
from .modes import HEAD_PARALLEL, MODES, STATE_PASSING, MixerMode, ModeChooser, check_mixing, choose_mode

__all__ = [
    "MODES", "MixerMode", "choose_mode", "handled", "install", "mixing_modes", "register_adapter",
]

# installer(module, state), or installer(module, state, mixing) for an adapter with both modes
Installer = Callable[..., None]


@dataclass(frozen=True)
class _Adapter:
    installer: Installer
    modes: tuple[str, ...]


_ADAPTERS: dict[str, _Adapter] = {}
_FAMILIES = ("gated_delta", "short_conv", "mamba", "linear_attention", "recurrent", "sparse", "compressed", "block_sparse")  # modules of this package whose import registers their adapters (filled below)
_INSTALLED = "_seqpar_mixer"  # attribute of an adapted module: the ParallelState it is bound to
_MIXING = "_seqpar_mixing"  # attribute of an adapted module: the mixing it was installed with
CHOOSER = "_seqpar_mode_chooser"  # attribute of a module whose adapter runs both modes: its ModeChooser


def register_adapter(qualname: str, *, modes: Sequence[str] | None = (HEAD_PARALLEL,)) -> Callable[[Installer], Installer]:
    """Decorator: ``installer(module, state)`` makes a module of class ``qualname`` (its
    ``__module__ + "." + __qualname__``) exact on ``state``'s shards. It is called once per module
    instance, state and mixing; it must not change what the module computes on one rank.

    ``modes``: the modes the adapter runs, ``("head_parallel",)`` or both, or ``None`` for an
    adapter that is no mixing mode at all (DeepSeek sparse attention gathers key-side tensors; any
    ``mixing`` runs it and ``"state_passing"`` is not refused for it); an adapter with
    ``"state_passing"`` is called ``installer(module, state, mixing)`` with the requested
    ``mixing`` (``"auto"`` too) and sets a :class:`~.modes.ModeChooser` as ``module.<CHOOSER>``."""
    if modes is None:  # not a recurrence or conv: it runs the same whatever mixing is asked for
        modes = ()
    elif not modes or any(m not in (HEAD_PARALLEL, STATE_PASSING) for m in modes):
        raise ValueError(f"register_adapter: modes must name 'head_parallel' and/or 'state_passing', got {modes}")
    else:
        modes = tuple(modes)

    def register(installer: Installer) -> Installer:
        _ADAPTERS[qualname] = _Adapter(installer, modes)
        return installer

    return register


def _load() -> None:
    for family in _FAMILIES:
        importlib.import_module(f"{__name__}.{family}")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def install(model: nn.Module, state: ParallelState, mixing: str = HEAD_PARALLEL) -> list[str]:
    """Install the registered adapters on every module of ``model`` that has one (idempotent;
    a module bound to another state or mixing is bound again). Returns the adapted modules' paths.

    Args:
        model: any module; its token mixers with an adapter are made exact on ``state``'s shards.
        state: the parallel state the tokens are sharded over.
        mixing: ``"head_parallel"`` (default: the model's own kernels on whole sequences of some
            heads, bitwise as on one device), ``"state_passing"`` (every rank its own tokens, a
            few states exchanged, bytes independent of the length) or ``"auto"`` (per call, by
            heads per rank and predicted bytes). Note [Choosing the mixing mode].

    Raises:
        ValueError: an unknown ``mixing``, or ``"state_passing"`` for a model with a mixer that
            has no state-passing form (naming it and the modes that apply); the same on every rank.
    """
    check_mixing(mixing, "install")
    _load()
    found = []
    for path, module in model.named_modules():
        adapter = _ADAPTERS.get(_qualname(type(module)))
        if adapter is not None:
            found.append((path, module, adapter))
    if mixing == STATE_PASSING:
        fixed: dict[str, list[str]] = {}  # class name: paths of its modules
        for path, module, adapter in found:
            if adapter.modes and STATE_PASSING not in adapter.modes:
                fixed.setdefault(type(module).__name__, []).append(path or "<model>")
        if fixed:
            which = ", ".join(
                f"{cls} ({paths[0]}{f' and {len(paths) - 1} more' if len(paths) > 1 else ''})"
                for cls, paths in fixed.items()
            )
            raise ValueError(
                f"install: mixing='state_passing' does not apply to {which}: their adapters run "
                "'head_parallel' only. Pass mixing='head_parallel', or 'auto' (state passing where a mixer "
                "has it, head-parallel elsewhere)"
            )
    paths = []
    for path, module, adapter in found:
        if getattr(module, _INSTALLED, None) is not state or getattr(module, _MIXING, None) != mixing:
            if STATE_PASSING in adapter.modes:
                adapter.installer(module, state, mixing)
            else:
                adapter.installer(module, state)
            object.__setattr__(module, _INSTALLED, state)
            object.__setattr__(module, _MIXING, mixing)
        paths.append(path)
    return paths


def handled(module: nn.Module, state: ParallelState) -> bool:
    """Whether ``module`` carries an adapter bound to ``state``."""
    return getattr(module, _INSTALLED, None) is state


def mixing_modes(model: nn.Module) -> dict[str, MixerMode | None]:
    """Per adapted module that runs both modes (path: its :class:`MixerMode`), what its last
    call on shards ran (``None`` before one). Other adapted modules always run head-parallel."""
    out = {}
    for path, module in model.named_modules():
        chooser = vars(module).get(CHOOSER)
        if isinstance(chooser, ModeChooser):
            out[path] = chooser.last
    return out
