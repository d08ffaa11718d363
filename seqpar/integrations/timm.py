"""Context parallelism for timm's ViT family: ``parallelize(model, state)``.

::

    from seqpar.integrations.timm import parallelize

    model = parallelize(timm.create_model("vit_base_patch16_224"), state)
    logits = model(images)          # full images in on every CP rank, full logits out

Note [timm ViTs on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~
timm's ``VisionTransformer`` (ViT, DeiT, DeiT distilled, DINOv2 with register tokens, ...) and
``Eva`` (EVA-02, with rotary embeddings) embed the patches, prepend ``num_prefix_tokens`` class /
distillation / register tokens, add position embeddings, then run ``model.blocks`` and pool. Only
attention mixes tokens, and it calls ``F.scaled_dot_product_attention`` (``fused_attn``).
:func:`parallelize` installs forward hooks on the blocks:

- before ``blocks[0]``: the ``P`` prefix tokens stay whole (replicated on every CP rank), the patch
  tokens are split contiguously (``split_sizes`` over the CP group, any count);
- around every block: ``seqpar.parallel_sdpa(state, replicated_prefix=P)``, so each attention call
  is exact joint attention of the replicated prefix and the sharded patches (Note [Replicated
  tokens]); EVA's ``rope`` argument (``[..., N, D]``, one row per patch token, applied to patch
  tokens only) is split like the patches;
- after ``blocks[-1]``: the patch tokens are gathered (``seqpar.comm.all_gather``) behind the
  prefix, so the final norm, pooling and head run on the full sequence.

Gradients are partial (Note [diffusers context parallelism] explains the same rule): the split is a
``narrow``, the gather's backward reduce-scatters, the prefix rows' gradients are per-rank shares.
With every rank backpropagating the full-output loss divided by ``cp_size``, parameter gradients
summed over ``state.cp_group`` equal the single-device ones.

Refused: attention that is not SDPA (``fused_attn=False``), masks and causal calls (raised by
``parallel_sdpa``), and, in training mode, dropout, drop-path and patch dropout with a non-zero
rate (random per rank, they would make the replicated tokens differ between ranks). Intermediate
block outputs (``forward_intermediates``, feature hooks on blocks) are this rank's shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..sdpa import parallel_sdpa
from ..state import ParallelState, require_state
from .hooks import ContextHooks, gather_parts, refuse_empty_parts, split_part

__all__ = ["parallelize"]

_WHERE = "seqpar.integrations.timm"
_APPLIED = "_seqpar_context_parallel"
# timm classes whose token flow Note [timm ViTs on shards] describes (subclasses included).
_SUPPORTED = {("timm.models.vision_transformer", "VisionTransformer"), ("timm.models.eva", "Eva")}
_STOCHASTIC = ("Dropout", "DropPath", "PatchDropout", "PatchDropoutWithIndices")


def _is_supported(model: nn.Module) -> bool:
    return any((c.__module__, c.__name__) in _SUPPORTED for c in type(model).__mro__)


def _rate(module: nn.Module) -> float:
    for name in ("p", "drop_prob", "prob"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


def _split_tokens(x: Tensor, state: ParallelState, prefix: int) -> Tensor:
    return torch.cat([x[:, :prefix], split_part(x[:, prefix:], state, 1)], 1)


def _first_block_hook(state: ParallelState, prefix: int, stochastic: list[nn.Module]) -> Callable:
    def hook(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        active = [type(m).__name__ for m in stochastic if m.training and _rate(m) > 0]
        if active:
            raise NotImplementedError(
                f"{_WHERE}: {sorted(set(active))} with a non-zero rate in training mode draw different "
                "random numbers on each CP rank, so the replicated prefix tokens would differ between "
                "ranks; set drop_rate, attn_drop_rate, proj_drop_rate, drop_path_rate and "
                "patch_drop_rate to 0 (or call model.eval())"
            )
        x = args[0] if args else kwargs["x"]
        if x.dim() != 3 or x.shape[1] < prefix:
            raise ValueError(
                f"{_WHERE}: the first block got tokens of shape {tuple(x.shape)}; expected [B, N, C] with "
                f"the {prefix} prefix tokens first"
            )
        if prefix == 0:  # a rank with neither prefix nor patch tokens cannot run timm's attention
            refuse_empty_parts(x.shape[1], state, _WHERE, "patch tokens (the model has no prefix token)")
        rope = kwargs.get("rope")
        if isinstance(rope, Tensor) and rope.shape[-2] != x.shape[1] - prefix:
            raise ValueError(
                f"{_WHERE}: the rotary embedding has {rope.shape[-2]} rows along dim -2 but there are "
                f"{x.shape[1] - prefix} patch tokens; only a rope with one row per patch token can be split"
            )
        x = _split_tokens(x, state, prefix)
        return ((x, *args[1:]), kwargs) if args else ((), {**kwargs, "x": x})

    return hook


def _rope_hook(state: ParallelState) -> Callable:
    def hook(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        rope = kwargs.get("rope")
        if rope is None:
            return None
        if not isinstance(rope, Tensor) or rope.dim() < 2:
            raise NotImplementedError(
                f"{_WHERE}: a rope argument of type {type(rope).__name__} cannot be split; only tensors "
                "[..., N, D] with one row per patch token are supported"
            )
        return args, {**kwargs, "rope": split_part(rope, state, rope.dim() - 2)}

    return hook


def _last_block_hook(state: ParallelState, prefix: int) -> Callable:
    def hook(block: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return torch.cat([output[:, :prefix], gather_parts(output[:, prefix:], state, 1)], 1)

    return hook


def parallelize(model: nn.Module, state: ParallelState, *, backend: str = "auto") -> nn.Module:
    """Apply context parallelism over ``state`` to a timm ViT / DeiT / EVA model, in place.

    Every CP rank calls the model with the same full images and gets the full output (logits or
    features), equal to the single-device model's (Note [timm ViTs on shards]).

    Args:
        model: a timm ``VisionTransformer`` (ViT, DeiT, distilled DeiT, register-token models, ...)
            or ``Eva`` (EVA, EVA-02) -- or a subclass -- using SDPA attention.
        state: the parallel state; its CP group splits the patch tokens.
        backend: seqpar attention backend for the attention calls.

    Returns:
        ``model`` with forward hooks on its blocks.

    Raises:
        ValueError: another model class, no blocks, an attention module with ``fused_attn=False``,
            or a second call on the same model. Calls raise ``NotImplementedError`` for dropout,
            drop-path or patch dropout active in training mode, and ``parallel_sdpa``'s errors for
            masks or causal attention.
    """
    require_state(state, _WHERE)
    if not isinstance(model, nn.Module) or not _is_supported(model):
        raise ValueError(
            f"{_WHERE}: expected a timm VisionTransformer or Eva model (or a subclass), got "
            f"{type(model).__module__}.{type(model).__name__}"
        )
    if getattr(model, _APPLIED, None) is not None:
        raise ValueError(f"{_WHERE}: parallelize() was already applied to this {type(model).__name__}")
    blocks = list(getattr(model, "blocks", []))
    if not blocks:
        raise ValueError(f"{_WHERE}: {type(model).__name__} has no blocks")
    unfused = sorted({type(m).__name__ for m in model.modules() if getattr(m, "fused_attn", True) is False})
    if unfused:
        raise ValueError(
            f"{_WHERE}: attention modules {unfused} have fused_attn=False (explicit matmul + softmax, "
            "which seqpar cannot reach); create the model with SDPA attention (unset TIMM_FUSED_ATTN)"
        )
    prefix = int(model.num_prefix_tokens)
    stochastic = [m for m in model.modules() if type(m).__name__ in _STOCHASTIC]

    handles = [blocks[0].register_forward_pre_hook(_first_block_hook(state, prefix, stochastic), with_kwargs=True)]
    context = ContextHooks(lambda: parallel_sdpa(state, backend=backend, replicated_prefix=prefix))
    for block in blocks:
        handles.append(block.register_forward_pre_hook(_rope_hook(state), with_kwargs=True))
        handles += context.register(block)
    handles.append(blocks[-1].register_forward_hook(_last_block_hook(state, prefix)))
    setattr(model, _APPLIED, handles)
    return model
