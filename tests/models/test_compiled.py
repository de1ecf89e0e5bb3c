"""Regional compilation (`model.compile`): each repeated block compiled, the same velocities as
eager, and a rollout that a LoRA update (inside the compiled blocks) still replays."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowloop.models import load_flow_model
from flowloop.models.compiled import bucket_text_lengths, compile_image_decoder, compile_repeated_blocks
from flowloop.models.sd3 import LORA_TARGETS
from tests.models.test_sd3 import T5_TOKENS, sd3_dir  # noqa: F401  (the tiny SD3 folder fixture)
from tests.models.tiny_diffusers import PROMPTS, check_lora_update, prompt_ids, rollout


@pytest.mark.slow  # inductor compiles C++ kernels on the CPU: ~90 s on 2 cores
def test_compiled_blocks_give_eager_velocities_and_a_replayable_lora_update(sd3_dir):  # noqa: F811
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
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
    # Every block call of the rollout, the KL reference and the update ran compiled: none hit
    # torch's recompile limit and fell back to eager.
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] == frames["total"] >= 8, dict(torch._dynamo.utils.counters["unimplemented"])
    # The image VAE's decoder, compiled whole, decodes as eager does.
    assert compile_image_decoder(model) and model.vae.decoder._compiled_call_impl is not None
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.decode(latents), eager.decode(latents), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # inductor compiles C++ kernels on the CPU: ~20 s on 2 cores for each case
@pytest.mark.parametrize("rollout_only", [True, False], ids=["rollout", "update"])
def test_prompts_of_different_lengths_share_one_compiled_graph(tmp_path, tiny_model, rollout_only):
    """The rollout's no-grad calls and, with the update compiled, its forward and backward."""
    from tests.models.tiny_diffusers_video import save_qwen_image

    torch._dynamo.reset()
    model = load_flow_model(save_qwen_image(tmp_path / "qwen", num_layers=2))
    assert compile_repeated_blocks(model.transformer, rollout_only=rollout_only) == 2
    assert bucket_text_lengths(model) and not bucket_text_lengths(tiny_model)  # only a model that cuts its text
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    graphs = []
    with torch.set_grad_enabled(not rollout_only):
        for prompt in ["a red circle", "two blue squares on a green mat"]:  # two text lengths
            with torch.no_grad():
                embeds = model.encode_prompt(*prompt_ids(model, [prompt]))
            v = model.velocity(x, torch.full((1,), 0.5), embeds)
            if not rollout_only:
                v.square().mean().backward()
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0] >= 1  # the second length compiled nothing


def test_only_an_image_autoencoder_decoder_is_compiled(tiny_model):
    assert not compile_image_decoder(tiny_model)  # the embedded model's decoder is its own module
    assert not compile_image_decoder(nn.Linear(2, 2))  # no VAE at all


def test_a_model_without_repeated_blocks_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="set model.compile=false"):
        compile_repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])))


def test_rollout_only_compiles_the_calls_without_gradients():
    torch._dynamo.reset()
    torch.manual_seed(0)
    stack = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    blocks = stack[0]
    eager = [block.forward for block in blocks]
    assert compile_repeated_blocks(stack, rollout_only=True) == 2
    x = torch.randn(3, 4)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        compiled_out = blocks[1](blocks[0](x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # the no-grad call went through dynamo
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    trained = blocks[1](blocks[0](x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the call with gradients stayed eager
    trained.sum().backward()
    assert blocks[0].weight.grad is not None
    torch.testing.assert_close(compiled_out, eager[1](eager[0](x)).detach(), rtol=1e-6, atol=1e-6)


def test_model_compile_takes_true_false_or_rollout():
    from flowloop.config import load_config
    from flowloop.config.train import TrainConfig

    assert load_config(TrainConfig, ["model.compile=rollout"]).model.compile == "rollout"
    with pytest.raises(ValueError, match="model.compile must be true, false or rollout, got 'fast'"):
        load_config(TrainConfig, ["model.compile=fast"])
