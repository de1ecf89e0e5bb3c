"""The shipped shapes model gives a request the same sample, to the last bit, alone and in any batch.

Runs the embedded weights through `RolloutEngine` (what rollouts and evaluation run) at the
model's own resolution, with few steps to stay fast.
"""

import pytest
import torch

from flowloop.models import load_flow_model
from flowloop.rollout import RolloutEngine, RolloutRequest, SamplingParams
from flowloop.tasks import shapes


PROMPTS = [p for c in shapes.CATEGORIES for p in shapes.split_prompts("train", c)[:3]]


@pytest.fixture(scope="module")
def model():
    return load_flow_model()


@pytest.fixture(scope="module")
def engine(model):
    return RolloutEngine(model)


def _request(model, request_id: str, prompt: str, seed: int, negative: str | None = None, **params) -> RolloutRequest:
    def ids(text):
        padded, mask = model.tokenize([text])
        return padded[0][mask[0].bool()]

    side = model.default_resolution
    params = {"height": side, "width": side, "num_inference_steps": 5, **params}
    negative_ids = None if negative is None else ids(negative)
    return RolloutRequest(request_id, ids(prompt), SamplingParams(seed=seed, **params), negative_ids)


def _assert_identical(a, b) -> None:
    assert a.request_id == b.request_id
    assert torch.equal(a.diffusion_output, b.diffusion_output)
    assert torch.equal(a.log_probs, b.log_probs)
    for key in ("final_latents", "all_latents", "prompt_embeds"):
        assert torch.equal(a.extra_fields[key], b.extra_fields[key]), key


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_sample_is_bitwise_the_same_alone_and_in_any_batch(model, engine, guidance_scale):
    # 1. A batch of 16 mixed prompts; with CFG one row brings a negative prompt (true CFG).
    cfg = guidance_scale > 1
    batch = [_request(model, f"r{k}", PROMPTS[(5 * k) % len(PROMPTS)], 1000 + 7 * k,
                      negative="a blue square" if cfg and k == 3 else None, guidance_scale=guidance_scale)
             for k in range(16)]
    together = engine.sample(batch)
    assert together[0].log_probs.shape == (4,)
    assert len({o.diffusion_output.sum().item() for o in together}) == 16  # distinct samples, not one repeated
    # 2. Each request alone.
    for request, out in zip(batch, together):
        _assert_identical(engine.sample([request])[0], out)
    # 3. Two of them at other positions of a batch of 9 with other prompts and seeds.
    others = [_request(model, f"o{k}", PROMPTS[(3 * k + 1) % len(PROMPTS)], 50 + k, guidance_scale=guidance_scale)
              for k in range(7)]
    mixed = engine.sample([batch[3], *others[:5], batch[10], *others[5:]])
    _assert_identical(mixed[0], together[3])
    _assert_identical(mixed[6], together[10])


def test_training_forward_is_batch_invariant_and_reaches_every_weight(model):
    """The update replays log-probs through the same forward with gradients on."""
    dit = model.transformer
    generator = torch.Generator().manual_seed(0)
    side = model.default_resolution
    x = torch.randn(5, *model.latent_shape(side, side), generator=generator)
    ids, mask = model.tokenize([PROMPTS[k] for k in range(5)])
    text = model.encode_prompt(ids, mask)["prompt_embeds"]
    sigma = torch.rand(5, generator=generator)
    batched = dit(x, sigma, text, mask)
    assert torch.equal(dit(x[2:3], sigma[2:3], text[2:3], mask[2:3]), batched[2:3])
    dit.zero_grad()
    batched.square().mean().backward()
    no_grad = [name for name, param in dit.named_parameters() if param.grad is None or not param.grad.any()]
    dit.zero_grad()
    assert not no_grad
