"""An accuracy two ways, each with a seeded 95% bootstrap confidence interval.

- The **category mean** (GenEval's headline) weighs every category alike. Its interval is
  stratified: each resample draws every category's samples again from that category, keeping
  its size, and averages the categories' accuracies.
- The **per-sample mean** weighs every sample alike. Its interval draws all samples again.

Both are percentile intervals over `resamples` draws from a generator seeded with `seed`, so the
same verdicts give the same interval. A verdict is 0 or 1, so drawing n of them again with
replacement and counting the correct ones is a binomial draw, `Binomial(n, accuracy)`: that is
how the resamples are drawn, exactly the bootstrap distribution at O(resamples) cost.

The resampled unit is the sample. Samples of one prompt (its seeds) are not independent, so the
interval covers seed noise on these prompts, not the choice of prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Accuracy:
    """Fraction correct as the mean over categories and over samples, each with its interval."""

    category_mean: float
    category_mean_ci: tuple[float, float]
    sample_mean: float
    sample_mean_ci: tuple[float, float]

    def as_dict(self) -> dict:
        return {"category_mean": self.category_mean, "category_mean_ci": list(self.category_mean_ci),
                "sample_mean": self.sample_mean, "sample_mean_ci": list(self.sample_mean_ci)}


def bootstrap_accuracy(correct: Sequence[bool], categories: Sequence[str], resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED, confidence: float = CONFIDENCE) -> Accuracy:
    """`Accuracy` of per-sample verdicts ``correct`` (one category each) with bootstrap intervals."""
    if len(correct) != len(categories):
        raise ValueError(f"correct and categories must have the same length, got {len(correct)} and {len(categories)}")
    if len(correct) == 0:
        raise ValueError("an accuracy needs at least one sample, got none")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    values = np.asarray(correct, dtype=bool)  # [N]
    labels = np.asarray(categories)
    names = sorted(set(categories))
    counts = np.array([int(np.sum(labels == name)) for name in names])  # [C]
    hits = np.array([int(np.sum(values[labels == name])) for name in names])  # [C]
    rng = np.random.default_rng(seed)
    # 1. Stratified: every category's correct count drawn again from its own samples.
    per_category = rng.binomial(counts, hits / counts, size=(resamples, len(names))) / counts  # [R, C]
    category_draws = per_category.mean(axis=1)  # [R]
    # 2. All samples drawn again together.
    sample_draws = rng.binomial(len(values), values.mean(), size=resamples) / len(values)  # [R]
    return Accuracy(
        category_mean=float(np.mean([h / n for h, n in zip(hits, counts)])),
        category_mean_ci=_percentiles(category_draws, confidence),
        sample_mean=float(values.mean()),
        sample_mean_ci=_percentiles(sample_draws, confidence),
    )


def _percentiles(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(draws, [tail, 1.0 - tail])
    return float(low), float(high)
