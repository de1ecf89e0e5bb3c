"""Objectives as a registry: a third objective is one class plus `register_objective`, trained by
the unchanged `Actor` and recipe; and a non-finite step is skipped before it touches anything."""

from __future__ import annotations

import copy
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
from flowloop.trainer.losses import noised
from flowloop.trainer.objectives import get_objective, objective_names, register_objective
from flowloop.trainer.recipe import run
from tests.agent_loop.helpers import PROMPTS, prompt_batch, small_config
from tests.conftest import make_tiny_model
from tests.trainer.test_recipe import metrics, tiny_config


class RewardWeightedFlowMatching:
    """A toy objective: plain flow matching on the rollout's clean samples, each row weighted by
    its positive advantage (reward-weighted regression); one drawn noise level per row."""

    rollout_keys = ("final_latents",)
    needs_sampling_values = False

    def __init__(self, config: ActorConfig, sampling: SamplingParams):
        self.config = config

    @classmethod
    def validate_config(cls, cfg) -> None:
        pass  # no log-probs needed: any sampler

    def prepare(self, tensors, generator):
        sample = tensors["final_latents"]  # [B, ...]
        t = torch.rand(sample.shape[0], generator=generator)  # [B]
        noise = torch.randn(sample.shape, generator=generator)  # [B, ...]
        tensors["toy_t"], tensors["toy_target"] = t, noise - sample
        tensors["toy_noisy"] = noised(sample, noise, t)
        return 1

    def forward(self, policy, rows, j):
        return policy.velocity(rows, rows["toy_noisy"], rows["toy_t"]).float()

    def sampling_value(self, out):
        return out

    def loss(self, policy, rows, advantages, j, out, old, fresh):
        weight = advantages.clamp_min(0)  # [b]
        error = (out - rows["toy_target"]).pow(2).flatten(1).mean(1)  # [b]
        return (weight * error).mean(), {"toy_error": error.detach().mean()}, None

    def metrics(self):
        return {}


register_objective("toy_rwfm", RewardWeightedFlowMatching)

ADVANTAGES = torch.tensor([1.5, -1.0, 0.5, -2.0])


@pytest.fixture(scope="module")
def batch() -> tuple[Batch, SamplingParams]:
    """Four real rollouts (2 prompts x 2) of `make_tiny_model()`'s weights, through the agent loop."""
    config = small_config(reward=None)
    manager = AgentLoopManager.create(config, make_tiny_model())
    try:
        out = manager.generate_sequences(prompt_batch(2, PROMPTS[:2]))
    finally:
        manager.shutdown()
    return out, SamplingParams.from_dict(config.sampling_dict(validate=False))


def _actor(sampling, objective: str, **fields) -> Actor:
    fields = {"objective": objective, "micro_batch_size": 2, "mini_batch_size": 4, "lr": 1e-3, **fields}
    return Actor(make_tiny_model(), ActorConfig(**fields), sampling)


def test_the_registry_names_every_objective():
    assert {"flow_grpo", "nft", "toy_rwfm"} <= set(objective_names())
    assert get_objective("toy_rwfm") is RewardWeightedFlowMatching
    with pytest.raises(ValueError, match="actor.objective must be one of"):
        get_objective("bogus")
    with pytest.raises(ValueError, match="already registered"):
        register_objective("nft", RewardWeightedFlowMatching)


def test_a_registered_objective_trains_through_the_actor(batch):
    out, sampling = batch
    actor = _actor(sampling, "toy_rwfm", inner_epochs=2, mini_batch_size=2)
    before = {k: v.clone() for k, v in actor.trainable_state().items()}
    stats = actor.update(out, ADVANTAGES, torch.Generator().manual_seed(0))
    assert stats["actor/optimizer_steps"] == 4 and "actor/skipped_nonfinite" not in stats
    assert math.isfinite(stats["actor/toy_error"]) and stats["actor/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in actor.trainable_state().items())


def test_a_registered_objective_trains_through_the_recipe(tiny_model_dir, tmp_path):
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", "actor.objective=toy_rwfm",
                    "rollout.algo.sampler=ode"), log=lambda _: None)
    trained = [r for r in metrics(tmp_path / "shapes") if "reward/mean" in r]
    assert len(trained) == 2 and all(math.isfinite(r["actor/toy_error"]) for r in trained)
    before = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    after = load_file(tmp_path / "shapes" / "checkpoints" / "step_000002" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_objectives_check_the_rollout_they_learn_from():
    with pytest.raises(ValueError, match="rollout.algo.sampler=ode records no log-probs for flow_grpo"):
        load_config(TrainConfig, ["actor.objective=flow_grpo", "rollout.algo.sampler=ode"])
    assert load_config(TrainConfig, ["actor.objective=toy_rwfm", "rollout.algo.sampler=ode"]).actor.objective == "toy_rwfm"


@pytest.mark.parametrize("objective", ["toy_rwfm", "nft", "flow_grpo"])
def test_a_non_finite_loss_skips_the_step_before_it_changes_anything(batch, objective):
    """NaN advantages make every loss NaN: the weights, AdamW's state, the EMA and the lr
    schedule stay bit-identical to what one finite update left, and the skips are counted."""
    out, sampling = batch
    actor = _actor(sampling, objective, ema_decay=0.9, mini_batch_size=2)
    actor.update(out, ADVANTAGES, torch.Generator().manual_seed(0))  # AdamW has moments to protect
    weights = {name: p.detach().clone() for name, p in actor.module.named_parameters()}
    optimizer, scheduler = copy.deepcopy(actor.optimizer.state_dict()), copy.deepcopy(actor.scheduler.state_dict())
    ema = {k: v.clone() for k, v in actor.ema.items()}

    stats = actor.update(out, torch.full((4,), math.nan), torch.Generator().manual_seed(1))

    assert stats["actor/skipped_nonfinite"] == 2 and stats["actor/optimizer_steps"] == 0
    assert all(torch.equal(p, weights[name]) for name, p in actor.module.named_parameters())
    assert all(p.grad is None for p in actor.module.parameters())
    assert all(torch.equal(v, ema[k]) for k, v in actor.ema.items())
    assert actor.scheduler.state_dict() == scheduler
    now = actor.optimizer.state_dict()
    assert now["param_groups"] == optimizer["param_groups"] and now["state"].keys() == optimizer["state"].keys()
    for index, state in optimizer["state"].items():
        assert all(torch.equal(now["state"][index][key], value) for key, value in state.items())
