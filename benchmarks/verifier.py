"""Shapes-world verifier: accuracy on rendered ground truth, noise, blanks, and its speed.

    .venv/bin/python benchmarks/verifier.py [--scenes 2000] [--sizes 32 48 64]

Renders the same sampled scenes (all six categories, every prompt of their templates, both
splits) at each size and prints: the `correct` rate on clean renders (and `strict`, exactly the
objects asked for), with Gaussian pixel noise (std 0.05 of the [0, 1] range), on blank images
and on uniform noise, the mean time of one `verify` call, and whether the size meets the bar the
world is built to: >= 99% clean, >= 95% noisy, <= 2% on blank and on noise images. A second
table gives the clean rate per shape (scenes holding that shape) at each size.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import numpy as np

from flowloop.tasks.shapes import BACKGROUND, SHAPES, render, sample_scene, verify

BAR = {"clean": 0.99, "noisy": 0.95, "blank": 0.02, "uniform": 0.02}
"""Least rate on clean and noisy renders, most on blank and uniform-noise images."""


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenes", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 48, 64])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    scenes = [sample_scene(rng) for _ in range(args.scenes)]
    print(f"{args.scenes} scenes, {_cpu()}, python {platform.python_version()}")
    print(f"{'size':>5} {'clean':>7} {'strict':>7} {'noise.05':>9} {'blank':>6} {'uniform':>8} {'ms/verify':>10}  bar")
    per_shape = {}
    for size in args.sizes:
        clean = [render(scene, size=size) for scene in scenes]
        noisy = [np.clip(img / 255.0 + rng.normal(0, 0.05, img.shape), 0, 1) for img in clean]
        blank = np.full((size, size, 3), BACKGROUND, dtype=np.uint8)
        uniform = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in scenes]
        start = time.perf_counter()
        verdicts = [verify(img, s.spec) for img, s in zip(clean, scenes)]
        ms = (time.perf_counter() - start) / len(scenes) * 1e3
        rates = {
            "clean": np.mean([v.correct for v in verdicts]),
            "noisy": np.mean([verify(img, s.spec).correct for img, s in zip(noisy, scenes)]),
            "blank": np.mean([verify(blank, s.spec).correct for s in scenes]),
            "uniform": np.mean([verify(img, s.spec).correct for img, s in zip(uniform, scenes)]),
        }
        strict = np.mean([v.strict for v in verdicts])
        meets = all(rates[k] >= BAR[k] for k in ("clean", "noisy")) and all(rates[k] <= BAR[k] for k in ("blank", "uniform"))
        print(f"{size:>5} {rates['clean']:>7.1%} {strict:>7.1%} {rates['noisy']:>9.1%} {rates['blank']:>6.1%} "
              f"{rates['uniform']:>8.1%} {ms:>10.2f}  {'meets' if meets else 'MISSES'}")
        hits = defaultdict(list)
        for verdict, scene in zip(verdicts, scenes):
            for shape in {o.shape for o in scene.objects}:
                hits[shape].append(verdict.correct)
        per_shape[size] = hits
    print("clean rate per shape (scenes holding it):")
    print(f"{'size':>5} " + " ".join(f"{shape:>9}" for shape in SHAPES))
    for size, hits in per_shape.items():
        print(f"{size:>5} " + " ".join(f"{np.mean(hits[shape]):>9.1%}" for shape in SHAPES))


if __name__ == "__main__":
    main()
