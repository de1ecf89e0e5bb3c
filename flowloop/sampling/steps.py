"""One sampling step of a flow-matching sampler, and the log-probability of the transition.

Time convention: ``x_t = (1 - t) * x0 + t * eps``, sigma = t in [0, 1], sampling from t = 1 to
t = 0; the model's velocity is ``v ~ eps - x0``; ``dt = sigma_next - sigma < 0``.

Every step has the same call shape::

    step(velocity, sigma, sigma_next, sample, *, noise_level, noise=None, generators=None,
         prev_sample=None) -> StepOutput(prev_sample, log_prob, mean, std)

- ``sample``, ``velocity``: ``[B, ...]`` (any trailing shape: image or video latents).
- ``sigma``, ``sigma_next``: Python floats, 0-d tensors or ``[B]`` tensors (one per sample).
  Preconditions (not checked, to keep the hot path free of device syncs):
  ``0 <= sigma_next < sigma <= 1``.
- Where the next sample's noise comes from, exactly one of:
  ``noise`` (``[B, ...]``, drawn by the caller), ``generators`` (one ``torch.Generator`` per
  sample, see ``randn_per_sample``), or ``prev_sample`` (replay: no noise is drawn, the given
  sample is returned and its log-probability computed). ``ode_step`` ignores ``noise`` and
  ``generators``.

All outputs are float32 (float64 if the inputs are): the step math runs in float32 even when the
model runs in bf16, because bf16 overflows in the mean and loses the log-prob. Keep the returned
``prev_sample`` as it is (float32) in the trajectory: the log-prob is that of the returned tensor,
so replaying it gives the recorded log-prob bit for bit.

``log_prob`` is ``[B]``: the Gaussian log-density averaged (not summed) over each sample's
elements, as Flow-GRPO does. It is computed one sample at a time so that a sample's value never
depends on its batch neighbours (a batched reduction splits the work differently for different
batch sizes and rounds differently).

Deterministic rows. Where a row's ``std`` is exactly 0 (``noise_level=0``, or ``cps_step`` on the
last step where ``sigma_next = 0``), the transition is a point mass: ``prev_sample = mean``
(the noise is multiplied by 0) and ``log_prob = 0`` by definition, never NaN or -inf, also in
replay. Such steps carry no policy gradient; keep them out of the SDE window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "LOGPROB_MODES",
    "STEPS",
    "StepFn",
    "StepOutput",
    "cps_step",
    "dance_step",
    "gaussian_log_prob",
    "get_step",
    "ode_step",
    "randn_per_sample",
    "sde_step",
]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

LOGPROB_MODES = ("density", "flow_grpo")
"""``cps_step`` log-prob modes: the true Gaussian log-density ("density"), or Flow-GRPO's
``-mean((x' - mean)^2)`` ("flow_grpo")."""


class StepOutput(NamedTuple):
    """What one step returns; all float32 (float64 for float64 inputs)."""

    prev_sample: torch.Tensor
    """``[B, ...]`` the sample at ``sigma_next``."""
    log_prob: torch.Tensor
    """``[B]`` log p(prev_sample | sample), mean over each sample's elements; 0 where std is 0."""
    mean: torch.Tensor
    """``[B, ...]`` the mean of the transition."""
    std: torch.Tensor
    """``[B, 1, ..., 1]`` the transition's standard deviation (what multiplies the unit noise).
    For ``sde_step`` this is ``s * sqrt(-dt)``; Flow-GRPO's KL uses ``s = std / sqrt(-dt)``."""


StepFn = Callable[..., StepOutput]


def randn_per_sample(
    generators: Sequence[torch.Generator],
    shape: Sequence[int],
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Unit Gaussian noise ``[B, *shape[1:]]`` (float32), row ``i`` drawn from ``generators[i]``.

    A sample's noise depends only on its own generator, never on the batch it is drawn in. Noise is
    always drawn in float32, so a bf16 and a float32 run of one seed see the same noise. ``device``
    defaults to each generator's device.
    """
    if isinstance(generators, torch.Generator):
        raise ValueError(
            "generators must be a sequence with one torch.Generator per sample, got a single "
            "torch.Generator; wrap it in a list for a batch of one"
        )
    if len(generators) != shape[0]:
        raise ValueError(
            f"need one generator per sample: got {len(generators)} generators for a batch of "
            f"{shape[0]}"
        )
    rows = [
        torch.randn(
            tuple(shape[1:]),
            generator=g,
            device=g.device if device is None else device,
            dtype=torch.float32,
        )
        for g in generators
    ]
    return torch.stack(rows)  # [B, ...]


def gaussian_log_prob(
    x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float
) -> torch.Tensor:
    """``[B]`` log N(x; mean, std^2) per element, averaged over each sample's elements.

    Computed in float32 (float64 for float64 inputs), one sample at a time (batch invariant).
    ``std`` broadcasts against ``x`` (a float, ``[B, 1, ..., 1]`` or ``x``'s shape) and must be > 0.
    """
    dtype = _compute_dtype(x, mean)
    x, mean = x.to(dtype), mean.to(dtype)
    std = torch.as_tensor(std, dtype=dtype, device=x.device).broadcast_to(x.shape)
    rows = []
    for i in range(x.shape[0]):
        diff, s = x[i] - mean[i], std[i]
        rows.append((-(diff * diff) / (2 * s * s) - torch.log(s) - _LOG_SQRT_2PI).mean())
    return torch.stack(rows)  # [B]


def ode_step(
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
    *,
    noise_level: float = 0.0,
    noise: torch.Tensor | None = None,
    generators: Sequence[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """Euler step ``x' = x + v * dt``; deterministic: std 0, log_prob 0.

    ``noise_level``, ``noise`` and ``generators`` are accepted (so every step is called the same
    way) and ignored. With ``prev_sample`` the given sample is returned unchanged.
    """
    del noise_level, noise, generators
    x, v, t, t_next = _prepare(velocity, sigma, sigma_next, sample)
    mean = x + v * (t_next - t)  # [B, ...]
    out = mean if prev_sample is None else _checked("prev_sample", prev_sample, mean)
    zeros = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)  # [B]
    return StepOutput(out, zeros, mean, torch.zeros_like(t))


def sde_step(
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
    *,
    noise_level: float,
    noise: torch.Tensor | None = None,
    generators: Sequence[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """Flow-GRPO's SDE step (``sde_step_with_logprob``, ``sde_type="sde"``).

    ``s = a * sqrt(t / (1 - t))`` with ``a = noise_level``; at ``t = 1`` the denominator uses
    ``sigma_next`` instead (``1 - sigma_next``), exactly as Flow-GRPO substitutes ``sigmas[1]``,
    the sigma after 1. ``mean = x + (v + s^2 / (2t) * (x + (1 - t) v)) * dt``,
    ``x' = mean + s * sqrt(-dt) * eps``. ``noise_level = 0`` gives the Euler step.
    """
    _check_noise_level(noise_level)
    x, v, t, t_next = _prepare(velocity, sigma, sigma_next, sample)
    dt = t_next - t  # [B, 1, ...]

    # 1. Diffusion coefficient; at t = 1 the next sigma keeps 1 / (1 - t) finite.
    t_denominator = torch.where(t == 1, t_next, t)
    s = noise_level * torch.sqrt(t / (1 - t_denominator))  # [B, 1, ...]

    # 2. Transition mean and std.
    mean = x + (v + s * s / (2 * t) * (x + (1 - t) * v)) * dt  # [B, ...]
    std = s * torch.sqrt(-dt)  # [B, 1, ...]

    # 3. Next sample (drawn or replayed) and its log-probability.
    out = _next_sample(mean, std, noise, generators, prev_sample)
    return StepOutput(out, _transition_log_prob(out, mean, std), mean, std)


def cps_step(
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
    *,
    noise_level: float,
    noise: torch.Tensor | None = None,
    generators: Sequence[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    logprob_mode: str = "density",
) -> StepOutput:
    """Coefficient-preserving step (Flow-GRPO ``sde_type="cps"``).

    ``x0 = x - t v``, ``x1 = x + (1 - t) v``, ``s = sigma_next * sin(a pi / 2)`` with
    ``a = noise_level`` in [0, 1], ``mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - s^2) x1``,
    ``x' = mean + s * eps``.

    ``logprob_mode``: ``"density"`` (default), the true Gaussian log-density; ``"flow_grpo"``,
    ``-mean((x' - mean)^2)`` as the public Flow-GRPO code computes it (no ``1 / (2 s^2)``, no
    constants), which changes what a clip range means. At ``sigma_next = 0`` (the last step)
    ``s = 0``: the step is deterministic, ``prev_sample = mean = x0`` and the density-mode
    log-prob is 0.
    """
    _check_noise_level(noise_level)
    if noise_level > 1:
        raise ValueError(f"noise_level for cps must be in [0, 1], got {noise_level!r}")
    if logprob_mode not in LOGPROB_MODES:
        raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {logprob_mode!r}")
    x, v, t, t_next = _prepare(velocity, sigma, sigma_next, sample)

    # 1. Predicted clean sample and predicted noise.
    x0 = x - t * v  # [B, ...]
    x1 = x + (1 - t) * v  # [B, ...]

    # 2. Re-noise to sigma_next, moving a share s of the noise from x1 to fresh noise.
    std = t_next * math.sin(noise_level * math.pi / 2)  # [B, 1, ...]
    mean = (1 - t_next) * x0 + torch.sqrt((t_next * t_next - std * std).clamp_min(0)) * x1

    # 3. Next sample (drawn or replayed) and its log-probability.
    out = _next_sample(mean, std, noise, generators, prev_sample)
    if logprob_mode == "flow_grpo":
        log_prob = _flow_grpo_log_prob(out, mean)
    else:
        log_prob = _transition_log_prob(out, mean, std)
    return StepOutput(out, log_prob, mean, std)


def dance_step(
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
    *,
    noise_level: float,
    noise: torch.Tensor | None = None,
    generators: Sequence[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """DanceGRPO's SDE step (``flux_step`` with ``sde_solver=True``).

    ``x0 = x - t v``, ``score = -(x - (1 - t) x0) / t^2``,
    ``mean = x + v dt - (a^2 / 2) score dt``, ``std = a sqrt(-dt)`` with ``a = noise_level``.
    The log-prob is the full Gaussian density (DanceGRPO's code drops the constant terms by a
    line-break slip; they do not change ratios).
    """
    _check_noise_level(noise_level)
    x, v, t, t_next = _prepare(velocity, sigma, sigma_next, sample)
    dt = t_next - t  # [B, 1, ...]

    # 1. Score of the noisy marginal from the predicted clean sample.
    x0 = x - t * v  # [B, ...]
    score = -(x - (1 - t) * x0) / (t * t)  # [B, ...]

    # 2. Transition mean and std.
    mean = x + v * dt - (0.5 * noise_level * noise_level) * score * dt  # [B, ...]
    std = noise_level * torch.sqrt(-dt)  # [B, 1, ...]

    # 3. Next sample (drawn or replayed) and its log-probability.
    out = _next_sample(mean, std, noise, generators, prev_sample)
    return StepOutput(out, _transition_log_prob(out, mean, std), mean, std)


STEPS: dict[str, StepFn] = {
    "ode": ode_step,
    "sde": sde_step,
    "cps": cps_step,
    "dance": dance_step,
}
"""Step functions by the name used in config (``algo.sde_type``; ``"ode"`` for evaluation)."""


def get_step(name: str) -> StepFn:
    """The step function registered as ``name``; ValueError listing the known names otherwise."""
    if name not in STEPS:
        raise ValueError(f"unknown sampling step {name!r}; known steps: {sorted(STEPS)}")
    return STEPS[name]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _prepare(
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast to the compute dtype; sigmas become per-sample columns ``[B, 1, ..., 1]``."""
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity and sample must have one shape, got {tuple(velocity.shape)} and "
            f"{tuple(sample.shape)}"
        )
    if sample.ndim < 1:
        raise ValueError("sample must have a batch dimension: [B, ...]")
    dtype = _compute_dtype(sample, velocity)
    t = _per_sample("sigma", sigma, sample, dtype)
    t_next = _per_sample("sigma_next", sigma_next, sample, dtype)
    return sample.to(dtype), velocity.to(dtype), t, t_next


def _per_sample(
    name: str, value: torch.Tensor | float, sample: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    batch = sample.shape[0]
    column = torch.as_tensor(value, dtype=dtype, device=sample.device)
    if column.ndim == 0:
        column = column.expand(batch)
    elif column.shape != (batch,):
        raise ValueError(
            f"{name} must be a scalar or a [B] tensor with B={batch}, got shape "
            f"{tuple(column.shape)}"
        )
    return column.reshape(batch, *([1] * (sample.ndim - 1)))  # [B, 1, ...]


def _check_noise_level(noise_level: float) -> None:
    try:
        ok = math.isfinite(float(noise_level)) and float(noise_level) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"noise_level must be a finite float >= 0, got {noise_level!r}")


def _checked(name: str, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if tensor.shape != like.shape:
        raise ValueError(
            f"{name} must have the sample's shape {tuple(like.shape)}, got {tuple(tensor.shape)}"
        )
    return tensor.to(device=like.device, dtype=like.dtype)


def _next_sample(
    mean: torch.Tensor,
    std: torch.Tensor,
    noise: torch.Tensor | None,
    generators: Sequence[torch.Generator] | None,
    prev_sample: torch.Tensor | None,
) -> torch.Tensor:
    """The replayed ``prev_sample``, or ``mean + std * noise`` with the given or drawn noise."""
    if prev_sample is not None:
        if noise is not None or generators is not None:
            raise ValueError(
                "pass prev_sample (replay) or noise/generators (sampling), not both"
            )
        return _checked("prev_sample", prev_sample, mean)
    if noise is not None and generators is not None:
        raise ValueError("pass noise or generators, not both")
    if generators is not None:
        noise = randn_per_sample(generators, mean.shape)  # on the generators' device
    if noise is None:
        raise ValueError(
            "a stochastic step needs noise= (drawn per sample), generators= (one per sample) "
            "or prev_sample= (replay)"
        )
    return mean + std * _checked("noise", noise, mean)


def _transition_log_prob(
    prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """Gaussian log-prob ``[B]`` of the detached ``prev_sample``; 0 for rows with ``std == 0``."""
    deterministic = std == 0  # [B, 1, ...]
    safe_std = torch.where(deterministic, torch.ones_like(std), std)  # no NaN in any gradient
    log_prob = gaussian_log_prob(prev_sample.detach(), mean, safe_std)  # [B]
    return torch.where(deterministic.reshape(-1), torch.zeros_like(log_prob), log_prob)


def _flow_grpo_log_prob(prev_sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's CPS "log-prob": ``-mean((x' - mean)^2)`` per sample, no scale, no constants."""
    prev_sample = prev_sample.detach()
    rows = [-((prev_sample[i] - mean[i]) ** 2).mean() for i in range(mean.shape[0])]
    return torch.stack(rows)  # [B]
