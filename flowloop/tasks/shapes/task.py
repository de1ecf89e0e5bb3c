"""The shapes world as a task: train prompts from the train split, accuracy on the held-out one.

Two accuracies, both from the verifier (`verify`) whatever reward the run trains on:
GenEval-style, a sample is `correct` when every constraint its prompt states holds in the image
(at least: "a square" is met by two squares); `strict`, when it also holds no object beyond those
asked for. `score` is the fraction of constraints met. The headline is the mean over the six
categories, as GenEval reports it; the mean over samples and 95% bootstrap intervals of both
come with it (`bootstrap.py`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from flowloop.tasks.base import Grid, draw_uniform, register_task, step_rng

from .bootstrap import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE, Accuracy, bootstrap_accuracy
from .prompts import CATEGORIES, SPLITS, category_of, parse_prompt, split_prompts
from .verify import Verdict, verify

PROMPT_SAMPLING = ("uniform", "category_balanced")
GRID_ROWS_PER_CATEGORY = 8
"""Validation samples per category shown in the grid."""
GRID_COLUMNS = 4
"""Seeds per held-out prompt in validation: one grid row."""


@dataclass
class EvalResult:
    """``geneval`` (every constraint met) and ``strict`` (exactly what was asked) accuracy with
    intervals; ``score``: mean fraction of constraints met over categories; ``per_category``:
    ``{category: {accuracy, strict_accuracy, score, n}}``; ``n``: samples."""

    geneval: Accuracy
    strict: Accuracy
    score: float
    per_category: dict[str, dict[str, float]]
    n: int

    @property
    def accuracy(self) -> float:
        """The GenEval-style headline (``val/accuracy``): the mean over categories."""
        return self.geneval.category_mean

    @property
    def strict_accuracy(self) -> float:
        """The strict headline (``val/strict_accuracy``): the mean over categories."""
        return self.strict.category_mean

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "strict_accuracy": self.strict_accuracy, "score": self.score,
                "per_category": self.per_category, "n": self.n,
                "geneval": self.geneval.as_dict(), "strict": self.strict.as_dict(),
                "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED, "confidence": CONFIDENCE,
                              "unit": "sample", "category_mean": "stratified by category"}}


def summarize(verdicts: list[Verdict], categories: list[str]) -> EvalResult:
    """Aggregate per-sample verdicts overall and per category."""
    by_category = defaultdict(list)
    for verdict, category in zip(verdicts, categories):
        by_category[category].append(verdict)
    per_category = {
        name: {
            "accuracy": float(np.mean([v.correct for v in rows])),
            "strict_accuracy": float(np.mean([v.strict for v in rows])),
            "score": float(np.mean([v.score for v in rows])),
            "n": len(rows),
        }
        for name, rows in sorted(by_category.items())
    }
    return EvalResult(
        geneval=bootstrap_accuracy([v.correct for v in verdicts], categories),
        strict=bootstrap_accuracy([v.strict for v in verdicts], categories),
        score=float(np.mean([row["score"] for row in per_category.values()])),
        per_category=per_category,
        n=len(verdicts),
    )


def score_images(images: np.ndarray, prompts: list[str], categories: list[str]) -> tuple[EvalResult, list]:
    """Run the verifier on each uint8 ``[H, W, 3]`` image and aggregate overall and per category."""
    if not len(images) == len(prompts) == len(categories):
        raise ValueError(f"images, prompts and categories must have the same length, got {len(images)}, "
                         f"{len(prompts)} and {len(categories)}")
    verdicts = [verify(image, prompt) for image, prompt in zip(images, prompts)]
    return summarize(verdicts, categories), verdicts


def eval_plan(split: str, samples_per_prompt: int, seed: int = 0) -> tuple[list[str], list[str], list[int]]:
    """Every prompt of ``split`` repeated ``samples_per_prompt`` times, with its category and fixed seed."""
    prompts, categories, seeds = [], [], []
    for category in CATEGORIES:
        for prompt in split_prompts(split, category):
            for k in range(samples_per_prompt):
                prompts.append(prompt)
                categories.append(category)
                seeds.append(seed + k)
    return prompts, categories, seeds


def spread(pool: list[str], count: int) -> list[str]:
    """``count`` prompts spread evenly over ``pool`` (every one, then again, when ``count`` exceeds it).
    A split lists its prompts grouped (all circles first, all "left of" first, ...), so its first
    few would validate on one corner of the category."""
    if count >= len(pool):
        return [pool[j % len(pool)] for j in range(count)]
    return [pool[(j * len(pool)) // count] for j in range(count)]


class ShapesTask:
    """Train rows from ``train_split`` (uniform, or a category first and then one of its prompts);
    validation: ``val_per_category`` samples per category from ``val_split``, ``GRID_COLUMNS``
    seeds per prompt in turn, the prompts spread evenly over the category's list, scored by the
    verifier."""

    val_metric = "val/strict_accuracy"  # the headline: exactly what the prompt asks; val/accuracy (GenEval-style) beside it

    def __init__(self, train_split: str = "train", val_split: str = "heldout", prompt_sampling: str = "uniform",
                 category_weights: dict[str, float] | None = None, val_per_category: int = 32):
        for key, value, allowed in [("data.train_split", train_split, SPLITS), ("data.val_split", val_split, SPLITS),
                                    ("data.prompt_sampling", prompt_sampling, PROMPT_SAMPLING)]:
            if value not in allowed:
                raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")
        if val_per_category < 1:
            raise ValueError(f"trainer.val_samples_per_category must be > 0, got {val_per_category}")
        self.rows = [{"raw_prompt": p, "category": category_of(parse_prompt(p))} for p in split_prompts(train_split)]
        self.rows_by_category = [[row for row in self.rows if row["category"] == c] for c in CATEGORIES]
        self.prompt_sampling = prompt_sampling
        self.category_probs = _category_probs(category_weights, prompt_sampling)
        """Draw probabilities of ``CATEGORIES`` under ``data.category_weights``; None: uniform."""
        self.val_split = val_split
        self.val_per_category = val_per_category

    @classmethod
    def from_config(cls, cfg) -> ShapesTask:
        data = cfg.data
        if data.val_prompt_file is not None:
            raise ValueError("data.val_prompt_file needs data.prompt_file (the shapes world has its own held-out split)")
        return cls(data.train_split, data.val_split, data.prompt_sampling, data.category_weights,
                   cfg.trainer.val_samples_per_category)

    def train_rows(self, seed: int, step: int, count: int) -> list[dict]:
        rng = step_rng(seed, step)
        if self.prompt_sampling == "uniform":
            return draw_uniform(self.rows, rng, count)
        pools, probs = self.rows_by_category, self.category_probs
        chosen = []
        for _ in range(count):  # category, then prompt, interleaved: the draw order resume relies on
            pool = pools[rng.integers(len(pools)) if probs is None else rng.choice(len(pools), p=probs)]
            chosen.append(pool[rng.integers(len(pool))])
        return chosen

    def val_rows(self) -> list[dict]:
        k = self.val_per_category
        rows = []
        for category in CATEGORIES:
            pool = split_prompts(self.val_split, category)
            chosen = spread(pool, -(-k // GRID_COLUMNS))
            rows += [{"raw_prompt": chosen[i // GRID_COLUMNS], "category": category} for i in range(k)]
        return rows

    def evaluate(self, images: np.ndarray, rows: list[dict]) -> tuple[dict[str, float], Grid]:
        """``val/accuracy``, ``val/strict_accuracy``, ``val/score``, ``val/<category>/accuracy`` and
        ``val/<category>/strict_accuracy`` from the verifier; the grid shows the first
        ``GRID_ROWS_PER_CATEGORY`` samples of each category."""
        prompts = [row["raw_prompt"] for row in rows]
        categories = [row.get("category") or category_of(parse_prompt(p)) for row, p in zip(rows, prompts)]
        result, _ = score_images(images, prompts, categories)
        metrics = {"val/accuracy": result.accuracy, "val/strict_accuracy": result.strict_accuracy,
                   "val/score": result.score}
        for name, row in result.per_category.items():
            metrics[f"val/{name}/accuracy"] = row["accuracy"]
            metrics[f"val/{name}/strict_accuracy"] = row["strict_accuracy"]
        starts = {}
        for i, category in enumerate(categories):
            starts.setdefault(category, []).append(i)
        picked = [i for indices in starts.values() for i in indices[:GRID_ROWS_PER_CATEGORY]]
        return metrics, Grid(images[picked], [prompts[i] for i in picked], per_row=GRID_COLUMNS)


def _category_probs(weights: dict[str, float] | None, prompt_sampling: str) -> np.ndarray | None:
    """``data.category_weights`` as draw probabilities over ``CATEGORIES`` (unnamed ones weigh 1)."""
    if weights is None:
        return None
    weights = dict(weights)
    if prompt_sampling != "category_balanced":
        raise ValueError("data.category_weights needs data.prompt_sampling=category_balanced")
    for key in weights:
        if key not in CATEGORIES:
            raise ValueError(f"data.category_weights key must be one of {list(CATEGORIES)}, got {key!r}")
    if any(w < 0 for w in weights.values()) or sum(weights.get(c, 1.0) for c in CATEGORIES) <= 0:
        raise ValueError(f"data.category_weights must be >= 0 with at least one category above 0, got {weights}")
    probs = np.array([float(weights.get(c, 1.0)) for c in CATEGORIES])
    return probs / probs.sum()


register_task("shapes")(ShapesTask.from_config)
