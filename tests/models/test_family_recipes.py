"""Each model family's shipped recipe trains through `flowloop train`'s code path on a tiny pipeline.

The YAML is loaded as a user would (`--config flowloop/config/recipes/<family>.yaml`), with only
the sizes shrunk, the device and dtype set for this CPU, the folder pointed at a tiny random
pipeline, and the reward swapped for one that needs no weights.
"""

import json

import pytest

from flowloop.cli import DEFAULT_RECIPE
from flowloop.config import load_config
from flowloop.config.train import TrainConfig
from flowloop.trainer.recipe import run
from tests.models import tiny_diffusers, tiny_diffusers_video

FAMILIES = {
    "sd3": (tiny_diffusers.build_sd3, tiny_diffusers.PROMPTS, []),
    "flux": (tiny_diffusers.build_flux, tiny_diffusers.PROMPTS, []),
    "qwen_image": (tiny_diffusers_video.save_qwen_image, tiny_diffusers_video.PROMPTS, []),
    "wan": (tiny_diffusers_video.save_wan, tiny_diffusers_video.PROMPTS, ["rollout.pipeline.num_frames=5"]),
}


def train_one_step(family, tmp_path, *overrides):
    """One `flowloop train` step of ``family``'s recipe on its tiny pipeline; (summary, cfg, metrics rows)."""
    build, prompts, extra = FAMILIES[family]
    folder = build(tmp_path / family)
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    cfg = load_config(TrainConfig, [
        f"model.path={folder}", "model.device=cpu", "model.dtype=float32", "model.autocast=false", "model.compile=false",
        f"data.prompt_file={tmp_path / 'prompts.txt'}",
        "data.prompts_per_step=2", "rollout.n=2", "rollout.pipeline.height=32", "rollout.pipeline.width=32",
        "rollout.pipeline.num_inference_steps=3", "rollout.val_kwargs.pipeline={num_inference_steps: 2}",
        "rollout.algo.sde_window_size=1", "rollout.algo.sde_window_range=[0,2]", "actor.micro_batch_size=2",
        "actor.mini_batch_size=4", "trainer.total_steps=1", "data.val_train_prompts=2",
        f"trainer.run_root={tmp_path / 'runs'}", *extra, *overrides,
    ], [DEFAULT_RECIPE.parent / f"{family}.yaml"])
    if family == "wan":  # per-frame over a reward that needs no model weights
        cfg.rollout.reward.kwargs = {"reward": "jpeg_compressibility", "aggregate": "mean"}
    else:
        cfg.rollout.reward.name, cfg.rollout.reward.kwargs = "jpeg_compressibility", {}
    summary = run(cfg, log=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "runs" / cfg.trainer.run_name / "metrics.jsonl").read_text().splitlines()]
    return summary, cfg, rows


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recipe_trains_one_step(family, tmp_path):
    summary, cfg, rows = train_one_step(family, tmp_path)
    assert summary["val_metric"] == "val/reward" and summary["after"] is not None
    step = rows[1]
    assert step["rollout_correction/max"] <= 1e-5 and step["actor/grad_norm"] > 0
    assert (tmp_path / "runs" / cfg.trainer.run_name / "checkpoints" / "step_000001" / "model.safetensors").is_file()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_diffusion_nft_trains_on_each_family(family, tmp_path):
    """DiffusionNFT on noise-free rollouts: the latents of an image or a video (FLUX's packed ones
    too) are the clean samples it noises again."""
    summary, cfg, rows = train_one_step(family, tmp_path, "actor.objective=nft", "rollout.algo.sampler=ode")
    step = rows[1]
    assert 0 <= step["actor/nft_r_mean"] <= 1 and step["actor/grad_norm"] > 0
    assert "rollout_correction/max" not in step
    assert (tmp_path / "runs" / cfg.trainer.run_name / "checkpoints" / "step_000001" / "model.safetensors").is_file()


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_the_reward_switches_on_the_command_line(family):
    """A recipe holds no reward-specific kwargs, so ``rollout.reward.name=ocr`` alone builds, and
    the PickScore folder comes from the command line when asked."""
    from flowloop.reward.registry import build_reward

    recipe = [DEFAULT_RECIPE.parent / f"{family}.yaml"]
    ocr = load_config(TrainConfig, ["rollout.reward.name=ocr"], recipe)
    assert ocr.rollout.reward.kwargs == {} and callable(build_reward(ocr.rollout.reward.name, ocr.rollout.reward.kwargs))
    pick = load_config(TrainConfig, ["rollout.reward.kwargs.model_path=/models/PickScore_v1"], recipe)
    assert (pick.rollout.reward.name, pick.rollout.reward.kwargs) == ("pickscore", {"model_path": "/models/PickScore_v1"})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recipes_are_sized_for_one_gpu(family):
    """The shipped real-model recipes sample at most 128 images (or 16 videos) a step on one device."""
    cfg = load_config(TrainConfig, [], [DEFAULT_RECIPE.parent / f"{family}.yaml"])
    assert cfg.scale.mode == "local"
    assert cfg.data.prompts_per_step * cfg.rollout.n <= (16 if family == "wan" else 128)
