"""torch.compile(fullgraph=True) of models calling seqpar: equal to eager, forward and backward.

``fullgraph=True`` makes any graph break an error. ``aot_eager`` runs everywhere; ``inductor``
needs a C++ compiler and runs where one is found. Multi-rank cases use gloo on CPU (worlds 3 and
4: ring, Ulysses with uneven heads, hybrid).
"""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqpar
from seqpar import ParallelState

pytestmark = pytest.mark.slow  # long multi-rank runs: not in the quick subset

_HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None
_BACKENDS = ["aot_eager"] + (["inductor"] if _HAS_COMPILER else [])


class _Block(nn.Module):
    """Projections around one seqpar call (dense, windowed, joint or packed) or an SDPA call."""

    def __init__(self, state: ParallelState, kind: str, dim: int = 24, heads: int = 6, kv_heads: int = 3):
        super().__init__()
        self.state, self.kind, self.heads, self.kv_heads = state, kind, heads, kv_heads
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)
        self.sinks = nn.Parameter(torch.randn(heads) * 0.5)

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.head_dim)
        k, v = self.kv(x).view(B, S, 2, self.kv_heads, self.head_dim).unbind(2)
        st = self.state
        if self.kind == "causal":
            o = seqpar.attention(q, k, v, st, causal=True, sinks=self.sinks)
        elif self.kind == "window":
            o = seqpar.attention(q, k, v, st, window=(4, 3), softcap=5.0, backend="reference")
        elif self.kind == "joint":
            o = seqpar.attention(q, k, v, st, replicated_prefix=3, sinks=self.sinks)
        elif self.kind == "bhsd":
            o = seqpar.attention(*(t.transpose(1, 2) for t in (q, k, v)), st, causal=True, layout="bhsd")
            o = o.transpose(1, 2)
        elif self.kind == "packed":
            o = seqpar.varlen_attention(q[0], k[0], v[0], st, seq_lens, causal=True, chunk_size=5)[None]
        elif self.kind == "sdpa":  # the caller opens parallel_sdpa around the (compiled) call
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, 2) for t in (k, v))
            o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            o = o.transpose(1, 2)
        else:
            raise AssertionError(self.kind)
        return self.o(o.reshape(B, S, -1))


def _inputs(state: ParallelState, kind: str):
    g = torch.Generator().manual_seed(3)
    if kind == "packed":
        lens = [7, 1, 13, 10]
        full = torch.randn(1, sum(lens), 24, generator=g)
        return seqpar.shard_packed(full, state, lens, dim=1), torch.tensor(lens)
    S = 29
    full = torch.randn(2, S, 24, generator=g)
    if kind == "joint":  # 3 replicated text tokens, then this rank's shard of 26 image tokens
        return torch.cat([full[:, :3], seqpar.shard(full[:, 3:], state)], 1), None
    return seqpar.shard(full, state), None


def _compare(R: int, U: int, kinds: list[str], backends: list[str]) -> dict[str, float]:
    state = ParallelState(R, U)
    errors = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = _Block(state, kind)
        x, lens = _inputs(state, kind)
        x = x.requires_grad_()
        extra = () if lens is None else (lens,)
        context = (lambda: seqpar.parallel_sdpa(state)) if kind == "sdpa" else contextlib.nullcontext
        with context():
            eager = model(x, *extra)
        want = torch.autograd.grad(eager.square().sum(), [x, *model.parameters()], allow_unused=True)
        for backend in backends:
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            for _ in range(2):  # the second call runs the cached graph
                with context():
                    out = compiled(x, *extra)
                got = torch.autograd.grad(out.square().sum(), [x, *model.parameters()], allow_unused=True)
            err = (out - eager).abs().max().item()
            for a, b in zip(got, want):
                if b is not None:
                    err = max(err, (a - b).abs().max().item() / max(1.0, b.abs().max().item()))
            errors[f"{kind}/{backend}"] = err
    state.close()
    return errors


_KINDS = ["causal", "window", "joint", "bhsd", "packed", "sdpa"]


def test_graph_holds_the_seqpar_operator():
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    targets = set()

    def record(gm, _):
        targets.update(str(node.target) for node in gm.graph.nodes)
        return make_boxed_func(gm.forward)

    state = ParallelState()
    for kind in ("causal", "packed", "sdpa"):
        model = _Block(state, kind)
        x, lens = _inputs(state, kind)
        context = (lambda: seqpar.parallel_sdpa(state)) if kind == "sdpa" else contextlib.nullcontext
        with context():
            out = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=record))(
                x.requires_grad_(), *(() if lens is None else (lens,))
            )
        out.sum().backward()
    assert {"seqpar.attention.default", "seqpar.varlen_attention.default"} <= targets, targets
    assert {"seqpar.attention_backward.default", "seqpar.varlen_attention_backward.default"} <= targets, targets


def test_compiled_single_process():
    # aot_eager runs every kind; inductor (a C++ build per graph, seconds each on a cold cache) the
    # three entry points: seqpar.attention, seqpar.varlen_attention and parallel_sdpa.
    errors = _compare(1, 1, _KINDS, _BACKENDS[:1])
    errors.update(_compare(1, 1, ["causal", "packed", "sdpa"], _BACKENDS[1:]))
    assert len(errors) == len(_KINDS) + 3 * (len(_BACKENDS) - 1) and all(e < 1e-4 for e in errors.values()), errors


@pytest.mark.parametrize("R,U,kinds", [
    (2, 2, ["causal", "joint", "packed", "sdpa"]),
    (4, 1, ["window", "bhsd"]),
])
def test_compiled_multi_rank_world4(pools, R, U, kinds):
    for rank, errors in enumerate(pools(4).run(_compare, R, U, kinds, ["aot_eager"])):
        assert len(errors) == len(kinds) and all(e < 1e-4 for e in errors.values()), (rank, errors)


def test_compiled_multi_rank_world3(pools):
    # Ulysses 3 over 6 query / 3 KV heads: the grouped heads split unevenly; the dense call with
    # inductor where a compiler is found (packed: aot_eager, as in the world-4 matrix).
    dense = pools(3).run(_compare, 1, 3, ["causal"], _BACKENDS[-1:])
    packed = pools(3).run(_compare, 1, 3, ["packed"], _BACKENDS[:1])
    per_rank = zip(dense, packed)
    for rank, (dense, packed) in enumerate(per_rank):
        errors = {**dense, **packed}
        assert len(errors) == 2 and all(e < 1e-4 for e in errors.values()), (rank, errors)


def _wrong_seq_len_on_one_rank() -> str:
    state = ParallelState(1, 3)
    x = torch.randn(1, 5, 2, 4)
    fn = torch.compile(lambda t, n: seqpar.attention(t, t, t, state, causal=True, seq_len=n),
                       fullgraph=True, backend="aot_eager")
    try:
        fn(x, 16 if state.cp_rank == 1 else 15)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        state.close()


def test_compiled_call_still_checks_on_every_rank(pools):
    # The operator runs the eager checks: a wrong seq_len on one rank raises on every rank.
    for rank, msg in enumerate(pools(3).run(_wrong_seq_len_on_one_rank)):
        assert "seqpar.attention" in msg, (rank, msg)
