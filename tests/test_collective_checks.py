"""Checks whose outcome can differ between CP ranks end in the same error on every rank (issue 42).

Each case lets exactly one rank pass a bad or different value to ``seqpar.inference.decode`` /
``prefill`` or to the losses of ``seqpar.training``, and asserts that every rank raised the same
``ValueError`` (type and message) naming that rank and the values, with no rank left waiting: the
pools' collective timeout is short, so a rank stuck in a collective fails the test. After the
refusals the same ranks run the normal call, which must still be exact against a float64
one-device reference (a refused decode leaves the cache unchanged).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar import ParallelState, shard
from seqpar.backends import reference_attention
from seqpar.inference import KVCache, decode, prefill
from seqpar.training import global_loss, linear_cross_entropy, sharded_cross_entropy

TOL = 1e-10
# (ring, ulysses) splits run in each world; the last CP rank is the one that differs
_SPLITS = {2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)]}


def _outcome(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 - the type and message are what the test compares
        return f"{type(e).__name__}: {e}"


def _same_error_everywhere(results: list[dict], case: str, bad: int, *needles: str) -> None:
    msgs = [r[case] for r in results]
    assert all(m == msgs[0] for m in msgs), (case, msgs)
    assert msgs[0].startswith("ValueError: "), (case, msgs[0])
    assert f"cp rank {bad}" in msgs[0], (case, msgs[0])
    for needle in needles:
        assert needle in msgs[0], (case, needle, msgs[0])


# ---------------------------------------------------------------------------------------------
# decode / prefill (items 3 and 6)

H, HKV, D, PROMPT, T = 4, 2, 8, 11, 2


def _problem():
    g = torch.Generator().manual_seed(7)
    total = PROMPT + T + 1
    q = torch.randn(1, total, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, total, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, total, HKV, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return q, k, v, sinks


# One rank's change to the decode call; every rank but the last passes the base options.
_DECODE_CASES = {
    "window": dict(window=(2, 0)),
    "softcap": dict(softcap=0.5),
    "scale": dict(softmax_scale=0.3),
    "sinks values": dict(sinks="shifted"),
    "no sinks": dict(sinks=None),
    "causal": dict(causal=False),
    "chunk_size": dict(chunk_size=4),
    "alibi": dict(alibi_slopes="ones"),
    "bad window": dict(window=(2, 3)),  # also invalid with causal: still the same error everywhere
    "tokens": dict(tokens=T + 1),  # item 6: gloo aborted that rank's process
    "layer": dict(layer=1),
}


def _rank_decode(ring: int, ulysses: int, cases: list[str], stage: str) -> dict:
    """Prefill a prompt, then for each case call ``stage`` ("decode", "prefill" of layer 1, or
    "prefill0" of a fresh cache) with the last CP rank passing the case's change; then the normal
    decode, whose error against the reference is returned under "error"."""
    state = ParallelState(ring, ulysses)
    bad = state.cp_rank == state.cp_size - 1
    q, k, v, sinks = _problem()
    base = dict(window=(5, 0), sinks=sinks)
    cache = KVCache(state, 2)
    prompt = [shard(x[:, :PROMPT], state) for x in (q, k, v)]
    prefill(*prompt, cache, 0, **base)
    out = {}
    for case in cases:
        change = dict(_DECODE_CASES[case]) if bad else {}
        tokens, layer = change.pop("tokens", T), change.pop("layer", 0)
        if change.get("sinks") == "shifted":
            change["sinks"] = sinks + 1
        if change.get("alibi_slopes") == "ones":
            change["alibi_slopes"] = torch.ones(H, dtype=torch.float64)
        opts = {**base, **change}
        if stage == "decode":
            block = [x[:, PROMPT:PROMPT + tokens] for x in (q, k, v)]
            out[case] = _outcome(lambda: decode(*block, cache, layer, **opts))
        elif stage == "prefill":  # a later layer: its shard length must be the first layer's
            shards = [x[:, :x.shape[1] - (tokens - T)] for x in prompt]  # "tokens": one token short
            out[case] = _outcome(lambda: prefill(*shards, cache, 1, **opts))
        else:  # the first layer of a fresh cache: the lengths' exchange carries the check
            out[case] = _outcome(lambda: prefill(*prompt, KVCache(state, 1), 0, **opts))
    if stage == "prefill":
        prefill(*prompt, cache, 1, **base)  # layer 1 was refused above: still empty
    block = [x[:, PROMPT:PROMPT + T] for x in (q, k, v)]
    got = [decode(*block, cache, layer, **base) for layer in range(2 if stage == "prefill" else 1)]
    want = reference_attention(q[:, :PROMPT + T], k[:, :PROMPT + T], v[:, :PROMPT + T], causal=True, **base)
    out["error"] = max((g - want[:, PROMPT:]).abs().max().item() for g in got)
    state.close()
    return out


_NEEDLES = {
    "window": ("window (5, 0) on cp rank 0 but (2, 0)",),
    "softcap": ("softcap 0.0 on cp rank 0 but 0.5",),
    "scale": ("softmax_scale", "but 0.3"),
    "sinks values": ("sinks values hash",),
    "no sinks": ("but None",),
    "causal": ("causal True on cp rank 0 but False",),
    "chunk_size": ("chunk_size None on cp rank 0 but 4",),
    "alibi": ("alibi_slopes None on cp rank 0 but values hash",),
    "bad window": ("(2, 3)",),
    "tokens": ("q shape (1, 2, 4, 8) on cp rank 0 but (1, 3, 4, 8)",),
    "layer": ("layer 0 on cp rank 0 but 1",),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_decode_options_that_differ_on_one_rank_raise_everywhere(pools, world):
    """Item 3: one rank's window, softcap, scale, sinks, causal, chunk or ALiBi (or layer) made
    every rank return a result matching no mask (0.68 off)."""
    cases = [c for c in _DECODE_CASES if c != "tokens"]
    for ring, ulysses in _SPLITS[world]:
        results = pools(world).run(_rank_decode, ring, ulysses, cases, "decode")
        for case in cases:
            _same_error_everywhere(results, case, world - 1, "seqpar.inference.decode", *_NEEDLES[case])
        assert max(r["error"] for r in results) < TOL, results


@pytest.mark.parametrize("world", [2, 3])
def test_decode_token_count_that_differs_on_one_rank_raises_everywhere(pools, world):
    """Item 6: another number of new tokens on one rank aborted that rank's process (gloo)."""
    for ring, ulysses in _SPLITS[world]:
        results = pools(world).run(_rank_decode, ring, ulysses, ["tokens"], "decode")
        _same_error_everywhere(results, "tokens", world - 1, *_NEEDLES["tokens"])
        assert max(r["error"] for r in results) < TOL, results


