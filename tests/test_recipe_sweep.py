"""benchmarks/recipe_sweep.py builds each variant's `flowloop train` command line."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_sweep_refuses_run_folders_an_earlier_sweep_left(tmp_path):
    (tmp_path / "sde_0").mkdir()
    recipe_sweep.check_fresh(tmp_path, ["sde_1", "sde_2"])  # new names pass
    with pytest.raises(ValueError, match=r"already holds runs named \['sde_0'\].*pass a new --out, or remove .*sde_0"):
        recipe_sweep.check_fresh(tmp_path, ["sde_0", "sde_1"])
    with pytest.raises(ValueError, match=r"--variant names \['a'\] more than once"):
        recipe_sweep.check_fresh(tmp_path, ["a", "b", "a"])


def test_the_command_line_names_the_stale_folder(tmp_path):
    (tmp_path / "v").mkdir()
    result = subprocess.run([sys.executable, str(Path(recipe_sweep.__file__)), "--out", str(tmp_path), "--variant", "v: trainer.seed=0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "already holds runs named ['v']" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]  # nothing started, nothing written
