"""Sampling and scoring outside the training loop: what `flowloop generate` and `flowloop eval` run.

Any `FlowModel` works: prompts go through the tokenizer's chat template (`encode_chat`, as the
agent loop sends them), ODE steps run in `RolloutEngine`, and each sample has its own fixed
seed, so two evaluations of the same weights give the same numbers and a sample does not depend
on its batch neighbours. Scoring is the task's (`flowloop.tasks`): the shapes verifier, or a
prompt file's reward.
"""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import torch

from flowloop.models.prompt_ids import encode_chat
from flowloop.protocol import Batch
from flowloop.reward.worker import ERROR_KEY
from flowloop.rollout import RolloutEngine, RolloutRequest, SamplingParams
from flowloop.tasks.shapes.task import EvalResult, eval_plan, score_images

DEFAULT_RESOLUTION = 512
"""Square size for a model that declares no ``default_resolution`` and has no diffusers
``transformer.config.sample_size`` to derive one from."""


def default_resolution(model) -> int:
    """The model's own default size: the embedded model's ``default_resolution``, else what the
    diffusers pipeline would pick (``transformer.config.sample_size`` x the VAE's factor)."""
    if getattr(model, "default_resolution", None):
        return int(model.default_resolution)
    transformer = getattr(model, "transformer", None)
    sample_size = getattr(getattr(transformer, "config", None), "sample_size", None)
    factor = getattr(model, "vae_scale_factor", None)
    if isinstance(sample_size, int) and isinstance(factor, int):
        return sample_size * factor
    return DEFAULT_RESOLUTION


def prompt_ids(model, prompt: str) -> torch.Tensor:
    """``[l]`` ids as the agent loop sends them; unknown words or too many tokens are a ValueError."""
    ids = encode_chat(model.tokenizer, [{"role": "user", "content": prompt}])
    if len(ids) > model.max_sequence_length:
        raise ValueError(f"prompt {prompt!r} has {len(ids)} tokens, more than the model's max_sequence_length="
                         f"{model.max_sequence_length}")
    return ids


def sample(model, prompts: list[str], seeds: list[int], num_steps: int = 40, guidance_scale: float = 1.0,
           height: int | None = None, width: int | None = None, num_frames: int | None = None,
           batch_size: int = 64, progress=None) -> torch.Tensor:
    """Euler ODE samples, one seed per sample: float in [0, 1], ``[N, C, H, W]`` (video ``[N, T, C, H, W]``).

    A sample depends only on its prompt and seed, not on ``batch_size`` (bitwise for the embedded model;
    for others, as far as their kernels do not depend on the row count).
    """
    height = height or default_resolution(model)
    width = width or height
    model.latent_shape(height, width, num_frames)  # a size (or frame count) the model cannot take fails here
    params = dict(height=height, width=width, num_frames=num_frames, num_inference_steps=num_steps,
                  guidance_scale=guidance_scale, sampler="ode", logprobs=False)
    ids = [prompt_ids(model, p) for p in prompts]  # every prompt checked before any sampling
    engine = RolloutEngine(model, cpu_shards=None)  # slices on a small CPU, as `flowloop train` does
    out = []
    for start in range(0, len(prompts), batch_size):
        requests = [RolloutRequest(f"eval-{i}", ids[i], SamplingParams(**params, seed=int(seeds[i])))
                    for i in range(start, min(start + batch_size, len(prompts)))]
        out += [o.diffusion_output.float().cpu() for o in engine.sample(requests)]
        if progress is not None:
            progress(len(requests))
    return torch.stack(out)


def ode_sample(model, prompts: list[str], seeds: list[int], num_steps: int = 40, guidance_scale: float = 1.0,
               resolution: int | None = None, batch_size: int = 64, progress=None) -> np.ndarray:
    """`sample` of an image model as uint8 ``[N, H, W, 3]`` (square, ``resolution`` a side)."""
    images = sample(model, prompts, seeds, num_steps, guidance_scale, resolution, resolution,
                    batch_size=batch_size, progress=progress)
    return to_uint8_images(images)


def to_uint8_images(images: torch.Tensor) -> np.ndarray:
    """Float ``[B, C, H, W]`` in [0, 1] -> uint8 ``[B, H, W, C]`` (PNG and grid layout)."""
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def first_frames(images: torch.Tensor) -> torch.Tensor:
    """Images as they are; a video batch ``[N, T, C, H, W]`` as its first frames ``[N, C, H, W]``."""
    return images[:, 0] if images.ndim == 5 else images


def with_rewards(rows: list[dict], out: Batch) -> list[dict]:
    """The rows with what the rollout's reward said about each sample: ``reward`` (NaN where it
    failed) and ``reward_extra`` (its numeric and other extra info); the rows as they are when
    the run has no reward."""
    if "rm_scores" not in out:
        return [dict(row) for row in rows]
    scores = out["rm_scores"][:, 0].tolist()  # [V]
    keys = [k for k in out.meta_info.get("reward_extra_keys", []) if k != ERROR_KEY and k in out]
    return [{**row, "reward": scores[i], "reward_extra": {k: out[k][i] for k in keys}} for i, row in enumerate(rows)]


def score_rows(reward_fn, images: torch.Tensor, rows: list[dict]) -> list[dict]:
    """Score float ``images`` (as `sample` returns them) with a built reward function (sync or
    async, `build_reward`) and return the rows with ``reward`` and ``reward_extra``, as
    `with_rewards` gives them in training."""
    result = reward_fn(images, [row["raw_prompt"] for row in rows], [dict(row) for row in rows])
    scores, infos = asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result
    return [{**row, "reward": float(score), "reward_extra": dict(info or {})}
            for row, score, info in zip(rows, scores, infos)]


async def _awaited(result):
    return await result


def evaluate(model, split: str = "heldout", samples_per_prompt: int = 4, num_steps: int = 40,
             guidance_scale: float = 1.0, seed: int = 0, batch_size: int = 64, progress=None,
             resolution: int | None = None) -> tuple[EvalResult, np.ndarray, list[str]]:
    """Every prompt of a shapes split at fixed seeds, scored by the verifier (GenEval-style and strict, each with
    bootstrap intervals); returns (EvalResult, images, prompts)."""
    prompts, categories, seeds = eval_plan(split, samples_per_prompt, seed)
    images = ode_sample(model, prompts, seeds, num_steps, guidance_scale, resolution, batch_size=batch_size, progress=progress)
    result, _ = score_images(images, prompts, categories)
    return result, images, prompts
