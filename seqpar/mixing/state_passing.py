"""State passing: linear recurrences over token shards with an exchange independent of ``S``.

Note [State passing]
~~~~~~~~~~~~~~~~~~~~
A linear recurrence ``h_t = A_t(h_{t-1}) + B_t`` (``A_t`` linear in ``h``) has a final state that is
affine in its initial state, over any contiguous piece of a sequence: ``h_end = P(h_0) + b``. Its
outputs are affine in ``h_0`` too. So, over the CP group:

1. **Summaries.** Every rank cuts its shard into *pieces*: maximal runs of consecutive tokens of one
   sequence (zig-zag: ring rank ``r`` holds chunks ``r`` and ``2R-1-r`` of every sequence, each cut
   over the Ulysses ranks; packed: pieces of several sequences; ``Placement.local_tokens``). The
   recurrence's own kernel runs each piece from a zero state: its outputs, ``b`` and the piece's
   transition ``P`` (:meth:`Recurrence.summarize`), in fp32 (float64 when the inputs are).
2. **One all-gather** of every piece's ``(P, b)`` over ``cp_group``: a few states per rank, whatever
   ``S``. Every rank folds them in global order, sequence by sequence (a sequence's first piece
   starts from its initial state, zero by default): every piece's true initial state, and every
   sequence's final state.
3. **Correction.** Each piece's outputs from its true initial state: a re-run of the kernel, or the
   recurrence's cheaper correction (:meth:`Recurrence.correct`; e.g. ``o += q_t P_t h_0``). A piece
   that starts its sequence with no initial state keeps its first-pass outputs.

Gradients are autograd's through every step. The all-gather's backward is a reduce-scatter
(``seqpar.comm.all_gather``): a piece's summary is read by every rank's fold, and under the partial
gradient convention (each rank backpropagates its own share of the loss) the gradient of that
summary is the sum of every rank's, returned to the piece's owner. So that every rank runs that
reduce-scatter even when its own outputs need no state from elsewhere (the first Ulysses rank of a
ring of one, a rank without tokens), its outputs are tied to the gathered summaries by an identity
whose backward gives them a zero gradient (:class:`_Tie`).

The final states and ``initial_state`` are replicated on the CP ranks: their gradients are partial
(summed over the CP group they are exact), like every parameter's.

Bytes per rank per call: forward, every rank's pieces' summaries (``P`` and ``b``, ``F`` values each)
in one all-gather; backward, the same in one reduce-scatter. At most ``2 * nseq`` pieces per rank
(one per zig-zag chunk and sequence), so for dense inputs ``N * 2 * F`` values received per rank,
independent of ``S``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..comm import all_gather
from ..placement import Placement
from ..placement.sizes import as_int, check_seq_lens
from ..state import ParallelState, require_state
from .conv import causal_conv1d_local
from .headwise import HeadShard, agree_on_call, head_parallel

__all__ = [
    "Recurrence",
    "Summary",
    "GatedDeltaRule",
    "ScalarDecayAttention",
    "SelectiveScan",
    "state_passing",
    "recurrence_head_parallel",
    "causal_conv1d_halo",
]


# --- the adapter protocol ---------------------------------------------------------------------------


@dataclass
class Summary:
    """Pass 1 of one piece (Note [State passing]).

    Attributes:
        outputs: the kernel's outputs ``[B, n, ...]`` from a zero initial state.
        final: ``b``, the final state from a zero initial state, ``[B, *state_shape]``.
        transition: ``P``, ``[B, *transition_shape]``.
        aux: whatever :meth:`Recurrence.correct` needs besides the inputs.
    """

    outputs: tuple[Tensor, ...]
    final: Tensor
    transition: Tensor
    aux: Any = None


class Recurrence:
    """A linear recurrence, as :func:`state_passing` and :func:`recurrence_head_parallel` run it.

    Token inputs are ``[B, n, H_t, ...]`` pieces of one contiguous run of a sequence (per-channel
    inputs ``[B, n, C]`` have ``C`` heads); per-head parameters live on the adapter. Subclasses give
    the kernel and the summary; the defaults below re-run the kernel for the correction.
    """

    num_inputs: int = 0
    input_names: tuple[str, ...] = ()

    def check(self, inputs: Sequence[Tensor]) -> None:
        """Raise ``ValueError`` naming the sizes if ``inputs`` do not fit (any token count)."""

    def heads(self, inputs: Sequence[Tensor]) -> int:
        """``H``, the head count the work is split by in head-parallel mode."""
        return max(x.shape[2] for x in inputs)

    def output_heads(self, inputs: Sequence[Tensor]) -> list[int]:
        """The head count of every output (grouped outputs: fewer)."""
        return [self.heads(inputs)]

    def parameters(self) -> list[Tensor]:
        """Per-head parameters (their gradients are partial on every rank)."""
        return []

    def state_shape(self, inputs: Sequence[Tensor]) -> tuple[int, ...]:
        """The state of one batch row (without ``B``)."""
        raise NotImplementedError

    def transition_shape(self, inputs: Sequence[Tensor]) -> tuple[int, ...]:
        """The transition ``P`` of one batch row (without ``B``)."""
        raise NotImplementedError

    def kernel(self, inputs: Sequence[Tensor], initial_state: Tensor | None) -> tuple[tuple[Tensor, ...], Tensor]:
        """``(outputs, final_state)`` of one piece from ``initial_state`` (``None``: zeros)."""
        raise NotImplementedError

    def transition(self, inputs: Sequence[Tensor]) -> Tensor:
        """``P`` of one piece, ``[B, *transition_shape]``."""
        raise NotImplementedError

    def apply(self, transition: Tensor, state: Tensor) -> Tensor:
        """``P(h)``, batched over the leading dim."""
        raise NotImplementedError

    def summarize(self, inputs: Sequence[Tensor]) -> Summary:
        outputs, final = self.kernel(inputs, None)
        return Summary(outputs, final, self.transition(inputs))

    def correct(self, inputs: Sequence[Tensor], summary: Summary, initial_state: Tensor) -> tuple[Tensor, ...]:
        """The outputs from ``initial_state``, given the piece's zero-state summary."""
        return self.kernel(inputs, initial_state)[0]

    def for_heads(
        self, shard: HeadShard, inputs: Sequence[Tensor], counts: Sequence[int],
    ) -> tuple[Recurrence, list[Tensor]]:
        """This recurrence on ``shard``'s heads (head-parallel mode): per-head parameters
        narrowed, grouped inputs (``counts``: every input's global head count) expanded to one
        head per head where the kernel needs it."""
        raise NotImplementedError


