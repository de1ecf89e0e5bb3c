"""JPEG compressibility and incompressibility: Flow-GRPO's definitions, images and video."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowloop.reward import build_reward
from flowloop.reward.compression import jpeg_compressibility, jpeg_incompressibility, jpeg_sizes_kb


def flat_and_noise(size: int = 64) -> torch.Tensor:
    """[2, 3, size, size]: one mid-grey image, one of uniform noise."""
    noise = torch.rand(3, size, size, generator=torch.Generator().manual_seed(0))
    return torch.stack([torch.full((3, size, size), 0.5), noise])


def test_a_flat_image_is_more_compressible_than_noise():
    images = flat_and_noise()
    (flat, noise), extra = jpeg_compressibility(images, ["", ""], [{}, {}])
    assert flat > noise and noise < 0  # compressibility: higher for the smaller file
    (flat_in, noise_in), _ = jpeg_incompressibility(images, ["", ""], [{}, {}])
    assert noise_in > flat_in > 0
    assert extra[1]["jpeg_kb"] > 5 * extra[0]["jpeg_kb"]


def test_sizes_are_pil_jpeg_at_quality_95_in_kb_and_the_scales_match_flow_grpo():
    images = flat_and_noise(32)
    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    expected = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        expected.append(len(buffer.getvalue()) / 1000)
    assert jpeg_sizes_kb(images) == expected
    assert jpeg_incompressibility(images, ["", ""], [{}, {}])[0] == expected  # raw kB
    assert jpeg_compressibility(images, ["", ""], [{}, {}])[0] == [-kb / 500 for kb in expected]
    rescaled = build_reward("jpeg_compressibility", {"scale_kb": 2.0})
    assert rescaled(images, ["", ""], [{}, {}])[0] == [-kb / 2 for kb in expected]


def test_video_scores_the_mean_over_frames_and_grey_images_work():
    images = flat_and_noise(32)
    video = images.unsqueeze(0)  # [1, T=2, 3, 32, 32]
    assert jpeg_sizes_kb(video) == [pytest.approx(np.mean(jpeg_sizes_kb(images)))]
    grey = images[:, :1]  # [2, 1, 32, 32]
    flat, noise = jpeg_sizes_kb(grey)
    assert 0 < flat < noise


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match=r"C = 1 or 3, got \(2, 4, 8, 8\)"):
        jpeg_sizes_kb(torch.zeros(2, 4, 8, 8))
    with pytest.raises(ValueError, match="scale_kb must be > 0, got 0"):
        jpeg_compressibility(torch.zeros(1, 3, 8, 8), [""], [{}], scale_kb=0)
