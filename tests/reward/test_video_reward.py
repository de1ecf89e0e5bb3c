"""Video rewards: the real shapes reward applied per frame of synthetic videos, then aggregated."""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest
import torch

from flowloop.reward import RewardSample, RewardWorker, build_reward, register_reward
from flowloop.reward.compression import jpeg_compressibility
from flowloop.reward.shapes import shapes_reward
from flowloop.reward.video import per_frame
from flowloop.tasks import shapes


def _picture(scene) -> torch.Tensor:
    return torch.from_numpy(shapes.render(scene, size=32)).permute(2, 0, 1).float() / 255  # [3, 32, 32]


def _videos() -> tuple[torch.Tensor, list[str]]:
    """Two 4-frame videos ``[2, 4, 3, 32, 32]``: frames of the video's own scene, an empty
    canvas, and another prompt's scene, so frame scores differ (1, 0 and in between)."""
    rng = np.random.default_rng(0)
    scenes = [shapes.sample_scene(rng, split="train") for _ in range(3)]
    own, other, third = (_picture(scene) for scene in scenes)
    empty = torch.tensor(shapes.BACKGROUND, dtype=torch.float32).view(3, 1, 1).expand(3, 32, 32) / 255
    videos = torch.stack([torch.stack([own, empty, third, own]), torch.stack([other, own, other, empty])])
    return videos, [shapes.prompt_for(scenes[0]), shapes.prompt_for(scenes[1])]


def _frame_by_frame(videos: torch.Tensor, prompts: list[str]) -> list[list[float]]:
    """The expected frame scores: the image reward called on one frame at a time."""
    return [[shapes_reward(video[t : t + 1], [prompt], [{}])[0][0] for t in range(video.shape[0])] for video, prompt in zip(videos, prompts)]


@pytest.mark.parametrize("aggregate, combine", [("mean", np.mean), ("min", min), ("max", max)])
def test_per_frame_scores_each_frame_with_its_videos_prompt(aggregate, combine):
    videos, prompts = _videos()
    expected = _frame_by_frame(videos, prompts)
    assert all(len(set(frames)) >= 2 for frames in expected)  # the aggregates really differ
    scores, extra = per_frame(shapes_reward, aggregate)(videos, prompts, [{"uid": 0}, {"uid": 1}])
    assert [info["frame_scores"] for info in extra] == expected
    assert scores == pytest.approx([combine(frames) for frames in expected])
    assert all(set(info) == {"frame_scores", "frame_extra"} and len(info["frame_extra"]) == 4 for info in extra)
    assert set(extra[0]["frame_extra"][0]) == {"correct", "constraints"}  # the image reward's own extra info


def test_stride_keeps_every_nth_frame():
    videos, prompts = _videos()
    expected = _frame_by_frame(videos, prompts)
    _, extra = per_frame("shapes", stride=2)(videos, prompts, [{}, {}])
    assert [info["frame_scores"] for info in extra] == [frames[::2] for frames in expected]


def test_async_image_reward_gives_an_async_video_reward():
    async def async_shapes(images, prompts, metadata):
        return shapes_reward(images, prompts, metadata)

    videos, prompts = _videos()
    video_reward = per_frame(async_shapes, "min")
    assert inspect.iscoroutinefunction(video_reward)
    assert asyncio.run(video_reward(videos, prompts, [{}, {}])) == per_frame(shapes_reward, "min")(videos, prompts, [{}, {}])


def test_registered_per_frame_builds_the_image_reward_by_name_with_its_kwargs():
    videos, prompts = _videos()
    direct = per_frame(shapes_reward, "max")(videos, prompts, [{}, {}])
    assert build_reward("per_frame", {"reward": "shapes", "aggregate": "max"})(videos, prompts, [{}, {}]) == direct
    kwargs = {"reward": "jpeg_compressibility", "reward_kwargs": {"scale_kb": 1.0}}
    scores, _ = build_reward("per_frame", kwargs)(videos, prompts, [{}, {}])
    expected = [np.mean(jpeg_compressibility(video, [p] * 4, [{}] * 4, scale_kb=1.0)[0]) for video, p in zip(videos, prompts)]
    assert scores == pytest.approx(expected)


def test_device_reaches_an_image_reward_that_takes_one():
    @register_reward("test_video_device", factory=True)
    def device_factory(device: str = "cpu"):
        return lambda images, prompts, metadata: ([0.0] * len(prompts), [{"device": device} for _ in prompts])

    videos, prompts = _videos()
    _, extra = build_reward("per_frame", {"reward": "test_video_device", "device": "cuda:7"})(videos, prompts, [{}, {}])
    assert {frame["device"] for info in extra for frame in info["frame_extra"]} == {"cuda:7"}
    shapes_video = build_reward("per_frame", {"reward": "shapes", "device": "cuda:7"})  # shapes takes no device
    assert len(shapes_video(videos, prompts, [{}, {}])[0]) == 2


def test_video_reward_through_the_reward_worker():
    register_reward("test_video_shapes_min")(per_frame(shapes_reward, "min"))
    videos, prompts = _videos()
    expected = _frame_by_frame(videos, prompts)

    async def score_both():
        worker = RewardWorker("test_video_shapes_min", max_batch_size=2, max_wait_ms=50)
        try:
            return await asyncio.gather(*(worker.compute_score(RewardSample(v, p)) for v, p in zip(videos, prompts)))
        finally:
            await worker.stop()

    results = asyncio.run(score_both())
    assert [result.score for result in results] == [min(frames) for frames in expected]
    assert [result.extra_info["frame_scores"] for result in results] == expected


def test_bad_arguments_are_value_errors():
    videos, prompts = _videos()
    with pytest.raises(ValueError, match=r"aggregate must be one of \['max', 'mean', 'min'\]"):
        per_frame(shapes_reward, "median")
    with pytest.raises(ValueError, match="stride"):
        per_frame(shapes_reward, stride=0)
    with pytest.raises(ValueError, match="by name"):
        per_frame(shapes_reward, reward_kwargs={"scale": 2})
    with pytest.raises(ValueError, match=r"\[B, T, C, H, W\]"):
        per_frame(shapes_reward)(videos[:, 0], prompts, [{}, {}])
    with pytest.raises(ValueError, match="2 videos, 1 prompts"):
        per_frame(shapes_reward)(videos, prompts[:1], [{}])
