"""``actor.flow_grpo.balance_steps``: each trained step's loss weighed by ``std / |d mean / d v|``
of its transition (the SDE step's closed form), scaled to mean 1 per row, and the loss the actor
gets multiplied by exactly that weight."""

from __future__ import annotations

import pytest
import torch

from flowloop.config import load_config
from flowloop.config.actor import ActorConfig
from flowloop.config.train import TrainConfig
from flowloop.sampling.schedules import sigmas
from flowloop.trainer.actor import Actor
from tests.conftest import make_tiny_model
from tests.trainer.test_objectives import ADVANTAGES, batch  # noqa: F401  (four real rollouts)


def _objective(sampling, balance: bool):
    config = ActorConfig(objective="flow_grpo", micro_batch_size=4, mini_batch_size=4)
    config.flow_grpo.balance_steps = balance
    return Actor(make_tiny_model(), config, sampling)


def test_sde_weights_follow_the_closed_form_and_favour_high_noise(batch):  # noqa: F811
    _, sampling = batch
    objective = _objective(sampling, True).objective
    schedule = sigmas(10, shift=3.0).double()
    t, t_next = schedule[:-1], schedule[1:]  # [10] each: every step of the trajectory
    rows = {"all_timesteps": t[None].float(), "all_next_timesteps": t_next[None].float(),
            "rollout_log_probs": torch.zeros(1, 10)}
    assert objective.prepare(rows, torch.Generator()) == 10
    weights = rows["step_weights"]  # [1, 10]

    # sde_step: s = a sqrt(t / (1 - t)) (t_next in the denominator at t = 1), std = s sqrt(-dt),
    # mean = x + (v + s^2 / (2t) (x + (1 - t) v)) dt, so d mean / d v = (1 + s^2 (1 - t) / (2t)) dt.
    a, dt = sampling.noise_level, t_next - t
    s = a * torch.sqrt(t / (1 - torch.where(t == 1, t_next, t)))
    scale = s * torch.sqrt(-dt) / ((1 + s * s * (1 - t) / (2 * t)) * dt.abs())
    torch.testing.assert_close(weights[0].double(), scale / scale.mean(), rtol=1e-5, atol=1e-6)
    assert weights.mean().item() == pytest.approx(1.0, abs=1e-6)
    assert (weights[0, :-1] > weights[0, 1:]).all()  # the earlier (noisier) step always weighs more


def test_the_actor_loss_of_a_step_is_its_weight_times_the_unweighted_loss(batch):  # noqa: F811
    out, sampling = batch
    losses = {}
    for balance in (False, True):
        actor = _objective(sampling, balance)
        objective = actor.objective
        rows = {k: out[k] for k in out.keys() if isinstance(out[k], torch.Tensor)}
        terms = objective.prepare(rows, torch.Generator().manual_seed(0))
        losses[balance] = [objective.loss(actor, rows, ADVANTAGES, j, objective.replay(actor, rows, j), None, True)[0]
                           for j in range(terms)]
        weights = rows.get("step_weights")  # what prepare gave the rows, with balance_steps
    assert len(losses[True]) >= 2
    for j, (plain, weighed) in enumerate(zip(losses[False], losses[True])):
        # every row of this batch shares one schedule, so a step's weight is one number
        assert torch.allclose(weights[:, j], weights[0, j])
        torch.testing.assert_close(weighed, plain * weights[0, j], rtol=1e-5, atol=1e-9)
    assert not torch.allclose(weights[0, 0], weights[0, 1])


def test_balance_steps_needs_a_density_log_prob():
    with pytest.raises(ValueError, match="set rollout.algo.logprob_mode=density or actor.flow_grpo.balance_steps=false"):
        load_config(TrainConfig, ["actor.objective=flow_grpo", "actor.flow_grpo.balance_steps=true",
                                  "rollout.algo.sampler=cps", "rollout.algo.noise_level=0.5",
                                  "rollout.algo.logprob_mode=flow_grpo"])
