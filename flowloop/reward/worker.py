"""`RewardWorker`: scores finished samples one call at a time, micro-batching concurrent calls.

The agent-loop worker sends each sample here as soon as it is generated (streaming), so scoring
overlaps the generation of the rest of the batch. Inside, calls queue up; one background task
takes whatever has arrived (up to ``max_batch_size``, waiting at most ``max_wait_ms`` for more)
and runs the reward function once on the stacked images. A sync function runs in a thread, so
the event loop (and the rollout it drives) keeps going meanwhile.

Failures never become a score: a row whose reward raised, or came back non-finite, gets
``score=None`` and the error in ``extra_info["reward_error"]``; a batch that raised is re-scored
one sample at a time, so one bad sample fails only its own row, except when the call ran past
``timeout_s`` or could not reach its server (`FAIL_FAST`): then every row of the batch fails at
once, with no per-row re-scoring of a dead service. A sync reward runs in a daemon thread, so one
that never returns neither blocks the run past ``timeout_s`` nor the process's exit. The same
class runs locally and, wrapped with ``ray.remote``, as an async Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from flowloop.reward.registry import build_reward, is_async

logger = logging.getLogger(__name__)

ERROR_KEY = "reward_error"
"""Extra-info key of every result: None, or ``"ExceptionType: message"`` when the row failed."""

FAIL_FAST = (TimeoutError, asyncio.TimeoutError, ConnectionError)
"""Errors that say the reward (or its server) is unavailable, not that one sample is bad."""


class RewardFailedError(RuntimeError):
    """A step's rewards failed (`flowloop.agent_loop.manager.apply_failure_policy` names the rows)."""


@dataclass
class RewardSample:
    """One finished sample to score."""

    image: torch.Tensor
    """``[C, H, W]`` image (or ``[T, C, H, W]`` video), float in [0, 1]."""
    prompt: str
    """The user's prompt text."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's non-tensor columns (``uid``, ``raw_prompt``, dataset fields...)."""


@dataclass
class RewardResult:
    score: float | None
    """The reward; None exactly when the reward failed for this sample."""
    extra_info: dict[str, Any]
    """The function's extra info for this sample, plus ``reward_error`` (None when it worked)."""


