"""Shapes-world verifier: accuracy on rendered ground truth, noise, blanks, and its speed.

    .venv/bin/python benchmarks/verifier.py [--scenes 1000]

Prints, for 32x32 and 64x64 renders of the same sampled scenes (all six categories):
`correct` rate on clean renders, with Gaussian pixel noise (std 0.05), on blank images and on
uniform noise, and the mean time of one `verify` call.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from flowloop.tasks.shapes import BACKGROUND, render, sample_scene, verify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenes", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    scenes = [sample_scene(rng) for _ in range(args.scenes)]
    print(f"{args.scenes} scenes, {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{'size':>5} {'clean':>7} {'noise.05':>9} {'blank':>6} {'uniform':>8} {'ms/verify':>10}")
    for size in (32, 64):
        clean = [render(scene, size=size) for scene in scenes]
        noisy = [np.clip(img / 255.0 + rng.normal(0, 0.05, img.shape), 0, 1) for img in clean]
        blank = np.full((size, size, 3), BACKGROUND, dtype=np.uint8)
        uniform = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in scenes]
        start = time.perf_counter()
        rate_clean = np.mean([verify(img, s.spec).correct for img, s in zip(clean, scenes)])
        ms = (time.perf_counter() - start) / len(scenes) * 1e3
        rate_noisy = np.mean([verify(img, s.spec).correct for img, s in zip(noisy, scenes)])
        rate_blank = np.mean([verify(blank, s.spec).correct for s in scenes])
        rate_uniform = np.mean([verify(img, s.spec).correct for img, s in zip(uniform, scenes)])
        print(f"{size:>5} {rate_clean:>7.1%} {rate_noisy:>9.1%} {rate_blank:>6.1%} {rate_uniform:>8.1%} {ms:>10.2f}")


if __name__ == "__main__":
    main()
