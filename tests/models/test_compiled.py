"""Regional compilation (`model.compile`): each repeated block compiled, the same velocities as
eager, and a rollout that a LoRA update (inside the compiled blocks) still replays."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowloop.models import load_flow_model
from flowloop.models.compiled import compile_image_decoder, compile_repeated_blocks
from flowloop.models.sd3 import LORA_TARGETS
from tests.models.test_sd3 import T5_TOKENS, sd3_dir  # noqa: F401  (the tiny SD3 folder fixture)
from tests.models.tiny_diffusers import PROMPTS, check_lora_update, prompt_ids, rollout


@pytest.mark.slow  # inductor compiles C++ kernels on the CPU: ~90 s on 2 cores
def test_compiled_blocks_give_eager_velocities_and_a_replayable_lora_update(sd3_dir):  # noqa: F811
    torch._dynamo.reset()
    eager, model = (load_flow_model(sd3_dir, max_sequence_length=T5_TOKENS) for _ in range(2))
    blocks = model.transformer.transformer_blocks
    assert compile_repeated_blocks(model.transformer) == len(blocks) >= 2
    assert all(block._compiled_call_impl is not None for block in blocks)
    embeds = model.encode_prompt(*prompt_ids(model, PROMPTS))
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.velocity(x, torch.full((2,), 0.7), embeds),
                                   eager.velocity(x, torch.full((2,), 0.7), embeds), rtol=1e-5, atol=1e-5)
    model.trainable_module().enable_gradient_checkpointing()
    batch, sampling = rollout(model, guidance_scale=4.5, shift=3.0)
    check_lora_update(model, batch, sampling, LORA_TARGETS)
    # The image VAE's decoder, compiled whole, decodes as eager does.
    assert compile_image_decoder(model) and model.vae.decoder._compiled_call_impl is not None
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.decode(latents), eager.decode(latents), rtol=1e-5, atol=1e-5)


def test_only_an_image_autoencoder_decoder_is_compiled(tiny_model):
    assert not compile_image_decoder(tiny_model)  # the embedded model's decoder is its own module
    assert not compile_image_decoder(nn.Linear(2, 2))  # no VAE at all


def test_a_model_without_repeated_blocks_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="set model.compile=false"):
        compile_repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])))