@pytest.mark.parametrize("world", [2, 3])
def test_prefill_options_that_differ_on_one_rank_raise_everywhere(pools, world):
    """The first layer's prefill (its lengths' exchange) and a later layer's (whose shard length
    is checked against the first layer's placement) raise on every rank too."""
    options = ["window", "softcap", "scale", "sinks values", "causal", "chunk_size", "alibi"]
    ring, ulysses = _SPLITS[world][0]
    for stage, cases in (("prefill0", options), ("prefill", [*options, "tokens"])):
        results = pools(world).run(_rank_decode, ring, ulysses, cases, stage)
        for case in cases:
            needles = ("seqpar.inference.prefill",)
            if case == "tokens":  # a shard length is only wrong against the first layer's placement
                needles += (f"tokens on cp rank {world - 1}, but the prefill of the first layer placed",)
            else:
                needles += _NEEDLES[case]
            _same_error_everywhere(results, case, world - 1, *needles)
        assert max(r["error"] for r in results) < TOL, (stage, results)


def _rank_cache_mismatch(_: None) -> dict:
    """One rank's cache was repeated (beam search started there only): its own check refuses,
    the others say which rank refused, and nobody waits."""
    state = ParallelState(dist.get_world_size(), 1)
    q, k, v, _ = _problem()
    cache = KVCache(state, 1)
    prefill(*(shard(x[:, :PROMPT], state) for x in (q, k, v)), cache, 0)
    if state.cp_rank == state.cp_size - 1:
        cache.repeat(2)
    block = [x[:, PROMPT:PROMPT + 1] for x in (q, k, v)]
    out = {"call": _outcome(lambda: decode(*block, cache, 0))}
    state.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_whose_cache_differs_refuses_and_no_rank_waits(pools, world):
    results = pools(world).run(_rank_cache_mismatch, None)
    for rank, r in enumerate(results):
        want = "do not match the cached rows" if rank == world - 1 else f"cp rank {world - 1} refused this call"
        assert r["call"].startswith("ValueError: ") and want in r["call"], (rank, r)


# ---------------------------------------------------------------------------------------------
# the losses (items 8 and 10)

B, S, HIDDEN, V = 2, 13, 6, 11


def _loss_problem(ignore_index: int):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, S, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(V, HIDDEN, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 3] = labels[1, 9] = ignore_index
    return hidden, weight, labels