def _compute_dtype(inputs: Sequence[Tensor]) -> torch.dtype:
    """fp32, or float64 when any input is (summaries and kernels run in it)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in inputs) else torch.float32


def _check_heads(name: str, x: Tensor, ndim: int, where: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{where}: {name} has shape {tuple(x.shape)}; expected {ndim} dims [B, n, ...]")


def _grouped(x: Tensor, heads: int) -> Tensor:
    """Grouped heads ``[B, n, h, ...]`` repeated to ``heads`` (the GQA relation)."""
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], 2)


def _segsum_decay(gam: Tensor) -> Tensor:
    """``exp(gam_t - gam_j)`` for ``j <= t``, zero above the diagonal; ``gam`` ``[..., C]``."""
    c = gam.shape[-1]
    causal = torch.ones(c, c, dtype=torch.bool, device=gam.device).tril()
    diff = gam[..., :, None] - gam[..., None, :]
    return torch.where(causal, diff, torch.full_like(diff, -math.inf)).exp()


def _chunks(x: Tensor, chunk: int) -> Tensor:
    """``[B, H, n, ...]`` padded with zeros to whole chunks: ``[B, H, n_chunks, chunk, ...]``."""
    pad = (-x.shape[2]) % chunk
    if pad:
        x = F.pad(x, (0, 0) * (x.ndim - 3) + (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


# --- gated delta rule -------------------------------------------------------------------------------


def gated_delta_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None, chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks (WY form), any float dtype, heads already matched.

    ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T q_t``.

    Args:
        q, k: ``[B, n, H, Dk]`` (scaled / normalised as wanted); v: ``[B, n, H, Dv]``;
        g, beta: ``[B, n, H]``; h0: ``[B, H, Dk, Dv]`` or ``None``.

    Returns:
        ``(o [B, n, H, Dv], S_n [B, H, Dk, Dv])``.

    Within a chunk with cumulative log decay ``gam``, the writes ``w_t = beta_t (v_t - (decayed
    S_{t-1})^T k_t)`` solve the unit lower-triangular system ``(I + A) W = beta V - beta e^gam K S_0``
    with ``A_tj = beta_t e^(gam_t - gam_j) k_t . k_j`` (``j < t``); then ``o = e^gam Q S_0 + (QK^T o
    decay) W`` and ``S_C = e^gam_C S_0 + (e^(gam_C - gam) K)^T W``. Padding (``beta = g = 0``, zero
    keys) is the identity.
    """
    B, n, H, Dk = k.shape
    Dv = v.shape[-1]
    h = h0 if h0 is not None else v.new_zeros(B, H, Dk, Dv)
    if n == 0:
        return v.new_zeros(B, 0, H, Dv), h
    qc, kc, vc = (_chunks(x.transpose(1, 2), chunk) for x in (q, k, v))  # [B, H, nc, C, D]
    gc, bc = (_chunks(x.transpose(1, 2), chunk) for x in (g, beta))      # [B, H, nc, C]
    gam = gc.cumsum(-1)
    decay = _segsum_decay(gam)                                            # [B, H, nc, C, C]
    system = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([bc[..., None] * vc, (bc * gam.exp())[..., None] * kc], -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, kw = solved[..., :Dv], solved[..., Dv:]
    attn = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * gam.exp()[..., None]
    k_to_end = kc * (gam[..., -1:] - gam).exp()[..., None]
    chunk_decay = gam[..., -1].exp()
    outs = []
    for i in range(qc.shape[2]):
        w = u[:, :, i] - kw[:, :, i] @ h
        outs.append(q_decayed[:, :, i] @ h + attn[:, :, i] @ w)
        h = h * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ w
    o = torch.stack(outs, 2).reshape(B, H, -1, Dv)[:, :, :n]
    return o.transpose(1, 2), h


class GatedDeltaRule(Recurrence):
    """The gated delta rule of Qwen3-Next / Qwen3.5 (transformers' ``torch_chunk_gated_delta_rule``
    semantics: queries scaled by ``Dk ** -0.5`` after the optional L2 norm, grouped K heads).

    Inputs ``q, k [B, n, Hk, Dk]``, ``v [B, n, H, Dv]``, ``g [B, n, H]`` (log decay, ``<= 0``),
    ``beta [B, n, H]``. With ``A_log`` and ``dt_bias`` (``[H]``) the fourth input is the raw gate
    ``a`` and ``g = -exp(A_log) * softplus(a + dt_bias)``, as the model computes it. Output
    ``[B, n, H, Dv]`` in ``v``'s dtype; state ``[H, Dk, Dv]``; transition ``[H, Dk, Dk]`` (acting
    on the left), found with the outputs in one kernel run: the value gets ``Dk`` zero columns and
    the initial state the identity there (the columns of the state evolve independently), which
    also gives the correction ``o_t += (q_t^T P_t) h_0`` as the extra output columns.
    """

    num_inputs = 5
    input_names = ("q", "k", "v", "g", "beta")

    def __init__(self, *, use_qk_l2norm: bool = False, chunk_size: int = 64, A_log: Tensor | None = None,
                 dt_bias: Tensor | None = None):
        if (A_log is None) != (dt_bias is None):
            raise ValueError("GatedDeltaRule: pass both A_log and dt_bias, or neither")
        self.use_qk_l2norm = use_qk_l2norm
        self.chunk_size = as_int(chunk_size, "chunk_size", "GatedDeltaRule", minimum=1)
        self.A_log, self.dt_bias = A_log, dt_bias

    def check(self, inputs):
        where = "GatedDeltaRule"
        q, k, v, g, beta = inputs
        for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
            _check_heads(name, x, nd, where)
        H = v.shape[2]
        if q.shape != k.shape or H % k.shape[2] or g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
            raise ValueError(
                f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
                f"{tuple(beta.shape)}; expected q, k [B, n, Hk, Dk], v [B, n, H, Dv] with Hk dividing H, g and "
                "beta [B, n, H]"
            )
        for name, p in (("A_log", self.A_log), ("dt_bias", self.dt_bias)):
            if p is not None and tuple(p.shape) != (H,):
                raise ValueError(f"{where}: {name} has shape {tuple(p.shape)}; expected [{H}] (one per V head)")

    def heads(self, inputs):
        return inputs[2].shape[2]

    def parameters(self):
        return [p for p in (self.A_log, self.dt_bias) if p is not None]

    def state_shape(self, inputs):
        return (inputs[2].shape[2], inputs[1].shape[3], inputs[2].shape[3])

    def transition_shape(self, inputs):
        return (inputs[2].shape[2], inputs[1].shape[3], inputs[1].shape[3])

    def _prepare(self, inputs):
        q, k, v, g, beta = inputs
        dtype, H = _compute_dtype(inputs), v.shape[2]
        q, k = (_grouped(x, H).to(dtype) for x in (q, k))
        if self.use_qk_l2norm:  # transformers' l2norm (fla's): x / sqrt(|x|^2 + 1e-6)
            q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        q = q * q.shape[-1] ** -0.5
        g = g.to(dtype)
        if self.A_log is not None:
            g = -self.A_log.to(dtype).exp() * F.softplus(g + self.dt_bias.to(dtype))
        return q, k, v.to(dtype), g, beta.to(dtype)

    def kernel(self, inputs, initial_state):
        q, k, v, g, beta = self._prepare(inputs)
        h0 = None if initial_state is None else initial_state.to(v.dtype)
        o, h = gated_delta_chunked(q, k, v, g, beta, h0, self.chunk_size)
        return (o.to(inputs[2].dtype),), h

    def apply(self, transition, state):
        return transition @ state

    def summarize(self, inputs):
        q, k, v, g, beta = self._prepare(inputs)
        B, _, H, Dk = k.shape
        Dv = v.shape[-1]
        eye = torch.eye(Dk, dtype=v.dtype, device=v.device)
        h0 = torch.cat([v.new_zeros(B, H, Dk, Dv), eye.expand(B, H, Dk, Dk)], -1)
        v_aug = torch.cat([v, v.new_zeros(*v.shape[:3], Dk)], -1)
        o, h = gated_delta_chunked(q, k, v_aug, g, beta, h0, self.chunk_size)
        return Summary((o[..., :Dv].to(inputs[2].dtype),), h[..., :Dv], h[..., Dv:], aux=o[..., Dv:])

    def correct(self, inputs, summary, initial_state):
        fix = torch.einsum("bnhk,bhkv->bnhv", summary.aux, initial_state.to(summary.aux.dtype))
        return ((summary.outputs[0] + fix).to(inputs[2].dtype),)

    def for_heads(self, shard, inputs, counts):
        q, k, v, g, beta = inputs
        hk = counts[0]
        narrowed = GatedDeltaRule(use_qk_l2norm=self.use_qk_l2norm, chunk_size=self.chunk_size,
                                  A_log=None if self.A_log is None else shard.narrow(self.A_log),
                                  dt_bias=None if self.dt_bias is None else shard.narrow(self.dt_bias))
        return narrowed, [shard.expand(q, hk, 2), shard.expand(k, hk, 2), v, g, beta]


# --- scalar-decay linear attention (lightning, Mamba2 SSD) ------------------------------------------


def scalar_decay_chunked(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, h0: Tensor | None, chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """``h_t = exp(a_t) h_{t-1} + k_t v_t^T``, ``o_t = h_t^T q_t``; heads matched, any float dtype.

    q, k ``[B, n, H, Dk]``, v ``[B, n, H, Dv]``, a ``[B, n, H]``, h0 ``[B, H, Dk, Dv]``; returns
    ``(o [B, n, H, Dv], h_n)``. Per chunk: ``o = (QK^T o e^(gam_t - gam_j)) V + e^gam Q h``."""
    B, n, H, Dk = k.shape
    Dv = v.shape[-1]
    h = h0 if h0 is not None else v.new_zeros(B, H, Dk, Dv)
    if n == 0:
        return v.new_zeros(B, 0, H, Dv), h
    qc, kc, vc = (_chunks(x.transpose(1, 2), chunk) for x in (q, k, v))
    gam = _chunks(a.transpose(1, 2), chunk).cumsum(-1)
    intra = ((qc @ kc.transpose(-1, -2)) * _segsum_decay(gam)) @ vc
    q_decayed = qc * gam.exp()[..., None]
    k_to_end = kc * (gam[..., -1:] - gam).exp()[..., None]
    outs = []
    for i in range(qc.shape[2]):
        outs.append(intra[:, :, i] + q_decayed[:, :, i] @ h)
        h = h * gam[:, :, i, -1].exp()[..., None, None] + k_to_end[:, :, i].transpose(-1, -2) @ vc[:, :, i]
    o = torch.stack(outs, 2).reshape(B, H, -1, Dv)[:, :, :n]
    return o.transpose(1, 2), h


class ScalarDecayAttention(Recurrence):
    """Linear attention with one decay per head and token: lightning attention, Mamba2's SSD.

    Inputs ``q, k [B, n, Hk, Dk]`` (grouped: Mamba2's C and B with ``Hk`` groups), ``v [B, n, H,
    Dv]``, ``a [B, n, H]``: ``h_t = exp(a_t) h_{t-1} + k_t v_t^T`` and ``o_t = scale * h_t^T q_t``.
    With ``A_log`` (``[H]``; and optional ``dt_bias``, ``D``) it is Mamba2: ``a`` is the raw ``dt``,
    ``delta = softplus(dt + dt_bias)``, the log decay ``-exp(A_log) * delta``, the value ``v *
    delta``, and ``D * v`` is added to the output. State ``[H, Dk, Dv]``; transition ``[H]``, the
    decay of the whole piece; correction ``o_t += scale * exp(sum_{s<=t} a_s) q_t^T h_0``.
    """

    num_inputs = 4
    input_names = ("q", "k", "v", "a")

    def __init__(self, *, scale: float = 1.0, chunk_size: int = 64, A_log: Tensor | None = None,
                 dt_bias: Tensor | None = None, D: Tensor | None = None):
        if A_log is None and (dt_bias is not None or D is not None):
            raise ValueError("ScalarDecayAttention: dt_bias and D belong to the Mamba2 form; pass A_log too")
        self.scale, self.chunk_size = float(scale), as_int(chunk_size, "chunk_size", "ScalarDecayAttention", minimum=1)
        self.A_log, self.dt_bias, self.D = A_log, dt_bias, D

    def check(self, inputs):
        where = "ScalarDecayAttention"
        q, k, v, a = inputs
        for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("a", a, 3)):
            _check_heads(name, x, nd, where)
        H = v.shape[2]
        if q.shape != k.shape or H % k.shape[2] or a.shape != v.shape[:3]:
            raise ValueError(
                f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, a {tuple(a.shape)}; "
                "expected q, k [B, n, Hk, Dk], v [B, n, H, Dv] with Hk dividing H, a [B, n, H]"
            )
        for name, p in (("A_log", self.A_log), ("dt_bias", self.dt_bias), ("D", self.D)):
            if p is not None and tuple(p.shape) != (H,):
                raise ValueError(f"{where}: {name} has shape {tuple(p.shape)}; expected [{H}] (one per head)")

    def heads(self, inputs):
        return inputs[2].shape[2]

    def parameters(self):
        return [p for p in (self.A_log, self.dt_bias, self.D) if p is not None]

    def state_shape(self, inputs):
        return (inputs[2].shape[2], inputs[1].shape[3], inputs[2].shape[3])

    def transition_shape(self, inputs):
        return (inputs[2].shape[2],)

    def _prepare(self, inputs):
        q, k, v, a = inputs
        dtype, H = _compute_dtype(inputs), v.shape[2]
        q, k, v, a = _grouped(q, H).to(dtype) * self.scale, _grouped(k, H).to(dtype), v.to(dtype), a.to(dtype)
        skip = None
        if self.A_log is not None:
            delta = F.softplus(a if self.dt_bias is None else a + self.dt_bias.to(dtype))
            if self.D is not None:
                skip = v * self.D.to(dtype)[:, None]
            v, a = v * delta[..., None], -self.A_log.to(dtype).exp() * delta
        return q, k, v, a, skip

    def kernel(self, inputs, initial_state):
        q, k, v, a, skip = self._prepare(inputs)
        h0 = None if initial_state is None else initial_state.to(v.dtype)
        o, h = scalar_decay_chunked(q, k, v, a, h0, self.chunk_size)
        o = o if skip is None else o + skip
        return (o.to(inputs[2].dtype),), h

    def apply(self, transition, state):
        return transition[..., None, None] * state

    def summarize(self, inputs):
        q, k, v, a, skip = self._prepare(inputs)
        o, h = scalar_decay_chunked(q, k, v, a, None, self.chunk_size)
        o = o if skip is None else o + skip
        gam = a.cumsum(1)
        return Summary((o.to(inputs[2].dtype),), h, gam[:, -1].exp(), aux=(q, gam))

    def correct(self, inputs, summary, initial_state):
        q, gam = summary.aux
        fix = gam.exp()[..., None] * torch.einsum("bnhk,bhkv->bnhv", q, initial_state.to(q.dtype))
        return ((summary.outputs[0] + fix).to(inputs[2].dtype),)

    def for_heads(self, shard, inputs, counts):
        q, k, v, a = inputs
        hk = counts[0]
        narrowed = ScalarDecayAttention(
            scale=self.scale, chunk_size=self.chunk_size,
            **{name: None if p is None else shard.narrow(p)
               for name, p in (("A_log", self.A_log), ("dt_bias", self.dt_bias), ("D", self.D))},
        )
        return narrowed, [shard.expand(q, hk, 2), shard.expand(k, hk, 2), v, a]


# --- diagonal selective scan (Mamba1) ---------------------------------------------------------------


class SelectiveScan(Recurrence):
    """Mamba1's selective scan: per channel ``c`` a diagonal state ``h [C, N]``.

    Inputs ``x [B, n, C]``, ``dt [B, n, C]`` (raw), ``Bm, Cm [B, n, G, N]`` (``G`` groups dividing
    ``C``; Mamba1 has ``G = 1``); parameters ``A_log [C, N]``, ``D [C]``, ``dt_bias [C]``:
    ``delta = softplus(dt + dt_bias)``, ``h_t = exp(delta_t A) o h_{t-1} + delta_t x_t B_t``,
    ``y_t = h_t C_t + D x_t`` with ``A = -exp(A_log)``. State ``[C, N]``; transition ``[C, N]``
    (element-wise, ``exp(A sum delta)``); correction ``y_t += sum_N C_t exp(A sum_{s<=t} delta_s) h_0``.
    """

    num_inputs = 4
    input_names = ("x", "dt", "B", "C")

    def __init__(self, A_log: Tensor, D: Tensor | None = None, dt_bias: Tensor | None = None):
        self.A_log, self.D, self.dt_bias = A_log, D, dt_bias

    def check(self, inputs):
        where = "SelectiveScan"
        x, dt, Bm, Cm = inputs
        for name, t, nd in (("x", x, 3), ("dt", dt, 3), ("B", Bm, 4), ("C", Cm, 4)):
            _check_heads(name, t, nd, where)
        C = x.shape[2]
        if dt.shape != x.shape or Bm.shape != Cm.shape or Bm.shape[:2] != x.shape[:2] or C % Bm.shape[2]:
            raise ValueError(
                f"{where}: x {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(Bm.shape)}, C {tuple(Cm.shape)}; "
                "expected x, dt [B, n, C] and B, C [B, n, G, N] with G dividing C"
            )
        N = Bm.shape[3]
        if tuple(self.A_log.shape) != (C, N):
            raise ValueError(f"{where}: A_log has shape {tuple(self.A_log.shape)}; expected [{C}, {N}]")
        for name, p in (("D", self.D), ("dt_bias", self.dt_bias)):
            if p is not None and tuple(p.shape) != (C,):
                raise ValueError(f"{where}: {name} has shape {tuple(p.shape)}; expected [{C}]")

    def heads(self, inputs):
        return inputs[0].shape[2]

    def parameters(self):
        return [p for p in (self.A_log, self.D, self.dt_bias) if p is not None]

    def state_shape(self, inputs):
        return (inputs[0].shape[2], inputs[2].shape[3])

    transition_shape = state_shape

    def _prepare(self, inputs):
        x, dt, Bm, Cm = inputs
        dtype, C = _compute_dtype(inputs), x.shape[2]
        x, dt = x.to(dtype), dt.to(dtype)
        delta = F.softplus(dt if self.dt_bias is None else dt + self.dt_bias.to(dtype))  # [B, n, C]
        A = -self.A_log.to(dtype).exp()                                                  # [C, N]
        return x, delta, A, _grouped(Bm, C).to(dtype), _grouped(Cm, C).to(dtype)

    def kernel(self, inputs, initial_state):
        x, delta, A, Bm, Cm = self._prepare(inputs)
        B, n, C = x.shape
        h = x.new_zeros(B, C, A.shape[1]) if initial_state is None else initial_state.to(x.dtype)
        decay = (delta[..., None] * A).exp()              # [B, n, C, N]
        write = (delta * x)[..., None] * Bm               # [B, n, C, N]
        ys = []
        for t in range(n):
            h = decay[:, t] * h + write[:, t]
            ys.append((h * Cm[:, t]).sum(-1))
        y = torch.stack(ys, 1) if ys else x.new_zeros(B, 0, C)
        if self.D is not None:
            y = y + x * self.D.to(x.dtype)
        return (y.to(inputs[0].dtype),), h

    def apply(self, transition, state):
        return transition * state

    def summarize(self, inputs):
        outputs, final = self.kernel(inputs, None)
        x, delta, A, _, Cm = self._prepare(inputs)
        cum = delta.cumsum(1)[..., None] * A               # [B, n, C, N], log decay since the start
        return Summary(outputs, final, cum[:, -1].exp(), aux=(cum, Cm))

    def correct(self, inputs, summary, initial_state):
        cum, Cm = summary.aux
        fix = (Cm * cum.exp() * initial_state.to(cum.dtype)[:, None]).sum(-1)
        return ((summary.outputs[0] + fix).to(inputs[0].dtype),)

    def for_heads(self, shard, inputs, counts):
        x, dt, Bm, Cm = inputs
        g = counts[2]
        narrowed = SelectiveScan(shard.narrow(self.A_log), None if self.D is None else shard.narrow(self.D),
                                 None if self.dt_bias is None else shard.narrow(self.dt_bias))
        return narrowed, [x, dt, shard.expand(Bm, g, 2), shard.expand(Cm, g, 2)]


# --- pieces of a placement ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    seq: int      # sequence index
    start: int    # position within the sequence
    length: int
    offset: int   # first local row


@functools.lru_cache(maxsize=64)
def _pieces(seq_lens: tuple[int, ...], ring_size: int, ulysses_size: int) -> tuple[tuple[_Piece, ...], ...]:
    """Per CP rank, its shard as maximal runs of consecutive tokens of one sequence, in local order."""
    placement = Placement(seq_lens, ring_size, ulysses_size)
    out = []
    for c in range(placement.cp_size):
        ids, pos = placement.local_tokens(c)
        if ids.numel() == 0:
            out.append(())
            continue
        cut = ((ids[1:] != ids[:-1]) | (pos[1:] != pos[:-1] + 1)).nonzero().flatten() + 1
        starts = [0, *cut.tolist()]
        ends = [*starts[1:], ids.numel()]
        out.append(tuple(_Piece(int(ids[a]), int(pos[a]), b - a, a) for a, b in zip(starts, ends)))
    return tuple(out)


def piece_counts(seq_lens: tuple[int, ...], ring_size: int, ulysses_size: int) -> tuple[int, ...]:
    """Per CP rank, the pieces (runs of consecutive tokens of one sequence) it holds: the rows it
    hands state passing's all-gathers."""
    return tuple(len(p) for p in _pieces(tuple(seq_lens), ring_size, ulysses_size))


@functools.lru_cache(maxsize=64)
def _global_order(
    seq_lens: tuple[int, ...], ring_size: int, ulysses_size: int,
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per sequence, its pieces ``(cp_rank, local index)`` in global order."""
    per_seq: list[list[tuple[int, int, int]]] = [[] for _ in seq_lens]
    for c, pieces in enumerate(_pieces(seq_lens, ring_size, ulysses_size)):
        for i, p in enumerate(pieces):
            per_seq[p.seq].append((p.start, c, i))
    return tuple(tuple((c, i) for _, c, i in sorted(s)) for s in per_seq)


class _Tie(torch.autograd.Function):
    """``x`` unchanged; ``anchor`` gets a zero gradient, so that its backward (the reduce-scatter
    every rank must join) runs on a rank whose ``x`` does not otherwise depend on it."""

    @staticmethod
    def forward(ctx, anchor, x):
        ctx.meta = (anchor.shape, anchor.dtype, anchor.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.meta
        return torch.zeros(shape, dtype=dtype, device=device), g


def _tie(anchor: Tensor, x: Tensor) -> Tensor:
    if not (anchor.requires_grad and torch.is_grad_enabled()) or not (x.dtype.is_floating_point or x.dtype.is_complex):
        return x
    return _Tie.apply(anchor, x)


# --- the two modes -------------------------------------------------------------------------------------


_OK, _FAILED = 0, 1


def _validate(recurrence: Recurrence, inputs: Sequence[Tensor], packed: bool, where: str) -> list[Tensor]:
    """Inputs as ``[B, S_local, ...]`` (packed: a batch of one); ``ValueError`` naming the sizes."""
    if not isinstance(recurrence, Recurrence):
        raise ValueError(f"{where}: recurrence must be a seqpar.mixing.Recurrence, got {type(recurrence).__name__}")
    if isinstance(inputs, Tensor) or not isinstance(inputs, Sequence) or not all(isinstance(x, Tensor) for x in inputs):
        raise ValueError(f"{where}: inputs must be a list of tensors, got {type(inputs).__name__}")
    if len(inputs) != recurrence.num_inputs:
        raise ValueError(
            f"{where}: {type(recurrence).__name__} takes {recurrence.num_inputs} inputs "
            f"({', '.join(recurrence.input_names)}), got {len(inputs)}"
        )
    xs = [x.unsqueeze(0) for x in inputs] if packed else list(inputs)
    lead = [tuple(x.shape[:2]) for x in xs]
    if any(x.ndim < 2 for x in xs) or len(set(lead)) != 1:
        layout = "[T_local, ...] (packed)" if packed else "[B, S_local, ...]"
        raise ValueError(
            f"{where}: inputs have shapes {[tuple(x.shape) for x in inputs]}; every input is {layout} with the "
            "same tokens"
        )
    recurrence.check(xs)
    return xs


def _lengths(seq_len: int | None, seq_lens: Sequence[int] | Tensor | None, where: str) -> tuple[int, ...]:
    if seq_len is not None and seq_lens is not None:
        raise ValueError(f"{where}: pass seq_len for dense inputs or seq_lens for packed ones, not both")
    if seq_lens is not None:
        return check_seq_lens(seq_lens, where)
    return () if seq_len is None else (as_int(seq_len, "seq_len", where),)


def state_passing(
    recurrence: Recurrence,
    inputs: Sequence[Tensor],
    state: ParallelState,
    *,
    seq_len: int | None = None,
    seq_lens: Sequence[int] | Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Run a linear recurrence on token shards by passing states (Note [State passing]).

    Every CP rank passes its shard of every token input; each rank runs its own tokens and the
    ranks exchange one all-gather of fixed-size piece summaries. Exact for any placement (zig-zag,
    contiguous, balanced packed), forward and backward.

    Args:
        recurrence: the adapter (:class:`GatedDeltaRule`, :class:`ScalarDecayAttention`,
            :class:`SelectiveScan`, or a :class:`Recurrence` of your own); the same on every rank.
        inputs: its token inputs, ``[B, S_local, H_t, ...]`` (``seqpar.shard``), or packed
            ``[T_local, H_t, ...]`` (``seqpar.shard_packed``) with ``seq_lens``.
        state: the parallel state; pieces are exchanged over ``state.cp_group``.
        seq_len: dense inputs: the global length ``S`` (``None``: exchanged, one small collective).
        seq_lens: packed inputs: the global sequence lengths.
        initial_state: the state every sequence starts from, ``[B, *state_shape]`` (packed:
            ``[nseq, *state_shape]``), the same on every rank; ``None``: zeros. Its gradient is
            partial (sum it over the CP group).

    Returns:
        ``(outputs, final_state)``: the recurrence's outputs as token shards in the inputs'
        placement (a tuple), and every sequence's final state ``[B, *state_shape]`` (packed
        ``[nseq, *state_shape]``) in fp32 (float64 for float64 inputs), the same on every rank
        (gradient partial, like ``initial_state``'s).

    Raises:
        ValueError: inputs that do not fit the recurrence, local lengths that are not this rank's
            share, an initial state of the wrong shape, ranks that disagree. Where the CP ranks
            check collectively (``ParallelState.checks``) every rank raises the same error.
    """
    where = "state_passing"
    require_state(state, where)
    packed = seq_lens is not None
    problem, xs, lens = None, [], ()
    try:
        lens = _lengths(seq_len, seq_lens, where)
        xs = _validate(recurrence, inputs, packed, where)
        if initial_state is not None:
            rows = len(lens) if packed else xs[0].shape[0]
            want = (rows, *recurrence.state_shape(xs))
            if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != want:
                got = tuple(initial_state.shape) if isinstance(initial_state, Tensor) else type(initial_state).__name__
                what = "[nseq, *state]" if packed else "[B, *state]"
                raise ValueError(f"{where}: initial_state has shape {got}; expected {what} = {want}")
    except ValueError as e:
        problem = str(e)
    device = xs[0].device if xs else torch.device("cpu")
    params = recurrence.parameters() if problem is None else []
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in [*xs, *params, *([initial_state] if initial_state is not None else [])])
    local = xs[0].shape[1] if xs else 0
    signature = None if problem else (
        type(recurrence).__name__, packed, xs[0].shape[0], [(tuple(x.shape[2:]), str(x.dtype)) for x in xs],
        lens if lens else None, grad, None if initial_state is None else str(initial_state.dtype),
    )
    lens = agree_on_call(
        state, local, problem, signature, lens, packed, device, where,
        lengths_given=seq_len is not None or packed, options="shapes outside the token dim, dtypes, requires_grad, initial_state, seq_len / seq_lens",
    )

    n, me = state.cp_size, state.cp_rank
    pieces = _pieces(lens, state.ring_size, state.ulysses_size)
    order = _global_order(lens, state.ring_size, state.ulysses_size)
    batch = xs[0].shape[0]
    sdtype = _compute_dtype(xs)
    s_shape, p_shape = recurrence.state_shape(xs), recurrence.transition_shape(xs)
    p_size, s_size = math.prod(p_shape), math.prod(s_shape)
    row = batch * (p_size + s_size)  # one piece's summary, flat

    # Pass 1: every local piece from a zero state.
    summaries: list[tuple[Sequence[Tensor], Summary]] = []
    for p in pieces[me]:
        part = [x.narrow(1, p.offset, p.length) for x in xs]
        summaries.append((part, recurrence.summarize(part)))
    if summaries:
        local_rows = torch.stack([
            torch.cat([s.transition.to(sdtype).reshape(-1), s.final.to(sdtype).reshape(-1)]) for _, s in summaries
        ])
    else:
        local_rows = torch.zeros(0, row, dtype=sdtype, device=device)
        if grad:  # join the autograd graph like the other ranks (the reduce-scatter in backward)
            local_rows = local_rows + sum(t.sum() for t in [*xs, *params] if t.requires_grad) * 0

    # One all-gather of every piece's (P, b); backward: a reduce-scatter (sum over ranks to the owner).
    if n > 1:
        gathered = all_gather(local_rows, state.cp_group, 0, [len(p) for p in pieces])
    else:
        gathered = local_rows
    first_row = [0]
    for p in pieces:
        first_row.append(first_row[-1] + len(p))

    # Fold in global order: every piece's true initial state, every sequence's final state.
    starts: dict[tuple[int, int], Tensor | None] = {}
    finals = []
    for s, members in enumerate(order):
        h = None
        if initial_state is not None:
            h = initial_state.narrow(0, s, 1) if packed else initial_state
            h = h.to(sdtype)
        for c, i in members:
            starts[(c, i)] = h
            r = gathered[first_row[c] + i]
            P = r[: batch * p_size].reshape(batch, *p_shape)
            b = r[batch * p_size:].reshape(batch, *s_shape)
            h = b if h is None else recurrence.apply(P, h) + b
        finals.append(h if h is not None else torch.zeros(batch, *s_shape, dtype=sdtype, device=device))
    final = torch.cat(finals, 0) if packed else finals[0]

    # Pass 2: the outputs from the true initial states.
    per_piece = []
    for i, (part, summary) in enumerate(summaries):
        h0 = starts[(me, i)]
        per_piece.append(summary.outputs if h0 is None else recurrence.correct(part, summary, h0))
    if per_piece:
        outs = [torch.cat(o, 1) if len(o) > 1 else o[0] for o in zip(*per_piece)]
    else:
        outs = list(_empty_outputs(recurrence, xs))
    outs = [_tie(gathered, o) for o in outs]
    if packed:
        outs = [o.squeeze(0) for o in outs]
    return tuple(outs), final


def _empty_outputs(recurrence: Recurrence, xs: list[Tensor]) -> tuple[Tensor, ...]:
    """The outputs of a rank without tokens: the kernel on zero tokens (no work)."""
    outs, _ = recurrence.kernel(xs, None)
    return outs


def recurrence_head_parallel(
    recurrence: Recurrence,
    inputs: Sequence[Tensor],
    state: ParallelState,
    *,
    seq_len: int | None = None,
    seq_lens: Sequence[int] | Tensor | None = None,
) -> tuple[Tensor, ...]:
    """The same recurrence head-parallel (``head_parallel``): whole sequences of some heads per
    rank, the kernel from zero states. Returns the outputs (a tuple) as token shards; no states
    (they stay on the rank of their heads; use :func:`state_passing` for them)."""
    where = "recurrence_head_parallel"
    require_state(state, where)
    packed = seq_lens is not None
    xs = _validate(recurrence, inputs, packed, where)
    heads = recurrence.heads(xs)
    counts = [x.shape[2] for x in xs]
    out_heads = recurrence.output_heads(xs)

    def mix(shard: HeadShard, *tensors: Tensor) -> tuple[Tensor, ...]:
        local = [t.unsqueeze(0) for t in tensors] if packed else list(tensors)
        rec, local = recurrence.for_heads(shard, local, counts)
        if not packed:
            return rec.kernel(local, None)[0]
        bounds = shard.cu_seqlens.tolist()
        pieces = [rec.kernel([t[:, a:b] for t in local], None)[0] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        if not pieces:
            return tuple(o.squeeze(0) for o in rec.kernel(local, None)[0])
        return tuple(torch.cat(o, 1).squeeze(0) for o in zip(*pieces))

    out = head_parallel(mix, list(inputs), state, heads=heads, out_heads=out_heads, seq_len=seq_len, seq_lens=seq_lens)
    return out if isinstance(out, tuple) else (out,)


# --- the causal conv's halo ---------------------------------------------------------------------------


def causal_conv1d_halo(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: ParallelState,
    *,
    activation: str | None = None,
    seq_len: int | None = None,
    seq_lens: Sequence[int] | Tensor | None = None,
) -> Tensor:
    """Depthwise causal conv1d of token shards with a halo exchange (state-passing mode).

    Each piece of the shard needs the ``K - 1`` globally preceding tokens of its sequence: every
    rank all-gathers the last ``min(n, K - 1)`` tokens of each of its pieces (bytes independent of
    ``S``), and each piece prepends what precedes it in global order (several pieces when they are
    short; nothing across a sequence start, so packed sequences never leak). Same arguments and
    result as ``seqpar.mixing.causal_conv1d``; the gradient of the halo is summed over the ranks
    that read it and returned to its owner (the all-gather's reduce-scatter).
    """
    where = "causal_conv1d_halo"
    require_state(state, where)
    packed = seq_lens is not None
    problem = None
    lens: tuple[int, ...] = ()
    try:
        lens = _lengths(seq_len, seq_lens, where)
        if not isinstance(x, Tensor) or x.ndim != (2 if packed else 3):
            raise ValueError(f"{where}: x must be {'[T_local, C]' if packed else '[B, S_local, C]'}, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        C = x.shape[-1]
        if not isinstance(weight, Tensor) or weight.ndim not in (2, 3) or weight.shape[0] != C or weight.shape[-1] < 1:
            raise ValueError(f"{where}: weight must be [C, K] or [C, 1, K] with C={C}, got {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (C,):
            raise ValueError(f"{where}: bias must be [{C}] or None, got {tuple(bias.shape)}")
        if activation not in (None, "silu"):
            raise ValueError(f"{where}: activation must be None or 'silu', got {activation!r}")
    except ValueError as e:
        problem = str(e)
    xb = x.unsqueeze(0) if problem is None and packed else x
    device = x.device if isinstance(x, Tensor) else torch.device("cpu")
    local = xb.shape[1] if problem is None else 0
    signature = None if problem else (packed, xb.shape[0], xb.shape[2], str(x.dtype), tuple(weight.shape), lens or None)
    lens = agree_on_call(
        state, local, problem, signature, lens, packed, device, where,
        lengths_given=seq_len is not None or packed, options="shapes outside the token dim, dtypes, weight, seq_len / seq_lens",
    )
    w = weight.reshape(weight.shape[0], weight.shape[-1])
    K, n, me = w.shape[-1], state.cp_size, state.cp_rank
    pieces = _pieces(lens, state.ring_size, state.ulysses_size)
    order = _global_order(lens, state.ring_size, state.ulysses_size)
    halo = K - 1
    B, Cc = xb.shape[0], xb.shape[2]
    if halo == 0 or n == 1:
        return causal_conv1d_local(x, w, bias, None if not packed else _cu(lens, device), activation)

    # Every piece's tail (its last min(length, K - 1) tokens), zero-padded at the front to K - 1.
    tails = []
    for p in pieces[me]:
        keep = min(p.length, halo)
        tail = xb.narrow(1, p.offset + p.length - keep, keep)
        tails.append(F.pad(tail, (0, 0, halo - keep, 0)))
    local_tails = torch.stack(tails) if tails else xb.new_zeros(0, B, halo, Cc) + xb.sum() * 0
    gathered = all_gather(local_tails, state.cp_group, 0, [len(p) for p in pieces])
    first_row = [0]
    for p in pieces:
        first_row.append(first_row[-1] + len(p))
    where_is = {ci: k for members in order for k, ci in enumerate(members)}

    outs = []
    for i, p in enumerate(pieces[me]):
        members = order[p.seq]
        before, need = [], halo
        for c, j in reversed(members[: where_is[(me, i)]]):
            if need == 0:
                break
            q = pieces[c][j]
            keep = min(q.length, halo, need)
            before.insert(0, gathered[first_row[c] + j][:, halo - keep:])
            need -= keep
        seg = torch.cat([*before, xb.narrow(1, p.offset, p.length)], 1)
        got = seg.shape[1] - p.length
        # Fewer than K - 1 preceding tokens only at the sequence start: the conv pads with zeros.
        y = causal_conv1d_local(seg, w, bias, None, activation)[:, got:]
        outs.append(y)
    out = torch.cat(outs, 1) if outs else causal_conv1d_local(xb, w, bias, None, activation)
    out = _tie(gathered, out)
    return out.squeeze(0) if packed else out


def _cu(lens: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long, device=device)
