"""Hybrid transformers families exact on sequence shards: gated delta nets and short convolutions.

Qwen3-Next, Qwen3.5 (text, and its MoE), OLMo Hybrid (gated delta rule + causal conv1d) and LFM2,
LFM2-MoE, LFM3 (gated short convolution) built with ``attn_implementation=register(state)`` run
on token shards with their mixers head-parallel (seqpar.integrations.transformers_mixers): float64
logits and CP-summed parameter gradients equal the one-device sdpa model's, at an odd length (37)
under ring x Ulysses 2 x 2 (quick), 1 x 4, 4 x 1, 3 x 1 and 1 x 3 (slow). The gated delta nets have
6 V heads reading 2 K heads of another head dim, so K heads are cut between ranks.
Decoding with a cache (a forward with use_cache=True, seqpar's generate) and packed batches (for
the short convolutions; the gated delta nets run them, tests/test_hybrid_packed.py, and refuse these
per-rank boundaries) are refused with the same error on every rank, none left waiting (short
collective timeout), and
seqpar.verify finds every module of an LFM2 and a Qwen3-Next model exact on 2 x 2. With one rank nothing changes.
"""

import contextlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import generate, register  # noqa: E402
from seqpar.integrations.transformers_mixers import install  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402
from seqpar.verify import verify  # noqa: E402

VOCAB = 97
SEQ_LEN = 37  # odd: no split is even
TOL = 1e-10  # float64
# Parameters the modeling code itself takes through float32 (Qwen's RMSNorm weights, the decay's
# A_log.float()): their gradients are float32 sums over tokens, so per-rank partial sums round
# differently from one sum (~1e-8). Everything else, the mixers' own weights included, is float64.
FLOAT32_PARAMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "A_log")
FLOAT32_TOL = 1e-6
# 6 V heads of dim 4 reading 2 K heads of dim 8: over 4 ranks (V heads split 2, 2, 1, 1) cp rank 1
# reads both K heads, each of which other ranks read too.
GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4)
# Families that run packed batches (tests/test_hybrid_packed.py): a packed call with each rank's own
# boundaries is a ValueError there, a NotImplementedError elsewhere.
PACKED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
FAMILIES = {
    "qwen3_next": GATED_DELTA,
    "qwen3_5_text": GATED_DELTA,
    "qwen3_5_moe_text": {},  # 2 V heads and 2 K heads: over 3 or 4 ranks, some rank has no head
    "olmo_hybrid": GATED_DELTA,
    "lfm2": {},
    "lfm2_moe": {},
    "lfm3": {},  # conv width 7: histories cross zig-zag chunks of 37 / 6 tokens
}


def _build(family: str, attn_implementation: str):
    """A float64 model of ``family`` in eval mode (seed 0: every build has the same weights)."""
    torch.manual_seed(0)
    config = tiny_hf_config(family, vocab_size=VOCAB, **FAMILIES[family])
    model = causal_lm_class(family)._from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"  # float64 MoE
    )
    return model.to(torch.float64).eval()


def _flat_grad(loss, model):
    """``(float64-computed, float32-computed)`` parameter gradients, each flat."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)  # unrouted experts get None
    flat = [[], []]
    for name, g, p in zip(names, grads, params):
        flat[name.endswith(FLOAT32_PARAMS)].append((torch.zeros_like(p) if g is None else g).reshape(-1))
    return torch.cat(flat[0]), torch.cat(flat[1] or [torch.zeros(0, dtype=torch.float64)])


def _ids(batch: int, seed: int):
    return torch.randint(3, VOCAB, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def _one_thread():
    """One torch thread, like the pool's ranks: tiny float64 ops on several threads of a busy
    2-core machine spend most of their time waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _references(families):
    """Per family, the one-device sdpa model's logits and loss gradients (computed once, here)."""
    ids = _ids(2, SEQ_LEN)
    out = {}
    with _one_thread():
        for family in families:
            ref = _build(family, "sdpa")
            logits = ref(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift_labels(ids).reshape(-1))
            out[family] = (logits.detach(), _flat_grad(loss, ref))
    return out


