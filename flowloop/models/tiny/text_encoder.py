"""The tiny text encoder: token embeddings, learned positions and a few transformer blocks.

A diffusers ``ModelMixin`` so it saves and loads (``config.json`` + safetensors) through the
same ``from_pretrained`` path as the components of real pipelines.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from flowloop.models.tiny.layers import Block


class TinyTextEncoder(ModelMixin, ConfigMixin):
    """Token ids ``[B, L]`` -> contextual embeddings ``[B, L, hidden_size]``."""

    @register_to_config
    def __init__(self, vocab_size: int = 64, max_length: int = 16, hidden_size: int = 128, depth: int = 2, num_heads: int = 4):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = nn.Parameter(torch.zeros(max_length, hidden_size))
        nn.init.normal_(self.position_embedding, std=0.02)
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.config.max_length:
            raise ValueError(f"prompt has {length} tokens; the text encoder takes at most max_length={self.config.max_length}")
        x = self.token_embedding(input_ids) + self.position_embedding[:length]  # [B, L, D]
        key_mask = attention_mask.bool()
        for block in self.blocks:
            x = block(x, key_mask)
        return self.norm(x) * attention_mask[..., None].to(x.dtype)
