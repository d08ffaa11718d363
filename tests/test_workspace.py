"""The workspace of a state (seqpar.comm.workspace, Note [Workspace]) and what attention keeps.

Fresh buffers per call by default (nothing kept between calls); with ``keep=True`` one arena per
device, handed out inside scopes only, roles of one scope in disjoint slices, every scope reusing
the arena from its start. Attention is exact either way (float64 reference, forward and backward,
ring, Ulysses and hybrid on 3 and 4 ranks, GQA, odd lengths), and with the default a state holds
no bytes between calls.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar import ParallelState
from seqpar.backends import reference_attention
from seqpar.comm import Workspace

CPU = torch.device("cpu")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_default_keeps_nothing():
    ws = Workspace()
    with ws.scope():
        a = ws.get("a", (4, 5), torch.float32, CPU)
        b = ws.get("a", (4, 5), torch.float32, CPU)
    assert a.shape == (4, 5) and a.dtype == torch.float32
    assert _storage(a) != _storage(b)  # fresh tensors
    assert ws.nbytes == 0


def test_arena_outside_scope_is_fresh():
    ws = Workspace(keep=True)
    a = ws.get("a", (8,), torch.float32, CPU)
    assert ws.nbytes == 0 and a.untyped_storage().nbytes() == 32


def test_arena_roles_share_across_scopes_not_within():
    ws = Workspace(keep=True)
    with ws.scope():  # the first scope only sizes the arena
        ws.get("x", (100,), torch.float32, CPU)
        ws.get("y", (10, 3), torch.float64, CPU)
    kept = ws.nbytes
    assert kept >= 400 + 240, kept
    with ws.scope():
        x = ws.get("x", (100,), torch.float32, CPU)
        y = ws.get("y", (10, 3), torch.float64, CPU)
        x.fill_(1.0)
        y.fill_(2.0)
        assert (x == 1.0).all() and (y == 2.0).all()  # disjoint slices
        assert _storage(x) == _storage(y)  # one arena
        again = ws.get("x", (50,), torch.float32, CPU)  # a role asked for again: its own slice
        assert again.data_ptr() == x.data_ptr()
    with ws.scope():  # another scope (e.g. the backward) starts from the arena's start
        z = ws.get("z", (160,), torch.float32, CPU)
        assert z.data_ptr() == x.data_ptr()
    assert ws.nbytes == kept  # no growth: the largest scope sizes it
    with ws.scope():
        ws.get("big", (1000,), torch.float32, CPU)  # too large: fresh now, the arena grows after
    assert ws.nbytes >= 4000
    ws.clear()
    assert ws.nbytes == 0


def test_arena_alignment_and_dtypes():
    ws = Workspace(keep=True)
    for _ in range(2):
        with ws.scope():
            a = ws.get("a", (3,), torch.bfloat16, CPU)
            b = ws.get("b", (5,), torch.float64, CPU)
    assert b.data_ptr() % 8 == 0 and a.dtype == torch.bfloat16 and b.shape == (5,)


def _rank_exact(keep: bool, packed: bool) -> dict:
    """Ring, Ulysses and hybrid calls against float64 references; what the state keeps."""
    import torch.distributed as dist

    n = dist.get_world_size()
    configs = [(n, 1), (1, n)] + ([(2, 2)] if n == 4 else [])
    errors, kept = [], []
    for R, U in configs:
        for H, Hkv in ((6, 2), (5, 5)):
            state = ParallelState(R, U)
            state.workspace = Workspace(keep=keep)
            g = torch.Generator().manual_seed(7)
            S, D = 37, 8
            lens = [11, 26]
            q, k, v, dout = (torch.randn(1, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            if packed:
                outs, off = [], 0
                for n_tok in lens:
                    part = [t[:, off:off + n_tok] for t in ref]
                    outs.append(reference_attention(*part, causal=True))
                    off += n_tok
                ref_out = torch.cat(outs, 1)
            else:
                ref_out = reference_attention(*ref, causal=True)
            ref_out.backward(dout)
            for _ in range(2):  # the second call runs on a sized arena
                if packed:
                    local = [seqpar.shard_packed(t[0], state, lens).requires_grad_() for t in (q, k, v)]
                    out = seqpar.varlen_attention(*local, state, lens, causal=True)
                    out.backward(seqpar.shard_packed(dout[0], state, lens))
                    want = [seqpar.shard_packed(t[0], state, lens) for t in (ref_out.detach(), *(r.grad for r in ref))]
                else:
                    local = [seqpar.shard(t, state).requires_grad_() for t in (q, k, v)]
                    out = seqpar.attention(*local, state, causal=True, seq_len=S)
                    out.backward(seqpar.shard(dout, state))
                    want = [seqpar.shard(t, state) for t in (ref_out.detach(), *(r.grad for r in ref))]
                got = [out.detach(), *(t.grad for t in local)]
                errors.append(max((a - b).abs().max().item() for a, b in zip(got, want)))
            kept.append(state.workspace.nbytes)
            state.close()
    return {"err": max(errors), "kept": kept}


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.slow
def test_attention_exact_with_either_workspace(pools, world, keep, packed):
    for rank, r in enumerate(pools(world).run(_rank_exact, keep, packed)):
        assert r["err"] < 1e-10, (rank, r)
        if keep:
            assert all(b > 0 for b in r["kept"]), (rank, r)
        else:
            assert all(b == 0 for b in r["kept"]), (rank, r)