def _errors(model, state: ParallelState, reference) -> dict[str, float]:
    """Max logits and CP-summed gradient errors (relative to max(1, |gradient|)) of a model on shards."""
    ids = _ids(2, SEQ_LEN)
    ref_logits, ref_grads = reference
    logits = model(input_ids=shard(ids, state), position_ids=shard_positions(SEQ_LEN, state)[None]).logits
    grads = _flat_grad(sharded_cross_entropy(logits, shard(shift_labels(ids), state), state), model)
    err = {"logits": (logits - shard(ref_logits, state)).abs().max().item()}
    for key, grad, ref_grad in zip(("grad", "grad32"), grads, ref_grads):
        dist.all_reduce(grad, group=state.cp_group)  # partial gradients sum to the true one
        if grad.numel():
            err[key] = (grad - ref_grad).abs().max().item() / max(1.0, ref_grad.abs().max().item())
    return err


def _refusals(model, state: ParallelState) -> dict[str, tuple[str, str]]:
    """``(exception type, message)`` of the calls this step refuses: a cache (a forward with
    use_cache=True; seqpar's generate), packed-batch kwargs."""
    ids = _ids(1, 1)
    local, positions = shard(ids, state), shard_positions(SEQ_LEN, state)[None]
    bounds = torch.tensor([0, local.shape[1]])
    calls = {
        "cache": lambda: model(input_ids=local, position_ids=positions, use_cache=True),
        "packed": lambda: model(input_ids=local, position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds),
        "generate": lambda: generate(model, ids, state, max_new_tokens=2, do_sample=False),
    }
    out = {}
    for what, call in calls.items():
        try:
            with torch.no_grad():
                call()
            out[what] = ("ran", "")
        except Exception as e:  # noqa: BLE001 - the test asserts the type and message
            out[what] = (type(e).__name__, str(e))
    return out


def _run(worlds, references, refusals: bool):
    """Per world ``(ring, ulysses)``: this rank's errors and refusals per family."""
    out = []
    for ring, ulysses in worlds:
        state = ParallelState(ring, ulysses, timeout=timedelta(seconds=60))  # a rank left waiting fails
        name = register(state, name=f"seqpar-test-hybrid-{ring}x{ulysses}")
        try:
            errors, refused = {}, {}
            for family, reference in references.items():
                model = _build(family, name)
                errors[family] = _errors(model, state, reference)
                if refusals:
                    refused[family] = _refusals(model, state)
            if refusals:  # and seqpar's own self-check finds every module of both kinds of model exact
                # (the gated delta net's norms see [B * S * H, D] rows: a flattened sequence dim)
                refused["verify"] = all(verify(_build(f, name), state, _ids(1, 3)).ok for f in ("lfm2", "qwen3_next"))
            out.append((errors, refused))
        finally:
            state.close()
    return out


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            for family, err in errors.items():
                where = (f"{ring}x{ulysses}", rank, family)
                assert err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL, (where, err)
    for w in range(len(worlds)):
        assert all(r[w][1].pop("verify", True) is True for r in per_rank), worlds[w]
        refusals = per_rank[0][w][1]
        for family, calls in refusals.items():
            for what, (kind, message) in calls.items():
                if what == "packed" and family in PACKED:  # runs packed batches: these boundaries are wrong
                    assert kind == "ValueError" and "cu_seq_lens_q" in message, (family, what, kind, message)
                    continue
                want = "packed batches" if what == "packed" else "does not support a cache"
                assert kind == "NotImplementedError" and want in message, (family, what, kind, message)
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


def test_hybrid_families_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references(FAMILIES), True)
    _check(worlds, per_rank)


@pytest.mark.slow  # ~1 min on 2 shared cores: 7 families, 4 worlds
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1), (1, 3)]], ids=["1x4+4x1", "3x1+1x3"])
def test_hybrid_families_exact_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, _references(FAMILIES), False)
    _check(worlds, per_rank)


def test_one_rank_changes_nothing():
    """With cp_size 1 the adapters leave every mixer as it is: bitwise the same outputs."""
    state = ParallelState()
    ids = _ids(2, 2)
    with _one_thread():
        for family in FAMILIES:
            model = _build(family, "sdpa")
            before = model(input_ids=ids).logits
            assert install(model, state), family  # the family's mixers have an adapter
            assert torch.equal(model(input_ids=ids).logits, before), family
