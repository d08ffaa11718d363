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
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from ...state import ParallelState

__all__ = ["handled", "install", "register_adapter"]

Installer = Callable[[nn.Module, ParallelState], None]

_ADAPTERS: dict[str, Installer] = {}
_FAMILIES = ("gated_delta", "short_conv", "mamba", "linear_attention", "recurrent")  # modules of this package whose import registers their adapters (filled below)
_INSTALLED = "_seqpar_mixer"  # attribute of an adapted module: the ParallelState it is bound to


def register_adapter(qualname: str) -> Callable[[Installer], Installer]:
    """Decorator: ``installer(module, state)`` makes a module of class ``qualname`` (its
    ``__module__ + "." + __qualname__``) exact on ``state``'s shards. It is called once per module
    instance and state; it must not change what the module computes on one rank."""

    def register(installer: Installer) -> Installer:
        _ADAPTERS[qualname] = installer
        return installer

    return register


def _load() -> None:
    for family in _FAMILIES:
        importlib.import_module(f"{__name__}.{family}")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def install(model: nn.Module, state: ParallelState) -> list[str]:
    """Install the registered adapters on every module of ``model`` that has one (idempotent;
    a module bound to another state is bound again). Returns the adapted modules' paths."""
    _load()
    paths = []
    for path, module in model.named_modules():
        installer = _ADAPTERS.get(_qualname(type(module)))
        if installer is None:
            continue
        if getattr(module, _INSTALLED, None) is not state:
            installer(module, state)
            object.__setattr__(module, _INSTALLED, state)
        paths.append(path)
    return paths


def handled(module: nn.Module, state: ParallelState) -> bool:
    """Whether ``module`` carries an adapter bound to ``state``."""
    return getattr(module, _INSTALLED, None) is state
