"""What crosses the rollout boundary: a request in, a `DiffusionOutput` out.

The agent loop sends one `RolloutRequest` per sample; the rollout server may batch it with
others, but everything a sample's result depends on (its seed, its sampling parameters) travels
inside the request, so batching never changes a result. Tensors end to end: no nested lists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

SAMPLERS = ("ode", "sde", "cps", "dance")


@dataclass(frozen=True)
class SamplingParams:
    """The merged ``pipeline`` + ``algo`` settings of one request, plus its seed."""

    height: int = 32
    width: int = 32
    num_frames: int | None = None
    """Video frames; None for images."""
    num_inference_steps: int = 10
    guidance_scale: float = 1.0
    """Classifier-free guidance; <= 1 runs no unconditional pass. With a negative prompt it is true CFG."""
    shift: float = 1.0
    """SD3-style sigma shift (1.0 = plain linear schedule)."""
    sampler: str = "sde"
    """One of ode, sde, cps, dance (see flowloop.sampling)."""
    noise_level: float = 0.7
    sde_window_size: int | None = None
    """Consecutive SDE steps (log-probs recorded there only); None = every step but the last."""
    sde_window_range: tuple[int, int] | None = None
    """The window lies inside steps [lo, hi); None = the whole trajectory."""
    logprob_mode: str = "density"
    """CPS only: "density" (true Gaussian) or "flow_grpo" (-||x'-mean||^2, as the public code)."""
    logprobs: bool = True
    """Record log-probs and latents for training; validation turns it off."""
    seed: int | None = None
    """Seeds the request's own torch.Generator (window start, initial and step noise); None = random."""
    global_steps: int | None = None
    """Trainer step that asked for this sample (for logging only)."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a merged config dict; an unknown key is a ValueError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        if values.get("sde_window_range") is not None:
            values["sde_window_range"] = tuple(values["sde_window_range"])
        return cls(**values)

    def batch_key(self) -> tuple:
        """Requests with equal keys can share a batch: everything but the per-sample seed and step."""
        return dataclasses.astuple(dataclasses.replace(self, seed=None, global_steps=None))


@dataclass
class RolloutRequest:
    request_id: str
    prompt_ids: torch.Tensor
    """Token ids ``[L]`` (int64, unpadded, chat template applied)."""
    sampling_params: SamplingParams
    negative_prompt_ids: torch.Tensor | None = None
    """Token ids of the negative prompt for true CFG, or None."""


@dataclass
class DiffusionOutput:
    request_id: str
    diffusion_output: torch.Tensor
    """Image ``[C, H, W]`` or video ``[T, C, H, W]``, float32 in [0, 1]."""
    log_probs: torch.Tensor | None = None
    """``[W]`` float32 log-probs of the window's steps; None when not asked for."""
    extra_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """``all_latents [W+1, ...]``, ``all_timesteps [W]``, ``prompt_embeds [L, D]``,
    ``prompt_embeds_mask [L]``, and ``negative_prompt_embeds(_mask)`` with true CFG."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``queue_time``, ``generate_time``, ``batch_size`` of the batch this request ran in."""
