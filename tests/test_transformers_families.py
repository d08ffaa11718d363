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

import pytest
import torch

pytest.importorskip("transformers")

from _hf import SEQ_LEN, build, each_world, one_device, shard_errors, token_ids  # noqa: E402

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.tools.models.hf_configs import HF_MLA_FAMILIES, HF_REFUSED_FAMILIES  # noqa: E402

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


def _mla_errors(state: ParallelState, name: str) -> dict[str, dict[str, float]]:
    """Max logits and summed-gradient errors (relative to max(1, |gradient|)) of every MLA family
    (and of RUN_HERE) against the single-device model."""
    tokens = token_ids(2, SEQ_LEN, low=0)
    out = {}
    for family in (*HF_MLA_FAMILIES, *RUN_HERE):
        ref = one_device(build(family, REFERENCE.get(family, "sdpa")), tokens)
        out[family] = shard_errors(build(family, name), state, tokens, ref)
    return out


def _refusals(state: ParallelState, name: str) -> dict[str, tuple[str, str]]:
    """``(exception type, message)`` of every refused family's call on this rank."""
    tokens = token_ids(2, 1, low=0)
    local, positions = shard(tokens, state), shard_positions(SEQ_LEN, state)[None]
    out = {}
    for family in HF_REFUSED_FAMILIES:
        if family in RUN_HERE:
            continue
        try:
            model = build(family, name)  # Falcon and GPT-J are refused here, while they are built
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

    def run(state, ring, ulysses):
        name = register(state, name=f"seqpar-test-families-{ring}x{ulysses}")
        with _deepseek_v2_rope_in_float64():
            mla = _mla_errors(state, name)
        return mla, _refusals(state, name)

    return each_world(worlds, run)


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, refusals) in zip(worlds, results):
            where = (f"{ring}x{ulysses}", rank)
            for family, err in errors.items():
                assert err["logits"] < TOL and err["grad"] < TOL, (where, family, err)
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
