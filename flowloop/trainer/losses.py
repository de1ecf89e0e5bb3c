"""FlowGRPO's loss for one trained step, its KL penalty, and the guard against non-finite losses.

One trained denoising step of a batch of trajectories gives, per sample, the replayed log-prob
``logp`` (current weights), the rollout's ``logp_old`` and the sample's advantage ``A``:

    A      = clamp(A, -adv_clip_max, adv_clip_max)
    ratio  = exp(logp - logp_old)
    loss   = mean_B( max(-A * ratio, -A * clamp(ratio, 1 - clip_range, 1 + clip_range)) )

and, with a KL coefficient ``beta > 0``, ``loss + beta * mean_B(kl_loss(...))`` (the recipe adds
it). Published defaults: ``clip_range = 1e-4``, ``adv_clip_max = 5``, ``beta = 0.04``.
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = ["KL_MODES", "NonFiniteGuard", "NonFiniteLossError", "flow_grpo_loss", "kl_loss"]

logger = logging.getLogger(__name__)

KL_MODES = ("flow_grpo", "exact")
"""`kl_loss` modes: Flow-GRPO's code ("flow_grpo") or the Gaussian KL of the transitions ("exact")."""


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss (a scalar) and detached diagnostics.

    ``log_prob [B]`` carries the gradient; ``old_log_prob [B]`` and ``advantages [B]`` are
    treated as constants (detached here). Any shape works as long as the three agree (e.g.
    ``[B, W]`` for W trained steps at once); the loss is the mean over every element.

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
    old_log_prob, advantages = old_log_prob.detach(), advantages.detach()

    # 1. Clamp the advantages, then the PPO ratio and its clipped twin.
    clamped = advantages.clamp(-adv_clip_max, adv_clip_max)  # [B]
    log_ratio = log_prob - old_log_prob  # [B]
    ratio = torch.exp(log_ratio)  # [B]
    unclipped_loss = -clamped * ratio  # [B]
    clipped_loss = -clamped * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)  # [B]

    # 2. Pessimistic (larger) of the two, averaged over the batch.
    loss = torch.maximum(unclipped_loss, clipped_loss).mean()

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
    """Raised by `NonFiniteGuard` after too many non-finite losses in a row."""


class NonFiniteGuard:
    """Skips steps whose loss is NaN or inf and stops the run after ``max_consecutive`` in a row.

    Call ``guard.check(loss, step)`` before ``backward``: True means go on; False means skip this
    step (a warning is logged and ``skipped`` counted); the ``max_consecutive``-th non-finite loss
    in a row raises `NonFiniteLossError`. A finite loss resets the consecutive count. Save
    `state_dict` in checkpoints to keep ``skipped`` across a resume.
    """

    def __init__(self, max_consecutive: int = 3):
        if not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"max_consecutive must be an int >= 1, got {max_consecutive!r}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        """Non-finite losses since the last finite one."""
        self.skipped = 0
        """Steps skipped in the whole run (log it as ``skipped_steps``)."""

    def check(self, loss: torch.Tensor, step: int | None = None) -> bool:
        """True when ``loss`` is finite; False (skip) or `NonFiniteLossError` (stop) otherwise."""
        if bool(torch.isfinite(loss.detach()).all()):
            self.consecutive = 0
            return True
        self.consecutive += 1
        where = f" at step {step}" if step is not None else ""
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"loss was non-finite ({_loss_text(loss)}){where}, {self.consecutive} times in a row; stopping. "
                "Check the learning rate, the rewards and the log-probs (the rollout-correction metric)."
            )
        self.skipped += 1
        logger.warning(
            "non-finite loss (%s)%s: skipping the update (%d in a row, %d skipped in total; stop at %d in a row)",
            _loss_text(loss), where, self.consecutive, self.skipped, self.max_consecutive,
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


def _loss_text(loss: torch.Tensor) -> str:
    return str(loss.detach().item()) if loss.numel() == 1 else "non-finite entries"
