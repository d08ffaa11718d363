"""Gated short convolutions (LFM2, LFM2-MoE, LFM3), exact on sequence shards.

Note [Short convolution on shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An LFM short-conv layer (transformers 5.23: ``Lfm2ShortConv``, ``Lfm2MoeShortConv``,
``Lfm3ShortConv``) projects its input to three gates ``B, C, x``, convolves ``B * x`` with a
depthwise causal conv1d of width ``conv_L_cache`` (3 for LFM2, 7 for LFM3) and multiplies the
result by ``C``. Only the conv mixes tokens, and every channel on its own: it runs head-parallel
with every channel a head (Note [Head-parallel mixing]), the model's own conv kernel on whole
sequences of ``hidden_size / cp_size`` channels, one exchange each way. So a token reads the
``K - 1`` globally preceding tokens whatever the placement (zig-zag included).

The layer's own forward runs on the shard with ``causal_conv1d_fn`` rebound to that
head-parallel conv (Note [Rebound kernels]); the gates and projections stay token-wise on the
shard. A cache (``past_key_values``, ``cache`` from 5.24: the conv state) and packed batches are
refused, on every rank alike (Note [Gated delta net on shards]). Read against transformers 5.23's
modeling files and 5.24's (the cache parameter renamed: Note [Renamed cache parameter]).

In state-passing mode (Note [Choosing the mixing mode]) the conv runs on the rank's own tokens
with the ``K - 1`` globally preceding ones of each of its pieces gathered from the ranks that
hold them (``causal_conv1d_halo``): a few tokens per piece, whatever the length. ``"auto"`` picks
it whenever those are fewer bytes than the two all-to-alls, i.e. at all but the shortest shards.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from ...mixing import HeadShard, causal_conv1d_halo, head_parallel
from ...state import ParallelState
from . import CHOOSER, register_adapter
from .gated_delta import refuse_call, refuse_decode_kernel
from .modes import HEAD_PARALLEL, STATE_PASSING, ModeChooser, pieces_per_rank
from .rebind import cache_parameter, call_cache, original_kernels, rebind_forward, set_forward

__all__: list[str] = []

_CLASSES = (
    "transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv",
    "transformers.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv",
    "transformers.models.lfm3.modeling_lfm3.Lfm3ShortConv",
)
_CONV = "causal_conv1d_fn"
_CACHE = cache_parameter("past_key_values")
_PARAMETERS = ("self", "hidden_states", _CACHE, "attention_mask")


def _install(module: nn.Module, state: ParallelState, mixing: str) -> None:
    if state.cp_size == 1:  # nothing is sharded: the module runs as it is
        return
    kernel = original_kernels(module, (_CONV,), _PARAMETERS)[_CONV]
    name = type(module).__name__
    chooser = ModeChooser(state, mixing)

    def conv(hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None,
             activation: str | None = None, **kwargs: Any) -> Tensor:
        """``causal_conv1d_fn`` on shards: ``hidden_states`` ``[B, C, S_local]``, channels as heads."""
        if hidden_states.ndim != 3 or weight.ndim != 2 or weight.shape[0] != hidden_states.shape[1]:
            raise NotImplementedError(
                f"seqpar: {name}'s forward passes its conv x {tuple(hidden_states.shape)} and weight "
                f"{tuple(weight.shape)}, not [B, C, S] and [C, K]; its adapter was written against "
                "transformers 5.23 and 5.24. Run the model with cp_size 1, or report the version"
            )

        batch, channels, local = hidden_states.shape
        size = hidden_states.element_size()
        halo = (state.cp_size - 1) * pieces_per_rank(state) * batch * (weight.shape[-1] - 1) * channels * size
        mode, seq_len = chooser.pick(local, channels, batch * 2 * channels * size, halo, hidden_states.device)
        if mode == STATE_PASSING:
            return causal_conv1d_halo(hidden_states.transpose(1, 2), weight, bias, state, activation=activation,
                                      seq_len=seq_len).transpose(1, 2)

        def mix(shard: HeadShard, x: Tensor) -> Tensor:  # x: [B, S, c], whole sequences
            b = None if bias is None else shard.narrow(bias)
            return kernel(x.transpose(1, 2), shard.narrow(weight), b, activation=activation).transpose(1, 2)

        return head_parallel(mix, [hidden_states.transpose(1, 2)], state, seq_len=seq_len).transpose(1, 2)

    update = "causal_conv1d_update"  # the cached one-token step
    rebound = rebind_forward(module, {_CONV: conv, update: refuse_decode_kernel(update)})
    signature = inspect.signature(type(module).forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(self, *args, **kwargs).arguments
        refuse_call(self, *call_cache(call, _CACHE), {**call.get("kwargs", {})})
        return rebound(self, *args, **kwargs)

    set_forward(module, forward)
    object.__setattr__(module, CHOOSER, chooser)


for _qualname in _CLASSES:
    register_adapter(_qualname, modes=(HEAD_PARALLEL, STATE_PASSING))(_install)
