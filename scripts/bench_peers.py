"""Benchmark seqpar against the other sequence-parallel attention libraries that are installed.

Every side computes the same problem -- exact attention over ``S`` tokens, ``H`` query and ``Hkv``
key/value heads of dim ``D``, forward and backward -- on the same local gloo ranks and with the same
CPU kernel (torch's ``_scaled_dot_product_flash_attention_for_cpu`` and its backward). The peers
stay optional: a peer that is not installed, or that cannot run on CPU gloo, is skipped and the
output says why.

Cases (``--cases``; ring x Ulysses on a CP group of ``R * U`` ranks; with fewer CP ranks than
``--world`` the other ranks run the same problem in data-parallel copies):

- ``u2``, ``u4``: Ulysses U=2 / U=4, causal: DeepSpeed's ``deepspeed.sequence.layer
  .DistributedAttention`` and yunchang's ``UlyssesAttention``;
- ``h22``: hybrid 2 x 2, causal: yunchang's ``LongContextAttention`` (USP, zig-zag ring);
- ``r4``: ring R=4, causal: yunchang's and ring-flash-attn's zig-zag rings, and torch's
  ``torch.distributed.tensor.experimental.context_parallel``;
- ``u2-full``, ``u4-full``, ``r4-full``: the same splits, non-causal: diffusers' own context
  parallelism (``ContextParallelConfig(ulysses_degree=U, ring_degree=R)`` through
  ``dispatch_attention_fn`` with the native backend; its templated CP refuses causal attention).

What is measured, per case and side:

- **time**: one forward+backward; all sides of a case are timed in interleaved rounds (every rank
  starts each call together), a round's time is the slowest rank's, the figure is the median over
  ``--rounds`` rounds after one untimed call;
- **memory**: the peak tensor bytes one rank allocates in one forward+backward on a freshly built
  side (``seqpar.tools.profiling.PeakMemory``: every storage an ATen op creates while it is alive),
  so whatever a side keeps for later calls is counted -- seqpar's ``state.workspace`` on a fresh
  ``ParallelState``, a peer's buffers -- next to outputs, saved activations and gradients; the
  busiest rank's figure;
- **exactness** (``--check-seq-len``, small shapes, before the timing): the max abs error of the
  output and of dq, dk, dv in fp32 against a single-device float64 reference, at the tokens each
  rank holds in the side's own placement, for an even shape and three odd ones: an odd length,
  ``H`` not divisible by ``U`` (H=5) and ``Hkv < U`` (GQA). A side that raises is reported as
  refusing (with its message); an error above ``--tol`` is reported as WRONG. A side that fails
  the even check is not timed.

seqpar runs twice in the Ulysses and hybrid cases: as constructed by default, and as
``seqpar-keep`` (``ParallelState(keep_head_shards=True)``: the forward keeps the head-sharded q,
k, v and output, so the backward sends only dout and the gradients, as the peers do); each is
compared with every peer in the same interleaved rounds.

Kernel shims (in this script only, never in seqpar): yunchang and ring-flash-attn call flash-attn
(CUDA). Without it installed, a module ``flash_attn`` is provided for the ranks of this run whose
``flash_attn_func``, ``_flash_attn_forward`` and ``_flash_attn_backward`` call the CPU kernel above
(GQA by repeating K/V heads; dropout, windows, softcap and ALiBi refused), so that their own
all-to-all, ring, merge and placement code runs unchanged. DeepSpeed's and diffusers' local
attention is ``F.scaled_dot_product_attention`` restricted to the flash kernel.

The ranks share the machine's cores (the output warns when there are fewer cores than ranks):
compare the ratios, which are measured interleaved in one run, not the absolute times.

Examples::

    python scripts/bench_peers.py                                   # S=8192, H=8, D=64, 4 ranks, all cases
    python scripts/bench_peers.py --seq-len 1024 --rounds 3 --cases u2,r4
    python scripts/bench_peers.py --check-only                      # exactness only

Output: the tables and notes, then the whole report as one JSON line (last line); ``--json PATH``
also writes it, ``--plot PATH`` saves a chart of the seqpar / peer time and memory ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.machinery
import importlib.util
import re
import statistics
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.tools.bench import Ranks, inputs, time_sharing_warning, usable_cores
from seqpar.tools.profiling import PeakMemory, PhaseTimer, max_over_ranks
from seqpar.tools.report import (
    Panel,
    add_output_arguments,
    chart_panels,
    emit,
    progress,
    script_parser,
    table,
)
from seqpar.tools.testing import DistPool, DistributedError

# ---------------------------------------------------------------------------------------------
# Cases and sides


@dataclass(frozen=True)
class Case:
    """One split of the CP group: ``ring`` x ``ulysses`` ranks, a mask, and the peers it runs."""

    key: str
    ring: int
    ulysses: int
    causal: bool
    peers: tuple[str, ...]
    seqpar_checks: str = "auto"  # ParallelState(checks=...) of the seqpar sides (--seqpar-checks)

    @property
    def label(self) -> str:
        split = f"ring {self.ring}" if self.ulysses == 1 else (
            f"ulysses {self.ulysses}" if self.ring == 1 else f"hybrid {self.ring}x{self.ulysses}")
        return f"{split}, {'causal' if self.causal else 'non-causal'}"


CASES = {
    c.key: c
    for c in (
        Case("u2", 1, 2, True, ("seqpar-keep", "deepspeed", "yunchang")),
        Case("u4", 1, 4, True, ("seqpar-keep", "deepspeed", "yunchang")),
        Case("h22", 2, 2, True, ("seqpar-keep", "yunchang")),
        Case("r4", 4, 1, True, ("yunchang", "ring-flash-attn", "torch-cp")),
        Case("u2-full", 1, 2, False, ("diffusers",)),
        Case("u4-full", 1, 4, False, ("diffusers",)),
        Case("r4-full", 4, 1, False, ("diffusers",)),
    )
}

# peer -> (module that must be importable, how to install it)
PEER_PACKAGES = {
    "seqpar-keep": ("seqpar", "pip install -e ."),
    "deepspeed": ("deepspeed", "pip install deepspeed"),
    "yunchang": ("yunchang", "pip install --no-deps yunchang"),
    "ring-flash-attn": ("ring_flash_attn", "pip install --no-deps ring-flash-attn"),
    "torch-cp": ("torch.distributed.tensor.experimental", "a torch with DTensor context parallelism"),
    "diffusers": ("diffusers", 'pip install -e ".[diffusers]"'),
}


def missing_reason(peer: str) -> str | None:
    """Why ``peer`` cannot run here (its package is not installed), else ``None``."""
    module, install = PEER_PACKAGES[peer]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"not installed ({install})"


# ---------------------------------------------------------------------------------------------
# The CPU kernel every side uses, and the flash-attn stand-in for yunchang and ring-flash-attn


def _expand_kv(q: torch.Tensor, *kv: torch.Tensor) -> list[torch.Tensor]:
    """``[B, S, Hkv, D]`` K/V repeated to q's ``H`` heads (GQA: head ``h`` reads K/V head ``h // (H / Hkv)``)."""
    rep = q.shape[2] // kv[0].shape[2]
    return [t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in kv]


