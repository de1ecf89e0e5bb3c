"""The tiny denoiser: a pixel-space DiT with joint text + image attention.

Patchify the image, prepend the projected text tokens, run adaLN-zero blocks conditioned on
the timestep and the pooled prompt, and unpatchify the image tokens into a velocity. Small
enough (a few million parameters at 32x32) to sample and train with FlowGRPO on a laptop CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from flowloop.models.tiny.layers import Block, grid_position_embedding, per_sample, sinusoidal_embedding


class TinyDiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """``(x_t [B,C,H,W], t [B], text [B,L,Dt], text_mask [B,L]) -> velocity [B,C,H,W]``."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        hidden_size: int = 160,
        depth: int = 6,
        num_heads: int = 5,
        mlp_ratio: float = 4.0,
        text_dim: int = 128,
    ):
        super().__init__()
        self.patch_embed = nn.Linear(in_channels * patch_size * patch_size, hidden_size)
        self.text_proj = nn.Linear(text_dim, hidden_size)
        self.time_mlp = nn.Sequential(nn.Linear(256, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.pooled_text_mlp = nn.Sequential(nn.Linear(text_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads, mlp_ratio, modulated=True) for _ in range(depth))
        self.final_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Linear(hidden_size, 2 * hidden_size)
        self.final_proj = nn.Linear(hidden_size, in_channels * patch_size * patch_size)
        for zero in (self.final_modulation, self.final_proj):
            nn.init.zeros_(zero.weight)
            nn.init.zeros_(zero.bias)
        self.gradient_checkpointing = False

    def check_resolution(self, height: int, width: int) -> None:
        """Raise ValueError unless the image is square and divisible by the patch size."""
        p = self.config.patch_size
        if height != width:
            raise ValueError(f"resolution {height}x{width} is not square; the tiny model takes square images (height == width)")
        if height % p or height <= 0:
            raise ValueError(f"resolution {height} is not a positive multiple of the model's patch_size={p}")

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        b, c, h, w = sample.shape
        self.check_resolution(h, w)
        p = self.config.patch_size
        gh, gw = h // p, w // p
        # 1. Patchify: [B, C, H, W] -> [B, N, C*p*p]
        patches = sample.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)
        image_tokens = self.patch_embed(patches) + grid_position_embedding(gh, gw, self.config.hidden_size, sample.device).to(patches.dtype)
        # 2. Conditioning: timestep (scaled to [0, 1000]) plus the masked mean of the prompt.
        mask = text_mask.to(text.dtype)[..., None]  # [B, L, 1]
        pooled = (text * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # [B, Dt]
        time_features = sinusoidal_embedding(timestep * 1000.0, 256).to(text.dtype)  # [B, 256]
        cond = per_sample(self.time_mlp, time_features) + per_sample(self.pooled_text_mlp, pooled)  # [B, D]
        # 3. Joint sequence [text; image] with padded text keys masked out.
        x = torch.cat([self.text_proj(text), image_tokens], dim=1)  # [B, L+N, D]
        key_mask = torch.cat([text_mask.bool(), torch.ones(b, gh * gw, dtype=torch.bool, device=sample.device)], dim=1)
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, key_mask, cond, use_reentrant=False)
            else:
                x = block(x, key_mask, cond)
        # 4. Final adaLN, project image tokens back to patches, unpatchify.
        shift, scale = per_sample(self.final_modulation, F.silu(cond))[:, None].chunk(2, dim=-1)  # each [B, 1, D]
        out = self.final_proj(self.final_norm(x[:, -gh * gw :]) * (1 + scale) + shift)  # [B, N, C*p*p]
        return out.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
