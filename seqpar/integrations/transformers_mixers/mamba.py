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

In state-passing mode (Note [Choosing the mixing mode]; ``install(..., mixing=)``) each rank keeps
its own tokens instead: the conv by its ``K - 1`` token halo (:func:`~seqpar.mixing.causal_conv1d_halo`,
the activation after it), the scan by :func:`~seqpar.mixing.state_passing` with each piece run by
the module's own scan kernel from a zero state (:class:`_ModelSSD`, :class:`_ModelSelectiveScan`:
the kernels' final states are the summaries' ``b``, the decays ``exp(A sum delta)``, formed as the
kernels form ``delta``, the transitions, and the outputs are corrected from the true initial state
in closed form, so no kernel is asked for an initial state, which mamba-ssm's selective scan does
not take). One decision per layer call, for the conv and the scan alike.

Inside each head-parallel call the module's own kernels run on whole sequences of the rank's heads, looked up
in its modeling module at call time (``causal_conv1d_fn``, ``mamba2_chunk_scan``,
``mamba_selective_scan``): the torch fallbacks, or ``causal-conv1d`` / ``mamba-ssm`` where
installed. The fused training kernels (``mamba2_split_conv1d_scan_combined``,
``mamba_inner_fn``) are never called: they would scan the shard alone.

The adapter replaces the instance's ``forward`` with one that reproduces the 5.23 forward with
the mixing routed as above, taking the arguments the class's forward takes (its cache under the
name of the installed release). The installer checks the class's ``forward`` (signature and the
names its code uses) against what was read; a transformers version whose forward differs is
refused, on every rank alike, rather than run with a stale copy.

Packed batches (transformers' flattened rows; Note [Packed sequences in transformers models]) run
in the Mamba2 mixers of the models with softmax attention, whose model check has validated the
global ``cu_seq_lens_q`` (and ``seq_idx``) against the ``shard_packed`` shards: ``seq_lens`` are its
differences, and each sequence's conv and scan start from zero history and state (head-parallel:
the module's kernels on every ``shard.cu_seqlens`` segment alone; state passing: the halo and the
states stop at every sequence start). ``seq_idx`` and the boundaries describe the shard's tokens,
so they never reach a kernel. With one rank the adapter is installed for packed calls only (dense
calls run the class's forward): transformers' torch fallbacks ignore the boundaries. Jamba's
decoder layers do not hand the kwargs to their Mamba1 mixer (the model check names it), and Mamba2
itself has no attention and so no model check: both refuse packed batches.

Not supported on shards, refused with the same error on every rank (one exchange of ints when
the CP ranks check collectively, ``ParallelState.checks``): a cache (``cache_params`` /
``past_key_values``, ``cache`` from 5.24: decoding, or prefill into a cache, which would need the
states at the shard ends), packed-batch kwargs other than the above (without ``cu_seq_lens_q``, or
with a padding mask), and a 2-D padding mask that is not this rank's ``[B, S_local]`` shard. A
mask of the shard's shape is applied as the reference does (token-wise, before the projection and
after the conv; in Mamba2 layers it travels with ``dt``, ones where a rank has none, since
transformers hands a rank without padding None).

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
from ...mixing import HeadShard, Recurrence, Summary, causal_conv1d_halo, head_parallel, state_passing
from ...prepare import collective_checks
from ...state import ParallelState
from . import CHOOSER, register_adapter
from .gated_delta import mark_packed, summary_dtype
from .modes import HEAD_PARALLEL, STATE_PASSING, ModeChooser, pieces_per_rank
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

