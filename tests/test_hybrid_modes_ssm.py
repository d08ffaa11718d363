"""State-space and Kimi-delta hybrids in both mixing modes: head-parallel and state passing (issue #43).

The Mamba2 (SSD) families -- Bamba, Nemotron-H, GraniteMoeHybrid, Zamba2, Falcon-H1 built with
``attn_implementation=register(state, mixing=...)``, and Mamba2 itself with ``install(model, state,
mixing=...)`` (no softmax attention) -- and the Kimi delta attention families (Kimi Linear, Bailing
hybrid) run on token shards in each mode: float64 logits and CP-summed parameter gradients equal
the one-device sdpa model's and each other's, at an odd length (37) under ring x Ulysses 2 x 2
(quick), 3 x 1 and 1 x 4 (slow). ``mixing_modes`` says what every adapted mixer ran; ``"auto"``
passes states where the ranks outnumber the heads (bitwise the state-passing mode's logits) and
runs head-parallel where its predicted bytes are fewer (bitwise the head-parallel mode's).
``"state_passing"`` for a model whose mixer has no such form is a ValueError on every rank.

The models keep float32 islands that round differently on a shard than on the whole sequence or
at another place in a buffer (the torch SSD and KDA kernels compute in float32; Nemotron-H's,
Kimi's and Bailing's norms and KDA's forget gates too), so both the one-device and the sharded
models get float64 versions of them here, written from their definitions (token by token for the
scans, with initial and final states: state passing starts pieces from given states). What stays
float32: ``A = -exp(A_log.float())`` of the Mamba2 mixers, whose gradient is a float32 sum that
per-piece partial sums round differently (within 1e-6, like test_hybrid_modes.py's).
"""

import contextlib
import importlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install, mixing_modes  # noqa: E402
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config  # noqa: E402
from seqpar.training import sharded_cross_entropy, shift_labels  # noqa: E402

VOCAB = 97
SEQ_LEN = 37  # odd: no split is even
TOL = 1e-10  # float64
FLOAT32_TOL = 1e-6
MODES = ("head_parallel", "state_passing")
MAMBA2 = ("bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1", "mamba2")
KDA = ("kimi_linear", "bailing_hybrid")
MAMBA1 = ("jamba", "mamba")
FAMILIES = MAMBA2 + KDA + MAMBA1
NO_ATTENTION = ("mamba2", "mamba")  # no position_ids: install(model, state, mixing=...)
# 2 SSD heads (or KDA heads) over 4 ranks: two hold no head, so "auto" passes states.
FEW_HEADS = {
    "bamba": dict(mamba_n_heads=2, mamba_d_head=32),
    "kimi_linear": dict(linear_num_heads=2),
}
# Parameters the modeling code takes through float32 (A = -exp(A_log.float()); Mamba1's D.float()
# and dt_proj.bias.float()): their gradients are float32 sums that per-piece partial sums round differently.
FLOAT32_PARAMS = {family: ("A_log",) for family in MAMBA2 + KDA}
FLOAT32_PARAMS.update({family: ("A_log", ".D", "dt_proj.bias") for family in MAMBA1})
# 4 heads (Jamba: 64 channels) over 4 ranks, 37 tokens: the mode "auto" runs by the predicted bytes
# (10 tokens per rank; Mamba1's small state makes its summaries cheaper than the exchange)
BYTES = {"bamba": "head_parallel", "kimi_linear": "head_parallel", "jamba": "state_passing"}
# The quick run: every adapter path once (register and install, Falcon-H1's variant, KDA, Mamba1);
# the others on 2 x 2 and all of them on 3 x 1 and 1 x 4 in the slow runs.
QUICK = ("bamba", "falcon_h1", "mamba2", "kimi_linear", "jamba")


# --- float64 versions of the float32 islands (the one-device and the sharded models get them) -----


