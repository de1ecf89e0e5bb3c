"""Tiny random diffusers pipeline folders (SD3, FLUX), built offline, in the real layouts.

Every component is a real diffusers / transformers class at a toy size, saved with
``save_pretrained``; tokenizers are built locally with character vocabularies (any lowercase
prompt tokenizes) and saved so ``AutoTokenizer.from_pretrained`` loads them. The folders load
through `flowloop.models.load_flow_model` exactly as a downloaded checkpoint would, and through
diffusers' own pipelines, which the tests use as the reference.

The helpers (`save_t5_tokenizer`, `save_clip_tokenizer`, `tiny_t5`, `tiny_vae`, `save_component`,
`write_model_index`) are meant for other families' builders too.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

CHARS = string.ascii_lowercase + string.digits + ",.!?'-"
SEED = 0


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------


def save_t5_tokenizer(folder: Path, words: tuple[str, ...] = ("cat", "red", "dog", "a", "on", "the")):
    """A T5 (Unigram) tokenizer: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, single characters, a few whole words."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in CHARS + string.ascii_uppercase] + [("▁" + c, -3.0) for c in CHARS + string.ascii_uppercase]
    pieces += [("▁" + w, -1.0) for w in words]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def save_clip_tokenizer(folder: Path):
    """A CLIP (byte-level BPE) tokenizer over single characters; 77 tokens, as the real ones."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------


def tiny_clip(vocab_size: int, hidden: int, projection: int | None):
    """CLIP text model (``CLIPTextModelWithProjection`` when ``projection`` is set), 2 layers."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=projection or hidden,
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu",
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def tiny_t5(vocab_size: int, d_model: int = 32):
    """T5 encoder, 2 layers of 2 heads."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def tiny_vae(scaling_factor: float, shift_factor: float, latent_channels: int = 4):
    """AutoencoderKL with two blocks (scale factor 2), no quant convs (as SD3's and FLUX's)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=32, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def save_component(module, root: Path, name: str) -> None:
    """``module.save_pretrained(root / name)`` (config.json + safetensors)."""
    module.save_pretrained(str(root / name))


def write_model_index(root: Path, class_name: str, components: dict[str, tuple[str | None, str | None]]) -> None:
    """``model_index.json`` as diffusers writes it: ``_class_name`` and ``name: [library, class]``."""
    from diffusers import __version__

    index = {"_class_name": class_name, "_diffusers_version": __version__, **{k: list(v) for k, v in components.items()}}
    (root / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _scheduler(root: Path, **config) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(**config).save_pretrained(str(root / "scheduler"))


# ---------------------------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------------------------


def build_sd3(root: Path) -> Path:
    """A ``StableDiffusion3Pipeline`` folder: MMDiT of 2 layers (one with SD3.5's dual attention), CLIP-L/G
    of width 16 (pooled projections 16 + 16), T5 of width 32, a 2-block VAE; 32x32 images -> 16x16x4 latents."""
    from diffusers import SD3Transformer2DModel

    root = Path(root)
    torch.manual_seed(SEED)
    clip_tokenizer = save_clip_tokenizer(root / "tokenizer")
    save_clip_tokenizer(root / "tokenizer_2")
    t5_tokenizer = save_t5_tokenizer(root / "tokenizer_3")
    save_component(tiny_clip(len(clip_tokenizer), hidden=16, projection=16), root, "text_encoder")
    save_component(tiny_clip(len(clip_tokenizer), hidden=16, projection=16), root, "text_encoder_2")
    save_component(tiny_t5(len(t5_tokenizer), d_model=32), root, "text_encoder_3")
    save_component(tiny_vae(scaling_factor=1.5305, shift_factor=0.0609), root, "vae")
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    save_component(transformer, root, "transformer")
    _scheduler(root, shift=3.0)
    write_model_index(root, "StableDiffusion3Pipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModelWithProjection"),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
        "text_encoder_3": ("transformers", "T5EncoderModel"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "tokenizer_2": ("transformers", "CLIPTokenizer"),
        "tokenizer_3": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "SD3Transformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
        "image_encoder": (None, None),
        "feature_extractor": (None, None),
    })
    return root


def build_flux(root: Path, guidance_embeds: bool = True) -> Path:
    """A ``FluxPipeline`` folder (FLUX.1-dev style with ``guidance_embeds``): 1 double + 1 single block,
    2 heads of 16, CLIP-L of width 16, T5 of width 32, a 2-block VAE with 4 latent channels
    (packed: 16); 32x32 images -> packed latents 16x8x8."""
    from diffusers import FluxTransformer2DModel

    root = Path(root)
    torch.manual_seed(SEED)
    clip_tokenizer = save_clip_tokenizer(root / "tokenizer")
    t5_tokenizer = save_t5_tokenizer(root / "tokenizer_2")
    save_component(tiny_clip(len(clip_tokenizer), hidden=16, projection=None), root, "text_encoder")
    save_component(tiny_t5(len(t5_tokenizer), d_model=32), root, "text_encoder_2")
    save_component(tiny_vae(scaling_factor=0.3611, shift_factor=0.1159), root, "vae")
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8),
    )
    save_component(transformer, root, "transformer")
    _scheduler(root, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    write_model_index(root, "FluxPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModel"),
        "text_encoder_2": ("transformers", "T5EncoderModel"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "tokenizer_2": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "FluxTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
        "image_encoder": (None, None),
        "feature_extractor": (None, None),
    })
    return root


