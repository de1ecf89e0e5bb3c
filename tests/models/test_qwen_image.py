"""Qwen-Image adapter on a tiny random pipeline folder, through the real loading, rollout and update paths."""

from __future__ import annotations

import shutil

import pytest
import torch

from flowloop.config.train import ActorConfig
from flowloop.models import load_flow_model
from flowloop.models.qwen_image import LORA_TARGETS, QwenImageFlowModel
from flowloop.trainer.actor import Actor
from tests.models.tiny_diffusers import check_lora_update, prompt_ids, rollout
from tests.models.tiny_diffusers_video import LATENT_CHANNELS, PROMPTS, TEXT_DIM, save_qwen_image

RES = 32  # 4 x 4 latents, 2 x 2 packed tokens
STEPS = 2  # SDE on the first step, ODE on the last: W = 1 log-prob per row


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_qwen_image(tmp_path_factory.mktemp("qwen") / "qwen-image")


@pytest.fixture(scope="module")
def model(folder):
    return load_flow_model(folder)


def _rollout(model, guidance_scale=1.0, negative_prompt=None, n=2):
    return rollout(model, steps=STEPS, n=n, prompts=PROMPTS[:2], negative_prompt=negative_prompt,
                   height=RES, width=RES, guidance_scale=guidance_scale)


def test_loads_frozen_encoders_and_the_pipelines_prompt_template(model):
    assert isinstance(model, QwenImageFlowModel)
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "a red circle"}], tokenize=False)
    assert text == ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
                    "a red circle<|im_end|>\n<|im_start|>assistant\n")
    assert model.max_sequence_length == 1024 and model.latent_shape(64, 32) == (LATENT_CHANNELS, 8, 4)
    assert not any(p.requires_grad for p in [*model.text_encoder.parameters(), *model.vae.parameters()])
    assert model.trainable_module() is model.transformer


