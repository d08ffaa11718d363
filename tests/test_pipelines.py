"""A whole diffusers pipeline call with ``parallelize`` on its transformer(s), against one device.

Each case is a tiny random pipeline (``seqpar.tools.models.pipelines``: real tiny VAE and
scheduler, text given as embeddings) called for 3 inference steps from a fixed generator, with odd
token counts (15 image/video tokens, 7 text tokens). On every rank of a gloo pool the pipeline
runs once on one device (the reference) and once with ``parallelize(model, state)`` on each of its
transformers, for several (ring, Ulysses) splits. Every rank must return the same latents after
every step and the same decoded image or video, and they must match the reference:

- fp32 cases: max absolute difference <= 1e-4 (latents are O(1)..O(10); measured ~7e-6);
- the float64 Flux case (transformer and VAE in float64): <= 1e-12 (measured ~4e-15).

A pipeline option seqpar cannot honour -- an attention mask passed through Flux's
``joint_attention_kwargs``, which reaches the sharded attention calls unsplit -- must raise on every
rank, not return an image; so must a generator seeded per rank (different latents on the CP ranks).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "diffusers",
    reason="diffusers is not installed; install the extra: pip install -e '.[diffusers]' (diffusers==0.42.1)",
)

import seqpar  # noqa: E402
from seqpar.integrations.diffusers import parallelize  # noqa: E402
from seqpar.tools.models.pipelines import (  # noqa: E402
    denoisers,
    flux_call,
    latent_tokens,
    tiny_flux_pipeline,
    tiny_wan_pipeline,
    wan_call,
)

STEPS = 3
ATOL = {"fp32": 1e-4, "float64": 1e-12}


def _flux(dtype: torch.dtype = torch.float32):
    # batch 2, Flux.1-dev's guidance embedding and true CFG (two transformer calls per step)
    return tiny_flux_pipeline(dtype=dtype), flux_call(batch=2, steps=STEPS, true_cfg_scale=1.5, dtype=dtype)


CASES = {
    "flux": lambda: _flux(),
    "flux-float64": lambda: _flux(torch.float64),
    "wan2.1": lambda: (tiny_wan_pipeline(), wan_call(steps=STEPS)),  # with classifier-free guidance
    "wan2.2-two-stage": lambda: (tiny_wan_pipeline(two_stage=True), wan_call(steps=STEPS)),
    "wan2.2-ti2v": lambda: (tiny_wan_pipeline(expand_timesteps=True), wan_call(steps=STEPS, guidance_scale=1.0)),
}
LAYOUTS = {2: [(1, 2), (2, 1)], 3: [(3, 1), (1, 3)], 4: [(2, 2)]}


def _run(case: str, state: seqpar.ParallelState | None) -> dict:
    """One pipeline call: the latents after every step, the decoded output, transformer calls."""
    pipe, call = CASES[case]()
    calls = []
    for i, model in enumerate(denoisers(pipe)):
        if state is not None:
            parallelize(model, state)
        model.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
    latents = []

    def keep_latents(pipe, step, t, kwargs):
        latents.append(kwargs["latents"].clone())
        return {}

    out = pipe(**call, generator=torch.Generator().manual_seed(3), output_type="np",
               callback_on_step_end=keep_latents, return_dict=False)[0]
    return dict(latents=torch.stack(latents), output=torch.as_tensor(out), calls=calls,
                tokens=latent_tokens(pipe, call), text=call["prompt_embeds"].shape[1])


def _compare(cases: list[str], layouts: list[tuple[int, int]]) -> dict:
    """Per (case, R, U): errors against the one-device call, and this rank's results."""
    out = {}
    for case in cases:
        ref = _run(case, None)
        for R, U in layouts:
            with seqpar.ParallelState(R, U) as state:
                got = _run(case, state)
            out[(case, R, U)] = dict(
                got,
                latent_err=float((got["latents"] - ref["latents"]).abs().max()),
                output_err=float((got["output"] - ref["output"]).abs().max()),
                ref_calls=ref["calls"],
            )
    return out


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_pipeline_call_matches_one_device(pools, world):
    per_rank = pools(world).run(_compare, list(CASES), LAYOUTS[world])
    failures = []
    for key, r in per_rank[0].items():
        case = key[0]
        for other in per_rank[1:]:  # every rank returns the same latents and image/video
            assert torch.equal(other[key]["latents"], r["latents"]), f"{key}: CP ranks disagree on the latents"
            assert torch.equal(other[key]["output"], r["output"]), f"{key}: CP ranks disagree on the output"
        assert r["tokens"] % 2 == 1 and r["text"] % 2 == 1, f"{key}: token counts should be odd"
        assert r["latents"].shape[0] == STEPS and r["calls"] == r["ref_calls"], key
        atol = ATOL["float64" if "float64" in case else "fp32"]
        if r["latent_err"] > atol or r["output_err"] > atol:
            failures.append(
                f"{key}: latents off by {r['latent_err']:.1e}, output by {r['output_err']:.1e} (atol {atol})"
            )
    assert not failures, "\n".join(failures)
    calls = {case: per_rank[0][(case, *LAYOUTS[world][0])]["calls"] for case in CASES}
    assert calls["flux"] == [0] * 2 * STEPS  # true CFG: two calls per step
    assert calls["wan2.1"] == [0] * 2 * STEPS  # CFG: two calls per step
    assert calls["wan2.2-two-stage"] == [0, 0] + [1] * 2 * (STEPS - 1)  # both transformers ran
    assert calls["wan2.2-ti2v"] == [0] * STEPS


