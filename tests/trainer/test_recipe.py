"""The RL recipe end to end on a tiny random model: exact replay, exact resume, run folders."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from flowloop.config import load_config
from flowloop.config.train import TrainConfig
from flowloop.reward.registry import register_reward
from flowloop.tasks import shapes
from flowloop.trainer.recipe import RLRecipe, run


@register_reward("test_brightness")
def brightness(images, prompts, metadata):
    """A dense reward that varies even on a random model's images, so advantages are non-zero."""
    values = images.flatten(1).mean(1).tolist()
    return values, [{} for _ in values]


def tiny_config(model_dir, run_root, *overrides):
    """A run of 8 rows a step that equal runs batch alike: the agent-loop worker flushes its rows
    to the server (`RolloutServer.flush`), and no batch ever runs on the (one-minute) clock."""
    return load_config(TrainConfig, [
        f"model.path={model_dir}", f"trainer.run_root={run_root}", "rollout.pipeline.height=16", "rollout.pipeline.width=16",
        "rollout.pipeline.num_inference_steps=4", "rollout.val_kwargs.pipeline={num_inference_steps: 4}",
        "rollout.algo.sde_window_size=2", "rollout.algo.sde_window_range=[0,3]", "rollout.n=4", "data.prompts_per_step=2",
        "rollout.server.max_wait_ms=60000", "actor.micro_batch_size=4", "actor.mini_batch_size=4", "actor.lr=1e-3",
        "actor.kl_coef=0.04", "trainer.val_samples_per_category=2", "trainer.val_every=2", "trainer.save_every=2",
        "trainer.keep_last=null", "rollout.reward.name=test_brightness", *overrides,
    ])


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "throughput/samples_per_s"} for r in rows]


def test_replay_reproduces_rollout_log_probs_and_weights_move(tiny_model_dir, tmp_path):
    summary = run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", "trainer.tensorboard=true"), log=lambda _: None)
    rows = metrics(tmp_path / "shapes")
    trained = [r for r in rows if "rollout_correction/max" in r]
    assert len(trained) == 2
    for row in trained:
        assert row["rollout_correction/max"] <= 1e-6
        assert row["actor/grad_norm"] > 0
    assert set(rows[0]) >= {"val/accuracy", "val/color_attr/accuracy"}
    assert {"reward/mean", "advantage/zero_std_group_frac", "actor/kl_loss", "actor/clip_frac", "actor/approx_kl"} <= set(trained[0])
    per_step = {k for k in trained[0] if re.search(r"_step[0-9]+$", k)}  # each of the window's 2 trained steps, on its own
    assert per_step == {f"actor/{m}_step{j}" for m in ("clip_frac", "approx_kl", "adv_log_ratio") for j in (0, 1)}
    by_category = {k.split("/")[2] for row in trained for k in row if k.startswith("reward/category/")}
    assert by_category and by_category <= set(shapes.CATEGORIES)  # the step's prompts, by category
    before = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    after = load_file(tmp_path / "shapes" / "checkpoints" / "step_000002" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert summary["val_metric"] == "val/strict_accuracy" and summary["before"] is not None and (tmp_path / "shapes" / "grids" / "step_000002.png").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "shapes" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("val/grid")] == [0, 2]  # the validation grids, as images
    assert [e.step for e in events.Scalars("val/accuracy")] == [0, 2]


def test_the_old_log_prob_pass_gives_the_rollouts_log_probs(tiny_model_dir, tmp_path):
    """``actor.flow_grpo.skip_old_logprob=false`` replays logp_old with the sampling weights (the second
    mini-batch's rows in a no-grad pass, the first's from their own training forward); replay
    being exact here, the run ends with the same weights and metrics as one that takes the
    rollout's log-probs, up to the replay's rounding (|logp_replay - logp_rollout| <= 1.2e-7 here)."""
    two_steps = ["trainer.total_steps=2", "actor.micro_batch_size=2"]  # 8 rows, two optimizer steps
    run(tiny_config(tiny_model_dir, tmp_path / "skip", *two_steps), log=lambda _: None)
    run(tiny_config(tiny_model_dir, tmp_path / "pass", *two_steps, "actor.flow_grpo.skip_old_logprob=false"), log=lambda _: None)
    skip_rows, pass_rows = metrics(tmp_path / "skip" / "shapes"), metrics(tmp_path / "pass" / "shapes")
    assert len(skip_rows) == len(pass_rows)
    for skip_row, pass_row in zip(skip_rows, pass_rows):
        assert pass_row == pytest.approx(skip_row, rel=1e-3, abs=1e-9)
    assert [r["actor/optimizer_steps"] for r in pass_rows if "actor/optimizer_steps" in r] == [2, 2]
    skip, replayed = (load_file(tmp_path / d / "shapes" / "checkpoints" / "step_000002" / "model.safetensors") for d in ("skip", "pass"))
    assert all(torch.allclose(skip[k], replayed[k], rtol=0, atol=1e-6) for k in skip)


