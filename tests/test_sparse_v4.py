"""DeepSeek-V4's compressed attention exact on sequence shards (``deepseek_v4``; Note [DeepSeek-V4
compressed attention on shards]).

Built with ``attn_implementation=register(state)``, a DeepSeek-V4 model with one layer of each kind
(sliding window, compressed sparse attention with its indexer, heavily compressed attention) runs
on token shards: float64 logits and CP-summed parameter gradients equal the one-device eager
model's (to the model's own float32 rounding: TOL) at an odd length (41) where the sliding window
(6), both compression rates (4 and 8: the last window is cut) and the indexer's top-k (3 of 10
entries) all cut, under ring x Ulysses 2 x 2 (quick), 1 x 4, 4 x 1 and 3 x 1 (slow); also at 5
tokens with rates of 2 on 2 x 2, where ranks hold one token (the heavily compressed layer then
builds no block bias of its own). With one rank the same path is the eager model to 1e-12.
Decoding with a cache (a forward with use_cache=True, seqpar's generate) and packed batches are
refused with the same error on every rank, none left waiting (short collective timeout), and
seqpar.verify finds every module exact on 2 x 2.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import generate, register  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402
from seqpar.tools.testing import DistPool  # noqa: E402
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402
from seqpar.verify import verify  # noqa: E402

VOCAB = 97
# float64, but the model keeps float32 islands: its hyper-connections (mHC) project in float32
# (``.float()``), its norms and RoPE round through float32, the compressors' softmax runs in float32.
# A float32 product over S_local rows may round otherwise than over S rows, and gradient sums over
# tokens are split across ranks: a model of sliding layers only, which no adapter touches, differs
# by 1.3e-8 (gradients) on 2 x 2, this one by up to 2e-7 (measured). A wrong window, entry or
# selection moves the logits by more than 1e-3 (test_every_part_cuts).
TOL = 1e-6
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
_TINY = dict(
    num_hidden_layers=3, layer_types=LAYERS, mlp_layer_types=["moe"] * 3, n_routed_experts=2, num_experts_per_tok=1,
    q_lora_rank=16, o_groups=2, o_lora_rank=8, hc_mult=2, index_n_heads=2, index_head_dim=8, partial_rotary_factor=0.5,
)
# case: (sequence length, config fields)
CASES = {
    # 41 = 10 * 4 + 1 = 5 * 8 + 1: both compressors drop a remainder; top-3 of up to 10 entries
    "windows": (41, dict(_TINY, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                         sliding_window=6, index_topk=3)),
    # 5 tokens on 4 ranks: three ranks hold one token each
    "one_token": (5, dict(_TINY, compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 2},
                          sliding_window=2, index_topk=1)),
}


def _build(case: str, attn_implementation: str, **overrides):
    """A float64 model of ``case`` in eval mode (seed 0: every build has the same weights)."""
    torch.manual_seed(0)
    config = tiny_hf_config("deepseek_v4", vocab_size=VOCAB, **{**CASES[case][1], **overrides})
    model = causal_lm_class("deepseek_v4")._from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"  # float64 MoE
    )
    with torch.no_grad():  # nonzero sinks and compressor position biases (initialised to zero), so both count
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model.to(torch.float64).eval()


def _ids(case: str, batch: int, seed: int):
    return torch.randint(3, VOCAB, (batch, CASES[case][0]), generator=torch.Generator().manual_seed(seed))


def _flat_grad(loss, model):
    """Every parameter's gradient, flat (the indexer's, which only selects, as zeros)."""
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


def _references(cases=tuple(CASES)):
    """Per case, the one-device eager model's logits and loss gradients (computed once, here)."""
    out = {}
    with _one_thread():
        for case in cases:
            ids = _ids(case, 2, 7)
            ref = _build(case, "eager")
            logits = ref(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift_labels(ids).reshape(-1))
            out[case] = (logits.detach(), _flat_grad(loss, ref))
    return out


def _errors(model, case: str, state: ParallelState, reference) -> dict[str, float]:
    """Max logits and CP-summed gradient errors (relative to max(1, |gradient|)) of a model on shards."""
    ids = _ids(case, 2, 7)
    ref_logits, ref_grad = reference
    positions = shard_positions(ids.shape[1], state)[None]
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
    ids = _ids("windows", 1, 1)
    local, positions = shard(ids, state), shard_positions(ids.shape[1], state)[None]
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
    """Per world ``(ring, ulysses)``: this rank's errors per case and, with ``extras``, the
    refusals and seqpar.verify's verdict."""
    out = []
    for ring, ulysses in worlds:
        state = ParallelState(ring, ulysses)
        name = register(state, name=f"seqpar-test-v4-{ring}x{ulysses}")
        try:
            errors, refused = {}, {}
            for case, reference in references.items():
                errors[case] = _errors(_build(case, name), case, state, reference)
            if extras:
                refused = _refusals(_build("windows", name), state)
                report = verify(_build("windows", name), state, _ids("windows", 1, 3))
                refused["verify"] = (report.ok, report.verdict)
            out.append((errors, refused))
        finally:
            state.close()
    return out


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            for case, err in errors.items():
                assert err["logits"] < TOL and err["grad"] < TOL, (f"{ring}x{ulysses}", rank, case, err)
    for w in range(len(worlds)):
        verdicts = [r[w][1].pop("verify", (True, "")) for r in per_rank]
        assert all(ok for ok, _ in verdicts), (worlds[w], verdicts[0])
        refusals = per_rank[0][w][1]
        for what, (kind, message) in refusals.items():
            want = "packed batches" if what == "packed" else "does not support a cache"
            assert kind == "NotImplementedError" and want in message, (what, kind, message)
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


def test_every_part_cuts():
    """The references depend on each part: another top-k, window, sinks or compression rate
    gives other logits (so exactness on shards is not exactness of a model that ignores it)."""
    ids = _ids("windows", 1, 5)
    rates = dict(CASES["windows"][1]["compress_rates"])
    with _one_thread(), torch.no_grad():
        base = _build("windows", "eager")(input_ids=ids).logits
        for change in (dict(index_topk=10), dict(sliding_window=41),
                       dict(compress_rates={**rates, "heavily_compressed_attention": 4})):
            other = _build("windows", "eager", **change)(input_ids=ids).logits
            assert (base - other).abs().max().item() > 1e-3, change


def test_compressed_attention_exact_2x2():
    worlds = [(2, 2)]
    with DistPool(4, timeout_s=60) as pool:  # a rank left waiting fails within the timeout
        per_rank = pool.run(_run, worlds, _references(), True)
    _check(worlds, per_rank)


@pytest.mark.slow  # three spawns on 2 shared cores
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_compressed_attention_exact_on_shards(worlds):
    size = worlds[0][0] * worlds[0][1]
    with DistPool(size, timeout_s=60) as pool:
        per_rank = pool.run(_run, worlds, _references(), False)
    _check(worlds, per_rank)


def test_one_rank_is_the_eager_model():
    """With one rank seqpar's implementation runs the model (same path, every gather the
    identity): logits and gradients the eager model's up to float64 rounding."""
    state = ParallelState()
    name = register(state, name="seqpar-test-v4-one")
    references = _references()
    with _one_thread():
        for case, reference in references.items():
            err = _errors(_build(case, name), case, state, reference)
            assert err["logits"] < 1e-12 and err["grad"] < 1e-12, (case, err)