def ssd_float64(hidden_states, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """The Mamba2 scan with ``mamba2_chunk_scan``'s arguments, token by token in float64:
    ``h_t = exp(A delta_t) h_{t-1} + delta_t x_t B_t^T``, ``y_t = h_t C_t + D x_t`` with ``delta =
    clamp(softplus(dt + dt_bias))``; hidden_states [b, s, h, p], B, C [b, s, g, n] (group j read by
    heads j*h/g ..), states [b, h, p, n]."""
    assert z is None
    x, dt = hidden_states.double(), dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    rep = x.shape[2] // B.shape[2]
    B, C = B.double().repeat_interleave(rep, 2), C.double().repeat_interleave(rep, 2)
    h = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    h = h if initial_states is None else initial_states.double()
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A.double())[..., None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1) if ys else x.new_zeros(x.shape)
    y = y if D is None else y + D.double()[:, None] * x
    return (y, h) if return_final_states else y


def selective_scan_float64(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False, **kwargs):
    """The Mamba1 scan with ``mamba_selective_scan``'s arguments in float64 (from a zero state, as
    the kernel): hidden_states, dt, z [b, i, s]; A [i, n]; B, C [b, n, s]."""
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
    y = torch.stack(ys, -1) if ys else x.new_zeros(x.shape)
    if D is not None:
        y = y + D[None, :, None] * x
    y = y if z is None else y * F.silu(z)
    return (y, h) if return_last_state else y


def kda_float64(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
    """Kimi delta attention with ``chunk_kimi_delta_attention``'s arguments, token by token in
    float64: ``S_t = diag(exp(g_t)) S_{t-1}``, then ``S_t += k_t (beta_t (v_t - S_t^T k_t))^T``,
    ``o_t = S_t^T q_t`` with queries scaled by ``D ** -0.5`` after the optional L2 norm (sqrt, as
    the modeling file's ``l2norm``)."""
    q, k, v, g, beta = (t.double() for t in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    batch, length, heads, dk = k.shape
    h = v.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.double()
    outs = []
    for t in range(length):
        h = h * g[:, t].exp()[..., None]
        delta = beta[:, t, :, None] * (v[:, t] - (h * k[:, t, :, :, None]).sum(-2))
        h = h + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((h * q[:, t, :, :, None]).sum(-2))
    out = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return out.to(query.dtype), (h if output_final_state else None)


def _rms_norm_float64(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _gated_norm_float64(self, hidden_states, gate=None):
    from transformers.activations import ACT2FN

    return _rms_norm_float64(self, hidden_states) * ACT2FN[self.activation](gate)


def _kimi_gate_float64(self, hidden_states):
    g = self.f_b_proj(self.f_a_proj(hidden_states)) + self.dt_bias.view(1, 1, -1)
    g = g.view(*hidden_states.shape[:2], -1, self.head_dim)
    return -torch.exp(self.A_log) * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def _bailing_gate_float64(self, hidden_states):
    g = self.f_proj(hidden_states).view(*hidden_states.shape[:2], self.num_heads, self.head_dim)
    g = g + self.dt_bias.view(1, 1, self.num_heads, self.head_dim)
    rate = self.A_log.exp().view(1, 1, self.num_heads, 1)
    return self.lower_bound * torch.sigmoid(rate * g) if self.safe_gate else -rate * F.softplus(g)


def _module(name):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


@contextlib.contextmanager
def _float64_islands():
    """The float64 islands above in the modeling files (read by the one-device forward and by the
    adapters when they install), and one torch thread (tiny float64 ops on several threads of a
    busy 2-core machine mostly wait for each other)."""
    kimi, bailing, nemotron = _module("kimi_linear"), _module("bailing_hybrid"), _module("nemotron_h")
    patches = [(_module(name), "mamba2_chunk_scan", ssd_float64) for name in MAMBA2]
    patches += [(_module(name), "mamba_selective_scan", selective_scan_float64) for name in MAMBA1]
    patches += [(m, "chunk_kimi_delta_attention", kda_float64) for m in (kimi, bailing)]
    patches += [
        (nemotron.NemotronHRMSNorm, "forward", _rms_norm_float64),
        (kimi.KimiLinearRMSNorm, "forward", _rms_norm_float64),
        (kimi.KimiLinearRMSNormGated, "forward", _gated_norm_float64),
        (kimi.KimiLinearForgetGate, "forward", _kimi_gate_float64),
        (bailing.BailingHybridRMSNorm, "forward", _rms_norm_float64),
        (bailing.BailingHybridRMSNormGated, "forward", _gated_norm_float64),
        (bailing.BailingHybridForgetGate, "forward", _bailing_gate_float64),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)
        torch.set_num_threads(threads)


# --- one model, one device or sharded ---------------------------------------------------------------


def _build(family: str, attn_implementation: str, **overrides):
    """A float64 model in eval mode (seed 0: every build has the same weights)."""
    torch.manual_seed(0)
    config = tiny_hf_config(family, vocab_size=VOCAB, **overrides)
    if family in NO_ATTENTION:
        return causal_lm_class(family)._from_config(config).to(torch.float64).eval()
    model = causal_lm_class(family)._from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"  # float64 MoE
    )
    return model.to(torch.float64).eval()


def _ids():
    return torch.randint(3, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(SEQ_LEN))


def _flat_grad(loss, model, family):
    """``(float64-computed, float32-computed)`` parameter gradients, each flat."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)  # unrouted experts get None
    flat = [[], []]
    for name, g, p in zip(names, grads, params):
        flat[name.endswith(FLOAT32_PARAMS[family])].append((torch.zeros_like(p) if g is None else g).reshape(-1))
    return torch.cat(flat[0]), torch.cat(flat[1] or [torch.zeros(0, dtype=torch.float64)])


def _key(family, overrides):
    return family if not overrides else f"{family}-few"


def _references(cases):
    """Per ``(family, overrides)``, the one-device model's logits and loss gradients."""
    ids, out = _ids(), {}
    with _float64_islands():
        for family, overrides in cases:
            ref = _build(family, "eager" if family in NO_ATTENTION else "sdpa", **overrides)
            logits = ref(input_ids=ids).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), shift_labels(ids).reshape(-1))
            out[_key(family, overrides)] = (logits.detach(), _flat_grad(loss, ref, family))
    return out


