"""docs/coming-from.md: every "seqpar, coming from X" block runs as written and is exact.

The page's blocks are fenced ```py, not ```python: tests/test_docs.py runs ```python blocks on
their own, and these need the peer's shards and groups set up first (here); the "before" blocks
need the peers' packages.

Each block runs on 4 gloo ranks with the names its peer's script has (``q``, ``k``, ``v`` as this
rank's shard in the peer's own placement and layout, the group, ``P`` / ``R`` / ``U``); its ``out``
and the gradients of q, k, v at those tokens equal one device's float64 attention. The peers'
placements are built here from their rules (contiguous slices; ``torch.chunk`` into ``2R``
chunks, rank ``r`` taking ``r`` and ``2R - 1 - r``; then a contiguous Ulysses split), so a block
that only worked in seqpar's own placement would fail: the page says they coincide when the
length divides evenly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

PAGE = Path(__file__).resolve().parents[1] / "docs" / "coming-from.md"
S, H, HKV, D, B = 16, 8, 2, 8, 2  # 2R x U divides S for every split below; GQA 8 / 2
# peer -> (ring, ulysses, layout of its q, k, v)
PEERS = {
    "deepspeed": (1, 4, "bshd"),
    "yunchang": (2, 2, "bshd"),
    "ring-flash-attn": (4, 1, "bshd"),
    "torch context_parallel": (4, 1, "bhsd"),
}


def _blocks() -> dict[str, str]:
    text = PAGE.read_text()
    out = {}
    for body in re.findall(r"```py\n(.*?)```", text, flags=re.S):
        first = body.splitlines()[0]
        if first.startswith("# seqpar, coming from "):
            out[first.removeprefix("# seqpar, coming from ").strip()] = body
    return out


def _positions(ring: int, ulysses: int, rank: int) -> torch.Tensor:
    """The peer's placement: zig-zag over 2R torch.chunk chunks, then a contiguous Ulysses split."""
    r, u = divmod(rank, ulysses)
    chunks = torch.arange(S).chunk(2 * ring)
    ring_local = torch.cat([chunks[r], chunks[2 * ring - 1 - r]]) if ring > 1 else torch.arange(S)
    return ring_local.chunk(ulysses)[u]


def _reference():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV, H))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True).transpose(1, 2)
    out.backward(dout)
    return [t.detach() for t in (q, k, v, dout, out, q.grad, k.grad, v.grad)]


def _run(blocks: dict[str, str], ref) -> dict[str, float]:
    q_full, k_full, v_full, dout_full, *want = ref
    errors = {}
    for peer, code in blocks.items():
        ring, ulysses, layout = PEERS[peer]
        pos = _positions(ring, ulysses, dist.get_rank())
        to = (lambda t: t.transpose(1, 2)) if layout == "bhsd" else (lambda t: t)
        q, k, v = (to(t.index_select(1, pos)).contiguous().requires_grad_() for t in (q_full, k_full, v_full))
        names = {"q": q, "k": k, "v": v, "P": ring * ulysses, "R": ring, "U": ulysses,
                 "group": dist.group.WORLD, "sp_group": dist.group.WORLD, "F": F}
        exec(compile(code, f"docs/coming-from.md ({peer})", "exec"), names)  # noqa: S102 - the page's code
        try:
            out = to(names["out"])
            out.backward(dout_full.index_select(1, pos))
            got = [out, to(q.grad), to(k.grad), to(v.grad)]
            errors[peer] = max((a - b.index_select(1, pos)).abs().max().item() for a, b in zip(got, want))
        finally:
            names["state"].close()
    return errors


def test_every_peer_has_a_block():
    assert set(_blocks()) == set(PEERS)


@pytest.mark.slow
def test_coming_from_blocks_run_exactly_in_the_peers_placement(pools):
    per_rank = pools(4).run(_run, _blocks(), _reference())
    for rank, errors in enumerate(per_rank):
        assert set(errors) == set(PEERS), errors
        for peer, err in errors.items():
            assert err < 1e-10, (rank, peer, err)
