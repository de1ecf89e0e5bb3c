"""Request builders shared by the rollout tests (tiny random model from tests/conftest.py)."""

from __future__ import annotations

import torch

from flowloop.rollout import RolloutRequest, SamplingParams
from flowloop.tasks import shapes

PROMPTS = [p for c in shapes.CATEGORIES for p in shapes.split_prompts("train", c)[:3]]


def prompt_ids(model, prompt: str) -> torch.Tensor:
    """Chat-templated, unpadded ids ``[L]``, as the agent loop sends them."""
    ids, mask = model.tokenize([prompt])
    return ids[0][mask[0].bool()]


def request(model, request_id: str, prompt: str = "a red circle", negative: str | None = None, **params) -> RolloutRequest:
    params = {"height": 16, "width": 16, "num_inference_steps": 6, **params}
    negative_ids = None if negative is None else prompt_ids(model, negative)
    return RolloutRequest(request_id, prompt_ids(model, prompt), SamplingParams(**params), negative_ids)


def mixed_requests(model, n: int = 16, **params) -> list[RolloutRequest]:
    """``n`` requests with different prompts and seeds (hence different SDE windows)."""
    params = {"sde_window_size": 2, "sde_window_range": (0, 5), **params}
    return [request(model, f"r{k}", PROMPTS[(5 * k) % len(PROMPTS)], seed=1000 + 7 * k, **params) for k in range(n)]


def assert_same_samples(a, b, pixel_atol: float = 0.0) -> None:
    """Two `DiffusionOutput`s of one request are the same sample, bit for bit: log-probs, pixels,
    latents and SDE window (tests/rollout/test_engine.py::test_batch_invariance). ``pixel_atol``:
    for a decoder whose kernels round differently at another batch size on some CPUs."""
    assert a.request_id == b.request_id
    assert torch.equal(a.log_probs, b.log_probs)
    assert torch.equal(a.extra_fields["final_latents"], b.extra_fields["final_latents"])
    torch.testing.assert_close(a.diffusion_output, b.diffusion_output, rtol=0.0, atol=pixel_atol)
    assert torch.equal(a.extra_fields["all_latents"], b.extra_fields["all_latents"])
    assert torch.equal(a.extra_fields["all_timesteps"], b.extra_fields["all_timesteps"])
