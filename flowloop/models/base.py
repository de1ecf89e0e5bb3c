"""The `FlowModel` contract: what the rollout engine and the trainer may ask of a model.

One interface covers the embedded pixel-space model and diffusers pipelines (a text encoder,
a denoiser, and a VAE or none; images or video). The engine never touches a component
directly: it encodes prompts, asks for velocities and decodes latents through these methods,
so adding a model family means writing one adapter, nothing else.

Time convention, used everywhere in flowloop: ``x_t = (1 - t) x0 + t eps``, sampling runs
from t = 1 (noise) to t = 0 (data), and ``velocity`` predicts ``eps - x0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class FlowModel(Protocol):
    """A text-to-image (or video) flow-matching model, seen by the engine and the trainer."""

    tokenizer: object
    """A transformers fast tokenizer (``PreTrainedTokenizerFast``), with a chat template."""

    max_sequence_length: int
    """Prompt embeddings are always padded to this many tokens; longer prompts are an error."""

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Shape of one sample's latent (no batch axis); raises ValueError on a bad resolution."""

    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Token ids ``[B, L]`` -> the denoiser's text conditioning, every tensor with batch axis ``B``.

        Always ``prompt_embeds [B, L, D]`` and ``prompt_embeds_mask [B, L]``; a model may add more
        (``pooled_prompt_embeds [B, D]`` for SD3 and FLUX). Every key must contain
        ``prompt_embeds`` (see `is_embedding_key`): the engine records these per sample and the
        trainer replays with them, so a group's samples reuse one encoding end to end.
        """

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """Predicted velocity ``eps - x0`` at noise level ``sigma`` ``[B]``; same shape as latents.

        ``embeds`` is what `encode_prompt` returned, indexed to the rows of ``latents``.
        """

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images ``[B, C, H, W]`` (or video ``[B, T, C, H, W]``), float in [0, 1]."""

    def trainable_module(self) -> torch.nn.Module:
        """The module RL updates (the denoiser); the text encoder and VAE stay frozen.

        Optional: ``combine_guidance(v_cond, v_uncond, guidance_scale)``, a family's own CFG rule
        (Qwen-Image rescales the guided velocity); `flowloop.rollout.engine.guided_velocity` uses
        it in place of ``apply_cfg`` when present, in the rollout and the replay alike.

        Optional: ``scheduler_shift`` (a `SchedulerShift`, read from the folder's scheduler config)
        and, for a dynamic one, ``image_seq_len(height, width)``: what ``shift: auto`` resolves from.
        A model without them samples ``auto`` unshifted.
        """


@dataclass(frozen=True)
class SchedulerShift:
    """The sigma shift a model's own scheduler applies (``scheduler/scheduler_config.json``), so
    ``rollout.pipeline.shift: auto`` samples on the grid the model was trained for."""

    shift: float = 1.0
    """The fixed SD3-style shift (``shift``, or Wan's ``flow_shift``); used when not dynamic."""
    dynamic: bool = False
    """FLUX / Qwen-Image (``use_dynamic_shifting``): the shift is ``exp(mu)``, ``mu`` linear in the
    image token count through (base_seq_len, base_shift) and (max_seq_len, max_shift)."""
    base_seq_len: int = 256
    max_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    shift_terminal: float | None = None
    """Qwen-Image's stretch of the grid to end at this sigma before 0; None: no stretch."""


def is_embedding_key(key: str) -> bool:
    """Whether a rollout output field is text conditioning (``*prompt_embeds*``, negatives included)."""
    return "prompt_embeds" in key


def is_sequence_embedding_key(key: str) -> bool:
    """Text conditioning with a token axis (padded to ``max_sequence_length``); pooled ones have none."""
    return is_embedding_key(key) and "pooled" not in key
