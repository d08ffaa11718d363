"""Gated delta nets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo Hybrid), exact on sequence shards.

Note [Gated delta net on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A gated delta net layer (transformers 5.23: ``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``,
``Qwen3_5MoeGatedDeltaNet``, ``OlmoHybridGatedDeltaNet``) projects its input to q, k (``Hk``
heads of ``Dk``), v (``Hv`` heads of ``Dv``), a decay ``g`` and a gate ``beta`` (``Hv`` each),
runs a depthwise causal conv1d over the q/k/v channels, then the gated delta rule, then a gated
norm and the output projection. Only the conv and the rule mix tokens, and both are per head (a
q/k channel belongs to one K head, a v channel to one V head; ``Hk`` divides ``Hv``, K head ``j``
serving V heads ``j * Hv/Hk ..``: the grouped heads of ``head_parallel``).

So the two run as **one** head-parallel call (Note [Head-parallel mixing]): the pre-conv q, k, v
and ``g``, ``beta`` go to whole sequences of ``Hv / cp_size`` V heads (and the K heads those
read), where the model's own conv kernel runs on those heads' channels and the model's own rule
kernel on those heads, and the output comes back to token shards. One exchange each way instead
of two (conv, then rule), and bitwise the one-device kernels on those heads.

The layer's own forward runs on the shard with its two kernel names rebound (Note [Rebound
kernels]): ``causal_conv1d_fn`` becomes a placeholder that returns its input (a depthwise conv on a
shard would read the wrong history) and records its weight, bias and activation; the forward's
token-wise steps between the two calls (transpose, split into q/k/v, reshape to heads) run on the
pre-conv channels; ``torch_chunk_gated_delta_rule`` then receives q/k/v, checks that they are views
of what the conv was given (nothing but a re-layout happened in between) and runs conv and rule
head-parallel. Decoding with a cache (``cache_params``, ``cache`` from 5.24: conv and recurrent
states) is refused: this step does not hand states across ranks. The refusal follows from the
call's arguments, which every CP rank passes alike, so every rank raises the same error before any
collective.

Packed batches (transformers' flattened rows, the global ``cu_seq_lens_q`` reaching the rule as
``cu_seqlens``; Note [Packed sequences in transformers models]) run per sequence: head-parallel
with ``seq_lens`` (each head shard holds whole sequences, ``shard.cu_seqlens``), the model's conv
and rule kernels on every sequence alone, from zero history and state (the torch fallbacks take
no ``cu_seqlens``: the rule refuses them, the conv ignores them); in state-passing mode the halo
and the states stop at every sequence start. With one rank the adapter is installed for packed
calls only (dense calls run the class's forward): transformers' fallbacks cannot run them there.

In state-passing mode (Note [Choosing the mixing mode]) the same rebound rule call runs the conv
on the rank's own tokens with their ``K - 1`` token halo (``causal_conv1d_halo``, on the pre-conv
q/k/v channels) and the rule by :func:`~seqpar.mixing.state_passing`, each piece by the model's
own rule kernel (:class:`KernelRule`): its outputs and final state from a zero state, its
transition from ``Dk`` extra value columns started at the identity, and a re-run from the true
initial state where the piece does not start the sequence.

Read against transformers 5.23's modeling files, and 5.24's (the same forwards with the cache
parameter renamed ``cache``: Note [Renamed cache parameter]); a forward of another shape is refused
when the adapter is installed (``rebind.original_kernels``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...mixing import HeadShard, Recurrence, Summary, causal_conv1d_halo, head_parallel, state_passing
from ...state import ParallelState
from . import CHOOSER, register_adapter
from .modes import HEAD_PARALLEL, STATE_PASSING, ModeChooser, pieces_per_rank
from .rebind import Parameter, cache_parameter, call_cache, original_kernels, rebind_forward, set_forward

__all__: list[str] = []

_CLASSES = (
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet",
)
_CONV, _RULE = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
_DECODE = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule")  # cached one-token steps
_CACHE = cache_parameter("cache_params")
_PARAMETERS = ("self", "hidden_states", _CACHE, "attention_mask")
# transformers' packed-batch kwargs: positions within the shard, not the sequence.
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")
_PACKED = "_seqpar_packed"  # attribute of a module whose adapter runs packed batches: the state it is bound to


def mark_packed(module: nn.Module, state: ParallelState) -> None:
    """Declare that ``module``'s adapter (bound to ``state``) runs packed batches exactly: the
    model check then lets a packed call through it (Note [Packed sequences in transformers
    models] in ``seqpar.integrations.transformers``)."""
    object.__setattr__(module, _PACKED, state)


def runs_packed(module: nn.Module, state: ParallelState) -> bool:
    """Whether ``module`` carries an adapter bound to ``state`` that runs packed batches."""
    return getattr(module, _PACKED, None) is state


def refuse_call(module: nn.Module, cache: object, cache_name: str, kwargs: dict[str, Any], *,
                packed: bool = False) -> None:
    """Refuse what this step does not run on shards (the same on every rank: see the Note).
    ``packed``: the adapter runs packed batches, given with the global ``cu_seq_lens_q``.

    Raises:
        NotImplementedError: a cache holding the layer's states, or packed-batch kwargs (all of
            them unless ``packed``; without ``cu_seq_lens_q`` if ``packed``).
    """
    name = type(module).__name__
    if cache is not None:
        raise NotImplementedError(
            f"seqpar: {name} on sequence shards does not support a cache ({cache_name}={type(cache).__name__}): "
            "the layer's states (conv, recurrent) would cover this rank's tokens only. Decoding and "
            "generate with a cache are not supported for hybrid models on shards yet; call the model "
            "with use_cache=False, or generate with cp_size 1"
        )
    given = [k for k in PACKED_KWARGS if kwargs.get(k) is not None]
    if given and packed and kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seqlens") is None:
        return
    if given and packed:
        raise NotImplementedError(
            f"seqpar: {name} runs packed batches given by the global cu_seq_lens_q (transformers' "
            f"DataCollatorWithFlattening), not by {', '.join(given)} alone"
        )
    if given:
        raise NotImplementedError(
            f"seqpar: {name} on sequence shards does not support packed batches ({', '.join(given)}); "
            "pass one sequence per row with position_ids=seqpar.shard_positions(S, state)[None]"
        )


def refuse_decode_kernel(name: str) -> Callable[..., Any]:
    """A stand-in for a cached one-token kernel: reached only with a cache, which is refused first."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"seqpar: {name} (cached decoding) is not supported on sequence shards")

    return refused


