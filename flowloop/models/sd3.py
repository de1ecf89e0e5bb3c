"""`SD3FlowModel`: Stable Diffusion 3 / 3.5 (a diffusers ``StableDiffusion3Pipeline`` folder) as a `FlowModel`.

Components: ``transformer`` (``SD3Transformer2DModel``, the MMDiT RL trains), ``vae``
(``AutoencoderKL`` with ``scaling_factor`` and ``shift_factor``), ``text_encoder`` /
``text_encoder_2`` (CLIP-L / CLIP-G, ``CLIPTextModelWithProjection``), ``text_encoder_3`` (T5
``T5EncoderModel``) and their tokenizers.

Conditioning, as ``StableDiffusion3Pipeline.encode_prompt`` computes it:
``prompt_embeds [B, 77 + T, D_t5]`` = the CLIP-L and CLIP-G penultimate hidden states, concatenated
on the feature axis and zero-padded to T5's width, followed on the sequence axis by T5's last
hidden state over ``T`` tokens; ``pooled_prompt_embeds [B, 768 + 1280]`` = both CLIPs' projected
pooled outputs. The engine pads prompt embeddings to ``max_sequence_length``, so this adapter's
``max_sequence_length`` is ``77 + T`` (``T`` = the ``max_sequence_length`` option, diffusers' name
and default, 256), and a prompt of more than ``T`` T5 tokens is an error, never a silent cut.

Tokenization: ``model.tokenizer`` is T5's (``tokenizer_3``). Given no chat template, it gets one
that yields the prompt followed by ``</s>``, so the agent loop's ids are exactly those the pipeline
feeds T5 (it tokenizes with ``add_special_tokens=True``). The CLIP branches decode those ids back
to text and tokenize it with their own tokenizers, padded and truncated to 77 tokens, as the
pipeline does (see `flowloop.models.diffusers_common`). T5 runs over all ``T`` positions, pads
included, with no attention mask: the pipeline does the same, and the MMDiT was trained so.

Time: the transformer takes ``timestep = sigma * 1000`` (the scheduler's timesteps) and predicts
``noise - x0``, flowloop's velocity, so no sign or scale changes beyond that.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowloop.models.diffusers_common import (
    CLIP_TOKENS,
    check_pipeline_folder,
    check_resolution,
    decode_prompts,
    latents_to_vae,
    load_frozen,
    load_prompt_tokenizer,
    to_unit_images,
    tokenize_like_pipeline,
    vae_scale_factor,
)
from flowloop.models.base import SchedulerShift
from flowloop.models.loading import load_component, load_tokenizer, read_scheduler_shift

PIPELINE_CLASS = "StableDiffusion3Pipeline"

LORA_TARGETS = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]
"""Flow-GRPO's SD3.5 LoRA targets (``scripts/train_sd3.py``): every joint-attention projection,
image and text stream; ``attn2`` (SD3.5's extra self-attention) and the MLPs are left alone."""

MODELS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


class SD3FlowModel:
    """CLIP-L + CLIP-G + T5 text encoders, the SD3 MMDiT and the VAE; see `flowloop.models.base.FlowModel`."""

    def __init__(self, tokenizer, clip_tokenizers, text_encoders, t5_encoder, transformer, vae, t5_tokens: int,
                 scheduler_shift: SchedulerShift = SchedulerShift()):
        self.tokenizer = tokenizer
        self.scheduler_shift = scheduler_shift  # what shift: auto samples with
        self.clip_tokenizers = list(clip_tokenizers)
        self.text_encoders = list(text_encoders)  # frozen CLIP-L, CLIP-G
        self.t5_encoder = t5_encoder  # frozen
        self.transformer = transformer
        self.vae = vae  # frozen
        self.t5_tokens = t5_tokens
        self.max_sequence_length = CLIP_TOKENS + t5_tokens
        self.vae_scale_factor = vae_scale_factor(vae)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_sequence_length: int = 256,
    ) -> SD3FlowModel:
        """Load a ``StableDiffusion3Pipeline`` folder; every weight in ``dtype`` on ``device``.

        ``max_sequence_length``: T5 tokens per prompt (diffusers' option of the same name; 256 is
        its default, 77 is enough for most prompt sets and cuts the MMDiT's text tokens).
        """
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        # 1. Every component present before anything loads.
        check_pipeline_folder(path, PIPELINE_CLASS, MODELS, TOKENIZERS)
        # 2. Tokenizers: T5's is the model's; the CLIP ones re-tokenize its decoded text.
        tokenizer = load_prompt_tokenizer(path, "tokenizer_3", max_sequence_length, append_eos=True)
        clip_tokenizers = [load_tokenizer(path, "tokenizer"), load_tokenizer(path, "tokenizer_2")]
        # 3. Frozen text encoders and VAE; the trainable transformer.
        text_encoders = [load_frozen(path, name, CLIPTextModelWithProjection, dtype, device)
                         for name in ("text_encoder", "text_encoder_2")]
        t5_encoder = load_frozen(path, "text_encoder_3", T5EncoderModel, dtype, device)
        vae = load_frozen(path, "vae", AutoencoderKL, dtype, device)
        transformer = load_component(path, "transformer", SD3Transformer2DModel, dtype).to(device)
        return cls(tokenizer, clip_tokenizers, text_encoders, t5_encoder, transformer, vae, max_sequence_length,
                   read_scheduler_shift(path))

    # -- FlowModel ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        if num_frames is not None:
            raise ValueError("num_frames: SD3 makes images, not video; leave num_frames unset")
        check_resolution(height, width, self.vae_scale_factor * self.transformer.config.patch_size)
        return (self.transformer.config.in_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    @torch.no_grad()
    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """T5 ids ``[B, 77 + T]`` (right-padded) -> ``prompt_embeds [B, 77 + T, D]``,
        ``prompt_embeds_mask [B, 77 + T]`` (CLIP part all ones), ``pooled_prompt_embeds [B, P]``."""
        device = self.device
        # 1. The T5 ids: the first T positions; anything after them is a prompt too long.
        lengths = attention_mask.sum(1)
        if int(lengths.max()) > self.t5_tokens or attention_mask[:, self.t5_tokens:].any():
            raise ValueError(f"a prompt has {int(lengths.max())} T5 tokens, more than max_sequence_length="
                             f"{self.t5_tokens} (model.options.max_sequence_length); raise it or shorten the prompt")
        t5_mask = attention_mask[:, : self.t5_tokens].to(device)  # [B, T]
        pad = self.tokenizer.pad_token_id or 0
        t5_ids = torch.where(t5_mask.bool(), prompt_ids[:, : self.t5_tokens].to(device), pad)  # [B, T]
        t5_embeds = self.t5_encoder(t5_ids)[0]  # [B, T, D]
        # 2. CLIP-L and CLIP-G on the decoded text: penultimate hidden states and pooled projections.
        texts = decode_prompts(self.tokenizer, prompt_ids, attention_mask)
        hidden, pooled = [], []
        for tokenizer, encoder in zip(self.clip_tokenizers, self.text_encoders):
            ids, _ = tokenize_like_pipeline(tokenizer, texts, CLIP_TOKENS)
            out = encoder(ids.to(device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])  # [B, 77, D_clip]
            pooled.append(out[0])  # [B, P_clip]
        clip_embeds = torch.cat(hidden, dim=-1)  # [B, 77, D_l + D_g]
        clip_embeds = torch.nn.functional.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))  # [B, 77, D]
        # 3. One sequence, CLIP first, as the pipeline concatenates them.
        prompt_embeds = torch.cat([clip_embeds.to(t5_embeds.dtype), t5_embeds], dim=1)  # [B, 77 + T, D]
        mask = torch.cat([torch.ones_like(t5_mask[:, :1]).expand(-1, CLIP_TOKENS), t5_mask], dim=1)  # [B, 77 + T]
        return {
            "prompt_embeds": prompt_embeds,
            "prompt_embeds_mask": mask,
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1),  # [B, P_l + P_g]
        }

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """MMDiT at ``timestep = sigma * 1000``, in the weights' dtype; float32 out."""
        dtype = self.transformer.dtype
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])  # [B]
        out = self.transformer(
            hidden_states=latents.to(dtype),
            timestep=sigma * 1000.0,
            encoder_hidden_states=embeds["prompt_embeds"].to(dtype),
            pooled_projections=embeds["pooled_prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> images ``[B, 3, h * f, w * f]`` float32 in [0, 1]."""
        config = self.vae.config
        latents = latents_to_vae(latents, config.scaling_factor, config.shift_factor)
        return to_unit_images(self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0])

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer
