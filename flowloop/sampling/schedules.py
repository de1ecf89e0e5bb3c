"""Sigma schedules for flow-matching samplers.

Time convention (used throughout flowloop): ``x_t = (1 - t) * x0 + t * eps`` with sigma = t in
[0, 1]; sampling runs from t = 1 (pure noise) to t = 0 (data). A schedule is a float32 tensor
``[num_steps + 1]`` that starts at 1 and ends at exactly 0; step ``i`` moves from ``sigmas[i]`` to
``sigmas[i + 1]``.

Two shifts move the grid towards high noise, as the real models expect:

- SD3 / SD3.5 ("linear" time shift in diffusers): ``s * t / (1 + (s - 1) * t)``, a fixed ``shift``.
- FLUX / Qwen-Image ("exponential", resolution dependent): ``mu`` is interpolated from the image
  token count (``resolution_shift_mu``), then ``exp(mu) / (exp(mu) + (1 / t - 1))``.

Qwen-Image's scheduler also stretches the shifted grid so its last non-zero sigma is
``shift_terminal`` (`stretch_to_terminal`), as diffusers' ``stretch_shift_to_terminal`` does.

The unshifted grid is ``linspace(1, 0, num_steps + 1)``, the same points as the FLUX and Qwen-Image
pipelines (``linspace(1, 1 / N, N)`` plus a final 0). diffusers' SD3 scheduler instead ends its
grid at ``sigma_min`` (about 1e-3) before the final 0; the difference is in the last step only.
"""

from __future__ import annotations

import math

import torch

__all__ = ["resolution_shift_mu", "sigmas", "stretch_to_terminal", "time_shift_exponential", "time_shift_linear"]


def time_shift_linear(shift: float, t: torch.Tensor | float) -> torch.Tensor | float:
    """SD3-style shift ``shift * t / (1 + (shift - 1) * t)``; maps 0 to 0 and 1 to 1.

    ``shift > 1`` spends more steps at high noise. Equal to diffusers' ``time_shift_type="linear"``
    with ``mu = shift``.
    """
    _check_positive("shift", shift)
    return shift * t / (1 + (shift - 1) * t)


def time_shift_exponential(mu: float, t: torch.Tensor | float) -> torch.Tensor | float:
    """FLUX / Qwen-Image shift ``exp(mu) / (exp(mu) + (1 / t - 1))``; maps 0 to 0 and 1 to 1.

    Equal to ``time_shift_linear(exp(mu), t)``; written in the models' form. ``t = 0`` gives 0
    (the formula's limit) instead of dividing by zero.
    """
    if not math.isfinite(mu):
        raise ValueError(f"mu must be a finite number, got {mu!r}")
    e = math.exp(mu)
    if isinstance(t, torch.Tensor):
        safe_t = torch.where(t > 0, t, torch.ones_like(t))
        return torch.where(t > 0, e / (e + (1 / safe_t - 1)), torch.zeros_like(t))
    return e / (e + (1 / t - 1)) if t > 0 else 0.0


def resolution_shift_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """``mu`` for ``time_shift_exponential``, linear in the image token count.

    The line passes through ``(base_seq_len, base_shift)`` and ``(max_seq_len, max_shift)`` and is
    extrapolated outside them, as diffusers' ``calculate_shift`` does. Defaults are FLUX.1's;
    Qwen-Image uses ``max_seq_len=8192, max_shift=0.9``. ``image_seq_len`` is the number of
    denoiser tokens: ``(H / vae_scale / patch) * (W / vae_scale / patch)``, e.g. 4096 for a
    1024x1024 FLUX image (mu = 1.15).
    """
    if image_seq_len <= 0:
        raise ValueError(f"image_seq_len must be > 0, got {image_seq_len!r}")
    if max_seq_len <= base_seq_len:
        raise ValueError(
            f"max_seq_len must be > base_seq_len, got max_seq_len={max_seq_len!r}, "
            f"base_seq_len={base_seq_len!r}"
        )
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def stretch_to_terminal(t: torch.Tensor, shift_terminal: float) -> torch.Tensor:
    """Scale ``1 - t`` so the grid's last point becomes ``shift_terminal`` (its first stays 1).

    ``t``: the non-zero sigmas ``[N]`` (without the final 0). A model trained with this stretch
    never sees the smallest sigmas the plain grid would end on.
    """
    if not 0 < shift_terminal < 1:
        raise ValueError(f"shift_terminal must be in (0, 1), got {shift_terminal!r}")
    one_minus = 1 - t
    return 1 - one_minus / (one_minus[-1] / (1 - shift_terminal))


def sigmas(
    num_steps: int,
    shift: float = 1.0,
    *,
    mu: float | None = None,
    shift_terminal: float | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The sigma grid ``[num_steps + 1]`` (float32) from 1 down to exactly 0.

    Args:
        num_steps: number of sampling steps, >= 1.
        shift: SD3-style shift (``time_shift_linear``); 1.0 leaves the linear grid unchanged.
        mu: FLUX / Qwen-Image resolution shift (``time_shift_exponential``), usually from
            ``resolution_shift_mu``. Give ``shift`` or ``mu``, not both.
        shift_terminal: after the shift, stretch the grid to end (before 0) at this sigma
            (`stretch_to_terminal`); None leaves it.
        device: where the returned tensor lives.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    _check_positive("shift", shift)
    if mu is not None and shift != 1.0:
        raise ValueError(
            f"pass either shift (SD3 style) or mu (FLUX/Qwen-Image style), not both; "
            f"got shift={shift!r}, mu={mu!r}"
        )
    # Computed in float64 so the float32 result is the correctly rounded value of the formula.
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # [N+1]
    if mu is not None:
        t = time_shift_exponential(mu, t)
    elif shift != 1.0:
        t = time_shift_linear(shift, t)
    if shift_terminal is not None:
        t = torch.cat([stretch_to_terminal(t[:-1], shift_terminal), t[-1:]])  # [N+1], the final 0 kept
    return t.to(device=device, dtype=torch.float32)


def _check_positive(name: str, value: float) -> None:
    try:
        ok = math.isfinite(float(value)) and float(value) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