@dataclass(eq=False)
class ConvCall:
    """What the forward passed to its conv kernel, for the rule to run it."""

    x: Tensor  # [B, C, S_local], the pre-conv q/k/v channels
    weight: Tensor  # [C, K]
    bias: Tensor | None
    activation: str | None


class ConvAndRuleKernels:
    """The conv and delta-rule kernels one layer instance runs with on ``state``'s shards: the
    forward's conv call is a placeholder that records its arguments, and its rule call runs the
    conv and the rule in one head-parallel call (Note [Gated delta net on shards]). A subclass
    names its rule and implements :meth:`mix`; shared by the gated delta nets and Kimi delta
    attention."""

    rule_name = "gated delta rule"  # in messages
    kernel_names = (_CONV, _RULE)  # the module-level names the forward calls its conv and rule by
    runs_packed = False  # True: mix() takes seq_lens= for packed calls (the rule's cu_seqlens)

    def __init__(self, module: nn.Module, state: ParallelState, parameters: tuple[Parameter, ...],
                 mixing: str = HEAD_PARALLEL) -> None:
        kernels = original_kernels(module, self.kernel_names, parameters)
        self.cache = next(p for p in parameters if isinstance(p, tuple))  # the cache parameter's names
        self.name = type(module).__name__
        self.state = state
        self.chooser = ModeChooser(state, mixing)
        self.conv_kernel, self.rule_kernel = (kernels[n] for n in self.kernel_names)
        self.pending: ConvCall | None = None  # set by conv, taken by rule, within one forward

    def conv(self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None,
             activation: str | None = None, **kwargs: Any) -> Tensor:
        """Placeholder of ``causal_conv1d_fn``: the conv runs inside :meth:`rule` (see the Note)."""
        if self.pending is not None:
            raise self._shape_error(f"calls its conv twice before the {self.rule_name}")
        if hidden_states.ndim != 3 or weight.ndim != 2 or weight.shape[0] != hidden_states.shape[1]:
            raise self._shape_error(
                f"passes its conv x {tuple(hidden_states.shape)} and weight {tuple(weight.shape)}, not "
                "[B, C, S] and [C, K]"
            )
        self.pending = ConvCall(hidden_states, weight, bias, activation)
        return hidden_states

    def rule(self, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, *,
             initial_state: Tensor | None = None, output_final_state: bool = False,
             use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None, **kwargs: Any,
             ) -> tuple[Tensor, None]:
        """The rule kernel on shards: conv + rule, one head-parallel call (:meth:`mix`)."""
        conv, self.pending = self.pending, None
        if conv is None:
            raise self._shape_error(f"calls the {self.rule_name} without its conv")
        if initial_state is not None or output_final_state or (cu_seqlens is not None and not self.runs_packed):
            raise NotImplementedError(
                f"seqpar: {self.name} on sequence shards takes no initial or final recurrent state and "
                "no packed batch (cache decoding and cu_seqlens are not supported on shards yet)"
            )
        extra = {k: kwargs[k] for k in ("chunk_size",) if k in kwargs}
        if cu_seqlens is not None:  # the model's global cu_seq_lens_q (checked by the model check)
            bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
            seq_lens = tuple(int(b) - int(a) for a, b in zip(bounds, bounds[1:]))
            return self.mix(conv, query, key, value, g, beta, use_qk_l2norm_in_kernel, extra, seq_lens=seq_lens), None
        return self.mix(conv, query, key, value, g, beta, use_qk_l2norm_in_kernel, extra), None

    def mix(self, conv: ConvCall, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
            use_qk_l2norm_in_kernel: bool, extra: dict[str, Any]) -> Tensor:
        """This rank's shard of the rule's output, the conv and rule run head-parallel."""
        raise NotImplementedError

    def _shape_error(self, what: str) -> NotImplementedError:
        import transformers

        return NotImplementedError(
            f"seqpar: {self.name}'s forward {what}; its adapter was written against transformers 5.23 and 5.24 "
            f"(installed: {transformers.__version__}). Run the model with cp_size 1, or report the version"
        )


