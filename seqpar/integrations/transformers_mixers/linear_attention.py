"""Linear attention (MiniMax lightning attention, Kimi delta attention), exact on sequence shards.

Note [Linear attention on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Both layer kinds here mix tokens only through a per-head recurrence (and, for KDA, a depthwise
conv over channels that each belong to one head), so both run head-parallel (Note [Head-parallel
mixing]): the recurrence's inputs go to whole sequences of ``H / cp_size`` heads, the module's own
computation runs there, and the output comes back to token shards; one exchange each way. The
projections, gates and norms around it stay token-wise on the shard.

**MiniMax lightning attention** (``MiniMaxLightningAttention``) computes, per head with slope
``s``, ``o_i = sum_{j <= i} exp(-s (i - j)) (q_i . k_j) v_j``, in blocks of ``block_size`` tokens:
an intra-block product with the ``diagonal_decay`` mask plus the decayed ``K^T V`` state of the
blocks before. The block loop is written inline in the forward (no kernel function to rebind), so
the adapter gives the instance a forward that runs the same steps as the class's (projection,
activation, padding mask, then the loop, norm, output gate, projection) with the loop moved into
the head-parallel call, on the module's own buffers narrowed to the rank's heads. The blocks are
cut from the global sequence start, as on one device, so the result is the one-device loop's on
those heads. The forward's second output (the final ``K^T V`` state, for a cache) is ``None``.
In state-passing mode (Note [Choosing the mixing mode]) the loop is replaced by
``ScalarDecayAttention`` on the rank's own tokens (log decay ``-slope`` per head and token: the
same sum), its piece states passed between ranks.

**Kimi delta attention** (``KimiLinearDeltaAttention``, ``BailingHybridDeltaAttention``): q, k,
v (``H`` heads of ``D`` each), a per-channel decay ``g`` ``[B, S, H, D]`` and a gate ``beta``
``[B, S, H]``, a depthwise causal conv1d over the q/k/v channels, then the chunked KDA rule. As
for the gated delta net (Note [Gated delta net on shards]) the forward runs on the shard with its
kernel names rebound (Note [Rebound kernels]): ``causal_conv1d_fn`` records its arguments and
returns its input, and ``chunk_kimi_delta_attention`` runs conv and rule in one head-parallel
call, each the modeling file's own function (the installed kernel or the torch fallback). In
state-passing mode the same call runs the conv by its halo and the rule by state passing with the
modeling file's own kernel per piece (``KernelRule``: the per-channel decay ``diag(exp(g_t))`` acts
on the state's rows, so its columns evolve independently and ``Dk`` extra value columns started
at the identity give the transition), as for the gated delta nets.

Decoding with a cache (MiniMax's ``past_key_values``, KDA's ``cache_params``; ``cache`` for both
from 5.24) and packed batches are refused from the call's arguments, which every CP rank passes
alike, so every rank raises the same error before any collective. Read against transformers
5.23's modeling files and 5.24's (the cache parameter renamed: Note [Renamed cache parameter]); a
forward of another shape is refused when the adapter is installed.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...mixing import HeadShard, ScalarDecayAttention, causal_conv1d_halo, head_parallel, state_passing
from ...state import ParallelState
from . import CHOOSER, register_adapter
from .gated_delta import (
    ConvAndRuleKernels, ConvCall, KernelRule, halo_and_rule_bytes, install_conv_and_rule, refuse_call, summary_dtype,
)
from .modes import HEAD_PARALLEL, STATE_PASSING, ModeChooser, pieces_per_rank
from .rebind import cache_parameter, call_cache, checked_forward, refuse_adapting, set_forward

__all__: list[str] = []


# --- MiniMax lightning attention ------------------------------------------------------------------

_LIGHTNING = "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention"
_LIGHTNING_CACHE = cache_parameter("past_key_values")
_LIGHTNING_PARAMETERS = ("self", "hidden_states", "position_embeddings", "attention_mask", _LIGHTNING_CACHE)
# What the 5.23 forward reads of the module; the adapter's forward reads the same.
_LIGHTNING_READS = ("qkv_proj", "act_fn", "norm", "output_gate", "out_proj", "slope_rate", "query_decay",
                    "key_decay", "diagonal_decay", "block_size", "num_attention_heads", "head_dim")


def _lightning_blocks(module: nn.Module, shard: HeadShard, qkv: Tensor) -> Tensor:
    """The forward's block loop (no cache) on whole sequences of this rank's heads.

    Args:
        qkv: ``[B, S, h, 3 * D]``, this rank's heads after the activation and padding mask.

    Returns:
        ``[B, S, h, D]``.
    """
    d, block = module.head_dim, module.block_size
    batch, seq_len, heads = qkv.shape[:3]
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, d, dim=3))  # [B, h, S, D]
    slope = shard.narrow(module.slope_rate)  # [h, 1, 1]
    query_decay, key_decay = shard.narrow(module.query_decay), shard.narrow(module.key_decay)  # [h, block, 1]
    diagonal_decay = shard.narrow(module.diagonal_decay, dim=1)  # [1, h, block, block]
    kv = torch.zeros(batch, heads, d, d, device=v.device, dtype=v.dtype)
    out = []
    for start in range(0, seq_len, block):
        end = min(start + block, seq_len)
        size = end - start
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal_decay[:, :, :size, :size], vb)
        inter = torch.matmul(qb * query_decay[:, :size], kv)
        out.append(inter + intra)
        kv = kv * torch.exp(-slope * size) + torch.matmul((kb * key_decay[:, -size:]).transpose(-1, -2), vb)
    return torch.cat(out, dim=-2).transpose(1, 2)


def _check_lightning(module: nn.Module) -> None:
    cls = type(module)
    checked_forward(cls, _LIGHTNING_PARAMETERS, (*_LIGHTNING_READS, "get_linear_cache"))
    missing = [n for n in _LIGHTNING_READS if not hasattr(module, n)]
    if missing:
        raise refuse_adapting(cls, f"it has no {missing} to compute lightning attention from")


def _lightning_state_passing(module: nn.Module, state: ParallelState, qkv: Tensor, seq_len: int | None) -> Tensor:
    """Lightning attention by state passing (Note [State passing]): this rank's tokens ``qkv [B,
    S_local, H, 3 * D]`` as linear attention with the per-head log decay ``-slope`` at every
    token (``ScalarDecayAttention``); ``[B, S_local, H, D]``. The same sum as the block loop:
    ``o_i = sum_{j <= i} exp(-s (i - j)) (q_i . k_j) v_j``."""
    q, k, v = torch.split(qkv, module.head_dim, dim=3)
    decay = -module.slope_rate.reshape(1, 1, -1).to(qkv.dtype).expand(*qkv.shape[:3])
    (out,), _ = state_passing(ScalarDecayAttention(chunk_size=module.block_size), [q, k, v, decay], state,
                              seq_len=seq_len)
    return out


def _install_lightning(module: nn.Module, state: ParallelState, mixing: str) -> None:
    if state.cp_size == 1:  # nothing is sharded: the module runs as it is
        return
    _check_lightning(module)
    signature = inspect.signature(type(module).forward)
    apply_mask = inspect.unwrap(type(module).forward).__globals__.get("apply_mask_to_padding_states")
    if not callable(apply_mask):
        raise refuse_adapting(type(module), "its forward does not call apply_mask_to_padding_states")
    chooser = ModeChooser(state, mixing)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        call = signature.bind(self, *args, **kwargs).arguments
        refuse_call(self, *call_cache(call, _LIGHTNING_CACHE), {**call.get("kwargs", {})})
        hidden_states, attention_mask = call["hidden_states"], call.get("attention_mask")
        batch, local, _ = hidden_states.shape
        heads, d = self.num_attention_heads, self.head_dim
        qkv = apply_mask(self.act_fn(self.qkv_proj(hidden_states)), attention_mask)  # token-wise
        qkv = qkv.reshape(batch, local, heads, 3 * d)
        # head-parallel: q, k, v in and the output back; state passing: P [H] and b [H, D, D] per piece
        per_token = batch * heads * 4 * d * qkv.element_size()
        summary = heads * (d * d + 1) * torch.empty(0, dtype=summary_dtype(qkv)).element_size()
        sp_bytes = (state.cp_size - 1) * pieces_per_rank(state) * batch * summary
        mode, seq_len = chooser.pick(local, heads, per_token, sp_bytes, qkv.device)
        if mode == STATE_PASSING:
            out = _lightning_state_passing(self, state, qkv, seq_len)
        else:
            out = head_parallel(lambda shard, x: _lightning_blocks(self, shard, x), [qkv], state, seq_len=seq_len)
        out = self.norm(out.reshape(batch, local, heads * d))
        out = F.sigmoid(self.output_gate(hidden_states)) * out
        return self.out_proj(out), None  # no K^T V state: decoding with a cache is refused above

    set_forward(module, forward)
    object.__setattr__(module, CHOOSER, chooser)


register_adapter(_LIGHTNING, modes=(HEAD_PARALLEL, STATE_PASSING))(_install_lightning)


# --- Kimi delta attention -------------------------------------------------------------------------

_KDA_CLASSES = (
    "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",
    "transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridDeltaAttention",
)
_CONV, _RULE = "causal_conv1d_fn", "chunk_kimi_delta_attention"
_KDA_DECODE = ("causal_conv1d_update", "recurrent_kimi_delta_attention")  # cached one-token steps
_KDA_PARAMETERS = ("self", "hidden_states", cache_parameter("cache_params"), "attention_mask")


class _KimiRule(KernelRule):
    """KDA's rule by the modeling file's own ``chunk_kimi_delta_attention``, per piece
    (:class:`KernelRule`: its per-channel decay acts on the state's rows, ``S_t = (I - beta_t k_t
    k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, so the state's columns still evolve
    independently and ``Dk`` extra value columns started at the identity give the transition)."""

    def kernel(self, inputs, initial_state):
        q, _, v = inputs[:3]
        if q.shape[1] == 0:  # a rank without tokens: the chunked kernel cannot reshape zero tokens
            dtype = summary_dtype(*inputs)
            h = initial_state if initial_state is not None else v.new_zeros(
                v.shape[0], *self.state_shape(inputs), dtype=dtype)
            return (v.new_zeros(v.shape),), h
        return super().kernel(inputs, initial_state)


class _KimiDeltaKernels(ConvAndRuleKernels):
    """Kimi Linear / Bailing-Hybrid: q, k, v and the per-channel decay ``g`` with the same heads."""

    rule_name = "delta rule"
    kernel_names = (_CONV, _RULE)

    def __init__(self, module: nn.Module, state: ParallelState, mixing: str) -> None:
        super().__init__(module, state, _KDA_PARAMETERS, mixing)

    def mix(self, conv: ConvCall, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
            use_qk_l2norm_in_kernel: bool, extra: dict[str, Any]) -> Tensor:
        heads, d = query.shape[-2:]
        same = conv.x.untyped_storage().data_ptr()
        if (
            query.ndim != 4 or any(tuple(t.shape) != tuple(query.shape) for t in (key, value, g))
            or tuple(beta.shape) != tuple(query.shape[:3]) or 3 * heads * d != conv.x.shape[1]
            or any(t.untyped_storage().data_ptr() != same for t in (query, key, value))
        ):
            raise self._shape_error(
                f"passes the rule q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}, "
                f"g {tuple(g.shape)}, beta {tuple(beta.shape)} that are not a re-layout of the conv's "
                f"{tuple(conv.x.shape)} channels with a per-channel decay"
            )
        batch = query.shape[0]
        per_token = batch * (  # in: the pre-conv channels, g and beta; out: the rule's output
            conv.x.shape[1] * conv.x.element_size()
            + heads * (d * g.element_size() + beta.element_size() + d * value.element_size())
        )
        sp_bytes = halo_and_rule_bytes(self.state, conv, heads, d, d, summary_dtype(query, key, value, g, beta))
        mode, seq_len = self.chooser.pick(query.shape[1], heads, per_token, sp_bytes, query.device)
        if mode == STATE_PASSING:
            # The conv by its halo on the pre-conv q/k/v channels, then the rule by state passing.
            y = causal_conv1d_halo(conv.x.transpose(1, 2), conv.weight, conv.bias, self.state,
                                   activation=conv.activation, seq_len=seq_len)  # [B, S_local, 3 H D]
            q, k, v = (t.unflatten(-1, (heads, d)) for t in y.split(heads * d, dim=-1))
            rule = _KimiRule(self.rule_kernel, use_qk_l2norm_in_kernel, extra)
            (out,), _ = state_passing(rule, [q, k, v, g, beta], self.state, seq_len=seq_len)
            return out
        conv_kernel, rule_kernel = self.conv_kernel, self.rule_kernel

        def mine(t: Tensor | None, shard: HeadShard) -> Tensor | None:
            # This rank's rows of a conv parameter laid out [q | k | v], each H heads of D channels.
            if t is None:
                return None
            return torch.cat([shard.narrow(p.unflatten(0, (heads, d))).flatten(0, 1) for p in t.chunk(3)])

        def mix(shard: HeadShard, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
            h = q.shape[2]
            # [B, c, S] channels first, as the forward lays out its conv input
            x = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)
            y = conv_kernel(x, weight=mine(conv.weight, shard), bias=mine(conv.bias, shard), activation=conv.activation)
            q, k, v = (t.unflatten(-1, (h, d)) for t in y.transpose(1, 2).split(h * d, dim=-1))
            out, _ = rule_kernel(
                q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra,
            )
            return out

        return head_parallel(mix, [query, key, value, g, beta], self.state, heads=heads, seq_len=seq_len)


def _install_kda(module: nn.Module, state: ParallelState, mixing: str) -> None:
    if state.cp_size == 1:  # nothing is sharded: the module runs as it is
        return
    kernels = _KimiDeltaKernels(module, state, mixing)
    install_conv_and_rule(module, kernels, _KDA_DECODE)
    object.__setattr__(module, CHOOSER, kernels.chooser)


for _qualname in _KDA_CLASSES:
    register_adapter(_qualname, modes=(HEAD_PARALLEL, STATE_PASSING))(_install_kda)
