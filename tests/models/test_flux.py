"""`FluxFlowModel` on a tiny random FluxPipeline folder (FLUX.1-dev style), loaded through the real path."""

from __future__ import annotations

import shutil

import pytest
import torch

from flowloop.models import load_flow_model
from flowloop.models.flux import LORA_TARGETS, FluxFlowModel, image_ids, pack, unpack
from tests.models.tiny_diffusers import PROMPTS, build_flux, check_lora_update, prompt_ids, rollout, unadapted_targets

T5_TOKENS = 16  # the max_sequence_length option


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return build_flux(tmp_path_factory.mktemp("flux") / "model")


@pytest.fixture
def model(flux_dir):
    return load_flow_model(flux_dir, max_sequence_length=T5_TOKENS, guidance=3.5)


def test_embeddings_packing_velocity_and_decode_are_the_pipelines(model, flux_dir):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux_dir)
    # 1. Text: T5 sequence and CLIP pooled, from the same ids the agent loop makes.
    with torch.no_grad():
        expected, pooled, text_ids = pipe.encode_prompt(PROMPTS, None, max_sequence_length=T5_TOKENS)
    ours = model.encode_prompt(*prompt_ids(model, PROMPTS))
    assert isinstance(model, FluxFlowModel) and ours["prompt_embeds"].shape == (2, T5_TOKENS, 32)
    torch.testing.assert_close(ours["prompt_embeds"], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled, rtol=0, atol=1e-5)

    # 2. Packing: our grid flattens to the pipeline's tokens; ids are its image ids.
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))  # VAE latents of 32x32 images
    packed = pack(z)  # [2, 16, 8, 8]
    assert packed.shape == (2, *model.latent_shape(32, 32))
    tokens = pipe._pack_latents(z, 2, 4, 16, 16)  # [2, 64, 16]
    assert torch.equal(packed.flatten(2).transpose(1, 2), tokens)
    assert torch.equal(unpack(packed), z) and torch.equal(pipe._unpack_latents(tokens, 32, 32, 2), z)
    assert torch.equal(image_ids(8, 8, torch.float32, "cpu"), pipe._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32))

    # 3. Velocity: the transformer called as the pipeline calls it (timestep / 1000, guidance tensor).
    sigma = torch.tensor([0.6, 0.3])
    with torch.no_grad():
        timesteps = sigma * 1000  # the scheduler's timesteps; the pipeline passes timesteps / 1000
        reference = pipe.transformer(hidden_states=tokens, timestep=timesteps / 1000, guidance=torch.full([2], 3.5),
                                     pooled_projections=pooled, encoder_hidden_states=expected, txt_ids=text_ids,
                                     img_ids=pipe._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32),
                                     return_dict=False)[0]
        v = model.velocity(packed, sigma, ours)
    torch.testing.assert_close(v.flatten(2).transpose(1, 2), reference, rtol=0, atol=1e-5)

    # 4. Decode: unpack, un-scale, un-shift, VAE, [0, 1], as the pipeline's output_type="pt".
    with torch.no_grad():
        image = pipe.vae.decode(z / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor, return_dict=False)[0]
    torch.testing.assert_close(model.decode(packed), pipe.image_processor.postprocess(image, output_type="pt"))


def test_rollout_replay_and_a_lora_update(model):
    batch, sampling = rollout(model)

    # 1. The contract's shapes (no CFG: FLUX.1-dev's guidance is embedded).
    w = 1  # 2 steps: the SDE on every step but the last
    expected = {
        "responses": (4, 3, 32, 32), "all_latents": (4, w + 1, 16, 8, 8), "rollout_log_probs": (4, w),
        "all_timesteps": (4, w), "prompts": (4, T5_TOKENS), "prompt_embeds": (4, T5_TOKENS, 32),
        "prompt_embeds_mask": (4, T5_TOKENS), "pooled_prompt_embeds": (4, 16),
    }
    assert {k: tuple(batch[k].shape) for k in expected} == expected
    assert not any(k.startswith("negative_") for k in batch.keys())
    assert batch["responses"].dtype == torch.float32 and 0 <= batch["responses"].min() <= batch["responses"].max() <= 1
    assert torch.isfinite(batch["rollout_log_probs"]).all()

    # 2. One LoRA update replays the rollout exactly, then moves the model's output, adapters only.
    check_lora_update(model, batch, sampling, LORA_TARGETS)
    assert unadapted_targets(model.transformer, LORA_TARGETS) == []  # every published target exists in FLUX


def test_bfloat16_weights_take_and_give_float32(model, flux_dir):
    half = load_flow_model(flux_dir, dtype="bfloat16", max_sequence_length=T5_TOKENS)
    assert {p.dtype for p in half.transformer.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in half.t5_encoder.parameters()} == {torch.bfloat16}
    embeds = half.encode_prompt(*prompt_ids(half, PROMPTS[:1]))
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))  # float32, as the engine keeps it
    with torch.no_grad():
        v, reference = half.velocity(x, torch.tensor([0.5]), embeds), model.velocity(x, torch.tensor([0.5]), embeds)
    assert v.dtype == torch.float32 and (v - reference).abs().max() < 0.1 * reference.abs().max()
    image = half.decode(x)
    assert image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1


def test_guidance_option_and_a_model_without_guidance_embeds(model, flux_dir, tmp_path):
    embeds = model.encode_prompt(*prompt_ids(model, PROMPTS[:1]))
    x, sigma = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2)), torch.tensor([0.5])
    with torch.no_grad():
        dev = model.velocity(x, sigma, embeds)
        model.guidance = 1.0
        assert not torch.allclose(model.velocity(x, sigma, embeds), dev)  # dev: guidance is an input
    schnell = load_flow_model(build_flux(tmp_path / "schnell", guidance_embeds=False), max_sequence_length=T5_TOKENS)
    with torch.no_grad():
        a = schnell.velocity(x, sigma, embeds)
        schnell.guidance = 7.0
        assert torch.equal(schnell.velocity(x, sigma, embeds), a)  # schnell: ignored


def test_bad_inputs(model, flux_dir, tmp_path):
    assert model.latent_shape(32, 48) == (16, 8, 12)
    with pytest.raises(ValueError, match="width=42 must be a positive multiple of 4"):
        model.latent_shape(32, 42)
    broken = shutil.copytree(flux_dir, tmp_path / "broken")
    (broken / "text_encoder_2" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="text_encoder_2 has no weights file"):
        load_flow_model(broken)
    with pytest.raises(ValueError, match=r"model.options \['shift'\] are not options of FluxFlowModel"):
        load_flow_model(flux_dir, shift=3.0)