def test_embeddings_and_velocity_match_the_diffusers_pipeline(model, folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    prompts = ["a red circle", "two blue squares on a green mat"]  # different lengths: the mask matters
    with torch.no_grad():
        expected, expected_mask = pipe.encode_prompt(prompts, device="cpu")  # drops the template's 34 tokens
        embeds = model.encode_prompt(*prompt_ids(model, prompts))
        assert len(model.template_prefix_ids) == pipe.prompt_template_encode_start_idx == 34  # the tiny BPE agrees
        assert torch.equal(embeds["prompt_embeds"], expected) and torch.equal(embeds["prompt_embeds_mask"], expected_mask)

        latents = torch.randn(2, *model.latent_shape(RES, RES), generator=torch.Generator().manual_seed(0))
        packed = pipe._pack_latents(latents, 2, LATENT_CHANNELS, RES // 8, RES // 8)
        out = pipe.transformer(hidden_states=packed, timestep=torch.full((2,), 700.0) / 1000, encoder_hidden_states=expected,
                               encoder_hidden_states_mask=expected_mask, img_shapes=[[(1, 2, 2)]] * 2, return_dict=False)[0]
        expected_v = pipe._unpack_latents(out, RES, RES, 8)[:, :, 0]
        assert torch.allclose(model.velocity(latents, torch.full((2,), 0.7), embeds), expected_v, atol=1e-6)


def test_combine_guidance_is_the_pipelines_true_cfg(model):
    from diffusers import QwenImagePipeline

    def pack(v):  # [2, C, 4, 4] -> the pipeline's tokens [2, 4, 4C]
        return QwenImagePipeline._pack_latents(v, 2, LATENT_CHANNELS, RES // 8, RES // 8)

    v_cond, v_neg = torch.randn(2, 2, *model.latent_shape(RES, RES), generator=torch.Generator().manual_seed(2))
    comb = pack(v_neg) + 4.0 * (pack(v_cond) - pack(v_neg))  # pipeline_qwenimage.py with true_cfg_scale=4
    expected = comb * (pack(v_cond).norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
    assert torch.allclose(pack(model.combine_guidance(v_cond, v_neg, 4.0)), expected, atol=1e-6)


def test_engine_guides_with_the_models_rule(model):
    from flowloop.rollout.engine import guided_velocity

    ids, mask = prompt_ids(model, ["a red circle", " "])
    embeds = model.encode_prompt(ids, mask)
    x = torch.randn(1, *model.latent_shape(RES, RES), generator=torch.Generator().manual_seed(3))
    sigma = torch.full((1,), 0.6)
    cond = {k: v[:1] for k, v in embeds.items()}
    both = {**cond, **{"negative_" + k: v[1:] for k, v in embeds.items()}}
    v_cond, v_neg = model.velocity(x, sigma, cond), model.velocity(x, sigma, {k: v[1:] for k, v in embeds.items()})
    expected = model.combine_guidance(v_cond, v_neg, 4.0)
    assert torch.allclose(guided_velocity(model, x, sigma, both, 4.0), expected, atol=1e-5)
    assert not torch.allclose(expected, v_neg + 4.0 * (v_cond - v_neg), atol=1e-3)  # the rescale matters


def test_a_row_gets_one_velocity_whatever_prompts_share_its_batch(model):
    """CFG sends [cond; negative] rows of different prompt lengths through one call, under the mask."""
    with torch.no_grad():
        embeds = model.encode_prompt(*prompt_ids(model, ["a red circle", "two blue squares on a green mat", " "]))
        x = torch.randn(3, *model.latent_shape(RES, RES), generator=torch.Generator().manual_seed(1))
        together = model.velocity(x, torch.full((3,), 0.5), embeds)
        for i in range(3):
            alone = model.velocity(x[i:i + 1], torch.full((1,), 0.5), {k: v[i:i + 1] for k, v in embeds.items()})
            assert torch.allclose(alone, together[i:i + 1], atol=1e-5)


def _text_lengths_seen(model, prompts, multiple):
    """The text length each prompt reaches the transformer with, and its velocity, at ``multiple``."""
    lengths = []
    hook = model.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["encoder_hidden_states"].shape[1]), with_kwargs=True)
    model.text_length_multiple = multiple
    x = torch.randn(1, *model.latent_shape(RES, RES), generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad():
            velocities = [model.velocity(x, torch.full((1,), 0.5), model.encode_prompt(*prompt_ids(model, [p])))
                          for p in prompts]
    finally:
        hook.remove()
        model.text_length_multiple = 1
    return lengths, velocities


def test_text_padded_to_a_length_multiple_gives_one_shape_and_the_same_velocity(model):
    """Compiled blocks see one text shape for prompts of different lengths, at the velocity of the exact length."""
    from flowloop.models.compiled import TEXT_LENGTH_MULTIPLE

    prompts = ["a red circle", "two blue squares on a green mat"]
    exact, exact_v = _text_lengths_seen(model, prompts, 1)
    padded, padded_v = _text_lengths_seen(model, prompts, TEXT_LENGTH_MULTIPLE)
    assert exact[0] < exact[1] < TEXT_LENGTH_MULTIPLE and padded == [TEXT_LENGTH_MULTIPLE] * 2
    for a, b in zip(exact_v, padded_v):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_take_and_give_float32(folder):
    model = load_flow_model(folder, dtype="bfloat16")
    embeds = model.encode_prompt(*prompt_ids(model, ["a red circle"]))
    assert embeds["prompt_embeds"].dtype == torch.bfloat16
    latents = torch.randn(1, *model.latent_shape(RES, RES))
    with torch.no_grad():
        assert model.velocity(latents, torch.full((1,), 0.5), embeds).dtype == torch.float32
    assert model.decode(latents).dtype == torch.float32


def test_rollout_replays_exactly_and_a_lora_update_moves_the_model(folder):
    model = load_flow_model(folder)  # its own copy: LoRA changes it
    out, sampling = _rollout(model)

    # 1. The contract's shapes (4 rows, W = 1 SDE step).
    length = model.max_sequence_length
    shape = model.latent_shape(RES, RES)
    expected = {"responses": (4, 3, RES, RES), "all_latents": (4, 2, *shape), "rollout_log_probs": (4, 1),
                "all_timesteps": (4, 1), "prompts": (4, length), "prompt_embeds": (4, length, TEXT_DIM),
                "prompt_embeds_mask": (4, length)}
    assert {k: tuple(out[k].shape) for k in expected} == expected
    assert out["all_latents"].dtype == torch.float32 and torch.isfinite(out["rollout_log_probs"]).all()
    assert 0 <= float(out["responses"].min()) and float(out["responses"].max()) <= 1

    # 2. One LoRA update replays the rollout exactly, then moves the velocity, adapters only.
    check_lora_update(model, out, sampling, LORA_TARGETS)


def test_true_cfg_with_a_negative_prompt(model):
    out, sampling = _rollout(model, guidance_scale=4.0, negative_prompt=" ", n=1)
    neg_mask, mask = out["negative_prompt_embeds_mask"], out["prompt_embeds_mask"]
    assert out["negative_prompt_embeds"].shape == out["prompt_embeds"].shape
    assert (neg_mask.sum(1) < mask.sum(1)).all()  # " " is shorter than every prompt: rows differ under the mask
    # The replay (the actor's guided_velocity on [cond; negative]) reproduces the recorded log-prob.
    actor = Actor(model, ActorConfig(micro_batch_size=2, mini_batch_size=2), sampling)
    rows = {k: out[k] for k in out.keys() if k.startswith(("all_", "prompt_embeds", "negative_prompt_embeds"))}
    with torch.no_grad():
        assert torch.allclose(actor.objective.replay(actor, rows, 0).log_prob, out["rollout_log_probs"][:, 0], atol=1e-5, rtol=0)
    plain, _ = _rollout(model, n=1)
    assert not torch.allclose(plain["responses"], out["responses"])  # same seeds, guidance changed the images


def test_bad_inputs_name_what_is_wrong(model, folder, tmp_path):
    with pytest.raises(ValueError, match="height=40 must be a positive multiple of 16"):
        model.latent_shape(40, 32)
    with pytest.raises(ValueError, match="num_frames=5: Qwen-Image makes images"):
        model.latent_shape(32, 32, 5)
    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "vae" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"vae/config.json is missing"):
        load_flow_model(broken)
    ids, mask = prompt_ids(model, ["a red circle"])
    with pytest.raises(ValueError, match="prompt template"):
        model.encode_prompt(ids[:, 5:], mask[:, 5:])  # ids that skipped the template
