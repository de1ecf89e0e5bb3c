"""JPEG reward: `jpeg_sizes_kb` (each frame quantised and encoded on a thread pool) against the
earlier code (the batch quantised out of place, frames encoded one after another), same sizes.

    .venv/bin/python benchmarks/jpeg_reward.py [--batch 16] [--size 512] [--repeats 5]

Random images (the worst case for JPEG, as a random-weight model's samples are); prints the
median seconds of each and their ratio, interleaved so that a busy moment hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowloop.reward.compression import _jpeg_bytes, jpeg_sizes_kb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    images = torch.rand(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    one_by_one, pooled = [], []
    jpeg_sizes_kb(images)  # starts the pool's threads
    for _ in range(args.repeats):
        start = time.perf_counter()
        frames = (images.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        serial = [_jpeg_bytes(frame) / 1000 for frame in frames]
        one_by_one.append(time.perf_counter() - start)
        start = time.perf_counter()
        threaded = jpeg_sizes_kb(images)
        pooled.append(time.perf_counter() - start)
        assert serial == threaded, "the pool must give the same sizes"
    a, b = statistics.median(one_by_one), statistics.median(pooled)
    print(f"{args.batch} images {args.size}x{args.size}: quantised out of place and encoded one after another {a:.3f} s, "
          f"jpeg_sizes_kb {b:.3f} s ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
