"""Async mode (``rollout.max_staleness`` > 0): the next step's rows sample while this step's update
runs, with the weights the replicas hold then; they train one update old, their versions are
logged, and the rollout-correction metrics show how far off they were."""

from __future__ import annotations

import math
import os
import shutil
import signal

import pytest

from flowloop.reward.registry import register_reward
from flowloop.trainer.recipe import run
from tests.trainer.test_faults import _training_step
from tests.trainer.test_recipe import brightness, metrics, tiny_config
from tests.trainer.test_scale_out import cluster  # noqa: F401  (the module's Ray cluster fixture)

quiet = {"log": lambda _: None}
ASYNC = ("actor.objective=flow_grpo", "rollout.max_staleness=1", "trainer.total_steps=3", "trainer.val_every=3")


def trained(run_dir) -> list[dict]:
    return [r for r in metrics(run_dir) if "actor/grad_norm" in r]


def test_on_policy_by_default(tiny_model_dir, tmp_path):
    run(tiny_config(tiny_model_dir, tmp_path, "actor.objective=flow_grpo", "trainer.total_steps=2"), **quiet)
    rows = trained(tmp_path / "shapes")
    assert [r["rollout/weight_version"] for r in rows] == [0, 1]  # each step samples the update just made
    assert all("rollout/staleness" not in r and r["rollout_correction/max"] <= 1e-6 for r in rows)


def test_local_async_rows_train_one_update_old_and_resume_resamples(tiny_model_dir, tmp_path):
    run(tiny_config(tiny_model_dir, tmp_path / "a", *ASYNC), **quiet)
    rows = trained(tmp_path / "a" / "shapes")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Step s samples during update s-1, with weights s-2 (the first step: the initial ones, 0).
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert rows[0]["rollout_correction/max"] <= 1e-6  # sampled with the weights it trains
    for row in rows[1:]:  # sampled one update back: the replay with the trainer's weights differs
        assert 0 < row["rollout_correction/max"] < math.inf and 0 < row["rollout_correction/mean"]
    # A resume starts the pipeline over: step 3 samples with the restored weights of step 2, the same each time.
    for copy in ("b", "c"):
        shutil.copytree(tmp_path / "a", tmp_path / copy)
        resume = f"trainer.resume={tmp_path / copy / 'shapes' / 'checkpoints' / 'step_000002'}"
        run(tiny_config(tiny_model_dir, tmp_path / copy, *ASYNC, resume), **quiet)
    resumed = [trained(tmp_path / copy / "shapes")[-1] for copy in ("b", "c")]
    assert resumed[0] == resumed[1] and resumed[0]["step"] == 3
    assert resumed[0]["rollout/weight_version"] == 2 and resumed[0]["rollout/staleness"] == 0


@register_reward("test_sigterm_while_step_2_samples_ahead")
def sigterm_at_step_2(images, prompts, metadata):
    if _training_step(metadata) == 2 and not getattr(sigterm_at_step_2, "sent", False):
        sigterm_at_step_2.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return brightness(images, prompts, metadata)


def test_sigterm_during_the_generation_ahead_checkpoints_the_step(tiny_model_dir, tmp_path):
    logged = []
    with pytest.raises(KeyboardInterrupt):  # step 2's rows sample during step 1: step 1 finishes and is saved
        run(tiny_config(tiny_model_dir, tmp_path, *ASYNC, "trainer.save_every=10",
                        "rollout.reward.name=test_sigterm_while_step_2_samples_ahead"), log=logged.append)
    assert sorted(p.name for p in (tmp_path / "shapes" / "checkpoints").iterdir()) == ["step_000001"]
    assert any("stopped by SIGTERM: checkpoint of step 1" in line for line in logged)


@pytest.mark.parametrize("overrides, message", [
    (("actor.flow_grpo.skip_old_logprob=false",), "rollout.max_staleness > 0 needs actor.flow_grpo.skip_old_logprob=true"),
    (("scale.mode=ray", "scale.placement=colocated"), "needs scale.placement=disaggregated"),
    (("actor.ema_decay=0.9",), "actor.ema_decay is not offered with rollout.max_staleness > 0"),
])
def test_async_settings_that_cannot_work_are_refused(tiny_model_dir, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("*", r"\*")):
        tiny_config(tiny_model_dir, tmp_path, *ASYNC, *overrides).validate()


def test_negative_max_staleness_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        tiny_config(tiny_model_dir, tmp_path, "rollout.max_staleness=-1")


def test_ray_disaggregated_async_trains(cluster, tiny_model_dir, tmp_path):  # noqa: F811
    run(tiny_config(tiny_model_dir, tmp_path, *ASYNC, "scale.mode=ray", "scale.placement=disaggregated",
                    "scale.rollout_replicas=1", "rollout.reward.name=jpeg_compressibility"), **quiet)
    rows = trained(tmp_path / "shapes")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert rows[0]["rollout_correction/max"] <= 1e-6 and all(0 < r["rollout_correction/max"] < math.inf for r in rows[1:])
