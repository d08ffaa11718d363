"""MiniMax-M3's block-sparse attention exact on sequence shards (``minimax_m3_vl``'s text model; Note
[MiniMax-M3 block-sparse attention on shards]).

Built with ``attn_implementation=register(state)``, a MiniMax-M3 text model with a sparse layer (an
indexer selecting key blocks) and a dense one runs on token shards with the layer's keys, values
and index keys gathered in global order: float64 logits and CP-summed parameter gradients equal
the one-device sdpa model's at an odd length (41) where the key blocks (4 slots: 11 blocks, the
last of one token), the top-k blocks (3) and the query's own block all cut, and cut across shard
boundaries, under ring x Ulysses 2 x 2 (quick), 1 x 4, 4 x 1 and 3 x 1 (slow). With one rank the
same path is the sdpa model to 1e-12. Decoding with a cache (a forward with use_cache=True,
seqpar's generate), packed batches, a padding mask and attention dropout are refused with the same
error on every rank, none left waiting (short collective timeout), and seqpar.verify finds every
module exact on 2 x 2. The model has no float32 island that computes across tokens but the
indexer's scores, which only select (their float32 products are the same per query and key on a
shard as on one device).
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
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402
from seqpar.verify import verify  # noqa: E402

FAMILY = "minimax_m3_vl"
VOCAB = 97
SEQ_LEN = 41  # odd: no split is even; 41 = 10 * 4 + 1, the last key block holds one token
# Blocks of 4 key slots, the top 3 of up to 11 per query and KV group, the query's own block forced in.
SPARSE = dict(index_block_size=4, index_topk_blocks=3, index_local_blocks=1)
TOL = 1e-10  # float64


def _build(attn_implementation: str, **overrides):
    """A float64 model in eval mode (seed 0: every build has the same weights)."""
    torch.manual_seed(0)
    config = tiny_hf_config(FAMILY, vocab_size=VOCAB, **{**SPARSE, **overrides})
    model = causal_lm_class(FAMILY)._from_config(config, attn_implementation=attn_implementation)
    return model.to(torch.float64).eval()


def _ids(batch: int, seed: int, seq_len: int = SEQ_LEN):
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def _flat_grad(loss, model):
    """Every parameter's gradient, flat (the indexer's, which only selects, as zeros)."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def _rms_norm_float64(self, x):
    """MiniMax-M3's Gemma-style norm (``x / rms(x) * (1 + weight)``) in the input's dtype: the
    model's own computes in float32, so its weight's gradient is a float32 sum over tokens, which
    per-rank partial sums round otherwise (5e-9 on 2 x 2, measured)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


@contextlib.contextmanager
def _float64_islands():
    """The float64 norm above in the modeling file (the one-device and the sharded models get it),
    and one torch thread, like the pool's ranks (tiny float64 ops on a busy 2-core machine)."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as modeling

    norm = modeling.MiniMaxM3VLRMSNorm
    saved, threads = norm.forward, torch.get_num_threads()
    norm.forward = _rms_norm_float64
    torch.set_num_threads(1)
    try:
        yield
    finally:
        norm.forward = saved
        torch.set_num_threads(threads)


def _reference():
    """The one-device sdpa model's logits and loss gradients (computed once, here)."""
    ids = _ids(2, 7)
    with _float64_islands():
        ref = _build("sdpa")
        logits = ref(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift_labels(ids).reshape(-1))
        return logits.detach(), _flat_grad(loss, ref)


def _errors(model, state: ParallelState, reference) -> dict[str, float]:
    """Max logits and CP-summed gradient errors (relative to max(1, |gradient|)) of a model on shards."""
    ids = _ids(2, 7)
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


