"""FlowGRPO's loss for one trained step, DiffusionNFT's loss, the KL penalty, and the guard
against non-finite losses.

One trained denoising step of a batch of trajectories gives, per sample, the replayed log-prob
``logp`` (current weights), the rollout's ``logp_old`` and the sample's advantage ``A``:

    A      = clamp(A, -adv_clip_max, adv_clip_max)
    ratio  = exp(logp - logp_old)
    loss   = mean_B( max(-A * ratio, -A * clamp(ratio, 1 - clip_range, 1 + clip_range)) )

and, with a KL coefficient ``beta > 0``, ``loss + beta * mean_B(kl_loss(...))`` (the actor adds
it). Published defaults: ``clip_range = 1e-4``, ``adv_clip_max = 5``, ``beta = 0.04``.

`nft_loss` is DiffusionNFT's objective (Zheng et al., 2025), which needs no log-probs: it trains
the flow-matching loss on the rollout's clean samples, noised again at a drawn time.
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = ["KL_MODES", "NonFiniteGuard", "NonFiniteLossError", "flow_grpo_loss", "kl_loss", "nft_loss", "noised"]

logger = logging.getLogger(__name__)

KL_MODES = ("flow_grpo", "exact")
"""`kl_loss` modes: Flow-GRPO's code ("flow_grpo") or the Gaussian KL of the transitions ("exact")."""


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss (a scalar) and detached diagnostics.

    ``log_prob [B]`` carries the gradient; ``old_log_prob [B]`` and ``advantages [B]`` are
    treated as constants (detached here). Any shape works as long as the three agree (e.g.
    ``[B, W]`` for W trained steps at once); the loss is the mean over every element, each
    multiplied by its entry of ``weights`` (a constant of the same shape) when given.

    Diagnostics (0-d, detached): ``ratio_mean``, ``clip_frac`` (share with
    ``|ratio - 1| > clip_range``), ``clip_frac_high`` / ``clip_frac_low`` (ratio above
    ``1 + clip_range`` / below ``1 - clip_range``), ``approx_kl`` (``0.5 * mean((logp - logp_old)^2)``),
    ``adv_clamped_frac`` (share of advantages the clamp changed).
    """
    if not (isinstance(clip_range, (int, float)) and clip_range > 0 and math.isfinite(clip_range)):
        raise ValueError(f"clip_range must be a finite float > 0, got {clip_range!r}")
    if not (isinstance(adv_clip_max, (int, float)) and adv_clip_max > 0):
        raise ValueError(f"adv_clip_max must be a float > 0 (inf disables the clamp), got {adv_clip_max!r}")
    if not log_prob.shape == old_log_prob.shape == advantages.shape:
        raise ValueError(
            "log_prob, old_log_prob and advantages must have one shape, got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)} and {tuple(advantages.shape)}"
        )
    if weights is not None and weights.shape != log_prob.shape:
        raise ValueError(f"weights must have log_prob's shape {tuple(log_prob.shape)}, got {tuple(weights.shape)}")
    old_log_prob, advantages = old_log_prob.detach(), advantages.detach()

    # 1. Clamp the advantages, then the PPO ratio and its clipped twin.
    clamped = advantages.clamp(-adv_clip_max, adv_clip_max)  # [B]
    log_ratio = log_prob - old_log_prob  # [B]
    ratio = torch.exp(log_ratio)  # [B]
    unclipped_loss = -clamped * ratio  # [B]
    clipped_loss = -clamped * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)  # [B]

    # 2. Pessimistic (larger) of the two, averaged over the batch.
    per_element = torch.maximum(unclipped_loss, clipped_loss)
    loss = (per_element if weights is None else per_element * weights.detach()).mean()

    with torch.no_grad():
        ratio_d = ratio.detach()
        diagnostics = {
            "ratio_mean": ratio_d.mean(),
            "clip_frac": ((ratio_d - 1.0).abs() > clip_range).float().mean(),
            "clip_frac_high": (ratio_d - 1.0 > clip_range).float().mean(),
            "clip_frac_low": (1.0 - ratio_d > clip_range).float().mean(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
            "adv_clamped_frac": (clamped != advantages).float().mean(),
        }
    return loss, diagnostics


def noised(sample: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward process ``x_t = (1 - t) x0 + t noise`` for ``sample``/``noise [B, ...]``, ``t [B]``."""
    t = t.reshape(t.shape[0], *([1] * (sample.ndim - 1))).to(sample.dtype)  # [B, 1, ...]
    return (1 - t) * sample + t * noise


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    sample: torch.Tensor,
    noisy: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's loss (a scalar) at one noise level per row, and detached diagnostics.

    ``sample [B, ...]`` is the rollout's clean latent x0, ``noisy [B, ...]`` the denoiser's input
    ``noised(sample, noise, t)`` at noise level ``t [B]``, ``velocity`` its prediction with the
    current weights (carries the gradient) and ``old_velocity`` with the weights that sampled (a
    constant). With ``r = 1/2 + clamp(A, -c, c) / (2c)`` (``c =
    adv_clip_max``) the share of "good" in the row, the implicit positive and negative policies

        v+ = (1 - beta) v_old + beta v        v- = (1 + beta) v_old - beta v

    are fitted to the flow-matching target with weights r and 1 - r:
    ``loss = mean_B(r * e(v+) + (1 - r) * e(v-))``. ``e`` is the squared error of the x0 the
    velocity implies (``x_t - t v``), averaged over elements and divided by the old policy's mean
    absolute x0 error (DiffusionNFT's adaptive weighting: no row or noise level dominates by scale).

    Why it can learn faster than a policy gradient: expanding the squares, each row's loss is (up
    to its weight) ``const + 2 beta (2r - 1) <v - v_old, v_old - target> + beta^2 |v - v_old|^2``:
    a pull of the velocity towards its own sample's flow-matching target (a push away for
    r < 1/2) with a built-in trust region around v_old, and no sampler noise in the gradient.

    Diagnostics: ``nft_r_mean`` (mean r), ``nft_old_error`` (the old policy's mean x0 squared
    error), ``nft_drift`` (mean squared ``v - v_old``), ``adv_clamped_frac``.
    """
    if not (isinstance(beta, (int, float)) and beta > 0 and math.isfinite(beta)):
        raise ValueError(f"beta must be a finite float > 0, got {beta!r}")
    if not (isinstance(adv_clip_max, (int, float)) and 0 < adv_clip_max < math.inf):
        raise ValueError(f"adv_clip_max must be a finite float > 0 for nft_loss, got {adv_clip_max!r}")
    if not velocity.shape == old_velocity.shape == sample.shape == noisy.shape:
        raise ValueError("velocity, old_velocity, sample and noisy must have one shape, got "
                         f"{[tuple(x.shape) for x in (velocity, old_velocity, sample, noisy)]}")
    batch = velocity.shape[0]
    if advantages.shape != (batch,) or t.shape != (batch,):
        raise ValueError(f"advantages and t must be [B] with B={batch}, got {tuple(advantages.shape)} and {tuple(t.shape)}")
    old_velocity, advantages = old_velocity.detach(), advantages.detach()
    t_ = t.detach().reshape(batch, *([1] * (velocity.ndim - 1))).to(velocity.dtype)  # [B, 1, ...]

    def x0_error(v: torch.Tensor) -> torch.Tensor:  # [B, ...]
        return noisy - t_ * v - sample

    # 1. r in [0, 1] from the clamped advantage; the two implicit policies.
    clamped = advantages.clamp(-adv_clip_max, adv_clip_max)  # [B]
    r = 0.5 + clamped / (2 * adv_clip_max)  # [B]
    positive = (1 - beta) * old_velocity + beta * velocity
    negative = (1 + beta) * old_velocity - beta * velocity

    # 2. Self-normalized x0 errors, weighted by r and 1 - r.
    scale = x0_error(old_velocity).abs().reshape(batch, -1).mean(dim=1).clamp_min(1e-5)  # [B]
    pos_err = x0_error(positive).pow(2).reshape(batch, -1).mean(dim=1) / scale  # [B]
    neg_err = x0_error(negative).pow(2).reshape(batch, -1).mean(dim=1) / scale  # [B]
    loss = (r * pos_err + (1 - r) * neg_err).mean()

    with torch.no_grad():
        diagnostics = {
            "nft_r_mean": r.mean(),
            "nft_old_error": x0_error(old_velocity).pow(2).mean(),
            "nft_drift": (velocity.detach() - old_velocity).pow(2).mean(),
            "adv_clamped_frac": (clamped != advantages).float().mean(),
        }
    return loss, diagnostics


def kl_loss(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: torch.Tensor | float,
    dt: torch.Tensor | float | None = None,
    mode: str = "flow_grpo",
) -> torch.Tensor:
    """``[B]`` KL penalty between the policy's and the reference's transition at one step.

    ``mean``, ``ref_mean``: ``[B, ...]`` transition means (``StepOutput.mean`` of the policy and
    of the reference on the same input); ``ref_mean`` is detached here. ``std``: the step's full
    transition std as the step functions return it (``StepOutput.std``, ``[B, 1, ..., 1]``, ``[B]``
    or a float). ``dt``: ``sigma_next - sigma`` (< 0), a float or ``[B]``, or None.

    - ``mode="flow_grpo"`` (default): ``mean over elements of (mean - ref_mean)^2 / (2 s^2)`` with
      ``s = std / sqrt(-dt)`` when ``dt`` is given, ``s = std`` when it is None. That is Flow-GRPO's
      code: for the ``sde`` step pass ``dt`` (its ``std_dev_t`` lacks the ``sqrt(-dt)`` factor),
      for ``cps`` pass ``dt=None`` (its ``std_dev_t`` is the full std).
    - ``mode="exact"``: the KL of the two Gaussians ``N(mean, std^2)`` and ``N(ref_mean, std^2)``
      per element, averaged over elements (as the log-probs are): ``(mean - ref_mean)^2 / (2 std^2)``
      with the full ``std``; ``dt`` is not used.

    Computed in float32 (float64 for float64 inputs). Rows whose ``std`` is 0 (deterministic
    steps, which are never trained) give 0 rather than inf or NaN.
    """
    if mode not in KL_MODES:
        raise ValueError(f"kl mode must be one of {KL_MODES}, got {mode!r}")
    if mean.shape != ref_mean.shape or mean.ndim < 1:
        raise ValueError(
            f"mean and ref_mean must have one shape [B, ...], got {tuple(mean.shape)} and {tuple(ref_mean.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(mean.dtype, ref_mean.dtype), torch.float32)
    batch = mean.shape[0]
    s = _per_sample("std", std, batch, dtype, mean.device)  # [B]
    if mode == "flow_grpo" and dt is not None:
        dt = _per_sample("dt", dt, batch, dtype, mean.device)  # [B]
        s = s / torch.sqrt(-dt)
    sq = ((mean.to(dtype) - ref_mean.detach().to(dtype)) ** 2).reshape(batch, -1).mean(dim=1)  # [B]
    deterministic = s == 0
    safe_s = torch.where(deterministic, torch.ones_like(s), s)  # no NaN in any gradient
    return torch.where(deterministic, torch.zeros_like(sq), sq / (2 * safe_s * safe_s))  # [B]


class NonFiniteLossError(RuntimeError):
    """Raised by `NonFiniteGuard` after too many updates in a row with non-finite steps."""


class NonFiniteGuard:
    """Stops a run after ``max_consecutive`` updates in a row whose optimizer steps were skipped
    for a non-finite loss or gradient norm.

    The actor itself skips such a step before it touches the weights (and reports the count as
    ``actor/skipped_nonfinite``); the guard sees one update at a time: ``guard.record(skipped,
    step)``. An update without skipped steps resets the consecutive count; the
    ``max_consecutive``-th update in a row with some raises `NonFiniteLossError`. Save
    `state_dict` in checkpoints to keep ``skipped`` across a resume.
    """

    def __init__(self, max_consecutive: int = 3):
        if not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"max_consecutive must be an int >= 1, got {max_consecutive!r}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        """Updates with skipped steps since the last clean one."""
        self.skipped = 0
        """Optimizer steps skipped in the whole run."""

    def record(self, skipped: int, step: int | None = None) -> bool:
        """True when the update skipped no optimizer step; False (go on) or `NonFiniteLossError`
        (stop) otherwise."""
        if not skipped:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += int(skipped)
        where = f" at step {step}" if step is not None else ""
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"non-finite loss or gradient{where}, {self.consecutive} updates in a row; stopping. "
                "Check the learning rate, the rewards and the log-probs (the rollout-correction metric)."
            )
        logger.warning(
            "%d optimizer step(s) skipped for a non-finite loss or gradient%s (%d updates in a row, %d steps "
            "skipped in total; stop at %d in a row)", skipped, where, self.consecutive, self.skipped, self.max_consecutive,
        )
        return False

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.skipped = int(state["consecutive"]), int(state["skipped"])


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _per_sample(name: str, value, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A float, ``[B]`` or ``[B, 1, ..., 1]`` value as a ``[B]`` tensor."""
    column = torch.as_tensor(value, dtype=dtype, device=device)
    if column.ndim == 0:
        return column.expand(batch)
    if column.shape[0] != batch or column.numel() != batch:
        raise ValueError(
            f"{name} must be a float, [B] or [B, 1, ..., 1] with B={batch}, got shape {tuple(column.shape)}"
        )
    return column.reshape(batch)

