"""``seqpar.verify``: the model self-check (docs/verify.md).

A model that is exact on shards passes (float64, every split); one with a layer that mixes tokens
outside attention, or a wrong backward, is caught, and the error names exactly that module, the
same on every rank. One pool per world size, with a short collective timeout, so that a rank left
waiting fails the test.

The token mixer put into the Llama (a product with a triangular matrix) is one the transformers
model check, which refuses the mixers it recognises from structure, lets through, so that these
tests see what verify finds by itself; the same mixer written with ``cumsum`` is refused by the
model check first, on every rank, and verify raises that refusal.
"""

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqpar
from seqpar import ParallelState
from seqpar.verify import VerificationError

_TIMEOUT = timedelta(seconds=60)  # the states' collectives: a rank left waiting fails the test

SEQ_LEN = 37


class RunningMean(nn.Module):
    """A token mixer seqpar does not parallelize: each token becomes the mean of the tokens up to it,
    then a linear map. Written as a product with a triangular matrix (no scan or convolution), so
    that the transformers model check, which refuses the mixers it recognises, lets it through."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = x.shape[1]
        weights = torch.ones(S, S, dtype=x.dtype, device=x.device).tril()
        return self.proj((weights / weights.sum(1, keepdim=True)) @ x)


class CumulativeMean(RunningMean):
    """The same mixer written with ``cumsum``, which the transformers model check recognises."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[:, None]
        return self.proj(x.cumsum(1) / count)


class _HalfGradOnShards(torch.autograd.Function):
    """Identity whose backward halves the gradient when it sees fewer than ``SEQ_LEN`` tokens."""

    @staticmethod
    def forward(ctx, x):
        ctx.sharded = x.shape[1] < SEQ_LEN
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5 if ctx.sharded else grad


class WrongBackward(nn.Module):
    """An MLP whose output is exact on shards but whose input gradient is not (a custom backward bug)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(_HalfGradOnShards.apply(x))


def _llama(name: str, mixer: str | None = None) -> nn.Module:
    """A tiny float32 Llama (seed 0) built for ``name``; ``mixer`` replaces layer 1's MLP."""
    from transformers import LlamaForCausalLM

    from seqpar.tools.models.llama import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM._from_config(config, attn_implementation=name)
    layer = model.model.layers[1]
    if mixer == "running_mean":
        layer.mlp = RunningMean(model.config.hidden_size)
    elif mixer == "cumulative_mean":
        layer.mlp = CumulativeMean(model.config.hidden_size)
    elif mixer == "wrong_backward":
        layer.mlp = WrongBackward(layer.mlp)
    return model


def _outcome(fn) -> tuple[bool, str]:
    """``(passed, report or error message)`` of ``fn()``."""
    try:
        return True, str(fn())
    except VerificationError as e:
        return False, str(e)


def _llama_cases(ring: int, ulysses: int) -> dict[str, object]:
    from seqpar.integrations.transformers import register

    state = ParallelState(ring_size=ring, ulysses_size=ulysses, timeout=_TIMEOUT)
    name = register(state)
    out: dict[str, object] = {}
    model = _llama(name).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out["good"] = _outcome(lambda: seqpar.verify(model, state))
    # The model comes back as it was: weights, dtype, mode, no .grad, its own attention and checks.
    out["restored"] = (
        all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        and all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
        and model.training and model.config._attn_implementation == name
    )
    try:
        model(input_ids=seqpar.shard(torch.zeros(1, SEQ_LEN, dtype=torch.long), state), use_cache=False)
        out["checked"] = "no error"
    except ValueError as e:  # the model check: no position_ids on shards
        out["checked"] = str(e)
    for mixer in ("running_mean", "wrong_backward"):
        out[mixer] = _outcome(lambda: seqpar.verify(_llama(name, mixer), state))
    try:  # the model check refuses it before any rank runs the model on its shard
        seqpar.verify(_llama(name, "cumulative_mean"), state)
        out["refused"] = "no error"
    except NotImplementedError as e:
        out["refused"] = str(e)
    report = seqpar.verify(_llama(name, "running_mean"), state, strict=False)
    out["report"] = (report.ok, report.culprit.path if report.culprit else None, str(report))
    state.close()
    return out


class Block(nn.Module):
    """A pre-norm ViT block over SDPA; ``mix`` adds a depthwise convolution over tokens."""

    def __init__(self, dim: int, heads: int, mix: bool) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mix = nn.Conv1d(dim, dim, 3, padding=1, groups=dim) if mix else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, C))
        if self.mix is not None:
            x = x + self.mix(x.transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(x)


def _vit(mix_in: int | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(16, 4, i == mix_in) for i in range(3)))


def _vit_seeded(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(Block(16, 4, False) for _ in range(3)))


def _sdpa_cases(ring: int, ulysses: int) -> dict[str, object]:
    state = ParallelState(ring_size=ring, ulysses_size=ulysses, timeout=_TIMEOUT)
    tokens = torch.randn(2, SEQ_LEN, 16, generator=torch.Generator().manual_seed(1))
    out = {
        "good": _outcome(lambda: seqpar.verify(_vit(None), state, tokens)),
        "mixer": _outcome(lambda: seqpar.verify(_vit(2), state, tokens)),
    }
    state.close()
    return out