def _model(family: str, state: ParallelState, names: dict[str, str], mode: str, **overrides):
    """The model as users run it on shards in ``mode``, and the call kwargs it needs."""
    if family in NO_ATTENTION:
        model = _build(family, "eager", **overrides)
        install(model, state, mixing=mode)
        return model, {}
    return _build(family, names[mode], **overrides), {"position_ids": shard_positions(SEQ_LEN, state)[None]}


def _sharded(family, model, extra, state: ParallelState):
    """This rank's logits and CP-summed gradients."""
    ids = _ids()
    logits = model(input_ids=shard(ids, state), **extra).logits
    grads = _flat_grad(sharded_cross_entropy(logits, shard(shift_labels(ids), state), state), model, family)
    for g in grads:
        dist.all_reduce(g, group=state.cp_group)  # partial gradients sum to the true one
    return logits.detach(), grads


def _diff(a, b) -> dict[str, float]:
    """Max logits and gradient differences (relative to max(1, |b|)) of two ``(logits, grads)``."""
    out = {"logits": (a[0] - b[0]).abs().max().item()}
    for key, x, y in zip(("grad", "grad32"), a[1], b[1]):
        if y.numel():
            out[key] = (x - y).abs().max().item() / max(1.0, y.abs().max().item())
    return out


def _error(call) -> tuple[str, str]:
    try:
        call()
        return ("ran", "")
    except Exception as e:  # noqa: BLE001 - the test asserts the type and message
        return (type(e).__name__, str(e))


# --- the runs ---------------------------------------------------------------------------------------


def _run(worlds, families, references, auto: bool):
    """Per world: {(family, mode): errors against one device}, {family: state passing vs
    head-parallel}, {(family, mode): modes the adapted mixers ran}, and (with ``auto``) what
    "auto" ran and the refusal."""
    out = []
    with _float64_islands():
        for ring, ulysses in worlds:
            state = ParallelState(ring, ulysses, timeout=timedelta(seconds=60))  # a rank left waiting fails
            try:
                names = {m: register(state, name=f"seqpar-test-ssm-{m}-{ring}x{ulysses}", mixing=m) for m in MODES}
                errors, between, ran = {}, {}, {}
                for family in families:
                    local_ref = (shard(references[family][0], state), references[family][1])
                    results = {}
                    for mode in MODES:
                        model, extra = _model(family, state, names, mode)
                        results[mode] = _sharded(family, model, extra, state)
                        errors[family, mode] = _diff(results[mode], local_ref)
                        ran[family, mode] = {m.mode for m in mixing_modes(model).values()}
                    between[family] = _diff(results["state_passing"], results["head_parallel"])
                extra = _auto_and_refusal(state, names, references, ring, ulysses) if auto else {}
                out.append((errors, between, ran, extra))
            finally:
                state.close()
    return out


