"""Mamba mixers of transformers on sequence shards: Mamba2 (SSD) and Mamba1 (selective scan).

Note [Mamba adapters]
~~~~~~~~~~~~~~~~~~~~~
Read against transformers 5.23, and 5.24 (the same forwards with the cache parameter renamed
``cache``: Note [Renamed cache parameter]). Two mixer codes, each shared by several families:

- **Mamba2** (``Mamba2Mixer``, ``BambaMixer``, ``NemotronHMamba2Mixer``,
  ``GraniteMoeHybridMambaLayer``, ``Zamba2MambaMixer``, and ``FalconH1Mixer`` with its
  multipliers and optional norm): ``in_proj`` gives per token the gate, ``x`` (``H`` heads of
  ``P``), ``B`` and ``C`` (``G`` groups of ``N``, group ``g`` read by heads ``g*H/G ..``) and
  ``dt`` (``H``); a depthwise causal conv1d runs over the ``x|B|C`` channels, then the chunked
  SSD scan, then a gated norm and ``out_proj``. Every conv channel belongs to one head or one
  group, so the conv and the scan are ONE :func:`seqpar.mixing.head_parallel` call: ``x`` and
  ``dt`` with ``H`` heads, ``B`` and ``C`` as grouped heads, the rank's conv channels and per-head
  parameters narrowed inside. The gate, norm and projections stay on the shard.
- **Mamba1** (``MambaMixer``, ``JambaMambaMixer``): the conv runs over ``x``'s ``I`` channels,
  but ``x_proj`` then mixes all channels of a token into ``dt``, ``B`` and ``C``, so it takes two
  calls: the conv (every channel a head), ``x_proj``/``dt_proj`` (and Jamba's norms) on the
  shard, then the selective scan (every channel a head; ``B``, ``C`` one group read by all).
  The gate (``z``) is applied on the shard after the scan, as the reference scan does last.

Inside each call the module's own kernels run on whole sequences of the rank's heads, looked up
in its modeling module at call time (``causal_conv1d_fn``, ``mamba2_chunk_scan``,
``mamba_selective_scan``): the torch fallbacks, or ``causal-conv1d`` / ``mamba-ssm`` where
installed. The fused training kernels (``mamba2_split_conv1d_scan_combined``,
``mamba_inner_fn``) are never called: they would scan the shard alone.

The adapter replaces the instance's ``forward`` with one that reproduces the 5.23 forward with
the mixing routed as above, taking the arguments the class's forward takes (its cache under the
name of the installed release). The installer checks the class's ``forward`` (signature and the
names its code uses) against what was read; a transformers version whose forward differs is
refused, on every rank alike, rather than run with a stale copy.

Not supported on shards, refused with the same error on every rank (one exchange of ints when
the CP ranks check collectively, ``ParallelState.checks``): a cache (``cache_params`` /
``past_key_values``, ``cache`` from 5.24: decoding, or prefill into a cache, which would need the
states at the shard ends), packed-batch kwargs (``seq_idx``, ``cu_seq_lens_*``), and a 2-D padding mask that
is not this rank's ``[B, S_local]`` shard. A mask of the shard's shape is applied as the
reference does (token-wise, before the projection and after the conv; in Mamba2 layers it travels
with ``dt``, ones where a rank has none, since transformers hands a rank without padding None).

Two containers are adapted too, so that the model check does not name them: Zamba2's
``Zamba2MambaDecoderLayer`` (a "hybrid" layer holds it one level down; an RMSNorm, the adapted
mixer and a residual) and ``Mamba2Model``, whose pre-hook refuses a full-length mask (it would
cut it to the shard's last ``S_local`` tokens before the mixers see it). Each checks that it holds
only what was read.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...comm import exchange_ints
from ...mixing import HeadShard, head_parallel
from ...prepare import collective_checks
from ...state import ParallelState
from . import register_adapter
from .rebind import cache_parameter, call_cache, shown, takes

__all__: list[str] = []

READ_AGAINST = "5.23 and 5.24"

# The names (globals and attributes) the 5.23 forward of each mixer code uses: a forward that
# uses other names was changed and is refused (Note [Mamba adapters]).
_MAMBA2_NAMES = frozenset(
    "A_log D activation apply_mask_to_padding_states bias causal_conv1d_fn causal_conv1d_update chunk_size "
    "conv1d conv_dim conv_kernel_size dt_bias dtype exp expand float get_conv_state get_recurrent_state "
    "head_dim in_proj intermediate_size is_recording_past layer_idx mamba2_chunk_scan "
    "mamba2_selective_state_update mamba2_split_conv1d_scan_combined n_groups norm num_heads out_proj "
    "reshape shape split squeeze ssm_state_size time_step_limit to torch training transpose "
    "update_conv_state update_recurrent_state variance_epsilon view weight".split()
)
_FALCON_H1_NAMES = (_MAMBA2_NAMES - {"reshape"}) | frozenset(
    "float32 functional mamba_rms_norm mup_vector nn silu ssm_in_multiplier".split()
)
_MAMBA1_NAMES = frozenset(
    "A_log D activation apply_mask_to_padding_states bias causal_conv1d_fn causal_conv1d_update chunk "
    "conv1d conv_kernel_size dt_proj dtype exp float get_conv_state get_recurrent_state in_proj "
    "is_recording_past layer_idx mamba_inner_fn mamba_selective_scan mamba_selective_state_update "
    "out_proj shape split squeeze ssm_state_size time_step_rank to torch training transpose unsqueeze "
    "update_conv_state update_recurrent_state use_associative_scan use_bias use_conv_bias use_mambapy "
    "weight x_proj".split()
)
_JAMBA_NAMES = (_MAMBA1_NAMES - {"mamba_inner_fn", "training", "use_bias", "use_conv_bias"}) | frozenset(
    "b_layernorm c_layernorm config dt_layernorm hasattr".split()
)
_CACHE_PARAMETER = cache_parameter("cache_params")
_PARAMETERS = ("self", "hidden_states", _CACHE_PARAMETER, "attention_mask", "kwargs")
# kwargs of packed batches (transformers' flash-attention varlen kwargs, Mamba's seq_idx).
_PACKED_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

_CACHE, _PACKED, _MASK = 1, 2, 3  # refusal codes exchanged between the CP ranks


def _check_forward(module: nn.Module, names: frozenset[str], kernels: tuple[str, ...]) -> types.ModuleType:
    """The module's modeling module, after checking that its forward is the one read.

    Raises:
        NotImplementedError: the forward or the kernels differ from transformers 5.23's.
    """
    cls = type(module)
    forward = inspect.unwrap(cls.forward)
    where = f"seqpar: the Mamba adapter of {cls.__name__} (read against transformers {READ_AGAINST})"
    fix = "run the model with cp_size 1, or use a transformers version the adapter was checked against"
    params = tuple(inspect.signature(forward).parameters)
    if len(params) != len(_PARAMETERS) or not takes(params, _PARAMETERS):
        raise NotImplementedError(f"{where}: its forward takes {list(params)}, not {shown(_PARAMETERS)}; {fix}")
    code = getattr(forward, "__code__", None)
    used = frozenset(code.co_names) if code is not None else frozenset()
    if used != names:
        raise NotImplementedError(
            f"{where}: its forward differs from the one read (names added: {sorted(used - names)}, gone: "
            f"{sorted(names - used)}), so it may compute what the adapter does not; {fix}"
        )
    modeling = sys.modules.get(cls.__module__)
    missing = [k for k in kernels if not callable(getattr(modeling, k, None))]
    if missing:
        raise NotImplementedError(f"{where}: {cls.__module__} has no {missing}; {fix}")
    return modeling


def _accelerate_hooks(names: list[str]) -> Callable[[Callable], Callable]:
    """transformers' ``force_accelerate_hooks`` (offloaded conv weights used directly), as the
    replaced forward had it; the identity where it is missing."""
    try:
        from transformers.integrations.accelerate import force_accelerate_hooks
    except ImportError:  # pragma: no cover - present in 5.23
        return lambda f: f
    return force_accelerate_hooks(names)


def _mask_row(mask: Tensor | None, batch: int, local: int) -> list[int]:
    if mask is not None and (mask.ndim != 2 or tuple(mask.shape) != (batch, local)):
        return [_MASK, mask.shape[-1] if mask.ndim else 0, local]
    return [0, 0, 0]


def _refuse_together(
    module: nn.Module, state: ParallelState, hidden: Tensor, cache: Any, mask: Tensor | None,
    kwargs: dict[str, Any],
) -> None:
    """Raise the same error on every CP rank if any rank's call cannot run exactly on shards."""
    row = _mask_row(mask, *hidden.shape[:2])
    if cache is not None:
        row = [_CACHE, 0, 0]
    elif any(kwargs.get(k) is not None for k in _PACKED_KWARGS):
        row = [_PACKED, 0, 0]
    _raise_together(module, state, hidden.device, row)


