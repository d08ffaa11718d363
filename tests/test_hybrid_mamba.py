"""Mamba families on sequence shards (issue #43 item 3; Note [Mamba adapters]).

Mamba2 (SSD) + conv1d: Bamba, Nemotron-H, GraniteMoeHybrid, Zamba2, Falcon-H1 (Mamba next to
attention in every layer) built with ``attn_implementation=register(state)``, and Mamba2 itself;
Mamba1 (selective scan) + conv1d: Jamba (``register``) and Mamba. Mamba and Mamba2 have no softmax
attention (their forward takes no ``position_ids``, which the model check asks for), so they run
with the adapters installed directly (``transformers_mixers.install(model, state)``).

Float64 logits and CP-summed parameter gradients against the one-device model. The models keep
float32 islands that round differently on a shard than on the whole sequence (the torch SSD and
selective scans convert to float32 inside, and so reduce some gradients over heads or tokens in
float32; Nemotron-H's RMSNorm multiplies its weight in float32): both models get float64 versions
of those (``_float64_islands``), so that the comparison to 1e-10 isolates what seqpar does. The
models' own float32 kernels are checked too, to float32 rounding. Refusals (a cache, a forward
that differs from the one read) raise the same error on every rank; no rank is left waiting.
"""

import contextlib
import importlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

import seqpar  # noqa: E402
from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402

VOCAB = 97
SEQ_LEN = 37  # odd: no split is even
TOL = 1e-10  # float64
TOL_FLOAT32 = 1e-5  # the models' own float32 kernels: rounding ~1e-7; a wrong mixer is off by ~1e-2
HYBRID = ("bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1", "jamba")  # register(state)
PLAIN = ("mamba2", "mamba")  # no softmax attention: install(model, state)
MAMBA2_MODULES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1")
MAMBA1_MODULES = ("mamba", "jamba")


# --- float64 versions of the models' float32 islands (both models get them) -----------------------


def ssd_float64(hidden_states, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """The Mamba2 scan, token by token in float64. hidden_states [b, s, h, p]; dt [b, s, h];
    A [h]; B, C [b, s, g, n] (group j read by heads j*h/g ..)."""
    assert z is None and initial_states is None and not return_final_states
    x, dt = hidden_states.double(), dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    rep = x.shape[2] // B.shape[2]
    B, C = B.double().repeat_interleave(rep, 2), C.double().repeat_interleave(rep, 2)
    h = x.new_zeros(*x.shape[:1], x.shape[2], x.shape[3], B.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A.double())[..., None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    return y if D is None else y + D.double()[:, None] * x


def selective_scan_float64(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False, **kwargs):
    """The Mamba1 scan in float64. hidden_states, dt, z [b, i, s]; A [i, n]; B, C [b, n, s]."""
    assert not return_last_state
    x, dt = hidden_states.double(), dt.double()
    if delta_bias is not None:
        dt = dt + delta_bias.double()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    h = x.new_zeros(x.shape[0], x.shape[1], A.shape[-1])
    ys = []
    for t in range(x.shape[2]):
        h = torch.exp(A * dt[:, :, t, None]) * h + (dt[:, :, t, None] * x[:, :, t, None]) * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + D[None, :, None] * x
    return y if z is None else y * F.silu(z)


def _rms_norm_float64(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def _float64_islands():
    patches = []
    for name in MAMBA2_MODULES:
        patches.append((importlib.import_module(f"transformers.models.{name}.modeling_{name}"), "mamba2_chunk_scan",
                        ssd_float64))
    for name in MAMBA1_MODULES:
        patches.append((importlib.import_module(f"transformers.models.{name}.modeling_{name}"),
                        "mamba_selective_scan", selective_scan_float64))
    nemotron = importlib.import_module("transformers.models.nemotron_h.modeling_nemotron_h")
    patches.append((nemotron.NemotronHRMSNorm, "forward", _rms_norm_float64))
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


# --- one family on one split ----------------------------------------------------------------------


def _build(family: str, attn_implementation: str):
    """A float64 model of ``family`` in eval mode (seed 0: every build has the same weights)."""
    torch.manual_seed(0)
    return causal_lm_class(family)._from_config(
        tiny_hf_config(family), attn_implementation=attn_implementation, experts_implementation="eager"
    ).to(torch.float64).eval()


def _flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params, allow_unused=True)  # unrouted experts get None
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def _sharded_model(family: str, state: ParallelState, name: str):
    """The model as users run it on shards, and the extra call kwargs it needs."""
    if family in PLAIN:
        model = _build(family, "eager")
        install(model, state)
        return model, {}
    return _build(family, name), {"position_ids": shard_positions(SEQ_LEN, state)[None]}


def _errors(family: str, state: ParallelState, name: str, mask: bool = False) -> dict[str, float]:
    """Max logits and summed-gradient errors against the one-device model (``mask``: a padding
    mask, left padding on row 0, for the families that take one on shards)."""
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(SEQ_LEN))
    labels = shift_labels(ids)
    full_mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    full_mask[0, :5] = 0
    extra_ref = {"attention_mask": full_mask} if mask else {}
    ref = _build(family, "eager" if family in PLAIN else "sdpa")  # sdpa: a float64 softmax
    ref_logits = ref(input_ids=ids, **extra_ref).logits
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), labels.reshape(-1))
    ref_grad = _flat_grad(ref_loss, list(ref.parameters()))

    model, extra = _sharded_model(family, state, name)
    if mask:
        extra["attention_mask"] = shard(full_mask, state)
    logits = model(input_ids=shard(ids, state), **extra).logits
    grad = _flat_grad(sharded_cross_entropy(logits, shard(labels, state), state), list(model.parameters()))
    dist.all_reduce(grad, group=state.cp_group)  # partial gradients sum to the true one
    return {
        "logits": (logits - shard(ref_logits, state)).abs().max().item(),
        "grad": (grad - ref_grad).abs().max().item(),
        "scale": max(1.0, ref_grad.abs().max().item()),
    }


