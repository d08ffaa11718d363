"""transformers families beyond windows and chunks (docs/models.md, the family table).

MLA families (DeepSeek-V2, DeepSeek-V3, MiMo-V2-Flash: key and value heads of different sizes)
run exactly under ``register(state)``: float64 logits and summed gradients against the
single-device model. Families whose attention seqpar cannot reach or express (Bloom, MPT and
Falcon compute attention in their own modules, GPT-J too; T5 adds a relative position bias) are
refused with a ``NotImplementedError`` raised on every rank: the pool's run returns, no rank waits.
One pool per world, with a short collective timeout, so that a rank left waiting fails the test.
"""

import contextlib
import inspect
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.tools.models.hf_configs import (  # noqa: E402
    HF_MLA_FAMILIES,
    HF_REFUSED_FAMILIES,
    causal_lm_class,
    tiny_hf_config,
)
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402

VOCAB = 97
SEQ_LEN = 37  # odd: no split is even
TOL = 1e-10  # float64
# Single-device reference implementation: transformers' eager attention takes its softmax in float32
# (not a float64 reference), except MiMo-V2-Flash's own eager (with sinks), which has no sdpa.
REFERENCE = {"deepseek_v2": "sdpa", "deepseek_v3": "sdpa", "mimo_v2_flash": "eager"}

# What each refused family's error says (besides the model class): the reason it is refused.
REFUSALS = {
    "bloom": "computes attention itself",
    "mpt": "computes attention itself",
    "falcon_alibi": "computes attention itself",
    "falcon_rope": "computes attention itself",
    "falcon_new_alibi": "computes attention itself",
    "falcon_new_rope": "computes attention itself",
    "gptj": "computes attention itself",
    "t5": "takes no position_ids",
}
# And on one rank (no shards), where the model's own checks stop at the first two.
ONE_RANK_REFUSALS = {**REFUSALS, "t5": "position biases (T5-style relative attention)"}


def _gptj_calls_the_attention_interface() -> bool:
    """transformers 5.24 rewrote GPT-J's attention to call the attention interface (5.23 computes
    it itself): there seqpar runs it, and it must then be exact rather than refused."""
    from transformers.models.gptj import modeling_gptj

    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(modeling_gptj.GPTJAttention)


# Families of HF_REFUSED_FAMILIES the installed transformers lets seqpar run: checked for exactness.
RUN_HERE = ("gptj",) if _gptj_calls_the_attention_interface() else ()


def _build(family: str, attn_implementation: str):
    """A float64 model of ``family`` in eval mode (seed 0, so every build has the same weights)."""
    cls = causal_lm_class(family)
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if family in HF_MLA_FAMILIES else {}  # float64 MoE
    return cls._from_config(tiny_hf_config(family), attn_implementation=attn_implementation, **experts).to(
        torch.float64
    ).eval()


@contextlib.contextmanager
def _deepseek_v2_rope_in_float64():
    """DeepSeek-V2 applies RoPE in complex64: float32 sin/cos and products whose last bit depends
    on where an element falls in a vectorised loop, so a shard's tokens differ from the same
    tokens in the full sequence by ~1e-7, before attention. Both models (reference and sharded)
    get the same RoPE in complex128 instead, so that the comparison isolates attention."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq.double()
        return torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling

    def apply(xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.unsqueeze(1)
        return torch.view_as_real(xq_ * freqs_cis).flatten(3), torch.view_as_real(xk_ * freqs_cis).flatten(3)

    saved = ds.DeepseekV2RotaryEmbedding.forward, ds.apply_rotary_emb
    ds.DeepseekV2RotaryEmbedding.forward, ds.apply_rotary_emb = rotary, apply
    try:
        yield
    finally:
        ds.DeepseekV2RotaryEmbedding.forward, ds.apply_rotary_emb = saved


def _flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params, allow_unused=True)  # unrouted experts get None
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def _mla_errors(state: ParallelState, name: str) -> dict[str, dict[str, float]]:
    """Max logits and summed-gradient errors of every MLA family (and of RUN_HERE) against the
    single-device model."""
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(SEQ_LEN))
    labels = shift_labels(ids)
    out = {}
    for family in (*HF_MLA_FAMILIES, *RUN_HERE):
        ref, model = _build(family, REFERENCE.get(family, "sdpa")), _build(family, name)
        ref_logits = ref(input_ids=ids).logits
        ref_loss = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, VOCAB), labels.reshape(-1))
        ref_grad = _flat_grad(ref_loss, list(ref.parameters()))

        logits = model(input_ids=shard(ids, state), position_ids=shard_positions(SEQ_LEN, state)[None]).logits
        grad = _flat_grad(sharded_cross_entropy(logits, shard(labels, state), state), list(model.parameters()))
        if state.cp_size > 1:
            dist.all_reduce(grad, group=state.cp_group)  # partial gradients sum to the true one
        out[family] = {
            "logits": (logits - shard(ref_logits, state)).abs().max().item(),
            "grad": (grad - ref_grad).abs().max().item(),
            "scale": ref_grad.abs().max().item(),
        }
    return out


def _refusals(state: ParallelState, name: str) -> dict[str, tuple[str, str]]:
    """``(exception type, message)`` of every refused family's call on this rank."""
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    local, positions = shard(ids, state), shard_positions(SEQ_LEN, state)[None]
    out = {}
    for family in HF_REFUSED_FAMILIES:
        if family in RUN_HERE:
            continue
        try:
            model = _build(family, name)  # Falcon and GPT-J are refused here, while they are built
            kwargs = {"input_ids": local}
            if family == "t5":
                kwargs["decoder_input_ids"] = local
            elif "position_ids" in inspect.signature(model.forward).parameters:
                kwargs["position_ids"] = positions
            model(**kwargs)
            out[family] = ("ok", "")
        except Exception as e:  # noqa: BLE001 - the test asserts the type
            out[family] = (type(e).__name__, str(e))
    return out


def _families(worlds: list[tuple[int, int]]):
    """Per world ``(ring, ulysses)``: this rank's MLA errors and refusals."""
    out = []
    for ring, ulysses in worlds:
        state = ParallelState(ring, ulysses, timeout=timedelta(seconds=60)) if ring * ulysses > 1 else ParallelState()
        name = register(state, name=f"seqpar-test-families-{ring}x{ulysses}")
        try:
            with _deepseek_v2_rope_in_float64():
                errors = _mla_errors(state, name)
            out.append((errors, _refusals(state, name)))
        finally:
            state.close()
    return out


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, refusals) in zip(worlds, results):
            where = (f"{ring}x{ulysses}", rank)
            for family, err in errors.items():
                assert err["logits"] < TOL and err["grad"] < TOL * max(1.0, err["scale"]), (where, family, err)
            want = REFUSALS if ring * ulysses > 1 else ONE_RANK_REFUSALS
            for family, (kind, message) in refusals.items():
                assert kind == "NotImplementedError" and want[family] in message, (where, family, kind, message)
    for w in range(len(worlds)):  # the same error on every rank
        for family, refusal in per_rank[0][w][1].items():
            assert all(r[w][1][family] == refusal for r in per_rank), (worlds[w], family)


def test_families_one_process():
    worlds = [(1, 1)]
    _check(worlds, [_families(worlds)])


@pytest.mark.slow  # ~1-2 min on 2 shared cores: 8 model families, 2 worlds
@pytest.mark.parametrize("worlds", [[(2, 2), (1, 4)], [(3, 1)]], ids=["2x2+1x4", "3x1"])
def test_families_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_families, worlds)
    _check(worlds, per_rank)