def _arguments(
    module: nn.Module, state: ParallelState, signature: inspect.Signature, args: tuple, kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """``(hidden_states, attention_mask)`` of a call bound as the class's forward takes it (its cache
    under either name, Note [Renamed cache parameter]), after refusing together what does not run."""
    call = signature.bind(module, *args, **kwargs).arguments
    hidden, mask = call["hidden_states"], call.get("attention_mask")
    _refuse_together(module, state, hidden, call_cache(call, _CACHE_PARAMETER)[0], mask, call.get("kwargs", {}))
    return hidden, mask


def _raise_together(module: nn.Module, state: ParallelState, device: torch.device, row: list[int]) -> None:
    """Every CP rank raises the error of the first rank whose ``row`` names a problem (one exchange
    where the ranks check collectively, ``collective_checks``; else this rank's own)."""
    rows = [row]
    if collective_checks(state, device, True):
        rows = exchange_ints(row, state.cp_group, device)
    culprit = next((c for c, r in enumerate(rows) if r[0]), None)
    if culprit is None:
        return
    code, got, local = rows[culprit]
    rank = state.cp_rank if len(rows) == 1 else culprit
    where = f"seqpar: {type(module).__name__} on sequence shards, cp rank {rank},"
    if code == _CACHE:
        raise NotImplementedError(
            f"{where} was called with a cache (cache / cache_params / past_key_values, use_cache=True): decoding or "
            "prefilling a cache needs the scan and conv states at the ends of the shards, which seqpar does "
            "not produce; call the model with use_cache=False on shards (generate on one rank)"
        )
    if code == _PACKED:
        raise NotImplementedError(
            f"{where} was called with packed-batch kwargs ({', '.join(_PACKED_KWARGS)}); Mamba mixers run "
            "dense batches on shards: pass one sequence per row"
        )
    raise ValueError(
        f"{where} got a 2-D attention_mask of {got} tokens for a shard of {local}; pass this rank's shard "
        "of the mask ([B, S_local], e.g. seqpar.shard(mask, state)), or none"
    )


# --- Mamba2 (SSD) -------------------------------------------------------------------------------


def _mamba2_mixing(
    self: nn.Module, modeling: types.ModuleType, state: ParallelState, projected: Tensor, mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(scan output [B, S_local, I], gate)`` from the shard's projections: conv and scan of whole
    sequences of this rank's heads (one head_parallel call)."""
    B_, S_local = projected.shape[:2]
    H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    I = self.intermediate_size  # noqa: E741 - the modeling code's name
    gate, xbc, dt = projected.split([I, self.conv_dim, H], dim=-1)
    x, b, c = xbc.split([I, G * N, G * N], dim=-1)
    A = -torch.exp(self.A_log.float())
    weight = self.conv1d.weight.squeeze(1)  # [conv_dim, K]
    bias = self.conv1d.bias
    K = weight.shape[-1]
    per_group = H // G

    def narrow3(t: Tensor | None, shard: HeadShard, K_: int | None) -> Tensor | None:
        """This rank's conv channels of ``t`` ([conv_dim, K] or [conv_dim]), in x|B|C order."""
        if t is None:
            return None
        tail = (K_,) if K_ else ()
        tx, tb, tc = t.split([I, G * N, G * N])
        parts = [
            shard.narrow(tx.view(H, P, *tail)).flatten(0, 1),
            shard.narrow(tb.view(G, N, *tail), num_heads=G).flatten(0, 1),
            shard.narrow(tc.view(G, N, *tail), num_heads=G).flatten(0, 1),
        ]
        return torch.cat(parts)

    def mix(shard: HeadShard, xs: Tensor, bs: Tensor, cs: Tensor, dts: Tensor, keep: Tensor) -> Tensor:
        # xs [B, S, h, P], bs/cs [B, S, g, N], dts [B, S, h], keep [B, S, 1]: whole sequences, in order.
        h, g = xs.shape[2], bs.shape[2]
        conv_in = torch.cat([xs.flatten(2), bs.flatten(2), cs.flatten(2)], dim=-1)
        conv_out = modeling.causal_conv1d_fn(
            conv_in.transpose(1, 2), narrow3(weight, shard, K), narrow3(bias, shard, None), activation=self.activation,
        ).transpose(1, 2)
        # The padding mask, applied after the conv as the reference does (ones: a no-op, exactly).
        conv_out = modeling.apply_mask_to_padding_states(conv_out, keep[:, :, 0])
        xs, bs, cs = conv_out.split([h * P, g * N, g * N], dim=-1)
        bs, cs = bs.unflatten(2, (g, N)), cs.unflatten(2, (g, N))
        if shard.start % per_group or shard.count % per_group:
            # This rank's heads cut a group: one B/C per head, so the kernel's grouping holds.
            bs, cs = shard.expand(bs, G, 2), shard.expand(cs, G, 2)
        return modeling.mamba2_chunk_scan(
            xs.unflatten(2, (h, P)), dts, shard.narrow(A), bs, cs, chunk_size=self.chunk_size,
            D=shard.narrow(self.D), z=None, return_final_states=False, dt_bias=shard.narrow(self.dt_bias),
            dt_softplus=True, initial_states=None, dt_limit=self.time_step_limit,
        )

    # The mask travels always, as one grouped head of dt's dtype (in dt's all-to-all): transformers
    # gives a rank whose shard has no padding None (create_recurrent_attention_mask), another one
    # a tensor, and every rank must pass the same tensors.
    keep = dt.new_ones(B_, S_local, 1) if mask is None else mask[:, :, None].to(dt.dtype)
    tensors = [x.view(B_, S_local, H, P), b.view(B_, S_local, G, N), c.view(B_, S_local, G, N), dt, keep]
    y = head_parallel(mix, tensors, state, heads=H)
    return y.reshape(B_, S_local, I), gate


def _install_mamba2(module: nn.Module, state: ParallelState, names: frozenset[str], falcon: bool) -> None:
    modeling = _check_forward(module, names, ("causal_conv1d_fn", "mamba2_chunk_scan", "apply_mask_to_padding_states"))
    if module.num_heads % module.n_groups:
        raise NotImplementedError(
            f"seqpar: {type(module).__name__} has {module.num_heads} heads in {module.n_groups} groups; "
            "the groups must divide the heads"
        )

    signature = inspect.signature(type(module).forward)

    @_accelerate_hooks(["conv1d"])
    def forward(self, *args, **kwargs):
        hidden_states, attention_mask = _arguments(self, state, signature, args, kwargs)
        dtype = hidden_states.dtype
        hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
        if falcon:
            hidden_states = hidden_states * self.ssm_in_multiplier
        projected = self.in_proj(hidden_states)
        if falcon:
            projected = projected * self.mup_vector
        y, gate = _mamba2_mixing(self, modeling, state, projected, attention_mask)
        if not falcon or self.mamba_rms_norm:
            y = self.norm(y, gate)
        else:
            y = y * F.silu(gate)
        return self.out_proj(y.to(dtype))

    object.__setattr__(module, "forward", types.MethodType(forward, module))


_MAMBA2_CLASSES = {
    "transformers.models.mamba2.modeling_mamba2.Mamba2Mixer": False,
    "transformers.models.bamba.modeling_bamba.BambaMixer": False,
    "transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer": False,
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer": False,
    "transformers.models.zamba2.modeling_zamba2.Zamba2MambaMixer": False,
    "transformers.models.falcon_h1.modeling_falcon_h1.FalconH1Mixer": True,
}


def _mamba2_installer(falcon: bool) -> Callable[[nn.Module, ParallelState], None]:
    def installer(module: nn.Module, state: ParallelState) -> None:
        if state.cp_size > 1:  # one rank: the module runs as it is
            _install_mamba2(module, state, _FALCON_H1_NAMES if falcon else _MAMBA2_NAMES, falcon)

    return installer


for _qualname, _falcon in _MAMBA2_CLASSES.items():
    register_adapter(_qualname)(_mamba2_installer(_falcon))


_MASK_HOOK = "_seqpar_mask_hook"  # attribute of an adapted Mamba2Model: its pre-hook's handle


@register_adapter("transformers.models.mamba2.modeling_mamba2.Mamba2Model")
def _mamba2_model(module: nn.Module, state: ParallelState) -> None:
    """Mamba2Model cuts a 2-D mask to the last ``S_local`` tokens before its mixers see it
    (``create_recurrent_attention_mask``), so a full-length mask next to sharded ids would reach
    them as the wrong tokens' mask, unnoticed: a pre-hook refuses a mask that is not the shard's.
    The model holds nothing else that mixes tokens (Mamba2Blocks: an RMSNorm, the adapted mixer,
    a residual), so adapting it hides nothing from the model check."""
    layers = getattr(module, "layers", None)
    layers = list(layers) if isinstance(layers, nn.ModuleList) else []
    blocks = {type(m).__name__ for m in layers}
    mixers = {type(getattr(m, "mixer", None)).__name__ for m in layers}
    if blocks != {"Mamba2Block"} or mixers != {"Mamba2Mixer"}:
        raise NotImplementedError(
            f"seqpar: Mamba2Model holds {sorted(blocks)} with mixers {sorted(mixers)}, not the Mamba2Blocks read "
            f"in transformers {READ_AGAINST}; run the model with cp_size 1"
        )
    old = getattr(module, _MASK_HOOK, None)
    if old is not None:
        old.remove()
    handle = None
    if state.cp_size > 1:
        signature = inspect.signature(type(module).forward)

        def check(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            bound = signature.bind_partial(model, *args, **kwargs).arguments
            tokens = bound.get("input_ids")
            tokens = tokens if isinstance(tokens, Tensor) else bound.get("inputs_embeds")
            mask = bound.get("attention_mask")
            if isinstance(tokens, Tensor) and isinstance(mask, Tensor):
                _raise_together(model, state, tokens.device, _mask_row(mask, tokens.shape[0], tokens.shape[1]))

        handle = module.register_forward_pre_hook(check, with_kwargs=True)
    object.__setattr__(module, _MASK_HOOK, handle)


@register_adapter("transformers.models.zamba2.modeling_zamba2.Zamba2MambaDecoderLayer")
def _zamba2_mamba_layer(module: nn.Module, state: ParallelState) -> None:
    """Zamba2's "hybrid" layers hold their Mamba layer one level down (``mamba_decoder``), and the
    model check names that layer, not its mixer. It is an RMSNorm, the mixer (adapted by its own
    entry above, installed right after this one) and a residual: exact once the mixer is."""
    children = {name: type(m).__name__ for name, m in module.named_children()}
    if children != {"mamba": "Zamba2MambaMixer", "input_layernorm": "Zamba2RMSNorm"}:
        raise NotImplementedError(
            f"seqpar: Zamba2MambaDecoderLayer has the children {children}, not the RMSNorm and Mamba "
            f"mixer read in transformers {READ_AGAINST}; run the model with cp_size 1"
        )


# --- Mamba1 (selective scan) ----------------------------------------------------------------------


def _install_mamba1(module: nn.Module, state: ParallelState, names: frozenset[str], jamba: bool) -> None:
    kernels = ("causal_conv1d_fn", "mamba_selective_scan", "apply_mask_to_padding_states")
    modeling = _check_forward(module, names, kernels)

    def conv(shard: HeadShard, xs: Tensor) -> Tensor:
        # xs [B, S, i]: whole sequences of this rank's channels.
        weight = shard.narrow(module.conv1d.weight.squeeze(1))
        bias = None if module.conv1d.bias is None else shard.narrow(module.conv1d.bias)
        return modeling.causal_conv1d_fn(xs.transpose(1, 2), weight, bias, activation=module.activation).transpose(1, 2)

    def scan(
        shard: HeadShard, xs: Tensor, dts: Tensor, bs: Tensor, cs: Tensor, A: Tensor, bias: Tensor | None,
    ) -> Tensor:
        # xs, dts [B, S, i]; bs, cs [B, S, 1, N] (one group, read by every channel).
        return modeling.mamba_selective_scan(
            xs.transpose(1, 2), dts.transpose(1, 2), shard.narrow(A), bs[:, :, 0].transpose(1, 2),
            cs[:, :, 0].transpose(1, 2), D=shard.narrow(module.D.float()), z=None,
            delta_bias=None if bias is None else shard.narrow(bias), delta_softplus=True, return_last_state=False,
            use_mambapy=module.use_mambapy, use_associative_scan=module.use_associative_scan,
        ).transpose(1, 2)

    signature = inspect.signature(type(module).forward)

    @_accelerate_hooks(["conv1d", "dt_proj"])
    def forward(self, *args, **kwargs):
        hidden_states, attention_mask = _arguments(self, state, signature, args, kwargs)
        dtype = hidden_states.dtype
        hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
        xs, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # [B, S_local, I] each
        A = -torch.exp(self.A_log.float())
        xs = head_parallel(conv, [xs], state)
        xs = modeling.apply_mask_to_padding_states(xs, attention_mask)
        time_step, B, C = torch.split(
            self.x_proj(xs), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )
        if jamba:
            time_step = self.dt_layernorm(time_step)
            B, C = self.b_layernorm(B), self.c_layernorm(C)
        if jamba and hasattr(self.config, "_is_quantized"):
            dt = self.dt_proj(time_step) - self.dt_proj.bias
        else:
            dt = (self.dt_proj.weight @ time_step.transpose(1, 2)).transpose(1, 2)
        bias = self.dt_proj.bias.float() if self.dt_proj.bias is not None else None

        def mix(shard: HeadShard, x: Tensor, d: Tensor, b: Tensor, c: Tensor) -> Tensor:
            return scan(shard, x, d, b, c, A, bias)

        y = head_parallel(mix, [xs, dt, B[:, :, None], C[:, :, None]], state, heads=xs.shape[-1])
        y = y * F.silu(gate)  # the reference scan's z, applied last there too
        return self.out_proj(y.to(dtype))

    object.__setattr__(module, "forward", types.MethodType(forward, module))


def _mamba1_installer(jamba: bool) -> Callable[[nn.Module, ParallelState], None]:
    def installer(module: nn.Module, state: ParallelState) -> None:
        if state.cp_size > 1:
            _install_mamba1(module, state, _JAMBA_NAMES if jamba else _MAMBA1_NAMES, jamba)

    return installer


register_adapter("transformers.models.mamba.modeling_mamba.MambaMixer")(_mamba1_installer(False))
register_adapter("transformers.models.jamba.modeling_jamba.JambaMambaMixer")(_mamba1_installer(True))