# ---------------------------------------------------------------------------------------------
# Driving a loaded model the way training does
# ---------------------------------------------------------------------------------------------

PROMPTS = ["a red cat", "the dog on a mat"]


def prompt_ids(model, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as the agent loop tokenizes them and the engine pads them: ids and mask ``[B, L]``."""
    from flowloop.models.prompt_ids import encode_chat
    from flowloop.rollout.engine import _pad

    rows = [_pad(encode_chat(model.tokenizer, [{"role": "user", "content": p}]), model) for p in prompts]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def rollout(model, steps: int = 2, n: int = 2, prompts: list[str] = PROMPTS, negative_prompt: str | None = None,
            **pipeline):
    """``len(prompts) * n`` rows through `AgentLoopManager` (local mode, no reward), 32x32 pixels unless
    ``pipeline`` says otherwise, with log-probs; returns ``(batch, SamplingParams)`` the actor must replay with."""
    from flowloop.agent_loop import AgentLoopManager
    from flowloop.config.rollout import PipelineConfig, RewardConfig, RolloutConfig, ValKwargs
    from flowloop.protocol import Batch
    from flowloop.rollout.types import SamplingParams

    pipeline = {"height": 32, "width": 32, **pipeline}
    config = RolloutConfig(
        pipeline=PipelineConfig(num_inference_steps=steps, **pipeline),
        val_kwargs=ValKwargs(pipeline={"num_inference_steps": steps}), reward=RewardConfig(name=None),
    )
    columns = {"raw_prompt": list(prompts), "uid": [f"p{i}" for i in range(len(prompts))]}
    if negative_prompt is not None:
        columns["negative_prompt"] = [negative_prompt] * len(prompts)
    manager = AgentLoopManager.create(config, model)
    try:
        batch = manager.generate_sequences(Batch.from_dict(non_tensors=columns, meta_info={"global_steps": 1}).repeat(n))
    finally:
        manager.shutdown()
    return batch, SamplingParams.from_dict(config.sampling_dict(validate=False))


def check_lora_update(model, batch, sampling, targets: list[str]) -> None:
    """One LoRA update after ``rollout``: it replays the recorded log-probs exactly (weights still those
    of the rollout), has a gradient, moves the model's velocity and leaves the base weights untouched."""
    from flowloop.models.base import is_embedding_key

    x, sigma = batch["all_latents"][:, 0], batch["all_timesteps"][:, 0]
    embeds = {k: batch[k] for k in batch.keys() if is_embedding_key(k) and not k.startswith("negative_")}
    with torch.no_grad():
        before = model.velocity(x, sigma, embeds)
    base = base_weights(model.transformer)
    metrics = lora_update(model, batch, sampling, targets)
    assert metrics["rollout_correction/max"] <= 1e-5
    assert metrics["actor/grad_norm"] > 0
    with torch.no_grad():
        after = model.velocity(x, sigma, embeds)
    assert (after - before).abs().max() > 1e-6
    now = base_weights(model.transformer)
    assert now.keys() == base.keys() and all(torch.equal(now[k], base[k]) for k in base)


def lora_update(model, batch, sampling, targets: list[str], rank: int = 4) -> dict[str, float]:
    """One FlowGRPO update with LoRA on ``targets`` (KL to the adapters-off base included)."""
    from flowloop.config.actor import ActorConfig
    from flowloop.trainer.actor import Actor

    config = ActorConfig(finetune="lora", lora_rank=rank, lora_alpha=2 * rank, lora_target_modules=list(targets),
                         lr=1e-2, micro_batch_size=len(batch), mini_batch_size=len(batch), kl_coef=0.04)
    actor = Actor(model, config, sampling)
    advantages = torch.tensor([1.0, -1.0] * (len(batch) // 2))  # [B]: a real signal, no reward model needed
    return actor.update(batch, advantages, torch.Generator().manual_seed(0))


def base_weights(module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s non-LoRA weights, named as before peft wrapped any layer."""
    return {name.replace(".base_layer", ""): p.detach().clone() for name, p in module.named_parameters() if "lora_" not in name}


def unadapted_targets(module, targets: list[str]) -> list[str]:
    """The ``targets`` no trainable LoRA layer of ``module`` ends with (a target list should have none)."""
    names = {name.split(".lora_")[0] for name, p in module.named_parameters() if "lora_" in name and p.requires_grad}
    return [t for t in targets if not any(name.endswith("." + t) for name in names)]
