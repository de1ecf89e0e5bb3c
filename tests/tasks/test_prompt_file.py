"""The prompt-file task (real models' path): formats, errors, draws, validation by reward."""

import json

import pytest

from flowloop.tasks import PromptFileTask, build_task, load_prompt_file
from flowloop.trainer.recipe import RLRecipe, run
from tests.trainer.test_recipe import metrics, tiny_config


def test_txt_and_jsonl_rows(tmp_path):
    (tmp_path / "p.txt").write_text("# header\na red circle\n\n  two blue squares  \n")
    assert load_prompt_file(tmp_path / "p.txt") == [{"raw_prompt": "a red circle"}, {"raw_prompt": "two blue squares"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a sign that says \"hi\"", "tag": "ocr"}) + "\n")
    assert load_prompt_file(tmp_path / "p.jsonl") == [{"raw_prompt": "a sign that says \"hi\"", "tag": "ocr"}]


def test_bad_files_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.prompt_file=.*missing.txt: no such file"):
        load_prompt_file(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=r"suffix must be one of \['.txt', '.jsonl', '.parquet'\]"):
        load_prompt_file(tmp_path / "prompts.csv")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each line must be an object with a non-empty \"prompt\""):
        load_prompt_file(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "ok"\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not valid JSON"):
        load_prompt_file(tmp_path / "broken.jsonl")
    (tmp_path / "empty.txt").write_text("\n# nothing\n")
    with pytest.raises(ValueError, match=r"holds no prompts"):
        load_prompt_file(tmp_path / "empty.txt")


def test_config_errors(tiny_model_dir, tmp_path):
    (tmp_path / "p.txt").write_text("a red circle\n")
    with pytest.raises(ValueError, match=r"data.prompt_sampling='category_balanced' needs the shapes world"):
        RLRecipe(tiny_config(tiny_model_dir, tmp_path, f"data.prompt_file={tmp_path / 'p.txt'}",
                                   "data.prompt_sampling=category_balanced"))
    with pytest.raises(ValueError, match=r"data.val_prompt_file needs data.prompt_file"):
        RLRecipe(tiny_config(tiny_model_dir, tmp_path, f"data.val_prompt_file={tmp_path / 'p.txt'}"))


def test_batches_carry_file_fields_and_the_negative_prompt(tiny_model_dir, tmp_path):
    rows = [{"prompt": p, "tag": i} for i, p in enumerate(["a red circle", "two blue squares", "a green triangle"])]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = RLRecipe(tiny_config(tiny_model_dir, tmp_path, f"data.prompt_file={tmp_path / 'p.jsonl'}",
                                        "data.negative_prompt=blurry"))
    batch = recipe.make_batch(1)
    assert len(batch) == 2 * 4  # prompts_per_step x n
    tags = {r["prompt"]: r["tag"] for r in rows}
    assert [tags[p] for p in batch["raw_prompt"]] == list(batch["tag"])
    assert set(batch["negative_prompt"]) == {"blurry"}
    assert list(recipe.make_batch(1)["raw_prompt"]) == list(batch["raw_prompt"])  # seed and step decide


def test_train_from_a_prompt_file_validates_by_reward(tiny_model_dir, tmp_path):
    (tmp_path / "train.txt").write_text("a red circle\ntwo blue squares\na green triangle\n")
    (tmp_path / "val.txt").write_text("three circles\na blue square\n")
    summary = run(tiny_config(tiny_model_dir, tmp_path, "trainer.total_steps=2", f"data.prompt_file={tmp_path / 'train.txt'}",
                              f"data.val_prompt_file={tmp_path / 'val.txt'}", "rollout.pipeline.guidance_scale=2.0",
                              "data.negative_prompt=blue"), log=lambda _: None)
    rows = metrics(tmp_path / "shapes")
    assert summary["val_metric"] == "val/reward" and summary["before"] == rows[0]["val/reward"]
    assert summary["after"] == rows[-1]["val/reward"] != summary["before"]  # the weights moved
    assert "val/accuracy" not in rows[0] and (tmp_path / "shapes" / "grids" / "step_000002.png").is_file()
    assert all(r["rollout_correction/max"] <= 1e-6 for r in rows[1:])  # CFG with the negative prompt replays exactly


def test_validation_takes_the_first_train_prompts_under_its_own_key(tiny_model_dir, tmp_path):
    (tmp_path / "p.txt").write_text("".join(f"{c} circle\n" for c in ("a red", "a blue", "a green", "two red", "a pink")))
    cfg = tiny_config(tiny_model_dir, tmp_path, f"data.prompt_file={tmp_path / 'p.txt'}", "data.val_train_prompts=3",
                      "trainer.val_samples_per_category=1")
    task = build_task(cfg)
    assert isinstance(task, PromptFileTask) and task.val_metric == "val/reward"
    assert [r["raw_prompt"] for r in task.val_rows()] == ["a red circle", "a blue circle", "a green circle"]
    assert task.train_rows(0, 5, 4) == task.train_rows(0, 5, 4) != task.train_rows(0, 6, 4)


def test_evaluate_averages_the_reward_and_its_numeric_extras():
    import numpy as np

    rows = [{"raw_prompt": f"p{i}", "reward": r, "reward_extra": {"kb": kb, "note": "x"}}
            for i, (r, kb) in enumerate([(0.5, 1.0), (float("nan"), 3.0), (1.0, None)])]
    task = PromptFileTask(rows, rows)
    metrics, grid = task.evaluate(np.zeros((3, 8, 8, 3), dtype=np.uint8), rows)
    assert metrics == {"val/reward": 0.75, "val/reward/kb": 2.0}
    assert grid.images.shape == (3, 8, 8, 3) and grid.captions == ["p0", "p1", "p2"] and grid.per_row == 1
    with pytest.raises(ValueError, match="every row needs a 'reward'"):
        task.evaluate(np.zeros((1, 8, 8, 3), dtype=np.uint8), [{"raw_prompt": "p"}])
