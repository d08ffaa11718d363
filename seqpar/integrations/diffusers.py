"""Context parallelism for diffusers transformers: ``parallelize(model, state)``.

::

    from seqpar.integrations.diffusers import parallelize

    model = parallelize(FluxTransformer2DModel.from_pretrained(...), state)
    out = model(hidden_states=latents, encoder_hidden_states=text, ...).sample   # full in, full out

Note [diffusers context parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
diffusers (checked against 0.42.1) declares on about ten transformer classes a ``_cp_plan``: a dict
from module names (``""`` is the model itself, ``"blocks.0"`` a submodule, one ``*`` ranges over a
``ModuleList``) to one of

- ``{input_name: ContextParallelInput(split_dim, expected_dims, split_output=False)}``: split that
  forward argument (a tensor, or a list/tuple of tensors with a list of specs) along ``split_dim``
  before the module runs;
- ``{output_index: ContextParallelInput(split_dim, expected_dims, split_output=True)}``: split that
  output (RoPE tables computed for the full sequence) after it ran;
- ``ContextParallelOutput(gather_dim, expected_dims)`` or a list of them (``None`` skips an
  output): gather the module's output(s) along ``gather_dim`` after it ran.

A tensor whose number of dims is not ``expected_dims`` is left whole, as diffusers does (Wan's
``timestep`` is split only in its per-token 2-D form). :func:`parallelize` reads the same plan and
installs forward hooks that do these splits and gathers on ``state.cp_group``: a split keeps this
rank's contiguous part of ``split_sizes(n, cp_size)`` (the first ``n % cp_size`` ranks hold one
more), so lengths never need to divide anything, and every tensor split from a sequence of the
same length (tokens, their RoPE table, their mask) is split the same way.

Attention: the attention processors of these models call diffusers' ``dispatch_attention_fn(...,
parallel_config=self._parallel_config)`` and pass ``None`` for calls that are not over sharded
tokens (Wan's cross-attention to its replicated text). :func:`parallelize` sets every processor's
``_parallel_config`` to a :class:`ShardedAttention` bound to ``state`` and wraps the backend
functions of diffusers' attention registry once (process-wide) so that a call carrying a
``ShardedAttention`` runs it, and every other call -- no parallel config, or diffusers' own
``ContextParallelConfig`` -- runs the original backend unchanged. The processor's own decision of
what is sharded is therefore followed exactly (Note [Sharded attention calls]). Processors that
call ``F.scaled_dot_product_attention`` directly (SD3's ``JointAttnProcessor2_0``, CogVideoX's) have
no ``_parallel_config``; their attention module runs under ``seqpar.parallel_sdpa(state)`` (any
shard lengths, non-causal), or under ``local_sdpa()`` if the module is a cross-attention module
(``is_cross_attention``), whose keys must then come from replicated text.

Gradients: a split is a plain ``narrow`` (backward: this rank's gradient in zeros, no
communication) and a gather is ``seqpar.comm.all_gather`` (backward: reduce-scatter, i.e. the
gradient of this rank's part summed over the CP group). So gradients are partial, as everywhere in
seqpar: when each rank backpropagates a share ``L_r`` of the loss with ``sum_r L_r = L`` -- for a
loss computed on the full output, ``L / cp_size`` on every rank -- the parameter gradients summed
over ``state.cp_group`` are the single-device gradients, and so are the summed gradients of the
inputs.

Note [Sharded attention calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A call that carries a :class:`ShardedAttention` has sharded queries (``[B, S_q_local, H, D]``,
diffusers' layout) and sharded keys/values. The keys may be the queries' own tokens (self or joint
attention: Flux concatenates its text and image shards) or another sharded sequence (LTX's
cross-attention to its sharded text, with a key mask). Every such call is non-causal, and
non-causal attention without a mask does not depend on where the tokens are: each query attends
to all keys of all ranks. So the call first exchanges ``(S_q_local, S_k_local)`` over the CP group
(one small all-gather; every rank then takes the same branch):

- no mask and ``S_q_local == S_k_local`` on every rank: ``seqpar.attention`` with the any-lengths
  non-causal path (exact for self, joint and, since the keys' positions do not matter, also for
  such cross-attention);
- otherwise (lengths differ somewhere, or a key mask is given): the keys, values and mask are
  all-gathered over the CP group (backward: reduce-scatter) and each rank attends its queries to
  all of them with plain SDPA. A mask must not vary over queries (``[B, S_k]`` or ``[..., 1,
  S_k]``): the query rows of a sharded mask would belong to other ranks.

Causal calls, dropout and ``return_lse`` are refused.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import attention
from ..comm import all_gather, exchange_ints
from ..sdpa import local_sdpa, parallel_sdpa
from ..state import ParallelState, require_state
from .diffusers_guard import same_inputs_hook
from .hooks import ContextHooks, gather_parts, refuse_empty_parts, split_part

__all__ = ["ShardedAttention", "gather_parts", "parallelize", "split_part"]

_WHERE = "seqpar.integrations.diffusers"
# Attribute set on a model by parallelize (its hooks), so that a second call is refused.
_APPLIED = "_seqpar_context_parallel"


# --- splitting and gathering ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Split:
    """One plan entry that splits: the input ``key`` (a name or an output index) along ``dim``."""

    key: str | int
    dims: tuple[tuple[int, int | None], ...]  # (split_dim, expected_dims) per tensor of a list
    is_list: bool
    on_output: bool


@dataclass(frozen=True)
class _Gather:
    """One plan entry that gathers outputs: ``(gather_dim, expected_dims)`` or ``None`` each."""

    dims: tuple[tuple[int, int | None] | None, ...]
    is_list: bool


def _spec_dims(spec: object, field: str, where: str) -> tuple[int, int | None]:
    dim = getattr(spec, field, None)
    expected = getattr(spec, "expected_dims", None)
    if isinstance(dim, bool) or not isinstance(dim, int) or not (expected is None or isinstance(expected, int)):
        raise ValueError(
            f"{_WHERE}: plan entry {where} is {spec!r}; expected a ContextParallelInput (split_dim, "
            "expected_dims, split_output) or ContextParallelOutput (gather_dim, expected_dims)"
        )
    return dim, expected


def _parse_entry(module_name: str, entry: object) -> list[_Split] | _Gather:
    """The hooks one plan entry asks for, after checking its format (Note [diffusers ...])."""
    if isinstance(entry, Mapping):
        splits = []
        for key, spec in entry.items():
            where = f"{module_name!r}[{key!r}]"
            specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
            if not specs or any(not hasattr(s, "split_dim") for s in specs):
                raise ValueError(
                    f"{_WHERE}: plan entry {where} is {spec!r}; an input entry maps names (or output "
                    "indices) to a ContextParallelInput or a list of them"
                )
            on_output = {bool(getattr(s, "split_output", False)) for s in specs}
            if len(on_output) != 1:
                raise ValueError(f"{_WHERE}: plan entry {where} mixes split_output=True and False")
            on_output = on_output.pop()
            if on_output != isinstance(key, int) or isinstance(key, bool):
                raise ValueError(
                    f"{_WHERE}: plan entry {where}: split_output=True needs an int key (the output "
                    "index) and split_output=False a str key (the forward argument's name)"
                )
            dims = tuple(_spec_dims(s, "split_dim", where) for s in specs)
            splits.append(_Split(key, dims, isinstance(spec, (list, tuple)), on_output))
        return splits
    specs = list(entry) if isinstance(entry, (list, tuple)) else [entry]
    if not specs or not all(s is None or hasattr(s, "gather_dim") for s in specs):
        raise ValueError(
            f"{_WHERE}: plan entry {module_name!r} is {entry!r}; expected a dict of "
            "ContextParallelInput, or a ContextParallelOutput (or a list of them)"
        )
    dims = tuple(None if s is None else _spec_dims(s, "gather_dim", repr(module_name)) for s in specs)
    return _Gather(dims, isinstance(entry, (list, tuple)))


def _submodules(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules a plan key names: ``""`` the model, dotted paths, one ``*`` over a ModuleList."""
    if name.count("*") > 1:
        raise ValueError(f"{_WHERE}: plan key {name!r} has more than one '*'")
    found = [model]
    for atom in name.split(".") if name else []:
        step = []
        for m in found:
            if atom == "*":
                if not isinstance(m, nn.ModuleList):
                    raise ValueError(
                        f"{_WHERE}: plan key {name!r}: '*' must stand for a ModuleList, got {type(m).__name__}"
                    )
                step.extend(m)
            elif isinstance(getattr(m, atom, None), nn.Module):
                step.append(getattr(m, atom))
            else:
                raise ValueError(
                    f"{_WHERE}: plan key {name!r}: {type(m).__name__} has no submodule {atom!r}"
                )
        found = step
    return found


