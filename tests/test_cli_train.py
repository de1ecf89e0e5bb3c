"""`flowloop train`'s config flags: --recipe NAME picks a shipped recipe, --config adds the user's
file, --print-config shows the merged result without training."""

from __future__ import annotations

import yaml

from flowloop.cli import main
from flowloop.config import recipe_names


def test_recipes_are_the_shipped_yamls():
    assert {"shapes", "shapes_flow_grpo", "sd3", "flux", "qwen_image", "wan"} <= set(recipe_names())


def test_print_config_merges_recipe_then_config_then_overrides(tmp_path, capsys):
    mine = tmp_path / "mine.yaml"
    mine.write_text("rollout:\n  n: 4\ntrainer:\n  total_steps: 7\n")
    assert main(["train", "--recipe", "flux", "--config", str(mine), "--print-config", "trainer.total_steps=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["pipeline"]["shift"] == "auto"  # from the flux recipe
    assert printed["rollout"]["n"] == 4 and printed["trainer"]["total_steps"] == 9


def test_default_recipe_and_an_unknown_one(capsys):
    assert main(["train", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["pipeline"]["height"] == 32  # shapes
    assert main(["train", "--recipe", "sdxl", "--print-config"]) == 2
    assert "unknown recipe 'sdxl'; known recipes: flux, qwen_image, sd3, shapes" in capsys.readouterr().err