class KernelRule(Recurrence):
    """A delta rule run by the model's own chunked kernel, for :func:`~seqpar.mixing.state_passing`.

    ``kernel(q, k, v, g=, beta=, initial_state=, output_final_state=True,
    use_qk_l2norm_in_kernel=, **extra)`` is the modeling file's (``torch_chunk_gated_delta_rule``,
    ``chunk_kimi_delta_attention``: the installed flash-linear-attention kernel or the torch
    fallback), so every piece is computed as the model computes it. Inputs ``q, k [B, n, Hk,
    Dk]``, ``v [B, n, H, Dv]``, ``g`` and ``beta`` as the kernel takes them; state ``[H, Dk, Dv]``.
    The state's columns evolve independently (``S_t = A_t S_{t-1} + k_t (beta_t v_t)^T``, ``A_t``
    acting on the left), so one run with ``Dk`` zero value columns appended and the identity as
    their initial state gives the piece's transition ``P [H, Dk, Dk]`` as those columns' final
    state. The correction re-runs the kernel from the true initial state (its outputs exactly).
    """

    num_inputs = 5
    input_names = ("q", "k", "v", "g", "beta")

    def __init__(self, kernel: Callable[..., Any], use_qk_l2norm: bool, extra: dict[str, Any]) -> None:
        self.fn, self.use_qk_l2norm, self.extra = kernel, use_qk_l2norm, extra

    def heads(self, inputs):
        return inputs[2].shape[2]

    def state_shape(self, inputs):
        return (inputs[2].shape[2], inputs[1].shape[3], inputs[2].shape[3])

    def transition_shape(self, inputs):
        return (inputs[2].shape[2], inputs[1].shape[3], inputs[1].shape[3])

    def _run(self, inputs, v: Tensor, initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
        q, k, _, g, beta = inputs
        return self.fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                       use_qk_l2norm_in_kernel=self.use_qk_l2norm, **self.extra)

    def kernel(self, inputs, initial_state):
        out, final = self._run(inputs, inputs[2], initial_state)
        return (out,), final

    def apply(self, transition, state):
        return transition @ state

    def summarize(self, inputs):
        v = inputs[2]
        B, _, H, Dv = v.shape
        Dk = inputs[1].shape[3]
        dtype = summary_dtype(*inputs)
        eye = torch.eye(Dk, dtype=dtype, device=v.device).expand(B, H, Dk, Dk)
        h0 = torch.cat([torch.zeros(B, H, Dk, Dv, dtype=dtype, device=v.device), eye], -1)
        out, final = self._run(inputs, torch.cat([v, v.new_zeros(*v.shape[:3], Dk)], -1), h0)
        return Summary((out[..., :Dv],), final[..., :Dv], final[..., Dv:])


