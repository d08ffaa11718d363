"""DeepSeek sparse attention exact on sequence shards: DeepSeek-V3.2 and GLM-5 (``deepseek_v32``,
``glm_moe_dsa``; Note [DeepSeek sparse attention on shards]).

Built with ``attn_implementation=register(state)``, both run on token shards with the indexer's
keys and the MLA latent gathered in global order: float64 logits and CP-summed parameter gradients
equal the one-device sdpa model's at an odd length (37) where the top-k (6) cuts, under ring x
Ulysses 2 x 2 (quick), 1 x 4, 4 x 1 and 3 x 1 (slow); GLM-5 with a full and a shared indexer
layer (the second reuses the first's selection). With one rank the same path is bitwise the sdpa
model. Decoding with a cache (a forward with use_cache=True, seqpar's generate) and packed batches
are refused with the same error on every rank, none left waiting (short collective timeout), and
seqpar.verify finds every module of a DeepSeek-V3.2 model exact on 2 x 2.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import generate, register  # noqa: E402
from seqpar.integrations.transformers_mixers import install  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402
from seqpar.tools.testing import DistPool  # noqa: E402
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402
from seqpar.verify import verify  # noqa: E402

VOCAB = 97
SEQ_LEN = 37  # odd: no split is even
TOPK = 6  # of up to 37 keys: the selection cuts for every query after the sixth
TOL = 1e-10  # float64
FAMILIES = {
    "deepseek_v32": dict(index_topk=TOPK),
    "glm_moe_dsa": dict(index_topk=TOPK, indexer_types=["full", "shared"]),
}


def _build(family: str, attn_implementation: str, **overrides):
    """A float64 model of ``family`` in eval mode (seed 0: every build has the same weights)."""
    torch.manual_seed(0)
    config = tiny_hf_config(family, vocab_size=VOCAB, **{**FAMILIES[family], **overrides})
    model = causal_lm_class(family)._from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"  # float64 MoE
    )
    return model.to(torch.float64).eval()


def _ids(batch: int, seed: int):
    return torch.randint(3, VOCAB, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _flat_grad(loss, model):
    """Every parameter's gradient, flat (the indexer's, which runs without gradients, as zeros)."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


@contextlib.contextmanager
def _one_thread():
    """One torch thread, like the pool's ranks (tiny float64 ops on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _references():
    """Per family, the one-device sdpa model's logits and loss gradients (computed once, here)."""
    ids = _ids(2, SEQ_LEN)
    out = {}
    with _one_thread():
        for family in FAMILIES:
            ref = _build(family, "sdpa")
            logits = ref(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift_labels(ids).reshape(-1))
            out[family] = (logits.detach(), _flat_grad(loss, ref))
    return out


def _errors(model, state: ParallelState, reference) -> dict[str, float]:
    """Max logits and CP-summed gradient errors (relative to max(1, |gradient|)) of a model on shards."""
    ids = _ids(2, SEQ_LEN)
    ref_logits, ref_grad = reference
    positions = shard_positions(SEQ_LEN, state)[None]
    logits = model(input_ids=shard(ids, state), position_ids=positions, use_cache=False).logits
    grad = _flat_grad(sharded_cross_entropy(logits, shard(shift_labels(ids), state), state), model)
    if state.cp_size > 1:
        dist.all_reduce(grad, group=state.cp_group)  # partial gradients sum to the true one
    return {
        "logits": (logits - shard(ref_logits, state)).abs().max().item(),
        "grad": (grad - ref_grad).abs().max().item() / max(1.0, ref_grad.abs().max().item()),
    }


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


def _run(worlds, references, extras: bool):
    """Per world ``(ring, ulysses)``: this rank's errors per family and, with ``extras``, the
    refusals and seqpar.verify's verdict."""
    out = []
    for ring, ulysses in worlds:
        state = ParallelState(ring, ulysses)
        name = register(state, name=f"seqpar-test-sparse-{ring}x{ulysses}")
        try:
            errors, refused = {}, {}
            for family, reference in references.items():
                model = _build(family, name)
                errors[family] = _errors(model, state, reference)
                if extras:
                    refused[family] = _refusals(model, state)
            if extras:
                report = verify(_build("deepseek_v32", name), state)
                refused["verify"] = (report.ok, report.verdict)
            out.append((errors, refused))
        finally:
            state.close()
    return out


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            for family, err in errors.items():
                assert err["logits"] < TOL and err["grad"] < TOL, (f"{ring}x{ulysses}", rank, family, err)
    for w in range(len(worlds)):
        verdicts = [r[w][1].pop("verify", (True, "")) for r in per_rank]
        assert all(ok for ok, _ in verdicts), (worlds[w], verdicts[0])
        refusals = per_rank[0][w][1]
        for family, calls in refusals.items():
            for what, (kind, message) in calls.items():
                want = "packed batches" if what == "packed" else "does not support a cache"
                assert kind == "NotImplementedError" and want in message, (family, what, kind, message)
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


def test_top_k_cuts():
    """The references select: with every key kept, the same weights give other logits."""
    ids = _ids(1, 5)
    with _one_thread(), torch.no_grad():
        for family in FAMILIES:
            sparse = _build(family, "sdpa")(input_ids=ids).logits
            dense = _build(family, "sdpa", index_topk=SEQ_LEN)(input_ids=ids).logits
            assert (sparse - dense).abs().max().item() > 1e-3, family


def test_sparse_attention_exact_2x2():
    worlds = [(2, 2)]
    with DistPool(4, timeout_s=60) as pool:  # a rank left waiting fails within the timeout
        per_rank = pool.run(_run, worlds, _references(), True)
    _check(worlds, per_rank)


@pytest.mark.slow  # three spawns on 2 shared cores
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_sparse_attention_exact_on_shards(worlds):
    size = worlds[0][0] * worlds[0][1]
    with DistPool(size, timeout_s=60) as pool:
        per_rank = pool.run(_run, worlds, _references(), False)
    _check(worlds, per_rank)


def test_one_rank_is_the_sdpa_model():
    """With one rank seqpar's implementation runs these models (same path, every gather the
    identity): logits and gradients bitwise the sdpa model's up to float64 rounding."""
    state = ParallelState()
    name = register(state, name="seqpar-test-sparse-one")
    references = _references()
    with _one_thread():
        for family, reference in references.items():
            err = _errors(_build(family, name), state, reference)
            assert err["logits"] < 1e-12 and err["grad"] < 1e-12, (family, err)
    # Any mixing mode takes the sparse layers (they gather keys: no head-parallel / state-passing
    # choice), mixing="state_passing" included.
    for family in references:
        assert install(_build(family, "sdpa"), state, mixing="state_passing"), family
