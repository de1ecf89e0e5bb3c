"""The task interface: the shapes task's draws, validation rows and scoring, and a new task in one file."""

import numpy as np
import pytest

from flowloop.config import load_config
from flowloop.config.train import TrainConfig
from flowloop.tasks import Grid, ShapesTask, Task, build_task, register_task
from flowloop.tasks.shapes import CATEGORIES, render, sample_scene, split_prompts
from flowloop.tasks.shapes.task import GRID_COLUMNS, GRID_ROWS_PER_CATEGORY


def test_shapes_draws_depend_on_seed_and_step_alone():
    task = ShapesTask(prompt_sampling="category_balanced")
    first = task.train_rows(seed=0, step=3, count=60)
    assert first == task.train_rows(seed=0, step=3, count=60)
    assert first != task.train_rows(seed=0, step=4, count=60) != task.train_rows(seed=1, step=3, count=60)
    assert {row["category"] for row in first} == set(CATEGORIES)
    assert {row["raw_prompt"] for row in first} <= set(split_prompts("train"))


def test_shapes_validation_rows_cycle_heldout_prompts_in_blocks_of_seeds():
    rows = ShapesTask(val_per_category=9).val_rows()
    assert len(rows) == 9 * len(CATEGORIES)
    single = [r["raw_prompt"] for r in rows if r["category"] == "color_attr"]
    assert single[:GRID_COLUMNS] == [single[0]] * GRID_COLUMNS and single[GRID_COLUMNS] != single[0]
    assert set(single) <= set(split_prompts("heldout", "color_attr"))


def test_shapes_validation_prompts_are_spread_over_the_whole_category():
    pool = split_prompts("heldout", "position")
    chosen = [r["raw_prompt"] for r in ShapesTask(val_per_category=32).val_rows() if r["category"] == "position"][::GRID_COLUMNS]
    assert len(set(chosen)) == 8
    positions = sorted(pool.index(p) for p in chosen)
    assert positions[0] == 0 and positions[-1] >= len(pool) * 3 // 4  # not only the list's first relation
    assert {"left of" in p for p in chosen} == {True, False}
    everyone = [r["raw_prompt"] for r in ShapesTask(val_per_category=4 * (len(pool) + 2)).val_rows() if r["category"] == "position"]
    assert set(everyone) == set(pool)


def test_shapes_evaluate_scores_rendered_scenes_as_correct():
    task = ShapesTask(val_per_category=10)
    rng = np.random.default_rng(0)
    rows, images = [], []
    for category in CATEGORIES:
        for _ in range(10):
            scene = sample_scene(rng, split="heldout", category=category)
            rows.append({"raw_prompt": scene.prompt, "category": category})
            images.append(render(scene, size=32))
    metrics, grid = task.evaluate(np.stack(images), rows)
    assert metrics["val/accuracy"] > 0.9 and {f"val/{c}/accuracy" for c in CATEGORIES} < set(metrics)
    assert len(grid.images) == GRID_ROWS_PER_CATEGORY * len(CATEGORIES) and grid.per_row == GRID_COLUMNS


def test_shapes_settings_name_the_key():
    with pytest.raises(ValueError, match=r"data.val_split must be one of \['train', 'heldout'\]"):
        ShapesTask(val_split="test")
    with pytest.raises(ValueError, match="data.prompt_sampling must be one of"):
        ShapesTask(prompt_sampling="balanced")


@register_task("test_constant")
class ConstantTask:
    """A toy task: one prompt, validation reports the mean reward under its own key."""

    val_metric = "val/constant"

    def __init__(self, cfg):
        self.prompt = "a red circle"

    def train_rows(self, seed, step, count):
        return [{"raw_prompt": self.prompt}] * count

    def val_rows(self):
        return [{"raw_prompt": self.prompt}] * 2

    def evaluate(self, images, rows):
        return {"val/constant": float(np.mean([r["reward"] for r in rows]))}, Grid(images, [self.prompt] * len(images), 1)


def test_a_new_task_is_one_class_and_a_registration(tiny_model_dir, tmp_path):
    from flowloop.trainer.recipe import run
    from tests.trainer.test_recipe import metrics, tiny_config

    cfg = tiny_config(tiny_model_dir, tmp_path, "data.task=test_constant", "trainer.total_steps=1")
    assert isinstance(build_task(cfg), Task)
    summary = run(cfg, log=lambda _: None)
    rows = metrics(tmp_path / "shapes")
    assert summary["val_metric"] == "val/constant" and "val/constant" in rows[0] and "val/accuracy" not in rows[0]
    assert "reward/mean" in rows[-1] and (tmp_path / "shapes" / "grids" / "step_000001.png").is_file()
    with pytest.raises(ValueError, match=r"data.task must be one of \[.*'shapes'"):
        build_task(load_config(TrainConfig, ["data.task=nope"]))
