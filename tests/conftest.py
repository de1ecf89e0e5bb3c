"""Shared fixtures: a tiny randomly initialised shapes model saved to a temp folder."""

from __future__ import annotations

import pytest
import torch

from flowloop.models.tiny import TinyDiT, TinyFlowModel, TinyTextEncoder, build_tokenizer
from flowloop.tasks import shapes


def make_tiny_model(seed: int = 0, resolution: int = 16) -> TinyFlowModel:
    """A few-thousand-parameter model with the real tokenizer; fast enough for any test."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(shapes.VOCABULARY)
    text_encoder = TinyTextEncoder(vocab_size=len(tokenizer), max_length=16, hidden_size=32, depth=1, num_heads=2)
    transformer = TinyDiT(sample_size=resolution, patch_size=4, hidden_size=32, depth=2, num_heads=2, text_dim=32)
    # adaLN-zero starts as the identity; perturb it so the velocity depends on every input.
    for name, param in transformer.named_parameters():
        if "modulation" in name or "final_proj" in name:
            torch.nn.init.normal_(param, std=0.02)
    return TinyFlowModel(tokenizer, text_encoder, transformer)


@pytest.fixture
def tiny_model() -> TinyFlowModel:
    return make_tiny_model()


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_model):
    path = tmp_path / "tiny"
    tiny_model.save_pretrained(path, dtype=torch.float32)
    return path