# refusal codes exchanged between the CP ranks: a cache, packed kwargs this mixer does not run,
# packed kwargs without cu_seq_lens_q, a mask that is not the shard's, a padding mask next to
# packing, a packed batch of more than one row
_CACHE, _PACKED, _PACKED_PARTIAL, _MASK, _PACKED_MASK, _PACKED_ROWS = 1, 2, 3, 4, 5, 6


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
    kwargs: dict[str, Any], runs_packed: bool = False,
) -> tuple[int, ...] | None:
    """Raise the same error on every CP rank if any rank's call cannot run exactly on shards.
    Returns a packed call's global sequence lengths (``runs_packed``: the mixer runs packed
    batches; the model check validated ``cu_seq_lens_q`` and the shards against each other),
    else ``None``."""
    row = _mask_row(mask, *hidden.shape[:2])
    seq_lens = None
    given = [k for k in _PACKED_KWARGS if kwargs.get(k) is not None]
    if cache is not None:
        row = [_CACHE, 0, 0]
    elif given and not runs_packed:
        row = [_PACKED, 0, 0]
    elif given and (kwargs.get("cu_seq_lens_q") is None or kwargs.get("cu_seqlens") is not None):
        row = [_PACKED_PARTIAL, 0, 0]
    elif given and mask is not None:
        row = [_PACKED_MASK, 0, 0]
    elif given and hidden.shape[0] != 1:
        row = [_PACKED_ROWS, hidden.shape[0], 0]
    elif given:
        cu = kwargs["cu_seq_lens_q"]
        bounds = [int(b) for b in (cu.tolist() if isinstance(cu, Tensor) else cu)]
        seq_lens = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    _raise_together(module, state, hidden.device, row)
    return seq_lens


def _arguments(
    module: nn.Module, state: ParallelState, signature: inspect.Signature, args: tuple, kwargs: dict[str, Any],
    runs_packed: bool = False,
) -> tuple[Tensor, Tensor | None, tuple[int, ...] | None]:
    """``(hidden_states, attention_mask, seq_lens)`` of a call bound as the class's forward takes it
    (its cache under either name, Note [Renamed cache parameter]), after refusing together what
    does not run; ``seq_lens``: a packed call's global sequence lengths (``runs_packed`` only)."""
    call = signature.bind(module, *args, **kwargs).arguments
    hidden, mask = call["hidden_states"], call.get("attention_mask")
    seq_lens = _refuse_together(
        module, state, hidden, call_cache(call, _CACHE_PARAMETER)[0], mask, call.get("kwargs", {}), runs_packed)
    return hidden, mask, seq_lens


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
            f"{where} was called with packed-batch kwargs ({', '.join(_PACKED_KWARGS)}); this Mamba mixer runs "
            "dense batches on shards (packed batches run for the Mamba2 mixers of models with attention: "
            "Bamba, Granite 4, Nemotron-H, Zamba2, Falcon-H1): pass one sequence per row"
        )
    if code == _PACKED_PARTIAL:
        raise NotImplementedError(
            f"{where} runs packed batches given by the global cu_seq_lens_q (transformers' "
            "DataCollatorWithFlattening), not by seq_idx or cu_seqlens alone; pass cu_seq_lens_q / cu_seq_lens_k "
            "of the whole batch with input_ids and position_ids sharded by seqpar.shard_packed"
        )
    if code == _PACKED_MASK:
        raise NotImplementedError(
            f"{where} got a padding attention_mask together with packed sequences (cu_seq_lens_q); a packed "
            "batch has no padding: drop the mask (the boundaries keep the sequences apart)"
        )
    if code == _PACKED_ROWS:
        raise ValueError(
            f"{where} got a packed batch of {got} rows; a packed batch is one row [1, T_local] "
            "(transformers' DataCollatorWithFlattening)"
        )
    raise ValueError(
        f"{where} got a 2-D attention_mask of {got} tokens for a shard of {local}; pass this rank's shard "
        "of the mask ([B, S_local], e.g. seqpar.shard(mask, state)), or none"
    )


# --- Mamba2 (SSD) -------------------------------------------------------------------------------

_MAMBA2_KERNELS = ("causal_conv1d_fn", "mamba2_chunk_scan", "apply_mask_to_padding_states")