def _split_tensor(x: Tensor, dims: tuple[int, int | None], state: ParallelState, where: str) -> Tensor:
    dim, expected = dims
    if expected is not None and x.dim() != expected:
        return x  # as diffusers: another rank of tensor is left whole (Note [diffusers ...])
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{_WHERE}: {where}: split_dim={dim} is out of range for shape {tuple(x.shape)}")
    refuse_empty_parts(x.shape[dim], state, _WHERE, f"{where} (shape {tuple(x.shape)}, split along dim {dim})")
    return split_part(x, state, dim % x.dim())


def _split_value(value: object, split: _Split, state: ParallelState, where: str) -> object:
    if value is None:
        return None
    if not split.is_list:
        if not isinstance(value, Tensor):
            raise ValueError(f"{_WHERE}: {where} is a {type(value).__name__}, but the plan splits it as a tensor")
        return _split_tensor(value, split.dims[0], state, where)
    if not isinstance(value, (list, tuple)) or len(value) != len(split.dims):
        raise ValueError(
            f"{_WHERE}: {where} is {type(value).__name__}"
            f"{f' of {len(value)}' if isinstance(value, (list, tuple)) else ''}, but the plan has a "
            f"list of {len(split.dims)} specs for it"
        )
    out = [
        _split_tensor(v, d, state, f"{where}[{i}]") if isinstance(v, Tensor) else v
        for i, (v, d) in enumerate(zip(value, split.dims))
    ]
    return type(value)(out) if isinstance(value, tuple) else out


