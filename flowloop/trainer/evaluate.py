"""Held-out evaluation on the shapes world: ODE sampling at fixed seeds, then the verifier.

The GenEval-style metric: a prompt's sample is `correct` when every constraint the prompt
states holds in the image; `score` is the dense fraction of constraints met. Seeds are fixed
per (prompt, sample index), so two evaluations of the same weights give the same numbers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from flowloop.rollout import RolloutEngine, RolloutRequest, SamplingParams
from flowloop.tasks import shapes


@dataclass
class EvalResult:
    accuracy: float
    score: float
    per_category: dict[str, dict[str, float]]
    n: int

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "score": self.score, "per_category": self.per_category, "n": self.n}


def ode_sample(
    model,
    prompts: list[str],
    seeds: list[int],
    num_steps: int = 40,
    guidance_scale: float = 1.0,
    resolution: int | None = None,
    batch_size: int = 64,
    progress=None,
) -> np.ndarray:
    """Euler ODE sampling through `RolloutEngine`, one seed per sample; uint8 ``[N, H, W, 3]``.

    A sample depends only on its prompt and seed, not on ``batch_size`` (up to the model's kernels).
    """
    resolution = resolution or model.default_resolution
    params = dict(height=resolution, width=resolution, num_inference_steps=num_steps,
                  guidance_scale=guidance_scale, sampler="ode", logprobs=False)
    engine = RolloutEngine(model)
    images = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, mask = model.tokenize(chunk)  # [B, L] right-padded; unknown words are a ValueError
        requests = [
            RolloutRequest(f"eval-{start + k}", ids[k][mask[k].bool()], SamplingParams(**params, seed=int(seeds[start + k])))
            for k in range(len(chunk))
        ]
        decoded = torch.stack([out.diffusion_output for out in engine.sample(requests)])  # [B, C, H, W] in [0, 1]
        images.append(to_uint8_images(decoded))
        if progress is not None:
            progress(len(chunk))
    return np.concatenate(images)


def summarize(correct: list[bool], scores: list[float], categories: list[str]) -> EvalResult:
    """Aggregate per-sample verdicts overall and per category.

    Overall is the mean over categories, as GenEval reports it, so the 180 colour-attribution
    prompts do not drown the 3 single-object ones.
    """
    by_category = defaultdict(list)
    for ok, score, category in zip(correct, scores, categories):
        by_category[category].append((bool(ok), float(score)))
    per_category = {
        name: {
            "accuracy": float(np.mean([ok for ok, _ in rows])),
            "score": float(np.mean([score for _, score in rows])),
            "n": len(rows),
        }
        for name, rows in sorted(by_category.items())
    }
    return EvalResult(
        accuracy=float(np.mean([row["accuracy"] for row in per_category.values()])),
        score=float(np.mean([row["score"] for row in per_category.values()])),
        per_category=per_category,
        n=len(correct),
    )


def score_images(images: np.ndarray, prompts: list[str], categories: list[str]) -> tuple[EvalResult, list]:
    """Run the verifier on each image and aggregate overall and per category."""
    verdicts = [shapes.verify(image, prompt) for image, prompt in zip(images, prompts)]
    return summarize([v.correct for v in verdicts], [v.score for v in verdicts], categories), verdicts


def to_uint8_images(images: torch.Tensor) -> np.ndarray:
    """Float ``[B, C, H, W]`` in [0, 1] -> uint8 ``[B, H, W, C]`` (PNG and grid layout)."""
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def eval_plan(split: str, samples_per_prompt: int, seed: int = 0) -> tuple[list[str], list[str], list[int]]:
    """Every prompt of ``split`` repeated ``samples_per_prompt`` times, with its category and fixed seed."""
    prompts, categories, seeds = [], [], []
    for category in shapes.CATEGORIES:
        for prompt in shapes.split_prompts(split, category):
            for k in range(samples_per_prompt):
                prompts.append(prompt)
                categories.append(category)
                seeds.append(seed + k)
    return prompts, categories, seeds


def evaluate(model, split: str = "heldout", samples_per_prompt: int = 4, num_steps: int = 40,
             guidance_scale: float = 1.0, seed: int = 0, batch_size: int = 64, progress=None):
    """Sample every prompt of ``split`` at fixed seeds and score it; returns (EvalResult, images, prompts)."""
    prompts, categories, seeds = eval_plan(split, samples_per_prompt, seed)
    images = ode_sample(model, prompts, seeds, num_steps, guidance_scale, batch_size=batch_size, progress=progress)
    result, _ = score_images(images, prompts, categories)
    return result, images, prompts
