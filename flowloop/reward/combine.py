"""``combined``: a weighted sum of other rewards, each part logged on its own.

Configured through ``reward.kwargs``: ``components`` maps a label to a weight, or to
``{weight, reward, kwargs}`` when the part needs kwargs or the same reward appears twice
(``reward`` defaults to the label and may be ``module:function``):

    rollout:
      reward:
        name: combined
        kwargs:
          components:
            shapes: 1.0
            jpeg_compressibility: 0.1
            ocr_server: {weight: 0.5, reward: remote, kwargs: {url: "http://10.0.0.2:8000"}}
          device: cuda:0   # optional: given to every part that takes `device` and sets none

or on the command line ``rollout.reward.name=combined
rollout.reward.kwargs.components.shapes=1.0 rollout.reward.kwargs.components.jpeg_compressibility=0.1``.

The score is ``sum(weight * part score)``. Each row's extra info holds, per label ``c``,
``reward/c`` (the part's raw, unweighted score) and ``reward/c/<key>`` for each key of the
part's own extra info, so the trainer logs ``reward/shapes``, ``reward/shapes/correct``,
``reward/jpeg_compressibility``... Parts run concurrently (sync ones in threads). A part that
raises, or returns a wrong count or a non-finite score, fails the batch with an error naming
the part; `RewardWorker` then re-scores row by row, so only the bad rows fail.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowloop.reward.registry import RewardFn, build_reward, is_async, register_reward

SPEC_KEYS = ("weight", "reward", "kwargs")


@dataclass(frozen=True)
class Part:
    """One component: its label (the extra-info prefix), reward name, weight and built function."""

    label: str
    reward: str
    weight: float
    fn: RewardFn

    def __str__(self) -> str:
        return f"component {self.label!r}" + (f" (reward {self.reward!r})" if self.reward != self.label else "")


@register_reward("combined", factory=True)
def combined(components: Mapping[str, Any], device: str | None = None) -> RewardFn:
    """Build every part once; returns the async batched function summing them."""
    if not isinstance(components, Mapping) or not components:
        raise ValueError(f"reward 'combined' needs components {{label: weight, ...}}, got {components!r}")
    parts = [_build_part(str(label), spec, device) for label, spec in components.items()]

    async def score(images, prompts, metadata):
        results = await asyncio.gather(*(_run(part, images, prompts, metadata) for part in parts), return_exceptions=True)
        for result in results:  # the first failing part, in config order
            if isinstance(result, BaseException):
                raise result
        totals = [0.0] * len(prompts)
        extra: list[dict[str, Any]] = [{} for _ in prompts]
        for part, (scores, infos) in zip(parts, results):
            for i, (value, info) in enumerate(zip(scores, infos)):
                totals[i] += part.weight * value
                extra[i][f"reward/{part.label}"] = value
                extra[i].update({f"reward/{part.label}/{key}": v for key, v in info.items()})
        return totals, extra

    return score


def _build_part(label: str, spec: Any, device: str | None) -> Part:
    """``label: weight`` or ``label: {weight, reward, kwargs}`` -> a built `Part`."""
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(SPEC_KEYS))
        if unknown or "weight" not in spec:
            raise ValueError(f"combined component {label!r}: expected a weight or {{weight, reward, kwargs}}, "
                             f"got keys {sorted(spec)}")
        weight, reward, kwargs = spec["weight"], str(spec.get("reward", label)), dict(spec.get("kwargs") or {})
    else:
        weight, reward, kwargs = spec, label, {}
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"combined component {label!r}: weight must be a finite number, got {weight!r}")
    return Part(label, reward, float(weight), build_reward(reward, kwargs, default_device=device))


async def _run(part: Part, images, prompts: list[str], metadata: list[dict]) -> tuple[list[float], list[dict]]:
    try:
        if is_async(part.fn):
            out = await part.fn(images, prompts, metadata)
        else:
            out = await asyncio.to_thread(part.fn, images, prompts, metadata)
    except Exception as err:
        raise RuntimeError(f"{part} raised {type(err).__name__}: {err}") from err
    return _checked(part, out, len(prompts))


def _checked(part: Part, out: Any, count: int) -> tuple[list[float], list[dict]]:
    """The part's (scores, extra_info) as floats and dicts, or an error naming the part."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"{part} must return (scores, extra_info), got {type(out).__name__}")
    scores, infos = out
    if len(scores) != count or len(infos) != count:
        raise ValueError(f"{part} returned {len(scores)} scores and {len(infos)} extra_info for {count} samples")
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError) as err:
        raise TypeError(f"{part} returned a non-numeric score: {err}") from None
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"{part} returned a non-finite score {value} for sample {i}")
    if not all(isinstance(info, dict) for info in infos):
        raise TypeError(f"{part} must return one dict of extra info per sample")
    return values, list(infos)