def _auto_and_refusal(state, names, references, ring, ulysses):
    names = {**names, "auto": register(state, name=f"seqpar-test-ssm-auto-{ring}x{ulysses}", mixing="auto")}
    out = {}
    for family, overrides in FEW_HEADS.items():  # fewer heads than ranks: "auto" passes states
        runs = {}
        for mode in ("auto", "state_passing"):
            model, extra = _model(family, state, names, mode, **overrides)
            runs[mode] = (_sharded(family, model, extra, state), mixing_modes(model))
        ref = references[_key(family, overrides)]
        out[family, "few_error"] = _diff(runs["auto"][0], (shard(ref[0], state), ref[1]))
        out[family, "few_same"] = torch.equal(runs["auto"][0][0], runs["state_passing"][0][0])
        out[family, "few_ran"] = {(m.mode, m.heads) for m in runs["auto"][1].values()}
    for family, expected in BYTES.items():  # enough heads: the predicted bytes decide
        runs = {}
        for mode in ("auto", expected):
            model, extra = _model(family, state, names, mode)
            runs[mode] = (_sharded(family, model, extra, state), mixing_modes(model))
        out[family, "bytes_ran"] = {
            (m.mode, m.tokens_per_rank, m.head_parallel_bytes < m.state_passing_bytes) for m in runs["auto"][1].values()
        }
        out[family, "bytes_same"] = torch.equal(runs["auto"][0][0], runs[expected][0][0])
    # a mixer with no state-passing form (xLSTM's mLSTM backend): named, the same ValueError on every rank
    xlstm = causal_lm_class("xlstm")._from_config(tiny_hf_config("xlstm", vocab_size=VOCAB))
    out["refused"] = _error(lambda: install(xlstm, state, mixing="state_passing"))
    return out


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, between, ran, _) in zip(worlds, results):
            for (family, mode), err in errors.items():
                where = (f"{ring}x{ulysses}", rank, family, mode)
                assert err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL, (where, err)
                assert ran[family, mode] == {mode}, (where, ran[family, mode])  # every adapted mixer ran it
            for family, err in between.items():  # and the two modes agree with each other
                where = (f"{ring}x{ulysses}", rank, family)
                assert err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL, (where, err)


def _check_auto(per_rank):
    extras = [results[0][3] for results in per_rank]
    for rank, extra in enumerate(extras):
        for family in FEW_HEADS:
            err = extra[family, "few_error"]
            assert err["logits"] < TOL and err["grad"] < TOL and err.get("grad32", 0) < FLOAT32_TOL, (rank, family, err)
            assert extra[family, "few_same"], (rank, family)
            assert extra[family, "few_ran"] == {("state_passing", 2)}, (rank, family, extra[family, "few_ran"])
        for family, expected in BYTES.items():
            ran = extra[family, "bytes_ran"]
            assert ran == {(expected, 10, expected == "head_parallel")}, (rank, family, ran)
            assert extra[family, "bytes_same"], (rank, family)
    kind, message = extras[0]["refused"]
    assert kind == "ValueError" and "xLSTMBackend" in message, message
    assert "'head_parallel' only" in message, message
    assert all(extra["refused"] == extras[0]["refused"] for extra in extras)  # the same error on every rank


def test_ssm_modes_exact_and_equal_2x2(pools):
    worlds = [(2, 2)]
    cases = [(f, {}) for f in QUICK] + list(FEW_HEADS.items())
    per_rank = pools(4).run(_run, worlds, QUICK, _references(cases), True)
    _check(worlds, per_rank)
    _check_auto(per_rank)


@pytest.mark.slow
@pytest.mark.parametrize(
    "worlds, families",
    [([(2, 2)], tuple(f for f in FAMILIES if f not in QUICK)), ([(3, 1)], FAMILIES), ([(1, 4)], FAMILIES)],
    ids=["2x2-rest", "3x1", "1x4"],
)
def test_ssm_modes_exact_and_equal_on_shards(pools, worlds, families):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, families, _references([(f, {}) for f in families]), False)
    _check(worlds, per_rank)
