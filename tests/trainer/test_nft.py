"""DiffusionNFT (``actor.objective=nft``): the loss against a hand-worked batch and its gradient
in closed form, the forward process, the config checks, and
`Actor.update` on a real batch of the tiny random model (weights move, deterministically); what the
rollout records for it is in tests/rollout/test_final_latents.py."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from flowloop.agent_loop import AgentLoopManager
from flowloop.config import load_config
from flowloop.config.actor import ActorConfig
from flowloop.config.train import TrainConfig
from flowloop.protocol import Batch
from flowloop.rollout import SamplingParams
from flowloop.trainer.actor import Actor
from flowloop.trainer.losses import nft_loss, noised
from flowloop.trainer.recipe import run
from tests.agent_loop.helpers import PROMPTS, prompt_batch, small_config
from tests.conftest import make_tiny_model
from tests.trainer.test_recipe import metrics, tiny_config

# ---- nft_loss by hand -----------------------------------------------------------------------
# Two rows of 1x1x2 elements, beta = 0.5, adv_clip_max = 2. With target = noise - sample, the x0
# error of a velocity v is  noisy - t v - sample = t (target - v);  scale = mean |t (target - v_old)|.
#   row 0: t=0.5   sample [0, 0]  noise [2, -2]  noisy [1, -1]  target [2, -2]
#          v_old [1, -1] -> error [0.5, -0.5], scale 0.5;  v [3, -1]
#          v+ = 0.5 v_old + 0.5 v = [2, -1]    error [0, -0.5]      mean sq 0.125  / 0.5 = 0.25
#          v- = 1.5 v_old - 0.5 v = [0, -1]    error [1, -0.5]      mean sq 0.625  / 0.5 = 1.25
#          A = 1 -> r = 1/2 + 1/4 = 0.75       row loss 0.75 * 0.25 + 0.25 * 1.25 = 0.5
#   row 1: t=0.25  sample [1, 1]  noise [-3, 1]  noisy [0, 1]   target [-4, 0]
#          v_old [0, 0] -> error [-1, 0], scale 0.5;  v [-2, 2]
#          v+ = [-1, 1]                        error [-0.75, -0.25] mean sq 0.3125 / 0.5 = 0.625
#          v- = [1, -1]                        error [-1.25, 0.25]  mean sq 0.8125 / 0.5 = 1.625
#          A = -5 -> clamped -2 -> r = 0       row loss 1.625
# loss = (0.5 + 1.625) / 2 = 1.0625


def _hand_batch():
    def rows(a, b):
        return torch.tensor([a, b]).reshape(2, 1, 1, 2)  # [B=2, 1, 1, 2]

    sample, noise, t = rows([0.0, 0.0], [1.0, 1.0]), rows([2.0, -2.0], [-3.0, 1.0]), torch.tensor([0.5, 0.25])
    old = rows([1.0, -1.0], [0.0, 0.0])
    velocity = rows([3.0, -1.0], [-2.0, 2.0]).requires_grad_()
    return velocity, old, sample, noised(sample, noise, t), t, torch.tensor([1.0, -5.0])


def test_nft_loss_by_hand():
    velocity, old, sample, noisy, t, adv = _hand_batch()
    assert torch.equal(noisy, torch.tensor([[1.0, -1.0], [0.0, 1.0]]).reshape(2, 1, 1, 2))
    loss, diag = nft_loss(velocity, old, sample, noisy, t, adv, beta=0.5, adv_clip_max=2.0)
    assert loss.shape == () and loss.item() == pytest.approx(1.0625, abs=1e-6)
    assert diag["nft_r_mean"].item() == pytest.approx(0.375)  # (0.75 + 0) / 2
    assert diag["nft_old_error"].item() == pytest.approx(0.375)  # mean of [0.25, 0.25, 1, 0]
    assert diag["nft_drift"].item() == pytest.approx(3.0)  # mean of (v - v_old)^2 = [4, 0, 4, 4]
    assert diag["adv_clamped_frac"].item() == pytest.approx(0.5)
    assert all(not v.requires_grad for v in diag.values())


def test_nft_gradient_at_the_old_velocity_in_closed_form():
    """At v = v_old, d loss / d v = 2 beta (2r - 1) t^2 (v_old - target) / (scale * numel) / B
    per row (the beta^2 |v - v_old|^2 term has zero slope there): zero for r = 1/2."""
    g = torch.Generator().manual_seed(0)
    B, shape, beta, c = 4, (2, 3, 3), 0.3, 2.0
    sample, noise = torch.randn(B, *shape, generator=g, dtype=torch.float64), torch.randn(B, *shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.9, 0.5, 0.2, 0.7], dtype=torch.float64)
    old = (noise - sample) + 0.5 * torch.randn(B, *shape, generator=g, dtype=torch.float64)  # an imperfect policy
    adv = torch.tensor([1.0, -0.5, 3.0, 0.0], dtype=torch.float64)  # r = 0.75, 0.375, 1 (clamped), 0.5
    velocity = old.clone().requires_grad_()
    loss, _ = nft_loss(velocity, old, sample, noised(sample, noise, t), t, adv, beta, c)
    loss.backward()

    target = noise - sample
    r = 0.5 + adv.clamp(-c, c) / (2 * c)
    scale = (t.view(B, 1, 1, 1) * (target - old)).abs().flatten(1).mean(1)  # mean |x0 error of v_old|
    numel = math.prod(shape)
    per_row = 2 * beta * (2 * r - 1) * t**2 / (scale * numel)  # [B]
    expected = per_row.view(B, 1, 1, 1) * (old - target) / B
    torch.testing.assert_close(velocity.grad, expected, rtol=1e-10, atol=1e-12)
    assert velocity.grad[3].abs().max() < 1e-15  # r = 1/2: no pull either way (zero up to rounding)


def test_a_positive_advantage_pulls_the_x0_prediction_to_the_sample_and_a_negative_one_pushes_it_away():
    g = torch.Generator().manual_seed(1)
    sample, noise = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    t = torch.tensor([0.6, 0.6])
    noisy = noised(sample, noise, t)
    old = (noise - sample) + torch.randn(2, 3, 4, 4, generator=g)
    velocity = old.clone().requires_grad_()
    loss, _ = nft_loss(velocity, old, sample, noisy, t, torch.tensor([2.0, -2.0]), beta=1.0, adv_clip_max=5.0)
    loss.backward()
    stepped = old - 10.0 * velocity.grad  # a small step downhill

    def x0_error(v):  # [B]: distance of the implied x0 = x_t - t v from the rollout's sample
        return (noisy - 0.6 * v - sample).flatten(1).norm(dim=1)

    before, after = x0_error(old), x0_error(stepped)
    assert after[0] < before[0]  # A > 0: towards its own sample
    assert after[1] > before[1]  # A < 0: away from it


def test_nft_loss_gives_no_gradient_to_the_old_velocity_or_advantages():
    velocity, old, sample, noisy, t, adv = _hand_batch()
    old.requires_grad_()
    adv.requires_grad_()
    loss, _ = nft_loss(velocity, old, sample, noisy, t, adv, beta=0.5, adv_clip_max=2.0)
    loss.backward()
    assert old.grad is None and adv.grad is None and velocity.grad is not None


def test_nft_loss_rejects_bad_settings():
    velocity, old, sample, noisy, t, adv = _hand_batch()
    for beta in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="beta must be a finite float > 0"):
            nft_loss(velocity, old, sample, noisy, t, adv, beta=beta, adv_clip_max=2.0)
    for clip in (math.inf, 0.0):
        with pytest.raises(ValueError, match="adv_clip_max must be a finite float > 0"):
            nft_loss(velocity, old, sample, noisy, t, adv, beta=0.5, adv_clip_max=clip)
    with pytest.raises(ValueError, match="velocity, old_velocity, sample and noisy must have one shape"):
        nft_loss(velocity, old, sample, noisy[:, :, :, :1], t, adv, beta=0.5, adv_clip_max=2.0)
    with pytest.raises(ValueError, match=r"advantages and t must be \[B\] with B=2"):
        nft_loss(velocity, old, sample, noisy, t, adv[:1], beta=0.5, adv_clip_max=2.0)
    with pytest.raises(ValueError, match=r"advantages and t must be \[B\] with B=2"):
        nft_loss(velocity, old, sample, noisy, t.view(2, 1), adv, beta=0.5, adv_clip_max=2.0)


def test_noised_is_the_forward_process_row_by_row():
    g = torch.Generator().manual_seed(2)
    sample, noise = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    t = torch.tensor([0.0, 0.3, 1.0])
    x = noised(sample, noise, t)
    for b in range(3):
        torch.testing.assert_close(x[b], (1 - t[b]) * sample[b] + t[b] * noise[b], rtol=0, atol=1e-7)
    assert torch.equal(x[0], sample[0]) and torch.equal(x[2], noise[2])  # t = 0 is the data, t = 1 the noise


# ---- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (["actor.objective=bogus"], "actor.objective must be one of ['flow_grpo', 'nft'"),
    (["actor.nft.beta=0"], "actor.nft.beta must be > 0"),
    (["actor.nft.beta=nan"], "actor.nft.beta must be > 0 and finite, got nan"),
    (["actor.nft.timesteps=0"], "actor.nft.timesteps must be >= 1"),
    (["actor.nft.time_range=[0.5,0.5]"], "actor.nft.time_range must be [lo, hi] with 0 <= lo < hi <= 1"),
    (["actor.nft.time_range=[0,1.5]"], "actor.nft.time_range must be [lo, hi]"),
    (["actor.nft.time_range=[0.2]"], "actor.nft.time_range must be [lo, hi]"),
    (["actor.nft_beta=0.5"], "unknown config key 'actor.nft_beta'"),
    (["actor.lr=inf"], "actor.lr must be > 0 and finite, got inf"),
    (["actor.lr=nan"], "actor.lr must be > 0 and finite"),
    (["actor.kl_coef=-1"], "actor.kl_coef must be >= 0 and finite"),
    (["actor.flow_grpo.clip_range=0"], "actor.flow_grpo.clip_range must be > 0"),
    (["actor.flow_grpo.timestep_fraction=1.5"], "actor.flow_grpo.timestep_fraction must be in (0, 1]"),
    (["actor.flow_grpo.kl_mode=k3"], "actor.flow_grpo.kl_mode must be one of ['flow_grpo', 'exact']"),
    (["actor.objective=nft", "actor.adv_clip_max=inf"], "actor.adv_clip_max, which must be finite and > 0"),
    (["rollout.algo.sampler=ode"], "set actor.objective=nft"),
    (["rollout.algo.noise_level=0"], "set actor.objective=nft"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(TrainConfig, overrides)
    assert message in str(err.value)


def test_nft_accepts_what_flow_grpo_cannot_learn_from():
    cfg = load_config(TrainConfig, ["actor.objective=nft", "rollout.algo.noise_level=0", "actor.nft.beta=0.1",
                                    "actor.nft.timesteps=3", "actor.nft.time_range=[0.2,0.8]"])
    assert cfg.actor.objective == "nft" and cfg.actor.nft.timesteps == 3 and list(cfg.actor.nft.time_range) == [0.2, 0.8]
    assert cfg.actor.nft.beta == 0.1


# ---- actor --------------------------------------------------------------------------------------

ADVANTAGES = torch.tensor([1.5, -1.0, 0.5, -2.0])


@pytest.fixture(scope="module")
def nft_batch() -> tuple[Batch, SamplingParams]:
    """Four real rollouts (2 prompts x 2) of `make_tiny_model()`'s weights, through the agent loop,
    cut down to what DiffusionNFT reads: the clean latents and the prompt embeddings."""
    config = small_config(reward=None)
    manager = AgentLoopManager.create(config, make_tiny_model())
    try:
        out = manager.generate_sequences(prompt_batch(2, PROMPTS[:2]))
    finally:
        manager.shutdown()
    assert out["final_latents"].shape == (4, 3, 16, 16)
    keys = ["final_latents", *[k for k in out.tensors.keys() if "prompt_embeds" in k]]
    return Batch.from_dict({k: out[k] for k in keys}), SamplingParams.from_dict(config.sampling_dict(validate=False))


def _nft_update(nft_batch, seed: int = 0, **fields):
    batch, sampling = nft_batch
    config = ActorConfig(**{"objective": "nft", "micro_batch_size": 2, "mini_batch_size": 4, "lr": 1e-3, **fields})
    actor = Actor(make_tiny_model(), config, sampling)
    stats = actor.update(batch, ADVANTAGES, torch.Generator().manual_seed(seed))
    return actor, stats


def test_nft_update_trains_deterministically_without_log_probs(nft_batch):
    base = make_tiny_model().transformer.state_dict()
    actor, stats = _nft_update(nft_batch)
    assert all(math.isfinite(stats[k]) for k in ("actor/policy_loss", "actor/nft_r_mean", "actor/grad_norm"))
    # r = 1/2 + clamp(A, -5, 5) / 10 for A = [1.5, -1, 0.5, -2]: mean 0.5 - 0.1 / 4
    assert stats["actor/nft_r_mean"] == pytest.approx(0.475, abs=1e-6)
    assert stats["actor/grad_norm"] > 0 and stats["actor/optimizer_steps"] == 1
    assert not any(k.startswith("rollout_correction/") for k in stats)
    after = actor.trainable_state()
    assert any(not torch.equal(after[k], base[k]) for k in base)

    again, _ = _nft_update(nft_batch)
    assert all(torch.equal(after[k], v) for k, v in again.trainable_state().items())
    other, _ = _nft_update(nft_batch, seed=1)  # other noise levels and noise: other weights
    assert any(not torch.equal(after[k], v) for k, v in other.trainable_state().items())


def test_old_velocity_is_the_sampling_policys(nft_batch):
    """The old velocity is computed once, before any optimizer step: with one step per update the
    current velocity equals it at every term (drift 0, measured exactly 0 here); with two, the
    second mini-batch trains against the weights that sampled, so it drifts (~1e-4 here). The
    reference is those same weights, so the velocity KL, mean (v - v_ref)^2 / 2, is half the drift."""
    _, one_step = _nft_update(nft_batch, kl_coef=0.1)
    assert one_step["actor/nft_drift"] < 1e-10 and one_step["actor/kl_loss"] < 1e-10
    _, two_steps = _nft_update(nft_batch, kl_coef=0.1, mini_batch_size=2)
    assert two_steps["actor/optimizer_steps"] == 2
    assert two_steps["actor/nft_drift"] > 1e-6
    assert two_steps["actor/kl_loss"] == pytest.approx(two_steps["actor/nft_drift"] / 2, rel=1e-3)


def test_old_velocity_pass_skips_the_first_mini_batch(nft_batch):
    """Rows trained before the first optimizer step take their old velocity from their own
    training forward, so the separate no-grad pass runs on the other rows only: 4 rows x 2 noise
    levels = 8 rows through the denoiser with one optimizer step, 8 + 2 x 2 with two."""
    batch, sampling = nft_batch
    for mini_batch_size, expected_rows in ((4, 8), (2, 12)):
        config = ActorConfig(objective="nft", micro_batch_size=2, mini_batch_size=mini_batch_size, lr=1e-3)
        actor = Actor(make_tiny_model(), config, sampling)
        seen = []
        actor.module.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
        stats = actor.update(batch, ADVANTAGES, torch.Generator().manual_seed(0))
        assert sum(seen) == expected_rows and math.isfinite(stats["actor/policy_loss"])


# ---- recipe -------------------------------------------------------------------------------------


def test_two_nft_steps_on_the_evaluation_ode(tiny_model_dir, tmp_path):
    """``flowloop train actor.objective=nft rollout.algo.noise_level=0``: no log-probs to learn
    from, yet the weights move and the metrics carry DiffusionNFT's diagnostics."""
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", "actor.objective=nft",
                    "rollout.algo.noise_level=0", "trainer.val_every=10"), log=lambda _: None)
    trained = [r for r in metrics(tmp_path / "shapes") if "reward/mean" in r]
    assert len(trained) == 2
    for row in trained:
        assert 0 <= row["actor/nft_r_mean"] <= 1 and math.isfinite(row["actor/policy_loss"])
        assert row["actor/grad_norm"] > 0 and "rollout_correction/mean" not in row
    before = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    after = load_file(tmp_path / "shapes" / "checkpoints" / "step_000002" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