def _refusals(ring: int, ulysses: int) -> dict[str, str]:
    """The ValueError of each bad call (every rank must raise, none may wait)."""
    from seqpar.integrations.transformers import register

    state = ParallelState(ring_size=ring, ulysses_size=ulysses, timeout=_TIMEOUT)
    name = register(state)
    rank = state.cp_rank
    calls = {
        # Each rank draws its own tokens: not one full input.
        "inputs_differ": lambda: seqpar.verify(_vit(None), state, torch.randn(1, SEQ_LEN, 16) + rank),
        "too_short": lambda: seqpar.verify(_vit(None), state, torch.randn(1, 2, 16, generator=torch.Generator())),
        # Each rank builds its model from its own seed: not one set of weights.
        "weights_differ": lambda: seqpar.verify(_vit_seeded(rank), state, torch.zeros(1, SEQ_LEN, 16)),
        "not_seqpar": lambda: seqpar.verify(_llama("sdpa"), state),
        "other_state": lambda: seqpar.verify(_llama(name), ParallelState()),
    }
    out = {}
    for case, call in calls.items():
        try:
            call()
            out[case] = "no error"
        except ValueError as e:
            out[case] = str(e)
    state.close()
    return out


@pytest.fixture(scope="module")
def pool4(pools):
    return pools(4)  # the session's ranks: a spawn that imports transformers costs ~20 s per rank


@pytest.fixture(scope="module")
def pool3(pools):
    pytest.importorskip("transformers")
    return pools(3)


def _same_on_every_rank(results: list[dict[str, object]], key: str) -> object:
    values = [r[key] for r in results]
    assert all(v == values[0] for v in values), f"{key}: ranks disagree: {values}"
    return values[0]


@pytest.mark.slow  # a transformers model on every rank: not in the quick subset
@pytest.mark.parametrize("ring,ulysses", [(2, 2), (4, 1)])
def test_llama_passes_and_mixers_are_named(pool4, ring, ulysses):
    pytest.importorskip("transformers")
    results = pool4.run(_llama_cases, ring, ulysses)
    passed, text = _same_on_every_rank(results, "good")
    assert passed, text
    assert "every module agrees" in text and "model.layers.1.mlp" in text  # the table lists every module
    assert _same_on_every_rank(results, "restored") is True
    assert "position_ids" in _same_on_every_rank(results, "checked")  # the model check is back

    passed, text = _same_on_every_rank(results, "running_mean")
    assert not passed
    assert text.startswith("seqpar.verify: model.layers.1.mlp: max error ")
    if (ring, ulysses) == (2, 2):  # cp rank 0 holds tokens 0..9: a running mean there is exact
        assert " on ranks 1-3 " in text
    ok, culprit, table = _same_on_every_rank(results, "report")
    assert not ok and culprit == "model.layers.1.mlp" and table.splitlines()[-1] == text

    assert "model.layers.1.mlp (CumulativeMean" in _same_on_every_rank(results, "refused")

    passed, text = _same_on_every_rank(results, "wrong_backward")
    assert not passed
    assert text.startswith("seqpar.verify: model.layers.1.mlp: every forward output agrees, but its input gradients")


@pytest.mark.slow  # a transformers model on every rank: not in the quick subset
def test_llama_three_ranks(pool3):
    results = pool3.run(_llama_cases, 3, 1)
    passed, text = _same_on_every_rank(results, "good")
    assert passed, text
    passed, text = _same_on_every_rank(results, "running_mean")
    assert not passed and text.startswith("seqpar.verify: model.layers.1.mlp: max error ")


@pytest.mark.parametrize("ring,ulysses", [(2, 2), (1, 4)])
def test_sdpa_module(pool4, ring, ulysses):
    results = pool4.run(_sdpa_cases, ring, ulysses)
    passed, text = _same_on_every_rank(results, "good")
    assert passed, text
    passed, text = _same_on_every_rank(results, "mixer")
    assert not passed
    assert text.startswith("seqpar.verify: 2.mix: max error "), text


def test_bad_calls_raise_on_every_rank(pool4):
    pytest.importorskip("transformers")
    results = pool4.run(_refusals, 2, 2)
    assert "inputs of cp ranks [1, 2, 3] differ" in _same_on_every_rank(results, "inputs_differ")
    assert "parameters or buffers of cp ranks [1, 2, 3] differ from cp rank 0's (the first: 0.qkv.weight)" in (
        _same_on_every_rank(results, "weights_differ"))
    assert "use at least 4 tokens" in _same_on_every_rank(results, "too_short")
    assert "attn_implementation='sdpa'" in _same_on_every_rank(results, "not_seqpar")
    assert "another ParallelState" in _same_on_every_rank(results, "other_state")


def test_one_process():
    """A size-1 state with no process group: both runs are the same computation."""
    report = seqpar.verify(_vit(1), ParallelState(), torch.randn(1, 5, 16))
    assert report.ok and "1.mix" in str(report)
