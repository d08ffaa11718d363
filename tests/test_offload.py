"""Activation offload around seqpar attention (docs/long-context.md): exact, on several CP splits.

``torch.autograd.graph.save_on_cpu`` keeps every tensor autograd saves in (pinned) host memory
and copies it back for backward; with activation checkpointing what is saved is each layer's
input only. seqpar's attention saves plain tensors (no custom pack hooks), so both compose.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import seqpar
from seqpar import ParallelState
from seqpar.backends import reference_attention


class _Layer(nn.Module):
    def __init__(self, state: ParallelState, dim: int = 16, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.state, self.heads, self.kv_heads, self.hd = state, heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.out = nn.Linear(dim, dim)
        self.mlp = seqpar.training.TiledTokenwise(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                                nn.Linear(4 * dim, dim)), 3)

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, -1, self.hd).split([self.heads, self.kv_heads, self.kv_heads], 2)
        if self.state is None:  # the whole sequence on one device
            a = reference_attention(q, k, v, causal=True)
        else:
            a = seqpar.attention(q, k, v, self.state, causal=True, seq_len=seq_len)
        x = x + self.out(a.reshape(B, S, -1))
        return x + self.mlp(x)


def _rank_offload(splits: list[tuple[int, int]]) -> list[float]:
    errors = []
    for ring, uly in splits:
        state = ParallelState(ring_size=ring, ulysses_size=uly)
        torch.manual_seed(0)
        layers = nn.ModuleList([_Layer(state) for _ in range(2)]).double()
        S = 29
        x = torch.randn(1, S, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        local = seqpar.shard(x, state)

        def run(offload: bool):
            h = local.clone().requires_grad_()
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload else None
            with ctx if ctx is not None else torch.enable_grad():
                y = h
                for layer in layers:
                    y = checkpoint(layer, y, S, use_reentrant=False)
            (y ** 2).sum().backward()
            grads = [h.grad] + [p.grad.clone() for p in layers.parameters()]
            layers.zero_grad(set_to_none=True)
            return y.detach(), grads

        y0, g0 = run(False)
        y1, g1 = run(True)
        err = (y0 - y1).abs().max().item()
        err = max([err] + [(a - b).abs().max().item() for a, b in zip(g0, g1)])
        # Against the whole sequence on one device: outputs, and parameter gradients summed over CP.
        for layer in layers:
            layer.state = None
        h = x.clone().requires_grad_()
        y = h
        for layer in layers:
            y = layer(y, S)
        (y ** 2).sum().backward()
        err = max(err, (seqpar.unshard(y1, state, size=S) - y.detach()).abs().max().item())
        err = max(err, (g1[0] - seqpar.shard(h.grad, state)).abs().max().item())
        for g, p in zip(g1[1:], layers.parameters()):
            dist.all_reduce(g, group=state.cp_group)
            err = max(err, (g - p.grad).abs().max().item())
        errors.append(err)
        state.close()
    dist.barrier()
    return errors


@pytest.mark.parametrize("world, splits", [(1, [(1, 1)]), (3, [(3, 1), (1, 3)]), (4, [(2, 2)])])
def test_offloaded_checkpoints_are_exact(pools, world, splits):
    for rank, errors in enumerate(pools(world).run(_rank_offload, splits)):
        assert max(errors) < 1e-12, f"rank {rank}: {splits}: {errors}"
