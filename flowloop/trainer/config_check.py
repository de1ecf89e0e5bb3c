"""Checks of a training config that need the sampler's own rules, reported with the user's keys.

`flowloop.rollout.types.SamplingParams.validate` names its fields ``sampling_params.<field>``: the
request's view. A user sets ``rollout.pipeline.*``, ``rollout.algo.*`` or their
``rollout.val_kwargs`` overrides, so the training and the validation settings are checked here,
before anything is built, and the message names the key that was set.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from flowloop.config.rollout import AlgoConfig, PipelineConfig, RolloutConfig
from flowloop.rollout.types import SamplingParams

__all__ = ["check_sampling", "user_key"]

logger = logging.getLogger(__name__)

_SECTIONS = {f.name: "pipeline" for f in dataclasses.fields(PipelineConfig)}
_SECTIONS.update({f.name: "algo" for f in dataclasses.fields(AlgoConfig)})


def user_key(field: str, validate: bool, rollout: RolloutConfig) -> str:
    """``rollout.pipeline.<field>`` / ``rollout.algo.<field>``, or the ``rollout.val_kwargs``
    override when validation sets that field itself."""
    section = _SECTIONS.get(field)
    if section is None:
        return f"rollout.{field}"
    if validate and field in getattr(rollout.val_kwargs, section):
        return f"rollout.val_kwargs.{section}.{field}"
    return f"rollout.{section}.{field}"


def check_sampling(rollout: RolloutConfig) -> None:
    """Build the training and the validation `SamplingParams` and validate them; a ValueError
    names the user's key (``rollout.algo.sde_window_size``), never ``sampling_params.*``."""
    for validate in (False, True):
        try:
            SamplingParams.from_dict({**rollout.sampling_dict(validate), "seed": 0}).validate()
        except ValueError as err:
            message = re.sub(r"sampling_params\.(\w+)", lambda m: user_key(m.group(1), validate, rollout), str(err))
            raise ValueError(message + (" (in validation)" if validate else "")) from None
