"""seqpar.integrations.diffusers: tiny random diffusers transformers, full in / full out, vs one device.

Each family is built twice from one seed (random weights, odd token counts): once as the
single-device reference, once parallelized over a ParallelState. The output must match in fp32,
and the parameter (and input) gradients summed over the CP group -- every rank backpropagating the
same full-output loss divided by cp_size -- must match the single-device gradients. All families
and (ring, ulysses) splits of one world size run in one DistPool call.
"""

import pytest
import torch

diffusers = pytest.importorskip(
    "diffusers",
    reason="diffusers is not installed; install the extra: pip install -e '.[diffusers]' (diffusers==0.42.1)",
)

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput  # noqa: E402

import seqpar  # noqa: E402
from seqpar.integrations.diffusers import ShardedAttention, parallelize  # noqa: E402

pytestmark = pytest.mark.slow  # long multi-rank runs: not in the quick subset

ATOL = 1e-4  # fp32 output, absolute
GRAD_RTOL = 1e-3  # fp32 gradient error relative to the largest entry of that tensor (float64: ~1e-14)


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights everywhere (diffusers zero-initialises some output layers)."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _flux(S: int = 15, T: int = 7):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=12, pooled_projection_dim=6, axes_dims_rope=(2, 2, 4),
    )
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, S, 8, generator=g), encoder_hidden_states=torch.randn(2, T, 12, generator=g),
        pooled_projections=torch.randn(2, 6, generator=g), timestep=torch.tensor([0.3, 0.7]),
        img_ids=torch.randn(S, 3, generator=g), txt_ids=torch.randn(T, 3, generator=g),
    )
    return model, inputs, None


def _wan(i2v: bool):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=12, freq_dim=16, ffn_dim=16, num_layers=2, image_dim=10 if i2v else None,
        added_kv_proj_dim=48 if i2v else None, rope_max_seq_len=32,
    )
    g = torch.Generator().manual_seed(2)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 3, 2, 10, generator=g),   # 3 x 1 x 5 = 15 tokens
        encoder_hidden_states=torch.randn(2, 6, 12, generator=g),
        # T2V: one timestep per sample; I2V case: one per token (Wan 2.2 style), split by the plan
        timestep=torch.rand(2, 15, generator=g) if i2v else torch.tensor([0.3, 0.7]),
    )
    if i2v:
        inputs["encoder_hidden_states_image"] = torch.randn(2, 5, 10, generator=g)
    return model, inputs, None


def _ltx():
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
        num_layers=2, caption_channels=12,
    )
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0  # padded text: a key mask on LTX's sharded cross-attention
    inputs = dict(
        hidden_states=torch.randn(2, 15, 8, generator=g), encoder_hidden_states=torch.randn(2, 7, 12, generator=g),
        timestep=torch.tensor([300, 700]), encoder_attention_mask=mask, num_frames=3, height=1, width=5,
    )
    return model, inputs, None


def _qwenimage(image: tuple[int, int, int] = (1, 3, 5), T: int = 7):
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=12, axes_dims_rope=(2, 2, 4),
    )
    g = torch.Generator().manual_seed(4)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, T - 2:] = 0  # padded text: QwenImage builds a joint key mask from it
    S = image[0] * image[1] * image[2]
    inputs = dict(
        hidden_states=torch.randn(2, S, 16, generator=g), encoder_hidden_states=torch.randn(2, T, 12, generator=g),
        encoder_hidden_states_mask=mask, timestep=torch.tensor([0.3, 0.7]), img_shapes=[[image]] * 2,
    )
    return model, inputs, None


# Caller-given plans in diffusers' format for two families that declare none.
SD3_PLAN = {
    "pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
    "context_embedder": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}
COGVIDEOX_PLAN = {
    "transformer_blocks.0": {
        "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
        "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
    },
    "": {"image_rotary_emb": [ContextParallelInput(split_dim=0, expected_dims=2)] * 2},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def _sd3():
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=12, caption_projection_dim=32, pooled_projection_dim=6, out_channels=4,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    g = torch.Generator().manual_seed(5)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 6, 10, generator=g),   # 3 x 5 = 15 patches
        encoder_hidden_states=torch.randn(2, 7, 12, generator=g),
        pooled_projections=torch.randn(2, 6, generator=g), timestep=torch.tensor([0.3, 0.7]),
    )
    return model, inputs, SD3_PLAN


def _cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=12, num_layers=2, sample_width=10, sample_height=2, sample_frames=9, patch_size=2,
        use_rotary_positional_embeddings=True,
    )
    g = torch.Generator().manual_seed(6)
    inputs = dict(
        hidden_states=torch.randn(2, 3, 4, 2, 10, generator=g),   # 3 x 1 x 5 = 15 patches
        encoder_hidden_states=torch.randn(2, 7, 12, generator=g), timestep=torch.tensor([300, 700]),
        image_rotary_emb=(torch.randn(15, 8, generator=g), torch.randn(15, 8, generator=g)),
    )
    return model, inputs, COGVIDEOX_PLAN


def _checkpointed(build):
    """The family with activation checkpointing: attention is recomputed during backward."""

    def build_checkpointed():
        model, inputs, plan = build()
        model.enable_gradient_checkpointing()
        return model, inputs, plan

    return build_checkpointed


FAMILIES = {
    "flux": _flux,
    "flux-checkpointed": _checkpointed(_flux),
    "wan": lambda: _wan(False),
    "wan-i2v": lambda: _wan(True),
    "ltx": _ltx,
    "qwenimage": _qwenimage,
    "sd3": _sd3,
    "cogvideox": _cogvideox,
    "sd3-checkpointed": _checkpointed(_sd3),
}
GRAD_INPUTS = ("hidden_states", "encoder_hidden_states")


def _forward_backward(family: str, state: "seqpar.ParallelState | None"):
    """Output and gradients (parameters and float inputs) of one family, plain or parallel."""
    model, inputs, plan = FAMILIES[family]()
    _randomize(model)
    for name in GRAD_INPUTS:
        inputs[name] = inputs[name].clone().requires_grad_()
    if state is not None:
        parallelize(model, state, plan)
    out = model(**inputs, return_dict=False)[0]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    n = 1 if state is None else state.cp_size
    ((out * weight).sum() / n).backward()
    grads = {f"param {k}": p.grad for k, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input {k}": inputs[k].grad for k in GRAD_INPUTS})
    return out.detach(), grads, sum(p.numel() for p in model.parameters())


def _compare_families(families: list[str], layouts: list[tuple[int, int]]) -> dict:
    """Per (family, R, U): (output error, gradient error, gradients compared, parameters)."""
    import torch.distributed as dist

    results = {}
    for family in families:
        ref_out, ref_grads, n_params = _forward_backward(family, None)
        for R, U in layouts:
            state = seqpar.ParallelState(ring_size=R, ulysses_size=U)
            out, grads, _ = _forward_backward(family, state)
            grad_err = 0.0
            for name, ref in ref_grads.items():
                g = grads[name].clone()
                dist.all_reduce(g, group=state.cp_group)
                grad_err = max(grad_err, float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-6)))
            missing = sorted(set(ref_grads) - set(grads))
            out_err = float((out - ref_out).abs().max()) if out.shape == ref_out.shape else float("inf")
            results[(family, R, U)] = (out_err, grad_err, len(ref_grads), n_params, missing)
    return results


