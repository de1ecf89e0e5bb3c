"""`SD3FlowModel` on a tiny random StableDiffusion3Pipeline folder, loaded through the real path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flowloop.config.train import ActorConfig
from flowloop.models import load_flow_model
from flowloop.models.sd3 import LORA_TARGETS, SD3FlowModel
from flowloop.rollout.types import SamplingParams
from flowloop.trainer.actor import Actor
from tests.models.tiny_diffusers import PROMPTS, build_sd3, check_lora_update, prompt_ids, rollout, unadapted_targets

T5_TOKENS = 16  # the max_sequence_length option: prompt embeddings are 77 CLIP + 16 T5 tokens


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return build_sd3(tmp_path_factory.mktemp("sd3") / "model")


@pytest.fixture
def model(sd3_dir):
    return load_flow_model(sd3_dir, max_sequence_length=T5_TOKENS)


def test_embeddings_are_the_pipelines(model, sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    with torch.no_grad():
        expected, negative, pooled, negative_pooled = pipe.encode_prompt(
            PROMPTS, None, None, do_classifier_free_guidance=True, max_sequence_length=T5_TOKENS)
    ours = model.encode_prompt(*prompt_ids(model, PROMPTS))
    empty = model.encode_prompt(*prompt_ids(model, ["", ""]))  # the engine's unconditional prompt
    assert isinstance(model, SD3FlowModel) and model.max_sequence_length == 77 + T5_TOKENS
    assert ours["prompt_embeds"].shape == (2, 77 + T5_TOKENS, 32) and ours["pooled_prompt_embeds"].shape == (2, 32)
    torch.testing.assert_close(ours["prompt_embeds"], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled, rtol=0, atol=1e-5)
    torch.testing.assert_close(empty["prompt_embeds"], negative, rtol=0, atol=1e-5)
    torch.testing.assert_close(empty["pooled_prompt_embeds"], negative_pooled, rtol=0, atol=1e-5)
    # The mask: all 77 CLIP positions, then the T5 prompt tokens ("a red cat</s>": 4).
    assert ours["prompt_embeds_mask"][0].tolist() == [1] * 81 + [0] * (T5_TOKENS - 4)


def test_rollout_replay_and_a_lora_update(model):
    model.trainable_module().enable_gradient_checkpointing()  # the recipe's model.gradient_checkpointing
    batch, sampling = rollout(model, guidance_scale=4.5, shift=3.0)

    # 1. The contract's shapes, with CFG's negative (empty-prompt) conditioning recorded too.
    length, w = 77 + T5_TOKENS, 1  # 2 steps: the SDE on every step but the last
    expected = {
        "responses": (4, 3, 32, 32), "all_latents": (4, w + 1, 4, 16, 16), "rollout_log_probs": (4, w),
        "all_timesteps": (4, w), "prompts": (4, length), "prompt_embeds": (4, length, 32),
        "prompt_embeds_mask": (4, length), "pooled_prompt_embeds": (4, 32), "negative_prompt_embeds": (4, length, 32),
        "negative_pooled_prompt_embeds": (4, 32),
    }
    assert {k: tuple(batch[k].shape) for k in expected} == expected
    assert batch["responses"].dtype == torch.float32 and 0 <= batch["responses"].min() <= batch["responses"].max() <= 1
    assert torch.isfinite(batch["rollout_log_probs"]).all()

    # 2. One LoRA update replays the rollout exactly, then moves the model's output, adapters only.
    check_lora_update(model, batch, sampling, LORA_TARGETS)
    assert unadapted_targets(model.transformer, LORA_TARGETS) == []  # every published target exists in SD3.5
    assert not any(p.requires_grad for p in model.t5_encoder.parameters())


def test_bad_resolution_and_too_long_prompt_are_errors(model):
    assert model.latent_shape(32, 48) == (4, 16, 24)
    with pytest.raises(ValueError, match="height=30 must be a positive multiple of 4"):
        model.latent_shape(30, 32)
    with pytest.raises(ValueError, match="width=34"):
        model.latent_shape(32, 34)
    with pytest.raises(ValueError, match="num_frames"):
        model.latent_shape(32, 32, num_frames=5)
    ids, mask = prompt_ids(model, ["a red cat on the mat with the dog and a cat"])  # 20 T5 tokens > 16
    with pytest.raises(ValueError, match="more than max_sequence_length=16"):
        model.encode_prompt(ids, mask)


@pytest.mark.parametrize("component, file, message", [
    ("text_encoder_3", "model.safetensors", "text_encoder_3 has no weights file"),
    ("vae", "config.json", "vae/config.json is missing"),
    ("tokenizer_2", "tokenizer.json", "tokenizer_2/tokenizer.json is missing"),
])
def test_a_missing_component_file_is_named(sd3_dir, tmp_path, component, file, message):
    broken = shutil.copytree(sd3_dir, tmp_path / "broken")
    (broken / component / file).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        load_flow_model(broken)


def test_a_lora_target_matching_nothing_is_an_error(model):
    config = ActorConfig(finetune="lora", lora_target_modules=["qkv"])
    with pytest.raises(ValueError, match=r"match no linear layer of SD3Transformer2DModel; its linear layers end in \[.*'to_q'"):
        Actor(model, config, SamplingParams())


def test_an_unsupported_pipeline_lists_the_supported_ones(sd3_dir, tmp_path):
    other = shutil.copytree(sd3_dir, tmp_path / "sdxl")
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError, match=r"'StableDiffusionXLPipeline'; supported: \[.*'FluxPipeline'.*'StableDiffusion3Pipeline'"):
        load_flow_model(other)


def test_cpu_shards_give_the_unsliced_samples(model):
    """A diffusers transformer shared by two shard threads: each row's sample is the unsliced one."""
    from flowloop.models.prompt_ids import encode_chat
    from flowloop.rollout import RolloutEngine, RolloutRequest
    from tests.rollout.helpers import assert_same_samples

    ids = [encode_chat(model.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    requests = [RolloutRequest(f"r{k}", ids[k % 2], SamplingParams(height=32, width=32, num_inference_steps=2,
                                                                   guidance_scale=4.5, seed=k)) for k in range(16)]
    whole = RolloutEngine(model, cpu_shards=1).sample(requests)
    sliced = RolloutEngine(model, cpu_shards=2).sample(requests)
    assert sliced[0].metrics["cpu_shards"] == 2.0
    for a, b in zip(whole, sliced):  # diffusers' VAE convolutions: a few 1e-7 apart at batch 8 vs 16 on an AMD EPYC
        assert_same_samples(a, b, pixel_atol=2e-6)
