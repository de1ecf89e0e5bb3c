"""Real-size FlowGRPO figures for SD3.5-Medium, FLUX.1-dev, Qwen-Image and Wan2.1-T2V-1.3B, random weights.

    python benchmarks/real_models.py --out results.json --budget-s 420    # one H200: about 4-6 minutes
    python benchmarks/real_models.py --tiny                               # the tests' tiny configs, CPU, ~20 s
    python benchmarks/real_models.py --shallow                            # real widths, 1 layer each, CPU, ~6 min
    python benchmarks/real_models.py --meta-only                          # real-size parameter counts only

Each family's published architecture (the configs below, in diffusers / transformers keywords) is
built directly on the device, in bf16, from random weights, with small local tokenizers (the
tests' builders; ids far inside the real vocabularies), and wrapped in its flowloop adapter in
memory: nothing is downloaded or written to disk. Then, with the settings of the family's recipe
(``flowloop/config/recipes/<family>.yaml``: CFG, shift, noise level, LoRA rank / alpha / targets, KL,
prompt length) at ``--resolution`` and ``--steps``:

1. rollout: ``n`` samples (4 images, 2 videos) in one `RolloutEngine` batch, SDE sampler with
   log-probs, an SDE window of ``--sde-window`` steps (Qwen-Image: its recipe's 2 in [0, 5));
   Qwen-Image runs true CFG with the negative prompt " ". Timed after a warm-up call of one ODE
   step on the same batch (text encoders, denoiser and VAE all run once before the clock starts);
2. one `Actor.update`: LoRA (added before the rollout, as in training), gradient checkpointing,
   micro-batches of 2 rows (Wan: 1), one optimizer step. Not warmed up: its time includes the
   first backward's one-off costs;
3. peak GPU memory (reset per family) and parameter counts.

It prints every real-size component's parameter count first (built on the meta device: no memory,
a few seconds), a settings line as each family starts and its figures as it ends, then a table:

    family      transformer   total build_s rollout_s samples/s update_s corr_mean  corr_max grad_norm    v_rms peak_GiB
    sd3               2.24B   7.91B     ...

``corr_mean`` / ``corr_max``: the update's ``rollout_correction/mean`` and ``/max``, |replay - rollout|
log-prob at its first micro-batch (bf16 kernels can differ between the rollout's batch of n rows
and the replay's micro-batch). ``v_rms``: RMS of one predicted velocity; random weights are not a
trained model, and the gap scales with the velocity's size, so read the two together.
``--out`` gets every figure as JSON, rewritten after each family, so a run stopped by a time limit
keeps what finished. A family that fails prints its traceback and the others still run;
``--budget-s`` skips the families not started within that many seconds of the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

START = time.monotonic()  # --budget-s counts from here, imports included

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # flowloop and the tests' tokenizer builders, from a plain checkout

FAMILIES = ("sd3", "flux", "qwen_image", "wan")
PROMPTS = ["a red cat sitting on a wooden table", "two dogs playing in the snow at night"]
NEGATIVE_PROMPT = " "  # Qwen-Image's recommended negative prompt (true CFG)

# ---------------------------------------------------------------------------------------------
# Published configs (diffusers / transformers constructor keywords)
# ---------------------------------------------------------------------------------------------

CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
              num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              layer_norm_epsilon=1e-6, dropout_rate=0.1)
UMT5_XXL = {**T5_XXL, "vocab_size": 256384}
SD_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
              latent_channels=16, norm_num_groups=32, sample_size=1024, use_quant_conv=False, use_post_quant_conv=False)
WAN_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                   3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916]
WAN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True], latents_mean=WAN_LATENTS_MEAN, latents_std=WAN_LATENTS_STD)

REAL = {
    "sd3": {  # stabilityai/stable-diffusion-3.5-medium
        "transformer": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                            attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                            caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        "vae": {**SD_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        "text_encoder": CLIP_L, "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL,
    },
    "flux": {  # black-forest-labs/FLUX.1-dev
        "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        "vae": {**SD_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "text_encoder": CLIP_L, "text_encoder_2": T5_XXL,
    },
    "qwen_image": {  # Qwen/Qwen-Image; text encoder Qwen2.5-VL-7B-Instruct
        "transformer": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                            axes_dims_rope=(16, 56, 56)),
        "vae": WAN_VAE,
        "text_encoder": dict(
            text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                             rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                                     mrope_section=[16, 24, 24])),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
            tie_word_embeddings=False),
    },
    "wan": {  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers
        "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                            out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        "vae": WAN_VAE,
        "text_encoder": UMT5_XXL,
    },
}
"""Every component of each pipeline, as its published ``config.json`` (keys the classes take)."""

TINY_VOCAB = 512  # above every local tokenizer's size
TINY_CLIP = dict(vocab_size=TINY_VOCAB, hidden_size=16, intermediate_size=32, projection_dim=16, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=77, hidden_act="gelu")
TINY_T5 = dict(vocab_size=TINY_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
               relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu")
TINY_SD_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                   up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                   latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False,
                   use_post_quant_conv=False)
TINY_WAN_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                    temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                    latents_std=[1.5, 2.0, 0.5, 1.0])
TINY = {
    "sd3": {
        "transformer": dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                            pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32, dual_attention_layers=(0,),
                            qk_norm="rms_norm"),
        "vae": {**TINY_SD_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        "text_encoder": TINY_CLIP, "text_encoder_2": TINY_CLIP, "text_encoder_3": TINY_T5,
    },
    "flux": {
        "transformer": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                            guidance_embeds=True, axes_dims_rope=(4, 4, 8)),
        "vae": {**TINY_SD_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "text_encoder": {**TINY_CLIP, "projection_dim": None}, "text_encoder_2": TINY_T5,
    },
    "qwen_image": {
        "transformer": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        "vae": TINY_WAN_VAE,
        "text_encoder": dict(
            text_config=dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                             bos_token_id=None, eos_token_id=None,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               fullatt_block_indexes=[0])),
    },
    "wan": {
        "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                            out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1),
        "vae": TINY_WAN_VAE,
        "text_encoder": {**TINY_T5, "num_layers": 1, "num_heads": 4, "relative_attention_max_distance": 16},
    },
}
"""The tests' tiny pipelines (tests/models/tiny_diffusers*.py), same keys as `REAL`."""

