"""A small video diffusion transformer (DiT) made of SDPA blocks.

The model works on patch tokens and knows nothing about parallelism: every attention is a plain
``F.scaled_dot_product_attention`` call, so under ``seqpar.parallel_sdpa(state)`` it runs on
sequence shards once its tokens (and their global positions) are sharded::

    patches = patchify(video, model.patch)                   # [B, S, P], S = T' * H' * W'
    local = seqpar.shard(patches, state)                     # [B, S_local, P]
    pos = seqpar.shard_positions(patches.shape[1], state)    # [S_local] global token index
    with seqpar.parallel_sdpa(state):
        pred = model(local, t, pos)                          # [B, S_local, P]

Tokens are ordered frame-major (``t, h, w``); the 3-D sin-cos position embedding is indexed by the
global token index, so a shard gets exactly the embeddings of its tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["VideoDiT", "DiTBlock", "patchify", "unpatchify"]


def _check_patch(video_shape: tuple[int, ...], patch: tuple[int, int, int], where: str) -> None:
    if len(video_shape) != 5:
        raise ValueError(
            f"{where}: expected a video (batch, channels, frames, height, width), got {video_shape}"
        )
    for name, n, p in zip(("frames", "height", "width"), video_shape[2:], patch):
        if p < 1 or n % p != 0:
            raise ValueError(f"{where}: {name}={n} is not a multiple of the patch size {p} (patch={patch})")


def patchify(video: Tensor, patch: tuple[int, int, int]) -> Tensor:
    """Cut a video into patch tokens.

    Args:
        video: ``(batch, channels, frames, height, width)``.
        patch: ``(pt, ph, pw)`` dividing frames, height and width.

    Returns:
        ``(batch, S, channels * pt * ph * pw)`` with ``S = (frames/pt) * (height/ph) * (width/pw)``,
        tokens frame-major.

    Raises:
        ValueError: a wrong rank or sizes the patch does not divide.
    """
    _check_patch(tuple(video.shape), patch, "patchify")
    b, c, t, h, w = video.shape
    pt, ph, pw = patch
    x = video.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # b, T', H', W', c, pt, ph, pw
    return x.reshape(b, (t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: Tensor, patch: tuple[int, int, int], grid: tuple[int, int, int]) -> Tensor:
    """Inverse of :func:`patchify`.

    Args:
        tokens: ``(batch, S, channels * pt * ph * pw)`` with ``S = T' * H' * W'``.
        patch: ``(pt, ph, pw)``.
        grid: ``(T', H', W')``, the token grid.

    Returns:
        ``(batch, channels, T' * pt, H' * ph, W' * pw)``.

    Raises:
        ValueError: if the token count or width does not fit ``grid`` and ``patch``.
    """
    b, s, p = tokens.shape
    gt, gh, gw = grid
    pt, ph, pw = patch
    if s != gt * gh * gw or p % (pt * ph * pw) != 0:
        raise ValueError(f"unpatchify: tokens {tuple(tokens.shape)} do not fit grid {grid} and patch {patch}")
    c = p // (pt * ph * pw)
    x = tokens.reshape(b, gt, gh, gw, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, c, gt * pt, gh * ph, gw * pw)


def _sincos(positions: Tensor, dim: int) -> Tensor:
    """``[N] -> [N, dim]`` sinusoidal features (``dim`` even)."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _pos_embed_3d(grid: tuple[int, int, int], dim: int) -> Tensor:
    """``[T' * H' * W', dim]`` fixed 3-D sin-cos embedding, frame-major token order."""
    per = 2 * (dim // 6)
    sizes = (per, per, dim - 2 * per)
    axes = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
    parts = [_sincos(a.reshape(-1), d) for a, d in zip(axes, sizes)]
    return torch.cat(parts, dim=1).float()


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """adaLN transformer block: self-attention (SDPA, QK-RMSNorm) and a GELU MLP.

    Args:
        dim: model width ``C``; ``heads`` must divide it.
        heads: attention heads ``H`` (head dim ``C / H``).
        mlp_ratio: MLP hidden width over ``C``.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"DiTBlock: heads={heads} must divide dim={dim}")
        self.heads, self.head_dim = heads, dim // heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada = nn.Linear(dim, 6 * dim)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """``x`` ``(B, S, C)`` tokens (a shard under ``parallel_sdpa``), ``c`` ``(B, C)`` conditioning."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c)).chunk(6, dim=-1)
        b, s, _ = x.shape
        h = _modulate(self.norm1(x), shift1, scale1)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)  # (B, H, S, D)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + gate1[:, None] * self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + gate2[:, None] * self.mlp(_modulate(self.norm2(x), shift2, scale2))


class VideoDiT(nn.Module):
    """A small video DiT on patch tokens (flow-matching / denoising head).

    Args:
        in_channels: latent channels of the video.
        patch: ``(pt, ph, pw)`` patch size.
        grid: ``(T', H', W')`` token grid (e.g. ``(13, 9, 15)``: 1755 tokens).
        dim: width ``C`` (even).
        depth: number of :class:`DiTBlock`.
        heads: attention heads.
        mlp_ratio: MLP width over ``C``.

    Raises:
        ValueError: odd ``dim`` or ``heads`` not dividing ``dim``.
    """

    def __init__(
        self,
        in_channels: int = 4,
        patch: tuple[int, int, int] = (1, 2, 2),
        grid: tuple[int, int, int] = (13, 9, 15),
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"VideoDiT: dim must be even, got {dim}")
        self.patch, self.grid, self.in_channels = tuple(patch), tuple(grid), in_channels
        self.patch_dim = in_channels * patch[0] * patch[1] * patch[2]
        self.num_tokens = grid[0] * grid[1] * grid[2]
        self.x_embed = nn.Linear(self.patch_dim, dim)
        self.register_buffer("pos_embed", _pos_embed_3d(self.grid, dim), persistent=False)
        self.t_embed = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([DiTBlock(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, self.patch_dim)

    def forward(self, tokens: Tensor, t: Tensor, positions: Tensor | None = None) -> Tensor:
        """Predict per-token targets.

        Args:
            tokens: ``(B, S_local, P)`` patch tokens (``P = in_channels * pt * ph * pw``).
            t: ``(B,)`` diffusion time in ``[0, 1]``.
            positions: ``(S_local,)`` global token index of each token (``seqpar.shard_positions``);
                ``None`` means ``arange(S_local)`` (the unsharded sequence).

        Returns:
            ``(B, S_local, P)``.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.x_embed(tokens) + self.pos_embed.to(tokens.dtype)[positions]
        c = self.t_embed(_sincos(t * 1000.0, self.pos_embed.shape[1]).to(tokens.dtype))
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.ada_out(F.silu(c)).chunk(2, dim=-1)
        h = _modulate(self.norm_out(x), shift, scale)  # (B, S_local, C)
        # nn.Linear on a 3-D input folds (B, S) into one dim and returns a *view* of its 2-D result.
        # FSDP2 warns about a root module returning a view (an in-place op on it would drop its
        # pre-backward hook); matmul + bias computes the same values into a fresh tensor.
        return torch.matmul(h, self.out.weight.t()) + self.out.bias
