"""Video rewards from image rewards: score every frame, then aggregate per video.

`per_frame(reward)` (registered as ``per_frame``) turns an image reward into one for
``[B, T, C, H, W]`` videos. The frames of the whole batch go to the image reward as ONE call of
``B * T`` images (row ``b * T + t`` is frame ``t`` of video ``b``, with video ``b``'s prompt and
metadata), so a batched model still sees a batch. Each video's score is the mean of its frame scores (or the min: every frame must
be good; or the max: some frame must be). ``stride`` keeps every stride-th frame, as Flow-GRPO's
video OCR reads every 4th frame.

Extra info per video: ``frame_scores`` (one float per scored frame) and ``frame_extra`` (the
image reward's extra info dict per scored frame).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flowloop.reward.registry import build_reward, is_async, register_reward

AGGREGATES: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda scores: sum(scores) / len(scores),
    "min": min,
    "max": max,
}


@register_reward("per_frame", factory=True)
def per_frame(
    reward: str | Callable,
    aggregate: str = "mean",
    stride: int = 1,
    reward_kwargs: dict[str, Any] | None = None,
    device: str | None = None,
) -> Callable:
    """A video reward applying image reward ``reward`` to each frame; registered as ``per_frame``:

        rollout.reward.name=per_frame rollout.reward.kwargs.reward=ocr rollout.reward.kwargs.aggregate=min

    ``reward`` is a reward name (registered or ``module:function``), built here with
    ``reward_kwargs`` (plus ``device``, when given and the image reward takes one), or an
    already built batched function. The result is async exactly when the image reward is.
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {sorted(AGGREGATES)}, got {aggregate!r}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if isinstance(reward, str):
        fn = build_reward(reward, reward_kwargs, default_device=device)
    elif reward_kwargs or device is not None:
        raise ValueError("reward_kwargs and device apply to a reward given by name; bind them into the function instead")
    else:
        fn = reward

    if is_async(fn):

        async def video_reward(videos: torch.Tensor, prompts: list[str], metadata: list[dict]):
            frames, frame_prompts, frame_metadata = _frames(videos, prompts, metadata, stride)
            return _per_video(await fn(frames, frame_prompts, frame_metadata), len(frame_prompts), len(prompts), aggregate)

    else:

        def video_reward(videos: torch.Tensor, prompts: list[str], metadata: list[dict]):
            frames, frame_prompts, frame_metadata = _frames(videos, prompts, metadata, stride)
            return _per_video(fn(frames, frame_prompts, frame_metadata), len(frame_prompts), len(prompts), aggregate)

    return video_reward


def _frames(videos: torch.Tensor, prompts: list[str], metadata: list[dict], stride: int):
    """``[B, T, C, H, W]`` -> ``[B * T', C, H, W]`` frames with each video's prompt and metadata repeated."""
    if videos.ndim != 5:
        raise ValueError(f"a video reward scores [B, T, C, H, W] videos, got shape {tuple(videos.shape)}")
    if not videos.shape[0] == len(prompts) == len(metadata):
        raise ValueError(f"got {videos.shape[0]} videos, {len(prompts)} prompts and {len(metadata)} metadata")
    kept = videos[:, ::stride]  # [B, T', C, H, W]
    count = kept.shape[1]
    frames = kept.reshape(-1, *kept.shape[2:])  # [B * T', C, H, W], video-major
    return frames, [p for p in prompts for _ in range(count)], [m for m in metadata for _ in range(count)]


def _per_video(out, num_frames: int, num_videos: int, aggregate: str) -> tuple[list[float], list[dict]]:
    """The image reward's (scores, extra_info) for ``num_frames = B * T'`` frames -> ``B``
    aggregated scores and extra info."""
    scores, extra = out
    if not len(scores) == len(extra) == num_frames:
        raise ValueError(f"the image reward returned {len(scores)} scores and {len(extra)} extra_info for {num_frames} frames")
    count = num_frames // num_videos  # frames per video
    video_scores, video_extra = [], []
    for b in range(num_videos):
        frame_scores = [float(score) for score in scores[b * count : (b + 1) * count]]
        video_scores.append(AGGREGATES[aggregate](frame_scores))
        video_extra.append({"frame_scores": frame_scores, "frame_extra": list(extra[b * count : (b + 1) * count])})
    return video_scores, video_extra
