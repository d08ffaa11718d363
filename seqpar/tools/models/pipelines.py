"""Tiny random diffusers pipelines (Flux, Wan) built in code, for tests, examples and docs.

No download: every component comes from a small config. The transformer gets random weights from
a seed (diffusers zero-initialises some output layers, which would hide attention); the VAE
(``AutoencoderKL`` for Flux, ``AutoencoderKLWan`` for Wan) and the scheduler
(``FlowMatchEulerDiscreteScheduler`` for Flux, ``UniPCMultistepScheduler`` in flow mode for Wan)
are real tiny instances with their default initialisation under the same seed. Tokenizers and text
encoders are left out (``None``): a call passes ``prompt_embeds`` (and Flux's
``pooled_prompt_embeds``) made by :func:`flux_call` / :func:`wan_call`::

    pipe = tiny_flux_pipeline()
    call = flux_call()                                   # 12 x 20 pixels: 3 x 5 = 15 image tokens
    for model in denoisers(pipe):
        parallelize(model, state)                        # seqpar.integrations.diffusers
    image = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np").images

:func:`latent_tokens` says how many tokens the transformer sees for a call (odd by default), so a
test can check that no length divides the CP group. diffusers is imported only when a function is
called. How a whole pipeline runs context-parallel: docs/howto-diffusers.md ("A whole pipeline").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["denoisers", "flux_call", "latent_tokens", "tiny_flux_pipeline", "tiny_wan_pipeline", "wan_call"]

# Flux: the text width (T5's d_model) and pooled width (CLIP's projection) of the tiny transformer.
FLUX_TEXT_DIM = 12
FLUX_POOLED_DIM = 6
# Wan: the text width (UMT5's d_model) of the tiny transformer.
WAN_TEXT_DIM = 12


def _randomize(model: nn.Module, seed: int, scale: float = 0.2) -> nn.Module:
    """Every parameter drawn from ``N(0, scale**2)`` with a generator seeded ``seed``; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def tiny_flux_pipeline(*, seed: int = 0, guidance_embeds: bool = True, dtype: torch.dtype = torch.float32):
    """A ``FluxPipeline`` of tiny random components (Flux.1-dev's structure, no text encoders).

    The VAE has two blocks (``vae_scale_factor`` 2) and 4 latent channels; the pipeline packs 2 x 2
    latent pixels into one token, so an image of ``height x width`` pixels is
    ``(height // 4) * (width // 4)`` tokens, and ``height``/``width`` must be multiples of 4.

    Args:
        seed: seeds the transformer's random weights and the VAE's initialisation.
        guidance_embeds: the transformer embeds the guidance scale (Flux.1-dev) or not (schnell).
        dtype: of every component (``torch.float64`` runs the transformer and VAE in float64; the
            scheduler's step is float32 in diffusers whatever the dtype).

    Returns:
        ``diffusers.FluxPipeline`` with ``text_encoder``, ``tokenizer``, ``text_encoder_2`` and
        ``tokenizer_2`` set to ``None``; its progress bar is off.

    Raises:
        ImportError: diffusers is not installed (``pip install -e '.[diffusers]'``).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=FLUX_TEXT_DIM, pooled_projection_dim=FLUX_POOLED_DIM,
            axes_dims_rope=(2, 2, 4), guidance_embeds=guidance_embeds,
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1,
            latent_channels=4, norm_num_groups=2, sample_size=16, scaling_factor=1.5, shift_factor=0.1,
            use_quant_conv=False, use_post_quant_conv=False,
        )
    # Dynamic shifting as Flux.1-dev, with image lengths scaled down to tiny images.
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256)
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae.eval(), text_encoder=None, tokenizer=None, text_encoder_2=None,
        tokenizer_2=None, transformer=_randomize(transformer, seed + 1),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe if dtype == torch.float32 else pipe.to(dtype)


def flux_call(
    *,
    batch: int = 1,
    text_tokens: int = 7,
    height: int = 12,
    width: int = 20,
    steps: int = 2,
    true_cfg_scale: float = 1.0,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Keyword arguments of a :func:`tiny_flux_pipeline` call, text given as random embeddings.

    Args:
        batch: prompts (the batch of ``prompt_embeds``).
        text_tokens: T5 tokens per prompt.
        height, width: image size in pixels, multiples of 4 (default 12 x 20: 15 image tokens).
        steps: ``num_inference_steps``.
        true_cfg_scale: above 1, negative embeddings are added too and the pipeline runs the
            transformer twice per step (true classifier-free guidance).
        seed: seeds the embeddings.
        dtype: of the embeddings (the pipeline's latents take it).

    Returns:
        ``{"prompt_embeds": (batch, text_tokens, 12), "pooled_prompt_embeds": (batch, 6),
        "height", "width", "num_inference_steps", ...}``; add ``generator`` and ``output_type``.

    Raises:
        ValueError: ``height`` or ``width`` not a positive multiple of 4.
    """
    for name, n in (("height", height), ("width", width)):
        if n < 4 or n % 4:
            raise ValueError(
                f"flux_call: {name}={n} must be a positive multiple of 4 (VAE factor 2 x 2-pixel packing), "
                f"e.g. {max(4, n // 4 * 4)}"
            )
    gen = torch.Generator().manual_seed(seed)
    call: dict[str, Any] = dict(
        prompt_embeds=torch.randn(batch, text_tokens, FLUX_TEXT_DIM, generator=gen).to(dtype),
        pooled_prompt_embeds=torch.randn(batch, FLUX_POOLED_DIM, generator=gen).to(dtype),
        height=height, width=width, num_inference_steps=steps,
    )
    if true_cfg_scale > 1:
        call.update(
            negative_prompt_embeds=torch.randn(batch, text_tokens, FLUX_TEXT_DIM, generator=gen).to(dtype),
            negative_pooled_prompt_embeds=torch.randn(batch, FLUX_POOLED_DIM, generator=gen).to(dtype),
            true_cfg_scale=true_cfg_scale,
        )
    return call


