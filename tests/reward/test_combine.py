"""``combined``: weights applied, each part's raw score and extra info kept, failures named."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from flowloop.reward import RewardSample, RewardWorker, build_reward, register_reward
from flowloop.reward.compression import jpeg_compressibility
from flowloop.reward.shapes import shapes_reward
from flowloop.tasks import shapes
from tests.reward.test_worker import score_all


@register_reward("test_combine_value")
def metadata_value(images, prompts, metadata, *, scale: float = 1.0):
    """The row's ``value`` metadata times ``scale``: known numbers to check the sum against."""
    return [scale * m["value"] for m in metadata], [{"seen": m["value"]} for m in metadata]


@register_reward("test_combine_fragile")
def fragile(images, prompts, metadata):
    if "boom" in prompts:
        raise RuntimeError("cannot score boom")
    return [float("nan") if p == "nan" else 1.0 for p in prompts], [{} for _ in prompts]


@register_reward("test_combine_device", factory=True)
def device_factory(device: str = "cpu"):
    def score(images, prompts, metadata):
        return [0.0] * len(prompts), [{"device": device} for _ in prompts]

    return score


def rendered(count: int = 3) -> tuple[torch.Tensor, list[str]]:
    rng = np.random.default_rng(0)
    scenes = [shapes.sample_scene(rng, split="train") for _ in range(count)]
    images = torch.stack([torch.from_numpy(shapes.render(s, size=32)).permute(2, 0, 1).float() / 255 for s in scenes])
    return images, [shapes.prompt_for(s) for s in scenes]


def test_the_score_is_the_weighted_sum_and_each_part_is_in_extra_info():
    images, prompts = rendered()
    metadata = [{} for _ in prompts]
    fn = build_reward("combined", {"components": {"shapes": 1.0, "jpeg_compressibility": 0.1}})
    scores, extra = asyncio.run(fn(images, prompts, metadata))
    shape_scores, shape_extra = shapes_reward(images, prompts, metadata)
    jpeg_scores, jpeg_extra = jpeg_compressibility(images, prompts, metadata)
    assert scores == [pytest.approx(s + 0.1 * j) for s, j in zip(shape_scores, jpeg_scores)]
    for i in range(len(prompts)):
        assert extra[i]["reward/shapes"] == shape_scores[i]  # raw, unweighted
        assert extra[i]["reward/jpeg_compressibility"] == jpeg_scores[i]
        assert extra[i]["reward/shapes/correct"] == shape_extra[i]["correct"]
        assert extra[i]["reward/jpeg_compressibility/jpeg_kb"] == jpeg_extra[i]["jpeg_kb"]


def test_parts_take_kwargs_and_one_reward_can_appear_twice():
    components = {
        "small": {"weight": 2.0, "reward": "test_combine_value", "kwargs": {"scale": 0.5}},
        "large": {"weight": -1.0, "reward": "test_combine_value", "kwargs": {"scale": 10.0}},
        "test_combine_value": 3,
    }
    fn = build_reward("combined", {"components": components})
    scores, extra = asyncio.run(fn(torch.zeros(2, 3, 4, 4), ["a", "b"], [{"value": 1.0}, {"value": 2.0}]))
    assert scores == [2 * 0.5 - 10 + 3, 2 * 1.0 - 20 + 6]
    assert extra[1] == {"reward/small": 1.0, "reward/small/seen": 2.0, "reward/large": 20.0, "reward/large/seen": 2.0,
                        "reward/test_combine_value": 2.0, "reward/test_combine_value/seen": 2.0}


def test_device_goes_to_parts_that_take_one():
    fn = build_reward("combined", {"components": {"test_combine_device": 1.0, "test_combine_value": 1.0}, "device": "meta"})
    _, extra = asyncio.run(fn(torch.zeros(1, 3, 4, 4), ["a"], [{"value": 0.0}]))
    assert extra[0]["reward/test_combine_device/device"] == "meta"


def test_a_failing_part_fails_only_its_rows_and_names_the_part():
    worker = RewardWorker("combined", max_wait_ms=50,
                          kwargs={"components": {"jpeg_compressibility": 1.0, "flaky": {"weight": 1.0, "reward": "test_combine_fragile"}}})
    samples = [RewardSample(torch.full((3, 8, 8), 0.5), prompt) for prompt in ("fine", "boom", "nan", "fine")]

    results = asyncio.run(score_all(worker, samples))
    assert [r.score is None for r in results] == [False, True, True, False]
    assert "component 'flaky' (reward 'test_combine_fragile') raised RuntimeError: cannot score boom" in results[1].extra_info["reward_error"]
    assert "component 'flaky' (reward 'test_combine_fragile') returned a non-finite score nan" in results[2].extra_info["reward_error"]
    assert results[0].extra_info["reward/flaky"] == 1.0


@pytest.mark.parametrize("components,message", [
    ({}, r"needs components \{label: weight, ...\}"),
    ({"shapes": "heavy"}, r"component 'shapes': weight must be a finite number, got 'heavy'"),
    ({"shapes": {"reward": "shapes"}}, r"component 'shapes': expected a weight or \{weight, reward, kwargs\}"),
    ({"shapes": {"weight": 1, "kwarg": {}}}, r"got keys \['kwarg', 'weight'\]"),
    ({"pickscore_v9": 1.0}, r"unknown reward 'pickscore_v9'"),
])
def test_bad_components_are_errors(components, message):
    with pytest.raises(ValueError, match=message):
        build_reward("combined", {"components": components})