def _refusals(name: str, state: ParallelState) -> dict[str, tuple[str, str]]:
    """``(exception type, message)`` of the calls this step refuses: a cache (a forward with
    use_cache=True; seqpar's generate), packed-batch kwargs, a padding mask, attention dropout."""
    model = _build(name)
    ids = _ids(1, 1)
    local, positions = shard(ids, state), shard_positions(SEQ_LEN, state)[None]
    bounds = torch.tensor([0, local.shape[1]])
    padding = torch.ones_like(ids)
    padding[:, :3] = 0  # left padding: it would move the key blocks
    dropout = _build(name, attention_dropout=0.5).train()
    calls = {
        "cache": lambda: model(input_ids=local, position_ids=positions, use_cache=True),
        "packed": lambda: model(input_ids=local, position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds),
        "generate": lambda: generate(model, ids, state, max_new_tokens=2, do_sample=False),
        "padding": lambda: model(input_ids=local, position_ids=positions, attention_mask=shard(padding, state),
                                 use_cache=False),
        "dropout": lambda: dropout(input_ids=local, position_ids=positions, use_cache=False),
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


# Each refusal's exception type and what its message says (a padding mask is refused by seqpar's
# mask function, before any layer runs).
_REFUSED = {
    "cache": ("NotImplementedError", "does not support a cache"),
    "packed": ("NotImplementedError", "packed batches"),
    "generate": ("NotImplementedError", "does not support a cache"),
    "padding": ("ValueError", "padding masks are not supported"),
    "dropout": ("NotImplementedError", "attention dropout 0.5"),
}


def _run(worlds, reference, extras: bool):
    """Per world ``(ring, ulysses)``: this rank's errors and, with ``extras``, the refusals and
    seqpar.verify's verdict."""
    out = []
    with _float64_islands():
        for ring, ulysses in worlds:
            state = ParallelState(ring, ulysses)
            name = register(state, name=f"seqpar-test-m3-{ring}x{ulysses}")
            try:
                errors, refused = _errors(_build(name), state, reference), {}
                if extras:
                    refused = _refusals(name, state)
                    report = verify(_build(name), state, _ids(1, 3))
                    refused["verify"] = (report.ok, report.verdict)
                out.append((errors, refused))
            finally:
                state.close()
    return out


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (err, _) in zip(worlds, results):
            assert err["logits"] < TOL and err["grad"] < TOL, (f"{ring}x{ulysses}", rank, err)
    for w in range(len(worlds)):
        verdicts = [r[w][1].pop("verify", (True, "")) for r in per_rank]
        assert all(ok for ok, _ in verdicts), (worlds[w], verdicts[0])
        refusals = per_rank[0][w][1]
        for what, (kind, message) in refusals.items():
            assert kind == _REFUSED[what][0] and _REFUSED[what][1] in message, (what, kind, message)
        assert all(r[w][1] == refusals for r in per_rank), worlds[w]  # the same error on every rank


def test_blocks_and_top_k_cut():
    """The reference depends on the selection: with every block kept, other blocks or no forced
    own block, the same weights give other logits (so exactness on shards is not exactness of a
    model that ignores the indexer)."""
    ids = _ids(1, 5)
    with _float64_islands(), torch.no_grad():
        base = _build("sdpa")(input_ids=ids).logits
        for change in (dict(index_topk_blocks=11), dict(index_block_size=3), dict(index_local_blocks=0)):
            other = _build("sdpa", **change)(input_ids=ids).logits
            assert (base - other).abs().max().item() > 1e-3, change


@pytest.mark.slow
def test_block_sparse_attention_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _reference(), True)
    _check(worlds, per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_block_sparse_attention_exact_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, _reference(), False)
    _check(worlds, per_rank)


def test_one_rank_is_the_sdpa_model():
    """With one rank seqpar's implementation runs the model (same path, every gather the identity):
    logits and gradients the sdpa model's up to float64 rounding; any mixing mode takes the sparse
    layer (it gathers keys: no head-parallel / state-passing choice)."""
    state = ParallelState()
    name = register(state, name="seqpar-test-m3-one")
    reference = _reference()
    with _float64_islands():
        err = _errors(_build(name), state, reference)
    assert err["logits"] < 1e-12 and err["grad"] < 1e-12, err
    assert "model.layers.0.self_attn" in install(_build("sdpa"), state, mixing="state_passing")
