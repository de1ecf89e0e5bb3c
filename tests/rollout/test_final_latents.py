"""What a training rollout records for DiffusionNFT (``actor.objective=nft``): ``final_latents``,
the clean latent its image decodes from, with a stochastic sampler, at zero noise and on the ODE."""

import torch

from tests.rollout.helpers import request


def test_sde_rollout_returns_the_latent_its_image_decodes_from(engine, model):
    out, other = engine.sample([request(model, "a", seed=3), request(model, "b", seed=4)])
    final = out.extra_fields["final_latents"]
    assert final.shape == model.latent_shape(16, 16) == (3, 16, 16) and final.dtype == torch.float32
    assert torch.equal(model.decode(final[None])[0], out.diffusion_output)
    assert final._base is None  # owns its storage, like every other output tensor
    assert not torch.equal(final, other.extra_fields["final_latents"])
    off = engine.sample([request(model, "c", seed=3, logprobs=False), request(model, "d", seed=4, logprobs=False)])[0]
    assert "final_latents" not in off.extra_fields and off.log_probs is None
    assert torch.equal(off.diffusion_output, out.diffusion_output)  # the same sample, only not recorded


def test_noise_level_0_samples_the_ode_and_records_its_clean_latent(engine, model):
    """What ``actor.objective=nft rollout.algo.noise_level=0`` trains on: the evaluation's ODE sample."""
    sde0 = engine.sample([request(model, "s", seed=5, noise_seed=11, noise_level=0.0)])[0]
    ode = engine.sample([request(model, "o", seed=5, noise_seed=11, sampler="ode", logprobs=False)])[0]
    assert torch.equal(sde0.log_probs, torch.zeros(5))  # deterministic steps: nothing for flow_grpo
    torch.testing.assert_close(model.decode(sde0.extra_fields["final_latents"][None])[0], ode.diffusion_output,
                               rtol=0, atol=1e-6)


def test_ode_rollout_with_logprobs_returns_final_latents_and_no_window(engine, model):
    out = engine.sample([request(model, "o", seed=5, sampler="ode")])[0]
    assert out.log_probs.shape == (0,)
    assert "all_latents" not in out.extra_fields
    assert torch.equal(model.decode(out.extra_fields["final_latents"][None])[0], out.diffusion_output)
