"""Classifier-free guidance: mixing the conditional and unconditional velocities.

``v = v_uncond + g * (v_cond - v_uncond)``. "True CFG" (Qwen-Image's ``true_cfg_scale``, FLUX with a
negative prompt) is the same formula with ``v_uncond`` predicted from the negative prompt instead of
the empty one. Guidance-distilled models (FLUX.1-dev) take the scale as a model input instead and
need no second pass: give them ``guidance_scale <= 1`` here.
"""

from __future__ import annotations

import torch

__all__ = ["apply_cfg", "needs_uncond"]


def needs_uncond(guidance_scale: float) -> bool:
    """Whether CFG needs the unconditional (or negative-prompt) pass: ``guidance_scale > 1``."""
    return guidance_scale > 1


def apply_cfg(
    v_cond: torch.Tensor, v_uncond: torch.Tensor | None, guidance_scale: float
) -> torch.Tensor:
    """``v_uncond + guidance_scale * (v_cond - v_uncond)``; ``v_cond`` itself when scale <= 1.

    With ``guidance_scale <= 1`` no unconditional pass is needed and ``v_uncond`` may be None.
    Elementwise, so a sample's result never depends on its batch neighbours.
    """
    if not needs_uncond(guidance_scale):
        return v_cond
    if v_uncond is None:
        raise ValueError(
            f"guidance_scale={guidance_scale} > 1 needs v_uncond (the unconditional or "
            f"negative-prompt velocity), got None"
        )
    if v_uncond.shape != v_cond.shape:
        raise ValueError(
            f"v_cond and v_uncond must have one shape, got {tuple(v_cond.shape)} and "
            f"{tuple(v_uncond.shape)}"
        )
    return v_uncond + guidance_scale * (v_cond - v_uncond)
