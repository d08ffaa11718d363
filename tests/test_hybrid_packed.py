"""Packed sequences in transformers models on sequence shards (issue #43).

A model built with ``attn_implementation=register(state)`` takes transformers' packed format
(DataCollatorWithFlattening): one row of concatenated sequences, ``input_ids`` and ``position_ids``
(restarting per sequence) sharded by ``seqpar.shard_packed``, and the global ``cu_seq_lens_q`` /
``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``. Three sequences of odd lengths (11, 23, 7)
run exactly: float64 logits and CP-summed parameter gradients equal one device running each
sequence on its own (the sdpa model, results concatenated), for Qwen3-Next and Qwen3.5 (gated delta
nets: conv and rule per sequence, head-parallel and state passing; softmax attention by
``seqpar.varlen_attention``) and Llama (softmax only), under ring x Ulysses 2 x 2 (quick), 3 x 1 and
1 x 4 (slow, with OLMo Hybrid and ``mixing="auto"``), and on one rank.
Refused with the same error on every rank, none left waiting (a short collective timeout): boundaries
that differ on one rank, boundaries that do not place the ranks' token counts, restarting positions
without boundaries, and a model whose token mixers do not run packed batches (LFM2's short conv).
"""

import contextlib
import importlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM  # noqa: E402

from seqpar import ParallelState, shard_packed, shard_packed_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.tools.models import tiny_llama_config  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402
from seqpar.training import shift_labels  # noqa: E402

VOCAB = 97
LENS = (11, 23, 7)  # odd: no sequence splits evenly
TOL = 1e-10  # float64
# Parameters the modeling code takes through float32 (Qwen's RMSNorm weights, the decay's
# A_log.float()): per-rank partial sums of their gradients round differently (~1e-8).
FLOAT32_PARAMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "A_log")
FLOAT32_TOL = 1e-6
# Qwen3.5's and OLMo Hybrid's gated norms cast the gate to float32: a 1-ulp float64 difference in
# the gate projection (a matmul of another token count, as on a shard) can flip a float32 rounding,
# 2e-8 at the norm and ~1e-7 at the logits (measured, transformers 5.23). Their logits are float32-exact.
LOGITS_TOL = {"qwen3_5_text": 1e-6, "olmo_hybrid": 1e-6}
_DELTA_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in ("qwen3_next", "qwen3_5", "olmo_hybrid"))
# 6 V heads reading 2 K heads of another head dim: K heads are cut between ranks.
GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4)
FAMILIES = {"qwen3_next": GATED_DELTA, "qwen3_5_text": GATED_DELTA, "olmo_hybrid": GATED_DELTA, "llama": {}}
QUICK = ("qwen3_next", "qwen3_5_text", "llama")
MIXERS = ("qwen3_next", "qwen3_5_text", "olmo_hybrid")


def _build(family: str, attn_implementation: str):
    """A float64 model of ``family`` in eval mode (seed 0: every build has the same weights)."""
    torch.manual_seed(0)
    if family == "llama":
        config = tiny_llama_config(vocab_size=VOCAB)
        return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).to(torch.float64).eval()
    config = tiny_hf_config(family, vocab_size=VOCAB, **FAMILIES.get(family, {}))
    model = causal_lm_class(family)._from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"
    )
    return model.to(torch.float64).eval()


def _sequences():
    """The packed batch: ``(ids [1, T], labels [1, T])``, labels shifted within each sequence."""
    ids = torch.randint(3, VOCAB, (1, sum(LENS)), generator=torch.Generator().manual_seed(7))
    return ids, shift_labels(ids, seq_lens=LENS)


def _bounds(lens=LENS):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _packed_kwargs(lens=LENS) -> dict:
    """transformers' flash-attn kwargs of a flattened batch (DataCollatorWithFlattening)."""
    cu = _bounds(lens)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))


def _loss(logits, labels, count: int):
    """Summed next-token loss over ``count`` labelled tokens of the whole batch (a rank's share)."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
    ) / count


def _flat_grad(loss, model):
    """``(float64-computed, float32-computed)`` parameter gradients, each flat."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = [[], []]
    for name, g, p in zip(names, grads, params):
        flat[name.endswith(FLOAT32_PARAMS)].append((torch.zeros_like(p) if g is None else g).reshape(-1))
    return torch.cat(flat[0]), torch.cat(flat[1] or [torch.zeros(0, dtype=torch.float64)])