def cpu_flash_forward(q, k, v, causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel on bshd ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` -> out ``[B, Sq, H, D]``,
    lse ``[B, H, Sq]`` (flash-attn's layouts).

    Raises:
        NotImplementedError: causal with ``Sq != Sk`` (the CPU kernel aligns the diagonal top-left,
            flash-attn bottom-right).
    """
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError(f"causal block with Sq={q.shape[1]} != Sk={k.shape[1]}: the CPU kernel aligns "
                                  "the diagonal top-left, flash-attn bottom-right")
    k, v = _expand_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse


def cpu_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None):
    """The CPU flash kernel's backward (bshd, as :func:`cpu_flash_forward`) -> dq, dk, dv (dk, dv summed
    back to ``Hkv`` heads)."""
    hkv = k.shape[2]
    k, v = _expand_kv(q, k, v)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.transpose(1, 2) for t in (dout.to(q.dtype), q, k, v, out.to(q.dtype))), lse, 0.0, causal, scale=scale)
    dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
    if dk.shape[2] != hkv:
        dk, dv = (t.unflatten(2, (hkv, -1)).sum(3) for t in (dk, dv))
    return dq, dk, dv


class _CpuFlash(torch.autograd.Function):
    """``flash_attn_func`` on the CPU kernel: bshd q, k, v -> out (no gradient for causal, scale)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = cpu_flash_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*cpu_flash_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale), None, None)


def _refuse_options(dropout_p=0.0, window=(-1, -1), softcap=0.0, alibi_slopes=None) -> None:
    if dropout_p or tuple(window) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError("the CPU flash-attn stand-in runs no dropout, window, softcap or ALiBi")


def _flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _refuse_options(dropout_p, window_size, softcap, alibi_slopes)
    return _CpuFlash.apply(q, k, v, causal, softmax_scale)


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """flash-attn >= 2.6.3's ``_flash_attn_forward`` -> (out, lse, S_dmask, rng_state)."""
    _refuse_options(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes)
    out, lse = cpu_flash_forward(q, k, v, causal, softmax_scale)
    return out, lse, None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """flash-attn >= 2.6.3's ``_flash_attn_backward``: writes dq, dk, dv in place."""
    _refuse_options(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes)
    for dst, src in zip((dq, dk, dv), cpu_flash_backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale)):
        dst.copy_(src)


def _not_provided(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"flash_attn.{name} is not provided by bench_peers' CPU stand-in")

    return refuse


def install_flash_attn_stand_in() -> bool:
    """Provide the CPU ``flash_attn`` (module docstring) in this process when flash-attn is not
    installed; returns whether the stand-in is active. Idempotent."""
    current = sys.modules.get("flash_attn")
    if current is not None:
        return getattr(current, "_bench_peers_stand_in", False)
    if importlib.util.find_spec("flash_attn") is not None:
        return False  # the real package (CUDA kernels): left alone
    pkg = types.ModuleType("flash_attn")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    pkg.__path__ = []
    pkg.__version__ = "2.7.4"  # the signatures above are flash-attn >= 2.6.3's
    pkg._bench_peers_stand_in = True
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface.__spec__ = importlib.machinery.ModuleSpec("flash_attn.flash_attn_interface", None)
    iface._flash_attn_forward, iface._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward", "flash_attn_varlen_func"):
        setattr(iface, name, _not_provided(name))
    pkg.flash_attn_func = iface.flash_attn_func = _flash_attn_func
    pkg.flash_attn_varlen_func = iface.flash_attn_varlen_func
    pkg.flash_attn_interface = iface
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = pkg, iface
    return True


def sdpa_flash(q, k, v, causal: bool = False, **_: object) -> torch.Tensor:
    """Local attention of DeepSpeed's Ulysses: bshd in and out, F.scaled_dot_product_attention on the
    CPU flash kernel only (GQA by repeating K/V heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v = _expand_kv(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# On every rank: process groups, sides, one forward+backward


@dataclass
class Groups:
    """This rank's groups of one case (created on every rank, in the same order)."""

    cp: dist.ProcessGroup
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    cp_rank: int
    ulysses_rank: int
    ring_rank: int


def make_groups(R: int, U: int, timeout_s: float) -> Groups:
    """CP groups of ``R * U`` consecutive ranks, Ulysses innermost (``cp_rank = ring_rank * U +
    ulysses_rank``, the layout of seqpar, yunchang and diffusers), with a collective timeout so
    that a peer whose ranks disagree fails instead of hanging."""
    n, me, cp = dist.get_world_size(), dist.get_rank(), R * U
    timeout = timedelta(seconds=timeout_s)
    mine: dict[str, dist.ProcessGroup] = {}
    for base in range(0, n, cp):
        ranks = list(range(base, base + cp))
        named = [("cp", ranks)] + [("ulysses", ranks[r * U:(r + 1) * U]) for r in range(R)] + [
            ("ring", ranks[u::U]) for u in range(U)]
        for name, members in named:
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                mine[name] = group
    c = me % cp
    return Groups(mine["cp"], mine["ulysses"], mine["ring"], c, c % U, c // U)


class Side:
    """One implementation on this rank: which global tokens it holds (``positions``) and its
    ``attention(q, k, v) -> out`` on those tokens (bshd, ``[B, S_local, H(kv), D]``)."""

    name = "?"

    def __init__(self, case: Case, S: int, groups: Groups) -> None:
        self.case, self.S, self.groups = case, S, groups
        self.positions = self.placement()

    def placement(self) -> torch.Tensor:
        """Contiguous parts in CP rank order (``torch.tensor_split``: the first ``S % N`` one longer)."""
        return torch.tensor_split(torch.arange(self.S), self.case.ring * self.case.ulysses)[self.groups.cp_rank]

    def attention(self, q, k, v) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SeqparSide(Side):
    name = "seqpar"
    keep_head_shards = False

    def __init__(self, case: Case, S: int, groups: Groups) -> None:
        import seqpar

        self._seqpar = seqpar
        self.state = seqpar.ParallelState(case.ring, case.ulysses, keep_head_shards=self.keep_head_shards,
                                          checks=case.seqpar_checks)
        super().__init__(case, S, groups)

    def placement(self) -> torch.Tensor:
        return self._seqpar.shard_positions(self.S, self.state)

    def attention(self, q, k, v):
        return self._seqpar.attention(q, k, v, self.state, causal=self.case.causal, seq_len=self.S)

    def close(self) -> None:
        self.state.close()


class SeqparKeepSide(SeqparSide):
    """seqpar with ``ParallelState(keep_head_shards=True)``: the Ulysses backward sends only dout
    and the gradients (the peers' traffic), at the memory of the kept head shards."""

    name = "seqpar-keep"
    keep_head_shards = True


class DeepSpeedSide(Side):
    name = "deepspeed"

    def __init__(self, case: Case, S: int, groups: Groups) -> None:
        import deepspeed.comm
        from deepspeed.sequence.layer import DistributedAttention

        if case.ring != 1:
            raise NotImplementedError("DeepSpeed Ulysses has no ring")
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        self.attn = DistributedAttention(sdpa_flash, groups.ulysses, scatter_idx=2, gather_idx=1)
        super().__init__(case, S, groups)

    def attention(self, q, k, v):
        return self.attn(q, k, v, 0, None, causal=self.case.causal)  # batch_dim_idx=0, no rotary


class YunchangSide(Side):
    """yunchang: ``UlyssesAttention`` for Ulysses alone, ``LongContextAttention`` (USP) with a ring;
    its zig-zag ring (and placement, ``zigzag_extract_local``) when causal, the basic one otherwise."""

    name = "yunchang"

    def __init__(self, case: Case, S: int, groups: Groups) -> None:
        install_flash_attn_stand_in()
        from yunchang import LongContextAttention, UlyssesAttention
        from yunchang.globals import PROCESS_GROUP
        from yunchang.kernels import AttnType

        # yunchang reads its groups from a process-wide singleton; ours are set there for this side.
        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = groups.ulysses, groups.ring
        self.impl = "zigzag" if case.causal else "basic"
        if case.ring == 1:
            self.attn = UlyssesAttention(groups.ulysses, scatter_idx=2, gather_idx=1, attn_type=AttnType.FA)
        else:
            self.attn = LongContextAttention(ring_impl_type=self.impl, attn_type=AttnType.FA)
        super().__init__(case, S, groups)

    def placement(self) -> torch.Tensor:
        if self.case.ring == 1:
            return super().placement()
        from yunchang import EXTRACT_FUNC_DICT

        cp = self.case.ring * self.case.ulysses
        return EXTRACT_FUNC_DICT[self.impl](torch.arange(self.S)[None], self.groups.cp_rank, cp, self.case.ring,
                                            self.case.ulysses)[0]

    def attention(self, q, k, v):
        return self.attn(q, k, v, causal=self.case.causal)


class RingFlashAttnSide(Side):
    """ring-flash-attn: ``zigzag_ring_flash_attn_func`` when causal (its tests' placement: 2R
    ``torch.chunk`` chunks, rank r holds r and 2R-1-r), ``ring_flash_attn_func`` otherwise."""

    name = "ring-flash-attn"

    def __init__(self, case: Case, S: int, groups: Groups) -> None:
        install_flash_attn_stand_in()
        import ring_flash_attn

        if case.ulysses != 1:
            raise NotImplementedError("ring-flash-attn has no Ulysses")
        self.fn = ring_flash_attn.zigzag_ring_flash_attn_func if case.causal else ring_flash_attn.ring_flash_attn_func
        super().__init__(case, S, groups)

    def placement(self) -> torch.Tensor:
        if not self.case.causal:
            return super().placement()
        R, r = self.case.ring, self.groups.ring_rank
        chunks = torch.arange(self.S).chunk(2 * R)
        return torch.cat([chunks[r], chunks[2 * R - 1 - r]])

    def attention(self, q, k, v):
        return self.fn(q, k, v, causal=self.case.causal, group=self.groups.ring)


class TorchCpSide(Side):
    """torch's DTensor context parallelism: ``context_parallel`` shards the buffers (its load
    balancer picks the placement) and turns F.scaled_dot_product_attention into ring attention."""

    name = "torch-cp"

    def __init__(self, case: Case, S: int, groups: Groups) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        if case.ulysses != 1:
            raise NotImplementedError("torch's context_parallel is a ring only")
        n, cp = dist.get_world_size(), case.ring
        self.mesh = DeviceMesh("cpu", torch.arange(n).view(-1, cp), mesh_dim_names=("dp", "cp"))["cp"]
        super().__init__(case, S, groups)

    def _context(self, buffers, dims):
        from torch.distributed.tensor.experimental import context_parallel

        return context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=dims)

    def placement(self) -> torch.Tensor:
        pos = torch.arange(self.S)[None]
        with self._context([pos], [1]):
            return pos[0].clone()

    def attention(self, q, k, v):
        # context_parallel needs a buffer to shard: a dummy one; q, k, v are already the rank's shards.
        with self._context([torch.zeros(2 * self.case.ring)], [0]):
            return sdpa_flash(q, k, v, causal=self.case.causal)


class DiffusersSide(Side):
    """diffusers: ``dispatch_attention_fn`` with the native backend and a ``ParallelConfig`` of
    ``ContextParallelConfig(ring_degree=R, ulysses_degree=U)`` on a CPU device mesh."""

    name = "diffusers"

    def __init__(self, case: Case, S: int, groups: Groups) -> None:
        from diffusers import ContextParallelConfig
        from diffusers.models._modeling_parallel import ParallelConfig
        from torch.distributed.device_mesh import init_device_mesh

        n, cp = dist.get_world_size(), case.ring * case.ulysses
        mesh = init_device_mesh("cpu", (n // cp, case.ring, case.ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
        self.config = ParallelConfig(context_parallel_config=ContextParallelConfig(
            ring_degree=case.ring, ulysses_degree=case.ulysses))
        self.config.setup(dist.get_rank(), n, torch.device("cpu"), mesh=mesh["ring", "ulysses"])
        super().__init__(case, S, groups)

    def attention(self, q, k, v):
        from diffusers.models.attention_dispatch import (
            AttentionBackendName,
            dispatch_attention_fn,
        )
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return dispatch_attention_fn(q, k, v, is_causal=self.case.causal, backend=AttentionBackendName.NATIVE,
                                         parallel_config=self.config, enable_gqa=k.shape[2] != q.shape[2])


SIDES: dict[str, type[Side]] = {
    cls.name: cls for cls in (SeqparSide, SeqparKeepSide, DeepSpeedSide, YunchangSide, RingFlashAttnSide, TorchCpSide,
                              DiffusersSide)
}


def _local(full: list[torch.Tensor], positions: torch.Tensor) -> list[torch.Tensor]:
    """The rank's tokens of the full ``[B, S, ., D]`` q, k, v, dout; q, k, v as leaves needing grads."""
    local = [t.index_select(1, positions).contiguous() for t in full]
    return [t.requires_grad_() for t in local[:3]] + [local[3]]


def step(side: Side, local: list[torch.Tensor]) -> torch.Tensor:
    """One forward+backward of ``side`` on the rank's tokens; returns the output (detached)."""
    q, k, v, dout = local
    for t in (q, k, v):
        t.grad = None
    out = side.attention(q, k, v)
    out.backward(dout)
    return out.detach()


def _short(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# ---------------------------------------------------------------------------------------------
# Exactness (small shapes, float64 reference)


def reference(full: list[torch.Tensor], causal: bool) -> list[torch.Tensor]:
    """Single-device float64 attention of the full q, k, v: out, dq, dk, dv (GQA by repeating K/V)."""
    q, k, v, dout = (t.double() for t in full)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kk, vv = _expand_kv(q, k, v)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                         is_causal=causal).transpose(1, 2)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def check_rank(args: argparse.Namespace, case: Case, shape: dict, names: list[str]) -> dict:
    """On every rank: each side's max abs error (out, dq, dk, dv) on ``shape``, or why it failed."""
    torch.set_num_threads(1)
    S = shape["seq_len"]
    full = inputs((1, S), shape["heads"], shape["kv_heads"], shape["head_dim"], seed=1,
                  dtype=getattr(torch, args.check_dtype))
    want = reference(full, case.causal)
    groups = make_groups(case.ring, case.ulysses, args.check_timeout)
    found: dict[str, dict] = {}
    for name in names:
        side = None
        try:
            side = SIDES[name](case, S, groups)
            local = _local(full, side.positions)
            out = step(side, local)
            got = [out] + [t.grad for t in local[:3]]
            if any(g is None or g.shape != w.index_select(1, side.positions).shape for g, w in zip(got, want)):
                shapes = [None if g is None else tuple(g.shape) for g in got]
                raise ValueError(f"result shapes {shapes} do not match the {len(side.positions)} tokens it holds")
            err = max(float((g.double() - w.index_select(1, side.positions)).abs().max()) for g, w in zip(got, want))
            found[name] = {"err": err, "tokens": len(side.positions)}
        except Exception as exc:  # noqa: BLE001 - a peer's refusal is a result
            found[name] = {"error": _short(exc), "trace": traceback.format_exc()[-1500:]}
        finally:
            if side is not None:
                side.close()
        dist.barrier()  # the next side starts together (a failed peer's ranks may have left early)
    return found


def check_shapes(args: argparse.Namespace, case: Case) -> list[tuple[str, dict]]:
    """The even shape and the odd ones of the exactness check."""
    S, U = args.check_seq_len, case.ulysses
    even = {"seq_len": S, "heads": 8, "kv_heads": 8, "head_dim": 16}
    if getattr(args, "even_check_only", False):
        return [("even", even)]
    return [
        ("even", even),
        (f"odd length S={S + 1}", {**even, "seq_len": S + 1}),
        (f"H=5 (not divisible by U={U})" if U > 1 else "H=5", {**even, "heads": 5, "kv_heads": 5}),
        (f"GQA Hkv={max(1, U // 2)} < U={U}" if U > 1 else "GQA Hkv=1",
         {**even, "kv_heads": max(1, U // 2)}),
    ]


def combine_check(per_rank: list[dict], name: str, tol: float) -> dict:
    """Every rank's result of one side -> one verdict: ``ok`` / ``WRONG`` / ``refused``."""
    results = [r[name] for r in per_rank]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        # A rank that failed on its own is the cause; timeouts and closed connections are echoes.
        own = [e for e in errors if not any(s in e.lower() for s in ("timed out", "closed", "connection"))]
        return {"verdict": "refused", "reason": (own or errors)[0]}
    tokens = sum(r["tokens"] for r in results)
    err = max(r["err"] for r in results)
    return {"verdict": "ok" if err <= tol else "WRONG", "max_abs_err": err, "tokens_held": tokens}


def check_case(ranks: DistPool, args: argparse.Namespace, case: Case, names: list[str]) -> dict:
    """Every shape of the exactness check: each side's verdict (:func:`combine_check`).

    All sides of a shape run in one call; when a rank dies there (gloo aborts the process when
    ranks send different sizes -- a peer that assumes even splits), each side runs alone, and the
    one whose run kills a rank is reported as ``crashed``.
    """
    found = {}
    for shape_label, shape in check_shapes(args, case):
        progress("bench_peers", f"{case.label}: exactness, {shape_label}")
        try:
            per_rank = ranks.run(check_rank, args, case, shape, names)
            verdicts = {n: combine_check(per_rank, n, args.tol) for n in names}
        except DistributedError:
            verdicts = {}
            for n in names:
                try:
                    verdicts[n] = combine_check(ranks.run(check_rank, args, case, shape, [n]), n, args.tol)
                except DistributedError as exc:
                    dead = re.search(r"dead ranks: \[[^\]]*\]", str(exc))
                    verdicts[n] = {"verdict": "crashed", "reason": "a rank died, hung or lost its connections ("
                                   + (dead.group(0) if dead else str(exc).splitlines()[0][:200])
                                   + "; gloo aborts a rank whose peers send other sizes: see stderr)"}
        found[shape_label] = {"shape": shape, **verdicts}
    return found


# ---------------------------------------------------------------------------------------------
# Time and memory (the full shape)


def measure_rank(args: argparse.Namespace, case: Case, names: list[str]) -> dict:
    """On every rank: each side's peak bytes of a first forward+backward on a fresh build, then
    ``args.rounds`` interleaved timed rounds; per round the slowest rank's seconds."""
    torch.set_num_threads(1)
    S = args.seq_len
    full = inputs((1, S), args.heads, args.kv_heads, args.head_dim, dtype=getattr(torch, args.dtype))
    groups = make_groups(case.ring, case.ulysses, args.timeout)
    sides, locals_, peaks = {}, {}, {}
    for name in names:  # a fresh build's first call: everything it allocates and keeps is counted
        sides[name] = SIDES[name](case, S, groups)  # allocates no tensor: buffers come with the first call
        locals_[name] = _local(full, sides[name].positions)
        dist.barrier()
        with PeakMemory(torch.device("cpu")) as mem:
            step(sides[name], locals_[name])
        peaks[name] = mem.peak
    kept = sides["seqpar"].state.workspace.nbytes if "seqpar" in sides else None  # of the peak, kept for reuse
    timer = PhaseTimer(torch.device("cpu"), barrier=True)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            timer.start()
            step(sides[name], locals_[name])
            seconds[name].append(timer.stop()[0])
    for side in sides.values():
        side.close()
    cpu = torch.device("cpu")
    return {name: {"seconds": max_over_ranks(seconds[name], cpu), "peak": peaks[name],
                   "workspace": kept if name == "seqpar" else None} for name in names}


# ---------------------------------------------------------------------------------------------
# The parent


def _fmt_err(v: dict) -> str:
    if v["verdict"] in ("refused", "crashed"):
        return v["verdict"]
    return f"{v['max_abs_err']:.1e}" + (" WRONG" if v["verdict"] == "WRONG" else "")


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--world", type=int, default=4, help="local CPU ranks")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--peers", default=None, help="comma-separated peers to run (default: every installed one)")
    parser.add_argument("--seq-len", type=int, default=8192, help="global tokens S of the timed problem")
    parser.add_argument("--heads", type=int, default=8, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim D")
    parser.add_argument("--dtype", default="float32", help="dtype of the timed problem")
    parser.add_argument("--rounds", type=int, default=5, help="timed interleaved rounds after one untimed call")
    parser.add_argument("--check-seq-len", type=int, default=64,
                        help="S of the exactness check's even shape (the odd-length one uses S+1)")
    parser.add_argument("--check-dtype", default="float32", help="dtype of the exactness check's inputs")
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="max abs error (--check-dtype vs float64) judged exact; about 5e-2 for bfloat16")
    parser.add_argument("--check-timeout", type=float, default=30.0,
                        help="seconds a peer's collective may wait in the exactness check before it fails")
    parser.add_argument("--check-startup", type=float, default=120.0,
                        help="seconds the exactness check waits for its ranks to start (again after a peer killed one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="collective timeout of the timed runs (s)")
    parser.add_argument("--check-only", action="store_true", help="run the exactness check only")
    parser.add_argument("--seqpar-checks", default="auto", choices=["auto", "always", "never"],
                        help="ParallelState(checks=...) of the seqpar sides: 'auto' (the default) checks every "
                             "CPU call collectively (one small all-gather, a synchronisation point the peers do not "
                             "have); 'never' leaves it out")
    parser.add_argument("--even-check-only", action="store_true",
                        help="check exactness on the even shape only (no odd shapes: quicker, no peer crashes)")
    add_output_arguments(parser, "seqpar / peer time and memory ratios per case")
    args = parser.parse_args()

    keys = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in keys if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; valid: {', '.join(CASES)}")
    wanted = None if args.peers is None else {p.strip() for p in args.peers.split(",") if p.strip()}
    if wanted is not None and wanted - set(PEER_PACKAGES):
        raise SystemExit(f"--peers: unknown {sorted(wanted - set(PEER_PACKAGES))}; valid: {', '.join(PEER_PACKAGES)}")

    skipped: list[dict] = []  # peers not run, with the reason
    plan: list[tuple[Case, list[str]]] = []
    for key in keys:
        case = dataclasses.replace(CASES[key], seqpar_checks=args.seqpar_checks)
        cp = case.ring * case.ulysses
        if args.world % cp:
            skipped.append({"case": key, "peer": "*", "reason": f"needs a world divisible by {cp}, got {args.world}"})
            continue
        names = ["seqpar"]
        for peer in case.peers:
            if wanted is not None and peer not in wanted:
                continue
            reason = missing_reason(peer)
            if reason:
                skipped.append({"case": key, "peer": peer, "reason": reason})
            else:
                names.append(peer)
        plan.append((case, names))

    results: list[dict] = []
    # Local CPU ranks; a peer that kills a rank costs a respawn, so the pool is told to expect a quick one.
    with DistPool(args.world, timeout_s=args.check_timeout, startup_s=args.check_startup) as ranks:
        for case, names in plan:
            results.append({"case": case.key, "label": case.label, "ring": case.ring, "ulysses": case.ulysses,
                            "causal": case.causal, "exactness": check_case(ranks, args, case, names), "sides": {}})
    if not args.check_only:
        with Ranks(args.world, torchrun=False, timeout_s=args.timeout) as ranks:
            for entry, (case, names) in zip(results, plan):
                even = entry["exactness"]["even"]
                timed = [n for n in names if even[n]["verdict"] == "ok"]
                for n in names:
                    if n not in timed:
                        skipped.append({"case": case.key, "peer": n, "reason": "not timed: failed the exactness "
                                        "check (" + even[n].get("reason", f"max abs err {even[n].get('max_abs_err')}")
                                        + ")"})
                if "seqpar" not in timed or len(timed) < 2:
                    continue
                progress("bench_peers", f"{case.label}: memory, then {args.rounds} interleaved rounds of {timed}")
                per_rank = ranks.run(measure_rank, args, case, timed)
                for n in timed:
                    rounds = per_rank[0][n]["seconds"]  # already the slowest rank's, per round
                    entry["sides"][n] = {"median_s": statistics.median(rounds), "rounds_s": rounds,
                                         "peak_bytes_max_rank": max(r[n]["peak"] for r in per_rank)}
                entry["sides"]["seqpar"]["workspace_bytes_max_rank"] = max(r["seqpar"]["workspace"] for r in per_rank)
                base = entry["sides"]["seqpar"]
                keep = entry["sides"].get("seqpar-keep")
                for n in timed[1:]:
                    side = entry["sides"][n]
                    side["time_seqpar_over_peer"] = base["median_s"] / side["median_s"]
                    side["memory_seqpar_over_peer"] = base["peak_bytes_max_rank"] / side["peak_bytes_max_rank"]
                    if keep is not None and n != "seqpar-keep":
                        side["time_seqpar_keep_over_peer"] = keep["median_s"] / side["median_s"]
                        side["memory_seqpar_keep_over_peer"] = keep["peak_bytes_max_rank"] / side["peak_bytes_max_rank"]

    rows = []
    for e in results:
        for n, side in e["sides"].items():
            if n == "seqpar":
                continue
            for mine, suffix in (("seqpar", ""), ("seqpar-keep", "_keep")):
                if f"time_seqpar{suffix}_over_peer" not in side:
                    continue
                ours = e["sides"][mine]
                rows.append([e["label"], f"{mine} / {n}", f"{side[f'time_seqpar{suffix}_over_peer']:.2f}",
                             f"{side[f'memory_seqpar{suffix}_over_peer']:.2f}",
                             f"{ours['median_s'] * 1e3:.0f}", f"{side['median_s'] * 1e3:.0f}",
                             f"{ours['peak_bytes_max_rank'] / 2**20:.1f}",
                             f"{e['sides']['seqpar']['workspace_bytes_max_rank'] / 2**20:.1f}",
                             f"{side['peak_bytes_max_rank'] / 2**20:.1f}"])
    check_rows = []
    for e in results:
        for shape_label, verdicts in e["exactness"].items():
            for n in (k for k in verdicts if k != "shape"):
                v = verdicts[n]
                check_rows.append([e["label"], shape_label, n, _fmt_err(v), v.get("reason", "")[:110]])
    text = ""
    if rows:
        text += (f"time and memory, seqpar / peer (< 1: seqpar faster / smaller); S={args.seq_len} H={args.heads} "
                 f"Hkv={args.kv_heads} D={args.head_dim} {args.dtype}, fwd+bwd, {args.world} ranks, median of "
                 f"{args.rounds} interleaved rounds\n"
                 + table(["case", "ours / peer", "time ratio", "memory ratio", "ours ms", "peer ms", "ours MiB",
                          "seqpar workspace", "peer MiB"], rows) + "\n\n")
    text += (f"exactness: max abs error of out, dq, dk, dv ({args.check_dtype}) vs one-device float64, "
             f"S={args.check_seq_len} "
             f"H=8 D=16 unless stated\n"
             + table(["case", "shape", "side", "max abs err", "reason"], check_rows))
    if skipped:
        text += "\n\nnot run:\n" + table(["case", "peer", "reason"], [[s["case"], s["peer"], s["reason"]]
                                                                     for s in skipped])
    notes = [
        ("time: the slowest rank's forward+backward, median over interleaved rounds; memory: peak tensor bytes "
         "of one forward+backward on a freshly built side (seqpar's state.workspace and any buffer a peer keeps "
         "included; 'of which workspace': seqpar's state.workspace, kept and reused by every later call and "
         "layer on the state), busiest rank"),
        ("every side runs torch's CPU flash kernel; yunchang and ring-flash-attn through this script's CPU "
         "flash-attn stand-in (see --help)"),
        None if args.check_only or args.rounds >= 3 else
        f"WARNING: median over only {args.rounds} round(s); use --rounds 3 or more for stable ratios",
        time_sharing_warning(args.world, usable_cores(), "cpu"),
    ]
    report = {"benchmark": "peers", "world": args.world, "args": vars(args), "cores": usable_cores(),
              "results": results, "not_run": skipped}
    labels = [f"{e['label']}: {n}" for e in results for n in e["sides"] if n != "seqpar"]
    plot = chart_panels(
        args.plot,
        f"seqpar / peer, S={args.seq_len} H={args.heads} D={args.head_dim} {args.dtype}, fwd+bwd, "
        f"{args.world} CPU ranks (< 1: seqpar better)",
        labels,
        [Panel("time, seqpar / peer (lower is better)",
               {"time": [s["time_seqpar_over_peer"] for e in results for n, s in e["sides"].items() if n != "seqpar"]},
               reference_line=1.0),
         Panel("memory, seqpar / peer (lower is better)",
               {"memory": [s["memory_seqpar_over_peer"] for e in results for n, s in e["sides"].items()
                           if n != "seqpar"]}, reference_line=1.0)],
    ) if labels else None
    emit(report, text, notes, args.json, plot=plot)


if __name__ == "__main__":
    main()
