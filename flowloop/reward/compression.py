"""JPEG compressibility and incompressibility: the size of an image's JPEG file as a reward.

Defined as DDPO and Flow-GRPO define them: the image is quantised to 8 bits, saved by PIL as
JPEG at quality 95, and its size taken in kB (1 kB = 1000 bytes). Then

- ``jpeg_compressibility``   = -size_kb / scale_kb, ``scale_kb = 500`` by default: Flow-GRPO's
  ``-size / 500`` (DDPO used ``-size``), which keeps a 512 px image's 50-300 kB near
  -0.1..-0.6, the range of the [0, 1] rewards it is combined with;
- ``jpeg_incompressibility`` = +size_kb / scale_kb, ``scale_kb = 1`` by default: both DDPO and
  Flow-GRPO reward the raw kB.

Set ``scale_kb`` in ``reward.kwargs`` to rescale. Video ``[B, T, C, H, W]``: the mean size over
frames. Extra info: ``jpeg_kb`` (the trainer logs its mean as ``reward/jpeg_kb``).
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from flowloop.reward.registry import register_reward

JPEG_QUALITY = 95
"""PIL quality setting of both papers' code."""

_encoders: dict[int, ThreadPoolExecutor] = {}
"""One encoding pool per process id (a forked child does not inherit its parent's threads)."""


def _encoder_pool() -> ThreadPoolExecutor:
    """PIL releases the GIL while it encodes, so a batch's frames encode on every core at once;
    the pool is made once per process, not once per reward call."""
    pid = os.getpid()
    if pid not in _encoders:
        _encoders[pid] = ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 16), thread_name_prefix="flowloop-jpeg")
    return _encoders[pid]


@register_reward("jpeg_compressibility")
def jpeg_compressibility(images, prompts, metadata, *, scale_kb: float = 500.0):
    """``-size_kb / scale_kb``: smaller files (flatter images) score higher."""
    _check_scale(scale_kb)
    sizes = jpeg_sizes_kb(images)
    return [-size / scale_kb for size in sizes], [{"jpeg_kb": size} for size in sizes]


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(images, prompts, metadata, *, scale_kb: float = 1.0):
    """``+size_kb / scale_kb``: larger files (busier images) score higher."""
    _check_scale(scale_kb)
    sizes = jpeg_sizes_kb(images)
    return [size / scale_kb for size in sizes], [{"jpeg_kb": size} for size in sizes]


def jpeg_sizes_kb(images: torch.Tensor) -> list[float]:
    """JPEG size in kB of each image of ``[B, C, H, W]`` (C = 1 or 3, floats in [0, 1]); for
    ``[B, T, C, H, W]`` the mean over each video's frames. Each frame is quantised and encoded on
    the pool's threads, so a batch's quantising runs on every core too."""
    if images.ndim not in (4, 5) or images.shape[-3] not in (1, 3):
        raise ValueError(f"images must be [B, C, H, W] or [B, T, C, H, W] with C = 1 or 3, got {tuple(images.shape)}")
    if images.ndim == 4:
        images = images.unsqueeze(1)  # [B, 1, C, H, W]: an image is a one-frame video
    frames = images.detach().float().cpu().numpy().reshape(-1, *images.shape[2:])  # [B*T, C, H, W]
    sizes = np.array(list(_encoder_pool().map(_quantised_jpeg_bytes, frames)), dtype=np.float64)
    return [float(np.mean(video)) / 1000 for video in sizes.reshape(images.shape[:2])]


def _check_scale(scale_kb: float) -> None:
    if not scale_kb > 0:
        raise ValueError(f"scale_kb must be > 0, got {scale_kb}")


def _quantised_jpeg_bytes(frame: np.ndarray) -> int:
    """Bytes of one ``[C, H, W]`` float frame in [0, 1], quantised to 8 bits (x 255, rounded
    half to even, as torch rounds) and saved as JPEG. NumPy's loops release the GIL and run on
    one thread each, so the pool's threads quantise side by side without oversubscribing."""
    pixels = frame * 255  # a new array: the caller's frame stays as it was
    np.rint(pixels, out=pixels)
    np.clip(pixels, 0, 255, out=pixels)
    return _jpeg_bytes(pixels.astype(np.uint8).transpose(1, 2, 0))


def _jpeg_bytes(frame: np.ndarray) -> int:
    """Bytes of one ``[H, W, C]`` uint8 frame saved as JPEG."""
    image = Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.tell()