def _input_hook(splits: list[_Split], state: ParallelState, module_name: str, module: nn.Module) -> Callable:
    names = [s for s in splits if not s.on_output]
    signature = inspect.signature(module.forward).parameters
    params = [n for n, p in signature.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.values())
    for split in names:
        if split.key not in signature and not takes_any:
            raise ValueError(
                f"{_WHERE}: the plan splits input {split.key!r} of {module_name!r}, but "
                f"{type(module).__name__}.forward has no such argument (it has {list(signature)})"
            )

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        for split in names:
            where = f"input {split.key!r} of {module_name or type(mod).__name__!r}"
            if split.key in kwargs:
                kwargs[split.key] = _split_value(kwargs[split.key], split, state, where)
            elif split.key in params and params.index(split.key) < len(args):
                i = params.index(split.key)
                args[i] = _split_value(args[i], split, state, where)
        return tuple(args), kwargs

    return hook


def _output_split_hook(splits: list[_Split], state: ParallelState, module_name: str) -> Callable:
    outs = [s for s in splits if s.on_output]

    def hook(mod: nn.Module, args: tuple, output: object) -> object:
        single = isinstance(output, Tensor)
        items = [output] if single else list(output) if isinstance(output, (list, tuple)) else None
        if items is None:
            raise ValueError(
                f"{_WHERE}: {module_name!r} returned a {type(output).__name__}; the plan splits its outputs"
            )
        for split in outs:
            if split.key >= len(items):
                raise ValueError(
                    f"{_WHERE}: the plan splits output {split.key} of {module_name!r}, which returned {len(items)}"
                )
            items[split.key] = _split_value(items[split.key], split, state, f"output {split.key} of {module_name!r}")
        return items[0] if single else type(output)(items)

    return hook