def _rank_losses(ring: int, ulysses: int, ignore_index: int) -> dict:
    """For both losses: one rank with a label >= V, one with a negative label that is not
    ignore_index (refused everywhere), then the normal call's error against F.cross_entropy
    (loss and gradients, float64)."""
    state = ParallelState(ring, ulysses)
    bad = state.cp_rank == state.cp_size - 1
    hidden, weight, labels = _loss_problem(ignore_index)
    losses = {
        "linear": lambda h, w, y: linear_cross_entropy(h, w, y, state, ignore_index=ignore_index, chunk_size=4),
        "sharded": lambda h, w, y: sharded_cross_entropy(h @ w.t(), y, state, ignore_index=ignore_index),
    }
    out = {}
    h_local, y_local = shard(hidden, state), shard(labels, state)
    for name, loss in losses.items():
        for label in (V + 4, -7):
            y = y_local.clone()
            if bad:
                y[0, 0] = label
            out[f"{name} {label}"] = _outcome(lambda: loss(h_local, weight, y))
    h_full = hidden.clone().requires_grad_()
    w_full = weight.clone().requires_grad_()
    want = F.cross_entropy(h_full.reshape(-1, HIDDEN) @ w_full.t(), labels.reshape(-1), ignore_index=ignore_index)
    ref_dh, ref_dw = torch.autograd.grad(want, (h_full, w_full))
    errors = []
    for loss in losses.values():
        h = h_local.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        share = loss(h, w, y_local)
        dh, dw = torch.autograd.grad(share, (h, w))
        total, dw_sum = share.detach().clone(), dw.clone()
        if state.cp_size > 1:
            dist.all_reduce(total, group=state.cp_group)  # the shares add up to the loss
            dist.all_reduce(dw_sum, group=state.cp_group)  # replicated weight: partial gradients
        errors.append(max(abs(total.item() - want.item()), (dw_sum - ref_dw).abs().max().item(),
                          (dh - shard(ref_dh, state)).abs().max().item()))
    out["error"] = max(errors)
    state.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_label_on_one_rank_raises_everywhere(pools, world):
    """Item 8: a label >= V or < 0 (not ignore_index) on one rank raised there only; the other
    ranks returned and waited in their next collective."""
    for ring, ulysses in _SPLITS[world]:
        results = pools(world).run(_rank_losses, ring, ulysses, -100)
        for name in ("linear_cross_entropy", "sharded_cross_entropy"):
            for label in (V + 4, -7):
                case = f"{name.split('_')[0]} {label}"
                _same_error_everywhere(results, case, world - 1, f"{name}: cp rank {world - 1} has label {label}",
                                       f"outside [0, {V})")
        assert max(r["error"] for r in results) < TOL, results


@pytest.mark.parametrize("world", [2, 3])
def test_ignore_index_at_or_above_the_vocab_size(pools, world):
    """Item 10: ignore_index >= V crashed linear_cross_entropy with an index error (a device-side
    assert on CUDA) where sharded_cross_entropy and F.cross_entropy accept it; bad labels are
    still refused on every rank."""
    for ignore_index in (V, V + 100):
        results = pools(world).run(_rank_losses, *_SPLITS[world][0], ignore_index)
        assert max(r["error"] for r in results) < TOL, (ignore_index, results)
        _same_error_everywhere(results, "linear -7", world - 1, "label -7")


def test_ignore_index_at_or_above_the_vocab_size_on_one_process():
    assert _rank_losses(1, 1, V)["error"] < TOL


def _rank_vocab_differs(_: None) -> dict:
    state = ParallelState(dist.get_world_size(), 1)
    hidden, weight, labels = _loss_problem(-100)
    width = V + 1 if state.cp_rank == state.cp_size - 1 else V
    logits = torch.randn(B, S, width, dtype=torch.float64)
    out = {
        "vocab": _outcome(lambda: sharded_cross_entropy(shard(logits, state), shard(labels, state), state)),
        "ignore_index": _outcome(lambda: linear_cross_entropy(
            shard(hidden, state), weight, shard(labels, state), state,
            ignore_index=-1 if state.cp_rank == state.cp_size - 1 else -100)),
    }
    state.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_size_or_ignore_index_that_differs_on_one_rank(pools, world):
    """Ranks that disagree on V or ignore_index would each count their own tokens: refused everywhere."""
    results = pools(world).run(_rank_vocab_differs, None)
    _same_error_everywhere(results, "vocab", world - 1, f"({V}, -100) on cp rank 0, ({V + 1}, -100)")
    _same_error_everywhere(results, "ignore_index", world - 1, f"({V}, -100) on cp rank 0, ({V}, -1)")


# ---------------------------------------------------------------------------------------------
# sweep: global_loss (all-reduces over CP and DP)


def _rank_global_loss(ring: int) -> dict:
    """One rank's share is float32 (or a 2-vector) where the others' are float64 scalars: their
    all-reduces would not pair up. Then the normal call: the mean over DP of the sums over CP."""
    state = ParallelState(ring, 1)  # world // ring data-parallel replicas
    rank = dist.get_rank()
    last = rank == dist.get_world_size() - 1
    share = torch.tensor(float(rank + 1), dtype=torch.float64)
    out = {
        "dtype": _outcome(lambda: global_loss(share.float() if last else share, state)),
        "shape": _outcome(lambda: global_loss(share.repeat(2) if last else share, state)),
    }
    world, cp = dist.get_world_size(), state.cp_size
    sums = [sum(range(d * cp + 1, (d + 1) * cp + 1)) for d in range(world // cp)]
    out["error"] = abs(global_loss(share, state).item() - sum(sums) / len(sums))
    state.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_global_loss_shares_that_differ_on_one_rank(pools, world):
    for ring in (world, 1):  # CP only, DP only
        results = pools(world).run(_rank_global_loss, ring)
        for case, needle in (("dtype", "1 element(s) of float32"), ("shape", "2 element(s) of float64")):
            msgs = [r[case] for r in results]
            assert all(m == msgs[0] for m in msgs) and msgs[0].startswith("ValueError: "), (case, msgs)
            assert f"rank {world - 1} has {needle}" in msgs[0], (case, msgs[0])
        assert max(r["error"] for r in results) < TOL, results
