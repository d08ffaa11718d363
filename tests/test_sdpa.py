"""seqpar.parallel_sdpa: SDPA models on sequence shards equal their single-device run."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import seqpar
from seqpar import ParallelState, parallel_sdpa, shard
from seqpar.tools.models import VideoDiT, patchify
from seqpar.sdpa import local_sdpa

ORIGINAL_SDPA = F.scaled_dot_product_attention
STATES = [(2, 2), (1, 4), (4, 1)]


class Block(nn.Module):
    """Pre-norm transformer block: linear q/k/v (GQA), SDPA, output projection, MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads, causal
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, heads * self.head_dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(heads * self.head_dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, scale=0.3, enable_gqa=self.kv_heads != self.heads
        )
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self, dim_in, dim, heads, kv_heads, causal, depth=2):
        super().__init__()
        self.inp = nn.Linear(dim_in, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads, kv_heads, causal) for _ in range(depth)])
        self.out = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 5))

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def _compare_sharded(model, inputs, weights, state, call):
    """Max |error| of the shard's output, of CP-summed parameter grads and of the input grad."""
    x_full = inputs.clone().requires_grad_(True)
    ref = call(model, x_full)
    ref_grads = torch.autograd.grad((ref * weights).sum(), [x_full, *model.parameters()])

    x = inputs.clone().requires_grad_(True)
    with parallel_sdpa(state):
        out = call(model, shard(x, state))
    grads = torch.autograd.grad((out * shard(weights, state)).sum(), [x, *model.parameters()])
    errs = {"out": (out - shard(ref, state)).abs().max().item() if out.numel() else 0.0}
    g_err = 0.0
    for g, r in zip(grads, ref_grads):
        g = g.clone()
        dist.all_reduce(g, group=state.cp_group)
        g_err = max(g_err, (g - r).abs().max().item())
    errs["grad"] = g_err
    return errs


def _sdpa_model_cases(ring, ulysses, cases):
    state = ParallelState(ring, ulysses)
    results = []
    for seq_len, heads, kv_heads, causal in cases:
        torch.manual_seed(1234)
        model = Net(7, 6 * heads, heads, kv_heads, causal).double()
        g = torch.Generator().manual_seed(seq_len)
        x = torch.randn(2, seq_len, 7, generator=g, dtype=torch.float64)
        w = torch.randn(2, seq_len, 5, generator=g, dtype=torch.float64)
        errs = _compare_sharded(model, x, w, state, lambda m, t: m(t))
        results.append(((seq_len, heads, kv_heads, causal), errs))
    return results


@pytest.mark.parametrize("ring,ulysses", STATES)
@pytest.mark.slow
def test_sdpa_model_matches_single_device(pools, ring, ulysses):
    # Odd token counts; heads 3 and 5 divide no Ulysses size > 1; GQA 6/3 and 6/2, MQA 5/1.
    cases = [
        (37, 3, 3, False),
        (37, 3, 3, True),
        (41, 6, 3, True),
        (23, 6, 2, False),
        (29, 5, 1, True),
        (5, 3, 3, True),  # fewer tokens than 2 * ring * ulysses on some states
    ]
    for per_rank in pools(4).run(_sdpa_model_cases, ring, ulysses, cases):
        for case, errs in per_rank:
            assert errs["out"] < 1e-6, (case, errs)
            assert errs["grad"] < 1e-6, (case, errs)


def _dit_case(ring, ulysses):
    state = ParallelState(ring, ulysses)
    torch.manual_seed(0)
    model = VideoDiT(in_channels=2, patch=(1, 2, 2), grid=(3, 3, 5), dim=24, depth=2, heads=3).double()
    g = torch.Generator().manual_seed(7)
    patches = patchify(torch.randn(2, 2, 3, 6, 10, generator=g, dtype=torch.float64), model.patch)
    t = torch.rand(2, generator=g, dtype=torch.float64)
    w = torch.randn(2, 45, 8, generator=g, dtype=torch.float64)
    pos = seqpar.shard_positions(45, state)

    x_full = patches.clone().requires_grad_(True)
    ref = model(x_full, t)
    ref_grads = torch.autograd.grad((ref * w).sum(), [x_full, *model.parameters()])
    x = patches.clone().requires_grad_(True)
    with parallel_sdpa(state, seq_len=45):  # known length: no collective to find it
        out = model(shard(x, state), t, pos)
    grads = torch.autograd.grad((out * shard(w, state)).sum(), [x, *model.parameters()])
    g_err = 0.0
    for gr, r in zip(grads, ref_grads):
        gr = gr.clone()
        dist.all_reduce(gr, group=state.cp_group)
        g_err = max(g_err, (gr - r).abs().max().item())
    return (out - shard(ref, state)).abs().max().item(), g_err


