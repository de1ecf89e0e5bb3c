"""The train loop under faults: a failed reward, SIGTERM, non-finite weights, a corrupted checkpoint."""

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from flowloop.cli import main
from flowloop.reward.registry import register_reward
from flowloop.trainer.advantages import register_advantage
from flowloop.trainer.losses import NonFiniteLossError
from flowloop.trainer.objectives import register_objective
from flowloop.trainer.objectives.nft import DiffusionNFT
from flowloop.trainer.recipe import RLRecipe, run
from tests.trainer.test_recipe import brightness, metrics, tiny_config

quiet = dict(log=lambda _: None)


def _training_step(metadata) -> int | None:
    uid = str(metadata[0].get("uid", ""))
    return None if uid.startswith("val") else int(uid.split("-")[0])


@register_reward("test_fails_at_step_3")
def fails_at_step_3(images, prompts, metadata):
    if _training_step(metadata) == 3:
        raise ConnectionError("reward server gone")
    return brightness(images, prompts, metadata)


@register_reward("test_sigterm_at_step_2")
def sigterm_at_step_2(images, prompts, metadata):
    if _training_step(metadata) == 2 and not getattr(sigterm_at_step_2, "sent", False):
        sigterm_at_step_2.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return brightness(images, prompts, metadata)


def test_a_failed_reward_checkpoints_the_last_step_and_the_resume_is_exact(tiny_model_dir, tmp_path):
    args = ("trainer.total_steps=4", "trainer.save_every=10")
    run(tiny_config(tiny_model_dir, tmp_path / "straight", *args), **quiet)
    with pytest.raises(RuntimeError, match="reward server gone"):
        run(tiny_config(tiny_model_dir, tmp_path / "faulty", *args, "rollout.reward.name=test_fails_at_step_3"), **quiet)
    assert sorted(p.name for p in (tmp_path / "faulty" / "shapes" / "checkpoints").iterdir()) == ["step_000002"]
    run(tiny_config(tiny_model_dir, tmp_path / "faulty", *args, "trainer.resume=auto"), **quiet)
    straight = load_file(tmp_path / "straight" / "shapes" / "checkpoints" / "step_000004" / "model.safetensors")
    resumed = load_file(tmp_path / "faulty" / "shapes" / "checkpoints" / "step_000004" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert metrics(tmp_path / "straight" / "shapes") == metrics(tmp_path / "faulty" / "shapes")


def test_sigterm_finishes_the_step_and_checkpoints_it(tiny_model_dir, tmp_path):
    before = signal.getsignal(signal.SIGTERM)  # the default, or whatever an earlier Ray session left
    logged = []
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=4", "trainer.save_every=10",
                        "rollout.reward.name=test_sigterm_at_step_2"), log=logged.append)
    assert sorted(p.name for p in (tmp_path / "shapes" / "checkpoints").iterdir()) == ["step_000002"]
    assert any("stopped by SIGTERM: checkpoint of step 2" in line for line in logged)
    assert signal.getsignal(signal.SIGTERM) is before  # the run put back the handler it found


def test_non_finite_weights_are_never_saved(tiny_model_dir, tmp_path):
    recipe = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2"), **quiet)
    recipe.setup()
    try:
        recipe.save(1)
        with torch.no_grad():
            next(recipe.group.local_worker.actor.module.parameters()).fill_(float("nan"))
        with pytest.raises(NonFiniteLossError, match="the weights of step 2 are not finite .* the last finite checkpoint \\(step 1\\)"):
            recipe.save(2)
    finally:
        recipe.cleanup()
    assert sorted(p.name for p in (tmp_path / "shapes" / "checkpoints").iterdir()) == ["step_000001"]


def test_eval_and_generate_refuse_a_corrupted_checkpoint(tiny_model_dir, tmp_path, capsys):
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=1", "trainer.save_every=1"), **quiet)
    checkpoint = tmp_path / "shapes" / "checkpoints" / "step_000001"
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    for command in (["eval", "--steps", "2", "--samples-per-prompt", "1"], ["generate", "a red circle", "--out", str(tmp_path / "g")]):
        assert main([*command, "--model", str(tiny_model_dir), "--checkpoint", str(checkpoint)]) == 2
        err = capsys.readouterr().err
        assert "model.safetensors does not match its sha256 in the manifest" in err and "Traceback" not in err
    assert not (tmp_path / "g").exists()


@register_advantage("test_nan")
def nan_advantages(rewards, groups):
    return torch.full_like(rewards, float("nan"))


def test_repeated_non_finite_steps_stop_with_a_checkpoint_of_unchanged_weights(tiny_model_dir, tmp_path):
    """NaN advantages: every update is skipped, the third in a row stops the run, and the checkpoint
    it leaves holds the base weights bit for bit (nothing non-finite reached them)."""
    logged = []
    with pytest.raises(NonFiniteLossError, match="3 updates in a row"):
        run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=6", "trainer.save_every=10",
                        "advantage.estimator=test_nan"), log=logged.append)
    assert sorted(p.name for p in (tmp_path / "shapes" / "checkpoints").iterdir()) == ["step_000003"]
    base = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    saved = load_file(tmp_path / "shapes" / "checkpoints" / "step_000003" / "model.safetensors")
    assert saved.keys() <= base.keys() and all(torch.equal(saved[k], base[k]) for k in saved)
    assert any("Resume with trainer.resume=auto and a lower actor.lr" in line for line in logged)
    assert [r["step"] for r in metrics(tmp_path / "shapes")] == [0, 1, 2, 3]


class FailsMidUpdate(DiffusionNFT):
    """DiffusionNFT whose 7th loss term fails: step 2's update, after its first optimizer step."""

    calls = 0

    def loss(self, *args, **kwargs):
        FailsMidUpdate.calls += 1
        if FailsMidUpdate.calls == 7:
            raise RuntimeError("device lost mid-update")
        return super().loss(*args, **kwargs)


register_objective("test_fails_mid_update", FailsMidUpdate)


def test_a_failure_inside_an_update_saves_no_half_updated_weights(tiny_model_dir, tmp_path):
    """Step 2's update fails after one of its two optimizer steps: the weights are neither step 1's
    nor step 2's, so nothing is saved under either name."""
    FailsMidUpdate.calls = 0
    logged = []
    with pytest.raises(RuntimeError, match="device lost mid-update"):
        run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=4", "trainer.save_every=10",
                        "actor.objective=test_fails_mid_update"), log=logged.append)
    checkpoints = tmp_path / "shapes" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert not any("checkpoint of step 1" in line for line in logged)
