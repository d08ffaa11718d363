"""Head-parallel token mixing (``seqpar.mixing``, issue #43 item 1): exact against one device.

Each case builds float64 inputs, applies a pure-torch mixer to the whole sequence on one device
(the reference), and runs the same mixer through ``seqpar.mixing.head_parallel`` on token shards:
outputs, input gradients (exact on their own rank) and parameter gradients (summed over the CP
group) must match to float64 rounding. Mixers: a causal depthwise conv1d (``causal_conv1d``), a
gated linear recurrence with grouped K heads (a scan), a per-head cumulative sum with two trailing
dims. Heads that do not divide the group, fewer heads than ranks, odd and packed lengths.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar import ParallelState
from seqpar.mixing import HeadShard, causal_conv1d, head_parallel

TIMEOUT = timedelta(seconds=60)


# --- pure-torch reference mixers (one device, whole sequences) -----------------------------------


def _bounds(seq_lens, total):
    """(start, stop) of every sequence; one sequence of ``total`` tokens when not packed."""
    if seq_lens is None:
        return [(0, total)]
    out, pos = [], 0
    for n in seq_lens:
        out.append((pos, pos + n))
        pos += n
    return out


def _cu_lens(cu_seqlens):
    return None if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def conv_ref(x, weight, bias, seq_lens=None):
    """Depthwise causal conv1d + SiLU by ``F.conv1d``, one sequence at a time. x: [B, S, C] or [T, C]."""
    xb = x if seq_lens is None else x[None]
    K = weight.shape[-1]
    pieces = []
    for a, b in _bounds(seq_lens, xb.shape[1]):
        seg = xb[:, a:b].transpose(1, 2)  # [B, C, n]
        y = F.conv1d(F.pad(seg, (K - 1, 0)), weight[:, None], bias, groups=x.shape[-1])
        pieces.append(y.transpose(1, 2))
    out = F.silu(torch.cat(pieces, 1))
    return out if seq_lens is None else out[0]


def scan_ref(q, k, v, a, seq_lens=None):
    """h_t = a_t h_{t-1} + k_t v_t^T (per V head, reset at each sequence start), o_t = q_t^T h_t.

    q, k: [B, S, Hk, Dk] (packed [T, Hk, Dk]); v: [B, S, Hv, Dv]; a: [B, S, Hv]; K head j serves
    V heads j*G .. j*G+G-1 (``repeat_interleave``)."""
    if seq_lens is not None:
        q, k, v, a = (t[None] for t in (q, k, v, a))
    G = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)
    outs = []
    for s0, s1 in _bounds(seq_lens, q.shape[1]):
        h = q.new_zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3])
        for t in range(s0, s1):
            h = a[:, t, :, None, None] * h + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], h))
    out = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return out if seq_lens is None else out[0]


def cumsum_ref(x, g, seq_lens=None):
    """Gated running sum within each sequence. x: [B, S, H, 2, 3]; g: [B, S, H] (packed without B)."""
    if seq_lens is not None:
        x, g = x[None], g[None]
    y = x * g[..., None, None]
    out = torch.cat([y[:, a:b].cumsum(1) for a, b in _bounds(seq_lens, x.shape[1])], 1)
    return out if seq_lens is None else out[0]


def kcum_ref(k, seq_lens=None):
    """Running sum of k within each sequence (an output with the grouped heads of k)."""
    kb = k if seq_lens is None else k[None]
    out = torch.cat([kb[:, a:b].cumsum(1) for a, b in _bounds(seq_lens, kb.shape[1])], 1)
    return out if seq_lens is None else out[0]


# --- the cases ------------------------------------------------------------------------------------


def _inputs(kind, B, S, seq_lens, dims, param_only=False):
    """Full float64 inputs (leaves), parameters and the reference outputs of case ``kind``."""
    g = torch.Generator().manual_seed(1234)
    lead = (S,) if seq_lens is not None else (B, S)

    def rnd(*shape, low=None):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        if low is not None:
            t = low + (1 - low) * torch.rand(*shape, generator=g, dtype=torch.float64)
        return t

    if kind == "conv":
        C, K = dims["C"], dims["K"]
        xs = [rnd(*lead, C).requires_grad_(not param_only)]
        params = [rnd(C, K).requires_grad_(), rnd(C).requires_grad_()]
    elif kind == "scan":
        Hk, Hv, Dk, Dv = dims["Hk"], dims["Hv"], 3, 2
        xs = [rnd(*lead, Hk, Dk), rnd(*lead, Hk, Dk), rnd(*lead, Hv, Dv), rnd(*lead, Hv, low=0.5)]
        xs = [x.requires_grad_() for x in xs]
        params = [rnd(Hv).requires_grad_()]
    else:
        H = dims["H"]
        xs = [rnd(*lead, H, 2, 3).requires_grad_(), rnd(*lead, H).requires_grad_()]
        params = []
    return xs, params


def _reference(kind, xs, params, seq_lens):
    if kind == "conv":
        return (conv_ref(xs[0], params[0], params[1], seq_lens),)
    if kind == "scan":
        gain = params[0]
        return (scan_ref(*xs, seq_lens) * gain[:, None], kcum_ref(xs[1], seq_lens))
    return (cumsum_ref(*xs, seq_lens),)


def _sharded(kind, xs, params, state, seq_len, seq_lens, dims):
    kw = dict(seq_len=seq_len) if seq_lens is None else dict(seq_lens=seq_lens)
    if kind == "conv":
        return (causal_conv1d(xs[0], params[0], params[1], state, activation="silu", **kw),)
    if kind == "scan":
        Hk, Hv = dims["Hk"], dims["Hv"]
        hd = 1 if seq_lens is not None else 2

        def fn(shard: HeadShard, q, k, v, a):
            assert shard.count >= 1  # never called without heads
            q1, k1 = shard.expand(q, Hk, hd), shard.expand(k, Hk, hd)
            o = scan_ref(q1, k1, v, a, _cu_lens(shard.cu_seqlens)) * shard.narrow(params[0])[:, None]
            return o, kcum_ref(k, _cu_lens(shard.cu_seqlens))

        return head_parallel(fn, xs, state, out_heads=[Hv, Hk], **kw)

    def fn(shard, x, g):
        return cumsum_ref(x, g, _cu_lens(shard.cu_seqlens))

    return (head_parallel(fn, xs, state, **kw),)


def _shard(x, state, seq_lens):
    return seqpar.shard(x, state, dim=1) if seq_lens is None else seqpar.shard_packed(x, state, seq_lens, dim=0)


def _max_err(a, b):
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _run_case(state, kind, B, S, seq_lens, dims, exchange_length=False, param_only=False):
    """Max errors (outputs, input gradients, parameter gradients) of one case on this rank."""
    xs, params = _inputs(kind, B, S, seq_lens, dims, param_only)
    ref = _reference(kind, xs, params, seq_lens)
    g = torch.Generator().manual_seed(99)
    weights = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in ref]
    sum((r * w).sum() for r, w in zip(ref, weights)).backward()

    local = [_shard(x.detach(), state, seq_lens).requires_grad_(x.requires_grad) for x in xs]
    mine = [p.detach().clone().requires_grad_() for p in params]
    seq_len = None if exchange_length or seq_lens is not None else S
    outs = _sharded(kind, local, mine, state, seq_len, seq_lens, dims)
    sum((o * _shard(w, state, seq_lens)).sum() for o, w in zip(outs, weights)).backward()

    err = {"out": max(_max_err(o, _shard(r.detach(), state, seq_lens)) for o, r in zip(outs, ref))}
    err["dx"] = max(
        [_max_err(x.grad, None if r.grad is None else _shard(r.grad, state, seq_lens)) for x, r in zip(local, xs)],
        default=0.0,
    )
    dp = 0.0
    for p, r in zip(mine, params):
        total = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(total, group=state.cp_group)  # partial gradients sum to the exact one
        dp = max(dp, _max_err(total, r.grad))
    err["dparam"] = dp
    return err


CASES = [  # (kind, B, S, seq_lens, dims, options)
    ("conv", 2, 37, None, dict(C=5, K=4), {}),
    ("conv", 2, 5, None, dict(C=3, K=4), dict(exchange_length=True)),
    ("conv", 1, 37, (5, 17, 1, 14), dict(C=5, K=3), {}),
    ("conv", 2, 37, None, dict(C=3, K=4), dict(param_only=True)),  # x needs no gradient
    ("scan", 2, 37, None, dict(Hk=2, Hv=6), {}),
    ("scan", 2, 5, None, dict(Hk=1, Hv=3), {}),
    ("scan", 1, 37, (5, 17, 1, 14), dict(Hk=2, Hv=6), {}),
    ("cumsum", 2, 37, None, dict(H=5), {}),
    ("cumsum", 2, 37, None, dict(H=1), {}),
    ("cumsum", 1, 29, (11, 0, 3, 15), dict(H=3), {}),
]


def _cases(ring, ulysses, cases):
    state = ParallelState(ring, ulysses, timeout=TIMEOUT)
    try:
        return [_run_case(state, kind, B, S, lens, dims, **opts) for kind, B, S, lens, dims, opts in cases]
    finally:
        state.close()


def _check(results, cases, split):
    for rank, per_case in enumerate(results):
        for case, err in zip(cases, per_case):
            for what, e in err.items():
                assert e < 1e-12, (split, rank, case[:5], what, e)


def test_exact_ring2_ulysses2(pools):
    _check(pools(4).run(_cases, 2, 2, CASES), CASES, (2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("ring,ulysses", [(1, 4), (4, 1), (1, 3), (3, 1), (2, 1), (1, 2)])
def test_exact_every_split(pools, ring, ulysses):
    _check(pools(ring * ulysses).run(_cases, ring, ulysses, CASES), CASES, (ring, ulysses))


# --- one process ----------------------------------------------------------------------------------


def test_one_rank_is_the_mixer_itself():
    x = torch.randn(2, 7, 3, 4, dtype=torch.float64)
    out = head_parallel(lambda shard, t: t.cumsum(1) * (shard.count == 3), [x], ParallelState())
    torch.testing.assert_close(out, x.cumsum(1), rtol=0, atol=0)


def test_head_shard_groups_heads():
    # 6 heads over 4 ranks: [2, 2, 1, 1]; 2 grouped heads (G = 3): rank 1 holds heads 2, 3 and
    # reads grouped heads 0 and 1.
    shard = HeadShard(6, 2, 2, (5,), None, 1, 4)
    assert shard.heads_of(2) == (0, 2) and shard.heads_of(6) == (2, 2) and shard.heads_of(3) == (1, 1)
    k = torch.tensor([[10.0, 20.0]])  # [.., grouped heads 0 and 1]
    assert shard.expand(k, 2, 1).tolist() == [[10.0, 20.0]]
    assert shard.narrow(torch.arange(6.0)).tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="does not divide|cannot be grouped"):
        shard.heads_of(4)


def test_bad_inputs_raise_with_the_sizes():
    state = ParallelState()
    with pytest.raises(ValueError, match="tensors\\[1\\] has 4 heads, which does not divide heads=6"):
        head_parallel(lambda s, a, b: a, [torch.zeros(1, 3, 6, 2), torch.zeros(1, 3, 4, 2)], state)
    with pytest.raises(ValueError, match="does not match tensors\\[0\\]"):
        head_parallel(lambda s, a, b: a, [torch.zeros(1, 3, 6), torch.zeros(1, 4, 6)], state)
    with pytest.raises(ValueError, match="holds 3 tokens, but seq_len=4"):
        head_parallel(lambda s, a: a, [torch.zeros(1, 3, 2)], state, seq_len=4)
    with pytest.raises(ValueError, match="expected \\[B, S, h, ...\\]"):
        head_parallel(lambda s, a: a[:, :, :1], [torch.zeros(1, 3, 2)], state)
    with pytest.raises(ValueError, match="weight must be \\[C, K\\]"):
        causal_conv1d(torch.zeros(1, 3, 4), torch.zeros(3, 2), None, state)


# --- refusals on every rank -----------------------------------------------------------------------


def _boom_on(rank):
    def fn(shard, x):
        if shard.cp_rank == rank:
            raise RuntimeError("boom")
        return x

    return fn


def _refusals(ring, ulysses):
    state = ParallelState(ring, ulysses, timeout=TIMEOUT)
    me = state.cp_rank
    x = seqpar.shard(torch.randn(2, 11, 5, 3), state)
    calls = {
        "fn raises on the last rank": lambda: head_parallel(_boom_on(state.cp_size - 1), [x], state, seq_len=11),
        "wrong heads on rank 1": lambda: head_parallel(
            lambda s, t: torch.cat([t, t], 2) if s.cp_rank == 1 else t, [x], state, seq_len=11),
        "rank 0 one token long": lambda: head_parallel(
            lambda s, t: t, [torch.cat([x, x[:, :1]], 1) if me == 0 else x], state, seq_len=11),
        "rank 2 other heads": lambda: head_parallel(lambda s, t: t, [x[:, :, :4] if me == 2 else x], state),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    state.close()
    return out


def test_refusals_raise_on_every_rank(pools):
    results = pools(4).run(_refusals, 2, 2)
    for rank, per in enumerate(results):
        for name, msg in per.items():
            assert msg is not None, (rank, name)
        last = rank == 3
        assert per["fn raises on the last rank"] == (
            "RuntimeError: boom" if last else per["fn raises on the last rank"]), rank
        assert last or "fn failed on cp rank 3" in per["fn raises on the last rank"], per
        assert "fn failed on cp rank 1" in per["wrong heads on rank 1"] or (
            rank == 1 and "output 0 on cp rank 1 has shape" in per["wrong heads on rank 1"]), (rank, per)
        assert "hold [4, 2, 3, 3] tokens" in per["rank 0 one token long"], per
        assert "places [3, 2, 3, 3]" in per["rank 0 one token long"], per
        assert "other tensors or options than cp rank 0" in per["rank 2 other heads"], per
