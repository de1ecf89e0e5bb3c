"""What crosses the rollout boundary: a request in, a `DiffusionOutput` out.

The agent loop sends one `RolloutRequest` per sample; the rollout server may batch it with
others, but everything a sample's result depends on (its seed, its sampling parameters) travels
inside the request, so batching never changes a result. Tensors end to end: no nested lists.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from flowloop.sampling import LOGPROB_MODES, sde_window

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
    shift: float | str = 1.0
    """SD3-style sigma shift (1.0 = plain linear schedule), or "auto": the model's own scheduler's
    shift at this resolution (`flowloop.rollout.engine.model_sigmas`)."""
    sampler: str = "sde"
    """One of ode, sde, cps, dance (see flowloop.sampling)."""
    noise_level: float = 0.7
    sde_window_size: int | None = None
    """Consecutive SDE steps (log-probs recorded there only); None = every step but the last."""
    sde_window_range: tuple[int, int] | None = None
    """The window lies inside steps [lo, hi); None = every step but the last, ``(0, steps - 1)``."""
    logprob_mode: str = "density"
    """CPS only: "density" (true Gaussian) or "flow_grpo" (-||x'-mean||^2, as the public code)."""
    logprobs: bool = True
    """Record what training needs (the clean final latent; with a stochastic sampler also the SDE
    window's latents and log-probs; the ODE has no window, so none); validation turns it off."""
    seed: int | None = None
    """Seeds the request's own torch.Generator (window start, initial and step noise); None = random."""
    noise_seed: int | None = None
    """Seeds the initial noise alone, so requests with one ``noise_seed`` start from the same
    latent; None = drawn from ``seed``'s generator."""
    global_steps: int | None = None
    """Trainer step that asked for this sample (for logging only)."""
    weight_version: int | None = None
    """The trainer update whose weights must sample this request: a replica holding others (one
    restarted after a crash, say) refuses it with `StaleWeightsError` and the client sends it to
    another. None: any weights."""

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
        """Requests with equal keys can share a batch: everything but the per-sample seeds and step."""
        return dataclasses.astuple(dataclasses.replace(self, seed=None, noise_seed=None, global_steps=None))

    def window_range(self) -> tuple[int, int]:
        """``sde_window_range``, or ``(0, num_inference_steps - 1)`` when it is None."""
        if self.sde_window_range is None:
            return (0, self.num_inference_steps - 1)
        return tuple(self.sde_window_range)

    def validate(self) -> None:
        """Raise a ValueError naming the field for a setting no model can run.

        Model-dependent checks (resolution, prompt length) are `RolloutEngine.validate`'s.
        """
        _check_int("height", self.height, 1)
        _check_int("width", self.width, 1)
        if self.num_frames is not None:
            _check_int("num_frames", self.num_frames, 1)
        _check_int("num_inference_steps", self.num_inference_steps, 1)
        _check_float("guidance_scale", self.guidance_scale)
        if self.shift != "auto":
            _check_float("shift", self.shift, positive=True)
        _check_float("noise_level", self.noise_level, non_negative=True)
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampling_params.sampler: unknown sampler {self.sampler!r}; known: {list(SAMPLERS)}")
        if self.sampler == "cps" and self.noise_level > 1:
            raise ValueError(f"sampling_params.noise_level must be in [0, 1] for sampler='cps', got {self.noise_level!r}")
        if self.logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"sampling_params.logprob_mode must be one of {list(LOGPROB_MODES)}, got {self.logprob_mode!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"sampling_params.logprobs must be a bool, got {self.logprobs!r}")
        for name in ("seed", "noise_seed"):
            seed = getattr(self, name)
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
                raise ValueError(f"sampling_params.{name} must be None or an int in [0, 2**64), got {seed!r}")
        if self.sampler == "ode":  # no window: with logprobs only the final latent is recorded
            return
        # The window's bounds, checked with a throwaway generator (the draw itself is the engine's).
        try:
            window = sde_window(self.num_inference_steps, self.sde_window_size, self.window_range(), torch.Generator())
        except ValueError as err:
            raise ValueError(f"sampling_params.sde_window_size/sde_window_range: {err}") from None
        if self.logprobs and len(window) == 0:
            raise ValueError(
                f"sampling_params.num_inference_steps={self.num_inference_steps} leaves no SDE step to record "
                f"log-probs on (the last step is ODE); use more steps, set sde_window_size, or logprobs=False"
            )


class StaleWeightsError(RuntimeError):
    """A replica was asked for a sample of weights it does not hold (`SamplingParams.weight_version`)."""


@dataclass
class RolloutRequest:
    request_id: str
    prompt_ids: torch.Tensor
    """Token ids ``[L]`` (int64, unpadded, chat template applied)."""
    sampling_params: SamplingParams
    negative_prompt_ids: torch.Tensor | None = None
    """Token ids of the negative prompt for true CFG (needs ``guidance_scale > 1``), or None."""


@dataclass
class DiffusionOutput:
    request_id: str
    diffusion_output: torch.Tensor
    """Image ``[C, H, W]`` or video ``[T, C, H, W]``, float32 in [0, 1], on the CPU."""
    log_probs: torch.Tensor | None = None
    """``[W]`` float32 log-probs of the window's steps; None when not asked for."""
    extra_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """All on the CPU (an engine built with ``device_rows`` leaves a training row's on the model's
    device: its replica holds them for the update, `flowloop.trainer.held_rows`), each its own
    storage (no views into a batch; the rows of one prompt share their embedding tensors, which
    nothing writes to). Always:
    the model's text conditioning, ``prompt_embeds [L, D]`` and ``prompt_embeds_mask [L]`` (padded
    to ``max_sequence_length``) plus any field the model adds (``pooled_prompt_embeds [D]``);
    with ``guidance_scale > 1``, the same fields of the negative prompt (or the empty prompt, for
    plain CFG) prefixed ``negative_``.
    With ``logprobs``: ``all_latents [W+1, ...]`` float32 (the latent entering the window's first
    step, then the one after each window step), ``all_timesteps [W]`` (sigma of each window step)
    and ``all_next_timesteps [W]`` (the sigma it steps to), float32, the exact values sampled with:
    replaying step ``k`` is ``velocity(all_latents[k], all_timesteps[k])`` then the sampler's step
    to ``all_next_timesteps[k]`` with ``prev_sample=all_latents[k + 1]``; and ``final_latents
    [...]`` float32, the clean latent the image was decoded from (DiffusionNFT trains on it)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``queue_time``, ``generate_time``, ``batch_size`` of the batch this request ran in."""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"sampling_params.{name} must be an int >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any, positive: bool = False, non_negative: bool = False) -> None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    bad = not math.isfinite(number) or isinstance(value, bool) or (positive and number <= 0) or (non_negative and number < 0)
    if bad:
        need = "a finite number" + (" > 0" if positive else " >= 0" if non_negative else "")
        raise ValueError(f"sampling_params.{name} must be {need}, got {value!r}")