def _tiny_wan_transformer(seed: int, in_channels: int):
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=in_channels,
            out_channels=in_channels, text_dim=WAN_TEXT_DIM, freq_dim=16, ffn_dim=16, num_layers=2,
            rope_max_seq_len=32, qk_norm="rms_norm_across_heads", cross_attn_norm=True,
        )
    return _randomize(model, seed + 1)


def tiny_wan_pipeline(*, seed: int = 0, two_stage: bool = False, expand_timesteps: bool = False):
    """A ``WanPipeline`` (text to video) of tiny random components, no text encoder.

    The VAE compresses 8 x 8 pixels and 4 frames (Wan 2.1's factors, 16 latent channels) and the
    transformer's patch is 1 x 2 x 2, so ``num_frames`` frames of ``height x width`` pixels are
    ``((num_frames - 1) // 4 + 1) * (height // 16) * (width // 16)`` tokens.

    Args:
        seed: seeds the transformers' random weights and the VAE's initialisation.
        two_stage: Wan 2.2 A14B's form: a second transformer (``transformer_2``, other weights)
            denoises the steps with ``t < 875`` (``boundary_ratio=0.875``, as Wan 2.2 T2V; of 2
            or 3 steps the first runs on ``transformer``, the others on ``transformer_2``).
        expand_timesteps: Wan 2.2 TI2V's form: one timestep per token, a ``(batch, tokens)``
            tensor that the transformer's plan splits with the tokens.

    Returns:
        ``diffusers.WanPipeline`` with ``tokenizer`` and ``text_encoder`` set to ``None``; its
        progress bar is off.

    Raises:
        ImportError: diffusers is not installed (``pip install -e '.[diffusers]'``).
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=vae.eval(), scheduler=scheduler,
        transformer=_tiny_wan_transformer(seed + 10, 16),
        transformer_2=_tiny_wan_transformer(seed + 20, 16) if two_stage else None,
        boundary_ratio=0.875 if two_stage else None, expand_timesteps=expand_timesteps,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan_call(
    *,
    batch: int = 1,
    text_tokens: int = 7,
    height: int = 16,
    width: int = 80,
    num_frames: int = 9,
    steps: int = 2,
    guidance_scale: float = 4.0,
    seed: int = 1,
) -> dict[str, Any]:
    """Keyword arguments of a :func:`tiny_wan_pipeline` call, text given as random embeddings.

    Args:
        batch: prompts (the batch of ``prompt_embeds``).
        text_tokens: UMT5 tokens per prompt.
        height, width: frame size in pixels, multiples of 16 (default 16 x 80: 1 x 5 tokens a frame).
        num_frames: ``4 k + 1`` frames (default 9: 3 latent frames, so 15 tokens).
        steps: ``num_inference_steps``.
        guidance_scale: above 1, negative embeddings are added too and the pipeline runs the
            transformer twice per step (classifier-free guidance).
        seed: seeds the embeddings.

    Returns:
        ``{"prompt_embeds": (batch, text_tokens, 12), "height", "width", "num_frames",
        "num_inference_steps", "guidance_scale", ...}``; add ``generator`` and ``output_type``.

    Raises:
        ValueError: ``height``/``width`` not a positive multiple of 16, or ``num_frames`` not ``4 k + 1``.
    """
    for name, n in (("height", height), ("width", width)):
        if n < 16 or n % 16:
            raise ValueError(f"wan_call: {name}={n} must be a positive multiple of 16, e.g. {max(16, n // 16 * 16)}")
    if num_frames < 1 or num_frames % 4 != 1:
        raise ValueError(f"wan_call: num_frames={num_frames} must be 4 k + 1, e.g. {max(1, num_frames // 4 * 4 + 1)}")
    gen = torch.Generator().manual_seed(seed)
    call: dict[str, Any] = dict(
        prompt_embeds=torch.randn(batch, text_tokens, WAN_TEXT_DIM, generator=gen),
        height=height, width=width, num_frames=num_frames, num_inference_steps=steps, guidance_scale=guidance_scale,
    )
    if guidance_scale > 1:
        call["negative_prompt_embeds"] = torch.randn(batch, text_tokens, WAN_TEXT_DIM, generator=gen)
    return call


def denoisers(pipe: Any) -> list[nn.Module]:
    """The pipeline's transformers to parallelize: ``transformer`` and, if set, ``transformer_2``."""
    return [m for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)) if m is not None]


def latent_tokens(pipe: Any, call: dict[str, Any]) -> int:
    """The number of image/video tokens the pipeline's transformer sees for ``pipe(**call)``.

    Args:
        pipe: a :func:`tiny_flux_pipeline` or :func:`tiny_wan_pipeline` (or a full-size one of
            the same classes).
        call: the call's keyword arguments (``height``, ``width``, and Wan's ``num_frames``).

    Raises:
        ValueError: a pipeline other than ``FluxPipeline`` or ``WanPipeline``.
    """
    name = type(pipe).__name__
    if name == "FluxPipeline":
        cell = pipe.vae_scale_factor * 2  # VAE factor, then 2 x 2 latent pixels per token
        return (call["height"] // cell) * (call["width"] // cell)
    if name == "WanPipeline":
        _, ph, pw = denoisers(pipe)[0].config.patch_size
        frames = (call["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1
        s = pipe.vae_scale_factor_spatial
        return frames * (call["height"] // (s * ph)) * (call["width"] // (s * pw))
    raise ValueError(f"latent_tokens: FluxPipeline or WanPipeline expected, got {name}")