def _refusal(fn) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 - the test asserts the type and message
        return (type(e).__name__, str(e))


def _with_cache(family: str, state: ParallelState, name: str) -> tuple[str, str]:
    ids = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    model, extra = _sharded_model(family, state, name)
    return _refusal(lambda: model(input_ids=shard(ids, state), use_cache=True, **extra))


def _full_length_mask(family: str, state: ParallelState, name: str) -> tuple[str, str]:
    """A full-length mask next to sharded ids (transformers' Mamba2Model would cut it to the shard's
    length): refused, not misapplied."""
    ids = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(1, SEQ_LEN, dtype=torch.long)
    mask[0, :3] = 0
    model, extra = _sharded_model(family, state, name)
    return _refusal(lambda: model(input_ids=shard(ids, state), attention_mask=mask, **extra))


def _changed_forward(state: ParallelState, name: str) -> tuple[str, str]:
    """A BambaMixer whose forward is not the one the adapter was read against."""
    from transformers.models.bamba import modeling_bamba

    original = modeling_bamba.BambaMixer.forward

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return original(self, hidden_states * 2, cache_params, attention_mask, **kwargs)

    modeling_bamba.BambaMixer.forward = forward
    try:
        model = _build("bamba", name)
        ids = shard(torch.zeros(1, SEQ_LEN, dtype=torch.long), state)
        return _refusal(lambda: model(input_ids=ids, position_ids=shard_positions(SEQ_LEN, state)[None]))
    finally:
        modeling_bamba.BambaMixer.forward = original


def _run(worlds, families, quick: bool):
    """Per world ``(ring, ulysses)``: this rank's errors (float64 islands), and on the quick run
    the float32 kernels' errors, the refusals and ``seqpar.verify``'s verdict."""
    out = []
    for ring, ulysses in worlds:
        state = ParallelState(ring, ulysses, timeout=timedelta(seconds=90))  # a rank left waiting fails
        name = register(state, name=f"seqpar-test-mamba-{ring}x{ulysses}")
        try:
            with _float64_islands():
                errors = {f: _errors(f, state, name) for f in families}
                if quick:
                    errors.update({f"{f}+mask": _errors(f, state, name, mask=True) for f in PLAIN})
            result = {"errors": errors}
            if quick:
                result["float32"] = {f: _errors(f, state, name) for f in ("bamba", "jamba")}
                result["cache"] = {f: _with_cache(f, state, name) for f in families}
                result["changed"] = _changed_forward(state, name)
                result["full_mask"] = {f: _full_length_mask(f, state, name) for f in PLAIN}
                report = seqpar.verify(_build("bamba", name), state, strict=False)
                result["verify"] = (report.ok, report.verdict)
            out.append(result)
        finally:
            state.close()
    return out


def _check(worlds, per_rank, quick: bool):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), result in zip(worlds, results):
            where = (f"{ring}x{ulysses}", rank)
            for family, err in result["errors"].items():
                assert err["logits"] < TOL and err["grad"] < TOL * err["scale"], (where, family, err)
            if not quick:
                continue
            for family, err in result["float32"].items():
                assert err["logits"] < TOL_FLOAT32 and err["grad"] < TOL_FLOAT32 * err["scale"], (where, family, err)
            for family, (kind, message) in result["cache"].items():
                assert kind == "NotImplementedError" and "cache" in message, (where, family, kind, message)
            for family, (kind, message) in result["full_mask"].items():
                want = f"attention_mask of {SEQ_LEN} tokens"
                assert kind == "ValueError" and want in message, (where, family, message)
            kind, message = result["changed"]
            assert kind == "NotImplementedError" and "BambaMixer" in message and "5.23" in message, (where, message)
            assert result["verify"][0], (where, result["verify"][1])
    if quick:  # the same error on every rank
        for w in range(len(worlds)):
            for key in ("cache", "changed", "full_mask"):
                assert all(r[w][key] == per_rank[0][w][key] for r in per_rank), (worlds[w], key)


def test_one_rank_unchanged():
    """With one CP rank the adapters change nothing: the model's own forward runs."""
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    for family in ("bamba", "jamba"):
        model, fresh = _build(family, "sdpa"), _build(family, "sdpa")
        assert install(model, ParallelState())  # the mixers are found and adapted
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits), family


def test_mamba_families_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, HYBRID + PLAIN, True)
    _check(worlds, per_rank, True)


@pytest.mark.slow  # several minutes on 2 shared cores: 8 families, 3 more splits
@pytest.mark.parametrize("worlds", [[(1, 4), (4, 1)], [(3, 1)]], ids=["1x4+4x1", "3x1"])
def test_mamba_families_on_splits(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, HYBRID + PLAIN, False)
    _check(worlds, per_rank, False)