def _delta_rule_f64(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule with the arguments of transformers' kernel, one token at a time in
    float64: decay the state by ``exp(g_t)``, write ``k_t (beta_t (v_t - S^T k_t))^T``, read
    ``S^T q_t``; queries scaled by ``Dk ** -0.5`` after the optional L2 norm, K heads repeated to
    the V heads."""
    heads = value.shape[2]
    q, k = (x.repeat_interleave(heads // x.shape[2], 2).double() for x in (query, key))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = value.double(), g.double(), beta.double()
    s = v.new_zeros(k.shape[0], heads, k.shape[-1], v.shape[-1]) if initial_state is None else initial_state.double()
    outs = []
    for t in range(k.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, ..., None] * delta[:, :, None]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    out = torch.stack(outs, 1) if outs else v.new_zeros(k.shape[0], 0, heads, v.shape[-1])
    return out.to(query.dtype), (s if output_final_state else None)


@contextlib.contextmanager
def _float64_rule():
    """transformers' torch fallback of the gated delta rule computes in float32 whatever the model's
    dtype (and pads to its chunk size, so a sequence's float32 rounding depends on what follows
    it): the modeling files get the float64 rule above, which the one-device models and the
    adapters (reading it when they install) then run. One torch thread, like the pool's ranks."""
    modules = [importlib.import_module(m) for m in _DELTA_MODULES]
    saved, threads = [m.torch_chunk_gated_delta_rule for m in modules], torch.get_num_threads()
    torch.set_num_threads(1)
    for m in modules:
        m.torch_chunk_gated_delta_rule = _delta_rule_f64
    try:
        yield
    finally:
        for m, kernel in zip(modules, saved):
            m.torch_chunk_gated_delta_rule = kernel
        torch.set_num_threads(threads)


def _references(families):
    """Per family, one device running each sequence on its own: logits ``[1, T, V]`` (concatenated)
    and the gradients of the batch's loss.

    Each sequence runs from position 0 followed by the later ones, which its tokens' logits do not
    see (every layer is causal), so that the matmuls see about as many tokens as the packed batch's
    (LOGITS_TOL)."""
    ids, labels = _sequences()
    count = int((labels != -100).sum())
    starts = torch.tensor((0, *LENS)).cumsum(0).tolist()
    out = {}
    with _float64_rule():
        for family in families:
            ref = _build(family, "sdpa")
            logits = torch.cat([ref(input_ids=ids[:, a:]).logits[:, :n] for a, n in zip(starts, LENS)], 1)
            out[family] = (logits.detach(), _flat_grad(_loss(logits, labels, count), ref))
    return out


def _packed_call(model, state: ParallelState, **kwargs):
    ids, _ = _sequences()
    return model(
        input_ids=shard_packed(ids, state, LENS, dim=1), position_ids=shard_packed_positions(LENS, state)[None],
        **{**_packed_kwargs(), **kwargs},
    )


def _errors(model, state: ParallelState, reference) -> dict[str, float]:
    """Max logits and CP-summed gradient errors (relative to max(1, |gradient|)) of a packed call."""
    ids, labels = _sequences()
    ref_logits, ref_grads = reference
    logits = _packed_call(model, state).logits
    count = int((labels != -100).sum())
    grads = _flat_grad(_loss(logits, shard_packed(labels, state, LENS, dim=1), count), model)
    err = {"logits": (logits - shard_packed(ref_logits, state, LENS, dim=1)).abs().max().item()}
    for key, grad, ref_grad in zip(("grad", "grad32"), grads, ref_grads):
        if state.cp_size > 1:
            dist.all_reduce(grad, group=state.cp_group)  # partial gradients sum to the true one
        if grad.numel():
            err[key] = (grad - ref_grad).abs().max().item() / max(1.0, ref_grad.abs().max().item())
    return err


def _outcome(call) -> tuple[str, str]:
    try:
        with torch.no_grad():
            call()
        return ("ran", "")
    except Exception as e:  # noqa: BLE001 - the test asserts the type and message
        return (type(e).__name__, str(e))


def _refusals(state: ParallelState, name: str) -> dict[str, tuple[str, str]]:
    """``(exception type, message)`` of packed calls that must be refused on every rank."""
    model = _build("qwen3_next", name)
    ids, _ = _sequences()
    local, positions = shard_packed(ids, state, LENS, dim=1), shard_packed_positions(LENS, state)[None]
    other = (11, 19, 11)  # the same total: only the boundaries differ
    calls = {
        # cp rank 0 alone passes other boundaries
        "one rank differs": lambda: model(
            input_ids=local, position_ids=positions, **_packed_kwargs(other if state.cp_rank == 0 else LENS)),
        # boundaries of 42 tokens next to shards of 41
        "counts": lambda: model(input_ids=local, position_ids=positions, **_packed_kwargs((11, 23, 8))),
        # restarting positions without boundaries
        "no boundaries": lambda: model(input_ids=local, position_ids=positions),
        # and the model still runs after each refusal
        "after": lambda: _packed_call(model, state),
        # a token mixer that does not run packed batches
        "short conv": lambda: _packed_call(_build("lfm2", name), state),
    }
    return {what: _outcome(call) for what, call in calls.items()}


def _run(worlds, references, mixings, refusals: bool):
    """Per world ``(ring, ulysses)``: this rank's errors per (family, mixing) and refusals."""
    with _float64_rule():
        return _run_worlds(worlds, references, mixings, refusals)


def _run_worlds(worlds, references, mixings, refusals: bool):
    out = []
    for ring, ulysses in worlds:
        state = ParallelState(ring, ulysses, timeout=timedelta(seconds=60))  # a rank left waiting fails
        try:
            errors = {}
            for mixing in mixings:
                name = register(state, name=f"seqpar-test-packed-{mixing}-{ring}x{ulysses}", mixing=mixing)
                for family, reference in references.items():
                    if family in MIXERS or mixing == mixings[0]:  # softmax-only models: one mixing
                        errors[family, mixing] = _errors(_build(family, name), state, reference)
            refused = _refusals(state, register(state, name=f"seqpar-test-packed-refusals-{ring}x{ulysses}")) \
                if refusals else {}
            out.append((errors, refused))
        finally:
            state.close()
    return out


def _check_errors(where, errors):
    for key, err in errors.items():
        ok = err["logits"] < LOGITS_TOL.get(key[0], TOL) and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL
        assert ok, (where, key, err)


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, _) in zip(worlds, results):
            _check_errors((f"{ring}x{ulysses}", rank), errors)
    for w in range(len(worlds)):
        refused = per_rank[0][w][1]
        assert all(r[w][1] == refused for r in per_rank), worlds[w]  # the same outcome on every rank
        if not refused:
            continue
        want = {
            "one rank differs": ("ValueError", "different cu_seq_lens_q"),
            "counts": ("ValueError", "places"),
            "no boundaries": ("ValueError", "position_ids"),
            "after": ("ran", ""),
            "short conv": ("NotImplementedError", "packed batches"),
        }
        for what, (kind, text) in want.items():
            got_kind, message = refused[what]
            assert got_kind == kind and text in message, (worlds[w], what, refused[what])
        # the counts refusal names the sizes
        assert "[11, 23, 8]" in refused["counts"][1] and "41" in refused["counts"][1], refused["counts"]


