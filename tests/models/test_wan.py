"""Wan text-to-video adapter on a tiny random pipeline folder, through the real loading, rollout and update paths."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flowloop.models import load_flow_model
from flowloop.models.wan import LORA_TARGETS, WanFlowModel
from flowloop.models.prompt_ids import encode_chat
from flowloop.rollout.engine import RolloutEngine
from flowloop.rollout.types import RolloutRequest, SamplingParams
from tests.models.tiny_diffusers import check_lora_update, prompt_ids, rollout
from tests.models.tiny_diffusers_video import LATENT_CHANNELS, PROMPTS, TEXT_DIM, save_wan

RES, FRAMES = 32, 5  # latents [4, 2, 4, 4]: 8 video tokens
STEPS = 2  # SDE on the first step, ODE on the last: W = 1 log-prob per row


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_wan(tmp_path_factory.mktemp("wan") / "wan")


@pytest.fixture(scope="module")
def model(folder):
    return load_flow_model(folder)


def test_loads_with_t5_chat_template_and_video_latents(model):
    assert isinstance(model, WanFlowModel)
    ids = encode_chat(model.tokenizer, [{"role": "user", "content": "a red circle"}])
    assert model.tokenizer.convert_ids_to_tokens(ids.tolist()) == ["\u2581a", "\u2581red", "\u2581circle", "</s>"]
    assert model.max_sequence_length == 512
    assert model.latent_shape(48, 32, 33) == (LATENT_CHANNELS, 9, 6, 4)
    assert not any(p.requires_grad for p in [*model.text_encoder.parameters(), *model.vae.parameters()])
    assert model.trainable_module() is model.transformer


def test_embeddings_velocity_and_decode_match_the_diffusers_pipeline(model, folder):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
    prompts = ["a red circle", "two blue squares on a green mat"]
    with torch.no_grad():
        expected = pipe._get_t5_prompt_embeds(prompts, max_sequence_length=512, device="cpu")  # zeros after each prompt
        embeds = model.encode_prompt(*prompt_ids(model, prompts))
        assert embeds["prompt_embeds"].shape == (2, 512, TEXT_DIM)
        assert torch.allclose(embeds["prompt_embeds"], expected, atol=1e-5)

        latents = torch.randn(2, *model.latent_shape(RES, RES, FRAMES), generator=torch.Generator().manual_seed(0))
        out = pipe.transformer(hidden_states=latents, timestep=torch.full((2,), 700.0), encoder_hidden_states=expected,
                               return_dict=False)[0]
        assert torch.allclose(model.velocity(latents, torch.full((2,), 0.7), embeds), out, atol=1e-5)
        model.expand_timesteps = True  # Wan 2.2 TI2V's per-token timesteps: all equal in text-to-video
        try:
            assert torch.allclose(model.velocity(latents, torch.full((2,), 0.7), embeds), out, atol=1e-5)
        finally:
            model.expand_timesteps = False

        vae = pipe.vae.config
        mean = torch.tensor(vae.latents_mean).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.latents_std).view(1, -1, 1, 1, 1)
        video = pipe.vae.decode(latents / inv_std + mean, return_dict=False)[0]  # the pipeline's decode
        video = pipe.video_processor.postprocess_video(video, output_type="pt")  # [B, T, C, H, W] in [0, 1]
        assert torch.allclose(model.decode(latents), video, atol=1e-5)


def test_bfloat16_weights_take_and_give_float32(folder):
    model = load_flow_model(folder, dtype="bfloat16")  # the norms diffusers keeps in float32 stay so
    assert model.dtype == torch.bfloat16
    embeds = model.encode_prompt(*prompt_ids(model, ["a red circle"]))
    latents = torch.randn(1, *model.latent_shape(RES, RES, FRAMES))
    with torch.no_grad():
        assert model.velocity(latents, torch.full((1,), 0.5), embeds).dtype == torch.float32
    assert model.decode(latents).dtype == torch.float32


def test_rollout_replays_exactly_and_a_lora_update_moves_the_model(folder):
    model = load_flow_model(folder)  # its own copy: LoRA changes it
    out, sampling = rollout(model, steps=STEPS, prompts=PROMPTS[:2], height=RES, width=RES, num_frames=FRAMES)

    # 1. The contract's shapes: videos [bsz, T, C, H, W], latents [bsz, W+1, C, F, h, w].
    shape = model.latent_shape(RES, RES, FRAMES)
    expected = {"responses": (4, FRAMES, 3, RES, RES), "all_latents": (4, 2, *shape), "rollout_log_probs": (4, 1),
                "all_timesteps": (4, 1), "prompt_embeds": (4, 512, TEXT_DIM), "prompt_embeds_mask": (4, 512)}
    assert {k: tuple(out[k].shape) for k in expected} == expected
    assert out["all_latents"].dtype == torch.float32 and torch.isfinite(out["rollout_log_probs"]).all()
    assert 0 <= float(out["responses"].min()) and float(out["responses"].max()) <= 1

    # 2. One LoRA update replays the rollout exactly, then moves the velocity, adapters only.
    check_lora_update(model, out, sampling, LORA_TARGETS)


def test_bad_inputs_name_what_is_wrong(model, folder, tmp_path):
    engine = RolloutEngine(model)
    request = RolloutRequest("r0", encode_chat(model.tokenizer, [{"role": "user", "content": "a red circle"}]),
                             SamplingParams(height=RES, width=RES, num_frames=6, num_inference_steps=STEPS))
    with pytest.raises(ValueError, match=r"num_frames=6 must be 4k\+1"):
        engine.validate(request)
    with pytest.raises(ValueError, match="num_frames: Wan makes videos"):
        model.latent_shape(RES, RES)
    with pytest.raises(ValueError, match="width=40 must be a positive multiple of 16"):
        model.latent_shape(32, 40, FRAMES)

    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "text_encoder" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"text_encoder has no weights file"):
        load_flow_model(broken)
    shutil.rmtree(broken)

    two_experts = shutil.copytree(folder, tmp_path / "a14b")
    index = json.loads((two_experts / "model_index.json").read_text())
    index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (two_experts / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="second transformer"):
        load_flow_model(two_experts)
