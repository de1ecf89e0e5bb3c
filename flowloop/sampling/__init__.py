"""Pure tensor functions for sampling flow-matching models (imports torch only).

Time convention: ``x_t = (1 - t) * x0 + t * eps``, sigma = t in [0, 1], sampling from t = 1 to 0,
velocity ``v ~ eps - x0``, ``dt = sigma_next - sigma < 0``.

- ``schedules``: sigma grids with the SD3 shift or the FLUX / Qwen-Image resolution shift.
- ``steps``: ODE / SDE / CPS / Dance steps with per-sample log-probs, and their registry.
- ``window``: which steps run the SDE.
- ``cfg``: classifier-free guidance.
"""

from flowloop.sampling.cfg import apply_cfg, needs_uncond
from flowloop.sampling.schedules import (
    resolution_shift_mu,
    sigmas,
    time_shift_exponential,
    time_shift_linear,
)
from flowloop.sampling.steps import (
    LOGPROB_MODES,
    STEPS,
    StepFn,
    StepOutput,
    cps_step,
    dance_step,
    gaussian_log_prob,
    get_step,
    ode_step,
    randn_per_sample,
    sde_step,
)
from flowloop.sampling.window import sde_window

__all__ = [
    "LOGPROB_MODES",
    "STEPS",
    "StepFn",
    "StepOutput",
    "apply_cfg",
    "cps_step",
    "dance_step",
    "gaussian_log_prob",
    "get_step",
    "needs_uncond",
    "ode_step",
    "randn_per_sample",
    "resolution_shift_mu",
    "sde_step",
    "sde_window",
    "sigmas",
    "time_shift_exponential",
    "time_shift_linear",
]
