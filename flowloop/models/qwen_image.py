"""`QwenImageFlowModel`: Qwen-Image (diffusers' ``QwenImagePipeline``) behind the `FlowModel` interface.

Components: ``Qwen2_5_VLForConditionalGeneration`` (text encoder, its Qwen2 tokenizer),
``QwenImageTransformer2DModel`` (a 60-layer MMDiT, the trained module) and
``AutoencoderKLQwenImage`` (a video-style VAE used with one frame). Everything follows
``diffusers/pipelines/qwenimage/pipeline_qwenimage.py``:

- Prompts go through the pipeline's prompt template (a fixed system prompt, then the user's text).
  That template *is* the tokenizer's chat template here, so the ids the agent loop makes are the
  ids the pipeline feeds its text encoder; ``encode_prompt`` drops the template's leading tokens
  (system prompt and the ``user`` header: 34 with Qwen-Image's tokenizer) from the last hidden
  states, exactly as the pipeline's ``prompt_template_encode_start_idx`` does.
- Latents are ``[C, H/8, W/8]`` (no frame axis: the VAE's single frame is added in ``decode``),
  float32; ``velocity`` packs them into 2x2 patches for the transformer and unpacks its output.
- The transformer takes ``sigma`` as its timestep (the pipeline's ``t / 1000``, rounded to the
  model dtype as the pipeline does) and predicts ``eps - x0``, flowloop's velocity.
- Text rows of different lengths share a batch under ``prompt_embeds_mask`` (CFG's ``[cond;
  negative]`` rows included); ``velocity`` trims the padding every row has, as the pipeline pads
  only to the longest prompt. With compiled blocks (``model.compile``) it pads to a multiple of
  ``text_length_multiple`` instead: each text length is a new shape to a compiled graph, and a
  prompt of a length not seen before compiled its graph inside a training step.

True CFG: the pipeline rescales the guided velocity to the conditional one's norm, token by
token; `QwenImageFlowModel.combine_guidance` does that, for the engine to call instead of its plain
`apply_cfg` mix (which it still uses today).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowloop.models.diffusers_common import (
    check_pipeline_folder,
    check_resolution,
    frozen,
    load_frozen,
    to_unit_images,
    valid_tokens_first,
)
from flowloop.models.base import SchedulerShift
from flowloop.models.loading import load_component, read_scheduler_shift

PIPELINE_CLASS = "QwenImagePipeline"

SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:"
)
TEMPLATE_PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
"""The template's text before the user's prompt; its tokens are dropped from the embeddings."""
TEMPLATE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"

PROMPT_TEMPLATE = (
    TEMPLATE_PREFIX
    + "{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}{% endif %}{% endfor %}"
    + TEMPLATE_SUFFIX.removesuffix("\n") + "{{ '\\n' }}"  # Jinja drops a template's final newline
)
"""The pipeline's ``prompt_template_encode`` as a chat template: the user's content in the slot."""

LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0",  # image stream attention
    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",  # text stream attention
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",  # both MLPs
)
"""LoRA targets for ``actor.lora_target_modules``: verl-omni's Qwen-Image FlowGRPO recipe
(``examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh``, rank 64, alpha 128)."""

TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
"""A Qwen2 tokenizer folder holds tokenizer.json, or vocab.json + merges.txt (Qwen-Image's has the latter)."""


class QwenImageFlowModel:
    """Qwen-Image text encoder + MMDiT + VAE; see `flowloop.models.base.FlowModel` and the module docstring."""

    def __init__(self, tokenizer, text_encoder, transformer, vae, max_sequence_length: int = 1024,
                 scheduler_shift: SchedulerShift = SchedulerShift()):
        self.tokenizer = tokenizer
        self.scheduler_shift = scheduler_shift  # dynamic, stretched: what shift: auto samples with
        self.text_encoder = frozen(text_encoder)
        self.transformer = transformer
        self.vae = frozen(vae)
        self.max_sequence_length = max_sequence_length
        self.text_length_multiple = 1
        """``velocity`` runs the text rows at the longest prompt's length rounded up to a multiple of
        this (zeros under the mask past each prompt); 1: the longest prompt's length, as the
        pipeline. `flowloop.models.compiled.bucket_text_lengths` raises it for compiled blocks."""
        self.vae_scale_factor = 2 ** len(vae.config.temperal_downsample)  # 8, as the pipeline computes it
        self.patch_size = transformer.config.patch_size
        self.latent_channels = transformer.config.in_channels // (self.patch_size * self.patch_size)
        self.template_prefix_ids = torch.tensor(tokenizer(TEMPLATE_PREFIX, add_special_tokens=False).input_ids)
        """Ids of `TEMPLATE_PREFIX`, dropped from the embeddings (34 of them: the pipeline's start index)."""
        suffix = len(tokenizer(TEMPLATE_SUFFIX, add_special_tokens=False).input_ids)
        if max_sequence_length <= len(self.template_prefix_ids) + suffix:
            raise ValueError(f"max_sequence_length={max_sequence_length} leaves no room for a prompt: the prompt "
                             f"template alone has {len(self.template_prefix_ids) + suffix} tokens")

    # -- loading ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        max_sequence_length: int = 1024):
        """Load a local ``QwenImagePipeline`` folder; weights in ``dtype`` on ``device``.

        ``max_sequence_length`` (``model.options``): most tokens of a prompt *with* its template,
        so a prompt of its own gets this minus the template's ~39 tokens; the text embeddings
        the denoiser sees are the prompt's part, at most ``max_sequence_length - 34`` long.
        """
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration

        # 1. Every component present before anything loads: a missing file names itself.
        check_pipeline_folder(path, PIPELINE_CLASS, models=("transformer", "text_encoder", "vae"))
        tokenizer = load_qwen_tokenizer(path)
        # 2. Frozen text encoder and VAE; the transformer trains.
        text_encoder = load_frozen(path, "text_encoder", Qwen2_5_VLForConditionalGeneration, dtype, device)
        vae = load_frozen(path, "vae", AutoencoderKLQwenImage, dtype, device)
        transformer = load_component(path, "transformer", QwenImageTransformer2DModel, dtype).to(device)
        return cls(tokenizer, text_encoder, transformer, vae, max_sequence_length, read_scheduler_shift(path))

    # -- FlowModel ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype  # diffusers' dtype: that of the weights, not of modules kept in float32

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        if num_frames is not None:
            raise ValueError(f"num_frames={num_frames}: Qwen-Image makes images; leave num_frames unset (null)")
        check_resolution(height, width, self.vae_scale_factor * self.patch_size)
        return (self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def image_seq_len(self, height: int, width: int) -> int:
        """Denoiser image tokens at this resolution (patches of the latent): the dynamic shift's input."""
        _, h, w = self.latent_shape(height, width)
        return (h // self.patch_size) * (w // self.patch_size)

    @torch.no_grad()
    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Templated ids ``[B, L]`` -> the text encoder's last hidden states without the template's
        prefix: ``prompt_embeds [B, L', D]`` (zeros after each prompt) and ``prompt_embeds_mask [B, L']``,
        ``L'`` the longest prompt of the batch, as the pipeline pads."""
        drop = len(self.template_prefix_ids)
        # 1. Valid tokens first in each row (any padding side in), trimmed to the longest row.
        ids, mask = valid_tokens_first(prompt_ids.to(self.device), attention_mask.to(self.device))  # [B, l]
        lengths = mask.sum(1)  # [B]
        prefix = self.template_prefix_ids.to(ids.device)
        if bool((lengths <= drop).any()) or not bool((ids[:, :drop] == prefix).all()):
            raise ValueError("prompt_ids must be Qwen-Image's prompt template around the prompt: tokenize "
                             "model.tokenizer.apply_chat_template([{'role': 'user', 'content': p}], tokenize=False)")
        # 2. Encode; hidden_states[-1] of the full model is the language model's last_hidden_state.
        hidden = self.text_encoder.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, l, D]
        # 3. Drop the template's prefix; zeros after each prompt, as the pipeline pads.
        embeds_mask = mask[:, drop:]  # [B, l - drop]
        embeds = hidden[:, drop:] * embeds_mask.unsqueeze(-1).to(hidden.dtype)  # [B, l - drop, D]
        return {"prompt_embeds": embeds, "prompt_embeds_mask": embeds_mask}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """``latents [B, C, h, w]`` float32 -> ``eps - x0`` float32, through the packed MMDiT."""
        batch, _, height, width = latents.shape
        dtype = self.dtype
        # 1. Text: cut the padding every row has, up to the length multiple (a longer pad changes
        # nothing under the mask).
        mask = embeds["prompt_embeds_mask"].to(self.device).bool()  # [B, L]
        length = int(mask.any(0).nonzero().max()) + 1
        length = -(-length // self.text_length_multiple) * self.text_length_multiple
        text, mask = embeds["prompt_embeds"][:, :length].to(self.device, dtype), mask[:, :length]  # [B, <=l, D], [B, <=l]
        pad = length - text.shape[1]  # rows encoded at their batch's longest prompt can be shorter
        if pad:
            text, mask = torch.nn.functional.pad(text, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad))
        text, mask = text.contiguous(), mask.contiguous()  # [B, l, D], [B, l]: one layout, one graph
        # 2. Latents as 2x2 patches; the pipeline's timestep is t = 1000 sigma in the model dtype, sent as t / 1000.
        hidden = _pack(latents.to(self.device, dtype), self.patch_size)  # [B, h*w/4, 4C]
        sigma = torch.as_tensor(sigma, device=self.device).expand(batch)
        timestep = (sigma.float() * 1000).to(dtype) / 1000  # [B]
        out = self.transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,  # the pipeline passes None when all valid
            img_shapes=[[(1, height // self.patch_size, width // self.patch_size)]] * batch,
            return_dict=False,
        )[0]  # [B, h*w/4, 4C]
        return _unpack(out, height, width, self.patch_size).float()  # [B, C, h, w]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> images ``[B, 3, H, W]`` in [0, 1] (latents_mean/std undone first)."""
        config = self.vae.config
        vae_dtype = self.vae.dtype
        mean = torch.tensor(config.latents_mean, device=self.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=self.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        z = latents.to(self.device, vae_dtype).unsqueeze(2) * std + mean  # [B, C, 1, h, w]
        return to_unit_images(self.vae.decode(z, return_dict=False)[0][:, :, 0])  # [B, 3, H, W]

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """True CFG as Qwen-Image's pipeline (and verl-omni) does it: the CFG mix, then each 2x2
        patch token of the result rescaled to the norm of the conditional velocity's token.

        ``[B, C, h, w]`` each. For `flowloop.rollout.engine.guided_velocity` to call in place of
        ``apply_cfg`` when a model defines it (rollout and replay alike).
        """
        guided = _pack(v_uncond + guidance_scale * (v_cond - v_uncond), self.patch_size)  # [B, tokens, 4C]
        scale = _pack(v_cond, self.patch_size).norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True)
        return _unpack(guided * scale, v_cond.shape[2], v_cond.shape[3], self.patch_size)

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def load_qwen_tokenizer(root: str | Path, subfolder: str = "tokenizer"):
    """The folder's Qwen2 tokenizer with the pipeline's prompt template as its chat template.

    Any chat template the folder ships (Qwen2.5-VL's assistant template) is replaced: the agent
    loop's ids must be those the pipeline encodes.
    """
    from transformers import AutoTokenizer

    folder = Path(root) / subfolder
    if not any(all((folder / name).is_file() for name in files) for files in TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder / 'tokenizer.json'} is missing (or vocab.json + merges.txt): "
                                "the model folder's tokenizer is incomplete.")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{folder} gave a slow tokenizer; flowloop needs a fast (tokenizers) one.")
    tokenizer.chat_template = PROMPT_TEMPLATE
    return tokenizer


def _pack(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/p)(w/p), C p p]``: the pipeline's ``_pack_latents``."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)


def _unpack(tokens: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """Inverse of `_pack`: ``[B, (h/p)(w/p), C p p]`` -> ``[B, C, h, w]`` (the pipeline's ``_unpack_latents``)."""
    b, _, d = tokens.shape
    c = d // (patch * patch)
    x = tokens.view(b, height // patch, width // patch, c, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)
