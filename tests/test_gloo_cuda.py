"""CUDA tensors over a gloo group: the ring refuses on every rank with a ValueError naming the fix.

gloo sends host memory only; a CUDA tensor handed to its point-to-point send fails inside gloo
("writev ... Bad address") on one rank while the peer sees the connection close (measured on an
H200 with two gloo ranks sharing the GPU). The all-to-all of Ulysses runs on CUDA tensors over gloo.
"""

import pytest
import torch

from seqpar.tools.testing import DistPool

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ring_on_cuda(ring: int, ulysses: int):
    import seqpar
    from seqpar import ParallelState, shard
    from seqpar.backends.reference import reference_attention

    torch.cuda.set_device(0)
    state = ParallelState(ring, ulysses)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 37, 4, 16, generator=g) for _ in range(3))
        ref = reference_attention(q, k, v, causal=True)
        try:
            out = seqpar.attention(*(shard(x, state).cuda() for x in (q, k, v)), state, seq_len=37, causal=True)
        except ValueError as e:
            return str(e)
        return (out.cpu() - shard(ref, state)).abs().max().item()
    finally:
        state.close()


def test_ring_refuses_cuda_tensors_on_gloo_and_ulysses_runs():
    with DistPool(2, timeout_s=60) as pool:
        ring = pool.run(_ring_on_cuda, 2, 1)
        ulysses = pool.run(_ring_on_cuda, 1, 2)
    assert all(isinstance(r, str) and "gloo" in r and "NCCL" in r for r in ring), ring
    assert ring[0] == ring[1]
    assert all(isinstance(e, float) and e < 1e-5 for e in ulysses), ulysses
