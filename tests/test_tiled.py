"""Tiled token-wise work (seqpar.tiled): exact against the untiled computation, and lighter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seqpar.tiled import TiledTokenwise, linear_cross_entropy_sum
from seqpar.tools.profiling import StorageTracker


def _problem(T=37, hidden=16, V=53, dtype=torch.float64, ignore=(3, 10, 36), seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, hidden, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(V, hidden, generator=gen, dtype=dtype, requires_grad=True)
    target = torch.randint(0, V, (T,), generator=gen)
    target[list(ignore)] = -100
    return h, w, target


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 100, None])
def test_linear_cross_entropy_sum_matches_untiled(chunk_size):
    h, w, target = _problem()
    got = linear_cross_entropy_sum(h, w, target, chunk_size=chunk_size)
    want = F.cross_entropy(h @ w.t(), target, ignore_index=-100, reduction="sum")
    assert abs(got.item() - want.item()) < 1e-10
    g = torch.autograd.grad(got * 0.7, (h, w))
    r = torch.autograd.grad(want * 0.7, (h, w))
    assert max((a - b).abs().max().item() for a, b in zip(g, r)) < 1e-10


def test_linear_cross_entropy_sum_all_ignored_and_float32():
    h, w, target = _problem(T=6, ignore=range(6))
    out = linear_cross_entropy_sum(h, w, target, chunk_size=4)
    assert out.item() == 0.0
    assert torch.equal(torch.autograd.grad(out, h)[0], torch.zeros_like(h))
    h, w, target = _problem(dtype=torch.float32)
    got = linear_cross_entropy_sum(h, w, target, chunk_size=8)
    want = F.cross_entropy(h.double() @ w.double().t(), target, reduction="sum")
    assert abs(got.item() - want.item()) < 1e-4 * abs(want.item())


@pytest.mark.parametrize("bad, match", [
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(target=torch.full((37,), 53)), r"label 53 is outside \[0, 53\)"),
    (dict(target=torch.zeros(36, dtype=torch.long)), r"one per token"),
    (dict(weight=torch.randn(53, 15, dtype=torch.float64)), "the same hidden_size"),
])
def test_linear_cross_entropy_sum_refuses(bad, match):
    h, w, target = _problem()
    args = dict(target=target, weight=w, chunk_size=None) | bad
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy_sum(h, args["weight"], args["target"], chunk_size=args["chunk_size"])


def test_linear_cross_entropy_sum_holds_no_full_logits():
    T, V, hidden = 2048, 2000, 16
    h = torch.randn(T, hidden, requires_grad=True)
    w = torch.randn(V, hidden, requires_grad=True)
    target = torch.randint(0, V, (T,))
    peaks = []
    for fn in (lambda: F.cross_entropy(h @ w.t(), target, reduction="sum"),
               lambda: linear_cross_entropy_sum(h, w, target, chunk_size=T // 16)):
        with StorageTracker() as mem:
            fn().backward()
        peaks.append(mem.peak)
    logits_bytes = T * V * 4
    assert peaks[0] >= logits_bytes  # the untiled loss holds the [T, V] logits
    assert peaks[1] < peaks[0] / 8, peaks


class _SwiGLU(nn.Module):
    def __init__(self, dim=12, hidden=40):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.gate, self.down = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        x = self.norm(x)
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("num_chunks, dim, shape", [(1, -2, (2, 9, 12)), (4, -2, (2, 9, 12)), (20, -2, (1, 9, 12)),
                                                      (3, 0, (11, 2, 12))])
def test_tiled_tokenwise_matches_untiled(num_chunks, dim, shape):
    torch.manual_seed(0)
    mlp = _SwiGLU().double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(*shape, dtype=torch.float64)
    want = mlp(x)
    ref = torch.autograd.grad(want, (x, *mlp.parameters()), dout)
    tiled = TiledTokenwise(mlp, num_chunks, dim=dim)
    got = tiled(x)
    assert (got - want).abs().max().item() < 1e-12
    grads = torch.autograd.grad(got, (x, *mlp.parameters()), dout)
    assert max((a - b).abs().max().item() for a, b in zip(grads, ref)) < 1e-12
    with torch.no_grad():
        assert (tiled(x) - want).abs().max().item() < 1e-12
    assert list(tiled.parameters()) == list(mlp.parameters())


def test_tiled_tokenwise_lowers_the_peak():
    mlp = _SwiGLU(dim=32, hidden=512)
    x = torch.randn(1, 4096, 32, requires_grad=True)
    peaks = []
    for m in (mlp, TiledTokenwise(mlp, 8)):
        with StorageTracker() as mem:
            m(x).sum().backward()
        peaks.append(mem.peak)
    intermediate = 4096 * 512 * 4  # one [S, hidden] fp32 activation of the untiled MLP
    assert peaks[0] - peaks[1] > 2 * intermediate, peaks


@pytest.mark.parametrize("bad, match", [(dict(module=lambda x: x), "must be a torch.nn.Module"),
                                        (dict(num_chunks=0), "num_chunks must be a positive int")])
def test_tiled_tokenwise_refuses(bad, match):
    args = dict(module=nn.Identity(), num_chunks=2) | bad
    with pytest.raises(ValueError, match=match):
        TiledTokenwise(args["module"], args["num_chunks"])


# ---------------------------------------------------------------------------------------------
# seqpar.training.linear_cross_entropy: the CP loss share on top of the tiled sum


def _rank_linear_ce(splits: list[tuple[int, int]], chunk_size: int | None) -> list[float]:
    import torch.distributed as dist

    import seqpar
    from seqpar.training import linear_cross_entropy, shift_labels

    errors = []
    for ring, uly in splits:
        state = seqpar.ParallelState(ring_size=ring, ulysses_size=uly)
        gen = torch.Generator().manual_seed(5)
        B, S, Hd, V = 2, 37, 8, 29
        hidden = torch.randn(B, S, Hd, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(V, Hd, generator=gen, dtype=torch.float64, requires_grad=True)
        ids = torch.randint(0, V, (B, S), generator=gen)
        ids[0, 4] = -100
        labels = shift_labels(ids)
        want = F.cross_entropy(hidden.reshape(-1, Hd) @ weight.t(), labels.reshape(-1), reduction="mean")
        ref_dh, ref_dw = torch.autograd.grad(want, (hidden, weight))
        h_local = seqpar.shard(hidden.detach(), state).requires_grad_()
        share = linear_cross_entropy(h_local, weight, seqpar.shard(labels, state), state, chunk_size=chunk_size)
        dh, dw = torch.autograd.grad(share, (h_local, weight))
        total, dw_sum = share.detach().clone(), dw.clone()
        dist.all_reduce(total, group=state.cp_group)  # the shares add up to the loss
        dist.all_reduce(dw_sum, group=state.cp_group)  # replicated weight: partial gradients
        errors.append(max(abs(total.item() - want.item()), (dw_sum - ref_dw).abs().max().item(),
                          (dh - seqpar.shard(ref_dh, state)).abs().max().item()))
        state.close()
    return errors


@pytest.mark.parametrize("world, splits", [(1, [(1, 1)]), (3, [(3, 1), (1, 3)]), (4, [(2, 2), (4, 1)])])
def test_linear_cross_entropy_share_matches_one_device(pools, world, splits):
    for chunk_size in (None, 3):
        for rank, errors in enumerate(pools(world).run(_rank_linear_ce, splits, chunk_size)):
            assert max(errors) < 1e-12, f"rank {rank}, splits {splits}, chunk {chunk_size}: {errors}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_sum_backward_holds_one_weight_gradient(dtype):
    """The backward's peak: the fp32 weight-gradient accumulator, its cast (bf16) and one chunk --
    never a second ``[V, hidden]`` product per chunk (``dw += g.T @ h`` allocated one)."""
    T, V, hidden, chunk = 64, 4096, 256, 8
    h = torch.randn(T, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(V, hidden, dtype=dtype, requires_grad=True)
    target = torch.randint(0, V, (T,))
    loss = linear_cross_entropy_sum(h, w, target, chunk_size=chunk)
    with StorageTracker() as mem:
        loss.backward()
    e = torch.empty((), dtype=dtype).element_size()
    dw = V * hidden * (4 + (e if dtype != torch.float32 else 0))  # fp32 accumulator, its cast
    one_chunk = chunk * V * (4 + 4 + e) + chunk * hidden * 8  # logits, softmax-grad, its cast, rows
    assert dw + T * hidden * e <= mem.peak <= dw + T * hidden * e + one_chunk, (mem.peak, dw)
