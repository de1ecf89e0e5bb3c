"""`WanFlowModel`: Wan 2.1 / 2.2 text-to-video (diffusers' ``WanPipeline``) behind the `FlowModel` interface.

Components: ``UMT5EncoderModel`` (text encoder, its T5 tokenizer), ``WanTransformer3DModel`` (the
trained module) and ``AutoencoderKLWan``. Everything follows ``diffusers/pipelines/wan/pipeline_wan.py``:

- The tokenizer's chat template is the user's text followed by ``</s>``: the pipeline tokenizes
  the raw prompt with ``add_special_tokens=True`` (T5 appends ``</s>``), the agent loop tokenizes
  the templated text without special tokens, so the template appends it (verl-omni's Wan template
  does the same). The pipeline's ``prompt_clean`` (ftfy, whitespace) is not applied.
- Text embeddings are UMT5's last hidden state, zero after each prompt and always
  ``max_sequence_length`` (512) long: the denoiser has no text mask and attends to the zero
  padding it was trained with, so ``velocity`` always feeds exactly that many tokens.
- A sample is a video: latents ``[C, (T - 1) / 4 + 1, H / 8, W / 8]`` (float32, normalised by the
  VAE's latents_mean/std), ``decode`` returns ``[B, T, 3, H, W]`` in [0, 1]. ``num_frames`` must be
  ``4k + 1`` (1 gives a one-frame video); images (``num_frames`` unset) are refused rather than
  silently returned as 5-D videos to image rewards.
- The transformer's timestep is ``1000 sigma`` (the scheduler's ``timesteps``), per token for Wan
  2.2 TI2V (``expand_timesteps``); it predicts ``eps - x0``, flowloop's velocity.

Wan 2.2 A14B's second transformer (``transformer_2``, switched at ``boundary_ratio``) is refused:
one trainable module per model is what the actor and LoRA expect.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowloop.models.diffusers_common import (
    check_pipeline_folder,
    check_resolution,
    frozen,
    load_frozen,
    load_prompt_tokenizer,
    to_unit_images,
    valid_tokens_first,
)
from flowloop.models.base import SchedulerShift
from flowloop.models.loading import load_component, read_scheduler_shift

PIPELINE_CLASS = "WanPipeline"

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""LoRA targets for ``actor.lora_target_modules``: the attention projections of every block's
self- and cross-attention. Flow-GRPO's ``scripts/train_wan2_1.py`` (rank 32, alpha 64) also lists
``add_*_proj`` / ``to_add_out``, which a text-to-video Wan transformer does not have."""