def _masked_flux_call(R: int, U: int) -> dict:
    """Flux with a key mask in ``joint_attention_kwargs``: one device, then parallel (error or output)."""
    pipe = tiny_flux_pipeline()
    call = flux_call(steps=2)
    T, S = call["prompt_embeds"].shape[1], latent_tokens(pipe, call)
    mask = torch.ones(1, 1, 1, T + S, dtype=torch.bool)
    mask[..., T - 2:T] = False  # the last two text tokens are padding
    masked = dict(call, joint_attention_kwargs={"attention_mask": mask}, output_type="latent")
    want = pipe(**masked, generator=torch.Generator().manual_seed(3)).images
    plain = pipe(**dict(call, output_type="latent"), generator=torch.Generator().manual_seed(3)).images
    result = dict(mask_matters=float((want - plain).abs().max()))
    with seqpar.ParallelState(R, U) as state:
        parallelize(pipe.transformer, state)
        try:
            got = pipe(**masked, generator=torch.Generator().manual_seed(3)).images
            result["error"] = float((got - want).abs().max())
        except ValueError as e:
            result["raised"] = str(e)
    return result


@pytest.mark.slow  # a diffusers model on every rank: not in the quick subset
def test_attention_mask_in_joint_attention_kwargs_is_refused(pools):
    """The one-device pipeline honours the mask; the parallel one raises on every rank."""
    per_rank = pools(2).run(_masked_flux_call, 1, 2)
    for r in per_rank:
        assert r["mask_matters"] > 1e-3, "the mask should change the one-device result"
        assert "raised" in r, f"a masked call returned numbers (error {r.get('error')}) instead of raising"
        assert "attention mask (1, 1, 1, 22)" in r["raised"] and "sharded calls" in r["raised"], r["raised"]


# --- single-process checks ------------------------------------------------------------------------


def test_one_rank_state_is_the_plain_pipeline():
    want = _run("wan2.2-two-stage", None)
    got = _run("wan2.2-two-stage", seqpar.ParallelState())
    assert torch.equal(got["latents"], want["latents"]) and torch.equal(got["output"], want["output"])


def test_builders_refuse_sizes_the_pipeline_would_round():
    with pytest.raises(ValueError, match="height=10 must be a positive multiple of 4"):
        flux_call(height=10)
    with pytest.raises(ValueError, match="width=40 must be a positive multiple of 16, e.g. 32"):
        wan_call(width=40)
    with pytest.raises(ValueError, match="num_frames=8 must be 4 k \\+ 1, e.g. 9"):
        wan_call(num_frames=8)
    assert latent_tokens(tiny_wan_pipeline(), wan_call(num_frames=13, height=48, width=16)) == 4 * 3 * 1


def _per_rank_inputs(kind: str) -> dict:
    """A parallel Flux pipeline called with rank-dependent inputs: the error, or the output's error."""
    import torch.distributed as dist

    pipe = tiny_flux_pipeline()
    call = dict(flux_call(steps=2), output_type="latent")
    rank = dist.get_rank()
    seed = 3 + rank if kind == "seed" else 3
    if kind == "last-bits":  # what ranks that encode the prompt themselves may differ by
        call["prompt_embeds"] = call["prompt_embeds"] * (1 + 1e-7 * rank)
    want = pipe(**call, generator=torch.Generator().manual_seed(3)).images
    with seqpar.ParallelState(1, 2) as state:
        parallelize(pipe.transformer, state)
        try:
            got = pipe(**call, generator=torch.Generator().manual_seed(seed)).images
            return dict(error=float((got - want).abs().max()))
        except ValueError as e:
            return dict(raised=str(e))


@pytest.mark.slow  # a diffusers pipeline on every rank: not in the quick subset
def test_a_generator_seeded_per_rank_is_refused(pools):
    """Per-rank seeds draw different latents on the CP ranks: refused on every rank, not a wrong image."""
    for r in pools(2).run(_per_rank_inputs, "seed"):
        assert "raised" in r, f"different latents on the CP ranks gave an image (off by {r.get('error')})"
        assert "called FluxTransformer2DModel with different inputs (hidden_states: cp ranks 0 and 1 differ" in (
            r["raised"]
        ), r["raised"]
        assert "the same seed" in r["raised"], r["raised"]
    for r in pools(2).run(_per_rank_inputs, "last-bits"):  # last-bit differences pass, and are harmless
        assert r.get("error", 1.0) < ATOL["fp32"], r