@pytest.mark.parametrize("objective", [[], ["actor.objective=nft", "rollout.algo.sampler=ode"]], ids=["flow_grpo", "nft"])
def test_resume_is_exact(tiny_model_dir, tmp_path, objective):
    run(tiny_config(tiny_model_dir, tmp_path / "straight", "trainer.total_steps=4", *objective), log=lambda _: None)
    run(tiny_config(tiny_model_dir, tmp_path / "split", "trainer.total_steps=2", *objective), log=lambda _: None)
    run(tiny_config(tiny_model_dir, tmp_path / "split", "trainer.total_steps=4", "trainer.resume=auto", *objective),
        log=lambda _: None)
    straight = load_file(tmp_path / "straight" / "shapes" / "checkpoints" / "step_000004" / "model.safetensors")
    resumed = load_file(tmp_path / "split" / "shapes" / "checkpoints" / "step_000004" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert metrics(tmp_path / "straight" / "shapes") == metrics(tmp_path / "split" / "shapes")


def test_validation_never_changes_training(tiny_model_dir, tmp_path):
    """Validating every step or only at the end trains the same weights: validation draws from its
    own fixed seeds, so trainer.val_every can be raised to save time without changing a run."""
    run(tiny_config(tiny_model_dir, tmp_path / "often", "trainer.total_steps=3", "trainer.val_every=1"), log=lambda _: None)
    run(tiny_config(tiny_model_dir, tmp_path / "once", "trainer.total_steps=3", "trainer.val_every=3"), log=lambda _: None)
    often = load_file(tmp_path / "often" / "shapes" / "checkpoints" / "step_000003" / "model.safetensors")
    once = load_file(tmp_path / "once" / "shapes" / "checkpoints" / "step_000003" / "model.safetensors")
    assert all(torch.equal(often[k], once[k]) for k in often)
    training = [[{k: v for k, v in r.items() if not k.startswith("val/")} for r in metrics(tmp_path / d / "shapes") if "reward/mean" in r]
                for d in ("often", "once")]
    assert training[0] == training[1] and len(training[0]) == 3


def test_linear_lr_schedule_reaches_its_floor_at_the_last_planned_step(tiny_model_dir, tmp_path):
    # 2 prompts x 4 samples, mini-batches of 4: 2 optimizer steps per RL step, 4 planned in all.
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", "actor.lr_schedule=linear",
                    "actor.lr_final_ratio=0.1", "trainer.val_every=10"), log=lambda _: None)
    lrs = [r["actor/lr"] for r in metrics(tmp_path / "shapes") if "actor/lr" in r]
    # actor/lr is the rate the next optimizer step will use: after 2 of 4 steps 1e-3 * (0.1 + 0.9 / 3).
    assert lrs == pytest.approx([1e-3 * (0.1 + 0.9 / 3), 1e-4])


