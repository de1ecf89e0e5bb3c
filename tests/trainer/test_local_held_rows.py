"""A local run on a GPU keeps each training row's rollout tensors in the worker (`HeldRows`, the
engine's ``device_rows``) instead of sending them through the host and back. Here on the CPU,
with the same worker built to hold its rows: the update it makes equals the update on the same
rows sent whole, and `flowloop bench`'s steps hand back the last batch with its tensors."""

from __future__ import annotations

import torch

from flowloop.agent_loop import AgentLoopManager
from flowloop.tasks import build_task
from flowloop.trainer.advantages import compute_advantages
from flowloop.trainer.bench import rl_steps, step_batch
from flowloop.trainer.model_worker import ROLES, ModelWorker
from flowloop.trainer.placement import WorkerGroup
from tests.trainer.test_recipe import tiny_config

ROLLOUT_TENSORS = {"all_latents", "all_timesteps", "all_next_timesteps", "final_latents", "prompt_embeds"}


def local_group(cfg, hold_rows: bool):
    worker = ModelWorker(cfg, ROLES, hold_rows=hold_rows)
    group = WorkerGroup([worker], [worker])
    return group, AgentLoopManager.create(cfg.rollout, worker.model, replicas=group.replicas)


def one_step(cfg, hold_rows: bool):
    """The batch of step 1 as the driver sees it, the update's metrics, the trained weights."""
    group, manager = local_group(cfg, hold_rows)
    try:
        group.sync_weights(manager, 0)
        out = manager.generate_sequences(step_batch(cfg, 1, 0, build_task(cfg)))
        advantages = compute_advantages("grpo", out["rm_scores"][:, 0], out["uid"]).advantages
        metrics = group.update(out, advantages, torch.Generator().manual_seed(0))
        weights = group.local_worker.actor.trainable_state()
        held_after = None if group.local_worker.held is None else len(group.local_worker.held)
    finally:
        manager.shutdown()
        group.shutdown()
    return out, metrics, {k: v.clone() for k, v in weights.items()}, held_after


def test_held_rows_train_exactly_as_rows_sent_whole(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path, "actor.objective=flow_grpo", "rollout.reward.name=jpeg_compressibility")
    held, held_metrics, held_weights, left = one_step(cfg, hold_rows=True)
    whole, whole_metrics, whole_weights, _ = one_step(cfg, hold_rows=False)
    # The driver's batch names the held rows and carries only the small columns and the images.
    assert "held_row" in held and not ROLLOUT_TENSORS & set(held.keys()) and ROLLOUT_TENSORS <= set(whole.keys())
    assert torch.equal(held["responses"], whole["responses"]) and torch.equal(held["rm_scores"], whole["rm_scores"])
    assert left == 0  # the update took every row it held
    assert held_metrics["rollout_correction/max"] <= 1e-6
    timing = {k for k in held_metrics if k.startswith("time/")}
    assert held_metrics.keys() == whole_metrics.keys() and "actor/grad_norm" in held_metrics
    assert {k: v for k, v in held_metrics.items() if k not in timing} == {k: v for k, v in whole_metrics.items() if k not in timing}
    assert held_weights.keys() == whole_weights.keys()
    assert all(torch.equal(held_weights[k], whole_weights[k]) for k in held_weights)


def test_bench_steps_return_the_last_batch_with_its_rollout_tensors(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path, "actor.objective=flow_grpo", "rollout.reward.name=jpeg_compressibility")
    group, manager = local_group(cfg, hold_rows=True)
    try:
        timings, out = rl_steps(group, manager, cfg, 2, log=lambda _: None, task=build_task(cfg))
    finally:
        manager.shutdown()
        group.shutdown()
    assert len(timings) == 2 and all(t["correction_max"] <= 1e-6 for t in timings)
    assert ROLLOUT_TENSORS <= set(out.keys()) and "held_row" not in out
    assert out["all_latents"].shape[:2] == (len(out), 3)  # a window of 2 steps: 3 latents a row
