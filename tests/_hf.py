"""Shared helpers of the transformers model tests (test_hybrid_*.py, test_sparse_*.py,
test_transformers_families.py): tiny float64 models, token ids, flat parameter gradients, one-device
references and a sharded run's errors against them, the outcome of a call that must be refused, one
fresh ``ParallelState`` per world of a pool run, packed batches, and float64 versions of the float32
islands of transformers' torch kernels (the gated delta rule, the Mamba scans, Kimi delta
attention) that both the one-device and the sharded models get, so that a comparison to 1e-10
isolates what seqpar does.

Imported as ``from _hf import ...`` after ``pytest.importorskip("transformers")``, as the tests
import ``_common``; the modeling files are imported only by the contexts that patch them.
"""

import contextlib
import importlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar import ParallelState, shard, shard_packed, shard_packed_positions, shard_positions
from seqpar.integrations.transformers import generate
from seqpar.tools.models.hf_configs import causal_lm_class, tiny_hf_config
from seqpar.training import sharded_cross_entropy, shift_labels

VOCAB = 97
SEQ_LEN = 37  # odd: no split is even


# --- models, ids, gradients -------------------------------------------------------------------------


def build(family: str, attn_implementation: str | None, *, init=None, **overrides):
    """A float64 model of ``family`` (``tiny_hf_config`` with ``overrides``) in eval mode, seed 0 so
    that every build has the same weights. ``attn_implementation=None``: a model without softmax
    attention (Mamba, Mamba2, xLSTM), built without attention or experts options; otherwise eager
    experts (a float64 MoE; a no-op for models without experts). ``init(model)`` runs before the
    cast to float64."""
    torch.manual_seed(0)
    config = tiny_hf_config(family, vocab_size=VOCAB, **overrides)
    if attn_implementation is None:
        model = causal_lm_class(family)._from_config(config)
    else:
        model = causal_lm_class(family)._from_config(
            config, attn_implementation=attn_implementation, experts_implementation="eager"
        )
    if init is not None:
        init(model)
    return model.to(torch.float64).eval()


def token_ids(batch: int, seed: int, length: int = SEQ_LEN, low: int = 3) -> torch.Tensor:
    """``[batch, length]`` token ids in ``[low, VOCAB)`` drawn from ``seed``."""
    return torch.randint(low, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def flat_grads(loss, model, float32: tuple[str, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float64-computed, float32-computed)`` parameter gradients of ``loss``, each flat: the
    second those of the parameters whose names end with one of ``float32`` (which the modeling
    code takes through float32: per-rank partial sums of their gradients round differently), empty
    when there are none. A parameter without a gradient (an unrouted expert, an indexer that only
    selects) counts as zeros."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = [[], []]
    for name, g, p in zip(names, grads, params):
        flat[name.endswith(float32)].append((torch.zeros_like(p) if g is None else g).reshape(-1))
    return torch.cat(flat[0]), torch.cat(flat[1] or [torch.zeros(0, dtype=torch.float64)])


def one_device(model, input_ids, float32: tuple[str, ...] = (), **kwargs):
    """One device: ``(logits, flat_grads)`` of ``model`` on ``input_ids`` under the mean
    next-token loss."""
    logits = model(input_ids=input_ids, **kwargs).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), shift_labels(input_ids).reshape(-1))
    return logits.detach(), flat_grads(loss, model, float32)


def on_shards(model, state: ParallelState, input_ids, float32: tuple[str, ...] = (), positions: bool = True, **kwargs):
    """This rank's ``(logits, CP-summed flat_grads)`` of ``model`` on its shard of ``input_ids``
    (with the shard's ``position_ids`` unless ``positions`` is False: models without attention)."""
    if positions:
        kwargs["position_ids"] = shard_positions(input_ids.shape[1], state)[None]
    logits = model(input_ids=shard(input_ids, state), **kwargs).logits
    grads = flat_grads(sharded_cross_entropy(logits, shard(shift_labels(input_ids), state), state), model, float32)
    if state.cp_size > 1:
        for g in grads:
            dist.all_reduce(g, group=state.cp_group)  # partial gradients sum to the true one
    return logits.detach(), grads


def diff(got, want, relative_logits: bool = False) -> dict[str, float]:
    """Max logits difference and max gradient differences relative to max(1, |want's gradient|) of
    two ``(logits, flat_grads)``: keys "logits", "grad" and, where there are float32-computed
    gradients, "grad32". ``relative_logits``: the logits' too relative to max(1, |want's logits|)."""
    logits = (got[0] - want[0]).abs().max().item()
    out = {"logits": logits / max(1.0, want[0].abs().max().item()) if relative_logits else logits}
    for key, x, y in zip(("grad", "grad32"), got[1], want[1]):
        if y.numel():
            out[key] = (x - y).abs().max().item() / max(1.0, y.abs().max().item())
    return out


def shard_errors(
    model, state: ParallelState, input_ids, ref, float32: tuple[str, ...] = (), relative_logits: bool = False, **kwargs
):
    """``diff`` of ``model`` on this rank's shard (``on_shards``) against the one-device ``ref``
    (``one_device``'s pair, whose logits are cut to the same shard)."""
    got = on_shards(model, state, input_ids, float32, **kwargs)
    return diff(got, (shard(ref[0], state), ref[1]), relative_logits)


# --- refusals and worlds ----------------------------------------------------------------------------


def outcome(call) -> tuple[str, str]:
    """``(exception type, message)`` of ``call()``, or ``("ran", "")``."""
    try:
        call()
        return ("ran", "")
    except Exception as e:  # noqa: BLE001 - the tests assert the type and message
        return (type(e).__name__, str(e))


def cache_and_packed_refusals(model, state: ParallelState, input_ids) -> dict[str, tuple[str, str]]:
    """``outcome`` of the calls a model whose mixers run on shards refuses: a cache (a forward with
    use_cache=True; seqpar's generate) and packed-batch kwargs of this rank's own boundaries."""
    local, positions = shard(input_ids, state), shard_positions(input_ids.shape[1], state)[None]
    bounds = torch.tensor([0, local.shape[1]])
    calls = {
        "cache": lambda: model(input_ids=local, position_ids=positions, use_cache=True),
        "packed": lambda: model(input_ids=local, position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds),
        "generate": lambda: generate(model, input_ids, state, max_new_tokens=2, do_sample=False),
    }
    with torch.no_grad():
        return {what: outcome(call) for what, call in calls.items()}


def check_cache_and_packed_refused(calls: dict[str, tuple[str, str]], where: tuple = ()) -> None:
    """Each outcome of ``cache_and_packed_refusals`` a NotImplementedError that names what it refuses."""
    for what, (kind, message) in calls.items():
        want = "packed batches" if what == "packed" else "does not support a cache"
        assert kind == "NotImplementedError" and want in message, (*where, what, kind, message)


def check_modes(worlds, per_rank, tol: float, float32_tol: float, family_tol: dict[str, float] | None = None) -> None:
    """Per rank and world of a run in both mixing modes, ``(errors, between, ran, _)``: every
    ``(family, mode)`` within ``tol`` (``family_tol[family]`` where given) of one device (its
    float32-computed gradients within ``float32_tol``), with every adapted mixer running that mode,
    and the two modes as close to each other."""
    family_tol = family_tol or {}
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, between, ran, _) in zip(worlds, results):
            for (family, mode), err in errors.items():
                where = (f"{ring}x{ulysses}", rank, family, mode)
                t = family_tol.get(family, tol)
                assert err["logits"] < t and err["grad"] < t and err.get("grad32", 0) < float32_tol, (where, err)
                assert ran[family, mode] == {mode}, (where, ran[family, mode])  # every adapted mixer ran it
            for family, err in between.items():  # and the two modes agree with each other
                where, t = (f"{ring}x{ulysses}", rank, family), family_tol.get(family, tol)
                assert err["logits"] < t and err["grad"] < t and err.get("grad32", 0) < float32_tol, (where, err)