def test_resume_after_a_crash_is_exact_with_a_decaying_lr(tiny_model_dir, tmp_path):
    args = ("trainer.total_steps=4", "actor.lr_schedule=cosine")
    run(tiny_config(tiny_model_dir, tmp_path / "straight", *args), log=lambda _: None)
    # A crash after step 2's checkpoint: the same run folder without what came later.
    shutil.copytree(tmp_path / "straight", tmp_path / "crashed")
    shutil.rmtree(tmp_path / "crashed" / "shapes" / "checkpoints" / "step_000004")
    run(tiny_config(tiny_model_dir, tmp_path / "crashed", *args, "trainer.resume=auto"), log=lambda _: None)
    straight = load_file(tmp_path / "straight" / "shapes" / "checkpoints" / "step_000004" / "model.safetensors")
    resumed = load_file(tmp_path / "crashed" / "shapes" / "checkpoints" / "step_000004" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert metrics(tmp_path / "straight" / "shapes") == metrics(tmp_path / "crashed" / "shapes")
    assert [r["actor/lr"] for r in metrics(tmp_path / "crashed" / "shapes") if "actor/lr" in r][-1] == 0.0


def test_a_new_run_never_overwrites_another(tiny_model_dir, tmp_path):
    first = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=1"), log=lambda _: None)
    first.setup()
    second = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=1"), log=lambda _: None)
    second.setup()
    try:
        assert first.run_dir.name == "shapes" and second.run_dir.name == "shapes-1"
    finally:
        first.cleanup()
        second.cleanup()


@pytest.mark.parametrize("override,message", [
    ("actor.finetune=half", "actor.finetune must be one of ['full', 'lora']"),
    ("advantage.estimator=ppo", "advantage.estimator must be one of"),
    ("actor.mini_batch_size=6", "actor.mini_batch_size=6 must be a multiple of actor.micro_batch_size=4"),
    ("rollout.n=0", "rollout.n must be > 0"),
    ("actor.lrr=1", "unknown config key 'actor.lrr'"),
    ("actor.lr_schedule=step", "actor.lr_schedule must be one of ['constant', 'linear', 'cosine']"),
    ("actor.lr_final_ratio=2", "actor.lr_final_ratio must be in [0, 1]"),
    ("actor.lr_final_ratio=0.1", "actor.lr_final_ratio=0.1 has no effect with actor.lr_schedule=constant"),
])
def test_config_errors_name_the_key(tiny_model_dir, tmp_path, override, message):
    with pytest.raises(ValueError) as err:
        tiny_config(tiny_model_dir, tmp_path, override)
    assert message in str(err.value)


def test_shipped_recipes_load():
    from flowloop.cli import DEFAULT_RECIPE

    for path in DEFAULT_RECIPE.parent.glob("*.yaml"):
        cfg = load_config(TrainConfig, [], [path])
        assert cfg.rollout.n >= 2


def test_lora_trains_adapters_only(tiny_model_dir, tmp_path):
    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", "actor.finetune=lora", "actor.lora_rank=4"),
        log=lambda _: None)
    saved = load_file(tmp_path / "shapes" / "checkpoints" / "step_000002" / "model.safetensors")
    assert saved and all("lora_" in key for key in saved)
    # lora_B starts at zero (the adapted model starts as the base); training must move it.
    assert any(saved[k].abs().max() > 0 for k in saved if "lora_B" in k)
    rows = [r for r in metrics(tmp_path / "shapes") if "rollout_correction/max" in r]
    assert rows[0]["rollout_correction/max"] <= 1e-6
    assert rows[-1]["actor/kl_loss"] > 0  # the reference (adapters off) differs from the trained model


def test_lora_adapters_train_in_float32_on_a_bf16_model(tiny_model_dir, tmp_path):
    recipe = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=1", "actor.finetune=lora",
                                        "actor.lora_rank=4", "model.dtype=bfloat16", "trainer.val_every=10"),
                            log=lambda _: None)
    recipe.setup()
    try:
        params = dict(recipe.group.local_worker.actor.module.named_parameters())
        assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
        assert {p.dtype for p in params.values() if not p.requires_grad} == {torch.bfloat16}
        recipe.train()
    finally:
        recipe.cleanup()
    saved = load_file(tmp_path / "shapes" / "checkpoints" / "step_000001" / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert any(saved[k].abs().max() > 0 for k in saved if "lora_B" in k)
    row = [r for r in metrics(tmp_path / "shapes") if "rollout_correction/max" in r][0]
    assert row["rollout_correction/max"] <= 1e-6  # rollout and replay run the same mixed-dtype module


@pytest.mark.parametrize("finetune,warned", [("full", True), ("lora", False)])
def test_training_bf16_weights_warns(tiny_model_dir, tmp_path, caplog, finetune, warned):
    recipe = RLRecipe(tiny_config(tiny_model_dir, tmp_path, f"actor.finetune={finetune}", "model.dtype=bfloat16"),
                            log=lambda _: None)
    with caplog.at_level("WARNING", logger="flowloop.trainer.actor"):
        recipe.setup()
    recipe.cleanup()
    assert ("training torch.bfloat16 weights with AdamW" in caplog.text) is warned


def test_lora_target_matching_nothing_is_an_error(tiny_model_dir, tmp_path):
    recipe = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "actor.finetune=lora", "actor.lora_target_modules=[to_q]"),
                            log=lambda _: None)
    with pytest.raises(ValueError, match=r"match no linear layer of TinyDiT; its linear layers end in \[.*'qkv'"):
        recipe.setup()
    recipe.cleanup()


def test_category_balanced_prompts_cover_every_category(tiny_model_dir, tmp_path):
    recipe = RLRecipe(tiny_config(tiny_model_dir, tmp_path, "data.prompt_sampling=category_balanced",
                                        "data.prompts_per_step=60"), log=lambda _: None)
    batch = recipe.make_batch(step=3)
    categories = [shapes.category_of(shapes.parse_prompt(p)) for p in batch["raw_prompt"][::4]]
    counts = {c: categories.count(c) for c in shapes.CATEGORIES}
    assert all(count >= 3 for count in counts.values()), counts  # uniform would give color_attr ~75%
    assert set(batch["raw_prompt"]) <= set(shapes.split_prompts("train"))
    assert list(recipe.make_batch(step=3)["raw_prompt"]) == list(batch["raw_prompt"])


