"""State passing for linear recurrences (``seqpar.mixing.state_passing``, issue #43 item 2).

Each case builds float64 inputs and runs a per-token reference recurrence on one device (written
here from the recurrence's definition, sequence by sequence, from the given initial states). The
same recurrence runs on token shards by state passing and head-parallel: outputs, final states,
input gradients (exact on their rank) and parameter / initial-state gradients (summed over the CP
group) must match to float64 rounding, and both modes must agree. Adapters: the gated delta rule
(grouped K heads, the model's gate parameters, L2 norm), scalar-decay linear attention (Mamba2 SSD
form with A_log / dt_bias / D, and the plain lightning form), Mamba1's selective scan; plus the
halo-exchange causal conv1d. Dense odd lengths (37, 5) with batch 2, packed sequences (with empty
and one-token ones).
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar import ParallelState
from seqpar.mixing import (
    GatedDeltaRule,
    ScalarDecayAttention,
    SelectiveScan,
    causal_conv1d_halo,
    recurrence_head_parallel,
    state_passing,
)

TIMEOUT = timedelta(seconds=60)


# --- one-device references, token by token ---------------------------------------------------------


def _bounds(seq_lens, total):
    if seq_lens is None:
        return [(0, total)]
    out, pos = [], 0
    for n in seq_lens:
        out.append((pos, pos + n))
        pos += n
    return out


def _scan(step, tensors, h_init, seq_lens, zero_state):
    """Run ``step(h, *token_slices) -> (h, out)`` over every sequence; ``(outputs, finals)``."""
    xs = [t if seq_lens is None else t[None] for t in tensors]
    outs, finals = [], []
    for s, (a, b) in enumerate(_bounds(seq_lens, xs[0].shape[1])):
        h = zero_state() if h_init is None else (h_init if seq_lens is None else h_init[s:s + 1])
        for t in range(a, b):
            h, o = step(h, *(x[:, t] for x in xs))
            outs.append(o)
        finals.append(h)
    out = torch.stack(outs, 1)
    return (out if seq_lens is None else out[0]), (finals[0] if seq_lens is None else torch.cat(finals))


def gdn_ref(q, k, v, g, beta, A_log, dt_bias, h0, seq_lens):
    H, Dk, Dv = v.shape[-2], k.shape[-1], v.shape[-1]
    q, k = q.repeat_interleave(H // q.shape[-2], -2), k.repeat_interleave(H // k.shape[-2], -2)
    q, k = (t / (t.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))  # fla's l2norm
    q = q / Dk ** 0.5
    g = -A_log.exp() * F.softplus(g + dt_bias)

    def step(h, qt, kt, vt, gt, bt):  # qt [B, H, Dk]
        h = h * gt.exp()[..., None, None]
        delta = bt[..., None] * (vt - torch.einsum("bhkv,bhk->bhv", h, kt))
        h = h + kt[..., None] * delta[..., None, :]
        return h, torch.einsum("bhkv,bhk->bhv", h, qt)

    rows = 1 if seq_lens is not None else v.shape[0]
    return _scan(step, [q, k, v, g, beta], h0, seq_lens, lambda: v.new_zeros(rows, H, Dk, Dv))


def ssd_ref(q, k, v, a, params, h0, seq_lens):
    H, Dk, Dv = v.shape[-2], k.shape[-1], v.shape[-1]
    q, k = q.repeat_interleave(H // q.shape[-2], -2), k.repeat_interleave(H // k.shape[-2], -2)
    skip = 0
    if params:
        A_log, dt_bias, D = params
        delta = F.softplus(a + dt_bias)
        skip = v * D[:, None]
        v, a = v * delta[..., None], -A_log.exp() * delta

    def step(h, qt, kt, vt, at):
        h = at.exp()[..., None, None] * h + kt[..., None] * vt[..., None, :]
        return h, torch.einsum("bhkv,bhk->bhv", h, qt)

    rows = 1 if seq_lens is not None else v.shape[0]
    out, final = _scan(step, [q, k, v, a], h0, seq_lens, lambda: v.new_zeros(rows, H, Dk, Dv))
    return out + skip, final


def mamba1_ref(x, dt, Bm, Cm, A_log, D, dt_bias, h0, seq_lens):
    C, N = A_log.shape
    Bm, Cm = Bm.repeat_interleave(C // Bm.shape[-2], -2), Cm.repeat_interleave(C // Cm.shape[-2], -2)
    delta = F.softplus(dt + dt_bias)
    A = -A_log.exp()

    def step(h, xt, dtt, bt, ct):  # xt [B, C], bt [B, C, N]
        h = (dtt[..., None] * A).exp() * h + (dtt * xt)[..., None] * bt
        return h, (h * ct).sum(-1)

    rows = 1 if seq_lens is not None else x.shape[0]
    out, final = _scan(step, [x, delta, Bm, Cm], h0, seq_lens, lambda: x.new_zeros(rows, C, N))
    return out + x * D, final


def conv_ref(x, weight, bias, seq_lens):
    xb = x if seq_lens is None else x[None]
    K = weight.shape[-1]
    pieces = []
    for a, b in _bounds(seq_lens, xb.shape[1]):
        if a == b:
            continue
        seg = xb[:, a:b].transpose(1, 2)
        pieces.append(F.conv1d(F.pad(seg, (K - 1, 0)), weight[:, None], bias, groups=x.shape[-1]).transpose(1, 2))
    out = F.silu(torch.cat(pieces, 1))
    return out if seq_lens is None else out[0]


# --- the cases ------------------------------------------------------------------------------------


def _make(kind, B, S, seq_lens, dims, init):
    """Leaf inputs, parameters, initial state, the adapter and the reference (outputs, final)."""
    g = torch.Generator().manual_seed(4321)
    lead = (S,) if seq_lens is not None else (B, S)
    rows = len(seq_lens) if seq_lens is not None else B

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    def uni(*shape, lo=0.1, hi=0.9):
        return (lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)).requires_grad_()

    if kind == "gdn":
        Hk, H, Dk, Dv = dims["Hk"], dims["H"], 4, 3
        xs = [rnd(*lead, Hk, Dk), rnd(*lead, Hk, Dk), rnd(*lead, H, Dv), rnd(*lead, H), uni(*lead, H)]
        params = [rnd(H, scale=0.5), rnd(H, scale=0.5)]
        h0 = rnd(rows, H, Dk, Dv) if init else None

        def adapter(p):
            return GatedDeltaRule(use_qk_l2norm=True, chunk_size=8, A_log=p[0], dt_bias=p[1])

        def reference(xs, p, h0):
            return gdn_ref(*xs, p[0], p[1], h0, seq_lens)
    elif kind in ("ssd", "lightning"):
        Hk, H, Dk, Dv = dims["Hk"], dims["H"], 4, 3
        a = rnd(*lead, H) if kind == "ssd" else uni(*lead, H, lo=-0.6, hi=-0.01)
        xs = [rnd(*lead, Hk, Dk, scale=0.5), rnd(*lead, Hk, Dk, scale=0.5), rnd(*lead, H, Dv), a]
        params = [rnd(H, scale=0.5), rnd(H, scale=0.5), rnd(H)] if kind == "ssd" else []
        h0 = rnd(rows, H, Dk, Dv) if init else None

        def adapter(p):
            if not p:
                return ScalarDecayAttention(chunk_size=8)
            return ScalarDecayAttention(chunk_size=8, A_log=p[0], dt_bias=p[1], D=p[2])

        def reference(xs, p, h0):
            return ssd_ref(*xs, p, h0, seq_lens)
    else:  # mamba1
        C, G, N = dims["C"], dims["G"], 3
        xs = [rnd(*lead, C), rnd(*lead, C), rnd(*lead, G, N), rnd(*lead, G, N)]
        params = [rnd(C, N, scale=0.5), rnd(C), rnd(C, scale=0.5)]
        h0 = rnd(rows, C, N) if init else None

        def adapter(p):
            return SelectiveScan(p[0], D=p[1], dt_bias=p[2])

        def reference(xs, p, h0):
            return mamba1_ref(*xs, *p, h0, seq_lens)
    return xs, params, h0, adapter, reference


def _shard(x, state, seq_lens):
    return seqpar.shard(x, state, dim=1) if seq_lens is None else seqpar.shard_packed(x, state, seq_lens, dim=0)


def _err(a, b):
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _summed(t, state, like):
    total = torch.zeros_like(like) if t is None else t.detach().clone()  # a rank without heads: None
    dist.all_reduce(total, group=state.cp_group)
    return total


def _run_recurrence(state, kind, B, S, seq_lens, dims, init, exchange_length=False):
    """Errors of state passing (outputs, final, grads) and of head-parallel against one device."""
    xs, params, h0, adapter, reference = _make(kind, B, S, seq_lens, dims, init)
    out_ref, final_ref = reference(xs, params, h0)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out_ref.shape, generator=g, dtype=torch.float64)
    wf = torch.randn(final_ref.shape, generator=g, dtype=torch.float64)
    ((out_ref * w).sum() + (final_ref * wf).sum()).backward()
    n = state.cp_size
    kw = dict(seq_lens=seq_lens) if seq_lens is not None else dict(seq_len=None if exchange_length else S)
    err = {}

    # State passing: each rank's loss is its tokens' share plus 1/N of the (replicated) final-state term.
    local = [_shard(x.detach(), state, seq_lens).requires_grad_() for x in xs]
    mine = [p.detach().clone().requires_grad_() for p in params]
    init_mine = None if h0 is None else h0.detach().clone().requires_grad_()
    (out,), final = state_passing(adapter(mine), local, state, initial_state=init_mine, **kw)
    ((out * _shard(w, state, seq_lens)).sum() + (final * wf).sum() / n).backward()
    err["sp out"] = _err(out, _shard(out_ref.detach(), state, seq_lens))
    err["sp final"] = _err(final, final_ref)
    err["sp dx"] = max(_err(x.grad, _shard(r.grad, state, seq_lens)) for x, r in zip(local, xs))
    err["sp dparam"] = max([_err(_summed(p.grad, state, p), r.grad) for p, r in zip(mine, params)], default=0.0)
    if h0 is not None:
        err["sp dinit"] = _err(_summed(init_mine.grad, state, init_mine), h0.grad)

    # Head-parallel on the same adapter (outputs only), and the two modes against each other.
    if h0 is None:
        for x in xs:
            x.grad = None
        for p in params:
            p.grad = None
        reference(xs, params, None)[0].mul(w).sum().backward()
        local_hp = [_shard(x.detach(), state, seq_lens).requires_grad_() for x in xs]
        mine_hp = [p.detach().clone().requires_grad_() for p in params]
        (out_hp,) = recurrence_head_parallel(adapter(mine_hp), local_hp, state, **kw)
        (out_hp * _shard(w, state, seq_lens)).sum().backward()
        err["hp out"] = _err(out_hp, _shard(out_ref.detach(), state, seq_lens))
        err["hp dx"] = max(_err(x.grad, _shard(r.grad, state, seq_lens)) for x, r in zip(local_hp, xs))
        err["hp dparam"] = max([_err(_summed(p.grad, state, p), r.grad) for p, r in zip(mine_hp, params)], default=0.0)
        err["sp == hp"] = _err(out, out_hp)
    return err


def _run_conv(state, B, S, seq_lens, C, K):
    g = torch.Generator().manual_seed(11)
    lead = (S,) if seq_lens is not None else (B, S)
    x = torch.randn(*lead, C, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(C, K, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(C, generator=g, dtype=torch.float64, requires_grad=True)
    ref = conv_ref(x, weight, bias, seq_lens)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref * w).sum().backward()
    xl = _shard(x.detach(), state, seq_lens).requires_grad_()
    wl, bl = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    kw = dict(seq_lens=seq_lens) if seq_lens is not None else dict(seq_len=S)
    out = causal_conv1d_halo(xl, wl, bl, state, activation="silu", **kw)
    (out * _shard(w, state, seq_lens)).sum().backward()
    return {
        "conv out": _err(out, _shard(ref.detach(), state, seq_lens)),
        "conv dx": _err(xl.grad, _shard(x.grad, state, seq_lens)),
        "conv dw": _err(_summed(wl.grad, state, wl), weight.grad),
        "conv db": _err(_summed(bl.grad, state, bl), bias.grad),
    }


PACKED = (5, 17, 1, 14)
CASES = [  # (kind, B, S, seq_lens, dims, init, options)
    ("gdn", 2, 37, None, dict(Hk=2, H=4), True, {}),
    ("gdn", 2, 37, None, dict(Hk=2, H=4), False, {}),
    ("gdn", 2, 5, None, dict(Hk=1, H=3), False, dict(exchange_length=True)),
    ("gdn", 1, 37, PACKED, dict(Hk=1, H=2), True, {}),
    ("gdn", 1, 29, (11, 0, 3, 15), dict(Hk=2, H=2), False, {}),
    ("ssd", 2, 37, None, dict(Hk=1, H=3), True, {}),
    ("ssd", 2, 5, None, dict(Hk=1, H=3), False, {}),
    ("ssd", 1, 37, PACKED, dict(Hk=2, H=4), True, {}),
    ("ssd", 1, 37, PACKED, dict(Hk=2, H=4), False, {}),
    ("lightning", 2, 37, None, dict(Hk=3, H=3), False, {}),
    ("mamba1", 2, 37, None, dict(C=5, G=1), True, {}),
    ("mamba1", 2, 5, None, dict(C=4, G=2), False, {}),
]
CONVS = [(2, 37, None, 5, 4), (2, 5, None, 3, 4), (1, 37, PACKED, 3, 4), (1, 29, (11, 0, 3, 15), 2, 3)]


def _cases(ring, ulysses):
    state = ParallelState(ring, ulysses, timeout=TIMEOUT)
    try:
        out = [_run_recurrence(state, kind, B, S, lens, dims, init, **opts)
               for kind, B, S, lens, dims, init, opts in CASES]
        return out + [_run_conv(state, *c) for c in CONVS]
    finally:
        state.close()


def _check(results, split):
    labels = [c[:6] for c in CASES] + [("conv", *c) for c in CONVS]
    for rank, per_case in enumerate(results):
        for case, err in zip(labels, per_case):
            for what, e in err.items():
                assert e < 1e-11, (split, rank, case, what, e)


def test_exact_ring2_ulysses2(pools):
    _check(pools(4).run(_cases, 2, 2), (2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("ring,ulysses", [(1, 4), (4, 1), (3, 1), (1, 3), (2, 1), (1, 2)])
def test_exact_every_split(pools, ring, ulysses):
    _check(pools(ring * ulysses).run(_cases, ring, ulysses), (ring, ulysses))


# --- one process ----------------------------------------------------------------------------------


def test_gated_delta_matches_transformers_kernels():
    # The adapter follows transformers' torch_*_gated_delta_rule (fp32, with an initial state).
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 37, 2, 8, generator=g), torch.randn(2, 37, 2, 8, generator=g)
    v = torch.randn(2, 37, 4, 6, generator=g)
    gate, beta = -torch.rand(2, 37, 4, generator=g), torch.rand(2, 37, 4, generator=g)
    h0 = torch.randn(2, 4, 8, 6, generator=g)
    ref, ref_final = qwen.torch_chunk_gated_delta_rule(
        q, k, v, gate, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (out,), final = state_passing(GatedDeltaRule(use_qk_l2norm=True), [q, k, v, gate, beta], ParallelState(),
                                  initial_state=h0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_with_the_sizes():
    state = ParallelState()
    q, v, g = torch.zeros(1, 5, 2, 4), torch.zeros(1, 5, 4, 3), torch.zeros(1, 5, 4)
    with pytest.raises(ValueError, match="takes 5 inputs \\(q, k, v, g, beta\\), got 4"):
        state_passing(GatedDeltaRule(), [q, q, v, g], state)
    with pytest.raises(ValueError, match="initial_state has shape \\(1, 4, 3, 3\\); expected .* \\(1, 4, 4, 3\\)"):
        state_passing(GatedDeltaRule(), [q, q, v, g, g], state, initial_state=torch.zeros(1, 4, 3, 3))
    with pytest.raises(ValueError, match="Hk dividing H"):
        state_passing(GatedDeltaRule(), [torch.zeros(1, 5, 3, 4)] * 2 + [v, g, g], state)
    with pytest.raises(ValueError, match="holds 5 tokens, but seq_len=6"):
        state_passing(GatedDeltaRule(), [q, q, v, g, g], state, seq_len=6)
    with pytest.raises(ValueError, match="A_log has shape \\(3,\\); expected \\[5, 2\\]"):
        x, bc = torch.zeros(1, 5, 5), torch.zeros(1, 5, 1, 2)
        state_passing(SelectiveScan(torch.zeros(3)), [x, x, bc, bc], state)


def _refusals(ring, ulysses):
    state = ParallelState(ring, ulysses, timeout=TIMEOUT)
    x = seqpar.shard(torch.randn(2, 11, 3), state)
    dt = seqpar.shard(torch.randn(2, 11, 3), state)
    bc = seqpar.shard(torch.randn(2, 11, 1, 2), state)
    rec = SelectiveScan(torch.zeros(3, 2))
    longer = [torch.cat([t, t[:, :1]], 1) for t in (x, dt, bc, bc)] if state.cp_rank == 0 else [x, dt, bc, bc]
    out = {}
    for name, call in {
        "rank 0 one token long": lambda: state_passing(rec, longer, state, seq_len=11),
        "rank 3 bad initial state": lambda: state_passing(
            rec, [x, dt, bc, bc], state, seq_len=11,
            initial_state=torch.zeros(2, 3, 3 if state.cp_rank == 3 else 2)),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    state.close()
    return out


def test_refusals_raise_on_every_rank(pools):
    for rank, per in enumerate(pools(4).run(_refusals, 2, 2)):
        assert "hold [4, 2, 3, 3] tokens" in per["rank 0 one token long"], (rank, per)
        msg = per["rank 3 bad initial state"]
        assert msg is not None and ("initial_state has shape" in msg if rank == 3 else "cp rank 3 refused" in msg), msg
