"""`FluxFlowModel`: FLUX.1 (a diffusers ``FluxPipeline`` folder) as a `FlowModel`.

Components: ``transformer`` (``FluxTransformer2DModel``, the one RL trains), ``vae``
(``AutoencoderKL``, ``scaling_factor`` and ``shift_factor``), ``text_encoder`` (CLIP-L,
``CLIPTextModel``: only its pooled output is used), ``text_encoder_2`` (T5, the token sequence) and
their tokenizers.

Conditioning, as ``FluxPipeline.encode_prompt`` computes it: ``prompt_embeds [B, T, D]`` = T5's
last hidden state over ``T`` tokens (the ``max_sequence_length`` option, default 512 as in
diffusers), ``pooled_prompt_embeds [B, 768]`` = CLIP-L's ``pooler_output``. Text position ids are
zeros, built in `velocity`.

Tokenization: ``model.tokenizer`` is T5's (``tokenizer_2``); given no chat template it gets one
yielding the prompt followed by ``</s>``, the ids the pipeline feeds T5. The CLIP branch decodes
those ids back to text and re-tokenizes it (77 tokens, truncated) as the pipeline does; see
`flowloop.models.diffusers_common`. T5 runs over all ``T`` positions, pads included, unmasked, as
in the pipeline.

Latents: FLUX's denoiser sees 2x2 patches of the VAE latent packed into tokens of ``4 C`` = 64
channels. flowloop keeps that packed tensor on its grid, ``[64, H / 16, W / 16]`` (channel
``c * 4 + dy * 2 + dx``, exactly the pipeline's ``_pack_latents`` order), and flattens it into the
``[(H / 16) * (W / 16), 64]`` token sequence inside `velocity`. Keeping the grid is what lets the
trainer replay a stored latent and `decode` unpack it without being told the resolution; the
values, and so every log-prob, are those of the token layout.

Time: the pipeline passes ``timestep / 1000`` = sigma (the transformer multiplies by 1000 inside);
``guidance`` (FLUX.1-dev's distilled guidance, option ``guidance``, default 3.5) goes as a
float tensor ``[B]`` when the transformer has ``guidance_embeds`` and is ignored otherwise
(FLUX.1-schnell). The output is ``noise - x0``, flowloop's velocity. Classifier-free guidance
(``guidance_scale > 1``) is "true CFG" with a negative prompt, which FLUX.1-dev does not need.
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

PIPELINE_CLASS = "FluxPipeline"

LORA_TARGETS = [
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
]
"""Flow-GRPO's FLUX.1 LoRA targets (``scripts/train_flux.py``): the double-stream blocks' attention
projections and MLPs, image and text streams. In the single-stream blocks only ``attn.to_q/k/v``
match (they have no ``to_out``; their MLP is ``proj_mlp``/``proj_out``), as in Flow-GRPO."""

MODELS = ("transformer", "vae", "text_encoder", "text_encoder_2")
TOKENIZERS = ("tokenizer", "tokenizer_2")


class FluxFlowModel:
    """CLIP-L (pooled) + T5 text encoders, the FLUX transformer and the VAE; see `flowloop.models.base.FlowModel`."""

    def __init__(self, tokenizer, clip_tokenizer, clip_encoder, t5_encoder, transformer, vae, guidance: float,
                 max_sequence_length: int, scheduler_shift: SchedulerShift = SchedulerShift()):
        self.tokenizer = tokenizer
        self.scheduler_shift = scheduler_shift  # dynamic: what shift: auto samples with
        self.clip_tokenizer = clip_tokenizer
        self.clip_encoder = clip_encoder  # frozen
        self.t5_encoder = t5_encoder  # frozen
        self.transformer = transformer
        self.vae = vae  # frozen
        self.guidance = guidance
        self.max_sequence_length = max_sequence_length  # T5 tokens = prompt_embeds' length
        self.vae_scale_factor = vae_scale_factor(vae)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_sequence_length: int = 512,
        guidance: float = 3.5,
    ) -> FluxFlowModel:
        """Load a ``FluxPipeline`` folder; every weight in ``dtype`` on ``device``.

        ``max_sequence_length``: T5 tokens per prompt (diffusers' default 512; Flow-GRPO trains with
        128). ``guidance``: FLUX.1-dev's embedded guidance (3.5 in Flow-GRPO and the diffusers
        examples); ignored by a transformer without ``guidance_embeds``.
        """
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        # 1. Every component present before anything loads.
        check_pipeline_folder(path, PIPELINE_CLASS, MODELS, TOKENIZERS)
        # 2. Tokenizers: T5's is the model's; CLIP's re-tokenizes its decoded text.
        tokenizer = load_prompt_tokenizer(path, "tokenizer_2", max_sequence_length, append_eos=True)
        clip_tokenizer = load_tokenizer(path, "tokenizer")
        # 3. Frozen text encoders and VAE; the trainable transformer.
        clip_encoder = load_frozen(path, "text_encoder", CLIPTextModel, dtype, device)
        t5_encoder = load_frozen(path, "text_encoder_2", T5EncoderModel, dtype, device)
        vae = load_frozen(path, "vae", AutoencoderKL, dtype, device)
        transformer = load_component(path, "transformer", FluxTransformer2DModel, dtype).to(device)
        return cls(tokenizer, clip_tokenizer, clip_encoder, t5_encoder, transformer, vae, float(guidance),
                   max_sequence_length, read_scheduler_shift(path))

    # -- FlowModel ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """``(4 C, H / (2 f), W / (2 f))``: the packed 2x2 patches on their grid (f: VAE scale factor)."""
        if num_frames is not None:
            raise ValueError("num_frames: FLUX makes images, not video; leave num_frames unset")
        cell = 2 * self.vae_scale_factor
        check_resolution(height, width, cell)
        return (self.transformer.config.in_channels, height // cell, width // cell)

    def image_seq_len(self, height: int, width: int) -> int:
        """Denoiser image tokens at this resolution (the packed grid): the dynamic shift's input."""
        _, h, w = self.latent_shape(height, width)
        return h * w

    @torch.no_grad()
    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """T5 ids ``[B, T]`` (right-padded) -> ``prompt_embeds [B, T, D]``, ``prompt_embeds_mask [B, T]``,
        ``pooled_prompt_embeds [B, 768]``."""
        device = self.device
        # 1. T5 over the padded ids, no mask, as the pipeline runs it.
        mask = attention_mask.to(device)
        pad = self.tokenizer.pad_token_id or 0
        t5_ids = torch.where(mask.bool(), prompt_ids.to(device), pad)  # [B, T]
        prompt_embeds = self.t5_encoder(t5_ids)[0]  # [B, T, D]
        # 2. CLIP-L's pooled output on the decoded text.
        texts = decode_prompts(self.tokenizer, prompt_ids, attention_mask)
        clip_ids, _ = tokenize_like_pipeline(self.clip_tokenizer, texts, CLIP_TOKENS)
        pooled = self.clip_encoder(clip_ids.to(device), output_hidden_states=False).pooler_output  # [B, 768]
        return {"prompt_embeds": prompt_embeds, "prompt_embeds_mask": mask, "pooled_prompt_embeds": pooled}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """Latents ``[B, 4C, h, w]`` -> tokens ``[B, h*w, 4C]`` -> transformer at ``timestep = sigma`` -> back; float32 out."""
        dtype = self.transformer.dtype
        batch, channels, h, w = latents.shape
        tokens = latents.flatten(2).transpose(1, 2).to(dtype)  # [B, h*w, 4C]
        prompt_embeds = embeds["prompt_embeds"].to(dtype)  # [B, T, D]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)  # [B]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance, dtype=torch.float32, device=latents.device)  # [B]
        out = self.transformer(
            hidden_states=tokens,
            timestep=sigma,
            guidance=guidance,
            pooled_projections=embeds["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=prompt_embeds,
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, dtype=dtype, device=latents.device),  # [T, 3]
            img_ids=image_ids(h, w, dtype, latents.device),  # [h*w, 3]
            return_dict=False,
        )[0]  # [B, h*w, 4C]
        return out.float().transpose(1, 2).reshape(batch, channels, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents ``[B, 4C, h, w]`` -> images ``[B, 3, 2fh, 2fw]`` float32 in [0, 1]."""
        config = self.vae.config
        latents = latents_to_vae(unpack(latents), config.scaling_factor, config.shift_factor)  # [B, C, 2h, 2w]
        return to_unit_images(self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0])

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer


def image_ids(h: int, w: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Position ids ``[h*w, 3]`` of the packed tokens: (0, row, column), as ``FluxPipeline._prepare_latent_image_ids``."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """VAE latents ``[B, C, 2h, 2w]`` -> packed grid ``[B, 4C, h, w]`` (channel ``c*4 + dy*2 + dx``)."""
    b, c, hh, ww = latents.shape
    x = latents.view(b, c, hh // 2, 2, ww // 2, 2).permute(0, 1, 3, 5, 2, 4)  # [B, C, 2, 2, h, w]
    return x.reshape(b, c * 4, hh // 2, ww // 2)


def unpack(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: ``[B, 4C, h, w]`` -> ``[B, C, 2h, 2w]``."""
    b, c4, h, w = latents.shape
    x = latents.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)  # [B, C, h, 2, w, 2]
    return x.reshape(b, c4 // 4, h * 2, w * 2)