def test_video_dit_matches_single_device(pools):
    for out_err, grad_err in pools(4).run(_dit_case, 2, 2):
        assert out_err < 1e-6 and grad_err < 1e-6, (out_err, grad_err)


def _checkpoint_case(ring, ulysses):
    """Activation checkpointing recomputes in backward, outside the ``with``: context_fn fixes it."""
    from contextlib import nullcontext

    from torch.utils.checkpoint import checkpoint

    state = ParallelState(ring, ulysses)
    torch.manual_seed(0)
    block = Block(12, 3, 3, causal=True).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 31, 12, generator=g, dtype=torch.float64)
    w = torch.randn(2, 31, 12, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad((block(x) * w).sum(), list(block.parameters()))
    with parallel_sdpa(state):
        out = checkpoint(
            block,
            shard(x, state),
            use_reentrant=False,
            context_fn=lambda: (nullcontext(), parallel_sdpa(state)),
        )
    grads = torch.autograd.grad((out * shard(w, state)).sum(), list(block.parameters()))  # outside
    err = 0.0
    for gr, r in zip(grads, ref_grads):
        gr = gr.clone()
        dist.all_reduce(gr, group=state.cp_group)
        err = max(err, (gr - r).abs().max().item())
    return err


def test_activation_checkpointing_with_context_fn(pools):
    assert max(pools(4).run(_checkpoint_case, 2, 2)) < 1e-10


def _sdpa_3d_and_batched(ring, ulysses):
    """SDPA's (N, S, D) form and extra leading dims fold into the batch."""
    state = ParallelState(ring, ulysses)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 4, 19, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = ORIGINAL_SDPA(q, k, v, is_causal=True)
    with parallel_sdpa(state):
        out5 = F.scaled_dot_product_attention(*(shard(t, state, dim=3) for t in (q, k, v)), is_causal=True)
        q3, k3, v3 = (shard(t[0, 0], state, dim=1) for t in (q, k, v))
        out3 = F.scaled_dot_product_attention(q3, k3, v3, is_causal=True)
    return (
        (out5 - shard(ref, state, dim=3)).abs().max().item(),
        (out3 - shard(ref[0, 0], state, dim=1)).abs().max().item(),
    )


def test_sdpa_leading_dims(pools):
    for err5, err3 in pools(4).run(_sdpa_3d_and_batched, 2, 2):
        assert err5 < 1e-10 and err3 < 1e-10


class JointBlock(nn.Module):
    """MMDiT-style joint attention (Flux, SD3): text and image tokens get their own projections,
    are concatenated ``[text | image]`` for one non-causal SDPA call, and split again."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv_txt, self.qkv_img = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.o_txt, self.o_img = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, txt, img):
        b, p, _ = txt.shape

        def heads(x):
            return x.view(b, x.shape[1], 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)

        q, k, v = torch.cat([heads(self.qkv_txt(txt)), heads(self.qkv_img(img))], dim=3).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, self.heads * self.head_dim)
        return txt + self.o_txt(a[:, :p]), img + self.o_img(a[:, p:])


def _joint_case(ring, ulysses, contiguous):
    """Text replicated on every rank, image tokens sharded (zig-zag, or contiguous as diffusers'
    plans split them): two joint blocks under ``parallel_sdpa(replicated_prefix=P)``."""
    state = ParallelState(ring, ulysses)
    torch.manual_seed(0)
    blocks = nn.ModuleList([JointBlock(12, 3) for _ in range(2)]).double()
    g = torch.Generator().manual_seed(5)
    P, S = 7, 45
    txt, img = torch.randn(2, P, 12, generator=g, dtype=torch.float64), torch.randn(2, S, 12, generator=g, dtype=torch.float64)
    w_txt, w_img = torch.randn(2, P, 12, generator=g, dtype=torch.float64), torch.randn(2, S, 12, generator=g, dtype=torch.float64)

    def run(t, i):
        for block in blocks:
            t, i = block(t, i)
        return t, i

    ref_t, ref_i = run(txt, img)
    params = list(blocks.parameters())
    ref_grads = torch.autograd.grad((ref_t * w_txt).sum() + (ref_i * w_img).sum(), params)
    if contiguous:
        sizes = [S // state.cp_size + (c < S % state.cp_size) for c in range(state.cp_size)]
        start = sum(sizes[: state.cp_rank])
        rows = list(range(start, start + sizes[state.cp_rank]))
    else:
        rows = seqpar.shard_positions(S, state).tolist()
    with parallel_sdpa(state, replicated_prefix=P):
        out_t, out_i = run(txt, img[:, rows])
    # Loss share: this rank's image rows, and the replicated text rows once over the group.
    share = (out_t * w_txt).sum() / state.cp_size + (out_i * w_img[:, rows]).sum()
    grads = torch.autograd.grad(share, params)
    err = max((out_t - ref_t).abs().max().item(), (out_i - ref_i[:, rows]).abs().max().item())
    g_err = 0.0
    for gr, r in zip(grads, ref_grads):
        gr = gr.clone()
        dist.all_reduce(gr, group=state.cp_group)
        g_err = max(g_err, (gr - r).abs().max().item())
    return err, g_err


@pytest.mark.parametrize("ring,ulysses,world", [(2, 2, 4), (1, 4, 4), (3, 1, 3), (1, 3, 3)])
def test_joint_attention_with_replicated_text(pools, ring, ulysses, world):
    for contiguous in (False, True):
        for out_err, grad_err in pools(world).run(_joint_case, ring, ulysses, contiguous):
            assert out_err < 1e-10 and grad_err < 1e-10, (contiguous, out_err, grad_err)


# --- single-process behaviour of the patch -----------------------------------------------------


def _qkv(heads=4, kv_heads=4, s=9, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, heads, s, d, generator=g, dtype=dtype),
        torch.randn(2, kv_heads, s, d, generator=g, dtype=dtype),
        torch.randn(2, kv_heads, s, d, generator=g, dtype=dtype),
    )


def test_size_one_state_equals_sdpa():
    q, k, v = _qkv(heads=6, kv_heads=2)
    ref = ORIGINAL_SDPA(q, k, v, is_causal=True, enable_gqa=True)
    with parallel_sdpa(ParallelState()):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    with parallel_sdpa(ParallelState(), seq_len=5):
        with pytest.raises(ValueError, match="seq_len"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # 9 tokens, not 5
    with pytest.raises(ValueError, match="seq_len must be a non-negative int"):
        parallel_sdpa(ParallelState(), seq_len=-1)


def test_patch_restored_exactly_and_nests():
    state = ParallelState()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    with parallel_sdpa(state):
        patched = F.scaled_dot_product_attention
        assert patched is not ORIGINAL_SDPA
        assert torch.nn.functional.scaled_dot_product_attention is patched
        with parallel_sdpa(state):
            assert F.scaled_dot_product_attention is patched
            with local_sdpa():
                q, k, v = _qkv()
                mask = torch.zeros(9, 9, dtype=torch.float64)
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # plain SDPA accepts masks
            with pytest.raises(ValueError, match="additive float mask cannot be checked"):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert F.scaled_dot_product_attention is patched
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_patch_restored_on_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with parallel_sdpa(ParallelState()):
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attn_mask"):
        with parallel_sdpa(ParallelState()):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(9, 9, dtype=torch.float64))
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_someone_else_patching_on_top():
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    with parallel_sdpa(ParallelState()):
        ours = F.scaled_dot_product_attention
        theirs = lambda *a, **k: ours(*a, **k)  # noqa: E731 - another library's patch
        F.scaled_dot_product_attention = theirs
    assert F.scaled_dot_product_attention is theirs  # not clobbered on exit
    F.scaled_dot_product_attention = ours  # they restore what they found: our stale dispatcher
    try:
        mask = torch.zeros(5, 5, dtype=torch.float64)
        torch.testing.assert_close(
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask), ORIGINAL_SDPA(q, q, q)
        )
        with parallel_sdpa(ParallelState()):
            pass
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    finally:
        F.scaled_dot_product_attention = ORIGINAL_SDPA


def test_other_threads_untouched():
    q, k, v = _qkv()
    mask = torch.zeros(9, 9, dtype=torch.float64)
    entered, done = threading.Event(), threading.Event()
    seen = {}

    def other():
        entered.wait(10)
        # The patch is installed, but this thread has no active state: plain SDPA, masks allowed.
        seen["patched"] = F.scaled_dot_product_attention is not ORIGINAL_SDPA
        seen["out"] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with parallel_sdpa(ParallelState()):
        entered.set()
        assert done.wait(10)
    t.join()
    assert seen["patched"]
    torch.testing.assert_close(seen["out"], ORIGINAL_SDPA(q, k, v, attn_mask=mask))
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_unsupported_arguments_raise():
    q, k, v = _qkv(heads=4, kv_heads=2)
    with parallel_sdpa(ParallelState()):
        with pytest.raises(ValueError, match="enable_gqa=True"):
            F.scaled_dot_product_attention(q, k, v)
        with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True)
        with torch.no_grad(), pytest.raises(NotImplementedError, match="dropout"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True)
        holes = torch.ones(9, 9, dtype=torch.bool)
        holes[4, 2] = False
        with pytest.raises(ValueError, match="row 4 of the 9x9 mask attends 8 keys that are not one contiguous"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=holes, enable_gqa=True)
        with pytest.raises(ValueError, match="differs between batch rows"):
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.stack([torch.ones(9, 9, dtype=torch.bool), holes.tril()]), enable_gqa=True
            )
        with pytest.raises(ValueError, match="local_sdpa"):
            F.scaled_dot_product_attention(q, k[:, :, :5], v[:, :, :5], enable_gqa=True)
        q3, k3, v3 = _qkv(heads=3, kv_heads=2)
        with pytest.raises(ValueError, match="not a multiple"):
            F.scaled_dot_product_attention(q3, k3, v3, enable_gqa=True)
        with pytest.raises(ValueError, match="leading"):
            F.scaled_dot_product_attention(q, k[:1], v[:1], enable_gqa=True)
    with pytest.raises(ValueError, match="ParallelState"):
        parallel_sdpa("not a state")
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


# --- what the patch reaches (docs/howto-dit.md's table) -------------------------------------------


def _torch_modules_case(ring, ulysses):
    """nn.MultiheadAttention (need_weights=False) and nn.TransformerEncoder in train and eval mode
    (eval and no_grad take PyTorch's native fast path unless the context switches it off)."""
    state = ParallelState(ring, ulysses)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=12, nhead=3, dim_feedforward=24, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).double()
    mha = nn.MultiheadAttention(12, 3, batch_first=True).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 31, 12, generator=g, dtype=torch.float64)
    errs = {}
    for mode in ("train", "eval", "inference"):
        encoder.train(mode == "train")
        with torch.inference_mode() if mode == "inference" else torch.no_grad():
            want = encoder(x)
            with parallel_sdpa(state):
                got = encoder(shard(x, state))
        errs[f"encoder {mode}"] = (got - shard(want, state)).abs().max().item()
    with torch.no_grad():
        want = mha(x, x, x, need_weights=False)[0]
        with parallel_sdpa(state):
            local = shard(x, state)
            got = mha(local, local, local, need_weights=False)[0]
            try:
                mha(local, local, local)  # need_weights=True by default
                errs["need_weights refused"] = 1.0
            except NotImplementedError:
                errs["need_weights refused"] = 0.0
    errs["mha"] = (got - shard(want, state)).abs().max().item()
    return errs