COMPONENTS = {
    "sd3": {"transformer": "SD3Transformer2DModel", "vae": "AutoencoderKL",
            "text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
            "text_encoder_3": "T5EncoderModel"},
    "flux": {"transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL", "text_encoder": "CLIPTextModel",
             "text_encoder_2": "T5EncoderModel"},
    "qwen_image": {"transformer": "QwenImageTransformer2DModel", "vae": "AutoencoderKLQwenImage",
                   "text_encoder": "Qwen2_5_VLForConditionalGeneration"},
    "wan": {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan", "text_encoder": "UMT5EncoderModel"},
}
"""Component -> class, as each pipeline's ``model_index.json`` names them."""
CONFIG_CLASSES = {"CLIPTextModelWithProjection": "CLIPTextConfig", "CLIPTextModel": "CLIPTextConfig",
                  "T5EncoderModel": "T5Config", "UMT5EncoderModel": "UMT5Config",
                  "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLConfig"}
"""transformers classes take a config object; diffusers classes take the keywords themselves."""

SHALLOW = {"num_layers": 1, "num_single_layers": 1, "num_hidden_layers": 1, "depth": 1,
           "dual_attention_layers": (0,), "fullatt_block_indexes": [0]}
"""``--shallow``: every stack cut to one layer, every width real: a CPU check that the real components fit together."""


def shallow(config):
    """``config`` (nested dicts) with the `SHALLOW` depths."""
    if not isinstance(config, dict):
        return config
    return {key: SHALLOW[key] if key in SHALLOW else shallow(value) for key, value in config.items()}


RUN = {"sd3": dict(n=4, micro_batch=2), "flux": dict(n=4, micro_batch=2), "qwen_image": dict(n=4, micro_batch=2),
       "wan": dict(n=2, micro_batch=1)}
"""Samples per rollout and rows per update micro-batch (one optimizer step over the ``n`` rows)."""


# ---------------------------------------------------------------------------------------------
# 1. Build: components on the device, then the adapter around them
# ---------------------------------------------------------------------------------------------


@contextmanager
def default_device_and_dtype(device: str | torch.device, dtype: torch.dtype):
    """Create tensors on ``device`` in ``dtype``: a 20B model is built in place, not in fp32 on the CPU."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_component(class_name: str, config: dict, device, dtype: torch.dtype) -> torch.nn.Module:
    """One component with random weights, its tensors in the dtypes ``from_pretrained(torch_dtype=dtype)`` gives."""
    import diffusers
    import transformers

    with default_device_and_dtype(device, dtype):
        if class_name in CONFIG_CLASSES:
            module = getattr(transformers, class_name)(getattr(transformers, CONFIG_CLASSES[class_name])(**config))
            keep_fp32 = getattr(module, "_keep_in_fp32_modules_strict", None) or []  # transformers: only these in bf16
        else:
            module = getattr(diffusers, class_name)(**config)
            keep_fp32 = getattr(module, "_keep_in_fp32_modules", None) or []  # diffusers: Wan's norms, time embedder
    if str(device) == "meta":
        return module
    saved = set(module.state_dict())  # non-persistent buffers (rotary tables) keep the dtype they were made in
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and name in saved:
            tensor.data = tensor.data.to(torch.float32 if any(k in name.split(".") for k in keep_fp32) else dtype)
    return module.to(device).eval()  # .to: buffers some constructors make on the CPU (from numpy)


def build_tokenizers(family: str) -> dict:
    """Small local tokenizers (the tests' builders) that cover `PROMPTS`; ids far below the real vocabularies."""
    from tests.models.tiny_diffusers import save_clip_tokenizer
    from tests.models.tiny_diffusers_video import qwen_tokenizer, t5_tokenizer

    corpus = [*PROMPTS, NEGATIVE_PROMPT]
    if family == "qwen_image":
        return {"qwen": qwen_tokenizer(corpus)}
    tokenizers = {"t5": t5_tokenizer(corpus)}
    if family in ("sd3", "flux"):
        with tempfile.TemporaryDirectory() as folder:
            tokenizers["clip"] = save_clip_tokenizer(Path(folder))
    return tokenizers


def build_model(family: str, configs: dict, options: dict, device, dtype: torch.dtype):
    """The family's `FlowModel` from components built in memory; ``options``: the recipe's ``model.options``."""
    from flowloop.models.diffusers_common import frozen

    tokenizers = build_tokenizers(family)
    configs = {name: dict(config) for name, config in configs[family].items()}
    for name, config in configs.items():  # CLIP pools at its EOS token: the local tokenizer's ids
        if COMPONENTS[family][name].startswith("CLIP"):
            clip = tokenizers["clip"]
            config.update(bos_token_id=clip.bos_token_id, eos_token_id=clip.eos_token_id,
                          pad_token_id=clip.pad_token_id)
    parts = {name: build_component(COMPONENTS[family][name], config, device, dtype) for name, config in configs.items()}
    for name, part in parts.items():
        if name != "transformer":
            frozen(part)  # text encoders and VAE, as from_pretrained's load_frozen
    check_vocabularies(parts, tokenizers)
    return assemble(family, parts, tokenizers, options)


def assemble(family: str, parts: dict, tokenizers: dict, options: dict):
    """The adapter's constructor on in-memory parts, with the tokenizer its ``from_pretrained`` would set up."""
    from flowloop.models.diffusers_common import ensure_chat_template

    length = options["max_sequence_length"]
    if family == "qwen_image":
        from flowloop.models.qwen_image import PROMPT_TEMPLATE, QwenImageFlowModel

        tokenizer = tokenizers["qwen"]
        tokenizer.chat_template = PROMPT_TEMPLATE  # as load_qwen_tokenizer
        return QwenImageFlowModel(tokenizer, parts["text_encoder"], parts["transformer"], parts["vae"], length)
    tokenizer = ensure_chat_template(tokenizers["t5"], append_eos=True)  # as load_prompt_tokenizer
    tokenizer.model_max_length = length
    if family == "sd3":
        from flowloop.models.sd3 import SD3FlowModel

        return SD3FlowModel(tokenizer, [tokenizers["clip"]] * 2, [parts["text_encoder"], parts["text_encoder_2"]],
                            parts["text_encoder_3"], parts["transformer"], parts["vae"], length)
    if family == "flux":
        from flowloop.models.flux import FluxFlowModel

        return FluxFlowModel(tokenizer, tokenizers["clip"], parts["text_encoder"], parts["text_encoder_2"],
                             parts["transformer"], parts["vae"], float(options["guidance"]), length)
    from flowloop.models.wan import WanFlowModel

    return WanFlowModel(tokenizer, parts["text_encoder"], parts["transformer"], parts["vae"], length)


def check_vocabularies(parts: dict, tokenizers: dict) -> None:
    """Every local tokenizer's ids must be rows of every text encoder's embedding."""
    needed = max(len(t) for t in tokenizers.values())
    for name, part in parts.items():
        if name.startswith("text_encoder") and part.get_input_embeddings().num_embeddings < needed:
            raise ValueError(f"{name} has {part.get_input_embeddings().num_embeddings} embedding rows; "
                             f"the local tokenizers need {needed}")


def parameter_counts(parts: dict[str, torch.nn.Module]) -> dict[str, int]:
    """``{component: parameters}`` plus ``total``."""
    counts = {name: sum(p.numel() for p in part.parameters()) for name, part in parts.items()}
    return {**counts, "total": sum(counts.values())}


def model_parts(model) -> dict[str, torch.nn.Module]:
    """An adapter's modules by pipeline component name."""
    parts = {"transformer": model.transformer, "vae": model.vae}
    if hasattr(model, "text_encoders"):  # SD3
        parts.update(text_encoder=model.text_encoders[0], text_encoder_2=model.text_encoders[1],
                     text_encoder_3=model.t5_encoder)
    elif hasattr(model, "clip_encoder"):  # FLUX
        parts.update(text_encoder=model.clip_encoder, text_encoder_2=model.t5_encoder)
    else:
        parts["text_encoder"] = model.text_encoder
    return parts


def meta_parameter_counts(families) -> dict[str, dict[str, int]]:
    """Real-size components built on the meta device (no memory, seconds): their parameter counts."""
    return {family: parameter_counts({name: build_component(COMPONENTS[family][name], config, "meta", torch.bfloat16)
                                      for name, config in REAL[family].items()})
            for family in families}


# ---------------------------------------------------------------------------------------------
# 2. Settings from the family's recipe
# ---------------------------------------------------------------------------------------------


def load_recipe(family: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ROOT / "flowloop" / "config" / "recipes" / f"{family}.yaml"))


def sampling_params(recipe: dict, args, video: bool):
    """The recipe's pipeline + algo settings at this run's resolution and steps; SDE window of ``args.sde_window``."""
    from flowloop.rollout.types import SamplingParams

    rollout = recipe["rollout"]
    values = {**rollout["pipeline"], **rollout["algo"]}
    height, width = args.video_resolution if video else args.resolution
    values.update(height=height, width=width, num_frames=args.frames if video else None,
                  num_inference_steps=args.steps, logprobs=True)
    if values.get("sde_window_size") is None:  # Flow-GRPO-Fast: a short window in the first half
        values.update(sde_window_size=args.sde_window, sde_window_range=[0, max(args.sde_window, args.steps // 2)])
    params = SamplingParams.from_dict(values)
    params.validate()
    return params


def actor_config(recipe: dict, n: int, micro_batch: int):
    """The recipe's actor settings (LoRA rank, targets, lr, KL, clip), one optimizer step over ``n`` rows."""
    from omegaconf import OmegaConf

    from flowloop.config.actor import ActorConfig

    values = {**recipe["actor"], "micro_batch_size": micro_batch, "mini_batch_size": n}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ActorConfig), values))


# ---------------------------------------------------------------------------------------------
# 3. Rollout and update
# ---------------------------------------------------------------------------------------------


def make_requests(model, params, n: int, negative: bool) -> list:
    """``n`` requests cycling over `PROMPTS`, seeds 0..n-1; the negative prompt for true CFG if asked."""
    from flowloop.agent_loop.base import encode_chat
    from flowloop.rollout.types import RolloutRequest

    def ids(text):
        return encode_chat(model.tokenizer, [{"role": "user", "content": text}])

    negative_ids = ids(NEGATIVE_PROMPT) if negative else None
    return [RolloutRequest(f"r{i}", ids(PROMPTS[i % len(PROMPTS)]), dataclasses.replace(params, seed=i), negative_ids)
            for i in range(n)]


def warm_up(engine, requests) -> float:
    """One ODE step on the same batch (text encoders, denoiser, VAE): first-call costs out of the timing."""
    params = dataclasses.replace(requests[0].sampling_params, sampler="ode", logprobs=False, num_inference_steps=1,
                                 sde_window_size=None, sde_window_range=None)
    start = time.perf_counter()
    engine.sample([dataclasses.replace(r, sampling_params=dataclasses.replace(params, seed=r.sampling_params.seed))
                   for r in requests])
    return time.perf_counter() - start


def rollout(engine, requests, max_sequence_length: int):
    """One batch through the engine; returns the trainer's `Batch` (as the agent-loop worker stacks it) and seconds."""
    from flowloop.models.base import is_sequence_embedding_key
    from flowloop.protocol import Batch, pad_to_length

    start = time.perf_counter()
    outputs = engine.sample(requests)  # results come back on the CPU: the clock includes the device's work
    seconds = time.perf_counter() - start
    tensors = {"rollout_log_probs": torch.stack([o.log_probs for o in outputs])}  # [n, W]
    for key in outputs[0].extra_fields:
        values = [o.extra_fields[key] for o in outputs]
        tensors[key] = (pad_to_length(values, max_sequence_length, 0, "right") if is_sequence_embedding_key(key)
                        else torch.stack(values))  # e.g. all_latents [n, W+1, *latent]
    return Batch.from_dict(tensors), seconds


def velocity_rms(model, batch, device) -> float:
    """RMS of the conditional velocity at the first row's first recorded step (scale of the log-prob gap)."""
    from flowloop.models.base import is_embedding_key

    embeds = {k: batch[k][:1].to(device) for k in batch.keys() if is_embedding_key(k) and not k.startswith("negative_")}
    with torch.no_grad():
        v = model.velocity(batch["all_latents"][:1, 0].to(device), batch["all_timesteps"][:1, 0].to(device), embeds)
    return float(v.float().pow(2).mean().sqrt())


def update(actor, batch, device) -> tuple[dict, float]:
    """One `Actor.update` with advantages +1, -1, ...; returns its metrics and seconds."""
    advantages = torch.tensor([1.0, -1.0] * math.ceil(len(batch) / 2))[: len(batch)]  # [n]
    start = time.perf_counter()
    metrics = actor.update(batch, advantages, torch.Generator().manual_seed(0))
    synchronize(device)
    return metrics, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# 4. One family, end to end
# ---------------------------------------------------------------------------------------------


def run_family(family: str, args, result: dict) -> None:
    """Build, roll out, update: fills ``result`` as it goes, so a failure keeps the figures before it."""
    from flowloop.rollout.engine import RolloutEngine
    from flowloop.trainer.actor import Actor

    device, recipe = args.device, load_recipe(family)
    n = args.samples or RUN[family]["n"]
    # 1. The recipe's settings at this run's size.
    params = sampling_params(recipe, args, video=family == "wan")
    config = actor_config(recipe, n, min(args.micro_batch or RUN[family]["micro_batch"], n))
    result["settings"] = dict(
        n=n, height=params.height, width=params.width, num_frames=params.num_frames, steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale, shift=params.shift, noise_level=params.noise_level,
        sde_window_size=params.sde_window_size, sde_window_range=list(params.window_range()),
        lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, kl_coef=config.kl_coef,
        micro_batch=config.micro_batch_size)
    print(f"== {family}: {result['settings']}", flush=True)
    # 2. Build on the device; LoRA goes on before the rollout, as in training.
    reset_peak(device)
    torch.manual_seed(0)  # the random weights
    start = time.perf_counter()
    configs = TINY if args.tiny else {f: shallow(c) for f, c in REAL.items()} if args.shallow else REAL
    model = build_model(family, configs, recipe["model"].get("options", {}), device, args.dtype)
    synchronize(device)
    result.update(build_s=time.perf_counter() - start, params=parameter_counts(model_parts(model)),
                  weights_gib=allocated_gib(device), max_sequence_length=model.max_sequence_length)
    if not args.no_checkpointing:
        model.trainable_module().enable_gradient_checkpointing()
    start = time.perf_counter()
    with torch.device(device):  # the adapters' weights made where they live, not on the CPU and copied
        actor = Actor(model, config, params)
    result.update(lora_s=time.perf_counter() - start,
                  lora_params=sum(p.numel() for p in model.transformer.parameters() if p.requires_grad))
    # 3. Rollout: a warm-up, then the timed batch.
    engine = RolloutEngine(model)
    requests = make_requests(model, params, n, negative=family == "qwen_image" and params.guidance_scale > 1)
    result["warmup_s"] = warm_up(engine, requests)
    batch, seconds = rollout(engine, requests, model.max_sequence_length)
    result.update(rollout_s=seconds, samples_per_s=n / seconds, rollout_peak_gib=peak_gib(device),
                  log_probs_finite=bool(torch.isfinite(batch["rollout_log_probs"]).all()),
                  velocity_rms=velocity_rms(model, batch, device))
    # 4. One update (gradient checkpointing on unless --no-checkpointing).
    metrics, seconds = update(actor, batch, device)
    result.update(update_s=seconds, rollout_correction_mean=metrics["rollout_correction/mean"],
                  rollout_correction_max=metrics["rollout_correction/max"], grad_norm=metrics["actor/grad_norm"],
                  policy_loss=metrics.get("actor/policy_loss"), peak_gib=peak_gib(device), status="ok")


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocated_gib(device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None


def free_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# 5. Report
# ---------------------------------------------------------------------------------------------

COLUMNS = [("family", "family", "", 11), ("transformer", "params.transformer", "B", 11),
           ("total", "params.total", "B", 7), ("build_s", "build_s", ".1f", 7), ("rollout_s", "rollout_s", ".2f", 9),
           ("samples/s", "samples_per_s", ".3f", 9),
           ("update_s", "update_s", ".2f", 8), ("corr_mean", "rollout_correction_mean", ".2e", 9),
           ("corr_max", "rollout_correction_max", ".2e", 9), ("grad_norm", "grad_norm", ".2e", 9),
           ("v_rms", "velocity_rms", ".2e", 8), ("peak_GiB", "peak_gib", ".1f", 8)]
"""Table columns: header, result key (``a.b`` = nested), format (``B``: a parameter count), width."""
REFERENCE_CORRECTION = 2.2e-5
"""The reference ``rollout_correction/mean`` of a bf16 SD3.5-Medium LoRA run (trained weights)."""


def billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def table_row(result: dict) -> str:
    cells = []
    for _, key, spec, width in COLUMNS:
        value = result
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        text = "-" if value is None else billions(value) if spec == "B" else format(value, spec)
        cells.append(f"{text:<{width}}" if key == "family" else f"{text:>{width}}")
    return " ".join(cells) + ("" if result.get("status") == "ok" else f"  [{result.get('status')}]")


def print_table(results: list[dict]) -> None:
    print("\n" + " ".join(f"{h:<{w}}" if h == "family" else f"{h:>{w}}" for h, _, _, w in COLUMNS))
    for result in results:
        print(table_row(result))
    print(f"corr_mean to match or beat: {REFERENCE_CORRECTION:.1e} (SD3.5-M, LoRA, bf16, trained weights)")


def print_meta_counts(counts: dict) -> None:
    print("Real-size parameter counts (built on the meta device):")
    for family, parts in counts.items():
        print(f"  {family:<11} " + "  ".join(f"{name}={billions(n)}" for name, n in parts.items()))
    sys.stdout.flush()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, run in this order")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="weights' dtype (bfloat16; float32 on a CPU, where this "
                                                      "torch's bf16 matmuls of tiny layers are ~100x slower)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny configs: a CPU check of the script")
    parser.add_argument("--shallow", action="store_true", help="real widths, one layer per stack, 64 px: a CPU "
                                                                "check that the real components fit together")
    parser.add_argument("--meta-only", action="store_true", help="print the real-size parameter counts and stop")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="skip families not started by then")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resolution", type=int, default=None, help="image side (512; --tiny 32, --shallow 64)")
    parser.add_argument("--video-resolution", default=None, help="Wan HxW (480x832; --tiny 32x32, --shallow 64x64)")
    parser.add_argument("--frames", type=int, default=None, help="Wan frames, 4k+1 (33; --tiny/--shallow 5)")
    parser.add_argument("--samples", type=int, default=None, help="samples per rollout (4 images, 2 videos)")
    parser.add_argument("--cudnn-attention", action="store_true", help="allow the cuDNN SDPA kernel (off by default)")
    parser.add_argument("--no-checkpointing", action="store_true", help="update without gradient checkpointing")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per update micro-batch (2; Wan 1)")
    parser.add_argument("--sde-window", type=int, default=2, help="SDE steps per sample (Qwen-Image: its recipe's)")
    parser.add_argument("--out", default=None, help="JSON file for every figure")
    args = parser.parse_args()
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; known: {list(FAMILIES)}")
    small = args.tiny or args.shallow
    side = args.resolution or (32 if args.tiny else 64 if args.shallow else 512)
    args.resolution = (side, side)
    video = args.video_resolution or ("32x32" if args.tiny else "64x64" if args.shallow else "480x832")
    args.video_resolution = tuple(int(x) for x in video.lower().split("x"))
    args.frames = args.frames or (5 if small else 33)
    cpu = torch.device(args.device).type == "cpu"
    args.dtype = getattr(torch, args.dtype or ("float32" if cpu else "bfloat16"))
    if small and cpu:
        torch.set_num_threads(1)  # small layers gain nothing from threads, and one busy core stalls them all
    return args


