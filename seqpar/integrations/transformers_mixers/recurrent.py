"""Per-channel and per-head recurrences (RecurrentGemma's RG-LRU block, xLSTM's mLSTM), exact on shards.

Note [RG-LRU on shards]
~~~~~~~~~~~~~~~~~~~~~~~
RecurrentGemma's recurrent block (transformers 5.23: ``RecurrentGemmaRecurrentBlock``) mixes
tokens twice, both per channel of its ``lru_width`` channels: a depthwise causal ``conv_1d`` over
the x branch, then the RG-LRU's linear scan ``h_t = a_t * h_{t-1} + x_t`` (``a_t`` zeroed where
the position id is 0: a new document). The gates between them are token-wise (block-diagonal per
head, from the same token), as are the y branch and the projections.

It runs in either mode (Note [Choosing the mixing mode]), one decision per block call for the
conv and the scan alike:

- **head-parallel**: each of the two runs head-parallel with every channel a head (Note
  [Head-parallel mixing]): the conv with the module's own weight and bias narrowed to the rank's
  channels, the scan as the module's own ``_rnn_scan`` on whole sequences of those channels, the
  reset flags travelling along as a one-head tensor (every rank receives them all, in global
  order). Bitwise the one-device block.
- **state passing**: every rank keeps its own tokens. The conv by its ``K - 1`` token halo
  (:func:`~seqpar.mixing.causal_conv1d_halo`), the scan by :func:`~seqpar.mixing.state_passing`
  with each piece run by the module's own ``_rnn_scan`` from a zero state (:class:`_ModelRGLRU`):
  its final state is the summary's ``b``, ``prod_t a_t (1 - reset_t)`` (formed as the scan forms
  its gate) the element-wise transition, and the outputs are corrected from the true initial
  state in closed form, ``y_t += prod_{s<=t} a_s (1 - reset_s) * h_0``. A reset is part of the
  transition (it zeroes it), so resets anywhere are exact; on shards they come from
  ``position_ids == 0``, which the model check allows at a sequence start only (dense batches).

The block's forward runs on the shard as written; the adapter only routes ``conv_1d``'s forward
and ``rg_lru._rnn_scan`` through those calls while the adapted forward runs (other calls of those
children are untouched).

Caches (``use_cache=True``: the conv and recurrent states the block keeps on itself) and packed
batches are refused from the call's arguments, which every CP rank passes alike, so every rank
raises the same error before any collective. Read against transformers 5.23's modeling file; a
block of another shape is refused when the adapter is installed.

xLSTM's mLSTM backend is a per-head recurrence with its own Note below (Note [mLSTM on shards]).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...comm import exchange_ints
from ...mixing import HeadShard, Recurrence, Summary, causal_conv1d_halo, head_parallel, state_passing
from ...state import ParallelState
from . import CHOOSER, register_adapter
from .gated_delta import refuse_call, summary_dtype
from .modes import HEAD_PARALLEL, STATE_PASSING, ModeChooser, pieces_per_rank
from .rebind import checked_forward, refuse_adapting, set_forward

__all__: list[str] = []

_BLOCK = "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock"
_PARAMETERS = ("self", "input_states", "position_ids", "attention_mask", "use_cache")


def _check(module: nn.Module) -> None:
    cls = type(module)
    checked_forward(cls, _PARAMETERS, ("conv_1d", "rg_lru"))
    conv, lru = getattr(module, "conv_1d", None), getattr(module, "rg_lru", None)
    if (
        not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels or conv.out_channels != conv.in_channels
        or conv.stride != (1,) or conv.dilation != (1,) or conv.padding != (conv.kernel_size[0] - 1,)
        or conv.padding_mode != "zeros"
    ):
        raise refuse_adapting(cls, f"its conv_1d is {conv!r}, not a depthwise causal Conv1d")
    scan = inspect.getattr_static(type(lru), "_rnn_scan", None) if lru is not None else None
    if not isinstance(scan, types.FunctionType) or "_rnn_scan" in vars(lru):
        raise refuse_adapting(cls, "its rg_lru has no _rnn_scan method (or it was replaced)")
    want = ["self", "hidden_states", "recurrent_gate", "reset", "recurrent_states"]
    if list(inspect.signature(scan).parameters)[:5] != want:
        raise refuse_adapting(cls, "its rg_lru._rnn_scan takes other arguments")


class _ModelRGLRU(Recurrence):
    """The RG-LRU scan for :func:`~seqpar.mixing.state_passing`, each piece by the module's own
    ``_rnn_scan`` from a zero state (its accumulation dtype included), so that a piece is computed
    as the model computes it.

    Inputs ``x [B, n, W]`` (the normalised, gated input), ``a [B, n, W]`` (the recurrent gate) and
    ``reset [B, n, 1]`` (1 where a document starts, in ``x``'s dtype), as the forward passes them
    to the scan. State ``[W]`` (the scan's final state); transition ``[W]``, ``prod_t a_t (1 -
    reset_t)``; correction from the true initial state ``h_0``: ``y_t += prod_{s<=t} a_s (1 -
    reset_s) h_0`` (no second scan).
    """

    num_inputs = 3
    input_names = ("x", "a", "reset")

    def __init__(self, scan: Callable[..., Any], lru: nn.Module, options: dict[str, Any]) -> None:
        self.scan, self.lru, self.options = scan, lru, options

    def heads(self, inputs):
        return inputs[0].shape[2]

    def state_shape(self, inputs):
        return (inputs[0].shape[2],)

    transition_shape = state_shape

    def kernel(self, inputs, initial_state):
        x, a, reset = inputs
        if x.shape[1] == 0:  # a rank without tokens: the scan reads a first token
            h = x.new_zeros(x.shape[0], x.shape[2], dtype=summary_dtype(x))
            return (x.new_zeros(x.shape),), h if initial_state is None else initial_state
        y, h = self.scan(self.lru, x, a, reset != 0, initial_state, **self.options)
        return (y,), h

    def apply(self, transition, state):
        return transition * state

    def summarize(self, inputs):
        (y,), final = self.kernel(inputs, None)
        x, a, reset = inputs
        # The scan's gate: a zeroed at resets (in a's dtype), then taken to its accumulation dtype.
        decay = (a * (reset == 0)).to(summary_dtype(*inputs)).cumprod(1)  # [B, n, W], since the piece start
        return Summary((y,), final, decay[:, -1], aux=decay)

    def correct(self, inputs, summary, initial_state):
        decay, y = summary.aux, summary.outputs[0]
        return ((y + decay * initial_state.to(decay.dtype)[:, None]).to(y.dtype),)


class _Mixing:
    """The conv and scan one block instance runs with on ``state``'s shards, while ``active``,
    in the mode its :class:`~.modes.ModeChooser` picked for the call."""

    def __init__(self, module: nn.Module, state: ParallelState, mixing: str) -> None:
        self.block = module
        self.state = state
        self.chooser = ModeChooser(state, mixing)
        self.active = False  # within the adapted forward only
        self.mode, self.seq_len = HEAD_PARALLEL, None  # of the running call
        self.conv_forward = type(module.conv_1d).forward
        self.scan = inspect.getattr_static(type(module.rg_lru), "_rnn_scan")

    def pick(self, x: Tensor) -> None:
        """The mode of this call (Note [Choosing the mixing mode]), from the block's input ``x``
        ``[B, S_local, hidden]``. Bytes each rank receives: head-parallel, the conv's x in and out,
        the scan's x and gate in (``W`` channels each) and its output back, and the reset flags
        (one head, to every rank); state passing, per piece the conv's ``K - 1`` token halo and
        the scan's summary (``b``, ``P``: ``[W]`` each)."""
        batch, local = x.shape[:2]
        n, e = self.state.cp_size, x.element_size()
        width, K = self.block.lru_width, self.block.conv_1d.kernel_size[0]
        per_token = batch * e * (5 * width + n)
        f = torch.empty(0, dtype=summary_dtype(x)).element_size()
        sp_bytes = (n - 1) * pieces_per_rank(self.state) * batch * ((K - 1) * width * e + 2 * width * f)
        self.mode, self.seq_len = self.chooser.pick(local, width, per_token, sp_bytes, x.device)

    def conv(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        """``conv_1d``'s forward: ``x`` ``[B, C, S_local]`` to ``[B, C, S_local]`` (the block cuts
        the output to ``S_local`` tokens, which it already is)."""
        if not self.active:
            return self.conv_forward(conv, x)
        if self.mode == STATE_PASSING:
            y = causal_conv1d_halo(x.transpose(1, 2), conv.weight, conv.bias, self.state, seq_len=self.seq_len)
            return y.transpose(1, 2)

        def mix(shard: HeadShard, xs: Tensor) -> Tensor:  # [B, S, c], whole sequences
            weight = shard.narrow(conv.weight)
            bias = None if conv.bias is None else shard.narrow(conv.bias)
            y = F.conv1d(xs.transpose(1, 2), weight, bias, padding=conv.padding, groups=weight.shape[0])
            return y[..., : xs.shape[1]].transpose(1, 2)

        return head_parallel(mix, [x.transpose(1, 2)], self.state, seq_len=self.seq_len).transpose(1, 2)

    def rnn_scan(self, hidden_states: Tensor, recurrent_gate: Tensor, reset: Tensor,
                 recurrent_states: Tensor | None, **kwargs: Any) -> tuple[Tensor, None]:
        """``rg_lru._rnn_scan`` on shards: ``[B, S_local, W]`` inputs, ``reset`` ``[B, S_local, 1]``."""
        lru = self.block.rg_lru
        if not self.active:
            return self.scan(lru, hidden_states, recurrent_gate, reset, recurrent_states, **kwargs)
        if recurrent_states is not None:
            raise NotImplementedError(
                f"seqpar: {type(self.block).__name__} on sequence shards takes no recurrent state (decoding "
                "with a cache is not supported on shards yet); call the model with use_cache=False"
            )
        # Per row (position ids may have one row for all), in x's dtype: a one-head tensor.
        flags = reset.to(hidden_states.dtype).expand(hidden_states.shape[0], -1, -1)
        if self.mode == STATE_PASSING:
            rec = _ModelRGLRU(self.scan, lru, kwargs)
            (out,), _ = state_passing(rec, [hidden_states, recurrent_gate, flags], self.state, seq_len=self.seq_len)
            return out, None
        scan = self.scan

        def mix(shard: HeadShard, x: Tensor, a: Tensor, r: Tensor) -> Tensor:
            out, _ = scan(lru, x, a, r != 0, None, **kwargs)
            return out

        # The flags are one "head": every rank receives them all.
        out = head_parallel(mix, [hidden_states, recurrent_gate, flags], self.state, heads=hidden_states.shape[-1],
                            seq_len=self.seq_len)
        return out, None


def _install(module: nn.Module, state: ParallelState, mixing: str) -> None:
    if state.cp_size == 1:  # nothing is sharded: the module runs as it is
        return
    _check(module)
    mixer = _Mixing(module, state, mixing)
    object.__setattr__(module.conv_1d, "forward", types.MethodType(mixer.conv, module.conv_1d))
    object.__setattr__(module.rg_lru, "_rnn_scan", mixer.rnn_scan)
    cls_forward = type(module).forward
    signature = inspect.signature(cls_forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(self, *args, **kwargs).arguments
        use_cache = call.get("use_cache", signature.parameters["use_cache"].default)
        if use_cache:
            raise NotImplementedError(
                f"seqpar: {type(self).__name__} on sequence shards does not support a cache (use_cache=True): "
                "the conv and recurrent states it keeps would cover this rank's tokens only. Decoding and "
                "generate with a cache are not supported for hybrid models on shards yet; call the model "
                "with use_cache=False, or generate with cp_size 1"
            )
        refuse_call(self, None, "use_cache", {**call.get("kwargs", {})})
        mixer.pick(call["input_states"])  # every rank alike: the refusals above are the same on every rank
        mixer.active = True
        try:
            return cls_forward(self, *args, **kwargs)
        finally:
            mixer.active = False

    set_forward(module, forward)
    object.__setattr__(module, CHOOSER, mixer.chooser)


register_adapter(_BLOCK, modes=(HEAD_PARALLEL, STATE_PASSING))(_install)


# --- xLSTM (mLSTM) --------------------------------------------------------------------------------

_MLSTM = "transformers.models.xlstm.modeling_xlstm.xLSTMBackend"  # the native backend (no xlstm package)
_MLSTM_PARAMETERS = ("self", "query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial",
                     "return_last_states", "mode")


def _install_mlstm(module: nn.Module, state: ParallelState) -> None:
    """Note [mLSTM on shards]: xLSTM's backend gets q, k ``[B, nh, S, Dqk]``, v ``[B, nh, S, Dv]``
    and the input / forget gate pre-activations ``[B, nh, S]``, and runs the mLSTM recurrence per
    head (chunkwise from the sequence start, the remainder step by step). The adapter runs the
    backend's own forward on whole sequences of ``nh / cp_size`` heads (Note [Head-parallel
    mixing]); the projections, gates' soft caps, the multi-head norm and output gate stay on the
    shard. Initial states (a cache, or xLSTMModel's chunked inference path, taken in eval mode when
    the shard is longer than ``config.max_inference_chunksize``) are refused; since that path
    depends on each rank's shard length, the ranks first exchange one flag so that all of them raise
    together. The final states are not returned (``None``)."""
    if state.cp_size == 1:  # nothing is sharded: the module runs as it is
        return
    cls = type(module)
    cls_forward = inspect.getattr_static(cls, "forward")
    got = list(inspect.signature(cls_forward).parameters) if isinstance(cls_forward, types.FunctionType) else []
    if got != list(_MLSTM_PARAMETERS) or not hasattr(module, "config"):
        raise refuse_adapting(cls, f"its forward takes {got}, not {list(_MLSTM_PARAMETERS)}")
    signature = inspect.signature(cls_forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        query = a["query"]
        carried = any(a[k] is not None for k in ("c_initial", "n_initial", "m_initial"))
        flags = exchange_ints([int(carried)], state.cp_group, query.device)
        if any(row[0] for row in flags):
            raise NotImplementedError(
                f"seqpar: {cls.__name__} on sequence shards takes no initial states (cp rank "
                f"{next(c for c, row in enumerate(flags) if row[0])} was given some): decoding with a cache and "
                "xLSTMModel's chunked inference (a shard longer than config.max_inference_chunksize in eval "
                "mode) are not supported on shards; call the model with use_cache=False and raise "
                "config.max_inference_chunksize, or run with cp_size 1"
            )
        mode = a["mode"] or self.config.mode
        last = a["return_last_states"]
        tupled = "train" not in mode or (self.config.return_last_states if last is None else last)

        def mix(shard: HeadShard, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor) -> Tensor:
            out = cls_forward(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), i.transpose(1, 2),
                              f.transpose(1, 2), None, None, None, last, mode)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        tensors = [a["query"], a["key"], a["value"], a["igate"], a["fgate"]]
        h = head_parallel(mix, [t.transpose(1, 2) for t in tensors], state).transpose(1, 2)
        return (h, None) if tupled else h

    set_forward(module, forward)


register_adapter(_MLSTM)(_install_mlstm)
