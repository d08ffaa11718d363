"""The Ulysses backward takes over the saved token shards and frees each once it is sent (Note
[Saved tensors handed over] in ``seqpar/saved.py``), and its incoming dout once exchanged (Note
[Dout exchanged first] in ``seqpar/parallel/hybrid.py``).

On 1 x U and 2 x 2 splits (U = 2, 3, 4) with GQA and an odd length, float64 against the
single-device reference: the token shards of q, k, v, out and dout are gone when the kernels run;
with ``retain_graph=True`` q, k, v and out are kept and a second backward gives the same
gradients; under ``save_on_cpu`` and non-reentrant checkpointing (other saved-tensor hooks) the
hand-over stands aside and results stay exact, while dout still goes; a saved tensor modified in
place raises; ring-only states and ``keep_head_shards`` do not use the hand-over. Joint attention
(replicated text rows, 1 x 3, 1 x 4, 2 x 2, with and without ``keep_head_shards``) frees dout too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import seqpar
import seqpar.parallel.ulysses as ulysses_mod
from seqpar import ParallelState
from seqpar.backends import reference_attention
from seqpar.saved import HandOver

S, H, HKV, D = 37, 6, 2, 8


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(1, S, h, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV, H)]


def _reference():
    q, k, v, dout = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*leaves, causal=True)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def _run(state, mode: str) -> dict:
    """One call on leaves through a scalar multiply (saves nothing), so the token shards attention
    saves are held by attention alone and its incoming gradient by autograd alone; whether the
    token shards of q, k, v, out and dout its backward received (the tensors it sends first) are
    still alive when the kernels run."""
    q, k, v, dout = (seqpar.shard(t, state) for t in _inputs())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    alive: list[list[bool]] = []
    received: list[StorageWeakRef] = []
    original_kernels, original_exchange = ulysses_mod.heads_backward, ulysses_mod.UlyssesSetup.to_heads_each

    def spy_exchange(self, xs, kinds, **kwargs):
        if kinds == "q":  # dout, exchanged first by its own node (Note [Dout exchanged first])
            received[:] = [StorageWeakRef(xs[0].untyped_storage())]
        if kinds == "qkkq":  # the backward's exchange of q, k, v, out
            received[:] = [StorageWeakRef(t.untyped_storage()) for t in xs] + received[-1:]
        return original_exchange(self, xs, kinds, **kwargs)

    def spy_kernels(*args, **kwargs):
        alive.append([not r.expired() for r in received])
        return original_kernels(*args, **kwargs)

    def layer(a, b, c):
        return seqpar.attention(*(t.mul(1.0) for t in (a, b, c)), state, causal=True, seq_len=S).mul(1.0)

    ulysses_mod.heads_backward, ulysses_mod.UlyssesSetup.to_heads_each = spy_kernels, spy_exchange
    try:
        if mode == "inplace":
            out = seqpar.attention(*(t.mul(1.0) for t in leaves), state, causal=True, seq_len=S)
            out.add_(1.0)  # the output is saved for the backward
            try:
                out.backward(dout)
            except RuntimeError as e:
                return {"error": str(e)}
            return {"error": None}
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                y = layer(*leaves)
        elif mode == "checkpoint":
            y = checkpoint(layer, *leaves, use_reentrant=False)
        else:
            y = layer(*leaves)
        if mode == "retain":
            y.backward(dout, retain_graph=True)
            first = [t.grad.clone() for t in leaves]
            y.backward(dout)
            grads = [t.grad - f for t, f in zip(leaves, first)]  # the second backward alone
        else:
            y.backward(dout)
            grads = [t.grad for t in leaves]
    finally:
        ulysses_mod.heads_backward, ulysses_mod.UlyssesSetup.to_heads_each = original_kernels, original_exchange
    _, ref_grads = _reference()
    want = [seqpar.shard(t, state) for t in ref_grads]
    err = max((a - b).abs().max().item() for a, b in zip(grads, want))
    return {"err": err, "alive": alive}


def _rank(mode: str) -> list[tuple[str, dict]]:
    n = dist.get_world_size()
    splits = [(1, n)] + ([(2, 2)] if n == 4 else [])
    results = []
    for R, U in splits:
        state = ParallelState(R, U)
        results.append((f"{R}x{U}", _run(state, mode)))
        state.close()
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_token_shards_freed_when_the_kernels_run(pools, world):
    for rank, results in enumerate(pools(world).run(_rank, "plain")):
        for split, r in results:
            assert r["err"] < 1e-10, (rank, split, r)
            # q, k, v, out and dout of the one call: all freed before the head shards' backward.
            assert r["alive"] == [[False] * 5], (rank, split, r)


@pytest.mark.parametrize("mode", ["retain", "save_on_cpu", "checkpoint"])
def test_kept_graph_and_other_hooks_keep_results_exact(pools, mode):
    for rank, results in enumerate(pools(3).run(_rank, mode)):
        for split, r in results:
            assert r["err"] < 1e-10, (rank, split, r)
            # dout is autograd's incoming gradient, freed once exchanged whatever holds the rest.
            if mode == "retain":  # kept for the second backward, handed over by it (no retain_graph)
                assert r["alive"] == [[True] * 4 + [False], [False] * 5], (rank, split, r)
            if mode == "checkpoint":  # the checkpoint's hooks own them: held as without the hand-over
                assert r["alive"] == [[True] * 4 + [False]], (rank, split, r)


def test_a_saved_tensor_modified_in_place_raises(pools):
    for rank, results in enumerate(pools(2).run(_rank, "inplace")):
        for split, r in results:
            assert r["error"] is not None and "inplace" in r["error"], (rank, split, r)


def test_hand_over_stands_aside_under_other_hooks():
    assert HandOver().active
    with torch.autograd.graph.save_on_cpu():
        assert not HandOver().active


def _rank_not_used(keep: bool, R: int) -> int:
    """How many hand-overs a call of this state makes."""
    import importlib

    attention_mod = importlib.import_module("seqpar.attention")  # the module, not the function

    made = []
    original = attention_mod.HandOver

    class Counting(original):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    attention_mod.HandOver = Counting
    try:
        state = ParallelState(R, dist.get_world_size() // R, keep_head_shards=keep)
        q, k, v, dout = (seqpar.shard(t, state).requires_grad_() for t in _inputs())
        seqpar.attention(q, k, v, state, causal=True, seq_len=S).backward(dout.detach())
        state.close()
    finally:
        attention_mod.HandOver = original
    return len(made)


def test_only_ulysses_without_kept_head_shards_hands_over(pools):
    assert pools(2).run(_rank_not_used, False, 1) == [1, 1]
    assert pools(2).run(_rank_not_used, True, 1) == [0, 0]  # the head shards are saved instead
    assert pools(2).run(_rank_not_used, False, 2) == [0, 0]  # the ring needs q, k, v, out throughout


def _rank_joint(keep: bool) -> list[tuple[str, dict]]:
    """Joint attention (replicated text rows, no hand-over): whether the incoming token-sharded
    dout is alive when the kernels run (Note [Dout exchanged first]), and the error against the
    single-device float64 reference. The layer's output goes through a scalar multiply, so its
    incoming dout is held by autograd alone; each rank's loss counts the replicated rows
    ``1 / cp`` times, and the gradients of the whole tensors are summed over the group."""
    n, P = dist.get_world_size(), 5
    splits = [(1, n)] + ([(2, 2)] if n == 4 else [])
    gen = torch.Generator().manual_seed(5)
    full = [torch.cat([torch.randn(1, P, t.shape[2], D, generator=gen, dtype=torch.float64), t], 1) for t in _inputs()]
    ref = [t.clone().requires_grad_() for t in full[:3]]
    reference_attention(*ref).backward(full[3])
    results = []
    for R, U in splits:
        state = ParallelState(R, U, keep_head_shards=keep)

        def local(t):  # the replicated text rows, then this rank's shard of the rest
            return torch.cat([t[:, :P], seqpar.shard(t[:, P:], state)], 1)

        leaves = [t.clone().requires_grad_() for t in full[:3]]
        weight = torch.ones(P + S, dtype=torch.float64)
        weight[:P] = 1 / state.cp_size
        dout = local(full[3] * weight[None, :, None, None])
        received: list[StorageWeakRef] = []
        alive: list[bool] = []
        original_kernels = ulysses_mod.heads_backward

        def spy_kernels(*args, **kwargs):
            alive.append(not received[0].expired())
            return original_kernels(*args, **kwargs)

        out = seqpar.attention(*(local(t) for t in leaves), state, replicated_prefix=P)
        out.register_hook(lambda g: received.append(StorageWeakRef(g.untyped_storage())))  # the incoming dout
        y = out.mul(1.0)
        del out
        ulysses_mod.heads_backward = spy_kernels
        try:
            y.backward(dout)
        finally:
            ulysses_mod.heads_backward = original_kernels
        for t in leaves:
            dist.all_reduce(t.grad)
        err = max((t.grad - r.grad).abs().max().item() for t, r in zip(leaves, ref))
        results.append((f"{R}x{U}", {"err": err, "alive": alive}))
        state.close()
    return results


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("world", [3, 4])
def test_joint_attention_frees_dout_before_the_kernels(pools, world, keep):
    for rank, results in enumerate(pools(world).run(_rank_joint, keep)):
        for split, r in results:
            assert r["err"] < 1e-10, (rank, split, keep, r)
            assert r["alive"] == [False], (rank, split, keep, r)