def _gather_hook(gather: _Gather, state: ParallelState, module_name: str) -> Callable:
    def hook(mod: nn.Module, args: tuple, output: object) -> object:
        single = isinstance(output, Tensor)
        items = [output] if single else list(output) if isinstance(output, (list, tuple)) else None
        if items is None or not all(isinstance(t, Tensor) for t in items) or len(items) != len(gather.dims):
            raise ValueError(
                f"{_WHERE}: the plan gathers {len(gather.dims)} output(s) of {module_name!r}, which "
                f"returned {type(output).__name__}"
                f"{f' of {len(items)}' if isinstance(output, (list, tuple)) else ''}"
            )
        for i, dims in enumerate(gather.dims):
            if dims is None:
                continue
            dim, expected = dims
            t = items[i]
            if (expected is not None and t.dim() != expected) or not -t.dim() <= dim < t.dim():
                raise ValueError(
                    f"{_WHERE}: output {i} of {module_name!r} has shape {tuple(t.shape)}; the plan "
                    f"gathers it along dim {dim} with expected_dims={expected}"
                )
            items[i] = gather_parts(t, state, dim % t.dim())
        return items[0] if single else type(output)(items)

    return hook


# --- attention ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShardedAttention:
    """Set as an attention processor's ``_parallel_config``: its sharded calls run on seqpar.

    Called by the wrapped diffusers attention backend with the dispatcher's arguments (Note
    [Sharded attention calls]).

    Args:
        state: the parallel state the tokens are split over.
        backend: seqpar attention backend (``"auto"``, ``"cpu"``, ``"flash_attn"``, ...).
    """

    state: ParallelState
    backend: str = "auto"

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        **ignored: Any,
    ) -> Tensor:
        """Attention of this rank's queries over the keys of every CP rank.

        Args:
            query: ``(batch, seqlen_q_local, nheads, headdim)``, this rank's queries.
            key, value: ``(batch, seqlen_k_local, nheads_kv, headdim)``, this rank's keys/values.
            attn_mask: ``None``, or a key mask that does not vary over queries: ``(batch,
                seqlen_k_local)`` or ``(..., 1, seqlen_k_local)``, bool or additive.
            scale: softmax scale (default ``headdim ** -0.5``); ``enable_gqa`` as SDPA.

        Returns:
            ``(batch, seqlen_q_local, nheads, headdim)``: this rank's rows of the attention over all
            keys (possibly a strided view).

        Raises:
            ValueError: a mask that varies over queries or does not match the keys.
            NotImplementedError: causal attention, dropout or ``return_lse``.
        """
        state = self.state
        if return_lse:
            raise NotImplementedError(f"{_WHERE}: return_lse=True is not supported on sharded attention calls")
        if dropout_p:
            raise NotImplementedError(
                f"{_WHERE}: attention dropout {dropout_p} is not supported on sharded attention calls"
            )
        if is_causal:
            raise NotImplementedError(
                f"{_WHERE}: is_causal=True on tokens split contiguously by a diffusers plan is not "
                "supported (causal attention needs seqpar.shard's placement); diffusers' models are non-causal"
            )
        s_q, s_k = query.shape[1], key.shape[1]
        if attn_mask is not None:
            attn_mask = _key_mask(attn_mask, query, key)
        lengths = exchange_ints([s_q, s_k, int(attn_mask is not None)], state.cp_group, query.device)
        if not any(row[2] for row in lengths) and all(row[0] == row[1] for row in lengths):
            return attention(query, key, value, state, softmax_scale=scale, layout="bshd", backend=self.backend)
        sizes = [row[1] for row in lengths]
        if state.cp_size > 1:
            key = all_gather(key, state.cp_group, 1, sizes)
            value = all_gather(value, state.cp_group, 1, sizes)
            if attn_mask is not None:
                attn_mask = _gather_mask(attn_mask, state, sizes)
        kwargs = {"enable_gqa": True} if enable_gqa else {}
        with local_sdpa():
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                attn_mask=attn_mask, scale=scale, **kwargs,
            )
        return out.transpose(1, 2)


def _key_mask(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """``mask`` as ``[..., 1, S_k_local]`` (broadcast over queries), after checking it is one."""
    B, s_k = query.shape[0], key.shape[1]
    if mask.dim() == 2 and tuple(mask.shape) == (B, s_k):
        mask = mask[:, None, None, :]
    if mask.dim() >= 2 and mask.shape[-1] != s_k:
        raise ValueError(
            f"{_WHERE}: attention mask {tuple(mask.shape)} for queries {tuple(query.shape)} and keys "
            f"{tuple(key.shape)} on sharded calls: it covers {mask.shape[-1]} keys but this rank holds "
            f"{s_k} (its shard): a mask over the whole sequence is not split by the plan, so it cannot be "
            "matched to the sharded keys; add the mask to the plan's inputs so it is split like the keys, "
            "or run without a mask"
        )
    if mask.dim() < 3 or mask.shape[-2] != 1:
        raise ValueError(
            f"{_WHERE}: attention mask {tuple(mask.shape)} for queries {tuple(query.shape)} and keys "
            f"{tuple(key.shape)}: on sharded calls only key masks that do not vary over queries are "
            f"supported ([B, S_k] or [..., 1, S_k] with S_k={s_k}); a block-causal or prefix mask over "
            "frames needs seqpar's placement: seqpar.parallel_sdpa / seqpar.attention(mask=MaskSlices...)"
        )
    return mask.detach()


def _gather_mask(mask: Tensor, state: ParallelState, sizes: list[int]) -> Tensor:
    if mask.dtype == torch.bool:  # gloo gathers no bool tensors
        return all_gather(mask.to(torch.uint8), state.cp_group, mask.dim() - 1, sizes).bool()
    return all_gather(mask, state.cp_group, mask.dim() - 1, sizes)


# The registry's backends are wrapped once per process; the original is kept on the wrapper.
_WRAP_LOCK = threading.Lock()


def _wrap_backend(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    @functools.wraps(fn)
    def backend(*args: Any, **kwargs: Any) -> Tensor:
        config = kwargs.get("_parallel_config")
        if isinstance(config, ShardedAttention):
            return config(*args, **kwargs)
        return fn(*args, **kwargs)

    backend._seqpar_original = fn  # type: ignore[attr-defined]
    return backend


def _registry():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry


def _install_dispatch() -> None:
    """Wrap every backend of diffusers' attention registry (once; Note [diffusers ...])."""
    registry = _registry()
    with _WRAP_LOCK:
        for name, fn in list(registry._backends.items()):
            if not hasattr(fn, "_seqpar_original"):
                registry._backends[name] = _wrap_backend(fn)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """diffusers' attention modules in ``model`` (those ``enable_parallelism`` also visits)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    kinds = (Attention, MochiAttention, AttentionModuleMixin)
    return [m for m in model.modules() if isinstance(m, kinds) and getattr(m, "processor", None) is not None]


def _check_backend(processor: object) -> None:
    """Raise unless the processor's diffusers backend passes ``_parallel_config`` through."""
    registry = _registry()
    name = getattr(processor, "_attention_backend", None)
    if name is None:
        name, _ = registry.get_active_backend()
    accepted = registry._supported_arg_names.get(name, ())
    if "_parallel_config" not in accepted:
        raise ValueError(
            f"{_WHERE}: attention processor {type(processor).__name__} uses diffusers backend "
            f"{getattr(name, 'value', name)!r}, which drops the parallel config, so its attention would "
            f"run on local shards only; use a backend that supports context parallelism "
            f"({sorted(registry._supports_context_parallel)}) via model.set_attention_backend()"
        )


def _guard_hook(records: list[tuple[nn.Module, object]]) -> Callable:
    """Model pre-hook: the processors set up by parallelize are still in place and usable."""

    def hook(model: nn.Module, args: tuple) -> None:
        for module, processor in records:
            if module.processor is not processor or (
                hasattr(processor, "_parallel_config")
                and not isinstance(processor._parallel_config, ShardedAttention)
            ):
                raise RuntimeError(
                    f"{_WHERE}: the attention processor of a {type(module).__name__} was replaced or "
                    "re-configured after parallelize(); its attention would no longer be exact. Set "
                    "processors and attention backends before calling parallelize()"
                )
            if hasattr(processor, "_parallel_config"):
                _check_backend(processor)

    return hook


def parallelize(
    model: nn.Module,
    state: ParallelState,
    plan: Mapping[str, object] | None = None,
    *,
    backend: str = "auto",
) -> nn.Module:
    """Apply context parallelism over ``state`` to a diffusers model, in place.

    Every rank of ``state.cp_group`` calls the model with the same full inputs and gets the same
    full output, equal to the single-device model's; inside, the tokens the plan names are split
    over the CP group and attention runs on seqpar (Note [diffusers context parallelism]).

    Args:
        model: a diffusers model (``ModelMixin``), e.g. ``FluxTransformer2DModel``. Its attention
            processors and backend must be set before this call.
        state: the parallel state; its CP group splits the tokens (a DP factor is left alone).
        plan: the context-parallel plan in diffusers' ``_cp_plan`` format (``ContextParallelInput``
            / ``ContextParallelOutput`` from ``diffusers.models._modeling_parallel``); default: the
            model's own ``_cp_plan``.
        backend: seqpar attention backend for the sharded attention calls.

    Returns:
        ``model``, with forward hooks installed and its processors bound to ``state``.

    Raises:
        ValueError: no plan (the model declares none and ``plan`` is ``None``); a malformed plan
            or one naming missing modules; a model that is already parallel (by this function or
            by diffusers' ``enable_parallelism``); an attention backend that drops the parallel
            config. Calls of the model raise ``ValueError`` for inputs that do not match the plan
            or that differ between the CP ranks (Note [Same inputs on every CP rank] in
            ``diffusers_guard.py``) and ``RuntimeError`` if processors were replaced afterwards.
        ImportError: diffusers is not installed.
    """
    require_state(state, _WHERE)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{_WHERE}: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _APPLIED, None) is not None:
        raise ValueError(f"{_WHERE}: parallelize() was already applied to this {type(model).__name__}")
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(
            f"{_WHERE}: this {type(model).__name__} already runs diffusers' own parallelism "
            "(enable_parallelism); use one or the other"
        )
    if plan is None:
        plan = getattr(model, "_cp_plan", None)
        if plan is None:
            raise ValueError(
                f"{_WHERE}: {type(model).__name__} declares no _cp_plan; pass plan= in the same format "
                "(see docs/howto-diffusers.md for SD3 and CogVideoX plans)"
            )
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"{_WHERE}: plan must be a non-empty dict of module names, got {plan!r}")

    # Build (and so check) everything before changing anything.
    pre_hooks, post_hooks = [], []
    for name, entry in plan.items():
        parsed = _parse_entry(name, entry)
        for module in _submodules(model, name):
            if isinstance(parsed, _Gather):
                post_hooks.append((module, _gather_hook(parsed, state, name)))
                continue
            if any(not s.on_output for s in parsed):
                pre_hooks.append((module, _input_hook(parsed, state, name, module)))
            if any(s.on_output for s in parsed):
                post_hooks.append((module, _output_split_hook(parsed, state, name)))
    attn_modules = _attention_modules(model)
    for module in attn_modules:
        if hasattr(module.processor, "_parallel_config"):
            if module.processor._parallel_config is not None:
                raise ValueError(
                    f"{_WHERE}: a {type(module).__name__} processor already has a parallel config; "
                    "parallelize() a model only once and without enable_parallelism()"
                )
            _check_backend(module.processor)

    _install_dispatch()
    marker = ShardedAttention(state, backend)
    sharded_sdpa = ContextHooks(lambda: parallel_sdpa(state, backend=backend))
    local = ContextHooks(local_sdpa)
    handles: list[torch.utils.hooks.RemovableHandle] = []
    records = []
    for module in attn_modules:
        processor = module.processor
        records.append((module, processor))
        if hasattr(processor, "_parallel_config"):
            processor._parallel_config = marker
        else:
            hooks = local if getattr(module, "is_cross_attention", False) else sharded_sdpa
            handles += hooks.register(module)
    handles += [module.register_forward_pre_hook(hook, with_kwargs=True) for module, hook in pre_hooks]
    handles += [module.register_forward_hook(hook) for module, hook in post_hooks]
    handles.append(model.register_forward_pre_hook(_guard_hook(records)))
    if state.cp_size > 1:  # first of all hooks: compare the full inputs (Note [Same inputs on every CP rank])
        handles.append(model.register_forward_pre_hook(same_inputs_hook(state, model), with_kwargs=True, prepend=True))
    setattr(model, _APPLIED, handles)
    return model
