"""Model-level checks for ``attn_implementation=register(state)`` models (the transformers integration).

Note [transformers model checks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The attention function sees one layer's queries and keys; some mistakes are only visible on the
model's own call, and some models never call it at all:

- a model whose config object is shared with another model: ``from_config(config,
  attn_implementation="sdpa")`` for a reference switches this model back to plain per-rank
  attention, and seqpar is never called again;
- a model that computes attention itself (Bloom, MPT, ...: its modeling code never
  calls transformers' attention interface): seqpar's mask object reaches its arithmetic;
- ``labels=``: transformers' loss on a shard is a local mean with the next-token shift applied
  inside the shard;
- ``position_ids`` missing or wrong: models that never pass them to attention (BERT, GPT-BigCode,
  ModernBERT, Qwen2-VL text, Llama 4) number every shard from 0 unnoticed;
- a rank holding no token: transformers' own mask code fails there (``position_ids[:, -1]``)
  while the other ranks wait in seqpar's first collective;
- a full-length 2-D ``attention_mask`` next to sharded ids, padding, a 4-D mask;
- a model with modules that mix tokens outside attention (linear attention and gated delta rules,
  Mamba scans, short convolutions, recurrences, indexers and compressors that pick keys: Qwen3-Next,
  MiniMax, Jamba, LFM2, DeepSeek-V3.2/V4, ...): on shards each would see only its rank's tokens.

The token mixers are found from the model's structure, never from class names (:func:`token_mixers`;
nested models built from another config, vision or audio towers, are not on the sharded sequence).
A module is a token mixer if

(a) its type mixes along the sequence: a convolution wider than one token (2-D/3-D ones only where
    their windows overlap: a patch embedding maps each patch to one token), a recurrence, pooling,
    padding (RWKV's token shift), torch's own attention;
(b) the config declares its layer a kind that is neither softmax attention nor token-wise
    (``layer_types``, ``layers_block_type``, ``block_types``, ``hybrid_override_pattern``, Kimi's
    ``linear_attn_config``: "linear_attention", "conv", "mamba", "hybrid", "indexed_attention",
    "heavily_compressed_attention", any kind not known to be softmax or token-wise). The module
    named is what the walk found inside that layer, else what differs from a softmax layer of the
    same list (MiniMax's ``self_attn`` class), else a module with projections of its own inside the
    layer's attention module (an indexer), else the attention module or the layer;
(c) its own forward -- with the methods and module-level helpers it calls, the functions the
    instance holds (a kernel picked in ``__init__``, a ``functools.partial``), through
    ``functools.wraps`` and closures (transformers' kernel-or-torch-fallback wrappers) -- calls a
    sequence primitive (``cumsum``, ``conv1d``, ``roll``, FFTs, ``scaled_dot_product_attention``
    ...) or a kernel of flash-linear-attention, mamba_ssm, causal-conv1d or xLSTM. Embeddings and
    the block holding the input embedding table are exempt: they run before any hidden state
    exists (RoBERTa counts positions with a ``cumsum`` of the mask).

A module whose forward calls transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``) is
softmax attention that seqpar handles, but what it holds or calls besides is checked like anything
else (DeepSeek-V4's compressor inside its attention module). :func:`handle_token_mixer` registers
module types and kernel functions seqpar runs exactly on shards; the check skips those, and refuses
the rest, naming each module path and how it was found, e.g. ``model.layers.0.self_attn
(MiniMaxLightningAttention: config.layer_types[0] = 'linear_attention')``. The answer depends on the
model's structure only, so every rank raises the same ``NotImplementedError`` without communicating,
before the exchange below; it is cached on the model until any module is registered anywhere in the
process (a layer replaced after the build is seen). With ``cp_size == 1`` nothing is sharded and
such models run (DeepSeek sparse attention layers through their adapter, since they hand seqpar's
mask object to their indexer: Note [DeepSeek sparse attention on shards]).

So :func:`seqpar.integrations.transformers.register` installs, once per process, a torch module
registration hook: when a ``PreTrainedModel`` whose config names a seqpar implementation gets its
first submodule (during its ``__init__``, so for ``from_config`` and ``from_pretrained`` alike), it
gets a forward pre-hook, :func:`check_call`. A model nested in another such model (``LlamaModel``
in ``LlamaForCausalLM``) hands its hook to the outer one, so one call is checked once.

:func:`check_call` refuses token mixers (``cp_size > 1``), looks at this rank's arguments, then
(``cp_size > 1``) all-gathers one row of a
few ints per CP rank -- its token count, the first problem it found and a fingerprint of its
positions -- and every rank raises the same error for the first rank with a problem, or for
token counts or positions that are not seqpar's placement of their sum, before any rank runs the
model on its shard. Where the state has one rank, only the first two checks apply.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..comm import exchange_ints
from ..placement import Placement
from ..state import ParallelState
from . import transformers_mixers
from .transformers_mixers.block_sparse import sparse_attention_layers
from .transformers_packed import ancestors, packed_call
from .transformers_shared import CACHE_ARGUMENTS, Binding, binding, four_d_mask_message, full_length_mask_message

__all__ = [
    "Binding", "TokenMixer", "binding", "calls_attention_interface", "check_call", "fingerprint", "handle_token_mixer",
    "install", "token_mixers",
]

_GUARD = "_seqpar_guard"  # attribute of a checked model: (implementation name, hook handle)
# Implementation names a switched config may name, coded as ints for the exchange (0: another).
_KNOWN = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")

# Problem codes of one rank's call, in the order they are looked for.
SWITCHED, UNSUPPORTED, LABELS, NO_POSITION_PARAMETER, NO_POSITIONS, POSITIONS, EMPTY, FULL_LENGTH_MASK, PADDING, MASK_4D = range(1, 11)


def install(handles: list) -> None:
    """Install the module registration hook of Note [transformers model checks] (once: ``handles``
    holds its handle)."""
    if not handles:
        handles.append(torch.nn.modules.module.register_module_module_registration_hook(_on_register))


def _on_register(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """Module registration hook: check seqpar models; a checked model nested in another hands over."""
    _STRUCTURE[0] += 1  # some model's structure changed: cached token-mixer checks start over
    if not hasattr(module, "config"):
        return
    _guard(module)
    inner = getattr(submodule, _GUARD, None)
    if inner is not None and getattr(module, _GUARD, None) is not None:
        inner[1].remove()
        object.__setattr__(submodule, _GUARD, None)


def _guard(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    if getattr(model, _GUARD, None) is not None or not isinstance(model, PreTrainedModel):
        return
    name = getattr(model.config, "_attn_implementation", None)
    if binding(name) is None:
        return
    _refuse_attention_class_table(model, name)
    handle = model.register_forward_pre_hook(functools.partial(check_call, name=name), with_kwargs=True)
    object.__setattr__(model, _GUARD, (name, handle))


# --- one call -------------------------------------------------------------------------------------


@functools.cache
def _parameters(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    """``(positional parameter names after self, every named parameter)`` of ``cls.forward``."""
    params = inspect.signature(cls.forward).parameters
    positional = tuple(n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return positional[1:], frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD)


def _argument(model: nn.Module, args: tuple, kwargs: dict[str, Any], name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    positional, _ = _parameters(type(model))
    i = positional.index(name) if name in positional else len(args)
    return args[i] if i < len(args) else None


@functools.cache
def _computes_attention_itself(cls: type) -> bool:
    """Whether ``cls``'s modeling code defines attention modules but never calls transformers'
    attention interface (``ALL_ATTENTION_FUNCTIONS``): Bloom, MPT, ...
    transformers' own heuristic (``_can_set_attn_implementation``), except that code that cannot
    be read counts as calling it (a mask used as a tensor still raises, ``MaskUsedAsTensor``)."""
    try:
        code = inspect.getsource(sys.modules[cls.__module__])
    except (KeyError, OSError, TypeError):
        return False
    defines = re.search(r"^class \w*Attention\w*\(nn\.Module\):", code, re.MULTILINE) is not None
    return defines and "ALL_ATTENTION_FUNCTIONS" not in code


def _refuse_attention_class_table(model: nn.Module, name: str) -> None:
    """Refuse, while it is built, a model that computes attention itself and picks its attention
    class from a table keyed by implementation name (Falcon's ``FALCON_ATTENTION_CLASSES``, GPT-J's
    ``GPTJ_ATTENTION_CLASSES``): its build would otherwise fail with a ``KeyError`` naming ``name``.

    Raises:
        NotImplementedError: on every rank alike (no communication), naming the model and the table.
    """
    cls = type(model)
    code = getattr(sys.modules.get(cls.__module__), "__dict__", {})
    tables = [k for k, v in code.items() if k.endswith("_ATTENTION_CLASSES") and isinstance(v, dict) and name not in v]
    if tables and _computes_attention_itself(cls):
        raise NotImplementedError(
            f"seqpar: {cls.__name__} computes attention itself instead of calling transformers' attention "
            f"interface (it picks its attention module from {tables[0]}, which has no {name!r}), so "
            "seqpar cannot run it on sequence shards; build it with attn_implementation='eager' or "
            "'sdpa' on one device. The families seqpar runs are in docs/models.md"
        )


# --- token mixers outside attention (Note [transformers model checks]) ------------------------------


@dataclass(frozen=True)
class TokenMixer:
    """A module of a model that mixes tokens along the sequence outside transformers' attention
    interface, and how the structural check found it."""

    path: str  # its name in model.named_modules(), e.g. "model.layers.0.linear_attn"
    kind: str  # its class name
    why: str  # what makes it a token mixer, e.g. "config.layer_types[0] = 'linear_attention'"

    def __str__(self) -> str:
        return f"{self.path} ({self.kind}: {self.why})"


# Module types and kernel functions that seqpar runs exactly on sequence shards. A module of a
# handled type is not looked into; a kernel function in here is not a reason to refuse. Empty until
# seqpar handles a mixer: everything the check finds is refused.
_HANDLED: set[object] = set()


def handle_token_mixer(kind: type | Callable) -> None:
    """Mark a module type, or a kernel function a module's forward calls, as a token mixer seqpar
    runs exactly on shards, so that :func:`token_mixers` no longer reports it."""
    _HANDLED.add(kind)


# The kinds a config's per-layer list (layer_types, layers_block_type, block_types) gives softmax
# attention layers and token-wise layers; any other kind ("linear_attention", "conv", "mamba",
# "hybrid", "recurrent", "indexed_attention", "compressed_sparse_attention", ...) mixes tokens
# otherwise, and so does a kind nobody listed here yet.
_SOFTMAX_KINDS = frozenset({
    "full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local",
    "global_attention", "local_attention", "window_attention", "bidirectional_attention",
})
_TOKENWISE_KINDS = frozenset({"mlp", "moe", "dense", "sparse", "hash_moe"})
_LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types")
# Nemotron-H's hybrid_override_pattern letters.
_PATTERN_KINDS = {"*": "attention", "M": "mamba", "-": "mlp", "E": "moe"}

# Calls that combine values along a dimension (torch functions and Tensor methods by their names):
# scans, convolutions, pooling, FFTs, shifts, and attention computed without the interface.
_SEQUENCE_PRIMITIVES = frozenset({
    "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "avg_pool1d", "max_pool1d", "lp_pool1d",
    "adaptive_avg_pool1d", "adaptive_max_pool1d", "fft", "rfft", "irfft", "roll",
    "scaled_dot_product_attention",
})
# Kernel packages of linear attention, state-space scans, short convolutions and xLSTM, and the public
# functions of theirs that modeling code calls (kernels absent on CPU leave only the names).
_KERNEL_PACKAGES = frozenset({"fla", "mamba_ssm", "causal_conv1d", "kernels", "xlstm"})
_KERNEL_FUNCTIONS = frozenset({
    "selective_scan_fn", "mamba_inner_fn", "selective_state_update", "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined", "causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda", "chunk_simple_gla", "chunk_gla",
    "fused_chunk_gla", "lightning_attn_func",
})
_TRACE_DEPTH = 4  # helper calls followed from a forward (methods, module-level functions)


def _by_type(module: nn.Module) -> str | None:
    """Why a torch.nn module mixes tokens by its type alone (convolutions wider than a token,
    recurrences, pooling, torch's own attention), or None. A 2-D/3-D convolution or pool whose
    windows tile their input (kernel == stride, no padding: a vision patch embedding) maps each
    patch to one token and is not a mixer."""
    if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
        return f"a recurrence ({type(module).__name__}) over the sequence"
    if isinstance(module, (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return "torch attention, not transformers' attention interface"
    if isinstance(module, nn.modules.conv._ConvNd):
        kernel, stride, padding = module.kernel_size, module.stride, module.padding
        if len(kernel) == 1:
            return f"a convolution of width {kernel[0]} over the sequence" if kernel[0] > 1 else None
        tiles = tuple(kernel) == tuple(stride) and padding in ((0,) * len(kernel), "valid") and not module.transposed
        return None if tiles else f"a convolution with kernel {tuple(kernel)}, stride {tuple(stride)}"
    pools = (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._LPPoolNd)
    if isinstance(module, pools):
        kernel = module.kernel_size if isinstance(module.kernel_size, tuple) else (module.kernel_size,)
        one_d = isinstance(module, (nn.MaxPool1d, nn.AvgPool1d, nn.LPPool1d))
        stride = module.stride if isinstance(module.stride, tuple) else (module.stride or module.kernel_size,)
        if (one_d and max(kernel) > 1) or (not one_d and tuple(kernel) != tuple(stride)):
            return f"pooling with kernel {module.kernel_size}"
        return None
    if isinstance(module, (nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)):
        return "adaptive pooling"
    pads = (nn.modules.padding._ConstantPadNd, nn.modules.padding._ReflectionPadNd, nn.modules.padding._ReplicationPadNd)
    if isinstance(module, pads) and any(module.padding):  # RWKV's token shift is a ZeroPad2d
        return f"padding {tuple(module.padding)}, which shifts tokens along the sequence"
    return None


def _functions(obj: object) -> list[types.FunctionType]:
    """The Python functions behind a callable: itself, what it wraps (``functools.wraps``) and the
    functions its closure holds (transformers' kernel-or-torch-fallback wrappers)."""
    out: list[types.FunctionType] = []
    todo = [obj]
    while todo:
        f = todo.pop()
        if isinstance(f, functools.partial):  # a kernel bound to its options in __init__ (xLSTM)
            todo += [f.func, *f.args, *f.keywords.values()]
            continue
        f = getattr(f, "fget", None) or getattr(f, "__func__", f)  # properties, bound and static methods
        if not isinstance(f, types.FunctionType) or f in out:
            continue
        out.append(f)
        if hasattr(f, "__wrapped__"):
            todo.append(f.__wrapped__)
        for cell in f.__closure__ or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    return out


def _kernel_name(obj: object) -> str | None:
    """``package.name`` if ``obj`` comes from a kernel package (flash-linear-attention, mamba_ssm,
    causal-conv1d, transformers' hub kernels), else None."""
    origin = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if not isinstance(origin, str) or origin.split(".")[0] not in _KERNEL_PACKAGES:
        return None
    return f"{origin}.{getattr(obj, '__name__', '')}".rstrip(".")


def _traceable(fn: types.FunctionType) -> bool:
    """Whether to read ``fn``'s code: modeling code and user code, not torch or transformers'
    shared machinery (masks, kernels' dispatch, the attention functions themselves)."""
    module = fn.__module__ or ""
    if module.split(".")[0] == "torch":
        return False
    return not module.startswith("transformers.") or module.startswith("transformers.models.")


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


@functools.lru_cache(maxsize=4096)
def _reach(root: Callable, cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """``(names, kernels)``: every global and attribute name the code reachable from ``root`` (a
    forward of ``cls``) reads -- through ``cls``'s methods and module-level helpers, up to
    ``_TRACE_DEPTH`` calls deep -- and the kernel-package functions it reaches."""
    names: set[str] = set()
    kernels: set[str] = set()
    seen: set[types.FunctionType] = set()
    todo: list[tuple[object, int]] = [(root, 0)]
    while todo:
        obj, depth = todo.pop()
        for fn in _functions(obj):
            if fn in seen:
                continue
            seen.add(fn)
            kernel = _kernel_name(fn)
            if kernel is not None:
                kernels.add(kernel)
                continue
            if not _traceable(fn):
                continue
            found = _code_names(fn.__code__)
            names |= found
            if depth >= _TRACE_DEPTH:
                continue
            for name in found:
                method = inspect.getattr_static(cls, name, None)
                if method is not None and not isinstance(method, type):
                    todo.append((method, depth + 1))
                value = fn.__globals__.get(name)
                if value is None or isinstance(value, type):
                    continue
                kernel = _kernel_name(value)
                if kernel is not None:
                    kernels.add(kernel)
                elif callable(value):
                    todo.append((value, depth + 1))
    return frozenset(names), frozenset(kernels)


def _forward_reach(module: nn.Module) -> tuple[frozenset[str], frozenset[str]]:
    """:func:`_reach` of a module's forward, with the functions the instance holds as attributes
    (a kernel chosen in ``__init__``, a forward replaced by hooks) followed too."""
    cls = type(module)
    names, kernels = _reach(cls.forward, cls)
    own = vars(module)
    extra = [own["forward"]] if "forward" in own else []
    extra += [v for k, v in own.items() if k in names and callable(v) and not isinstance(v, (nn.Module, type))]
    for fn in extra:
        if _kernel_name(fn) is not None:
            kernels |= {_kernel_name(fn)}
            continue
        more, more_kernels = _reach(getattr(fn, "__func__", fn), cls)
        names, kernels = names | more, kernels | more_kernels
    return names, kernels


def calls_attention_interface(module: nn.Module) -> bool:
    """Whether ``module``'s forward calls transformers' attention interface
    (``ALL_ATTENTION_FUNCTIONS``, where the config's ``_attn_implementation`` is looked up)."""
    return "ALL_ATTENTION_FUNCTIONS" in _forward_reach(module)[0]


def _by_calls(module: nn.Module) -> str | None:
    """Why a module's own forward mixes tokens, from what it calls (scans, convolutions, kernel
    functions of linear attention and state-space models), or None."""
    names, kernels = _forward_reach(module)
    handled = {getattr(k, "__name__", None) for k in _HANDLED if not isinstance(k, type)}
    called = sorted((names & (_SEQUENCE_PRIMITIVES | _KERNEL_FUNCTIONS)) - handled)
    called += sorted(k for k in kernels if k.rsplit(".", 1)[-1] not in handled)
    return f"its forward calls {', '.join(called)}" if called else None


def _config_kinds(config: object) -> tuple[str, list[object]] | None:
    """``(field, kind of every layer)`` from the first per-layer list the config declares."""
    n = getattr(config, "num_hidden_layers", None)
    for field in _LAYER_KIND_FIELDS:
        try:
            kinds = getattr(config, field, None)
        except Exception:  # noqa: BLE001 - a config property that cannot be computed declares nothing
            kinds = None
        if isinstance(kinds, (list, tuple)) and kinds:
            count = n if isinstance(n, int) and n > 0 else len(kinds)
            return field, [kinds[i % len(kinds)] for i in range(count)]  # a shorter list repeats (block_types)
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and pattern:
        return "hybrid_override_pattern", [_PATTERN_KINDS.get(c, c) for c in pattern]
    linear = getattr(config, "linear_attn_config", None)  # Kimi Linear checkpoints: 1-based layer numbers
    if isinstance(linear, dict) and isinstance(linear.get("kda_layers"), (list, tuple)) and isinstance(n, int):
        kda = {int(i) - 1 for i in linear["kda_layers"]}
        return "linear_attn_config['kda_layers']", ["kda" if i in kda else "full_attention" for i in range(n)]
    return None


def _mixes(kind: object) -> bool:
    return kind not in _SOFTMAX_KINDS and kind not in _TOKENWISE_KINDS


def _outermost(paths: list[str]) -> list[str]:
    """The paths not inside another of ``paths`` (dotted module paths), in their order, once each."""
    return [p for p in dict.fromkeys(paths) if not any(p.startswith(q + ".") for q in paths)]


def _layer_list(model: nn.Module, count: int, skip: tuple[str, ...]) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of ``count`` decoder layers in ``model`` (preferring one named ``layers``)."""
    lists = [
        (p, m) for p, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == count and not any(p == s or p.startswith(s + ".") for s in skip)
    ]
    lists.sort(key=lambda pm: (not pm[0].endswith("layers"), pm[0].count(".")))
    return lists[0] if lists else None


def _declared_mixer_modules(
    layer: nn.Module, base: str, kinds: list[object], layers: nn.ModuleList, i: int, found: dict[str, str],
) -> list[str]:
    """The paths to name for layer ``i``, which the config declares a token mixer: what the walk
    found inside it; else what differs from a softmax layer of the same list; else the custom
    modules with projections of its own inside its attention module (an indexer, a compressor);
    else its attention module, else the layer."""
    inside = [p for p in found if p.startswith(base + ".")]
    if inside:  # named by the layer's child holding it, unless that is its attention module
        children = []
        for p in inside:
            child = p[: p.index(".", len(base) + 1)] if "." in p[len(base) + 1:] else p
            children.append(p if calls_attention_interface(layer.get_submodule(child[len(base) + 1:])) else child)
        return _outermost(children)
    refs = [j for j, k in enumerate(kinds) if k in _SOFTMAX_KINDS and j < len(layers)]
    mine = dict(layer.named_modules())
    if refs:
        theirs = {rel: type(m) for rel, m in layers[refs[0]].named_modules()}
        differ = [rel for rel, m in mine.items() if rel and theirs.get(rel) is not type(m)]
        if differ:
            return [f"{base}.{rel}" for rel in _outermost(differ)]
    attention = [rel for rel, m in mine.items() if rel and calls_attention_interface(m)]
    for rel in attention:
        own = [
            f"{rel}.{child}" for child, m in mine[rel].named_children()
            if not isinstance(m, nn.Linear) and any(isinstance(c, nn.Linear) for c in m.modules())
        ]
        if own:
            return [f"{base}.{p}" for p in own]
    return [f"{base}.{rel}" for rel in attention[:1]] or [base]


def token_mixers(model: nn.Module) -> list[TokenMixer]:
    """Every module of ``model`` that mixes tokens along the sequence outside transformers'
    attention interface and that seqpar does not handle, outermost first, found from structure
    alone (Note [transformers model checks]): by type, by the config's declared layer kinds, by
    what its forward calls. Nested models built from another config (vision or audio towers) do
    not run on the sharded sequence and are not looked at."""
    from transformers import PreTrainedModel

    root = getattr(model, "config", None)
    text = root.get_text_config() if hasattr(root, "get_text_config") else root
    skip: list[str] = []  # towers and handled modules: not looked into
    found: dict[str, str] = {}  # path -> why
    classes: dict[str, str] = {}
    configs: list[tuple[str, nn.Module]] = []  # (path, outermost model) per config object
    # The block holding the input embedding table runs before any hidden state exists: what it
    # combines along the sequence are ids and masks (RoBERTa counts positions with a cumsum).
    try:
        table = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model without one: nothing is exempt
        table = None
    inputs = {id(m) for m in model.modules() if table is not None and any(c is table for c in m.children())}
    for path, module in model.named_modules():
        if any(path.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, PreTrainedModel):
            if module is not model and module.config is not root and module.config is not text:
                skip.append(path)
                continue
            if all(m.config is not module.config for _, m in configs):
                configs.append((path, module))
            continue
        if type(module) in _HANDLED:
            skip.append(path)
            continue
        classes[path] = type(module).__name__
        if type(module).__module__.split(".")[0] == "torch":
            why = _by_type(module)
        else:  # an embedding looks one row up per token, whatever it computes its positions from
            why = None if isinstance(module, nn.Embedding) or id(module) in inputs else _by_calls(module)
        if why:
            found[path] = why
    declared: dict[str, str] = {}
    for path, owner in configs:
        field_kinds = _config_kinds(owner.config)
        if field_kinds is None:
            continue
        field, kinds = field_kinds
        located = _layer_list(owner, len(kinds), tuple(s[len(path) + 1:] if path else s for s in skip))
        if located is None:
            continue
        rel, layers = located
        prefix = ".".join(p for p in (path, rel) if p)
        for i, kind in enumerate(kinds[: len(layers)]):
            if not _mixes(kind) or type(layers[i]) in _HANDLED:
                continue
            for p in _declared_mixer_modules(layers[i], f"{prefix}.{i}", kinds, layers, i, found):
                if not any(p == s or p.startswith(s + ".") for s in skip):
                    declared.setdefault(p, f"config.{field}[{i}] = {kind!r}")
    named = list(declared) + [p for p in found if p not in declared]
    mixers = []
    for p in _outermost(named):
        whys = [w for w in (declared.get(p), found.get(p)) if w]
        mixers.append(TokenMixer(p, classes.get(p, type(model.get_submodule(p)).__name__), "; ".join(whys)))
    order = {p: n for n, p in enumerate(dict(model.named_modules()))}
    return sorted(mixers, key=lambda m: order.get(m.path, -1))


_STRUCTURE = [0]  # bumped by every module registration in the process: cached checks start over
_MIXERS = "_seqpar_token_mixers"  # attribute of a checked model: (_STRUCTURE[0] when found, mixers)


def _model_token_mixers(model: nn.Module) -> list[TokenMixer]:
    """:func:`token_mixers`, cached on the model until any module is registered anywhere."""
    cached = getattr(model, _MIXERS, None)
    if cached is not None and cached[0] == _STRUCTURE[0]:
        return cached[1]
    mixers = token_mixers(model)
    object.__setattr__(model, _MIXERS, (_STRUCTURE[0], mixers))
    return mixers


def _refuse_token_mixers(model: nn.Module, state: ParallelState, mixing: str = "head_parallel") -> None:
    """Refuse, on every rank alike (decided from structure, without communication), a model with
    token mixers seqpar does not handle, before it runs on ``cp_size > 1`` shards.

    Raises:
        NotImplementedError: naming the mixers' module paths and how each was found.
    """
    found = _model_token_mixers(model)  # cached: an ordinary model's call stops here
    if not found:
        return
    # Note [transformers token-mixer adapters]: adapted modules are exact
    transformers_mixers.install(model, state, mixing)
    modules = dict(model.named_modules())
    mixers = [
        m for m in found
        if not any(transformers_mixers.handled(modules[p], state) for p in ancestors(m.path) if p in modules)
    ]
    if not mixers:
        return
    shown = "; ".join(map(str, mixers[:4])) + (f"; and {len(mixers) - 4} more" if len(mixers) > 4 else "")
    raise NotImplementedError(
        f"seqpar: {type(model).__name__} has modules that mix tokens outside attention, which seqpar "
        f"does not run on sequence shards: {shown}. Over {state.cp_size} CP ranks each would see only "
        "its rank's tokens (silently wrong outputs), so the model is refused on every rank; run it with "
        "cp_size 1, or see docs/models.md for the families seqpar runs"
    )


def _adapt_on_one_rank(model: nn.Module, state: ParallelState) -> None:
    """With one rank nothing is sharded and token mixers run as they are, except DeepSeek sparse
    attention layers, which hand seqpar's mask object to their indexer: their adapter runs them
    (Note [DeepSeek sparse attention on shards] in ``transformers_mixers.sparse``)."""
    if sparse_attention_layers(model):
        transformers_mixers.install(model, state)


@functools.lru_cache(maxsize=64)
def _placement_fingerprints(total: int, ring_size: int, ulysses_size: int) -> tuple[int, ...]:
    """The position fingerprint of every CP rank's shard of ``total`` tokens."""
    placement = Placement.dense(total, ring_size, ulysses_size)
    return tuple(_fingerprint(placement.global_index(c)) for c in range(ring_size * ulysses_size))


@dataclass(frozen=True)
class _Call:
    """What one rank's call looks like: ``row`` is what it tells the other CP ranks."""

    n: int  # tokens (input_ids or inputs_embeds), -1 if neither is given
    code: int  # first problem found on this rank, 0 for none
    details: tuple[int, int]  # numbers for the message of that problem
    positions: int  # fingerprint of the positions, 0 without them
    device: torch.device

    @property
    def row(self) -> list[int]:
        return [self.n, self.code, *self.details, self.positions]


def _fingerprint(positions: Tensor) -> int:
    """An int that differs, with overwhelming probability, between different position rows: the
    sum of a non-linear 64-bit mix of every (index, position) pair, on the positions' device.

    Not a weighted sum: a moment linear in the positions lets other rows match ([1, 0, 1, 4] and
    [0, 1, 2, 3] have the same ``sum((p + 1) * (i + 1))``); int64 arithmetic wraps, which the mix wants.
    """
    p = positions.reshape(-1).long()
    h = p * 0x5851F42D4C957F2D + torch.arange(p.numel(), device=p.device) * 0x14057B7EF767814F + 1
    h = h ^ (h >> 31)
    h = h * 0x2545F4914F6CDD1D
    h = h ^ (h >> 29)
    return int(h.sum())


fingerprint = _fingerprint


def _decoding(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The ``SeqparCache`` of a call that passes new tokens on every rank (not a sharded prefill), or None."""
    from .transformers_cache import SeqparCache  # imports transformers itself: loaded on first use

    # under either name: transformers >= 5.24 takes `cache` and still accepts `past_key_values`
    cache = next((c for c in (_argument(model, args, kwargs, n) for n in CACHE_ARGUMENTS) if c is not None), None)
    if isinstance(cache, SeqparCache) and not (cache.layers and cache.layers[0].sharded):
        return cache
    return None


def _check_decoding(model: nn.Module, args: tuple, kwargs: dict[str, Any], state: ParallelState, cache: Any) -> None:
    """A call with new tokens on every CP rank (Note [transformers cache on shards]): the same tokens
    and positions on every rank, no padding or 4-D mask, every rank raising alike."""
    ids = _argument(model, args, kwargs, "input_ids")
    embeds = _argument(model, args, kwargs, "inputs_embeds")
    tokens = ids if isinstance(ids, Tensor) else embeds if isinstance(embeds, Tensor) else None
    if tokens is None:
        return
    positions = _argument(model, args, kwargs, "position_ids")
    mask = _argument(model, args, kwargs, "attention_mask")
    code = 0
    if isinstance(mask, Tensor) and mask.dim() == 4:
        code = MASK_4D
    elif isinstance(mask, Tensor) and mask.dim() == 2 and not bool(mask.all()):
        code = PADDING
    row = [
        int(tokens.shape[0]), int(tokens.shape[1]), code, _fingerprint(tokens.detach().float().mul(1024).long()
                                                                     if tokens.is_floating_point() else tokens),
        _fingerprint(positions) if isinstance(positions, Tensor) else 0,
    ]
    rows = exchange_ints(row, state.cp_group, tokens.device) if state.cp_size > 1 else [row]
    where = f"seqpar ({type(model).__name__}, decoding with a SeqparCache of {cache.get_seq_length()} tokens)"
    if any(r[2] for r in rows):
        r = next(i for i, r in enumerate(rows) if r[2])
        what = "a 4-D attention_mask" if rows[r][2] == MASK_4D else "a padding attention_mask (zeros)"
        raise ValueError(f"{where}: cp rank {r} passed {what}; pass none, or all ones")
    if any(r != rows[0] for r in rows):
        raise ValueError(
            f"{where}: the CP ranks passed different new tokens or positions ((batch, tokens, -, ids, positions) "
            f"fingerprints {rows}); after the sharded prefill every rank passes the same new tokens"
        )


def _inspect(model: nn.Module, name: str, args: tuple, kwargs: dict[str, Any], state: ParallelState) -> _Call:
    """This rank's :class:`_Call` (no communication)."""
    ids = _argument(model, args, kwargs, "input_ids")
    embeds = _argument(model, args, kwargs, "inputs_embeds")
    tokens = ids if isinstance(ids, Tensor) else embeds if isinstance(embeds, Tensor) else None
    n = -1 if tokens is None else int(tokens.shape[-1] if tokens is ids else tokens.shape[1])
    device = tokens.device if tokens is not None else next(model.parameters(), torch.zeros(())).device
    current = getattr(model.config, "_attn_implementation", None)

    def call(code: int, details: tuple[int, int] = (0, 0), positions: int = 0) -> _Call:
        return _Call(n, code, details, positions, device)

    if current != name:
        return call(SWITCHED, (_KNOWN.index(current) + 1 if current in _KNOWN else 0, 0))
    if _computes_attention_itself(type(model)):
        return call(UNSUPPORTED)
    if state.cp_size == 1:
        return call(0)
    if _argument(model, args, kwargs, "labels") is not None:
        return call(LABELS)
    if n == 0:
        return call(EMPTY)
    mask = _argument(model, args, kwargs, "attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 4:
        return call(MASK_4D, tuple(mask.shape[-2:]))
    if isinstance(mask, Tensor) and mask.dim() == 2 and n >= 0 and mask.shape[-1] != n:
        return call(FULL_LENGTH_MASK, (int(mask.shape[-1]), 0))
    if isinstance(mask, Tensor) and mask.dim() == 2 and not bool(mask.all()):
        return call(PADDING)
    if "position_ids" not in _parameters(type(model))[1]:
        return call(NO_POSITION_PARAMETER)
    positions = _argument(model, args, kwargs, "position_ids")
    if not isinstance(positions, Tensor):
        return call(NO_POSITIONS)
    rows = positions.detach().reshape(-1, positions.shape[-1])
    if (n >= 0 and rows.shape[-1] != n) or not bool((rows == rows[:1]).all()):
        return call(POSITIONS, (int(rows.shape[-1]), -1))
    first = (int(rows[0, 0]), int(rows[0, -1])) if rows.numel() else (-1, -1)
    return call(0, first, _fingerprint(rows[0]))


def check_call(model: nn.Module, args: tuple, kwargs: dict[str, Any], *, name: str) -> None:
    """Forward pre-hook of a seqpar model (Note [transformers model checks]): raise the same error
    on every CP rank if any rank's call cannot run exactly on shards.

    Raises:
        ValueError: a switched config, missing or wrong ``position_ids``, a rank without tokens,
            token counts that are not seqpar's placement, a full-length, padding or 4-D mask.
        NotImplementedError: modules that mix tokens outside attention (:func:`token_mixers`),
            ``labels=``, a model that does not call the attention interface, or whose forward
            takes no ``position_ids``.
    """
    bound = binding(name)
    if bound is None:  # the name was registered again, by someone else
        return
    state = bound.state
    if state.cp_size > 1 and getattr(model.config, "_attn_implementation", None) == name:
        _refuse_token_mixers(model, state, bound.mixing)  # the same on every rank: no exchange needed
    elif getattr(model.config, "_attn_implementation", None) == name and _model_token_mixers(model):
        _adapt_on_one_rank(model, state)
    cache = _decoding(model, args, kwargs) if state.cp_size > 1 else None
    if cache is not None and getattr(model.config, "_attn_implementation", None) == name:
        if not _computes_attention_itself(type(model)):
            _check_decoding(model, args, kwargs, state, cache)
            return
    mine = _inspect(model, name, args, kwargs, state)
    packed = packed_call(lambda arg: _argument(model, args, kwargs, arg), state)
    if state.cp_size == 1:
        if mine.code:
            raise _error(model, name, state, [mine.row], 0)
        packed.agree([packed.row], [mine.n], model, state, _model_token_mixers(model), bound.mixing)
        return
    both = exchange_ints(mine.row + packed.row, state.cp_group, mine.device)
    rows = [row[:len(mine.row)] for row in both]
    culprit = next((r for r, row in enumerate(rows) if row[1]), None)
    if culprit is not None:
        raise _error(model, name, state, rows, culprit)
    packed_rows = [row[len(mine.row):] for row in both]
    if not packed.agree(packed_rows, [row[0] for row in rows], model, state, _model_token_mixers(model), bound.mixing):
        _check_placement(model, state, rows)


def _check_placement(model: nn.Module, state: ParallelState, rows: list[list[int]]) -> None:
    """Token counts and positions that are seqpar's placement of their sum (every rank alike)."""
    lengths = [row[0] for row in rows]
    if min(lengths) < 0:
        return
    total = sum(lengths)
    placement = Placement.dense(total, state.ring_size, state.ulysses_size)
    where = f"seqpar ({type(model).__name__}, ring {state.ring_size} x ulysses {state.ulysses_size})"
    if list(placement.shard_lengths) != lengths:
        raise ValueError(
            f"{where}: the CP ranks hold {lengths} tokens, not seqpar's placement of their {total} tokens "
            f"({list(placement.shard_lengths)}); shard the inputs with input_ids=seqpar.shard(input_ids, state)"
        )
    for r, (row, want) in enumerate(zip(rows, _placement_fingerprints(total, state.ring_size, state.ulysses_size))):
        if row[4] != want:
            raise ValueError(
                f"{where}: the position_ids of cp rank {r} ({row[2]}..{row[3]}) are not its global "
                f"positions seqpar.shard_positions({total}, state) for the {total} tokens the CP ranks "
                f"hold ({lengths}); pass position_ids=seqpar.shard_positions({total}, state)[None]"
            )


def _shortest(state: ParallelState, total: int) -> int:
    """The shortest sequence of at least ``total`` tokens that gives every CP rank a token."""
    length = max(total, state.cp_size)
    while 0 in Placement.dense(length, state.ring_size, state.ulysses_size).shard_lengths:
        length += 1
    return length


def _error(model: nn.Module, name: str, state: ParallelState, rows: list[list[int]], r: int) -> Exception:
    """The error of cp rank ``r``'s problem, worded from ``rows`` alone (the same on every rank)."""
    cls = type(model).__name__
    n, code, a, b, _ = rows[r]
    lengths = [row[0] for row in rows]
    at = f" (cp rank {r} of {state.cp_size})" if state.cp_size > 1 else ""
    messages: dict[int, Callable[[], Exception]] = {
        SWITCHED: lambda: ValueError(
            f"seqpar: this {cls} was built with attn_implementation={name!r}, but its config now names "
            f"{repr(_KNOWN[a - 1]) if a else 'another implementation'}{at}: a config object shared with "
            "another model (e.g. a reference built with from_config(config, attn_implementation='sdpa')) "
            "switched it, and its attention would run per rank on the shards, without seqpar. Give every "
            "model its own config (copy.deepcopy(config)), or build this model again"
        ),
        UNSUPPORTED: lambda: NotImplementedError(
            f"seqpar: {cls} computes attention itself instead of calling transformers' attention "
            f"interface (its modeling code never calls ALL_ATTENTION_FUNCTIONS), so "
            f"attn_implementation={name!r} never reaches its attention layers and seqpar cannot run it "
            "on sequence shards; the families seqpar runs are in docs/models.md"
        ),
        LABELS: lambda: NotImplementedError(
            f"seqpar: {cls} was called with labels= on sequence shards{at}: transformers' loss would "
            "be the mean over this rank's tokens with the next-token shift applied inside the shard, "
            "which loses the targets at the shard edges and weights the ranks wrongly. Call the model "
            "without labels and compute the loss share from the logits: "
            "seqpar.training.sharded_cross_entropy(logits, seqpar.shard(seqpar.training.shift_labels("
            "input_ids), state), state)"
        ),
        NO_POSITION_PARAMETER: lambda: NotImplementedError(
            f"seqpar: {cls}.forward takes no position_ids, so on sequence shards it would number every "
            "rank's tokens from 0 instead of their global positions; seqpar cannot run it over "
            f"{state.cp_size} CP ranks"
        ),
        NO_POSITIONS: lambda: ValueError(
            f"seqpar: {cls} was called without position_ids on sequence shards{at}; transformers would "
            "number every rank's tokens from 0 instead of their global positions (silently wrong "
            "outputs on every rank but the first). Pass position_ids=seqpar.shard_positions(S, "
            "state)[None] with input_ids=seqpar.shard(input_ids, state)"
        ),
        POSITIONS: lambda: ValueError(
            f"seqpar: the position_ids of cp rank {r} have {a} positions per row, for {n} tokens, or "
            "rows that differ; pass position_ids=seqpar.shard_positions(S, state)[None] (one row, "
            "broadcast over the batch) with input_ids=seqpar.shard(input_ids, state)"
        ),
        EMPTY: lambda: ValueError(
            f"seqpar: the CP ranks hold {lengths} tokens (cp_rank order): cp rank {r} holds none, and "
            f"transformers cannot run {cls} on no token (its mask code reads the last position) while "
            f"the other ranks would wait for it. A sequence of {sum(lengths)} tokens is too short for "
            f"ring {state.ring_size} x ulysses {state.ulysses_size}: use at least "
            f"{_shortest(state, sum(lengths))} tokens, or fewer CP ranks"
        ),
        FULL_LENGTH_MASK: lambda: ValueError(f"cp rank {r}: {full_length_mask_message(a, n)}"),
        PADDING: lambda: ValueError(
            f"seqpar attention: padding masks are not supported on sequence shards (the attention_mask "
            f"of cp rank {r} has zeros); drop padding, or pack the sequences and use seqpar.varlen_attention"
        ),
        MASK_4D: lambda: ValueError(f"cp rank {r}: {four_d_mask_message(f'(..., {a}, {b})', n, state.cp_size)}"),
    }
    return messages[code]()


class suspended:
    """Context manager: no model check for ``model`` (and the seqpar models inside it) while inside.

    For a run of the same weights on the full sequence with a plain implementation, such as
    :func:`seqpar.verify`'s reference run: with the config switched to ``"sdpa"``, :func:`check_call`
    would refuse it. The checks come back on exit (also after an exception), first among the
    model's pre-hooks as they were installed.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._held: list[tuple[nn.Module, str]] = []

    def __enter__(self) -> nn.Module:
        for module in self.model.modules():
            guard = getattr(module, _GUARD, None)
            if guard is not None:
                guard[1].remove()  # the attribute stays, so the registration hook does not guard it again
                self._held.append((module, guard[0]))
        return self.model

    def __exit__(self, *exc: object) -> None:
        for module, name in self._held:
            hook = functools.partial(check_call, name=name)
            handle = module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
            object.__setattr__(module, _GUARD, (name, handle))
        self._held.clear()
