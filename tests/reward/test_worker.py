"""`RewardWorker`: micro-batching, sync and async functions, and failures that never become 0."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from flowloop.reward import RewardSample, RewardWorker, register_reward
from flowloop.tasks import shapes

CALLS: dict[str, list] = {"batch_sizes": [], "threads": []}


@register_reward("test_constant")
def constant(images, prompts, metadata):
    CALLS["batch_sizes"].append(images.shape[0])
    CALLS["threads"].append(threading.get_ident())
    return [float(m["value"]) for m in metadata], [{"n": images.shape[0]} for _ in prompts]


@register_reward("test_async")
async def async_reward(images, prompts, metadata):
    await asyncio.sleep(0)
    return [float(images[i].mean()) for i in range(len(prompts))], [{"prompt": p} for p in prompts]


@register_reward("test_bad_rows")
def bad_rows(images, prompts, metadata):
    if "boom" in prompts:
        raise RuntimeError("the scorer crashed on boom")
    return [float("nan") if p == "nan" else 1.0 for p in prompts], [{} for _ in prompts]


@register_reward("test_wrong_length")
def wrong_length(images, prompts, metadata):
    return [1.0] * (len(prompts) + 1), [{} for _ in prompts]


def sample(prompt: str = "a red circle", value: float = 0.0, size: int = 8) -> RewardSample:
    return RewardSample(torch.full((3, size, size), 0.25), prompt, {"value": value})


async def score_all(worker: RewardWorker, samples: list[RewardSample]):
    try:
        return await asyncio.gather(*(worker.compute_score(s) for s in samples))
    finally:
        await worker.stop()


def test_concurrent_calls_share_batches_and_run_off_the_event_loop():
    CALLS["batch_sizes"].clear()
    CALLS["threads"].clear()
    worker = RewardWorker("test_constant", max_batch_size=4)
    results = asyncio.run(score_all(worker, [sample(value=i) for i in range(10)]))
    assert [r.score for r in results] == [float(i) for i in range(10)]  # each caller gets its own row
    assert sum(CALLS["batch_sizes"]) == 10 and max(CALLS["batch_sizes"]) == 4 and len(CALLS["batch_sizes"]) < 10
    assert threading.get_ident() not in CALLS["threads"]  # sync functions run in a thread
    assert all(r.extra_info["reward_error"] is None for r in results)


def test_images_of_different_shapes_are_scored_in_separate_calls():
    CALLS["batch_sizes"].clear()
    worker = RewardWorker("test_constant", max_wait_ms=50)
    results = asyncio.run(score_all(worker, [sample(size=8), sample(size=16), sample(size=8)]))
    assert sorted(CALLS["batch_sizes"]) == [1, 2] and [r.extra_info["n"] for r in results] == [2, 1, 2]


def test_async_functions_are_awaited():
    results = asyncio.run(score_all(RewardWorker("test_async"), [sample("x"), sample("y")]))
    assert [r.score for r in results] == [0.25, 0.25]
    assert [r.extra_info["prompt"] for r in results] == ["x", "y"]


def test_a_raising_batch_fails_only_its_bad_rows():
    samples = [sample("fine"), sample("boom"), sample("nan"), sample("fine")]
    results = asyncio.run(score_all(RewardWorker("test_bad_rows", max_wait_ms=50), samples))
    assert [r.score for r in results] == [1.0, None, None, 1.0]
    assert results[1].extra_info == {"reward_error": "RuntimeError: the scorer crashed on boom"}
    assert "non-finite score nan" in results[2].extra_info["reward_error"]
    assert results[0].extra_info == {"reward_error": None}


def test_wrong_number_of_scores_is_a_failure_not_a_guess():
    results = asyncio.run(score_all(RewardWorker("test_wrong_length", max_wait_ms=50), [sample(), sample()]))
    assert [r.score for r in results] == [None, None]
    assert results[0].extra_info["reward_error"] == (
        "ValueError: reward 'test_wrong_length' returned 2 scores and 1 extra_info for 1 samples"
    )


def test_shapes_reward_is_the_verifier():
    scene = shapes.sample_scene(__import__("numpy").random.default_rng(3), split="train")
    prompt = shapes.prompt_for(scene)
    image = torch.from_numpy(shapes.render(scene, size=32)).permute(2, 0, 1).float() / 255  # [3, 32, 32]
    (result,) = asyncio.run(score_all(RewardWorker("shapes"), [RewardSample(image, prompt)]))
    verdict = shapes.verify(image, prompt)
    assert result.score == verdict.score == 1.0
    assert result.extra_info == {"correct": True, "constraints": verdict.details["constraints"], "reward_error": None}


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="max_batch_size >= 1"):
        RewardWorker("shapes", max_batch_size=0)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardWorker("nope")