class WanFlowModel:
    """UMT5 + Wan video DiT + Wan VAE; see `flowloop.models.base.FlowModel` and the module docstring."""

    def __init__(self, tokenizer, text_encoder, transformer, vae, max_sequence_length: int = 512,
                 expand_timesteps: bool = False, scheduler_shift: SchedulerShift = SchedulerShift()):
        self.scheduler_shift = scheduler_shift  # flow_shift: what shift: auto samples with
        self.tokenizer = tokenizer
        self.text_encoder = frozen(text_encoder)
        self.transformer = transformer
        self.vae = frozen(vae)
        self.max_sequence_length = max_sequence_length
        self.expand_timesteps = expand_timesteps
        self.scale_temporal = vae.config.scale_factor_temporal
        self.scale_spatial = vae.config.scale_factor_spatial
        self.patch_size = tuple(transformer.config.patch_size)  # (t, h, w)

    # -- loading ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        max_sequence_length: int = 512):
        """Load a local ``WanPipeline`` folder; weights in ``dtype`` on ``device``.

        ``max_sequence_length`` (``model.options``): the pipeline's text length, 512; every
        prompt's embeddings are zero-padded to it and a longer prompt is an error.
        """
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5EncoderModel

        # 1. Every component present before anything loads: a missing file names itself.
        index = check_pipeline_folder(path, PIPELINE_CLASS, models=("transformer", "text_encoder", "vae"),
                                      tokenizers=("tokenizer",))
        second = index.get("transformer_2")
        if (second and any(second)) or index.get("boundary_ratio") is not None:
            raise ValueError(f"{path}/model_index.json has a second transformer (transformer_2, boundary_ratio="
                             f"{index.get('boundary_ratio')}): Wan 2.2 A14B's two-expert denoising is not supported; "
                             "use a one-transformer Wan (2.1 T2V, 2.2 TI2V-5B)")
        tokenizer = load_prompt_tokenizer(path, "tokenizer", max_sequence_length, append_eos=True)
        # 2. Frozen text encoder and VAE; the transformer trains.
        text_encoder = load_frozen(path, "text_encoder", UMT5EncoderModel, dtype, device)
        vae = load_frozen(path, "vae", AutoencoderKLWan, dtype, device)
        transformer = load_component(path, "transformer", WanTransformer3DModel, dtype).to(device)
        return cls(tokenizer, text_encoder, transformer, vae, max_sequence_length,
                   expand_timesteps=bool(index.get("expand_timesteps", False)), scheduler_shift=read_scheduler_shift(path))

    # -- FlowModel ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype  # the weights' dtype; diffusers keeps Wan's norms in float32

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        step = self.scale_temporal  # 4: the VAE keeps the first frame and packs each 4 after it into one
        if num_frames is None:
            raise ValueError(f"num_frames: Wan makes videos; set num_frames to {step}k+1 (e.g. 33 or 81; 1 for one frame)")
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % step:
            raise ValueError(f"num_frames={num_frames} must be {step}k+1 (1, {1 + step}, {1 + 2 * step}, ...): the VAE "
                             f"keeps the first frame and packs each {step} after it into one latent frame")
        check_resolution(height, width, self.scale_spatial * self.patch_size[1])
        frames = (num_frames - 1) // self.scale_temporal + 1
        return (self.transformer.config.in_channels, frames, height // self.scale_spatial, width // self.scale_spatial)

    @torch.no_grad()
    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Ids ``[B, L]`` -> ``prompt_embeds [B, max_sequence_length, D]`` (zero after each prompt) and
        ``prompt_embeds_mask [B, max_sequence_length]``, as the pipeline's ``_get_t5_prompt_embeds``."""
        ids, mask = prompt_ids.to(self.device), attention_mask.to(self.device)
        # 1. Valid tokens first, cut to the longest row: under the mask, padding never changes
        #    UMT5's outputs at the prompt's tokens, and a shorter batch is faster.
        ids, mask = valid_tokens_first(ids, mask)  # [B, l]
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, l, D]
        # 2. Zeros after each prompt, padded to max_sequence_length, as the pipeline does.
        embeds = _fit(hidden * mask.unsqueeze(-1).to(hidden.dtype), self.max_sequence_length)  # [B, M, D]
        return {"prompt_embeds": embeds, "prompt_embeds_mask": _fit(mask, self.max_sequence_length)}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """``latents [B, C, F, h, w]`` float32 -> ``eps - x0`` float32."""
        batch, _, frames, height, width = latents.shape
        dtype = self.dtype
        # 1. Text: exactly max_sequence_length tokens, zero where the mask is (the pipeline's input).
        mask = embeds["prompt_embeds_mask"].to(self.device)
        text = embeds["prompt_embeds"].to(self.device) * mask.unsqueeze(-1).to(embeds["prompt_embeds"].dtype)
        text = _fit(text, self.max_sequence_length).to(dtype)  # [B, M, D]
        # 2. Timestep 1000 sigma (float32, as the scheduler's timesteps); per token for Wan 2.2 TI2V.
        timestep = torch.as_tensor(sigma, device=self.device).float().expand(batch) * 1000  # [B]
        if self.expand_timesteps:
            _, ph, pw = self.patch_size
            timestep = timestep[:, None].expand(batch, frames * (height // ph) * (width // pw))  # [B, tokens]
        out = self.transformer(hidden_states=latents.to(self.device, dtype), timestep=timestep,
                               encoder_hidden_states=text, return_dict=False)[0]  # [B, C, F, h, w]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F, h, w]`` -> videos ``[B, T, 3, H, W]`` in [0, 1], one video at a time
        (a batch of videos would multiply the decoder's peak memory)."""
        config = self.vae.config
        vae_dtype = self.vae.dtype
        mean = torch.tensor(config.latents_mean, device=self.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=self.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        videos = []
        for row in latents.to(self.device, vae_dtype).split(1):
            video = self.vae.decode(row * std + mean, return_dict=False)[0]  # [1, 3, T, H, W]
            videos.append(to_unit_images(video).transpose(1, 2))  # [1, T, 3, H, W]
        return torch.cat(videos)

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer


def _fit(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Cut or zero-pad axis 1 of ``tensor`` ``[B, L, ...]`` to ``length``."""
    if tensor.shape[1] >= length:
        return tensor[:, :length]
    pad = tensor.new_zeros(tensor.shape[0], length - tensor.shape[1], *tensor.shape[2:])
    return torch.cat([tensor, pad], dim=1)