LAYOUTS = {2: [(1, 2), (2, 1)], 3: [(3, 1), (1, 3)], 4: [(2, 2)]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_families_match_one_device(pools, world):
    results = pools(world).run(_compare_families, list(FAMILIES), LAYOUTS[world])
    assert all(r == results[0] for r in results), "CP ranks disagree on the full output"
    failures = []
    for (family, R, U), (out_err, grad_err, n_grads, n_params, missing) in results[0].items():
        if out_err > ATOL or grad_err > GRAD_RTOL or missing:
            failures.append(
                f"{family} ring={R} ulysses={U}: output error {out_err:.2e}, gradient error {grad_err:.2e}, "
                f"missing gradients {missing}"
            )
        assert n_grads > 10, f"{family}: only {n_grads} gradients compared"
    assert not failures, "\n".join(failures)


# --- sequences shorter than the CP group (issue #19, finding 9) ------------------------------------

# (family, builder arguments): 3 image tokens (and 3 or 7 text tokens) over 4 ranks left a rank
# without image tokens; diffusers' code failed there while the others waited in a collective.
SHORT = {
    "flux 3+3": ("flux", dict(S=3, T=3)),
    "flux 3+7": ("flux", dict(S=3, T=7)),
    "flux 4+3": ("flux", dict(S=4, T=3)),  # enough image tokens, too few text tokens
    "qwenimage 3+7": ("qwenimage", dict(image=(1, 1, 3), T=7)),
    "qwenimage 1x4+7": ("qwenimage", dict(image=(1, 1, 4), T=7)),  # one token per rank: exact
    "flux 4+4": ("flux", dict(S=4, T=4)),  # one token per rank: exact
}


def _short_sequences(layouts):
    """Per (case, R, U): the output error against one device, or the error message."""
    out = {}
    for case, (family, kwargs) in SHORT.items():
        for R, U in layouts:
            model, inputs, _ = {"flux": _flux, "qwenimage": _qwenimage}[family](**kwargs)
            _randomize(model)
            with torch.no_grad():
                want = model(**inputs, return_dict=False)[0]
                with seqpar.ParallelState(R, U) as state:
                    parallelize(model, state)
                    try:
                        out[(case, R, U)] = float((model(**inputs, return_dict=False)[0] - want).abs().max())
                    except ValueError as e:
                        out[(case, R, U)] = str(e)
    return out


def test_sequences_shorter_than_the_cp_group(pools):
    per_rank = pools(4).run(_short_sequences, [(2, 2), (1, 4), (4, 1)])
    assert all(r == per_rank[0] for r in per_rank), "CP ranks disagree (the same error must reach every rank)"
    for (case, R, U), got in per_rank[0].items():
        if case in ("flux 4+4", "qwenimage 1x4+7"):
            assert isinstance(got, float) and got < ATOL, (case, R, U, got)
        else:
            assert isinstance(got, str) and "tokens, fewer than the 4 CP ranks" in got, (case, R, U, got)
            assert "cp rank 3 would run the model on no token" in got, got


# --- single-process checks ------------------------------------------------------------------------


def test_one_rank_state_is_the_plain_model():
    ref_out, ref_grads, _ = _forward_backward("flux", None)
    out, grads, _ = _forward_backward("flux", seqpar.ParallelState())
    assert torch.equal(out, ref_out)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6)


def test_other_attention_calls_are_untouched():
    """After parallelize, dispatch calls without seqpar's marker run the original backend."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    parallelize(_flux()[0], seqpar.ParallelState())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 4, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert torch.equal(dispatch_attention_fn(q, k, v), want)


def test_refusals():
    state = seqpar.ParallelState()
    model = _sd3()[0]
    with pytest.raises(ValueError, match="declares no _cp_plan; pass plan="):
        parallelize(model, state)
    with pytest.raises(ValueError, match="has no submodule 'nope'"):
        parallelize(model, state, {"nope": ContextParallelOutput(gather_dim=1)})
    with pytest.raises(ValueError, match="split_output=True needs an int key"):
        parallelize(model, state, {"": {"hidden_states": ContextParallelInput(1, split_output=True)}})
    with pytest.raises(ValueError, match="expected a dict of ContextParallelInput"):
        parallelize(model, state, {"proj_out": "gather"})
    with pytest.raises(ValueError, match="no such argument"):
        parallelize(model, state, {"": {"latents": ContextParallelInput(1)}})

    flux = parallelize(_flux()[0], state)
    with pytest.raises(ValueError, match="already applied"):
        parallelize(flux, state)
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    flux.set_attn_processor(FluxAttnProcessor())
    with pytest.raises(RuntimeError, match="replaced or re-configured after parallelize"):
        flux(**_flux()[1])


def test_sharded_call_refuses_query_dependent_masks_and_causal():
    attend = ShardedAttention(seqpar.ParallelState())
    q = k = v = torch.randn(1, 5, 2, 4)
    with pytest.raises(ValueError, match="do not vary over queries"):
        attend(q, k, v, attn_mask=torch.ones(1, 2, 5, 5, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="is_causal=True"):
        attend(q, k, v, is_causal=True)
    with pytest.raises(NotImplementedError, match="dropout"):
        attend(q, k, v, dropout_p=0.1)
