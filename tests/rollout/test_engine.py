import dataclasses
import pickle

import pytest
import torch

from flowloop.rollout import RolloutRequest, guided_velocity
from flowloop.sampling import get_step, sigmas
from tests.rollout.helpers import assert_same_samples, mixed_requests, prompt_ids, request


def _stack(outputs, key):
    return torch.stack([o.extra_fields[key] for o in outputs])


def test_output_contract(engine, model):
    out = engine.sample([request(model, "a", seed=3, sde_window_size=2, sde_window_range=(1, 5))])[0]
    assert out.request_id == "a"
    image = out.diffusion_output
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    assert out.log_probs.shape == (2,) and out.log_probs.dtype == torch.float32
    extra = out.extra_fields
    assert extra["all_latents"].shape == (3, 3, 16, 16) and extra["all_latents"].dtype == torch.float32
    assert extra["prompt_embeds"].shape == (model.max_sequence_length, 32)
    assert extra["prompt_embeds_mask"].shape == (model.max_sequence_length,)
    assert extra["prompt_embeds_mask"].sum() == len(prompt_ids(model, "a red circle"))  # right-padded
    assert "negative_prompt_embeds" not in extra
    # The window: two consecutive steps inside [1, 5), with the schedule's exact sigma values.
    grid = sigmas(6)
    start = int((grid == extra["all_timesteps"][0]).nonzero())
    assert 1 <= start <= 3
    assert torch.equal(extra["all_timesteps"], grid[start : start + 2])
    assert torch.equal(extra["all_next_timesteps"], grid[start + 1 : start + 3])
    # Outputs own their storage (a view would pickle the whole batch through Ray).
    assert all(t._base is None for t in [image, out.log_probs, *extra.values()])
    assert set(out.metrics) >= {"generate_time", "batch_size"}


def test_rows_of_one_prompt_share_one_host_copy_of_its_embeddings(engine, model):
    """A group's rows carry one host tensor per prompt (and one for the empty prompt under CFG):
    no copy per row, and a batch of outputs pickled whole carries each prompt's embeddings once."""
    requests = [request(model, f"g{k}", "a red circle", seed=k, guidance_scale=3.0) for k in range(4)]
    requests.append(request(model, "other", "a blue square", seed=9, guidance_scale=3.0))
    outputs = engine.sample(requests)
    group, other = outputs[:4], outputs[4]
    for key in ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds"):
        assert all(o.extra_fields[key] is group[0].extra_fields[key] for o in group)
        assert group[0].extra_fields[key]._base is None  # its own storage, not a view of the batch
    assert not torch.equal(other.extra_fields["prompt_embeds"], group[0].extra_fields["prompt_embeds"])
    assert other.extra_fields["negative_prompt_embeds"] is group[0].extra_fields["negative_prompt_embeds"]
    copied = [dataclasses.replace(o, extra_fields={k: v.clone() for k, v in o.extra_fields.items()}) for o in group]
    embeds = group[0].extra_fields["prompt_embeds"]
    saved = len(pickle.dumps(copied)) - len(pickle.dumps(group))
    assert saved >= 3 * embeds.numel() * embeds.element_size()  # three rows' prompt embeddings, at least


def test_default_window_is_every_step_but_the_last(engine, model):
    out = engine.sample([request(model, "a", seed=0)])[0]
    assert torch.equal(out.extra_fields["all_timesteps"], sigmas(6)[:5])
    assert out.extra_fields["all_latents"].shape[0] == 6


@pytest.mark.parametrize("sampler, guidance", [("sde", 1.0), ("cps", 1.0), ("dance", 1.0), ("sde", 3.0)])
def test_replay_gives_the_recorded_log_prob_exactly(engine, model, sampler, guidance):
    params = dict(sampler=sampler, guidance_scale=guidance, noise_level=0.7)
    requests = mixed_requests(model, 3, **params)
    if guidance > 1:  # one true-CFG row, two plain CFG rows
        requests[0].negative_prompt_ids = prompt_ids(model, "a blue square")
    outputs = engine.sample(requests)
    assert len({int(o.extra_fields["all_timesteps"][0] * 1000) for o in outputs}) > 1  # windows differ
    latents, log_probs = _stack(outputs, "all_latents"), torch.stack([o.log_probs for o in outputs])  # [B, W+1, ...], [B, W]
    embeds = {k: _stack(outputs, k) for k in outputs[0].extra_fields if "prompt_embeds" in k}
    step = get_step(sampler)
    for k in range(log_probs.shape[1]):
        t, t_next = _stack(outputs, "all_timesteps")[:, k], _stack(outputs, "all_next_timesteps")[:, k]  # [B]
        v = guided_velocity(model, latents[:, k], t, embeds, guidance)
        replay = step(v, t, t_next, latents[:, k], noise_level=0.7, prev_sample=latents[:, k + 1])
        assert torch.equal(replay.log_prob, log_probs[:, k])
        assert torch.isfinite(replay.log_prob).all() and (replay.log_prob != 0).all()


