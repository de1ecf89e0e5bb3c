"""`flowloop train` with a combined reward (shapes verifier + JPEG compressibility): both parts,
and the verifier's accuracy, reach metrics.jsonl as their own columns."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flowloop.cli import main
from flowloop.protocol import Batch
from flowloop.trainer.step_metrics import category_reward_means, reward_extra_means

TINY = [
    "rollout.pipeline.height=16", "rollout.pipeline.width=16", "rollout.pipeline.num_inference_steps=4",
    "rollout.val_kwargs.pipeline={num_inference_steps: 2}", "rollout.algo.sde_window_size=2", "rollout.algo.sde_window_range=[0,3]",
    "rollout.n=4", "data.prompts_per_step=2", "actor.micro_batch_size=4", "actor.mini_batch_size=8",
    "trainer.val_samples_per_category=1", "trainer.val_every=100", "trainer.save_every=100", "trainer.total_steps=2",
]


def test_a_combined_reward_trains_and_logs_each_part(tiny_model_dir, tmp_path, capsys):
    code = main(["train", f"model.path={tiny_model_dir}", f"trainer.run_root={tmp_path}", *TINY,
                 "rollout.reward.name=combined",
                 "rollout.reward.kwargs={components: {shapes: 1.0, jpeg_compressibility: 0.1}}"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "shapes" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in trained] == [1, 2]
    for row in trained:
        shapes_mean, jpeg_mean = row["reward/shapes"], row["reward/jpeg_compressibility"]
        assert 0.0 <= shapes_mean <= 1.0 and jpeg_mean < 0  # -kB / 500
        assert abs(row["reward/mean"] - (shapes_mean + 0.1 * jpeg_mean)) < 1e-5
        assert 0.0 <= row["reward/shapes/correct"] <= shapes_mean  # the verifier's accuracy, per part
        assert row["reward/jpeg_compressibility/jpeg_kb"] == pytest.approx(-500 * jpeg_mean)
        assert "reward/shapes/constraints" not in row and "reward/reward_error" not in row  # dicts, errors: not numbers


def test_reward_extra_means_logs_every_numeric_column_generically():
    batch = Batch.from_dict(non_tensors={
        "correct": [True, False, True, True], "jpeg_kb": [1.0, 2.0, None, np.float32(3.0)], "label": ["a", "b", "c", "d"],
        "reward/ocr": [0.5, 0.5, 1.0, 0.0], "reward_error": [None] * 4, "constraints": [{"x": True}] * 4, "uid": [1, 2, 3, 4],
    }, meta_info={"reward_extra_keys": ["correct", "jpeg_kb", "label", "reward/ocr", "reward_error", "constraints"]})
    assert reward_extra_means(batch) == {"reward/correct": 0.75, "reward/jpeg_kb": 2.0, "reward/ocr": 0.5}


def test_category_reward_means_split_the_reward_and_accuracy_by_category():
    batch = Batch.from_dict(non_tensors={"category": ["counting", "position", "counting", None],
                                         "correct": [True, False, False, True]})
    rewards = torch.tensor([1.0, 0.25, 0.5, 0.0])
    assert category_reward_means(batch, rewards) == {
        "reward/category/counting/mean": 0.75, "reward/category/counting/correct": 0.5,
        "reward/category/position/mean": 0.25, "reward/category/position/correct": 0.0,
    }
    assert category_reward_means(Batch.from_dict(non_tensors={"category": ["a", "b"]}), torch.tensor([0.5, 1.0])) == {
        "reward/category/a/mean": 0.5, "reward/category/b/mean": 1.0}
    assert category_reward_means(Batch.from_dict(non_tensors={"uid": [1]}), torch.tensor([1.0])) == {}
