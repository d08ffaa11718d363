"""Every mask and score option against a float64 single-device reference, forward and backward.

Sliding windows (shorter than a zig-zag chunk, spanning several chunks, longer than the sequence,
bidirectional), chunked attention (alone and with a window), softcapping, attention sinks, and
joint attention with replicated text tokens before and/or after the sharded ones -- under ring,
Ulysses and hybrid states on 1-4 ranks (3 included), odd lengths, uneven heads and GQA, dense and
packed. Gradients of the global leaves (and sinks) are summed over the CP group (partial-gradient
convention) and compared with the reference's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _common import quick_up_to
import seqpar
from seqpar import ParallelState
from seqpar.backends.reference import reference_attention, reference_varlen_attention

_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}

# name: options for seqpar.attention / the reference. Zig-zag chunks of the 61-token sequence are
# 7-31 tokens long depending on the ring size.
_DENSE_OPTIONS = {
    "window < chunk": dict(causal=True, window=(3, 0)),
    "window spans chunks": dict(causal=True, window=(20, -1)),
    "window > sequence": dict(causal=True, window=(100, 0)),
    "bidirectional window": dict(causal=False, window=(4, 6)),
    "one-sided window": dict(causal=False, window=(-1, 2)),
    "chunked causal": dict(causal=True, chunk_size=8),
    "chunked + window": dict(causal=True, chunk_size=16, window=(5, 0)),
    "chunked bidirectional": dict(causal=False, chunk_size=13),
    "softcap causal": dict(causal=True, softcap=3.0),
    "softcap + window": dict(causal=True, window=(9, 0), softcap=2.0),
    "sinks causal": dict(causal=True, sinks=True),
    "sinks + window + softcap": dict(causal=True, window=(6, 0), softcap=4.0, sinks=True),
    "joint prefix": dict(prefix=5),
    "joint suffix": dict(suffix=4),
    "joint both + sinks": dict(prefix=3, suffix=2, sinks=True),
    "joint + softcap": dict(prefix=4, softcap=3.0),
}
_PACKED_OPTIONS = {
    "window": dict(causal=True, window=(4, 0)),
    "window > documents": dict(causal=True, window=(70, 0)),
    "bidirectional window": dict(causal=False, window=(3, 2)),
    "chunked causal": dict(causal=True, chunk_size=5),
    "softcap": dict(causal=True, softcap=2.5),
    "sinks + window": dict(causal=True, window=(6, 0), sinks=True),
}
_HEADS = [(6, 2), (3, 1), (4, 4), (8, 2)]


def _grads(out, leaves, dout):
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def _dense_case(state: ParallelState, c: dict) -> tuple[str, float, float]:
    opts = dict(c["options"])
    prefix, suffix = opts.pop("prefix", 0), opts.pop("suffix", 0)
    with_sinks = opts.pop("sinks", False)
    B, S, (H, Hkv), D, dtype = c["B"], c["S"], c["heads"], 8, c["dtype"]
    gen = torch.Generator().manual_seed(c["seed"])
    L = prefix + S + suffix
    full = [torch.randn(B, L, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) if with_sinks else None
    leaves = [t.to(dtype).double().requires_grad_() for t in full[:3]]
    if sinks is not None:
        leaves.append(sinks.clone().requires_grad_())
    ref = reference_attention(*leaves[:3], sinks=leaves[3] if with_sinks else None, **opts)
    ref_grads = _grads(ref, leaves, full[3])

    def local(t):  # replicated text, then this rank's shard of the rest
        body = seqpar.shard(t[:, prefix:prefix + S], state, dim=1)
        return torch.cat([t[:, :prefix], body, t[:, prefix + S:]], 1)

    mine = [t.detach().to(dtype).requires_grad_() for t in full[:3]]
    if sinks is not None:
        mine.append(sinks.clone().to(dtype).requires_grad_())
    out = seqpar.attention(
        *(local(t) for t in mine[:3]), state, sinks=mine[3] if with_sinks else None,
        replicated_prefix=prefix, replicated_suffix=suffix, seq_len=S if c["seq_len"] else None,
        backend=c["backend"], **opts,
    )
    assert out.dtype == dtype and out.shape == local(mine[0]).shape
    # This rank's loss share: its own rows, plus 1/cp of the replicated rows (counted once).
    weight = torch.ones(out.shape[1], dtype=torch.float64)
    weight[:prefix] = weight[out.shape[1] - suffix:] = 1 / state.cp_size
    dout = local(full[3]) * weight[None, :, None, None]
    grads = _grads(out, mine, dout.to(dtype))
    for g in grads:
        dist.all_reduce(g, group=state.cp_group)
    err = (out.double() - local(ref.detach())).abs().max().item()
    err = max([err] + [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)])
    scale = max(1.0, max(r.abs().max().item() for r in (ref, *ref_grads)))
    return c["name"], err / scale, _TOL[dtype]


def _dense_cases(configs, seed):
    cases = []
    for i, (name, options) in enumerate(_DENSE_OPTIONS.items()):
        for j, RU in enumerate(configs):
            k = i + j + seed
            cases.append(dict(
                RU=RU, name=f"{RU} {name}", options=options, B=1 + k % 2, S=61 if k % 3 else 37,
                heads=_HEADS[k % len(_HEADS)], dtype=torch.float64 if k % 2 else torch.float32,
                backend="reference" if k % 5 == 0 else "auto", seq_len=k % 2 == 0, seed=k,
            ))
    return cases


def _rank_dense(cases):
    states = {}
    out = []
    for c in cases:
        if c["RU"] not in states:
            states[c["RU"]] = ParallelState(*c["RU"])
        out.append(_dense_case(states[c["RU"]], c))
    return out


_WORLDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1), (1, 4)]}


@pytest.mark.parametrize("world", quick_up_to(3, sorted(_WORLDS)))
def test_dense_masks(pools, world):
    cases = _dense_cases(_WORLDS[world], seed=world)
    for rank, results in enumerate(pools(world).run(_rank_dense, cases)):
        assert len(results) == len(cases)
        for name, err, tol in results:
            assert err <= tol, f"rank {rank}: {name}: error {err:.3g} > {tol:.3g}"


def _packed_case(state: ParallelState, c: dict) -> tuple[str, float, float]:
    opts = dict(c["options"])
    with_sinks = opts.pop("sinks", False)
    lens, (H, Hkv), D, dtype = c["lens"], c["heads"], 8, c["dtype"]
    gen = torch.Generator().manual_seed(c["seed"])
    T = sum(lens)
    full = [torch.randn(T, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) if with_sinks else None
    leaves = [t.to(dtype).double().requires_grad_() for t in full[:3]]
    if sinks is not None:
        leaves.append(sinks.clone().requires_grad_())
    ref = reference_varlen_attention(*leaves[:3], lens, sinks=leaves[3] if with_sinks else None, **opts)
    ref_grads = _grads(ref, leaves, full[3])
    mine = [t.detach().to(dtype).requires_grad_() for t in full[:3]]
    if sinks is not None:
        mine.append(sinks.clone().to(dtype).requires_grad_())
    out = seqpar.varlen_attention(
        *(seqpar.shard_packed(t, state, lens) for t in mine[:3]), state, lens,
        sinks=mine[3] if with_sinks else None, backend=c["backend"], **opts,
    )
    grads = _grads(out, mine, seqpar.shard_packed(full[3], state, lens).to(dtype))
    for g in grads:
        dist.all_reduce(g, group=state.cp_group)
    err = (out.double() - seqpar.shard_packed(ref.detach(), state, lens)).abs().max().item() if out.numel() else 0.0
    err = max([err] + [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)])
    return c["name"], err, _TOL[dtype]


_MIXES = [[9, 0, 23, 1, 2, 40, 5], [61], [3, 3, 3, 30, 1, 17], [1, 1, 2, 0, 44]]


def _rank_packed(cases):
    states = {}
    out = []
    for c in cases:
        if c["RU"] not in states:
            states[c["RU"]] = ParallelState(*c["RU"])
        out.append(_packed_case(states[c["RU"]], c))
    return out


@pytest.mark.parametrize("world", quick_up_to(3, [2, 3, 4]))
def test_packed_masks(pools, world):
    cases = []
    for i, (name, options) in enumerate(_PACKED_OPTIONS.items()):
        for j, RU in enumerate(_WORLDS[world]):
            k = i + j + world
            cases.append(dict(
                RU=RU, name=f"{RU} {name}", options=options, lens=_MIXES[k % len(_MIXES)],
                heads=_HEADS[k % len(_HEADS)], dtype=torch.float64 if k % 2 else torch.float32,
                backend="reference" if k % 4 == 0 else "auto", seed=k,
            ))
    for rank, results in enumerate(pools(world).run(_rank_packed, cases)):
        assert len(results) == len(cases)
        for name, err, tol in results:
            assert err <= tol, f"rank {rank}: {name}: error {err:.3g} > {tol:.3g}"


def test_single_process_options_match_reference():
    """``ParallelState()`` without a process group runs every option exactly, in every layout."""
    state = ParallelState()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 23, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    for options in (dict(causal=True, window=(5, 0), softcap=2.0), dict(chunk_size=6), dict(window=(2, 2))):
        want = reference_attention(q, k, v, sinks=sinks, **options)
        for layout, dim in (("bshd", 1), ("sbhd", 0), ("bhsd", 2)):
            perm = {"bshd": (0, 1, 2, 3), "sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3)}[layout]
            got = seqpar.attention(*(t.permute(perm) for t in (q, k, v)), state, sinks=sinks,
                                   layout=layout, **options).permute(perm)
            assert (got - want).abs().max() < 1e-12, (options, layout)