class RewardWorker:
    """Runs reward ``reward_fn`` (a registered name or ``module:function``, built with
    ``kwargs``: see `flowloop.reward.registry.build_reward`) on micro-batches of samples.

    The reward is built here, so in Ray mode a reward model loads inside the actor.
    """

    def __init__(self, reward_fn: str, max_batch_size: int = 16, max_wait_ms: float = 0.0,
                 kwargs: dict[str, Any] | None = None, timeout_s: float | None = None):
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_wait_ms >= 0, got {max_batch_size}, {max_wait_ms}")
        if timeout_s is not None and not 0 < timeout_s < math.inf:
            raise ValueError(f"rollout.reward.timeout_s must be a number > 0 or null, got {timeout_s}")
        self.timeout_s = timeout_s
        """Most seconds one call of the reward function may take (None: no limit)."""
        self.name = reward_fn
        self.fn = build_reward(reward_fn, kwargs)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    async def compute_score(self, sample: RewardSample) -> RewardResult:
        """Score one sample; concurrent calls share reward-function calls."""
        self._start()
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((sample, future))
        return await future

    async def stop(self) -> None:
        """Cancel the batching task; calls still waiting get a CancelledError."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while self._queue is not None and not self._queue.empty():
            self._queue.get_nowait()[1].cancel()

    # -- batching -----------------------------------------------------------------------
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            items = await self._next_batch()
            try:
                for group in _group_by_shape(items):
                    results = await self._score([sample for sample, _ in group])
                    for (_, future), result in zip(group, results):
                        if not future.done():
                            future.set_result(result)
            except BaseException as err:  # a bug here must not leave callers waiting forever
                for _, future in items:
                    if not future.done():
                        future.set_exception(err if isinstance(err, Exception) else asyncio.CancelledError())
                if not isinstance(err, Exception):
                    raise

    async def _next_batch(self) -> list[tuple[RewardSample, asyncio.Future]]:
        items = [await self._queue.get()]
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while len(items) < self.max_batch_size:
            if not self._queue.empty():
                items.append(self._queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                items.append(await asyncio.wait_for(self._queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return items

    # -- scoring ------------------------------------------------------------------------
    async def _score(self, samples: list[RewardSample]) -> list[RewardResult]:
        """Score samples of one shape; a raising batch is re-scored sample by sample."""
        try:
            scores, infos = await asyncio.wait_for(self._call(samples), self.timeout_s)
        except FAIL_FAST as err:
            if isinstance(err, (TimeoutError, asyncio.TimeoutError)):
                message = (f"TimeoutError: reward {self.name!r} took longer than rollout.reward.timeout_s={self.timeout_s} s "
                           f"for a batch of {len(samples)}; raise rollout.reward.timeout_s or fix the reward")
            else:
                message = f"{type(err).__name__}: {err}"
            return [self._failed(sample, message) for sample in samples]
        except Exception as err:
            if len(samples) > 1:
                return [(await self._score([sample]))[0] for sample in samples]
            return [self._failed(samples[0], f"{type(err).__name__}: {err}")]
        return [self._result(sample, score, info) for sample, score, info in zip(samples, scores, infos)]

    async def _call(self, samples: list[RewardSample]) -> tuple[list, list]:
        images = torch.stack([sample.image for sample in samples])  # [B, C, H, W] or [B, T, C, H, W]
        prompts = [sample.prompt for sample in samples]
        metadata = [sample.metadata for sample in samples]
        if is_async(self.fn):
            out = await self.fn(images, prompts, metadata)
        else:
            out = await in_daemon_thread(self.fn, images, prompts, metadata)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"reward {self.name!r} must return (scores, extra_info), got {type(out).__name__}")
        scores, infos = out
        if len(scores) != len(samples) or len(infos) != len(samples):
            raise ValueError(
                f"reward {self.name!r} returned {len(scores)} scores and {len(infos)} extra_info for {len(samples)} samples"
            )
        return list(scores), list(infos)

    def _result(self, sample: RewardSample, score: Any, info: Any) -> RewardResult:
        if not isinstance(info, dict) or ERROR_KEY in info:
            return self._failed(sample, f"reward {self.name!r} must return a dict without {ERROR_KEY!r} per sample, got {info!r}")
        try:
            value = float(score)
        except (TypeError, ValueError):
            return self._failed(sample, f"reward {self.name!r} returned a non-numeric score {score!r}")
        if not math.isfinite(value):
            return self._failed(sample, f"reward {self.name!r} returned a non-finite score {value}")
        return RewardResult(value, {**info, ERROR_KEY: None})

    def _failed(self, sample: RewardSample, message: str) -> RewardResult:
        prompt = sample.prompt if len(sample.prompt) <= 100 else sample.prompt[:80] + f"... ({len(sample.prompt)} chars)"
        logger.warning("reward %r failed for prompt %r: %s", self.name, prompt, message)
        return RewardResult(None, {ERROR_KEY: message})


async def in_daemon_thread(fn, *args):
    """``fn(*args)`` in a daemon thread: awaiting it can time out, and a call that never returns
    does not keep the process alive (``asyncio.to_thread``'s pool threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target():
        try:
            result, error = fn(*args), None
        except BaseException as err:  # delivered to the awaiting task
            result, error = None, err
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="reward", daemon=True).start()
    return await future


def _group_by_shape(items: list) -> list[list]:
    """Split queued (sample, future) pairs into runs of one image shape, order kept within each."""
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault(tuple(item[0].image.shape), []).append(item)
    return list(groups.values())