def test_torch_attention_modules(pools):
    for errs in pools(4).run(_torch_modules_case, 2, 2):
        assert max(errs.values()) < 1e-10, errs
    assert torch.backends.mha.get_fastpath_enabled()  # restored in this process too


def _cross_attention_lengths_case():
    """Cross-attention under parallel_sdpa whose context length equals the local length on one
    rank only: every rank raises (none computes sharded self-attention alone)."""
    state = ParallelState(1, 3)
    q = torch.randn(1, 2, 5 if state.cp_rank == 0 else 4, 8, dtype=torch.float64)  # shard sizes 5/4/4 (S=13)
    ctx = torch.randn(1, 2, 5, 8, dtype=torch.float64)  # replicated context of 5 tokens
    try:
        with parallel_sdpa(state):
            F.scaled_dot_product_attention(q, ctx, ctx)
    except ValueError as e:
        return str(e)[:80]
    return "NO ERROR"


def test_cross_attention_refused_on_every_rank(pools):
    for msg in pools(3).run(_cross_attention_lengths_case):
        assert msg != "NO ERROR", msg


def test_reentrant_checkpoint_is_refused():
    from torch.utils.checkpoint import checkpoint

    q, k, v = (t.requires_grad_() for t in _qkv())
    with parallel_sdpa(ParallelState()):
        with pytest.raises(RuntimeError, match="use_reentrant=True"):
            checkpoint(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v, use_reentrant=True)
        out = checkpoint(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v, use_reentrant=False)
    torch.testing.assert_close(out, ORIGINAL_SDPA(q, k, v))


