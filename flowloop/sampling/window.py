"""The SDE window: which sampling steps are stochastic (and carry log-probs) in one rollout.

Flow-GRPO-Fast and MixGRPO sample with the SDE on a few consecutive steps only and take plain
Euler (ODE) steps elsewhere; only the window's steps are trained. The window is drawn per request
from the request's generator, so a rollout is reproducible from its seed.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

__all__ = ["sde_window"]


def sde_window(
    num_steps: int,
    window_size: int | None,
    window_range: Sequence[int] | None,
    generator: torch.Generator | None,
) -> range:
    """The step indices ``range(start, start + window_size)`` that run the SDE.

    Args:
        num_steps: sampling steps in the rollout; steps are ``0 .. num_steps - 1``.
        window_size: ``sde_window_size``, consecutive SDE steps. ``None`` (or 0, as Flow-GRPO
            writes it) means every step but the last: ``range(0, num_steps - 1)``; the last step
            lands on the clean sample, where the Gaussian is too sharp to train on.
        window_range: ``sde_window_range = (lo, hi)``: the window lies inside steps
            ``[lo, hi)``, so its start is drawn uniformly from ``lo .. hi - window_size``
            (both ends included), as Flow-GRPO's ``random.randint(lo, hi - size)``; e.g. size 2 in
            ``(0, 10)`` gives one of ``(0, 2), (1, 3), ..., (8, 10)``. Needs
            ``0 <= lo`` and ``lo + window_size <= hi <= num_steps``. Unused when ``window_size``
            is None.
        generator: draws the start (one ``torch.randint``); unused when ``window_size`` is None.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    # 1. No size: every step but the last.
    if window_size is None or window_size == 0:
        return range(0, num_steps - 1)

    # 2. Validate the size and the range against the schedule.
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 0:
        raise ValueError(
            f"sde_window_size must be None or an int in [1, num_steps={num_steps}], "
            f"got {window_size!r}"
        )
    if window_size > num_steps:
        raise ValueError(
            f"sde_window_size must be <= num_steps={num_steps}, got {window_size}"
        )
    lo, hi = _check_range(window_range, num_steps, window_size)
    if generator is None:
        raise ValueError("sde_window needs the request's torch.Generator to draw the window start")

    # 3. One draw: start uniform in lo .. hi - window_size.
    offset = torch.randint(
        0, hi - window_size - lo + 1, (1,), generator=generator, device=generator.device
    )
    start = lo + int(offset.item())
    return range(start, start + window_size)


def _check_range(
    window_range: Sequence[int] | None, num_steps: int, window_size: int
) -> tuple[int, int]:
    bounds = (
        f"0 <= lo and lo + sde_window_size <= hi <= num_steps, here "
        f"sde_window_size={window_size}, num_steps={num_steps}"
    )
    if window_range is None or len(window_range) != 2:
        raise ValueError(
            f"sde_window_range must be a pair (lo, hi) with {bounds}; got {window_range!r}"
        )
    try:
        lo, hi = (operator.index(b) for b in window_range)
    except TypeError:
        raise ValueError(
            f"sde_window_range must hold two ints with {bounds}; got {window_range!r}"
        ) from None
    if lo < 0 or lo + window_size > hi or hi > num_steps:
        raise ValueError(
            f"sde_window_range={tuple(window_range)!r} does not fit the window: need {bounds}"
        )
    return lo, hi