def main() -> None:
    import diffusers
    import transformers

    args = parse_args()
    if not args.cudnn_attention:
        # torch 2.11's cuDNN attention backward fails on FLUX.1's joint sequence (1536 tokens, bf16:
        # "mha_graph.execute ... is_good()"); the flash and memory-efficient kernels run it.
        torch.backends.cuda.enable_cudnn_sdp(False)
    meta = meta_parameter_counts(args.families)
    print_meta_counts(meta)
    if args.meta_only:
        return
    cuda = torch.device(args.device).type == "cuda"
    report = {"device": torch.cuda.get_device_name(args.device) if cuda else args.device,
              "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                           "transformers": transformers.__version__},
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "meta_params": meta, "results": []}
    for family in args.families:
        elapsed = time.monotonic() - START
        result = {"family": family, "status": "running"}
        if elapsed > args.budget_s:
            result["status"] = f"skipped: {elapsed:.0f}s > --budget-s {args.budget_s:.0f}"
        else:
            try:
                run_family(family, args, result)
            except Exception as err:  # one family's failure must not cost the others' figures
                traceback.print_exc()
                result.update(status="error", error=f"{type(err).__name__}: {err}", peak_gib=peak_gib(args.device))
            result["family_s"] = time.monotonic() - START - elapsed
        free_memory(args.device)
        result["elapsed_s"] = time.monotonic() - START
        report["results"].append(result)
        print(f"[{result['elapsed_s']:6.1f}s] {table_row(result)}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report["results"])


if __name__ == "__main__":
    main()
