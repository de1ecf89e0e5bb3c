"""benchmarks/recipe_sweep.py builds each variant's `flowloop train` command line."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("recipe_sweep", Path(__file__).parents[1] / "benchmarks" / "recipe_sweep.py")
recipe_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe_sweep)


def test_a_variants_recipe_goes_before_the_shared_overrides():
    tokens = ["model.device=cuda", "model.path=runs/base", "--recipe", "shapes_flow_grpo", "trainer.seed=1", "--recipe=x"]
    assert recipe_sweep.options_first(tokens) == [
        "--recipe", "shapes_flow_grpo", "--recipe=x", "model.device=cuda", "model.path=runs/base", "trainer.seed=1"]


def test_a_flag_without_value_keeps_the_override_after_it():
    assert recipe_sweep.options_first(["--debug", "trainer.seed=0", "--recipe", "x"]) == ["--debug", "--recipe", "x", "trainer.seed=0"]


def test_the_reordered_line_parses_as_flowloop_train_would():
    from flowloop.cli import build_parser

    args = build_parser().parse_args(["train", *recipe_sweep.options_first(["trainer.seed=1", "--recipe", "shapes_flow_grpo"])])
    assert args.recipe == "shapes_flow_grpo"
    assert args.overrides == ["trainer.seed=1"]