@pytest.mark.parametrize(
    "params", [dict(sampler="sde"), dict(sampler="cps", noise_level=0.8), dict(sampler="sde", guidance_scale=3.0)]
)
def test_batch_invariance(engine, model, params):
    """A request gives the same sample, bit for bit, alone and inside a batch of 16 mixed requests:
    the tiny DiT runs its per-sample layers with a fixed row count (`flowloop.models.tiny.layers.per_sample`)."""
    requests = mixed_requests(model, 16, **params)
    if params.get("guidance_scale", 1.0) > 1:
        requests[3].negative_prompt_ids = prompt_ids(model, "a blue square")
    batched = engine.sample(requests)
    assert len({tuple(o.extra_fields["all_timesteps"].tolist()) for o in batched}) > 1  # windows differ
    for req, together in zip(requests, batched):
        alone = engine.sample([req])[0]
        assert_same_samples(alone, together)
        assert torch.equal(alone.extra_fields["prompt_embeds"], together.extra_fields["prompt_embeds"])


def test_seeds(engine, model):
    def run(seed, rid="a"):
        return engine.sample([request(model, rid, seed=seed, sde_window_size=2, sde_window_range=(0, 5))])[0]

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a.diffusion_output, b.diffusion_output) and torch.equal(a.log_probs, b.log_probs)
    assert (a.diffusion_output - c.diffusion_output).abs().max() > 1e-3
    unseeded = [run(None, f"u{k}").diffusion_output for k in range(3)]
    assert all((unseeded[i] - unseeded[j]).abs().max() > 1e-3 for i, j in [(0, 1), (0, 2), (1, 2)])
    # The image does not depend on whether log-probs are recorded.
    quiet = engine.sample([request(model, "q", seed=7, sde_window_size=2, sde_window_range=(0, 5), logprobs=False)])[0]
    assert torch.equal(quiet.diffusion_output, a.diffusion_output) and quiet.log_probs is None
    assert "all_latents" not in quiet.extra_fields


def test_windows_vary_with_the_seed_inside_their_range(engine, model):
    outputs = engine.sample(mixed_requests(model, 16, sde_window_size=2, sde_window_range=(1, 5)))
    starts = {float(o.extra_fields["all_timesteps"][0]) for o in outputs}
    grid = sigmas(6).tolist()
    assert starts <= {grid[1], grid[2], grid[3]} and len(starts) > 1


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_ode_matches_a_plain_euler_loop(engine, model, guidance):
    """The engine's ODE path against an independent Euler loop over the model's own methods."""
    prompts = ["a red circle", "two blue squares", "a red circle"]
    outputs = engine.sample([request(model, f"e{k}", p, seed=k, sampler="ode", logprobs=False, guidance_scale=guidance)
                             for k, p in enumerate(prompts)])
    with torch.no_grad():
        ids, mask = model.tokenize(prompts)
        cond = model.encode_prompt(ids, mask)
        uncond = model.encode_prompt(*model.tokenize([""] * 3))
        x = torch.stack([torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(k)) for k in range(3)])
        grid = sigmas(6)
        for i in range(6):
            v = model.velocity(x, grid[i].expand(3), cond)
            if guidance > 1:
                v_u = model.velocity(x, grid[i].expand(3), uncond)
                v = v_u + guidance * (v - v_u)
            x = x + v * (grid[i + 1] - grid[i])
    images = torch.stack([o.diffusion_output for o in outputs])
    assert (images - model.decode(x)).abs().max() <= 1e-5
    if guidance == 1.0:  # same calls, same shapes: bitwise
        assert torch.equal(images, model.decode(x))


def test_sampling_runs_in_eval_mode_and_restores_the_mode(engine, model):
    seen = []
    hook = model.transformer.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    model.transformer.train()
    try:
        out = engine.sample([request(model, "a", seed=0)])[0]
    finally:
        hook.remove()
    assert seen and not any(seen)
    assert model.transformer.training  # restored
    model.transformer.eval()
    assert not out.diffusion_output.requires_grad and not out.log_probs.requires_grad


def _bad(model, field):
    ok = request(model, "bad")
    too_long = torch.arange(3, 3 + model.max_sequence_length + 1) % 20 + 3
    return {
        "sampler": lambda: request(model, "bad", sampler="euler"),
        "sde_window_range": lambda: request(model, "bad", sde_window_size=2, sde_window_range=(3, 9)),
        "sde_window_size": lambda: request(model, "bad", sde_window_size=7),
        "height": lambda: request(model, "bad", height=18, width=18),
        "prompt_ids": lambda: RolloutRequest("bad", too_long, ok.sampling_params),
        "vocabulary": lambda: RolloutRequest("bad", torch.tensor([2, 10_000]), ok.sampling_params),
        "negative_prompt_ids": lambda: request(model, "bad", negative="a blue square"),
        "logprobs": lambda: request(model, "bad", logprobs="yes"),
        "noise_level": lambda: request(model, "bad", noise_level=-0.1),
        "logprob_mode": lambda: request(model, "bad", sampler="cps", logprob_mode="exact"),
        "seed": lambda: request(model, "bad", seed=-1),
    }[field]()


@pytest.mark.parametrize("field", ["sampler", "sde_window_range", "sde_window_size", "height", "prompt_ids", "vocabulary",
                                   "negative_prompt_ids", "logprobs", "noise_level", "logprob_mode", "seed"])
def test_bad_input_is_a_value_error_naming_the_field(engine, model, field):
    bad = _bad(model, field)
    with pytest.raises(ValueError, match=field):
        engine.validate(bad)
    with pytest.raises(ValueError, match=field):
        engine.sample([request(model, "good"), bad])


def test_one_batch_one_batch_key(engine, model):
    with pytest.raises(ValueError, match="batch_key"):
        engine.sample([request(model, "a"), request(model, "b", num_inference_steps=4)])
    assert engine.sample([]) == []