def test_thread_started_inside_a_context_is_refused():
    q, k, v = _qkv()
    seen = {}

    def worker():
        try:
            F.scaled_dot_product_attention(q, k, v)
            seen["result"] = "ran"
        except RuntimeError as e:
            seen["result"] = str(e)

    with parallel_sdpa(ParallelState()):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert "thread started while a parallel_sdpa context was open" in seen["result"]
    t = threading.Thread(target=worker)  # no context open any more: plain SDPA
    t.start()
    t.join()
    assert seen["result"] == "ran"


def test_contexts_exit_in_any_order():
    q, k, v = _qkv()
    outer, inner = parallel_sdpa(ParallelState()), local_sdpa()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # not LIFO: the local_sdpa context stays in force
    mask = torch.zeros(9, 9, dtype=torch.float64)
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # plain SDPA: masks allowed
    inner.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    outer, inner = local_sdpa(), parallel_sdpa(ParallelState())
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    with pytest.raises(ValueError, match="additive float mask"):  # still seqpar
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    inner.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


# ---------------------------------------------------------------------------------------------
# Boolean masks over the global sequence: block-causal frames and prefix-LM run exactly.


def _bool_mask_case(state: ParallelState, c: dict) -> float:
    S, (H, Hkv) = c["S"], c["heads"]
    gen = torch.Generator().manual_seed(c["seed"])
    full = [torch.randn(2, h, S, 8, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
    mask = c["mask"]
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    ref = ORIGINAL_SDPA(*leaves, attn_mask=mask, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, leaves, full[3])
    mine = [seqpar.shard(t, state, dim=2).requires_grad_() for t in full[:3]]
    with parallel_sdpa(state):
        out = F.scaled_dot_product_attention(*mine, attn_mask=mask[None, None].expand(2, H, S, S), enable_gqa=True)
    grads = [g.clone() for g in torch.autograd.grad(out, mine, seqpar.shard(full[3], state, dim=2))]
    err = (out - seqpar.shard(ref.detach(), state, dim=2)).abs().max().item()
    for g, r in zip(grads, ref_grads):
        full_g = seqpar.unshard(g, state, dim=2, size=S)
        err = max(err, (full_g - r).abs().max().item())
    return err


def _bool_mask_rank(cases):
    states, errs = {}, []
    for c in cases:
        if c["RU"] not in states:
            states[c["RU"]] = ParallelState(*c["RU"])
        errs.append(_bool_mask_case(states[c["RU"]], c))
    return errs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bool_block_causal_and_prefix_masks_are_exact(pools, world):
    from seqpar import MaskSlices

    configs = {2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1)]}[world]
    cases = []
    for i, RU in enumerate(configs):
        S = (37, 41)[i % 2]
        pos = torch.arange(S)
        frames = MaskSlices.block_causal([7, 3, 11, 1, S - 22]).allows(pos, pos)
        prefix = MaskSlices.prefix_lm(S, 9).allows(pos, pos)
        for j, mask in enumerate((frames, prefix)):
            cases.append(dict(RU=RU, S=S, mask=mask, heads=((6, 2), (3, 1))[j], seed=10 * i + j))
    for errs in pools(world).run(_bool_mask_rank, cases):
        assert max(errs) < 1e-10, errs
