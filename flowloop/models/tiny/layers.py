"""Building blocks shared by the tiny text encoder and the tiny denoiser.

A sample's result does not depend on which other samples share its batch, to the last bit:
attention always sees a fixed-length, padded text sequence and an explicit boolean mask, and
layers with one row per sample run through `per_sample`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


ROW_CHUNK = 16
"""Rows of each matmul in `per_sample`. Any fixed count works (within one matmul a row's result
depends on that row alone, whatever its position: measured at 4 to 32 rows); 16 keeps a lone
sample's padding cheap and runs a batch of 16 as one matmul."""


def per_sample(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer`` (row-wise: a Linear, an MLP) on ``x [B, D]`` as matmuls of exactly ``ROW_CHUNK``
    rows, the last chunk zero-padded, so a row's result does not depend on ``B``.

    A CPU GEMM's last bits depend on its row count: with MKL on an AVX-512 CPU, fewer than 3 to
    15 rows (by shape) round otherwise than more. The per-sample layers (timestep and pooled-text
    MLPs, adaLN modulations) have B rows, so a sample alone and the same sample in a batch ended
    ~1e-5 apart in pixels. Token-wise layers run ``B * tokens`` rows (80 per sample in the DiT at
    32x32, 16 per prompt in the text encoder), enough there; tests/models/test_tiny_batch_invariance.py
    checks whole samples.
    """
    b = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -b % ROW_CHUNK))  # [B rounded up to a multiple of ROW_CHUNK, D]
    return torch.cat([layer(chunk) for chunk in padded.split(ROW_CHUNK)])[:b]


class Attention(nn.Module):
    """Multi-head self-attention over one joint sequence, with a key-padding mask."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)  # [3, B, h, N, d/h]
        mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, N]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, N, d/h]
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """Pre-norm transformer block; with ``cond`` it is a DiT block (adaLN-zero modulation)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, modulated: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=not modulated, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=not modulated, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.modulation = None
        if modulated:
            self.modulation = nn.Linear(dim, 6 * dim)
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, cond: torch.Tensor | None = None) -> torch.Tensor:
        if self.modulation is None:
            x = x + self.attn(self.norm1(x), key_mask)
            return x + self.mlp(self.norm2(x))
        modulation = per_sample(self.modulation, F.silu(cond))[:, None]  # [B, 1, 6D]
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation.chunk(6, dim=-1)  # each [B, 1, D]
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1, key_mask)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


def sinusoidal_embedding(values: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """``values`` ``[B]`` -> ``[B, dim]`` sin/cos features (timesteps, positions)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=values.device) / half)
    args = values.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def grid_position_embedding(grid_h: int, grid_w: int, dim: int, device=None) -> torch.Tensor:
    """Fixed 2-D sin/cos position embedding ``[grid_h * grid_w, dim]`` (half rows, half columns)."""
    ys, xs = torch.meshgrid(
        torch.arange(grid_h, dtype=torch.float32, device=device),
        torch.arange(grid_w, dtype=torch.float32, device=device),
        indexing="ij",
    )
    return torch.cat([sinusoidal_embedding(ys.flatten(), dim // 2, 100.0), sinusoidal_embedding(xs.flatten(), dim // 2, 100.0)], -1)