def each_world(worlds, run, timeout_s: float | None = 60.0) -> list:
    """``[run(state, ring, ulysses)]`` per world ``(ring, ulysses)``, each on a fresh
    ``ParallelState`` (closed after; ``ParallelState()`` for 1 x 1) whose collectives time out after
    ``timeout_s`` seconds (None: the default group's), so that a rank left waiting fails the test."""
    out = []
    for ring, ulysses in worlds:
        if ring * ulysses == 1:
            state = ParallelState()
        elif timeout_s is None:
            state = ParallelState(ring, ulysses)
        else:
            state = ParallelState(ring, ulysses, timeout=timedelta(seconds=timeout_s))
        try:
            out.append(run(state, ring, ulysses))
        finally:
            state.close()
    return out


# --- packed batches (transformers' DataCollatorWithFlattening format) ------------------------------

LENS = (11, 23, 7)  # odd: no sequence splits evenly


def packed_sequences():
    """The packed batch: ``(ids [1, T], labels [1, T])``, labels shifted within each sequence."""
    tokens = torch.randint(3, VOCAB, (1, sum(LENS)), generator=torch.Generator().manual_seed(7))
    return tokens, shift_labels(tokens, seq_lens=LENS)


def packed_kwargs(lens=LENS) -> dict:
    """transformers' flash-attn kwargs of a flattened batch of sequences of ``lens``."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))


def packed_loss(logits, labels, count: int):
    """Summed next-token loss over ``count`` labelled tokens of the whole batch (a rank's share)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum") / count


def packed_call(model, state: ParallelState, **kwargs):
    """``model`` on this rank's shard of the packed batch, with the global boundaries."""
    tokens, _ = packed_sequences()
    return model(
        input_ids=shard_packed(tokens, state, LENS, dim=1), position_ids=shard_packed_positions(LENS, state)[None],
        **{**packed_kwargs(), **kwargs},
    )


def packed_references(families, build_family, float32: tuple[str, ...]):
    """Per family, one device running each sequence on its own: logits ``[1, T, V]`` (concatenated)
    and the flat gradients of the batch's loss. Each sequence runs from its start to the batch's
    end, which its tokens' logits do not see (every layer is causal), so that the matmuls see about
    as many tokens as the packed batch's."""
    tokens, labels = packed_sequences()
    count = int((labels != -100).sum())
    starts = torch.tensor((0, *LENS)).cumsum(0).tolist()
    out = {}
    for family in families:
        ref = build_family(family, "sdpa")
        logits = torch.cat([ref(input_ids=tokens[:, a:]).logits[:, :n] for a, n in zip(starts, LENS)], 1)
        out[family] = (logits.detach(), flat_grads(packed_loss(logits, labels, count), ref, float32))
    return out


def packed_errors(model, state: ParallelState, ref, float32: tuple[str, ...]) -> dict[str, float]:
    """``diff`` of a packed call on this rank's shard (gradients CP-summed) against ``ref``."""
    _, labels = packed_sequences()
    logits = packed_call(model, state).logits
    count = int((labels != -100).sum())
    grads = flat_grads(packed_loss(logits, shard_packed(labels, state, LENS, dim=1), count), model, float32)
    if state.cp_size > 1:
        for g in grads:
            dist.all_reduce(g, group=state.cp_group)  # partial gradients sum to the true one
    return diff((logits, grads), (shard_packed(ref[0], state, LENS, dim=1), ref[1]))


# --- float64 versions of the float32 islands (the one-device and the sharded models get them) -----


@contextlib.contextmanager
def patched(patches, default_dtype: torch.dtype | None = None):
    """Each ``(object, attribute, value)`` of ``patches`` set (the modeling files are read by the
    one-device forward and by the adapters when they install), ``default_dtype`` if given, and one
    torch thread, like the pool's ranks (tiny float64 ops on several threads of a busy 2-core
    machine mostly wait for each other); all restored after."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_num_threads(1)
    if default_dtype is not None:
        torch.set_default_dtype(default_dtype)
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)


def one_thread():
    """One torch thread for the block (``patched`` with nothing to patch)."""
    return patched(())


def modeling(name: str):
    """transformers' modeling file of model type ``name``."""
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def delta_rule_float64(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule with transformers' kernel's arguments, token by token in float64:
    ``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S~_t^T k_t))^T`` (``S~`` the decayed state),
    ``o_t = S_t^T q_t``, queries scaled by ``Dk ** -0.5`` after the optional L2 norm, K heads
    repeated to the V heads."""
    heads = value.shape[2]
    q, k = (x.repeat_interleave(heads // x.shape[2], 2).double() for x in (query, key))
    v, g, beta = value.double(), g.double(), beta.double()
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    batch, length, _, dk = k.shape
    h = v.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.double()
    outs = []
    for t in range(length):
        h = h * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - (h * k[:, t, :, :, None]).sum(-2))
        h = h + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((h * q[:, t, :, :, None]).sum(-2))
    out = torch.stack(outs, 1) if outs else v.new_zeros(batch, 0, heads, v.shape[-1])
    return out.to(query.dtype), (h if output_final_state else None)


def float64_delta_rule(default_dtype: torch.dtype | None = None):
    """transformers' torch fallback of the gated delta rule computes in float32 whatever the model's
    dtype (and pads to its chunk size, so a sequence's float32 rounding depends on what follows
    it): Qwen3-Next's, Qwen3.5's and OLMo Hybrid's modeling files get ``delta_rule_float64``
    (``patched``), and their norms, which round to float32 too, float64 versions: a float64
    elementwise op over another token count (a shard, one sequence of a packed batch) may differ in
    the last bit on some CPUs (measured on an AVX-512 Xeon: the decay g, the conv output), and a float32 rounding
    after it can then flip (~1e-7 at the logits)."""
    next_, qwen3_5, olmo = (modeling(name) for name in ("qwen3_next", "qwen3_5", "olmo_hybrid"))
    patches = [(m, "torch_chunk_gated_delta_rule", delta_rule_float64) for m in (next_, qwen3_5, olmo)]
    patches += [
        (next_.Qwen3NextRMSNorm, "forward", _offset_rms_norm_float64),
        (next_.Qwen3NextRMSNormGated, "forward", _gated_norm_float64),
        (qwen3_5.Qwen3_5RMSNorm, "forward", _offset_rms_norm_float64),
        (qwen3_5.Qwen3_5RMSNormGated, "forward", _gated_norm_float64),
        (olmo.OlmoHybridRMSNorm, "forward", _rms_norm_float64),
        (olmo.OlmoHybridRMSNormGated, "forward", _gated_norm_float64),
    ]
    return patched(patches, default_dtype)


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


def _offset_rms_norm_float64(self, x):
    """Qwen3-Next's and Qwen3.5's RMSNorm (a zero-initialised weight, applied as ``1 + weight``)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


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


MAMBA2_FILES = ("bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1", "mamba2")
MAMBA1_FILES = ("jamba", "mamba")


def float64_state_space():
    """The state-space and Kimi-delta models' float32 islands in float64 (``patched``): the torch
    SSD, selective-scan and KDA kernels, and Nemotron-H's, Kimi's and Bailing's norms and KDA's
    forget gates. What stays float32: ``A = -exp(A_log.float())`` of the Mamba2 mixers, whose
    gradient is a float32 sum that per-piece partial sums round differently (within 1e-6)."""
    kimi, bailing, nemotron = modeling("kimi_linear"), modeling("bailing_hybrid"), modeling("nemotron_h")
    patches = [(modeling(name), "mamba2_chunk_scan", ssd_float64) for name in MAMBA2_FILES]
    patches += [(modeling(name), "mamba_selective_scan", selective_scan_float64) for name in MAMBA1_FILES]
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
    return patched(patches)
