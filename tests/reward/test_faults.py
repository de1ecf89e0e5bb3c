"""Rewards that hang or lose their server fail their batch fast; the manager cancels sibling rows."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from flowloop.agent_loop import AgentLoopManager
from flowloop.agent_loop.registry import register_agent_loop
from flowloop.config.rollout import AgentConfig, RewardConfig
from flowloop.models import load_flow_model
from flowloop.reward import RewardSample, RewardWorker, register_reward
from tests.agent_loop.helpers import prompt_batch, small_config

CALLS: list[int] = []
RELEASE = threading.Event()


@register_reward("test_hangs")
def hangs(images, prompts, metadata):
    CALLS.append(len(prompts))
    RELEASE.wait()  # never set: a reward that never returns
    return [1.0] * len(prompts), [{} for _ in prompts]


@register_reward("test_server_gone")
def server_gone(images, prompts, metadata):
    CALLS.append(len(prompts))
    raise ConnectionError("reward server http://x:1 gave no answer")


def _score(name: str, count: int, **options) -> list:
    worker = RewardWorker(name, max_batch_size=count, max_wait_ms=50, **options)

    async def go():
        samples = [RewardSample(torch.rand(3, 8, 8), f"p{i}") for i in range(count)]
        try:
            return await asyncio.gather(*(worker.compute_score(s) for s in samples))
        finally:
            await worker.stop()

    return asyncio.run(go())


def test_a_reward_that_never_returns_fails_its_batch_at_the_timeout():
    CALLS.clear()
    start = time.perf_counter()
    results = _score("test_hangs", 4, timeout_s=0.3)
    assert time.perf_counter() - start < 5
    assert CALLS == [4]  # one call, no per-row re-scoring
    assert all(r.score is None and "rollout.reward.timeout_s=0.3" in r.extra_info["reward_error"] for r in results)


def test_a_dead_server_fails_the_batch_once_not_row_by_row():
    CALLS.clear()
    results = _score("test_server_gone", 4)
    assert CALLS == [4]
    assert all(r.score is None and r.extra_info["reward_error"].startswith("ConnectionError") for r in results)


def test_a_remote_reward_that_never_answers_is_bounded_by_the_timeout():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        worker = RewardWorker("remote", max_batch_size=4, max_wait_ms=50, timeout_s=0.5,
                              kwargs={"url": url, "timeout_s": 30, "max_retries": 3})
        start = time.perf_counter()

        async def go():
            samples = [RewardSample(torch.rand(3, 8, 8), f"p{i}") for i in range(4)]
            try:
                return await asyncio.gather(*(worker.compute_score(s) for s in samples))
            finally:
                await worker.stop()

        results = asyncio.run(go())
        assert time.perf_counter() - start < 5
        assert all("timeout_s=0.5" in r.extra_info["reward_error"] for r in results)
    finally:
        listener.close()


def test_reward_timeout_is_validated():
    with pytest.raises(ValueError, match="reward.timeout_s must be a number of seconds > 0"):
        small_config(reward_config=RewardConfig(timeout_s=0)).validate()


@register_agent_loop("test_boom")
class Boom:
    def __init__(self, client, tokenizer, **_):
        pass

    async def run(self, sampling_params, **row):
        raise RuntimeError("this agent loop failed")


def test_a_failing_worker_cancels_its_siblings_rows():
    model = load_flow_model(None)
    manager = AgentLoopManager.create(small_config(agent=AgentConfig(num_workers=2), reward=None), model)
    try:
        batch = prompt_batch(n=2)
        batch["agent_name"] = ["test_boom"] + ["single_turn"] * (len(batch) - 1)
        with pytest.raises(RuntimeError, match="this agent loop failed"):
            manager.generate_sequences(batch)
        rows = [t for t in asyncio.all_tasks(manager._loop)
                if not t.done() and "RolloutServer" not in t.get_coro().__qualname__]  # the server's own loop stays
        assert rows == []
        out = manager.generate_sequences(prompt_batch(n=2))  # the next call sees only its own rows
        assert len(out) == 8
    finally:
        manager.shutdown()
