"""A module's own forward, run with some of the kernel functions it calls swapped for seqpar's.

Note [Rebound kernels]
~~~~~~~~~~~~~~~~~~~~~~
transformers 5.23's hybrid layers call their sequence kernels as module-level functions of their
modeling file (``causal_conv1d_fn(...)``, ``torch_chunk_gated_delta_rule(...)``: the
causal-conv1d / flash-linear-attention kernel where installed, else a torch fallback, chosen when
the file is imported). On shards only those calls need to change, to run on whole sequences of
some heads (Note [Head-parallel mixing]); the projections, gates and norms around them are
token-wise and keep running on the shard, as the modeling code wrote them.

So an adapter gives the module *instance* a forward made of the class's own code (same code
object, defaults and closure) whose global namespace is a copy of its modeling module's with the
kernel names bound to seqpar's functions. Decorators that wrap the forward with
``functools.wraps`` and hold it in their closure (transformers' ``force_accelerate_hooks``) are
rebuilt around it. Nothing of the class or the modeling module changes: other instances and other
models keep the original kernels, and ``module.forward`` is the only attribute set.

The code is checked, not trusted: every swapped name must be a global that the forward reads, and
the forward's leading parameters must be the ones the adapter was written against; otherwise the
adapter refuses to install, naming the class and the transformers version.

Note [Renamed cache parameter]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5.24 renamed the cache parameter of the token mixers' forwards (``cache_params`` or
``past_key_values`` in 5.23) to ``cache`` and left their bodies as they were (Note [transformers
cache argument]); the old keyword still reaches the forward through ``deprecate_kwarg``, which
wraps it with ``functools.wraps`` and holds it in its closure, as the rebuild above expects. So an
adapter names that parameter by its alternatives (:func:`cache_parameter`), which the checks
accept either of; reads the call's cache under any of them (:func:`call_cache`: the forward's own
parameter, or the other name caught in its ``**kwargs``), so that a cache is refused whichever
name the caller used; and writes one under the name the class's forward takes
(:func:`parameter_name`).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from torch import nn

__all__ = [
    "cache_parameter", "call_cache", "checked_forward", "original_kernels", "parameter_name", "rebind_forward",
    "refuse_adapting", "set_forward", "shown", "takes",
]

# A forward's parameter: its name, or the names it has had across transformers releases.
Parameter = Union[str, tuple[str, ...]]

_REBOUND = "_seqpar_rebound"  # attribute of a forward built here


def refuse_adapting(cls: type, what: str) -> NotImplementedError:
    """The error of an adapter that refuses to install on ``cls`` (its code is not what was read)."""
    import transformers

    return NotImplementedError(
        f"seqpar: cannot adapt {cls.__name__} to sequence shards: {what}. Its adapter was written "
        f"against transformers 5.23 and 5.24 (installed: {transformers.__version__}); run the model with "
        "cp_size 1, or report the version so that the adapter can follow it"
    )


def _innermost(cls: type) -> types.FunctionType:
    forward = inspect.getattr_static(cls, "forward", None)
    if not isinstance(forward, types.FunctionType):
        raise refuse_adapting(cls, f"its forward is a {type(forward).__name__}, not a Python function")
    inner = inspect.unwrap(forward)
    if not isinstance(inner, types.FunctionType):
        raise refuse_adapting(cls, "its forward wraps something that is not a Python function")
    return inner


def cache_parameter(old: str) -> tuple[str, str]:
    """A mixer's cache parameter: ``old`` (its 5.23 name) or ``cache`` (5.24 on); Note [Renamed
    cache parameter]."""
    return (old, "cache")


def takes(got: Sequence[str], parameters: Sequence[Parameter]) -> bool:
    """Whether the parameter names ``got`` start with ``parameters`` (a tuple entry: any of its names)."""
    return len(got) >= len(parameters) and all(
        g == p if isinstance(p, str) else g in p for g, p in zip(got, parameters)
    )


def shown(parameters: Sequence[Parameter]) -> list[str]:
    """``parameters`` for messages, alternatives joined by ``|``."""
    return [p if isinstance(p, str) else "|".join(p) for p in parameters]


def parameter_name(cls: type, alternatives: Sequence[str]) -> str:
    """The one of ``alternatives`` that ``cls.forward`` takes (check it with :func:`checked_forward` first).

    Raises:
        NotImplementedError: a forward that takes none of them.
    """
    got = inspect.signature(_innermost(cls)).parameters
    name = next((n for n in alternatives if n in got), None)
    if name is None:
        raise refuse_adapting(cls, f"its forward takes {list(got)}, none of {list(alternatives)}")
    return name


def call_cache(call: Mapping[str, Any], alternatives: Sequence[str]) -> tuple[Any, str]:
    """The cache a call passes and the name it came under, from the call's bound arguments
    (``signature.bind(...).arguments``): under the forward's own parameter, or under another of
    ``alternatives`` caught in its ``**kwargs`` (``deprecate_kwarg`` hands that on to the forward);
    ``(None, alternatives[0])`` when it passes none. Note [Renamed cache parameter]."""
    extra = call.get("kwargs")
    places = (call, extra) if isinstance(extra, Mapping) else (call,)
    for name in alternatives:
        for place in places:
            value = place.get(name)
            if value is not None:
                return value, name
    return None, alternatives[0]


def checked_forward(cls: type, parameters: Sequence[Parameter], reads: Sequence[str] = ()) -> types.FunctionType:
    """The innermost Python function of ``cls.forward``, after checking that its parameters start
    with ``parameters`` (``self`` first; a tuple entry: any of its names) and that its code reads
    every name in ``reads``.

    Raises:
        NotImplementedError: a forward of another shape, naming what differs.
    """
    inner = _innermost(cls)
    got = list(inspect.signature(inner).parameters)
    if not takes(got, parameters):
        raise refuse_adapting(cls, f"its forward takes {got}, not {shown(parameters)} first")
    missing = [name for name in reads if name not in inner.__code__.co_names]
    if missing:
        raise refuse_adapting(cls, f"its forward does not read {missing}")
    return inner


def original_kernels(module: nn.Module, names: Sequence[str], parameters: Sequence[Parameter]) -> dict[str, Callable]:
    """The functions that ``type(module).forward`` calls under ``names`` (its modeling module's
    globals), after checking that its code reads each of them and that its parameters start
    with ``parameters`` (``self`` first).

    Raises:
        NotImplementedError: a forward of another shape (another transformers version, a forward
            replaced by a kernel hub), naming what differs.
    """
    cls = type(module)
    own = vars(module).get("forward")
    if own is not None and not getattr(getattr(own, "__func__", own), _REBOUND, False):
        raise refuse_adapting(cls, "this instance's forward was replaced (by a kernel hub or another library)")
    inner = checked_forward(cls, parameters)
    out = {}
    for name in names:
        value = inner.__globals__.get(name)
        if name not in inner.__code__.co_names or not callable(value):
            raise refuse_adapting(cls, f"its forward does not call a module-level function {name}")
        out[name] = value
    return out


def _rebuild(fn: types.FunctionType, kernels: Mapping[str, Callable], cls: type) -> types.FunctionType:
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        namespace = {**fn.__globals__, **kernels}
        closure = fn.__closure__
    else:
        new_inner = _rebuild(inner, kernels, cls)
        cells = list(fn.__closure__ or ())
        holds = [i for i, c in enumerate(cells) if _contents(c) is inner]
        if not holds:
            raise refuse_adapting(cls, f"its forward is wrapped by {fn.__qualname__}, which does not hold it in its closure")
        for i in holds:
            cells[i] = types.CellType(new_inner)
        namespace, closure = fn.__globals__, tuple(cells)
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    if inner is not None:
        new.__wrapped__ = new_inner
    return new


def _contents(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def rebind_forward(module: nn.Module, kernels: Mapping[str, Callable]) -> types.FunctionType:
    """``type(module).forward`` with the globals ``kernels`` names bound to ``kernels``' values
    (Note [Rebound kernels]), unbound: call it with the module first. Check the forward with
    :func:`original_kernels` first."""
    cls = type(module)
    return _rebuild(inspect.getattr_static(cls, "forward"), kernels, cls)


def set_forward(module: nn.Module, forward: Callable) -> None:
    """Make ``forward(module, ...)`` this instance's forward (replacing one set here before)."""
    setattr(forward, _REBOUND, True)
    object.__setattr__(module, "forward", types.MethodType(forward, module))
