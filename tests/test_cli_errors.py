"""One error path in the CLI: bad input or a failed service is one line, exit code 2, no traceback
(``--debug`` raises instead), and no result is lost or half-written."""

import json
import shutil

import pytest
import torch

from flowloop.cli import main
from flowloop.reward.registry import register_reward


@register_reward("test_cli_raises")
def raises(images, prompts, metadata):
    raise RuntimeError("scorer exploded")


@register_reward("test_cli_strings")
def strings(images, prompts, metadata):
    return ["high"] * len(prompts), [{} for _ in prompts]


TINY_TRAIN = ["rollout.pipeline.height=16", "rollout.pipeline.width=16", "rollout.pipeline.num_inference_steps=4",
              "rollout.val_kwargs.pipeline={num_inference_steps: 4}", "rollout.n=2", "data.prompts_per_step=2",
              "actor.micro_batch_size=4", "actor.mini_batch_size=4", "trainer.val_samples_per_category=1",
              "trainer.total_steps=2", "rollout.algo.sde_window_size=2",
              "rollout.algo.sde_window_range=[0,3]"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0][lines[0].index("flowloop "):]


def test_malformed_yaml_names_the_file_and_line_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: [1e-3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert f"config file {bad} is not valid YAML" in one_line_error(capsys)
    with pytest.raises(ValueError):
        main(["train", "--config", str(bad), "--debug"])


def test_a_truncated_model_file_names_the_model(tiny_model_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["generate", "a red circle", "--out", str(tmp_path / "out"), "--model", str(broken)]) == 2
    assert f"--model {broken}: a weights file cannot be read" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("reward,message", [("test_cli_raises", "scorer exploded"), ("test_cli_strings", "non-numeric score 'high'")])
def test_a_failing_reward_in_training_is_one_line(tiny_model_dir, tmp_path, capsys, reward, message):
    code = main(["train", "--recipe", "shapes_flow_grpo", *TINY_TRAIN, f"model.path={tiny_model_dir}", f"trainer.run_root={tmp_path / 'runs'}",
                 f"rollout.reward.name={reward}"])
    assert code == 2
    line = one_line_error(capsys)
    assert message in line and "rollout.reward.failure_policy" in line


@pytest.mark.parametrize("reward", ["test_cli_raises", "test_cli_strings"])
def test_a_failing_reward_in_eval_is_one_line(tiny_model_dir, tmp_path, capsys, reward):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    assert main(["eval", "--prompts", str(prompts), "--reward", reward, "--model", str(tiny_model_dir),
                 "--samples-per-prompt", "1", "--steps", "2"]) == 2
    assert f"--reward {reward} failed" in one_line_error(capsys)


def test_output_paths_are_checked_before_any_work(tiny_model_dir, tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert main(["generate", "a red circle", "--out", str(a_file), "--model", str(tiny_model_dir)]) == 2
    assert f"--out {a_file} is a file" in one_line_error(capsys)
    assert main(["eval", "--json", str(tmp_path), "--model", str(tiny_model_dir), "--steps", "2"]) == 2
    assert f"--json {tmp_path} is a folder" in one_line_error(capsys)
    assert main(["export", str(tmp_path), "--out", str(a_file)]) == 2
    assert f"--out {a_file} is a file" in one_line_error(capsys)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder" in one_line_error(capsys)


def test_empty_prompt_zero_resolution_and_a_huge_prompt(tiny_model_dir, tmp_path, capsys):
    assert main(["generate", "  ", "--out", str(tmp_path / "g"), "--model", str(tiny_model_dir)]) == 2
    assert "the prompt is empty" in one_line_error(capsys)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "a red circle", "--out", str(tmp_path / "g"), "--resolution", "0"])
    assert exit_.value.code == 2 and "--resolution: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "a red circle", "--out", str(tmp_path / "g"), "--guidance-scale", "nan"])
    assert "--guidance-scale: must be a finite number, got nan" in capsys.readouterr().err
    huge = " ".join(["circle"] * 10_000)
    assert main(["generate", huge, "--out", str(tmp_path / "g"), "--model", str(tiny_model_dir)]) == 2
    line = one_line_error(capsys)
    assert len(line) < 800 and "chars)" in line
    assert not (tmp_path / "g").exists()


def test_one_sample_per_group_is_refused(capsys):
    assert main(["train", "--recipe", "shapes_flow_grpo", "rollout.n=1"]) == 2
    assert "rollout.n=1 with advantage.estimator=grpo: each group holds one sample" in one_line_error(capsys)


def test_plot_skips_a_torn_last_line_and_names_a_broken_one(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": 0.1 * s, "reward/correct": 0.1 * s} for s in range(1, 4)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 4, "rew')
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curve.png").is_file()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rew\n' + text)
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl line 1 is not JSON" in one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_sampling_on_cuda_without_a_gpu_names_the_flag(tiny_model_dir, tmp_path, capsys):
    assert main(["eval", "--device", "cuda", "--model", str(tiny_model_dir), "--json", str(tmp_path / "e.json")]) == 2
    assert "--device cuda: this machine has no CUDA device; use --device cpu" in one_line_error(capsys)
    assert not (tmp_path / "e.json").exists()