def test_category_weights_shift_the_draw_and_bad_weights_name_the_key(tiny_model_dir, tmp_path):
    balanced = ("data.prompt_sampling=category_balanced", "data.prompts_per_step=600")
    recipe = RLRecipe(tiny_config(tiny_model_dir, tmp_path, *balanced,
                                        "data.category_weights={color_attr: 4, single_object: 0}"), log=lambda _: None)
    categories = list(recipe.make_batch(step=0)["category"][::4])
    share = {c: categories.count(c) / len(categories) for c in shapes.CATEGORIES}
    assert share["single_object"] == 0 and 0.4 < share["color_attr"] < 0.6, share  # 4 / (4 + 4 x 1) = 0.5
    assert all(0.07 < share[c] < 0.2 for c in ("two_objects", "counting", "colors", "position")), share  # 1/8 each
    for weights, message in [("{colour_attr: 2}", "data.category_weights key must be one of ['single_object'"),
                             ("{color_attr: -1}", "data.category_weights must be >= 0")]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            RLRecipe(tiny_config(tiny_model_dir, tmp_path, *balanced, f"data.category_weights={weights}"))
    with pytest.raises(ValueError, match="data.category_weights needs data.prompt_sampling=category_balanced"):
        RLRecipe(tiny_config(tiny_model_dir, tmp_path, "data.category_weights={color_attr: 2}"))


def test_eval_of_a_trained_checkpoint(tiny_model_dir, tmp_path):
    from flowloop.cli import main

    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=1", "trainer.save_every=1"), log=lambda _: None)
    checkpoint = tmp_path / "shapes" / "checkpoints" / "step_000001"
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--checkpoint", str(checkpoint), "--samples-per-prompt", "1",
                 "--steps", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n"] > 0
    assert main(["eval", "--model", str(tiny_model_dir), "--checkpoint", str(tmp_path), "--steps", "2"]) == 2


@pytest.mark.parametrize("decay", [0.0, 1.0])
def test_ema_follows_the_weights_at_decay_0_and_stays_at_the_base_at_1(tiny_model_dir, tmp_path, decay):
    from flowloop.trainer.checkpoint import load_checkpoint

    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", f"actor.ema_decay={decay}"), log=lambda _: None)
    loaded = load_checkpoint(tmp_path / "shapes" / "checkpoints" / "step_000002")
    base = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    reference = loaded.model_state if decay == 0.0 else base
    assert loaded.extra["ema"].keys() == base.keys()
    assert all(torch.equal(loaded.extra["ema"][k], reference[k]) for k in base)
    assert any(not torch.equal(loaded.model_state[k], base[k]) for k in base)


def test_eval_and_export_with_ema_use_the_checkpoints_ema_weights(tiny_model_dir, tmp_path, capsys):
    """At decay 1 the EMA stays at the base weights: --ema must give the base model's samples exactly."""
    from flowloop.cli import main

    run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", "actor.ema_decay=1.0"), log=lambda _: None)
    checkpoint = tmp_path / "shapes" / "checkpoints" / "step_000002"
    pictures = {}
    for name, extra in [("base", []), ("ema", ["--checkpoint", str(checkpoint), "--ema"]), ("live", ["--checkpoint", str(checkpoint)])]:
        out = tmp_path / name
        assert main(["generate", "a red circle", "--model", str(tiny_model_dir), *extra, "--num", "2", "--steps", "4",
                     "--upscale", "1", "--out", str(out)]) == 0
        pictures[name] = [f.read_bytes() for f in sorted(out.glob("*.png"))]
    assert len(pictures["base"]) == 2 and pictures["ema"] == pictures["base"] and pictures["live"] != pictures["base"]
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "exported"), "--ema"]) == 0
    exported = load_file(tmp_path / "exported" / "transformer" / "diffusion_pytorch_model.safetensors")
    base = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == base.keys() and all(torch.equal(exported[k], base[k]) for k in base)

    run(tiny_config(tiny_model_dir, tmp_path / "plain", "trainer.total_steps=1"), log=lambda _: None)
    plain = tmp_path / "plain" / "shapes" / "checkpoints" / "step_000001"
    capsys.readouterr()
    assert main(["eval", "--model", str(tiny_model_dir), "--checkpoint", str(plain), "--ema", "--steps", "2"]) == 2
    assert "keeps no EMA weights (its run had actor.ema_decay unset); leave out --ema" in capsys.readouterr().err
    assert main(["eval", "--ema", "--steps", "2"]) == 2
    assert "--ema reads a checkpoint's EMA weights: pass --checkpoint too" in capsys.readouterr().err