def halo_and_rule_bytes(
    state: ParallelState, conv: ConvCall, heads: int, dk: int, dv: int, dtype: torch.dtype,
) -> int:
    """Bytes a rank receives in state-passing mode (Note [Choosing the mixing mode]): every other
    rank's pieces' summaries (``P [H, Dk, Dk]`` and ``b [H, Dk, Dv]``) and conv halos."""
    batch, channels = conv.x.shape[:2]
    summary = heads * dk * (dk + dv) * torch.empty(0, dtype=dtype).element_size()
    halo = (conv.weight.shape[-1] - 1) * channels * conv.x.element_size()
    return (state.cp_size - 1) * pieces_per_rank(state) * batch * (summary + halo)


def summary_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32, or float64 when any input is: the dtype state passing sums summaries in."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _GatedDeltaKernels(ConvAndRuleKernels):
    """Qwen3-Next / Qwen3.5 / OLMo-Hybrid: q, k with K heads, v with V heads reading them."""

    runs_packed = True

    def __init__(self, module: nn.Module, state: ParallelState, mixing: str) -> None:
        super().__init__(module, state, _PARAMETERS, mixing)

    def mix(self, conv: ConvCall, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
            use_qk_l2norm_in_kernel: bool, extra: dict[str, Any], seq_lens: tuple[int, ...] | None = None,
            ) -> Tensor:
        """``seq_lens``: a packed call's global sequence lengths (one row ``[1, T_local]`` in
        ``shard_packed``'s placement): every sequence's conv and rule start afresh."""
        hk, dk = query.shape[-2:]
        hv, dv = value.shape[-2:]
        channels = (hk * dk, hk * dk, hv * dv)
        same = conv.x.untyped_storage().data_ptr()
        if (
            query.ndim != 4 or tuple(key.shape) != tuple(query.shape) or value.ndim != 4 or hv % hk
            or sum(channels) != conv.x.shape[1] or g.shape[-1] != hv or beta.shape[-1] != hv
            or any(t.untyped_storage().data_ptr() != same for t in (query, key, value))
        ):
            raise self._shape_error(
                f"passes the rule q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}, "
                f"g {tuple(g.shape)}, beta {tuple(beta.shape)} that are not a re-layout of the conv's "
                f"{tuple(conv.x.shape)} channels"
            )
        if seq_lens is not None and query.shape[0] != 1:
            raise self._shape_error(f"passes a packed batch of {query.shape[0]} rows, not one")
        batch = query.shape[0]
        per_token = batch * (  # in: the pre-conv channels, g and beta; out: the rule's output
            conv.x.shape[1] * conv.x.element_size()
            + hv * (g.element_size() + beta.element_size() + dv * value.element_size())
        )
        sp_bytes = halo_and_rule_bytes(self.state, conv, hv, dk, dv, summary_dtype(query, key, value, g, beta))
        mode, seq_len = self.chooser.pick(query.shape[1], hv, per_token, sp_bytes, query.device)
        if mode == STATE_PASSING:
            return self._state_passing(conv, channels, hk, hv, dk, dv, g, beta, use_qk_l2norm_in_kernel, extra,
                                       seq_len, seq_lens)
        conv_kernel, rule_kernel = self.conv_kernel, self.rule_kernel

        def mix(shard: HeadShard, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
            # This rank's channels of the conv weight: q and k rows per K head, v rows per V head.
            def mine(t: Tensor | None) -> Tensor | None:
                if t is None:
                    return None
                tq, tk, tv = t.split(channels)
                return torch.cat([
                    shard.narrow(tq.unflatten(0, (hk, dk)), 0, hk).flatten(0, 1),
                    shard.narrow(tk.unflatten(0, (hk, dk)), 0, hk).flatten(0, 1),
                    shard.narrow(tv.unflatten(0, (hv, dv)), 0, hv).flatten(0, 1),
                ])

            mq, mv = q.shape[2], v.shape[2]
            # [B, c, S] channel-last, as the forward lays out its conv input
            x = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)
            y = conv_kernel(x, mine(conv.weight), mine(conv.bias), activation=conv.activation)
            q, k, v = y.transpose(1, 2).split([mq * dk, mq * dk, mv * dv], dim=-1)
            # One K head per V head of this rank (its V heads may read K heads in any ratio).
            q = shard.expand(q.unflatten(-1, (mq, dk)), hk, dim=2)
            k = shard.expand(k.unflatten(-1, (mq, dk)), hk, dim=2)
            out, _ = rule_kernel(
                q, k, v.unflatten(-1, (mv, dv)), g=g, beta=beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra,
            )
            return out

        if seq_lens is None:
            return head_parallel(mix, [query, key, value, g, beta], self.state, heads=hv, seq_len=seq_len)

        def mix_packed(shard: HeadShard, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
            # [T, h, ...]: the conv and the rule of every sequence on its own, from zero history and
            # state, as one device runs each sequence (the torch fallbacks take no cu_seqlens).
            bounds = shard.cu_seqlens.tolist()
            outs = [
                mix(shard, *(t[None, a:b] for t in (q, k, v, g, beta)))[0]
                for a, b in zip(bounds, bounds[1:]) if b > a
            ]
            return torch.cat(outs) if outs else v.new_zeros(0, v.shape[1], dv)

        out = head_parallel(mix_packed, [t[0] for t in (query, key, value, g, beta)], self.state, heads=hv,
                            seq_lens=seq_lens)
        return out.unsqueeze(0)

    def _state_passing(
        self, conv: ConvCall, channels: tuple[int, int, int], hk: int, hv: int, dk: int, dv: int, g: Tensor,
        beta: Tensor, use_qk_l2norm: bool, extra: dict[str, Any], seq_len: int | None,
        seq_lens: tuple[int, ...] | None = None,
    ) -> Tensor:
        """Conv by its halo, then the rule by state passing, each rank on its own tokens (packed:
        ``seq_lens`` given, one row; no halo or state crosses a sequence start)."""
        x = conv.x.transpose(1, 2)  # [B, S_local, C]
        if seq_lens is not None:
            x, g, beta, seq_len = x[0], g[0], beta[0], None  # [T_local, ...]
        y = causal_conv1d_halo(x, conv.weight, conv.bias, self.state, activation=conv.activation,
                               seq_len=seq_len, seq_lens=seq_lens)
        q, k, v = y.split(channels, dim=-1)
        inputs = [q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv)), g, beta]
        (out,), _ = state_passing(KernelRule(self.rule_kernel, use_qk_l2norm, extra), inputs, self.state,
                                  seq_len=seq_len, seq_lens=seq_lens)
        return out if seq_lens is None else out.unsqueeze(0)