def test_packed_families_exact_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references(QUICK), ("head_parallel", "state_passing"), True)
    _check(worlds, per_rank)


@pytest.mark.slow  # ~1 min on 2 shared cores
@pytest.mark.parametrize("world", [(3, 1), (1, 4)], ids=["3x1", "1x4"])
def test_packed_families_exact_on_shards(pools, world):
    per_rank = pools(world[0] * world[1]).run(
        _run, [world], _references(FAMILIES), ("head_parallel", "state_passing", "auto"), False
    )
    _check([world], per_rank)


def test_packed_on_one_rank():
    """With one rank too: transformers' torch fallbacks of the gated delta net cannot keep packed
    sequences apart (its rule refuses cu_seqlens, its conv ignores them), so the adapter runs
    them per sequence, in either mode."""
    state = ParallelState()
    names = {m: register(state, name=f"seqpar-test-packed-one-rank-{m}", mixing=m)
             for m in ("head_parallel", "state_passing")}
    references = _references(("qwen3_next", "llama"))
    with _float64_rule():
        for mixing, name in names.items():
            for family, reference in references.items():
                _check_errors(("1x1", 0), {(family, mixing): _errors(_build(family, name), state, reference)})
        refused = _refusals(state, names["head_parallel"])
    assert refused["no boundaries"][0] == "ValueError" and "cu_seq_lens_q" in refused["no boundaries"][1], refused
    assert refused["counts"][0] == "ValueError" and "[11, 23, 8]" in refused["counts"][1], refused
    assert refused["after"] == ("ran", ""), refused
    assert refused["short conv"][0] == "NotImplementedError" and "packed batches" in refused["short conv"][1], refused
