"""What an agent loop is: the `AgentLoop` protocol, its `AgentLoopOutput`, and small helpers
every loop needs (chat messages, tokenising on the event-loop thread, a timed rollout call).

An agent loop turns one dataset row into one trajectory. It is built per row with
``(client, tokenizer, **yaml_kwargs)`` and awaited once:

    output = await loop.run(sampling_params, **row)   # row: the row's non-tensor columns

It may call ``client.generate`` any number of times (turns); the trajectory it returns is what
the trainer learns from. The worker streams ``output`` to a reward worker unless the loop set
``reward_score`` itself.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from flowloop.models.prompt_ids import encode_chat  # noqa: F401  (part of the agent-loop API)
from flowloop.rollout.types import DiffusionOutput, RolloutRequest, SamplingParams


class AgentLoopMetrics(BaseModel):
    """Per-row timings in seconds, one dict per row in ``meta_info["metrics"]``."""

    generate_time: float = 0.0
    """Wall time inside ``client.generate`` over all turns (queueing included)."""
    queue_time: float = 0.0
    """Part of it the requests waited in the rollout server's queue (from `DiffusionOutput.metrics`)."""
    reward_time: float = 0.0
    """Wall time from handing the sample to a reward worker to getting its score."""
    retries: float = 0.0
    """Replicas the request was sent to again because one was lost or held stale weights."""


class AgentLoopOutput(BaseModel):
    """One row's trajectory, unpadded; the worker pads and stacks rows into a `Batch`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: torch.Tensor
    """``[L]`` int64 token ids of the prompt the trajectory answers (chat template applied)."""
    response_diffusion_output: torch.Tensor
    """The generated image ``[C, H, W]`` (or video ``[T, C, H, W]``), float in [0, 1]."""
    response_logprobs: torch.Tensor | None = None
    """``[W]`` log-probs of the SDE-window steps; None when not asked for (validation)."""
    reward_score: float | None = None
    """Set by a loop that scores its own trajectory; None sends it to a reward worker."""
    num_turns: int = 0
    """Chat turns, user and assistant both: a single-turn loop has 2."""
    metrics: AgentLoopMetrics = Field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    """Tensors are stacked into batch tensors (``*prompt_embeds`` and ``*prompt_embeds_mask``
    padded to ``max_sequence_length``); anything else becomes a non-tensor column."""


class AgentLoop(Protocol):
    """Built per row as ``cls(client=..., tokenizer=..., **yaml_kwargs)``."""

    async def run(self, sampling_params: SamplingParams, **row: Any) -> AgentLoopOutput:
        """``row``: the row's non-tensor columns (``raw_prompt``, ``uid``, dataset fields...)."""


# ---- helpers ------------------------------------------------------------------------------


def chat_messages(raw_prompt: str | list[dict]) -> list[dict]:
    """A row's ``raw_prompt`` as chat messages: a string is one user message."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    if isinstance(raw_prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in raw_prompt):
        return list(raw_prompt)
    raise ValueError(f"raw_prompt must be a str or a list of chat messages ({{'role', 'content'}}), got {raw_prompt!r}")


def prompt_text(raw_prompt: str | list[dict]) -> str:
    """The text a reward judges: the last user message's content."""
    users = [m.get("content", "") for m in chat_messages(raw_prompt) if m["role"] == "user"]
    if not users:
        raise ValueError(f"raw_prompt has no user message: {raw_prompt!r}")
    return users[-1]


async def timed_generate(client, request: RolloutRequest, metrics: AgentLoopMetrics) -> DiffusionOutput:
    """``await client.generate(request)``, adding its wall and queue time to ``metrics``."""
    start = time.perf_counter()
    output = await client.generate(request)
    metrics.generate_time += time.perf_counter() - start
    metrics.queue_time += float(output.metrics.get("queue_time", 0.0))
    metrics.retries += float(output.metrics.get("retries", 0.0))
    return output