def install_conv_and_rule(module: nn.Module, kernels: ConvAndRuleKernels, decode: tuple[str, ...]) -> None:
    """Give ``module`` its class's forward with its conv and rule kernels rebound to ``kernels``
    (one head-parallel call, Note [Gated delta net on shards]) and its cached one-token kernels
    (``decode``) refused, refusing a cache or packed kwargs first and a forward that ran the conv but
    not the rule after. Shared by the gated delta nets and Kimi delta attention."""
    conv, rule = kernels.kernel_names
    replaced = {conv: kernels.conv, rule: kernels.rule, **{k: refuse_decode_kernel(k) for k in decode}}
    rebound = rebind_forward(module, replaced)
    signature = inspect.signature(type(module).forward)
    one_rank = kernels.state.cp_size == 1  # adapted for packed batches only (see _install)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(self, *args, **kwargs).arguments
        extra = {**call.get("kwargs", {})}
        if one_rank and extra.get("cu_seq_lens_q") is None:
            return type(self).forward(self, *args, **kwargs)
        refuse_call(self, *call_cache(call, kernels.cache), extra, packed=kernels.runs_packed)
        kernels.pending = None
        try:
            out = rebound(self, *args, **kwargs)
        finally:
            left, kernels.pending = kernels.pending, None
        if left is not None:
            raise kernels._shape_error(f"calls its conv but not the {kernels.rule_name}")
        return out

    set_forward(module, forward)


def _install(module: nn.Module, state: ParallelState, mixing: str) -> None:
    # With one rank nothing is sharded and the module runs as it is, except for packed batches:
    # transformers' torch fallbacks ignore cu_seq_lens_q (Note [Packed sequences in transformers
    # models]), so those run through the adapter, per sequence.
    kernels = _GatedDeltaKernels(module, state, mixing)
    install_conv_and_rule(module, kernels, _DECODE)
    mark_packed(module, state)
    if state.cp_size > 1:
        object.__setattr__(module, CHOOSER, kernels.chooser)


for _qualname in _CLASSES:
    register_adapter(_qualname, modes=(HEAD_PARALLEL, STATE_PASSING))(_install)