class _ModelSSD(Recurrence):
    """Mamba2's SSD scan for :func:`~seqpar.mixing.state_passing`, each piece by the modeling
    file's own ``mamba2_chunk_scan`` (the torch fallback, or mamba-ssm's chunked kernel), so that a
    piece is computed as the model computes it: its ``D`` skip, ``dt_bias``, softplus and
    ``time_step_limit`` included.

    Inputs ``x [B, n, H, P]``, ``B, C [B, n, G, N]``, raw ``dt [B, n, H]``, as the forward passes
    them to the kernel. State ``[H, P, N]`` (the kernel's final state); transition ``[H]``, the
    piece's decay ``exp(A sum_t delta_t)`` with ``delta = clamp(softplus(dt + dt_bias))`` as the
    kernel forms it. Correction from the true initial state ``h_0``: ``y_t += exp(A sum_{s<=t}
    delta_s) C_t . h_0``, the scan's term of its initial state (no second scan).
    """

    num_inputs = 4
    input_names = ("x", "B", "C", "dt")

    def __init__(self, scan: Callable[..., Any], A: Tensor, D: Tensor | None, dt_bias: Tensor | None,
                 chunk_size: int, dt_limit: tuple[float, float]) -> None:
        self.scan, self.A, self.D, self.dt_bias = scan, A, D, dt_bias
        self.chunk_size, self.dt_limit = chunk_size, dt_limit

    def heads(self, inputs):
        return inputs[0].shape[2]

    def parameters(self):
        return [p for p in (self.A, self.D, self.dt_bias) if p is not None]

    def state_shape(self, inputs):
        return (inputs[0].shape[2], inputs[0].shape[3], inputs[1].shape[3])

    def transition_shape(self, inputs):
        return (inputs[0].shape[2],)

    def kernel(self, inputs, initial_state):
        x, b, c, dt = inputs
        if x.shape[1] == 0:  # a rank without tokens: nothing to scan (the kernel needs a chunk)
            dtype = summary_dtype(x)
            h = initial_state if initial_state is not None else x.new_zeros(
                x.shape[0], *self.state_shape(inputs), dtype=dtype)
            return (x.new_zeros(x.shape, dtype=dtype),), h
        y, final = self.scan(
            x, dt, self.A, b, c, chunk_size=self.chunk_size, D=self.D, z=None, return_final_states=True,
            dt_bias=self.dt_bias, dt_softplus=True, initial_states=initial_state, dt_limit=self.dt_limit,
        )
        return (y,), final

    def apply(self, transition, state):
        return transition[..., None, None] * state

    def summarize(self, inputs):
        (y,), final = self.kernel(inputs, None)
        dt = inputs[3]
        if self.dt_bias is not None:  # the kernel's steps: bias and softplus in dt's dtype, then clamp
            dt = dt + self.dt_bias.to(dt.dtype)
        delta = F.softplus(dt).clamp(self.dt_limit[0], self.dt_limit[1])
        dtype = summary_dtype(*inputs)
        gam = (self.A.to(dtype) * delta.to(dtype)).cumsum(1)  # [B, n, H], log decay since the piece start
        return Summary((y,), final, gam[:, -1].exp(), aux=gam)

    def correct(self, inputs, summary, initial_state):
        gam, y = summary.aux, summary.outputs[0]
        heads, c = inputs[0].shape[2], inputs[2]
        c = c.to(gam.dtype).repeat_interleave(heads // c.shape[2], 2)  # group j read by heads j*H/G ..
        fix = gam.exp()[..., None] * torch.einsum("bnhs,bhps->bnhp", c, initial_state.to(gam.dtype))
        return ((y + fix).to(y.dtype),)


def _ranks_per_group(heads: int, groups: int, ranks: int) -> int:
    """About how many ranks read each of ``groups`` grouped heads when ``heads`` are split over
    ``ranks`` (head_parallel sends a grouped head to every rank holding one of its heads)."""
    return max(1, -(-ranks // groups))


def _mamba2_mixing(
    self: nn.Module, modeling: types.ModuleType, state: ParallelState, projected: Tensor, mask: Tensor | None,
    chooser: ModeChooser, seq_lens: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(scan output [B, S_local, I], gate)`` from the shard's projections: conv and scan of whole
    sequences of this rank's heads (one head_parallel call), or of this rank's own tokens by the
    conv's halo and state passing (the mode ``chooser`` picks). ``seq_lens``: a packed call's global
    sequence lengths (one row ``[1, T_local]`` in ``shard_packed``'s placement, no mask): every
    sequence's conv and scan start from zero history and state."""
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

    # Bytes each rank receives per call (Note [Choosing the mixing mode]). Head-parallel: x, B, C
    # (each group to every rank reading it), dt and the mask in, the scan output (the torch
    # fallback's float32; a fused kernel returns x's dtype) back. State passing: per piece the
    # summary (b [H, P, N], P [H]) and the conv's K - 1 token halo.
    readers = _ranks_per_group(H, G, state.cp_size)
    out_size = torch.empty(0, dtype=summary_dtype(xbc)).element_size()
    per_token = B_ * (
        (I + 2 * G * N * readers) * xbc.element_size() + H * dt.element_size() + state.cp_size * dt.element_size()
        + I * out_size
    )
    summary = H * (P * N + 1) * out_size
    halo = (K - 1) * self.conv_dim * xbc.element_size()
    sp_bytes = (state.cp_size - 1) * pieces_per_rank(state) * B_ * (summary + halo)
    mode, seq_len = chooser.pick(S_local, H, per_token, sp_bytes, projected.device)
    if mode == STATE_PASSING:
        # The conv by its halo (activation after it: token-wise), the mask after the conv as the
        # forward applies it, then the scan by state passing: every rank its own tokens.
        from transformers.activations import ACT2FN

        if seq_lens is not None:  # packed: [T_local, ...], no halo or state crosses a sequence start
            xbc, dt, seq_len = xbc[0], dt[0], None
        conv_out = causal_conv1d_halo(xbc, weight, bias, state, seq_len=seq_len, seq_lens=seq_lens)
        if self.activation is not None:
            conv_out = ACT2FN[self.activation](conv_out)
        conv_out = modeling.apply_mask_to_padding_states(conv_out, mask)
        xs, bs, cs = conv_out.split([I, G * N, G * N], dim=-1)
        scan = _ModelSSD(modeling.mamba2_chunk_scan, A, self.D, self.dt_bias, self.chunk_size, self.time_step_limit)
        tokens = xs.shape[:-1]  # (B, S_local), packed (T_local,)
        (y,), _ = state_passing(
            scan, [xs.view(*tokens, H, P), bs.view(*tokens, G, N), cs.view(*tokens, G, N), dt], state,
            seq_len=seq_len, seq_lens=seq_lens,
        )
        return y.reshape(B_, S_local, I), gate

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

    def mix(shard: HeadShard, xs: Tensor, bs: Tensor, cs: Tensor, dts: Tensor, keep: Tensor | None) -> Tensor:
        # xs [B, S, h, P], bs/cs [B, S, g, N], dts [B, S, h], keep [B, S, 1] or None (packed):
        # whole sequences, in order.
        h, g = xs.shape[2], bs.shape[2]
        conv_in = torch.cat([xs.flatten(2), bs.flatten(2), cs.flatten(2)], dim=-1)
        conv_out = modeling.causal_conv1d_fn(
            conv_in.transpose(1, 2), narrow3(weight, shard, K), narrow3(bias, shard, None), activation=self.activation,
        ).transpose(1, 2)
        # The padding mask, applied after the conv as the reference does (ones: a no-op, exactly).
        conv_out = modeling.apply_mask_to_padding_states(conv_out, None if keep is None else keep[:, :, 0])
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

    tensors = [x.view(B_, S_local, H, P), b.view(B_, S_local, G, N), c.view(B_, S_local, G, N), dt]
    if seq_lens is not None:

        def mix_packed(shard: HeadShard, xs: Tensor, bs: Tensor, cs: Tensor, dts: Tensor) -> Tensor:
            # [T, h, ...]: the conv and the scan of every sequence on its own, from zero history
            # and state, as one device runs each sequence (the torch fallbacks take no boundaries).
            bounds = shard.cu_seqlens.tolist()
            outs = [
                mix(shard, *(t[None, a:b] for t in (xs, bs, cs, dts)), None)[0]
                for a, b in zip(bounds, bounds[1:]) if b > a
            ]
            return torch.cat(outs) if outs else xs.new_zeros(xs.shape, dtype=summary_dtype(xs))

        y = head_parallel(mix_packed, [t[0] for t in tensors], state, heads=H, seq_lens=seq_lens)
        return y.reshape(B_, S_local, I), gate
    # The mask travels always, as one grouped head of dt's dtype (in dt's all-to-all): transformers
    # gives a rank whose shard has no padding None (create_recurrent_attention_mask), another one
    # a tensor, and every rank must pass the same tensors.
    keep = dt.new_ones(B_, S_local, 1) if mask is None else mask[:, :, None].to(dt.dtype)
    y = head_parallel(mix, [*tensors, keep], state, heads=H, seq_len=seq_len)
    return y.reshape(B_, S_local, I), gate


def _install_mamba2(
    module: nn.Module, state: ParallelState, names: frozenset[str], falcon: bool, mixing: str, packed: bool,
) -> None:
    modeling = _check_forward(module, names, _MAMBA2_KERNELS)
    if module.num_heads % module.n_groups:
        raise NotImplementedError(
            f"seqpar: {type(module).__name__} has {module.num_heads} heads in {module.n_groups} groups; "
            "the groups must divide the heads"
        )

    signature = inspect.signature(type(module).forward)
    chooser = ModeChooser(state, mixing)
    one_rank = state.cp_size == 1  # adapted for packed calls only (see _mamba2_installer)

    @_accelerate_hooks(["conv1d"])
    def forward(self, *args, **kwargs):
        if one_rank and signature.bind(self, *args, **kwargs).arguments.get("kwargs", {}).get("cu_seq_lens_q") is None:
            return type(self).forward(self, *args, **kwargs)  # a dense call on one rank: as it is
        hidden_states, attention_mask, seq_lens = _arguments(self, state, signature, args, kwargs, packed)
        dtype = hidden_states.dtype
        hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
        if falcon:
            hidden_states = hidden_states * self.ssm_in_multiplier
        projected = self.in_proj(hidden_states)
        if falcon:
            projected = projected * self.mup_vector
        y, gate = _mamba2_mixing(self, modeling, state, projected, attention_mask, chooser, seq_lens)
        if not falcon or self.mamba_rms_norm:
            y = self.norm(y, gate)
        else:
            y = y * F.silu(gate)
        return self.out_proj(y.to(dtype))

    object.__setattr__(module, "forward", types.MethodType(forward, module))
    if packed:
        mark_packed(module, state)
    if one_rank:
        vars(module).pop(CHOOSER, None)  # mixing_modes reports calls on shards only
    else:
        object.__setattr__(module, CHOOSER, chooser)


# Per Mamba2 mixer class: (Falcon-H1's variant, runs packed batches). Packed batches run where the
# model hands transformers' packed kwargs to the mixer and has softmax attention, whose model check
# validates the global cu_seq_lens_q against the shards (Note [Packed sequences in transformers
# models]); Mamba2 itself (no attention) has no such check and keeps refusing them.
_MAMBA2_CLASSES = {
    "transformers.models.mamba2.modeling_mamba2.Mamba2Mixer": (False, False),
    "transformers.models.bamba.modeling_bamba.BambaMixer": (False, True),
    "transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer": (False, True),
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer": (False, True),
    "transformers.models.zamba2.modeling_zamba2.Zamba2MambaMixer": (False, True),
    "transformers.models.falcon_h1.modeling_falcon_h1.FalconH1Mixer": (True, True),
}


def _mamba2_installer(falcon: bool, packed: bool) -> Callable[[nn.Module, ParallelState, str], None]:
    def installer(module: nn.Module, state: ParallelState, mixing: str) -> None:
        names = _FALCON_H1_NAMES if falcon else _MAMBA2_NAMES
        if state.cp_size > 1:
            _install_mamba2(module, state, names, falcon, mixing, packed)
        elif packed:
            # One rank: the module runs as it is, except for packed calls: transformers' torch
            # fallbacks ignore the boundaries (a sequence would read the previous one's conv history
            # and scan state), so those run through the adapter, per sequence. A forward of another
            # transformers version stays unadapted there: the model check then refuses packed calls.
            try:
                _install_mamba2(module, state, names, falcon, mixing, packed)
            except NotImplementedError:
                return

    return installer


for _qualname, (_falcon, _packed) in _MAMBA2_CLASSES.items():
    register_adapter(_qualname, modes=(HEAD_PARALLEL, STATE_PASSING))(_mamba2_installer(_falcon, _packed))


_MASK_HOOK = "_seqpar_mask_hook"  # attribute of an adapted Mamba2Model: its pre-hook's handle


@register_adapter("transformers.models.mamba2.modeling_mamba2.Mamba2Model", modes=None)
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


@register_adapter("transformers.models.zamba2.modeling_zamba2.Zamba2MambaDecoderLayer", modes=None)
def _zamba2_mamba_layer(module: nn.Module, state: ParallelState) -> None:
    """Zamba2's "hybrid" layers hold their Mamba layer one level down (``mamba_decoder``), and the
    model check names that layer, not its mixer. It is an RMSNorm, the mixer (adapted by its own
    entry above, installed right after this one) and a residual: exact once the mixer is, packed
    batches included (it hands the packed kwargs on to the mixer)."""
    children = {name: type(m).__name__ for name, m in module.named_children()}
    if children != {"mamba": "Zamba2MambaMixer", "input_layernorm": "Zamba2RMSNorm"}:
        raise NotImplementedError(
            f"seqpar: Zamba2MambaDecoderLayer has the children {children}, not the RMSNorm and Mamba "
            f"mixer read in transformers {READ_AGAINST}; run the model with cp_size 1"
        )
    try:  # packed batches run where the mixer's adapter runs them (one rank: only if it installs)
        _check_forward(module.mamba, _MAMBA2_NAMES, _MAMBA2_KERNELS)
    except NotImplementedError:
        return
    mark_packed(module, state)


# --- Mamba1 (selective scan) ----------------------------------------------------------------------


class _ModelSelectiveScan(Recurrence):
    """Mamba1's selective scan for :func:`~seqpar.mixing.state_passing`, each piece by the modeling
    file's own ``mamba_selective_scan`` from a zero state (the torch fallback or mamba-ssm's
    ``selective_scan_fn``: neither takes an initial state, so none is asked of it).

    Inputs ``x, dt [B, n, I]`` (``dt`` raw: the kernel adds ``delta_bias`` and applies softplus),
    ``B, C [B, n, 1, N]`` (one group read by every channel). State ``[I, N]`` (the kernel's last
    state); transition ``[I, N]``, element-wise ``exp(A sum_t delta_t)``; correction from the true
    initial state ``h_0``: ``y_t += sum_N C_t exp(A sum_{s<=t} delta_s) h_0``.
    """

    num_inputs = 4
    input_names = ("x", "dt", "B", "C")

    def __init__(self, scan: Callable[..., Any], A: Tensor, D: Tensor | None, delta_bias: Tensor | None,
                 options: dict[str, Any]) -> None:
        self.scan, self.A, self.D, self.delta_bias, self.options = scan, A, D, delta_bias, options

    def heads(self, inputs):
        return inputs[0].shape[2]

    def parameters(self):
        return [p for p in (self.A, self.D, self.delta_bias) if p is not None]

    def state_shape(self, inputs):
        return (inputs[0].shape[2], self.A.shape[-1])

    transition_shape = state_shape

    def kernel(self, inputs, initial_state):
        x, dt, b, c = inputs
        if x.shape[1] == 0:  # a rank without tokens: nothing to scan
            h = x.new_zeros(x.shape[0], *self.state_shape(inputs), dtype=summary_dtype(x))
            return (x.new_zeros(x.shape),), h if initial_state is None else initial_state
        if initial_state is not None:  # the kernel starts from zeros: correct its outputs
            summary = self.summarize(inputs)
            final = self.apply(summary.transition, initial_state) + summary.final
            return self.correct(inputs, summary, initial_state), final
        y, last = self.scan(
            x.transpose(1, 2), dt.transpose(1, 2), self.A, b[:, :, 0].transpose(1, 2), c[:, :, 0].transpose(1, 2),
            D=self.D, z=None, delta_bias=self.delta_bias, delta_softplus=True, return_last_state=True, **self.options,
        )
        return (y.transpose(1, 2),), last

    def apply(self, transition, state):
        return transition * state

    def summarize(self, inputs):
        (y,), final = self.kernel(inputs, None)
        dt = inputs[1]
        if self.delta_bias is not None:  # the kernel's steps: bias and softplus in dt's dtype
            dt = dt + self.delta_bias.to(dt.dtype)
        dtype = summary_dtype(*inputs)
        cum = F.softplus(dt).to(dtype).cumsum(1)[..., None] * self.A.to(dtype)  # [B, n, I, N]
        return Summary((y,), final, cum[:, -1].exp(), aux=cum)

    def correct(self, inputs, summary, initial_state):
        cum, y = summary.aux, summary.outputs[0]
        fix = (inputs[3].to(cum.dtype) * cum.exp() * initial_state.to(cum.dtype)[:, None]).sum(-1)
        return ((y + fix).to(y.dtype),)


def _install_mamba1(module: nn.Module, state: ParallelState, names: frozenset[str], jamba: bool, mixing: str) -> None:
    kernels = ("causal_conv1d_fn", "mamba_selective_scan", "apply_mask_to_padding_states")
    modeling = _check_forward(module, names, kernels)
    chooser = ModeChooser(state, mixing)

    def pick(xs: Tensor) -> tuple[str, int | None]:
        """The mode of this call, for both the conv and the scan (Note [Choosing the mixing mode]).
        Head-parallel: the conv's ``x`` in and out, the scan's ``x``, ``dt`` in (``B``, ``C``: one
        group, to every rank) and its output back. State passing: per piece the conv's ``K - 1``
        token halo and the scan's summary (``b``, ``P``: ``[I, N]`` each)."""
        batch, local, inner = xs.shape
        n, e = state.cp_size, xs.element_size()
        N, K = module.ssm_state_size, module.conv1d.weight.shape[-1]
        per_token = batch * e * (5 * inner + 2 * N * n)
        f = torch.empty(0, dtype=summary_dtype(xs)).element_size()
        sp_bytes = (n - 1) * pieces_per_rank(state) * batch * ((K - 1) * inner * e + 2 * inner * N * f)
        return chooser.pick(local, inner, per_token, sp_bytes, xs.device)

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
        hidden_states, attention_mask, _ = _arguments(self, state, signature, args, kwargs)
        dtype = hidden_states.dtype
        hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
        xs, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # [B, S_local, I] each
        A = -torch.exp(self.A_log.float())
        mode, seq_len = pick(xs)
        if mode == STATE_PASSING:  # the conv by its halo (activation after it: token-wise)
            from transformers.activations import ACT2FN

            xs = causal_conv1d_halo(xs, self.conv1d.weight.squeeze(1), self.conv1d.bias, state, seq_len=seq_len)
            xs = xs if self.activation is None else ACT2FN[self.activation](xs)
        else:
            xs = head_parallel(conv, [xs], state, seq_len=seq_len)
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

        if mode == STATE_PASSING:
            options = {"use_mambapy": self.use_mambapy, "use_associative_scan": self.use_associative_scan}
            rec = _ModelSelectiveScan(modeling.mamba_selective_scan, A, self.D.float(), bias, options)
            (y,), _ = state_passing(rec, [xs, dt, B[:, :, None], C[:, :, None]], state, seq_len=seq_len)
        else:
            y = head_parallel(mix, [xs, dt, B[:, :, None], C[:, :, None]], state, heads=xs.shape[-1], seq_len=seq_len)
        y = y * F.silu(gate)  # the reference scan's z, applied last there too
        return self.out_proj(y.to(dtype))

    object.__setattr__(module, "forward", types.MethodType(forward, module))
    object.__setattr__(module, CHOOSER, chooser)


def _mamba1_installer(jamba: bool) -> Callable[[nn.Module, ParallelState, str], None]:
    def installer(module: nn.Module, state: ParallelState, mixing: str) -> None:
        if state.cp_size > 1:
            _install_mamba1(module, state, _JAMBA_NAMES if jamba else _MAMBA1_NAMES, jamba, mixing)

    return installer


for _qualname, _jamba in (("transformers.models.mamba.modeling_mamba.MambaMixer", False),
                          ("transformers.models.jamba.modeling_jamba.JambaMambaMixer", True)):
    register_adapter(_qualname, modes=(HEAD_PARALLEL, STATE_PASSING))(_mamba1_installer(_jamba))
